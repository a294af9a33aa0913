"""Fill in the middle: the prompt layout (`checkpoints.fim`), completions' `suffix`, /infill
(llama-server's), and which stop string ended an answer (vLLM's `stop_reason`)."""

from __future__ import annotations

import json

import httpx
import pytest

from cadence.checkpoints import fim
from cadence.server.llama_api import EditorStops, Options
from cadence.checkpoints.tokenizer import Tokenizer
from cadence.engine.reference import greedy_generate
from tests.conftest import fim_tokenizer_of, serve_tiny

@pytest.fixture(scope="module")
def tok(fim_tokenizer):
    return fim_tokenizer


@pytest.fixture(scope="module")
def url(tiny_engine, tok):
    with serve_tiny(tiny_engine, tok) as base:
        yield base


def text(tok: Tokenizer, s: str) -> list[int]:
    return tok.encode(s, add_bos=False, special=False)


# -- the layout ------------------------------------------------------------------------------


def test_the_tokens_are_found_by_their_texts(tok, tiny_tokenizer, tiny_config):
    v = tok.vocab_size
    assert fim.FimTokens.of(tok) == fim.FimTokens(v - 1, v - 2, v - 3, v - 4, v - 5)
    assert fim.FimTokens.of(tiny_tokenizer) is None
    assert "no FIM prefix/suffix/middle token" in fim.missing_message(tiny_tokenizer)
    # CodeLlama's spelling, without the repository tokens; one missing role is named alone.
    llama = fim_tokenizer_of(tiny_config, {"<PRE>": -1, "<SUF>": -2, "<MID>": -3})
    assert fim.FimTokens.of(llama) == fim.FimTokens(v - 1, v - 2, v - 3)
    no_middle = fim_tokenizer_of(tiny_config, {"<PRE>": -1, "<SUF>": -2})
    assert fim.FimTokens.of(no_middle) is None
    assert "no FIM middle token" in fim.missing_message(no_middle)


def test_a_suffix_alone_is_prefix_suffix_middle(tok):
    f = fim.FimTokens.of(tok)
    ids = fim.infill_ids(tok, f, "def add(a, b):\n    ", fim.Hole("\nprint(add(1, 2))\n"))
    assert ids == [f.prefix, *text(tok, "def add(a, b):\n    "), f.suffix,
                   *text(tok, "\nprint(add(1, 2))\n"), f.middle]
    # A prompt given as ids goes in as it is.
    assert fim.infill_ids(tok, f, [7, 8, 9], fim.Hole("x")) == [f.prefix, 7, 8, 9, f.suffix,
                                                                *text(tok, "x"), f.middle]


def test_the_repository_layout_is_llama_servers(tok, tiny_config):
    f = fim.FimTokens.of(tok)
    hole = fim.Hole("tail", prompt="mid", extra=(fim.ExtraFile("one = 1\n", "a.py"),
                                                 fim.ExtraFile("two = 2\n")))
    assert fim.infill_ids(tok, f, "head", hole) == [
        f.repo, *text(tok, "myproject\n"),
        f.file_sep, *text(tok, "a.py\n"), *text(tok, "one = 1\n"),
        f.file_sep, *text(tok, "tmp\n"), *text(tok, "two = 2\n"),
        f.file_sep, *text(tok, "filename\n"),
        f.prefix, *text(tok, "head"), *tok.encode("mid", add_bos=False), f.suffix,
        *text(tok, "tail"), f.middle]
    # Without FIM_SEP and FIM_REP (CodeLlama), files are parted by llama.cpp's snippet rule, and
    # a tokenizer's BOS comes after them, before the prefix, where llama-server puts it.
    bare = fim_tokenizer_of(tiny_config, {"<PRE>": -1, "<SUF>": -2, "<MID>": -3}, add_bos_token=True)
    g = fim.FimTokens.of(bare)
    assert bare.add_bos and bare.bos_id is not None
    assert fim.infill_ids(bare, g, "h", fim.Hole("t", extra=(fim.ExtraFile("x\n"),))) == [
        *text(bare, "\n\n--- snippet ---\n\n"), *text(bare, "x\n"), bare.bos_id, g.prefix,
        *text(bare, "h"), g.suffix, *text(bare, "t"), g.middle]
    assert fim.infill_ids(bare, g, "h", fim.Hole("t"))[:2] == [bare.bos_id, g.prefix]


