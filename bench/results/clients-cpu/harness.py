"""Shared bits of the client drivers: record one call's outcome, its HTTP status and error text,
and the server log lines written while it ran (errors, tracebacks, non-2xx access lines)."""
import json
import os
import re
import sys
import time
import traceback

from pydantic import BaseModel, Field

BASE = os.environ.get("CADENCE_BASE", "http://127.0.0.1:8011")
LOG = os.environ.get("CADENCE_LOG", "/tmp/serve.log")
OUT = os.environ.get("CLIENTS_OUT", "/tmp/clients-results.jsonl")
MODEL = "smollm2"

INTERESTING = re.compile(r"Traceback|Error|error|Exception|exception|WARNING|^E\d{4}|^W\d{4}|"
                         r"\" [45]\d\d|status[=: ]+[45]\d\d", re.M)


class Address(BaseModel):
    street: str
    city: str


class Person(BaseModel):
    """A person and where they live."""
    name: str
    age: int = Field(description="age in years")
    address: Address


def _log_size():
    try:
        return os.path.getsize(LOG)
    except OSError:
        return 0


def _log_slice(start):
    with open(LOG, "rb") as f:
        f.seek(start)
        text = f.read().decode("utf-8", "replace")
    # keep lines that look like trouble; progress bars and info lines are dropped
    lines = [l for l in text.splitlines() if INTERESTING.search(l)]
    return lines[-40:]


def _status(e):
    for attr in ("status_code", "status", "code"):
        v = getattr(e, attr, None)
        if isinstance(v, int):
            return v
    resp = getattr(e, "response", None)
    if resp is not None and isinstance(getattr(resp, "status_code", None), int):
        return resp.status_code
    return None


def call(client, name, fn, check=None):
    """Run fn(); ok if it returns and check(result) (if given) is truthy or returns None."""
    start = _log_size()
    t0 = time.perf_counter()
    rec = {"client": client, "call": name}
    try:
        result = fn()
        rec["seconds"] = round(time.perf_counter() - t0, 3)
        note = check(result) if check else None
        rec["outcome"] = "ok"
        rec["result"] = _short(result if note is None else note)
    except Exception as e:  # noqa: BLE001 - the point is to record anything
        rec["seconds"] = round(time.perf_counter() - t0, 3)
        rec["outcome"] = "failed"
        rec["status"] = _status(e)
        rec["error"] = f"{type(e).__name__}: {e}"[:3000]
        rec["traceback"] = traceback.format_exc()[-3000:]
    time.sleep(0.3)
    rec["server_log"] = _log_slice(start)
    with open(OUT, "a") as f:
        f.write(json.dumps(rec) + "\n")
    mark = "OK " if rec["outcome"] == "ok" else "FAIL"
    print(f"[{mark}] {client:16s} {name:45s} {rec['seconds']:7.2f}s "
          f"{rec.get('status') or ''} {rec.get('error', rec.get('result', ''))[:300]}", flush=True)
    for l in rec["server_log"]:
        print("      server:", l[:300], flush=True)
    return rec


def _short(x):
    try:
        if hasattr(x, "model_dump_json"):
            s = x.model_dump_json()
        elif isinstance(x, (dict, list)):
            s = json.dumps(x, default=str)
        else:
            s = str(x)
    except Exception:  # noqa: BLE001
        s = repr(x)
    return s[:600]


def section(name):
    print(f"\n=== {name} ===", flush=True)
    sys.stdout.flush()
