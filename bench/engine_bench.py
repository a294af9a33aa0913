"""Engine microbenchmark: decode step time and prefill throughput against this machine's roofline.

    python -m cadence.bench.engine_bench --model=smollm2-135m --out=bench/results/engine-cpu/engine.json

Measures the machine first (a large on-device reduction for memory bandwidth, a large matmul for
FLOP/s; the bandwidth again after each timed decode dispatch), then times the engine's own compiled
programs:
- decode: one step over `num_slots` slots at several live context lengths, with all of them or
  only `--active` of them decoding (the rest idle, as on a lightly loaded server), and with k
  steps per dispatch (`--decode_steps`); the floor is (weight bytes + live KV bytes) /
  bandwidth, since a decode step must read both;
- prefill: a long prompt in chunks of `--prefill_chunk`; tokens/s and achieved FLOP/s against
  2 * params * tokens (+ attention) / matmul rate.
`--sampling` times decode with every row's settings of a kind (`SAMPLING_KINDS`: greedy;
temperature 1 alone, OpenAI's defaults; temperature and top-p; both and top-k; penalized; with
logprobs; or all of them; llama-server's defaults in llama.cpp's order, alone and with its other
samplers; those with their logprobs, raw or post-sampling), what each stage of `model.sampling`
costs.
Prints a table and writes one JSON file (machine, JAX version, date, every figure).
"""

from __future__ import annotations

import datetime
import json
import platform
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from cadence.bench import roofline
from cadence.checkpoints.registry import load_model
from cadence.engine.config import DEFAULT_PAGE_SIZE, KV_DTYPES, EngineConfig, fixed_page_tables
from cadence.engine.engine import Engine
from cadence.engine.packing import PrefillChunk
from cadence.engine.programs import sampling_rows
from cadence.model.params import cast_bytes
from cadence.model import cpu_kernels
from cadence.model.quant import quantize, quantize_grouped
from cadence.model.host_sampling import RequestSampling, SamplingRows

_MODEL = flags.DEFINE_string("model", "smollm2-135m", "Model to benchmark.")
_SLOTS = flags.DEFINE_list("slots", ["1", "4", "8"], "Slot counts for decode.")
_CONTEXTS = flags.DEFINE_list("contexts", ["128", "1024"], "Live context lengths for decode.")
_ACTIVE = flags.DEFINE_list("active", [], "Decoding slots per point (default: all of them); "
                            "counts above --slots are skipped.")
_PROMPT = flags.DEFINE_integer("prompt_tokens", 2048, "Prompt length for prefill.")
_CHUNK = flags.DEFINE_integer("prefill_chunk", 512, "Prefill chunk size.")
_MAX_SEQ = flags.DEFINE_integer("max_seq_len", 4096, "Slot length.")
_STEPS = flags.DEFINE_integer("steps", 20, "Timed decode dispatches per point.")
_DECODE_STEPS = flags.DEFINE_list("decode_steps", ["1"], "Decode steps per dispatch (k) to time; "
                                  "a point's step time is its dispatch's time / k.")
_PAGE = flags.DEFINE_integer("page_size", DEFAULT_PAGE_SIZE, "KV page size (tokens).")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Compute and KV dtype.")
_KV_DTYPE = flags.DEFINE_enum("kv_dtype", None, list(KV_DTYPES), "KV pool dtype (default: --dtype).")
_WEIGHTS = flags.DEFINE_enum(
    "weights", "float", ["float", "int8", "gguf", "int8-grouped", "int4-grouped"],
    "float; int8 (per output channel); with --decode_matmul=cpu also gguf (the checkpoint's own "
    "block-quantized matrices) and int8-grouped / int4-grouped (groups of 32), the floor then "
    "counting the bytes decode reads.")
_ATTENTION = flags.DEFINE_string("attention", "xla", "Attention implementation (xla, cpu, pallas, reference).")
_DECODE_MATMUL = flags.DEFINE_enum("decode_matmul", "xla", ["xla", "cpu"],
                                   "Decode's matmuls: XLA's, or the CPU kernel (`model.cpu_kernels`).")
_OUT = flags.DEFINE_string("out", None, "Where to write the JSON results.")

# Each kind's row, and whether it asks for logprobs: what `--sampling` times decode with.
SAMPLED = dict(temperature=0.7, top_p=0.9, top_k=50, seed=1)
PENALIZED = dict(repetition_penalty=1.1, frequency_penalty=0.5, presence_penalty=0.5,
                 logit_bias=tuple((i, 1.0) for i in range(300)))
