"""A cached grammar asked for more than --grammar_timeout after its compile started."""
import json, time, urllib.request, urllib.error, uuid
def post(body):
    req = urllib.request.Request("http://127.0.0.1:8011/v1/chat/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    t = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, time.perf_counter() - t, json.loads(r.read())["choices"][0]["message"]["content"]
    except urllib.error.HTTPError as e:
        return e.code, time.perf_counter() - t, e.read().decode()
name = "k" + uuid.uuid4().hex[:8]
body = {"model": "smollm2", "max_tokens": 40, "messages": [{"role": "user", "content": "Give a key."}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {name: {"type": "string"}}, "required": [name]}}}}
print("first (compiles):", post(body))
print("again at once:  ", post(body))
time.sleep(11)
print("again after 11 s:", post(body))
