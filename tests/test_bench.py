"""bench/: the client against real loopback servers (cadence with the tiny model, and a stand-in
for another OpenAI-compatible server), the metrics on hand-made records with known answers,
workload reproducibility, billing and roofline arithmetic, and the plots."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys

import numpy as np
import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from cadence.bench import plots, roofline
from cadence.bench.bill import Prices, bill
from cadence.bench.client import RequestResult, Target, _on_message
from cadence.bench.cadence_server import REPO, ServerConfig, parse_config
from cadence.bench.experiments import capacity, check_slos, compare, parse_slos
from cadence.bench.metrics import chat_itl, class_metrics, percentile, stream_rate, summarize, throughput
from cadence.bench.report import load_results, run_report, write_json
from cadence.bench.runner import run_workload
from cadence.bench.workload import ClassSpec, RequestSpec, WorkloadSpec, approx_tokens, corpus
from cadence.model.config import TINY
from cadence.scheduler.policy import PolicyConfig
from cadence.scheduler.scheduler import Scheduler, SchedulerConfig
from cadence.server.app import create_app
from tests.conftest import loopback_server


@contextlib.contextmanager
def serve_app(app):
    with loopback_server(app) as base:
        yield f"{base}/v1"


def tiny_workload(**kw) -> WorkloadSpec:
    # The tiny tokenizer is nearly byte-level (about one token per character): short prompts.
    classes = (ClassSpec.chat(concurrency=2, prompt_tokens=(15, 25), output_tokens=(6, 12)),
               ClassSpec.document(rate=2.0, prompt_tokens=(30, 45), output_tokens=(2, 4)))
    return WorkloadSpec(classes, **{"seed": 3, "warmup_s": 0.3, "duration_s": 1.5, "drain_timeout_s": 30, **kw})


@pytest.fixture(scope="module")
def cadence_url(tiny_engine, tiny_tokenizer):
    # The serving tests' engine, warmed once for the session.
    sched = Scheduler(tiny_engine, tiny_tokenizer, SchedulerConfig(policy=PolicyConfig(token_budget=40, chunk=32)))
    with serve_app(create_app(sched, tiny_tokenizer, "tiny")) as url:
        yield url


@pytest.fixture(scope="module")
def cadence_report(cadence_url):
    data = asyncio.run(run_workload(tiny_workload(), Target(cadence_url, "tiny"), verbose=False))
    return data, run_report(data)


# -- the client against real servers --------------------------------------------------------


def test_client_against_cadence_records_usage_and_joins_the_server_timeline(cadence_report):
    data, report = cadence_report
    ok = [r for r in data.results if r.ok]
    assert ok and len(ok) == len(data.results), [r.error for r in data.results if not r.ok]
    assert {r.cls for r in ok} == {"chat", "document"}
    for r in ok:
        assert r.output_tokens == r.max_tokens  # ignore_eos: the drawn length, from usage
        assert sum(r.message_tokens()) == r.output_tokens
        assert 0 < r.ttft < r.done - r.sent
        assert r.server is not None, "every request is joined to cadence's record by id"
        assert r.server["output_tokens"] == r.output_tokens
        assert r.server["prompt_tokens"] == r.prompt_tokens
        assert r.server["queue_s"] >= 0 and r.server["prefill_chunks"] >= 1
        # the server's first token precedes the client's, on the client's clock
        assert r.server["first_token"] <= r.message_times[0] + 0.05
    server = report["server"]
    assert server["kind"] == "cadence-timeline" and server["iterations"]
    assert server["clock_offset_error_s"] < 0.5
    assert any(it["prefill_tokens"] > 0 for it in server["iterations"])
    summary = report["summary"]
    assert summary["classes"]["chat"]["ok"] >= 1 and summary["chat_inter_token_s"]["n"] > 0
    assert summary["throughput"]["tokens_per_s"] > 0
    assert summary["server"]["joined_requests"] >= 1
    assert summary["server"]["kv"]["samples"] >= 1


def test_completions_endpoint_and_report_round_trip(cadence_url, cadence_report, tmp_path):
    spec = tiny_workload(warmup_s=0.0, duration_s=0.5)
    data = asyncio.run(run_workload(spec, Target(cadence_url, "tiny", endpoint="completions"), verbose=False))
    assert data.results and all(r.ok for r in data.results)
    _, report = cadence_report
    path = write_json(tmp_path / "run.json", report)
    again = json.loads(path.read_text())
    window = tuple(again["summary"]["window_s"])
    resummarized = summarize(load_results(again), window, {"chat"}, ["chat", "document"])
    assert resummarized["chat_inter_token_s"] == report["summary"]["chat_inter_token_s"]
    assert resummarized["throughput"] == report["summary"]["throughput"]


def _fake_openai_app():
    """Another OpenAI-compatible server: two tokens per message, cumulative usage on every chat
    chunk (as vLLM's continuous_usage_stats), final usage only for completions, no timeline."""

    async def stream(request, chat: bool):
        body = await request.json()
        n = body["max_tokens"]

        async def frames():
            for i in range(0, n, 2):
                await asyncio.sleep(0.005)
                text = "ab cd "
                choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
                frame = {"choices": [choice]}
                if chat:
                    frame["usage"] = {"prompt_tokens": 10, "completion_tokens": min(i + 2, n), "total_tokens": 0}
                yield f"data: {json.dumps(frame)}\n\n"
            usage = {"prompt_tokens": 10, "completion_tokens": n, "total_tokens": 10 + n,
                     "prompt_tokens_details": {"cached_tokens": 4}}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(frames(), media_type="text/event-stream")

    async def metrics(request):
        return Response('vllm:kv_cache_usage_perc{model_name="m"} 0.25\n')

    async def missing(request):
        return JSONResponse({"detail": "Not Found"}, status_code=404)

    async def chat(request):
        return await stream(request, True)

    async def completions(request):
        return await stream(request, False)

    return Starlette(routes=[
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/metrics", metrics), Route("/debug/timeline", missing),
    ])


def test_client_against_another_openai_compatible_server():
    spec = WorkloadSpec((ClassSpec.chat(concurrency=2, prompt_tokens=(8, 20), output_tokens=(8, 8)),),
                        seed=1, warmup_s=0.0, duration_s=1.2, drain_timeout_s=10)
    with serve_app(_fake_openai_app()) as url:
        chat = asyncio.run(run_workload(spec, Target(url, "m", api_key="k"), verbose=False))
        plain = asyncio.run(run_workload(spec, Target(url, "m", endpoint="completions", ignore_eos=False),
                                         verbose=False))
    assert chat.server["kind"] == "prometheus" and chat.server["samples"][0]["kv_usage"] == 0.25
    r = next(r for r in chat.results if r.ok)
    assert r.usage["completion_tokens"] == r.max_tokens  # the last usage, never a sum of cumulative ones
    assert r.tokens_basis == "exact: cumulative usage per message" and set(r.message_tokens()) == {2}
    summary = summarize(chat.results, chat.window, chat.chat_classes())
    assert summary["chat_inter_token_s"]["basis"].startswith("counted: a message of k tokens")
    assert summary["chat_inter_token_s"]["n"] == 2 * summary["chat_inter_token_s"]["message_gaps_s"]["n"]
    p = next(r for r in plain.results if r.ok)
    assert p.tokens_basis.startswith("estimate: tokens spread") and sum(p.message_tokens()) == p.max_tokens


def test_extra_body_fields_go_into_every_request():
    spec = RequestSpec("r", "chat", "hi", 1, 8)
    body = Target("http://x/v1", "m", extra_body=(("cache_prompt", False),)).body(spec)
    assert body["cache_prompt"] is False and body["max_tokens"] == 8 and body["stream"] is True
    assert "cache_prompt" not in Target("http://x/v1", "m").body(spec)


def test_client_imports_nothing_of_the_engine():
    code = ("import sys, bench.client, bench.workload, bench.metrics, bench.runner, bench.report, bench.bill; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
            "{'jax', 'flax', 'model', 'engine', 'scheduler', 'server', 'checkpoints'}); print(bad); "
            "sys.exit(1 if bad else 0)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


# -- experiments ------------------------------------------------------------------------------


@pytest.mark.slow
def test_compare_spawns_cadence_per_config_and_writes_table_json_and_plots(
        tiny_model_dir, tmp_path, monkeypatch):
    root, env = tiny_model_dir
    monkeypatch.setenv("CADENCE_CACHE", env["CADENCE_CACHE"])  # the servers' compilation cache
    model = root / "model"
    base = ServerConfig(model=str(model), num_slots=4, max_seq_len=256, prefill_chunk=32)
    configs = [parse_config(item, base) for item in ("prefill-first@32", "disaggregated@32")]
    out = tmp_path / "compare"
    result = compare(tiny_workload(duration_s=1.0), configs, Target("http://unused/v1", "x"), out,
                     health_timeout_s=120, slos={"chat_ttft_p99": 60.0, "error_rate": 0.0},
                     estimate="(the estimate)")
    assert [row["config"] for row in result["table"]] == ["prefill-first@32", "disaggregated@32"]
    assert all(row["errors"] == 0 and row["chat_itl_max_s"] > 0 for row in result["table"])
    colocated, split = result["table"]
    assert colocated["transfers"] is None and set(colocated["busy"]) == {"colocated"}
    assert set(split["busy"]) == {"prefill", "decode"} and split["transfers"] > 0
    assert 0 < split["transfer_p50_s"] <= split["transfer_p99_s"] < 1
    assert split["transfer_bytes_p50"] > 0 and split["decode_pool_wait_p99_s"] >= 0
    text = (out / "compare.txt").read_text()
    assert text.startswith("config") and "decode wait p99" in text and "(the estimate)" in text
    assert "prefill-first@32: meets every target" in text
    assert "the colocated baseline (prefill-first@32) already meets the targets" in text
    for name in ["compare.json", "run-prefill-first_32.json", "run-disaggregated_32.json", *result["plots"]]:
        assert (out / name).stat().st_size > 0, name
    assert "timeline-disaggregated_32.png" in result["plots"]


def test_compare_configs_carry_serve_flags_and_another_checkout():
    base = ServerConfig(num_slots=4, max_seq_len=512)
    plain = parse_config("prefill-first@256", base)
    assert (plain.policy, plain.prefill_chunk, plain.label, plain.repo) == ("prefill-first", 256, "prefill-first@256", None)
    item = f"chunked@128:kv_reservation=max:repo={REPO}"
    paged = parse_config(item, base)
    assert paged.label == item and paged.repo == str(REPO) and paged.num_slots == 4
    assert paged.argv(1)[-1] == "--kv_reservation=max" and "--prefill_chunk=128" in paged.argv(1)
    split = parse_config("disaggregated@64", base)
    assert split.policy == "chunked" and split.label == "disaggregated@64"
    assert split.argv(1)[-3:] == ["--num_cpu_devices=2", "--prefill_devices=0", "--decode_devices=1"]
    for bad in ["chunked", "fastest@64", "chunked@64:kv_reservation", "chunked@64:repo=/nonexistent"]:
        with pytest.raises(ValueError, match="configs"):
            parse_config(bad, base)


@pytest.mark.slow
def test_host_ceiling_streams_from_the_real_server_around_a_null_engine(tiny_model_dir, tmp_path):
    root, env = tiny_model_dir
    out = tmp_path / "ceiling.json"
    done = subprocess.run([sys.executable, "-m", "cadence.bench.host_ceiling", f"--model={root / 'model'}",
                           "--streams=1,4", "--warmup=0.5", "--duration=1", "--output_tokens=16", f"--out={out}"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    points = json.loads(out.read_text())["points"]
    assert [p["streams"] for p in points] == [1, 4]
    for p in points:  # 16-token requests back to back for a second: many complete ones
        assert p["errors"] == 0 and p["requests"] > 2 * p["streams"] and p["messages_per_s"] > 16
        assert p["iterations_per_s"] > 0


@pytest.mark.slow
def test_capacity_bisection_against_cadence(cadence_url, tmp_path):
    # A window long enough that chat gaps are always observed: a trial with no measurement
    # fails its SLO by design, so a too-short window would make the easy case flaky.
    spec = tiny_workload(warmup_s=0.0, duration_s=1.5)
    target = Target(cadence_url, "tiny")
    easy = capacity(spec, {"chat_itl_p99": 100.0}, target, tmp_path / "easy", low=0.5, high=2.0, steps=1)
    assert easy["capacity_factor"] == 2.0 and len(easy["trials"]) == 2 and "at least" in easy["note"]
    assert easy["capacity"]["kv"]["samples"] >= 0 and (tmp_path / "easy" / "capacity.json").exists()
    impossible = capacity(spec, {"chat_ttft_p99": 1e-9}, target, tmp_path / "hard", low=0.5, high=2.0)
    assert impossible["capacity_factor"] is None and len(impossible["trials"]) == 1


# -- metrics with known answers ---------------------------------------------------------------


def record(cls, sent, times, tokens=None, done=None, rid="r") -> RequestResult:
    tokens = len(times) if tokens is None else tokens
    return RequestResult(id=rid, cls=cls, approx_prompt_tokens=10, max_tokens=tokens, sent=sent, status=200,
                         message_times=list(times), message_texts=["x"] * len(times),
                         message_usage=[None] * len(times),
                         usage={"prompt_tokens": 12, "completion_tokens": tokens},
                         done=times[-1] if done is None and times else done)


def test_percentiles_and_stream_rate():
    values = list(range(1, 101))
    assert percentile(values, 50) == pytest.approx(50.5)
    assert percentile(values, 99) == pytest.approx(99.01)
    assert percentile([], 99) is None
    assert stream_rate(11, 1.0, 3.0) == pytest.approx(5.0)
    assert stream_rate(1, 1.0, 3.0) is None and stream_rate(5, 2.0, 2.0) is None


def test_class_metrics_cover_requests_sent_in_the_window():
    rs = [record("chat", 0.5, [1.0, 1.5, 2.0], done=2.1, rid="a"),  # sent before the window
          record("chat", 1.0, [1.25, 2.25, 3.25], tokens=5, done=3.5, rid="b"),
          record("chat", 2.0, [3.0, 3.5], done=4.0, rid="c"),
          RequestResult("d", "chat", 10, 5, 2.5, status=429, error="HTTP 429", rejected=True, done=2.6)]
    m = class_metrics(rs, "chat", (1.0, 10.0))
    assert (m["requests"], m["ok"], m["rejected"], m["errors"]) == (3, 2, 1, 0)
    assert m["ttft_s"]["p50"] == pytest.approx((0.25 + 1.0) / 2)
    # rates: b = (5 - 1) / 2.0 = 2.0, c = (2 - 1) / 0.5 = 2.0
    assert m["stream_rate_tok_s"]["p50"] == pytest.approx(2.0)
    assert m["completion_s"]["p50"] == pytest.approx((2.5 + 2.0) / 2)


def test_inter_token_delay_is_across_chat_streams_only_and_in_the_window():
    rs = [record("chat", 0.0, [1.0, 1.1, 1.3], rid="a"), record("chat", 0.0, [2.0, 2.5], rid="b"),
          record("document", 0.0, [1.0, 5.0], rid="c")]
    itl = chat_itl(rs, (0.0, 10.0), {"chat"})
    assert itl["n"] == 3 and itl["max"] == pytest.approx(0.5) and itl["p50"] == pytest.approx(0.2)
    assert itl["basis"] == "exact: one token per message"
    late = chat_itl(rs, (1.2, 10.0), {"chat"})
    assert late["n"] == 2 and late["p50"] == pytest.approx(0.35)


def test_chunk_normalized_gaps_are_labelled_estimates():
    r = record("chat", 0.0, [1.0, 1.4], tokens=5)  # 5 tokens in 2 messages, no per-message usage
    r.message_texts = ["a", "bcdefghijklmnop"]  # the second message carries most of the text
    assert r.tokens_basis.startswith("estimate") and sum(r.message_tokens()) == 5
    itl = chat_itl([r], (0.0, 10.0), {"chat"})
    k = r.message_tokens()[1]
    assert itl["basis"].startswith("estimate") and itl["n"] == k
    assert itl["max"] == pytest.approx(0.4 / k) and itl["message_gaps_s"]["max"] == pytest.approx(0.4)


def test_tokens_that_arrive_together_are_counted_as_one_delivery():
    """Several decode steps per dispatch: three messages at once, then two, then one."""
    r = record("chat", 0.0, [1.0, 1.0002, 1.0004, 1.05, 1.0501, 1.1], rid="a")
    d = chat_itl([r], (0.0, 10.0), {"chat"})["deliveries"]
    assert d["messages_per_delivery_mean"] == pytest.approx(2.0) and d["messages_per_delivery_max"] == 3
    assert d["gaps_s"]["n"] == 2 and d["gaps_s"]["max"] == pytest.approx(0.05)
    one_by_one = chat_itl([record("chat", 0.0, [1.0, 1.1, 1.3], rid="b")], (0.0, 10.0), {"chat"})
    assert one_by_one["deliveries"]["messages_per_delivery_max"] == 1
    assert one_by_one["deliveries"]["gaps_s"]["max"] == pytest.approx(0.2)


def test_throughput_counts_tokens_arriving_in_the_interval():
    rs = [record("chat", 0.0, [0.5, 1.5, 2.5, 3.5]), record("document", 0.0, [2.0, 9.0])]
    tp = throughput(rs, (1.0, 3.0))
    assert tp["output_tokens"] == 3 and tp["tokens_per_s"] == pytest.approx(1.5)
    assert tp["interval_s"] == [1.0, 3.0] and tp["basis"] == "exact"
    # Of requests that finished in the interval, per class: how many, and their prompt tokens.
    tp = throughput(rs + [record("document", 0.0, [1.0, 2.5], rid="d")], (1.0, 3.0))
    assert tp["by_class"] == {"document": {"finished": 1, "prompt_tokens": 12, "prompt_tokens_per_s": 6.0}}


def test_slos_parse_and_check():
    slos = parse_slos(["chat_itl_p99=0.25", "document_ttft_p99=30", "chat_rate_p10=5", "error_rate=0"])
    summary = {"chat_inter_token_s": {"p99": 0.2}, "errors": 0, "rejected": 1, "incomplete": 0,
               "classes": {"chat": {"requests": 9, "stream_rate_tok_s": {"p10": 6.0}},
                           "document": {"requests": 1, "ttft_s": {"p99": 31.0}}}}
    ok, details = check_slos(summary, slos)
    assert not ok
    assert details["chat_itl_p99"]["ok"] and details["chat_rate_p10"]["ok"]
    assert not details["document_ttft_p99"]["ok"] and details["error_rate"]["value"] == pytest.approx(0.1)
    with pytest.raises(ValueError):
        parse_slos(["chat_latency=1"])


# -- workload ---------------------------------------------------------------------------------


def test_workload_is_reproducible_with_a_seed():
    def draw(seed):
        spec = tiny_workload(seed=seed)
        it = spec.requests("chat")
        return [next(it) for _ in range(5)], spec.arrivals("document", 20.0)

    a, b, c = draw(7), draw(7), draw(8)
    assert a == b and a != c
    requests, arrivals = a
    assert all(15 <= r.approx_prompt_tokens <= 26 and 6 <= r.max_tokens <= 12 for r in requests)
    assert arrivals == sorted(arrivals) and 20 <= len(arrivals) <= 65  # Poisson, mean 40
    assert len(corpus()) > 100 and all(p.isprintable() for p in corpus()[:50])
    doc = next(WorkloadSpec((ClassSpec.document(rate=1.0, prompt_tokens=(3000, 3000)),)).requests("document"))
    assert abs(approx_tokens(doc.prompt) - 3000) < 60
    assert tiny_workload().scaled(2.0).get("document").rate == 4.0
    assert tiny_workload().scaled(2.0).get("chat").concurrency == 4
    only = tiny_workload().scaled(3.0, only="document")
    assert only.get("document").rate == 6.0 and only.get("chat") == tiny_workload().get("chat")


# -- billing and roofline arithmetic ----------------------------------------------------------


def test_bill_arithmetic_and_cumulative_usage_is_not_summed():
    prices = Prices(input_per_m=1.0, output_per_m=2.0, cached_input_per_m=0.5)
    r = RequestResult("a", "chat", 10, 3, 0.0)
    for i, n in enumerate((1, 2, 3)):  # a server that repeats cumulative usage on every chunk
        _on_message(r, {"choices": [{"delta": {"content": "x"}}],
                        "usage": {"prompt_tokens": 1000, "completion_tokens": n,
                                  "prompt_tokens_details": {"cached_tokens": 200}}}, float(i))
    doc = RequestResult("b", "document", 10, 3, 0.0, usage={"prompt_tokens": 5000, "completion_tokens": 100})
    failed = RequestResult("c", "chat", 10, 3, 0.0, error="HTTP 500")
    estimate = bill([r, doc, failed], prices)
    chat = estimate["classes"]["chat"]
    assert (chat["input_tokens"], chat["cached_input_tokens"], chat["output_tokens"]) == (800, 200, 3)
    assert chat["cost"] == pytest.approx(800e-6 + 200 * 0.5e-6 + 3 * 2e-6)
    assert chat["unbilled_requests"] == 1
    assert estimate["classes"]["document"]["cost"] == pytest.approx(5000e-6 + 200e-6)
    assert estimate["total"]["cost"] == pytest.approx(chat["cost"] + 5200e-6)
    assert Prices(1.0, 2.0).cached_rate == 1.0


def test_kv_handoff_estimate():
    """Llama-3-8B in bf16: 2 x 32 layers x 8 KV heads x 128 x 2 bytes = 128 KiB per token, so
    an 8k-token prompt moves 1 GiB: 21.5 ms at 50 GB/s."""
    from cadence.model.config import LLAMA3_8B

    e = roofline.transfer_estimate(LLAMA3_8B, 2, (8192,), {"link": 50.0})
    assert e["bytes_per_token"] == 131072
    assert e["prompts"][0]["bytes"] == 2**30
    assert e["prompts"][0]["seconds"]["link"] == pytest.approx(2**30 / 50e9)
    assert "128.0 KiB per prompt token" in roofline.format_transfer_estimate([e])


def test_roofline_arithmetic():
    c = TINY  # d=64, L=2, heads 4/2 of 16, ffn 128, vocab 512
    per_layer = 64 * 16 * (2 * 4 + 2 * 2) + 3 * 64 * 128
    assert roofline.linear_params(c) == 2 * per_layer
    assert roofline.weight_bytes(c, 4) == (2 * per_layer + 512 * 64) * 4
    decode = roofline.decode_cost(c, (10, 20), itemsize=4)
    attention = 4 * 2 * 4 * 16 * 30
    assert decode["flops"] == 2 * 2 * per_layer * 2 + 2 * 512 * 64 * 2 + attention
    kv_token = 2 * 2 * 2 * 16 * 4
    assert decode["bytes"] == roofline.weight_bytes(c, 4) + kv_token * (30 + 2)
    prefill = roofline.prefill_cost(c, start=8, length=4, itemsize=4)
    assert prefill["flops"] == 2 * 2 * per_layer * 4 + 2 * 512 * 64 + 4 * 2 * 4 * 16 * (4 * 8 + 10)
    slow_memory = roofline.Machine(bandwidth_gb_s=1.0, flops_gflop_s=1e6)
    p = roofline.predict(roofline.iteration_cost(c, roofline.Shape(decode_contexts=(10, 20)), 4), slow_memory)
    assert p["bound"] == "memory" and p["predicted_s"] == pytest.approx(decode["bytes"] / 1e9)
    slow_compute = roofline.Machine(bandwidth_gb_s=1e6, flops_gflop_s=1.0)
    shape = roofline.Shape(decode_contexts=(10,), prefill=((8, 4), (12, 4)))
    p = roofline.predict(roofline.iteration_cost(c, shape, 4), slow_compute)
    assert p["bound"] == "compute" and p["predicted_s"] == pytest.approx(p["flops"] / 1e9)


def test_roofline_against_a_cadence_run(cadence_report):
    _, report = cadence_report
    machine = roofline.Machine(bandwidth_gb_s=10.0, flops_gflop_s=100.0)
    compared = roofline.compare_run(json.loads(json.dumps(report)), TINY, machine, 4)
    assert compared["groups"] and compared["total_measured_s"] > 0
    assert any(g["kind"].startswith("with prefill") for g in compared["groups"])


# -- plots ------------------------------------------------------------------------------------


def test_plots_are_written_as_png(cadence_report, tmp_path):
    _, report = cadence_report
    rng = np.random.default_rng(0)
    paths = [
        plots.itl_cdf({"prefill-first": rng.exponential(0.05, 500), "chunked@64": rng.exponential(0.03, 500)},
                      tmp_path / "itl.png"),
        plots.ttft_vs_prompt({"run": load_results(report)}, tmp_path / "ttft.png"),
        plots.timeline(report, tmp_path / "timeline.png"),
    ]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000


def test_conversations_resend_their_history_and_later_turns_hit_the_cache(cadence_url):
    """The multi-turn workload against cadence: each turn sends the system prompt and every
    earlier message and reply, so its prompt grows turn by turn, and from the second turn on
    the server reports most of it cached (the system prompt is shared by all conversations)."""
    from cadence.bench.conversations import (ConversationSpec, SharedPrefixSpec, format_table, prefix_table,
                                             run_conversations, run_shared_prefix)

    spec = ConversationSpec(conversations=3, turns=2, system_tokens=5, user_tokens=(1, 2), max_tokens=4)
    results, wall = asyncio.run(run_conversations(spec, Target(cadence_url, "tiny")))
    assert len(results) == 6 and all(r.ok for r in results), [r.error for r in results]
    for c in range(3):
        turns = sorted((r for r in results if r.id.startswith(f"conv{c}-")), key=lambda r: r.id)
        prompts = [r.prompt_tokens for r in turns]
        assert prompts[0] < prompts[1]
        assert all(r.cached_tokens > 0 for r in turns[1:])
    table = prefix_table(results, wall)
    rows = {row["class"]: row for row in table["rows"]}
    assert set(rows) == {"turn-1", "turn-2", "later turns", "all"}
    assert rows["all"]["prompt_tokens"] == sum(r.prompt_tokens for r in results)
    assert rows["later turns"]["cached_share"] > 0.5
    assert rows["all"]["computed_tokens"] == rows["all"]["prompt_tokens"] - rows["all"]["cached_tokens"]
    assert "later turns" in format_table(table)
    shared, _ = asyncio.run(run_shared_prefix(
        SharedPrefixSpec(groups=2, prompts_per_group=3, prefix_tokens=5, question_tokens=(1, 2), max_tokens=4,
                         concurrency=2), Target(cadence_url, "tiny")))
    assert len(shared) == 6 and all(r.ok for r in shared)
    assert sum(r.cached_tokens > 0 for r in shared) >= 4  # all but each group's first (or two, racing)