def test_control_tokens_in_the_document_are_text_and_in_the_prompt_are_tokens(tok):
    f = fim.FimTokens.of(tok)
    code = 'marker = "<|fim_middle|>"'
    ids = fim.infill_ids(tok, f, code, fim.Hole(code, prompt="<|fim_middle|>"))
    assert ids.count(f.middle) == 2  # the prompt's, and the layout's last; not the code's
    assert ids[-1] == f.middle and tok.decode(ids[1:ids.index(f.middle)]) == code
    assert tok.encode(code, special=False) != tok.encode(code)
    assert tok.decode(tok.encode(code, special=False)) == code


def test_special_false_on_sentencepiece(spm):
    code = "x = '</s>' + '<s>'"
    plain = spm.encode(code, add_bos=False, special=False)
    assert spm.bos_id not in plain and not spm.eos_ids & set(plain)
    assert spm.decode(plain) == code
    assert spm.bos_id in spm.encode(code, add_bos=False)


# -- through the server ---------------------------------------------------------------------


def reference(tiny_params, tiny_config, ids: list[int], n: int, tok: Tokenizer) -> str:
    out = greedy_generate(tiny_params, tiny_config, ids, n, tok.eos_ids)
    return tok.decode(out, skip_special=True)


def test_suffix_completes_the_middle_as_the_reference_does(url, tok, tiny_params, tiny_config):
    f = fim.FimTokens.of(tok)
    ids = fim.infill_ids(tok, f, "def add(a, b):\n", fim.Hole("\n\nprint(add(1, 2))\n"))
    want = reference(tiny_params, tiny_config, ids, 12, tok)
    body = {"prompt": "def add(a, b):\n", "suffix": "\n\nprint(add(1, 2))\n", "max_tokens": 12,
            "temperature": 0}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
    assert r["choices"][0]["text"] == want
    assert r["usage"]["prompt_tokens"] == len(ids)
    # An empty suffix is a plain completion, as it always was.
    plain = httpx.post(f"{url}/v1/completions", json={**body, "suffix": ""}, timeout=60).json()
    assert plain["choices"][0]["text"] == reference(
        tiny_params, tiny_config, tok.encode("def add(a, b):\n"), 12, tok)
    echo = httpx.post(f"{url}/v1/completions", json={**body, "echo": True}, timeout=60)
    assert echo.status_code == 400 and "suffix" in echo.json()["error"]["message"]


def test_infill_answers_in_llama_servers_shape(url, tok, tiny_params, tiny_config):
    f = fim.FimTokens.of(tok)
    extra = [{"filename": "util.py", "text": "def one():\n    return 1\n"}]
    hole = fim.Hole("\nprint(x)\n", prompt="x =", extra=(fim.ExtraFile(**extra[0]),))
    ids = fim.infill_ids(tok, f, "import util\n", hole)
    want = reference(tiny_params, tiny_config, ids, 10, tok)
    body = {"input_prefix": "import util\n", "input_suffix": "\nprint(x)\n", "prompt": "x =",
            "input_extra": extra, "n_predict": 10, "temperature": 0, "return_tokens": True,
            "cache_prompt": True}
    r = httpx.post(f"{url}/infill", json=body, timeout=60).json()
    assert r["content"] == want and r["stop"] is True and r["truncated"] is False
    assert r["tokens_evaluated"] == len(ids) and r["tokens_predicted"] == len(r["tokens"])
    assert tok.decode(r["tokens"], skip_special=True) == want
    assert r["stop_type"] == ("limit" if len(r["tokens"]) == 10 else "eos")
    assert r["timings"]["prompt_n"] + r["timings"]["cache_n"] == len(ids)
    assert r["timings"]["predicted_n"] == len(r["tokens"])

    # Streamed: a chunk per token, then the totals; the chunks spell the same answer.
    with httpx.stream("POST", f"{url}/infill", json={**body, "stream": True}, timeout=60) as s:
        chunks = [json.loads(line[len("data: "):]) for line in s.iter_lines() if line]
    *steps, last = chunks
    assert all(c["stop"] is False for c in steps) and last["stop"] is True
    assert "".join(c["content"] for c in steps) == want
    assert [t for c in steps for t in c["tokens"]] == r["tokens"]
    assert last["content"] == "" and last["tokens_predicted"] == len(r["tokens"])
    # The second time, the prompt came from the prefix cache.
    assert last["timings"]["cache_n"] > 0