SAMPLING_KINDS = {
    "greedy": (RequestSampling(), False),
    "temperature": (RequestSampling(temperature=1.0, seed=1), False),  # OpenAI's defaults
    "nucleus": (RequestSampling(temperature=0.7, top_p=0.9, seed=1), False),
    "sampled": (RequestSampling(**SAMPLED), False),
    "penalized": (RequestSampling(**PENALIZED), False),
    "logprobs": (RequestSampling(), True),
    "all": (RequestSampling(**SAMPLED, **PENALIZED, min_p=0.05), True),
    # llama-server's defaults (top_k 40, top_p 0.95, min_p 0.05, temperature 0.8) in its order
    "llama": (RequestSampling(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=1,
                              temperature_last=True), False),
    # and every llama.cpp sampler cadence runs
    "llama_all": (RequestSampling(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=1,
                                  temperature_last=True, top_n_sigma=2.0, typical_p=0.95,
                                  xtc_probability=0.5, xtc_threshold=0.1, dynatemp_range=0.3), False),
    # and DRY at SillyTavern's usual settings, over the last 1024 tokens
    "llama_dry": (RequestSampling(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=1,
                                  temperature_last=True, dry_multiplier=0.8, dry_window=1024,
                                  dry_breakers=(198, 28, 18)), False),
    # llama-server's defaults with n_probs 20 as they are, and as post_sampling_probs reports them
    "llama_logprobs": (RequestSampling(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=1,
                                       temperature_last=True), True),
    "llama_post": (RequestSampling(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=1,
                                   temperature_last=True, post_sampling=True), True),
    # Mirostat 2 and 1 at llama-server's tau and eta, at its default temperature
    "mirostat2": (RequestSampling(temperature=0.8, seed=1, temperature_last=True, mirostat=2), False),
    "mirostat1": (RequestSampling(temperature=0.8, seed=1, temperature_last=True, mirostat=1), False),
    # llama-server's defaults, the draw adaptive-p's at 0.2
    "adaptive": (RequestSampling(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=1,
                                 temperature_last=True, adaptive_target=0.2), False),
}
_SAMPLING = flags.DEFINE_list("sampling", ["greedy"], f"Sampling kinds to time decode with: {list(SAMPLING_KINDS)}.")


def sampling_rows_of(kind: str, slots: int):
    sampling, logprobs = SAMPLING_KINDS[kind]
    rows = SamplingRows(slots)
    for slot in range(slots):
        rows.set(slot, sampling, logprobs=logprobs)
    return rows.params()


def decode_point(engine, rows, tables, context: int, count: int, weight_bytes: int, probe,
                 k: int = 1, kind: str = "greedy") -> dict:
    """The median step with the first `count` slots decoding at `context` live tokens each, in
    dispatches of `k` steps, and its ratio to the floor. Each timed dispatch is followed by a
    probe of the memory's bandwidth, and the ratio is the median over the (dispatch, probe)
    pairs: this shared machine's bandwidth drifts by 2x within minutes, and a floor measured
    once would hold a point to another moment's memory. `probe`: `roofline.bandwidth_probe()`."""
    slots = engine.config.num_slots
    positions = np.full(slots, context - 1, np.int32)
    active = np.arange(slots) < count
    kv_bytes = count * context * engine.model_config.kv_bytes_per_token(jnp.dtype(engine.config.pool_dtype).itemsize)
    engine.decode(positions, active, rows, tables, k).block_until_ready()
    steps, bandwidths = [], []
    for _ in range(_STEPS.value):
        start = time.perf_counter()
        engine.decode(positions, active, rows, tables, k).block_until_ready()
        steps.append((time.perf_counter() - start) / k)
        bandwidths.append(probe())
    floors = (weight_bytes + kv_bytes) / np.array(bandwidths)
    step, floor = float(np.median(steps)), float(np.median(floors))
    ratio = float(np.median(np.array(steps) / floors))
    print(f"decode  slots={slots:<3} active={count:<3} context={context:<5} k={k:<2} {kind:<9} {step * 1e3:7.1f} ms/step "
          f"(floor {floor * 1e3:5.1f} ms, {ratio:4.2f}x; memory {np.min(bandwidths) / 1e9:.1f}-"
          f"{np.max(bandwidths) / 1e9:.1f} GB/s)  {count / step:7.1f} tok/s")
    return {"slots": slots, "active": count, "context": context, "steps_per_dispatch": k,
            "sampling": kind, "step_ms": step * 1e3, "bandwidth_gb_s": float(np.median(bandwidths)) / 1e9,
            "floor_ms": floor * 1e3, "ratio_to_floor": ratio,
            "achieved_gb_s": (weight_bytes + kv_bytes) / step / 1e9, "tokens_per_s": count / step}


