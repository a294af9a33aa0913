"""Per-iteration FLOPs and bytes from the model config, against the machine's roofline.

    machine = Machine(bandwidth_gb_s=31, flops_gflop_s=193)          # given, or measure_machine()
    shape = Shape(decode_contexts=(300,) * 8, prefill=((0, 256),))    # one iteration
    c = iteration_cost(config, shape, itemsize=4); predict(c, machine)

The model of an iteration: each program (one decode step over the decoding slots, one per prefill
chunk) reads every weight once; decode reads each slot's live KV context, a chunk reads the KV
before it and writes its own; logits are computed for one row per decoding slot and one per
chunk (its last position). FLOPs are 2 per multiply-add of the linear layers and causal attention
(QK and PV). A program's predicted time is max(FLOPs / FLOP/s, bytes / bandwidth); it is
compute-bound when the first is larger. Activations, norms, RoPE, sampling and host work are left
out: they are what measured-minus-predicted shows.

`reconstruct(run)` rebuilds approximate iteration shapes from a run's cadence timeline (the
iteration log gives the decode count and prefill tokens; contexts and chunk offsets come from the
requests' timelines), so measured iteration times can be set against predicted ones. The server
reads a step's results while running the next, so iteration i's work shows in the wall time of
iteration i + 1 (`pipeline_offset`).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from cadence.model.config import PRESETS, ModelConfig


@dataclasses.dataclass(frozen=True)
class Machine:
    bandwidth_gb_s: float
    flops_gflop_s: float
    source: str = "given"


@dataclasses.dataclass(frozen=True)
class Shape:
    decode_contexts: tuple[int, ...] = ()  # tokens each decoding slot attends to (incl. the new one)
    prefill: tuple[tuple[int, int], ...] = ()  # (start, length) of each chunk program


def load_config(spec: str) -> ModelConfig:
    """A preset name, a ModelConfig JSON file, or a converted checkpoint folder."""
    if spec in PRESETS:
        return PRESETS[spec]
    path = Path(spec).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        return ModelConfig.from_json(path.read_text())
    raise ValueError(f"unknown model {spec!r}: give one of {sorted(PRESETS)}, a ModelConfig JSON file "
                     f"or a converted checkpoint folder")


def linear_params(c: ModelConfig) -> int:
    """Weights of the per-layer matmuls, all layers (no embedding, no norms)."""
    attn = c.hidden_size * c.head_dim * (2 * c.num_heads + 2 * c.num_kv_heads)
    return c.num_layers * (attn + 3 * c.hidden_size * c.ffn_size)


def weight_bytes(c: ModelConfig, itemsize: int) -> int:
    """Bytes a program reads for weights: the layers and one vocab x hidden output matrix."""
    return (linear_params(c) + c.vocab_size * c.hidden_size) * itemsize


def attention_flops(c: ModelConfig, attended: int) -> int:
    """QK and PV over `attended` (query, key) position pairs in total."""
    return 4 * c.num_layers * c.num_heads * c.head_dim * attended


def decode_cost(c: ModelConfig, contexts: tuple[int, ...], itemsize: int) -> dict:
    b = len(contexts)
    flops = 2 * linear_params(c) * b + 2 * c.vocab_size * c.hidden_size * b
    flops += attention_flops(c, sum(contexts))
    kv = c.kv_bytes_per_token(itemsize)
    return {"flops": flops, "bytes": weight_bytes(c, itemsize) + kv * (sum(contexts) + b)}


def prefill_cost(c: ModelConfig, start: int, length: int, itemsize: int) -> dict:
    """One prefill program over positions [start, start + length): the layers for every token,
    the LM head for one row only (the chunk's last position, the one whose logits are read), and
    causal attention over the KV before the chunk and within it. The bench's one prefill model."""
    attended = length * start + length * (length + 1) // 2  # causal
    flops = 2 * linear_params(c) * length + 2 * c.vocab_size * c.hidden_size
    flops += attention_flops(c, attended)
    kv = c.kv_bytes_per_token(itemsize)
    return {"flops": flops, "bytes": weight_bytes(c, itemsize) + kv * (start + 2 * length)}


def iteration_cost(c: ModelConfig, shape: Shape, itemsize: int) -> list[dict]:
    """One cost per program the iteration runs."""
    programs = [{"program": f"prefill[{s}:{s + n}]", **prefill_cost(c, s, n, itemsize)} for s, n in shape.prefill]
    if shape.decode_contexts:
        programs.append({"program": f"decode x{len(shape.decode_contexts)}",
                         **decode_cost(c, shape.decode_contexts, itemsize)})
    return programs


def predict(programs: list[dict], machine: Machine) -> dict:
    t_compute = sum(p["flops"] for p in programs) / (machine.flops_gflop_s * 1e9)
    t_memory = sum(p["bytes"] for p in programs) / (machine.bandwidth_gb_s * 1e9)
    total = sum(max(p["flops"] / (machine.flops_gflop_s * 1e9), p["bytes"] / (machine.bandwidth_gb_s * 1e9))
                for p in programs)
    flops, nbytes = sum(p["flops"] for p in programs), sum(p["bytes"] for p in programs)
    return {"flops": flops, "bytes": nbytes, "intensity_flop_per_byte": flops / nbytes if nbytes else None,
            "compute_s": t_compute, "memory_s": t_memory, "predicted_s": total,
            "bound": "compute" if t_compute > t_memory else "memory"}


def timed(fn, repeats: int = 5) -> float:
    """Median seconds of `fn()` over `repeats` runs after one warm (compiling) run: the bench's
    one timer. What `fn` returns is waited for (`jax.block_until_ready`), so it may hand back
    arrays still being computed; a function that blocks itself may return anything."""
    import jax

    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def bandwidth_probe():
    """A function that reads 256 MiB on the device (a reduction) and returns the bytes/s it got:
    for probing the memory between the timed runs of a benchmark on a machine that drifts. On
    an accelerator, where one such read takes about as long as a dispatch, one program reads it
    16 times, each pass depending on the last so that XLA can neither hoist nor merge them."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((64 * 2**20,), jnp.float32)
    passes = 1 if x.devices().pop().platform == "cpu" else 16
    total = jax.jit(lambda x: jax.lax.fori_loop(
        0, passes, lambda _, s: jnp.sum(x + 0.0 * s), jnp.float32(0)))
    total(x).block_until_ready()

    def probe() -> float:
        start = time.perf_counter()
        total(x).block_until_ready()
        return passes * x.nbytes / (time.perf_counter() - start)

    return probe


def measure_bandwidth() -> float:
    """Bytes/s of a 256 MiB on-device reduction, the median of 5."""
    probe = bandwidth_probe()
    return float(np.median([probe() for _ in range(5)]))


def measure_machine() -> Machine:
    """`measure_bandwidth` and a 2048^3 f32 matmul (FLOP/s), medians of 5."""
    import jax
    import jax.numpy as jnp

    a = jnp.ones((2048, 2048), jnp.float32)
    mm = jax.jit(jnp.matmul)
    flops = 2 * 2048**3 / timed(lambda: mm(a, a))
    return Machine(measure_bandwidth() / 1e9, flops / 1e9, source=f"measured on {jax.devices()[0].platform}")


def standard_shapes(max_context: int = 4096) -> list[tuple[str, Shape]]:
    shapes = []
    for slots in (1, 8, 64):
        for context in (128, 1024, 4096):
            if context <= max_context:
                shapes.append((f"decode {slots} slots @ {context}", Shape(decode_contexts=(context,) * slots)))
    for length in (64, 256, 512, 2048):
        for start in (0, 2048):
            if start + length <= max_context:
                shapes.append((f"prefill {length} @ {start}", Shape(prefill=((start, length),))))
    shapes.append(("mixed: 8 decodes @ 512 + prefill 256 @ 1024",
                   Shape(decode_contexts=(512,) * 8, prefill=((1024, 256),))))
    return shapes


def reconstruct(run: dict) -> list[tuple[dict, Shape]]:
    """Approximate shapes of a run's iterations from its cadence timeline (server clock)."""
    server = run.get("server") or {}
    iterations, requests = server.get("iterations") or [], server.get("requests") or []
    if not iterations:
        raise ValueError("the run has no cadence iteration log (was the target a cadence server?)")
    chunk = (server.get("info") or {}).get("policy", {}).get("chunk") or 256
    progress: dict[str, int] = {}
    times = {r["request_id"]: np.asarray(r["token_times"], float) for r in requests}
    shapes = []
    for it in iterations:
        start = it["start"]
        decoding = [r for r in requests if r["first_token"] is not None and r["first_token"] <= start + it["wall"]
                    and r["finished"] > start]
        contexts = [r["prompt_tokens"] + int(np.searchsorted(times[r["request_id"]], start, "right")) + 1
                    for r in decoding]
        mean = int(np.mean(contexts)) if contexts else 1
        contexts = (sorted(contexts) + [mean] * it["decode_slots"])[: it["decode_slots"]]
        left, pieces = it["prefill_tokens"], []
        candidates = [r for r in requests if r["admitted"] is not None and r["admitted"] <= start
                      and progress.get(r["request_id"], 0) < r["prompt_tokens"]]
        candidates.sort(key=lambda r: r["prompt_tokens"] - progress.get(r["request_id"], 0))
        for r in candidates:
            if left <= 0:
                break
            done = progress.get(r["request_id"], 0)
            n = min(left, r["prompt_tokens"] - done)
            for s in range(done, done + n, chunk):
                pieces.append((s, min(chunk, done + n - s)))
            progress[r["request_id"]] = done + n
            left -= n
        if left > 0:  # requests the timeline did not include (finished after the last poll)
            pieces.append((0, left))
        shapes.append((it, Shape(decode_contexts=tuple(contexts), prefill=tuple(pieces))))
    return shapes


def compare_run(run: dict, config: ModelConfig, machine: Machine, itemsize: int,
                pipeline_offset: int = 1) -> dict:
    """Measured iteration wall times against predictions, grouped by iteration kind."""
    shapes = reconstruct(run)
    rows = []
    for i, (it, shape) in enumerate(shapes):
        j = i + pipeline_offset
        if j >= len(shapes):
            break
        steps = it.get("decode_steps", 1)  # k decode steps in one dispatch: k programs' cost
        p = predict(iteration_cost(config, shape, itemsize) * steps, machine)
        rows.append({"index": it["index"], "decode_slots": len(shape.decode_contexts), "decode_steps": steps,
                     "prefill_tokens": sum(n for _, n in shape.prefill), "measured_s": shapes[j][0]["wall"], **p})
    groups: dict[str, list[dict]] = {}
    for r in rows:
        if r["prefill_tokens"] == 0:
            key = f"decode only, {r['decode_slots']} slots" + (
                f", {r['decode_steps']} steps per dispatch" if r["decode_steps"] > 1 else "")
        else:
            bucket = next(b for b in (64, 256, 1024, 4096, 1 << 30) if r["prefill_tokens"] <= b)
            key = f"with prefill <= {bucket if bucket < 1 << 30 else 'any'} tokens"
        groups.setdefault(key, []).append(r)
    table = []
    for key in sorted(groups):
        g = groups[key]
        measured = float(np.median([r["measured_s"] for r in g]))
        predicted = float(np.median([r["predicted_s"] for r in g]))
        bounds = {r["bound"] for r in g}
        table.append({"kind": key, "iterations": len(g), "measured_median_s": measured,
                      "predicted_median_s": predicted, "ratio": measured / predicted if predicted else None,
                      "bound": "/".join(sorted(bounds)),
                      "achieved_gb_s": float(np.median([r["bytes"] / r["measured_s"] / 1e9 for r in g])),
                      "achieved_gflop_s": float(np.median([r["flops"] / r["measured_s"] / 1e9 for r in g]))})
    total_measured = sum(r["measured_s"] for r in rows)
    total_predicted = sum(r["predicted_s"] for r in rows)
    return {"pipeline_offset": pipeline_offset, "groups": table, "iterations": rows,
            "total_measured_s": total_measured, "total_predicted_s": total_predicted,
            "shapes": "reconstructed from the iteration log and request timelines (approximate)"}


def analytic_table(config: ModelConfig, machine: Machine, itemsize: int, max_context: int = 4096) -> list[dict]:
    rows = []
    for name, shape in standard_shapes(max_context):
        p = predict(iteration_cost(config, shape, itemsize), machine)
        tokens = len(shape.decode_contexts) + sum(n for _, n in shape.prefill)
        rows.append({"shape": name, **p, "tokens_per_s": tokens / p["predicted_s"]})
    return rows


def format_rows(rows: list[dict], machine: Machine) -> str:
    balance = machine.flops_gflop_s / machine.bandwidth_gb_s
    out = [f"machine ({machine.source}): {machine.bandwidth_gb_s:.1f} GB/s, {machine.flops_gflop_s:.0f} GFLOP/s, "
           f"balance {balance:.1f} FLOP/byte",
           f"{'shape':<46} {'GFLOP':>8} {'MB':>8} {'FLOP/B':>7} {'bound':>7} {'predicted ms':>12} {'tok/s':>9}"]
    for r in rows:
        out.append(f"{r['shape']:<46} {r['flops'] / 1e9:8.2f} {r['bytes'] / 1e6:8.1f} "
                   f"{r['intensity_flop_per_byte']:7.1f} {r['bound']:>7} {r['predicted_s'] * 1e3:12.2f} "
                   f"{r['tokens_per_s']:9.0f}")
    return "\n".join(out)


def format_comparison(result: dict) -> str:
    out = [f"{'iteration kind':<34} {'n':>5} {'measured ms':>11} {'predicted ms':>12} {'ratio':>6} "
           f"{'bound':>8} {'GB/s':>6} {'GFLOP/s':>8}"]
    for g in result["groups"]:
        out.append(f"{g['kind']:<34} {g['iterations']:>5} {g['measured_median_s'] * 1e3:11.1f} "
                   f"{g['predicted_median_s'] * 1e3:12.1f} {g['ratio']:6.2f} {g['bound']:>8} "
                   f"{g['achieved_gb_s']:6.1f} {g['achieved_gflop_s']:8.0f}")
    out.append(f"all iterations: measured {result['total_measured_s']:.1f} s, predicted "
               f"{result['total_predicted_s']:.1f} s ({result['shapes']})")
    return "\n".join(out)


def load_run(path: str | Path) -> dict:
    return json.loads(Path(path).read_text())


# -- the disaggregation handoff ---------------------------------------------------------------

# Effective one-way link bandwidths (GB/s) for the estimate: PCIe 4.0 and 5.0 x16 as measured
# host-device copies reach (~80% of 32 and 64), and NVLink 4 between two H100/H200s (450 per
# direction).
LINKS = {"PCIe 4.0 x16": 25.0, "PCIe 5.0 x16": 50.0, "NVLink 4": 450.0}


def kv_bytes_per_token(c: ModelConfig, itemsize: int) -> int:
    """What a prompt token's KV occupies, and so what a prefill-to-decode handoff moves per
    token: K and V of every layer, 2 x layers x kv_heads x head_dim x dtype bytes."""
    return 2 * c.num_layers * c.num_kv_heads * c.head_dim * itemsize


def transfer_estimate(c: ModelConfig, itemsize: int, prompt_tokens: Sequence[int],
                      links: dict[str, float] = LINKS) -> dict:
    """DistServe-style estimate of the handoff: bytes per prompt and the seconds each link takes."""
    per_token = kv_bytes_per_token(c, itemsize)
    return {"model": c.name, "itemsize": itemsize, "bytes_per_token": per_token,
            "prompts": [{"tokens": n, "bytes": n * per_token,
                         "seconds": {name: n * per_token / (gb_s * 1e9) for name, gb_s in links.items()}}
                        for n in prompt_tokens]}


def format_transfer_estimate(estimates: Sequence[dict]) -> str:
    out = []
    for e in estimates:
        links = list(e["prompts"][0]["seconds"]) if e["prompts"] else []
        out.append(f"{e['model']} ({8 * e['itemsize']}-bit KV): {e['bytes_per_token'] / 1024:.1f} KiB per "
                   f"prompt token (2 x layers x kv_heads x head_dim x {e['itemsize']} bytes)")
        out.append(f"  {'prompt':>7} {'KV':>10} " + " ".join(f"{name:>14}" for name in links))
        for p in e["prompts"]:
            out.append(f"  {p['tokens']:>7} {p['bytes'] / 2**20:>7.1f} MiB "
                       + " ".join(f"{1e3 * p['seconds'][name]:>11.2f} ms" for name in links))
    out.append("  (links: " + ", ".join(f"{k} {v:g} GB/s" for k, v in LINKS.items()) + ", one way, effective)")
    return "\n".join(out)
