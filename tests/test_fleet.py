"""cadence replicas behind sglang-router (`bench/fleet.py`): two `cadence-serve` subprocesses on
the tiny model and the router in front of them, as a user deploys them.

Skips, saying why, where the sglang-router wheel is not installed (it is in the dev extra)."""

from __future__ import annotations

import concurrent.futures
import json
import subprocess
import sys
import time

import httpx
import pytest

from cadence.bench import fleet as fleet_mod
from cadence.bench.cadence_server import REPO, ServerConfig
from cadence.bench.fleet import Fleet, counters, parse_policy, split_cores

TIMEOUT = 120
LONG = 440  # output tokens: streams that run for a while on the tiny model

needs_router = pytest.mark.skipif(fleet_mod.router_available() is not None,
                                  reason=str(fleet_mod.router_available()))


def test_cores_split_into_disjoint_equal_shares():
    assert split_cores(2, [0, 1]) == [[0], [1]]
    assert split_cores(2, [0, 1, 2, 3, 4]) == [[0, 1], [2, 3]]
    assert split_cores(1, [3, 5]) == [[3, 5]]
    assert split_cores(3, [0, 1]) is None  # fewer cores than replicas: they share


def test_a_policy_entry_carries_router_flags_and_bad_ones_are_refused():
    assert parse_policy("round_robin") == ("round_robin", ())
    assert parse_policy("cache_aware:balance-abs-threshold=2:cache-threshold=0.5") == (
        "cache_aware", ("--balance-abs-threshold", "2", "--cache-threshold", "0.5"))
    for bad in ("nearest", "cache_aware:balance-abs-threshold", "cache_aware:=2"):
        with pytest.raises(ValueError):
            parse_policy(bad)


def tiny_fleet(tiny_model_dir, out, policy: str, max_seq_len: int = 256) -> Fleet:
    root, env = tiny_model_dir
    # No speculative decoding: the tiny model's greedy text repeats itself, so prompt lookup
    # drafts all of it and a long stream ends before a poll of the gauges can see it run.
    config = ServerConfig(model=str(root / "model"), num_slots=2, max_seq_len=max_seq_len, prefill_chunk=32,
                          extra_flags=("--speculative=off",))
    return Fleet(config, 2, policy, out, health_timeout_s=300, env=env)


def model_of(base: str) -> str:
    """The served model's id: requests through sglang-router must name it (the router sends
    "unknown" for a request that names none)."""
    return httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]