def test_a_stop_string_is_named(url, tok, tiny_params, tiny_config):
    ids = tok.encode("The capital of France is")
    full = reference(tiny_params, tiny_config, ids, 16, tok)
    word = full[4:7]
    assert word.strip()
    body = {"prompt": "The capital of France is", "max_tokens": 16, "temperature": 0,
            "stop": ["never written here", word]}
    choice = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]
    assert choice["text"] == full[:full.index(word)] and choice["stop_reason"] == word
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60) as s:
        last = [json.loads(l[6:]) for l in s.iter_lines() if l and l != "data: [DONE]"][-1]
    assert last["choices"][0]["stop_reason"] == word
    # Cut off: no stop string.
    cut = httpx.post(f"{url}/v1/completions", json={**body, "stop": None, "max_tokens": 3},
                     timeout=60).json()["choices"][0]
    assert cut["finish_reason"] == "length" and cut["stop_reason"] is None


@pytest.mark.parametrize("body, param, fragment", [
    ({"input_suffix": ""}, "input_prefix", "is required"),
    ({"input_prefix": ""}, "input_suffix", "is required"),
    ({"input_prefix": "", "input_suffix": "", "samplers": ["top_k", "beam"]}, "samplers", "array of names"),
    ({"input_prefix": "", "input_suffix": "", "mirostat": 3}, "mirostat", "0 (off), 1 or 2"),
    ({"input_prefix": "", "input_suffix": "", "mirostat_v3": 2}, "mirostat_v3", "unrecognized"),
    ({"input_prefix": "", "input_suffix": "", "repeat_penalty": 2.5}, "repeat_penalty", "repeat_penalty must be in"),
    ({"input_prefix": "", "input_suffix": "", "repeat_last_n": -3}, "repeat_last_n", "-1 (the whole context)"),
    ({"input_prefix": "", "input_suffix": "", "n_indent": -1}, "n_indent", ">= 0"),
    ({"input_prefix": "", "input_suffix": "", "response_fields": "content"}, "response_fields", "must be an array"),
    ({"input_prefix": "", "input_suffix": "", "input_extra": [{"file": "a"}]}, "input_extra", "array of"),
    ({"input_prefix": "", "input_suffix": "", "n_predict": -2}, "n_predict", "-1"),
    ({"input_prefix": 3, "input_suffix": ""}, "input_prefix", "must be a string"),
])
def test_bad_infill_requests_are_400(url, body, param, fragment):
    r = httpx.post(f"{url}/infill", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and fragment in r.json()["error"]["message"]


def test_a_model_without_infill_tokens_says_so(tiny_engine, tiny_tokenizer):
    with serve_tiny(tiny_engine, tiny_tokenizer) as base:
        r = httpx.post(f"{base}/infill", json={"input_prefix": "a", "input_suffix": "b"}, timeout=60)
        assert r.status_code == 400 and "cannot fill in the middle" in r.json()["error"]["message"]
        assert r.json()["error"]["param"] == "input_prefix"
        ok = httpx.post(f"{base}/v1/completions", json={"prompt": "a", "max_tokens": 2}, timeout=60)
        assert ok.status_code == 200


# -- what editors send ---------------------------------------------------------------------


def fed(stops: EditorStops, pieces: list[tuple[str, float]]) -> tuple[str, int]:
    """The text `stops` keeps of `pieces` (text, time), and how many it read before it ended."""
    kept = []
    for k, (text, now) in enumerate(pieces):
        kept.append(stops.feed(text, now))
        if stops.done:
            return "".join(kept), k + 1
    return "".join(kept) + stops.finish(), len(pieces)


def test_a_line_indented_less_than_n_indent_ends_the_answer():
    four = Options(n_indent=4)
    # The first line is never judged; the block's lines are; the line that leaves it is cut
    # before its text (its indentation kept, as llama-server keeps it).
    assert fed(EditorStops(four), [("x", 0), (" = 1\n", 0), ("    y = 2", 0), ("\n  z", 0), ("ok", 0)]) \
        == ("x = 1\n    y = 2\n  ", 4)
    # Indentation split across tokens is held until the line's first character.
    assert fed(EditorStops(four), [("a\n  ", 0), ("  ", 0), ("b", 0)]) == ("a\n    b", 3)
    assert fed(EditorStops(four), [("a\n  ", 0), ("\tb", 0)]) == ("a\n  \t", 2)
    # A blank line is a line at indentation 0; a last line's indentation is given back.
    assert fed(EditorStops(four), [("a\n\nb", 0)]) == ("a\n", 1)
    assert fed(EditorStops(four), [("a\n   ", 0)]) == ("a\n   ", 1)
    assert fed(EditorStops(Options()), [("a\n\nb", 0)]) == ("a\n\nb", 1)


def test_a_newline_after_t_max_predict_ms_ends_the_answer():
    stops = EditorStops(Options(t_max_predict_ms=1000))
    assert fed(stops, [("a", 10.0), ("b\n", 10.5), ("c", 11.2), ("d\ne", 11.3), ("f", 11.4)]) \
        == ("ab\ncd\ne", 4)
    # The text that ends it is all kept, an indentation held for n_indent too.
    both = EditorStops(Options(n_indent=4, t_max_predict_ms=1000))
    assert fed(both, [("a", 10.0), ("b\n    ", 12.0), ("c", 12.1)]) == ("ab\n    ", 2)


def test_editors_requests_are_served(url, tok):
    newline = tok.encode("\n", add_bos=False)
    assert len(newline) == 1
    body = {"input_prefix": "def f():\n    ", "input_suffix": "\n", "temperature": 0,
            "samplers": ["top_k", "top_p", "infill"], "cache_prompt": True, "t_max_prompt_ms": 500,
            "id_slot": 0}
    # Forced to write newlines, with n_indent 1: the blank second line ends it, and the
    # request is cancelled there rather than running to n_predict.
    answer = httpx.post(f"{url}/infill", json={**body, "n_predict": 50, "n_indent": 1, "return_tokens": True,
                                               "logit_bias": {str(newline[0]): 100}}, timeout=60)
    r = answer.json()
    assert r["content"] == "\n" and r["stop_type"] == "limit"
    assert r["tokens"] == newline * 2 and r["tokens_predicted"] == 2
    # The scheduler's record of it: cancelled there, well short of its 50 tokens.
    name = answer.headers["X-Request-Id"]
    timeline = httpx.get(f"{url}/debug/timeline", timeout=60).json()["requests"]
    record = next(t for t in timeline if t["request_id"] == name)
    assert record["finish_reason"] == "abort" and record["output_tokens"] < 50
    with httpx.stream("POST", f"{url}/infill", json={**body, "n_predict": 50, "n_indent": 1, "stream": True,
                                                    "logit_bias": {str(newline[0]): 100}}, timeout=60) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines() if line]
    assert "".join(c["content"] for c in chunks) == "\n" and chunks[-1]["stop_type"] == "limit"
    # n_predict 0 computes the prompt only; the next request finds it in the prefix cache.
    warm = {**body, "input_prefix": "class Warm:\n    def go(self):\n        ", "input_suffix": ""}
    r = httpx.post(f"{url}/infill", json={**warm, "n_predict": 0}, timeout=60).json()
    assert r["content"] == "" and r["tokens_predicted"] == 0 and r["stop_type"] == "limit"
    cold = r["timings"]["cache_n"]  # (the repository's preamble, which every request shares)
    assert r["timings"]["prompt_n"] > 0
    r = httpx.post(f"{url}/infill", json={**warm, "n_predict": 2, "response_fields": [
        "content", "timings/cache_n", "timings/nothing", "truncated"]}, timeout=60).json()
    assert set(r) == {"content", "timings/cache_n", "truncated"} and r["timings/cache_n"] > cold
