"""Structured output in the scheduler: grammars compiled with llguidance over a real tokenizer,
requests constrained by them on the fake engine (which samples among the tokens each bitmask
allows), beside unconstrained requests that must not notice."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import threading
import time

import jsonschema
import llguidance
import numpy as np
import pytest

from cadence.model.host_sampling import RequestSampling, bitmask_words
from cadence.scheduler.errors import SubmissionError
from cadence.scheduler.grammar import GrammarCompiler, GrammarError, JsonObject, JsonSchema, Lark, Regex
from tests.fakes import TOK, FakeEngine, Harness, chunked, expected, random_prompt

SCHEMA = {
    "type": "object",
    "properties": {
        "kind": {"enum": ["cat", "dog", "axolotl"]},
        "n": {"type": "integer", "minimum": -5, "maximum": 120},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "minItems": 1, "maxItems": 3},
        "inner": {"type": "object", "properties": {"x": {"type": "number", "minimum": 0, "maximum": 1}},
                  "required": ["x"], "additionalProperties": False},
    },
    "required": ["kind", "n", "ok", "tags", "inner"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def compiler():
    return GrammarCompiler(TOK, TOK.vocab_size)


def test_schemas_compile_once_whatever_their_key_order(compiler):
    first = compiler.compile(JsonSchema(SCHEMA))
    reordered = json.loads(json.dumps(SCHEMA, sort_keys=True))
    assert list(reordered) != list(SCHEMA)
    before = compiler.compiled
    assert compiler.compile(JsonSchema(reordered)) is first and compiler.compiled == before
    assert first.compile_seconds > 0 and first.vocab_size == TOK.vocab_size


@pytest.mark.parametrize("spec, problem", [
    (JsonSchema({"type": "object", "properties": {"a": {"type": "string", "pattern": "(["}}}), "unclosed"),
    (JsonSchema({"type": "colour"}), "colour"),
    (JsonSchema({"$ref": "#/definitions/missing"}), "missing"),
    (JsonSchema({"type": "string", "minLength": 5, "maxLength": 2}), "Unsatisfiable schema: minLength"),
    (Regex("a(b"), "unclosed"),
    (Lark("start: nowhere"), "nowhere"),
])
def test_a_grammar_that_cannot_compile_is_refused_by_name(compiler, spec, problem):
    with pytest.raises(GrammarError, match=re.escape(problem)) as caught:
        compiler.compile(spec)
    assert "\n<state>" not in str(caught.value) and "<grammar>" not in str(caught.value)


def test_a_cached_grammar_is_served_long_after_its_compile():
    """The time limit is the compile's, not the cache entry's age: a grammar asked for again
    after more than `timeout` seconds comes from the cache, awaited or not."""
    quick = GrammarCompiler(TOK, TOK.vocab_size, timeout=0.5)
    first = quick.compile(Regex("[ab]+"))
    time.sleep(0.6)
    assert asyncio.run(quick.compile_async(Regex("[ab]+"))) is first
    assert quick.compile(Regex("[ab]+")) is first
    quick.close()


def test_a_slow_compile_is_refused_and_nothing_waits_for_it():
    impatient = GrammarCompiler(TOK, TOK.vocab_size, timeout=1e-6)
    with pytest.raises(GrammarError, match="longer than"):
        impatient.compile(JsonSchema(SCHEMA))
    impatient.close()


def test_closing_the_compiler_answers_everyone_still_waiting():
    """A compile under way and one queued behind it (one worker): closed, both waiters hear
    GrammarError at once, threads and loops alike, and the compile that was running finishes
    to no one without an error of its own."""
    closing = GrammarCompiler(TOK, TOK.vocab_size, workers=1)
    closing._view_lock.acquire()  # the first compile stops before it starts: deterministic
    running = threading.Thread(target=lambda: outcomes.append(_outcome(closing, Regex("[ab]+"))))
    outcomes: list[str] = []
    running.start()
    queued = asyncio.new_event_loop()
    waiter = queued.create_task(closing.compile_async(Regex("[cd]+")))
    queued.run_until_complete(asyncio.sleep(0.05))
    closing.close()
    with pytest.raises(GrammarError, match="shutting down"):
        queued.run_until_complete(asyncio.wait_for(waiter, 5))
    queued.close()
    closing._view_lock.release()  # the running compile goes on, and its result goes nowhere
    running.join(5)
    assert outcomes == ["GrammarError: the server is shutting down; the grammar was not compiled"]
    assert closing._pending == 0


def _outcome(compiler: GrammarCompiler, spec) -> str:
    try:
        return f"compiled {compiler.compile(spec)}"
    except GrammarError as e:
        return f"GrammarError: {e}"


def run_constrained(h: Harness, grammar, n: int, rng_seed: int = 0, **params):
    rng = np.random.default_rng(rng_seed)
    return [h.submit(random_prompt(rng, int(rng.integers(3, 90))), grammar=grammar, max_tokens=160,
                     **params) for _ in range(n)]


def test_constrained_requests_follow_their_grammars_beside_free_ones(compiler):
    """JSON schemas, JSON objects and regexes, greedy and sampled, among requests with no
    grammar: every constrained output parses and validates and ends where its grammar does
    ("stop"); every free one is exactly what it is alone; the split steps ran."""
    engine = FakeEngine(num_slots=6, page_size=16)
    h = Harness(engine, chunked(budget=128, chunk=64))
    rng = np.random.default_rng(1)
    schema = compiler.compile(JsonSchema(SCHEMA))
    regex = compiler.compile(Regex(r"[ab]{3,6}x(yz)?"))
    anything = compiler.compile(JsonObject())
    sampled = dict(sampling=RequestSampling(temperature=0.8, seed=4))
    cases = []
    for i in range(12):
        grammar = [schema, regex, None, None][i % 4]
        extra = sampled if i % 3 == 0 else {}
        prompt = random_prompt(rng, int(rng.integers(3, 120)))
        cases.append((h.submit(prompt, grammar=grammar, max_tokens=300 if grammar else 25, **extra), grammar))
    h.submit(random_prompt(rng, 40), grammar=anything, max_tokens=300)
    h.run()
    assert engine.split_steps > 0
    for client, grammar in cases:
        text = client.record.text
        if grammar is schema:
            assert client.record.finish_reason == "stop", text
            jsonschema.validate(json.loads(text), SCHEMA)
        elif grammar is regex:
            assert client.record.finish_reason == "stop" and re.fullmatch(r"[ab]{3,6}x(yz)?", text), text
        else:
            want, reason = expected(engine, client.prompt, 25, sampling=client.params.sampling)
            assert client.token_ids == want and client.record.finish_reason == reason
    last = h.clients[-1]
    assert isinstance(json.loads(last.record.text), dict)


def test_constrained_requests_decode_one_step_at_a_time(compiler):
    """Several decode steps per dispatch skip requests the host must mask step by step."""
    engine = FakeEngine(num_slots=4, decode_steps=4)
    h = Harness(engine, chunked())
    free = h.submit([5, 6, 7], max_tokens=20)
    h.run()
    assert max(call.steps for calls in h.steps for call in calls if hasattr(call, "steps")) == 4
    first = len(h.steps)
    again = h.submit([5, 6, 7], max_tokens=20)
    constrained = h.submit([8, 9], grammar=compiler.compile(Regex("q{30}")), max_tokens=40)
    h.run()
    beside = [call for calls in h.steps[first:] for call in calls
              if hasattr(call, "steps") and constrained.slot in call.slots]
    # 29 decode steps after the prefill's q, and one more whose forward ran before the 30th q
    # was seen to complete the grammar (its sampling dropped the row).
    assert len(beside) == 30 and all(call.steps == 1 for call in beside)
    assert constrained.record.text == "q" * 30 and again.token_ids == free.token_ids


def test_grammars_survive_preemption_forks_and_disaggregation(compiler):
    """The grammar's state is the request's own: recomputed after a preemption, one per choice
    of n > 1, carried from the prefill pool to the decode pool."""
    schema = compiler.compile(JsonSchema(SCHEMA))
    # A pool too small for everyone: requests are preempted and recomputed mid-answer.
    engine = FakeEngine(num_slots=4, page_size=16, max_seq_len=256, num_pages=20)
    h = Harness(engine, chunked(budget=96, chunk=32))
    clients = run_constrained(h, schema, 6, rng_seed=2)
    h.run()
    assert h.sched.preemptions > 0
    group = h.submit_group([40, 41, 42] * 7, [dict(grammar=schema, max_tokens=160)] * 3)
    h.run()
    for client in clients + group:
        assert client.record.finish_reason == "stop", client.record.text
        jsonschema.validate(json.loads(client.record.text), SCHEMA)
    rng = np.random.default_rng(3)
    pair = Harness(FakeEngine(num_slots=3), chunked(), decode_engine=FakeEngine(num_slots=3))
    moved = [pair.submit(random_prompt(rng, 50), grammar=schema, max_tokens=300) for _ in range(4)]
    pair.run()
    assert pair.decode_engine.split_steps > 0
    for client in moved:
        jsonschema.validate(json.loads(client.record.text), SCHEMA)


def test_a_grammar_dead_end_fails_its_request_alone():
    """A grammar that allows no token (here: past llguidance's lexer limit) is refused when it
    compiles if that happens at its first token, and a few tokens in ends its request with an
    error that says so; the others finish."""
    tight = GrammarCompiler(TOK, TOK.vocab_size, limits=llguidance.LLParserLimits(max_lexer_states=3))
    with pytest.raises(GrammarError, match="allows no output at all: lexer"):
        tight.compile(Regex("(ab|cd)*e"))
    later = tight.compile(JsonSchema({"type": "object", "properties": {"x": {"type": "string"}}}))
    engine = FakeEngine(num_slots=4)
    h = Harness(engine, chunked())
    free = [h.submit([3, 4, 5, 6], max_tokens=30), h.submit([9, 9], max_tokens=30)]
    doomed = [h.submit([8, 8, 8], grammar=later, max_tokens=30)]
    h.run()
    for client in doomed:
        assert client.record.finish_reason == "error"
        assert "grammar allows no token" in client.record.error and "lexer" in client.record.error
    assert doomed[0].record.output_tokens >= 1  # it died while decoding
    for client in free:
        assert client.token_ids == expected(engine, client.prompt, 30)[0]


def test_grammars_need_an_engine_that_splits_its_steps(compiler):
    grammar = compiler.compile(Regex("a+"))
    engine = FakeEngine()
    engine.config = dataclasses.replace(engine.config, structured_output=False)
    h = Harness(engine, chunked())
    with pytest.raises(SubmissionError, match="--structured_output"):
        h.submit([1, 2], grammar=grammar)
    h = Harness(FakeEngine(), chunked())
    with pytest.raises(SubmissionError, match="ignore_eos"):
        h.submit([1, 2], grammar=grammar, ignore_eos=True)
    other = GrammarCompiler(TOK, TOK.vocab_size + 64).compile(Regex("a+"))
    with pytest.raises(SubmissionError, match="vocabulary"):
        h.submit([1, 2], grammar=other)


def test_a_sentencepiece_vocabulary_walks_to_valid_json(spm):
    """llguidance over a SentencePiece tokenizer's view (pieces' "▁" as spaces, byte-fallback
    tokens as their bytes): random walks among the allowed tokens, what the client reads
    (the tokenizer's own decoding) parses and validates."""
    compiler = GrammarCompiler(spm, spm.vocab_size)
    grammar = compiler.compile(JsonSchema(SCHEMA))
    rng = np.random.default_rng(0)
    row = np.zeros(bitmask_words(spm.vocab_size), np.int32)
    for _ in range(5):
        matcher, ids = grammar.matcher(), []
        while not matcher.done and len(ids) < 400:
            assert matcher.fill(row), matcher.error
            allowed = np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")[: spm.vocab_size])
            allowed = [t for t in allowed.tolist() if t not in spm.eos_ids] or allowed.tolist()
            token = int(rng.choice(allowed))
            if token in spm.eos_ids:
                break
            assert matcher.accept(token)
            ids.append(token)
        jsonschema.validate(json.loads(spm.decode(ids)), SCHEMA)


@pytest.mark.parametrize("opened", [False, True], ids=["the model opens", "the prompt opened"])
@pytest.mark.parametrize("answer", [JsonSchema({"type": "object", "properties": {"a": {"type": "integer"}},
                                                "required": ["a"]}),
                                    Lark('start: "<tool_call>" %json {"type": "object"} "</tool_call>"')],
                         ids=["schema", "lark"])
def test_thinking_leaves_the_reasoning_free_and_then_holds_the_answer_to_its_grammar(compiler, opened, answer):
    """A thinking model's format (`Thinking`): any text up to the first `</think>` (even one
    that mentions the tag in part), newlines, then the answer's grammar, which ends the request."""
    from cadence.scheduler.grammar import Thinking

    grammar = compiler.compile(Thinking(answer, opened=opened))
    head = "" if opened else "<think>"
    body = '{"a": 3}' if isinstance(answer, JsonSchema) else '<tool_call>{"x": [1, 2]}</tool_call>'

    def run(text: str) -> tuple[bool, bool]:
        matcher = grammar.matcher()
        ok = all(matcher.accept(t) for t in TOK.encode(text, add_bos=False))
        return ok, matcher.done

    assert run(f"{head}\nA </thin k> and <think> inside.\n</think>\n\n{body}") == (True, True)
    assert run(f"{head}short</think>{body}") == (True, True)
    assert run(f"{head}x</think>\n\nnot the format")[0] is False
    assert run(f"{head}x</think></think>{body}")[0] is False  # the first </think> ends it
    if not opened:
        assert run(f"x</think>{body}")[0] is False  # the model must open it