def main(argv) -> None:
    del argv
    measured = roofline.measure_machine()
    machine = {"bandwidth_gb_s": measured.bandwidth_gb_s, "matmul_gflop_s": measured.flops_gflop_s}
    print(f"machine: {machine['bandwidth_gb_s']:.1f} GB/s read, {machine['matmul_gflop_s']:.0f} GFLOP/s matmul")
    model = load_model(_MODEL.value)
    cfg = model.config
    params, packed = model.params, None
    if _WEIGHTS.value == "int8":
        params = quantize(model.params, cfg)
    elif _WEIGHTS.value == "gguf":
        packed = {path: blocks for path, (blocks, _) in model.packed.items()}
    elif _WEIGHTS.value.endswith("-grouped"):
        params, packed = quantize_grouped(model.params, cfg, {"int8-grouped": "q8", "int4-grouped": "q4"}[_WEIGHTS.value])
    weight_bytes = cast_bytes(params, _DTYPE.value)
    results = {"decode": [], "prefill": []}
    probe = roofline.bandwidth_probe()  # one 256 MiB array and program for every point
    for slots in map(int, _SLOTS.value):
        engine = Engine(params, cfg, EngineConfig(
            num_slots=slots, max_seq_len=_MAX_SEQ.value, prefill_chunk=_CHUNK.value,
            page_size=_PAGE.value, decode_steps=max(map(int, _DECODE_STEPS.value)), dtype=_DTYPE.value,
            kv_dtype=_KV_DTYPE.value, attention=_ATTENTION.value, decode_matmul=_DECODE_MATMUL.value), packed=packed)
        if _DECODE_MATMUL.value == "cpu":  # what decode reads: the blocked (or packed) matrices
            weight_bytes = cpu_kernels.decode_bytes(engine.params)
        rows = sampling_rows([RequestSampling()] * slots)
        tables = fixed_page_tables(engine.config)  # each slot a run of pages, as if allocated
        for slot in range(slots):  # what the penalties read: a prompt's worth of history
            engine.set_history(slot, list(range(100, 228)))
        for context in map(int, _CONTEXTS.value):
            for count in [a for a in map(int, _ACTIVE.value) if a <= slots] or [slots]:
                for k in map(int, _DECODE_STEPS.value):
                    for kind in _SAMPLING.value:
                        results["decode"].append(decode_point(
                            engine, sampling_rows_of(kind, slots), tables, context, count,
                            weight_bytes, probe, k, kind))
        if slots == int(_SLOTS.value[0]):
            n, chunk = _PROMPT.value, _CHUNK.value
            prompt = list(np.random.default_rng(0).integers(100, cfg.vocab_size, n))

            def prefill_all():
                for start in range(0, n, chunk):
                    piece = prompt[start : start + chunk]
                    token = engine.prefill([PrefillChunk(0, piece, start, start + chunk >= n, tables[0])],
                                           rows)
                token.block_until_ready()

            seconds = roofline.timed(prefill_all, 3)
            flops = sum(roofline.prefill_cost(cfg, start, min(chunk, n - start), 4)["flops"]
                        for start in range(0, n, chunk))  # one program (one logits row) a chunk
            point = {"prompt_tokens": n, "chunk": chunk, "seconds": seconds, "tokens_per_s": n / seconds,
                     "achieved_gflop_s": flops / seconds / 1e9,
                     "fraction_of_matmul_rate": flops / seconds / 1e9 / machine["matmul_gflop_s"]}
            results["prefill"].append(point)
            print(f"prefill {n} tokens in chunks of {chunk}: {seconds:.2f} s, {n / seconds:.0f} tok/s, "
                  f"{point['achieved_gflop_s']:.0f} GFLOP/s ({point['fraction_of_matmul_rate']:.0%} of matmul)")
    report = {
        "model": _MODEL.value, "weights": _WEIGHTS.value, "dtype": _DTYPE.value,
        "kv_dtype": _KV_DTYPE.value or _DTYPE.value, "page_size": _PAGE.value,
        "attention": _ATTENTION.value, "decode_matmul": _DECODE_MATMUL.value,
        "weight_bytes": weight_bytes, "machine": machine,
        "platform": platform.platform(), "processor": platform.processor() or platform.machine(),
        "cpu_count": __import__("os").cpu_count(), "device": str(jax.devices()[0]),
        "jax_version": jax.__version__, "date": datetime.date.today().isoformat(), **results,
    }
    if _OUT.value:
        Path(_OUT.value).parent.mkdir(parents=True, exist_ok=True)
        Path(_OUT.value).write_text(json.dumps(report, indent=2))
    print(json.dumps({"decode_ms": {f"{p['active']}of{p['slots']}x{p['context']}k{p['steps_per_dispatch']}"
                                    f"{'' if p['sampling'] == 'greedy' else '-' + p['sampling']}":
                                    round(p["step_ms"], 1)
                                    for p in results["decode"]},
                      "prefill_tok_s": [round(p["tokens_per_s"]) for p in results["prefill"]]}))


if __name__ == "__main__":
    app.run(main)
