"""Several `cadence-serve` replicas behind sglang-router (the SGLang Model Gateway), on this machine.

    with Fleet(ServerConfig(num_slots=4), replicas=2, policy="cache_aware", out=Path("out")) as fleet:
        fleet.base_url              # the router's OpenAI-compatible base URL, ".../v1"
        fleet.replicas[0].url       # one replica's root URL, for direct calls and its /metrics
        fleet.kill(0); fleet.restart(0)

Each replica is a `cadence-serve` subprocess on its own loopback port, pinned to its own share of
this process's cores (with `taskset`) where there are enough of them (two replicas on two cores: one
core each),
so replicas do not fight over one core's caches; with fewer cores than replicas they share them
all, and `Fleet.cores` says so. The router (`python -m sglang_router.launch_router`, from the
`sglang-router` wheel) starts once every replica answers /health, with the chosen policy, and
`Fleet` returns once the router lists every replica as a healthy worker. On the way out the
router gets SIGTERM, then each replica (they drain), and whatever will not stop is killed.

sglang-router checks each worker's /health every `health_interval_s` and takes it out of
rotation after `health_failures` failures in a row; it puts a restarted one back after one
success. Logs: OUT/router.log and OUT/replica-I.log.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx

from cadence.bench.cadence_server import REPO, ServerConfig, free_port, log_tail, stop, wait_healthy

ROUTER_POLICIES = ("cache_aware", "round_robin", "random", "power_of_two")


def router_available() -> str | None:
    """None when sglang-router can be started here, else why not."""
    try:
        import sglang_router  # noqa: F401
    except ImportError as e:
        return f"sglang-router is not installed ({e}); pip install 'sglang-router==0.3.2'"
    return None


def parse_policy(entry: str) -> tuple[str, tuple[str, ...]]:
    """`POLICY[:FLAG=VALUE...]` into the policy and the router flags (`--FLAG VALUE`)."""
    policy, *options = entry.split(":")
    if policy not in ROUTER_POLICIES:
        raise ValueError(f"{policy!r} is not one of {', '.join(ROUTER_POLICIES)}")
    extra: list[str] = []
    for option in options:
        key, eq, value = option.partition("=")
        if not (eq and key and value):
            raise ValueError(f"option {option!r} in {entry!r} is not FLAG=VALUE")
        extra += [f"--{key}", value]
    return policy, tuple(extra)


def split_cores(replicas: int, cores: list[int] | None = None) -> list[list[int]] | None:
    """Disjoint, equal shares of `cores` (default: the cores this process may run on), one per
    replica; None when there are fewer cores than replicas."""
    cores = sorted(os.sched_getaffinity(0)) if cores is None else cores
    if len(cores) < replicas:
        return None
    share = len(cores) // replicas
    return [cores[i * share:(i + 1) * share] for i in range(replicas)]


@dataclasses.dataclass
class Replica:
    index: int
    port: int
    cores: list[int] | None
    log: Path
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


class Fleet:
    def __init__(self, config: ServerConfig, replicas: int, policy: str, out: Path, *,
                 health_timeout_s: float = 1200, health_interval_s: int = 1, health_failures: int = 2,
                 router_flags: tuple[str, ...] = (), env: dict[str, str] | None = None):
        if policy not in ROUTER_POLICIES:
            raise ValueError(f"router policy must be one of {', '.join(ROUTER_POLICIES)}, got {policy!r}")
        if replicas < 1:
            raise ValueError(f"a fleet needs at least one replica, got {replicas}")
        if any(f.startswith("--api_key") for f in config.extra_flags):
            raise ValueError("a fleet's replicas take no API key (the router would have to send it)")
        self.config, self.policy, self.out = config, policy, Path(out)
        self.health_timeout_s, self.env = health_timeout_s, env
        self.cores = split_cores(replicas) if shutil.which("taskset") else None
        self.replicas = [Replica(i, free_port(), self.cores[i] if self.cores else None,
                                 self.out / f"replica-{i}.log") for i in range(replicas)]
        self.router_port, self.router_metrics_port = free_port(), free_port()
        self.router_flags = ("--health-check-interval-secs", str(health_interval_s),
                             "--health-failure-threshold", str(health_failures),
                             "--health-success-threshold", "1", *router_flags)
        self.router: subprocess.Popen | None = None

    @property
    def router_url(self) -> str:
        return f"http://127.0.0.1:{self.router_port}"

    @property
    def base_url(self) -> str:
        return f"{self.router_url}/v1"

    def describe(self) -> dict:
        return {"replicas": len(self.replicas), "router_policy": self.policy,
                "cores": self.cores or "shared (fewer cores than replicas, or no taskset)",
                "server": dataclasses.asdict(self.config), "router_flags": list(self.router_flags)}

    # -- replicas -----------------------------------------------------------------------------

    def start_replica(self, i: int) -> None:
        """Starts replica `i` (again, after `kill`) on its port and cores; returns once it is healthy."""
        r = self.replicas[i]
        # taskset rather than a preexec_fn: forking a process with JAX's threads must exec at once.
        pin = ["taskset", "--cpu-list", ",".join(map(str, r.cores))] if r.cores else []
        with open(r.log, "a") as log:
            r.proc = subprocess.Popen([*pin, *self.config.argv(r.port)], cwd=self.config.repo or REPO,
                                      stdout=log, stderr=subprocess.STDOUT, env=self.env)
        wait_healthy(r.proc, r.url, self.health_timeout_s, r.log)

    def kill(self, i: int) -> None:
        """SIGKILL: the replica dies as a crashed machine would, mid-request."""
        proc = self.replicas[i].proc
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()

    restart = start_replica

    # -- the router ---------------------------------------------------------------------------

    def workers(self) -> dict[str, bool]:
        """The router's workers: URL -> healthy."""
        listing = httpx.get(f"{self.router_url}/workers", timeout=5).json()
        return {w["url"]: bool(w.get("is_healthy")) for w in listing.get("workers", [])}

    def wait_workers(self, healthy: set[str], timeout_s: float = 120) -> None:
        """Waits until exactly `healthy` are the router's healthy workers."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if {u for u, ok in self.workers().items() if ok} == healthy:
                    return
            except (httpx.HTTPError, ValueError):
                pass
            if self.router is not None and self.router.poll() is not None:
                raise RuntimeError(f"sglang-router exited with {self.router.returncode}; "
                                   f"{self.out / 'router.log'} ends with:\n{log_tail(self.out / 'router.log')}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the router's healthy workers never became {sorted(healthy)}")
            time.sleep(0.5)

    def _start_router(self) -> None:
        argv = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
                "--port", str(self.router_port), "--prometheus-host", "127.0.0.1",
                "--prometheus-port", str(self.router_metrics_port), "--policy", self.policy,
                "--log-level", "warn", "--worker-urls", *(r.url for r in self.replicas), *self.router_flags]
        with open(self.out / "router.log", "w") as log:
            self.router = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        self.wait_workers({r.url for r in self.replicas})

    # -- lifetime -----------------------------------------------------------------------------

    def __enter__(self) -> Fleet:
        why = router_available()
        if why:
            raise RuntimeError(why)
        self.out.mkdir(parents=True, exist_ok=True)
        try:
            for r in self.replicas:
                print(f"  starting replica {r.index} on port {r.port}, cores {r.cores or 'all'}; log {r.log}",
                      file=sys.stderr)
            # One at a time: each compiles its programs, and compiling is the start's cost.
            for r in self.replicas:
                self.start_replica(r.index)
            self._start_router()
            print(f"  sglang-router ({self.policy}) on {self.router_url}", file=sys.stderr)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        stop(self.router, 30)
        for r in self.replicas:
            stop(r.proc)


# -- what a fleet run reports -------------------------------------------------------------------

# Counters read from each replica before and after a run (sums over their labels).
COUNTERS = ("cadence:prefix_cache_queries_total", "cadence:prefix_cache_hits_total",
            "cadence:request_success_total", "cadence:prompt_tokens_total")


def counters(url: str, names: tuple[str, ...] = COUNTERS) -> dict[str, float]:
    """One scrape of `url`/metrics: each of `names` summed over its labels."""
    from prometheus_client.parser import text_string_to_metric_families

    totals = dict.fromkeys(names, 0.0)
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name in totals:
                totals[sample.name] += sample.value
    return totals


def replica_deltas(before: list[dict[str, float]], after: list[dict[str, float]]) -> list[dict]:
    """Per replica, what the run added: requests finished, prompt tokens, prefix-cache lookups."""
    rows = []
    for i, (b, a) in enumerate(zip(before, after)):
        d = {name: a[name] - b[name] for name in a}
        rows.append({"replica": i, "requests": int(d["cadence:request_success_total"]),
                     "prompt_tokens": int(d["cadence:prompt_tokens_total"]),
                     "cache_queries": int(d["cadence:prefix_cache_queries_total"]),
                     "cache_hits": int(d["cadence:prefix_cache_hits_total"])})
    return rows


def summary(label: str, results: list, wall_s: float, replicas: list[dict]) -> dict:
    """One fleet's row: the prefix hit rate (the replicas' counters, and the client's
    cached_tokens), TTFT p50/p99 over every request, output tokens/s, and the split."""
    from cadence.bench.metrics import percentile

    ok = [r for r in results if r.ok]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    queries = sum(r["cache_queries"] for r in replicas)
    prompt = sum(r.prompt_tokens or 0 for r in ok)
    return {"fleet": label, "requests": len(results), "failed": len(results) - len(ok),
            "hit_rate": sum(r["cache_hits"] for r in replicas) / queries if queries else None,
            "client_cached_share": sum(min(r.cached_tokens, r.prompt_tokens or 0) for r in ok) / prompt
            if prompt else None,
            "ttft_p50": percentile(ttfts, 50), "ttft_p99": percentile(ttfts, 99),
            "output_tok_s": sum(r.output_tokens or 0 for r in ok) / wall_s, "wall_s": wall_s,
            "requests_per_replica": [r["requests"] for r in replicas]}


def format_summaries(rows: list[dict]) -> str:
    from cadence.bench.report import _f

    w = max([5, *(len(r["fleet"]) for r in rows)])
    out = [f"{'fleet':<{w}} {'reqs':>5} {'fail':>4} {'hit rate':>8} {'client':>7} {'TTFT p50':>9} "
           f"{'TTFT p99':>9} {'out tok/s':>9}  per replica"]
    for r in rows:
        out.append(f"{r['fleet']:<{w}} {r['requests']:>5} {r['failed']:>4} {_f(r['hit_rate']):>8} "
                   f"{_f(r['client_cached_share']):>7} {_f(r['ttft_p50']):>9} {_f(r['ttft_p99']):>9} "
                   f"{r['output_tok_s']:>9.1f}  {r['requests_per_replica']}")
    return "\n".join(out)