def chat(base: str, content: str, max_tokens: int = 12) -> httpx.Response:
    body = {"model": model_of(base), "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return httpx.post(f"{base}/v1/chat/completions", json=body, timeout=TIMEOUT)


def streamed_text(base: str, prompt: str, max_tokens: int) -> tuple[str, str | None]:
    """A streamed completion's text, and its finish_reason (None if the stream broke off)."""
    body = {"model": model_of(base), "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    text, finish = [], None
    try:
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=TIMEOUT) as response:
            if response.status_code != 200:
                return response.read().decode(errors="replace"), None
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    event = json.loads(line[len("data: "):])
                    if "error" in event:
                        return event["error"]["message"], None
                    for choice in event["choices"]:
                        text.append(choice["text"])
                        finish = choice["finish_reason"] or finish
    except httpx.HTTPError as e:
        return f"{type(e).__name__}: {e}", None
    return "".join(text), finish


def running(replica_url: str) -> float:
    return counters(replica_url, ("vllm:num_requests_running",))["vllm:num_requests_running"]


def finished(replica_url: str) -> int:
    return int(counters(replica_url)["cadence:request_success_total"])


def served(f: Fleet) -> list[int]:
    return [finished(r.url) for r in f.replicas]


# The full tier (two replicas and the router as subprocesses: ~13 s); the default tier keeps the
# fleet's own logic (cores, policies, counters) and the routes the router reads (test_clients,
# test_reliability).
@pytest.mark.slow
@needs_router
def test_through_the_router_answers_equal_direct_calls_and_the_gauges_move(tiny_model_dir, tmp_path):
    with tiny_fleet(tiny_model_dir, tmp_path, "round_robin", max_seq_len=512) as f:
        direct = f.replicas[0].url
        info = httpx.get(f"{direct}/server_info", timeout=10).json()
        assert info["served_model_name"].endswith("model") and info["dp_size"] == 1
        assert info["max_running_requests"] == 2
        assert httpx.get(f"{direct}/model_info", timeout=10).json()["is_generation"] is True
        workers = httpx.get(f"{f.router_url}/workers", timeout=10).json()["workers"]
        assert {w["model_id"] for w in workers} == {info["served_model_name"]}

        before = served(f)
        prompts = [f"route me {i}" for i in range(6)]
        for prompt in prompts:
            routed, alone = chat(f.router_url, prompt), chat(direct, prompt)
            assert routed.status_code == 200, routed.text
            assert routed.json()["choices"][0]["message"] == alone.json()["choices"][0]["message"]
            usage = lambda r: {k: v for k, v in r.json()["usage"].items() if k != "prompt_tokens_details"}
            assert usage(routed) == usage(alone)  # (the second call may find the prompt cached)
        assert streamed_text(f.router_url, "stream me", 20) == streamed_text(direct, "stream me", 20)
        after = served(f)
        # Round robin: the six routed chats and the stream split over both replicas.
        routed_per_replica = [a - b for a, b in zip(after, before)]
        routed_per_replica[0] -= len(prompts) + 1  # the direct calls
        assert sorted(routed_per_replica) == [3, 4]

        # The vLLM-named gauges a router reads move while a routed request runs, and fall back.
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            # LONG tokens: the CPU kernels decode the tiny model's 230 before a poll might see them
            long = pool.submit(streamed_text, f.router_url, "a long one", LONG)
            seen = None  # the replicas' loads, once the routed request shows in them
            while seen is None and not long.done():
                loads = [httpx.get(f"{r.url}/get_load", timeout=10).json()[0] for r in f.replicas]
                if (sum(e["num_reqs"] for e in loads) == 1
                        and sum(running(r.url) for r in f.replicas) == 1):
                    seen = loads
                time.sleep(0.01)
            assert seen is not None, "the routed request never showed in the gauges while it ran"
            assert sum(entry["num_tokens"] for entry in seen) > 0
            assert long.result()[1] == "length"
        assert sum(running(r.url) for r in f.replicas) == 0
        assert sum(counters(r.url, ("vllm:prefix_cache_queries_total",))["vllm:prefix_cache_queries_total"]
                   for r in f.replicas) > 0


def held(replica_url: str) -> int:
    """Requests a replica holds: running and waiting."""
    c = counters(replica_url, ("vllm:num_requests_running", "vllm:num_requests_waiting"))
    return int(sum(c.values()))


@needs_router
@pytest.mark.slow
def test_a_killed_replica_fails_only_its_requests_and_a_restart_brings_it_back(tiny_model_dir, tmp_path):
    with tiny_fleet(tiny_model_dir, tmp_path, "round_robin", max_seq_len=512) as f:
        healthy = {r.url for r in f.replicas}
        survivor = f.replicas[1]
        prompts = [f"in flight {i}" for i in range(8)]  # two slots a replica: some wait
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            streams = [pool.submit(streamed_text, f.router_url, p, LONG) for p in prompts]
            deadline = time.monotonic() + 60
            while sum(split := [held(r.url) for r in f.replicas]) < len(prompts):
                assert time.monotonic() < deadline and not any(s.done() for s in streams), split
                time.sleep(0.02)
            f.kill(0)
            # Nothing hangs: every stream ends, well before its client timeout.
            outcomes = [s.result(timeout=TIMEOUT) for s in streams]
        # The survivor's requests finish in full and unchanged. The dead one's end in an error:
        # sglang-router 0.3.2 closes each such stream before its last chunk, so the client's
        # HTTP library raises (no finish_reason, no [DONE]: never a short answer passed as whole).
        whole = [(p, text) for p, (text, finish) in zip(prompts, outcomes) if finish == "length"]
        assert len(whole) == split[1], (split, outcomes)
        for prompt, text in whole:
            assert text == streamed_text(survivor.url, prompt, LONG)[0]
        broken = [text for text, finish in outcomes if finish is None]
        assert len(broken) == split[0] and all(broken), (split, outcomes)

        # The router's health check takes the dead replica out; new requests go to the survivor.
        f.wait_workers(healthy - {f.replicas[0].url}, timeout_s=60)
        before = finished(survivor.url)
        assert all(chat(f.router_url, f"after the kill {i}").status_code == 200 for i in range(4))
        assert finished(survivor.url) == before + 4

        # Restarted on its port, it is healthy again and gets its share.
        f.restart(0)
        f.wait_workers(healthy, timeout_s=60)
        assert all(chat(f.router_url, f"after the restart {i}").status_code == 200 for i in range(4))
        assert finished(f.replicas[0].url) >= 2


@needs_router
@pytest.mark.slow
def test_the_fleet_command_runs_a_workload_through_the_router(tiny_model_dir, tmp_path):
    root, env = tiny_model_dir
    out = tmp_path / "fleet"
    cmd = [sys.executable, "-m", "cadence.bench.cli", "fleet", f"--model={root / 'model'}", "--replicas=2",
           "--router_policies=round_robin", "--nosingle_replica", "--fleet_workload=shared_prefix",
           "--groups=2", "--prompts_per_group=3", "--prefix_tokens=40", "--question_tokens=5,10",
           "--reply_tokens=4", "--concurrency=2", "--num_slots=2", "--max_seq_len=512",
           "--prefill_chunk=32", "--health_timeout=300", f"--out_dir={out}"]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (row,) = json.loads((out / "fleet.json").read_text())["summary"]
    assert row["fleet"] == "2 replicas, round_robin" and row["requests"] == 6 and row["failed"] == 0
    assert row["requests_per_replica"] == [3, 3]
    assert 0 < row["hit_rate"] < 1 and row["ttft_p50"] > 0
    assert done.stdout.startswith("fleet ")
