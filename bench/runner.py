"""Driving a workload against a target: closed and open loops, the window, and the server's view.

    data = asyncio.run(run_workload(spec, target))

Time runs from t0 (the start of the run). Requests are sent in [0, warmup + duration): closed-loop
classes keep `concurrency` requests in flight each, open-loop classes send at their Poisson
arrival times whatever the server's state. The observation window is [warmup, warmup + duration);
after it nothing new is sent, and requests in flight get `drain_timeout_s` to finish (then they
are cancelled and marked incomplete).

While the run lasts a poller reads the server's state once a second: cadence's
`GET /debug/timeline` (its iteration log, finished requests' timelines and KV use) when the
server has it, else the KV-use gauge of a Prometheus `/metrics` (cadence's or vLLM's names). The
server's clock is mapped to the client's with the offset measured at the poll with the shortest
round trip (its half round trip is the offset's uncertainty).

Client side: imports only the standard library, httpx, numpy and the other client modules.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import secrets
import sys
import time

import httpx

from cadence.bench.client import RequestResult, Target, stream_into
from cadence.bench.workload import RequestSpec, WorkloadSpec, corpus

POLL_S = 1.0
_KV_GAUGE = re.compile(r"^\S*(?:kv_cache_usage_perc|gpu_cache_usage_perc)(?:\{[^}]*\})?\s+(\S+)$", re.M)


@dataclasses.dataclass
class RunData:
    spec: WorkloadSpec
    target: Target
    results: list[RequestResult]
    window: tuple[float, float]
    wall_s: float
    server: dict  # iterations / requests (server clock), kv samples, clock offset; {} if none

    def chat_classes(self) -> set[str]:
        return {c.name for c in self.spec.classes if c.kind == "chat"}


class ServerPoller:
    """Reads cadence's timeline (or a Prometheus KV gauge) incrementally during a run."""

    def __init__(self, http: httpx.AsyncClient, target: Target, t0: float):
        self.http, self.target, self.t0 = http, target, t0
        self.kind: str | None = None  # "cadence-timeline", "prometheus", or None
        self.iterations: list[dict] = []
        self.requests: list[dict] = []
        self.samples: list[dict] = []
        self.info: dict = {}
        self.offset: float | None = None  # server clock minus client clock
        self.offset_error: float = float("inf")
        self._since_iteration, self._since_request = -1, 0

    async def start(self) -> None:
        """Sets the cursors to 'now', so an earlier run on the same server is not read."""
        await self.poll(record=False)

    async def poll(self, record: bool = True) -> None:
        if self.kind in (None, "cadence-timeline"):
            url = f"{self.target.root}/debug/timeline"
            params = {"since_iteration": self._since_iteration, "since_request": self._since_request}
            try:
                before = time.perf_counter() - self.t0
                response = await self.http.get(url, params=params, timeout=30)
                after = time.perf_counter() - self.t0
            except httpx.HTTPError:
                return
            if response.status_code == 200:
                self.kind = "cadence-timeline"
                self._take_timeline(response.json(), before, after, record)
                return
            if self.kind is None and response.status_code in (404, 405):
                self.kind = "prometheus"
        if self.kind == "prometheus":
            try:
                response = await self.http.get(f"{self.target.root}/metrics", timeout=30)
            except httpx.HTTPError:
                return
            match = _KV_GAUGE.search(response.text) if response.status_code == 200 else None
            if match and record:
                self.samples.append({"t": time.perf_counter() - self.t0, "kv_usage": float(match.group(1))})

    def _take_timeline(self, body: dict, before: float, after: float, record: bool) -> None:
        if after - before < 2 * self.offset_error:
            self.offset = body["now"] - (before + after) / 2
            self.offset_error = (after - before) / 2
        if body["iterations"]:
            self._since_iteration = body["iterations"][-1]["index"]
        self._since_request = body["next_request"]
        self.info = {k: body[k] for k in ("num_slots", "max_seq_len", "policy", "kv_cache_bytes")}
        self.info["disaggregated"] = body.get("disaggregated", False)
        if not record:
            return
        self.iterations += body["iterations"]
        self.requests += body["requests"]
        self.samples.append({
            "t": (before + after) / 2, "kv_usage": body["kv_cache_usage"],
            "kv_bytes": body["kv_cache_usage"] * body["kv_cache_bytes"],
            "kv_pages": body.get("kv_pages_used"), "kv_pages_total": body.get("kv_pages_total"),
            "kv_page_utilization": body.get("kv_page_utilization"),
            "running": body["num_running"], "waiting": body["num_waiting"],
        })

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self.poll()
            try:
                await asyncio.wait_for(stop.wait(), POLL_S)
            except TimeoutError:
                pass

    def export(self) -> dict:
        return {"kind": self.kind, "clock_offset_s": self.offset,
                "clock_offset_error_s": None if self.offset is None else self.offset_error,
                "info": self.info, "iterations": self.iterations, "requests": self.requests,
                "samples": self.samples}


async def run_workload(spec: WorkloadSpec, target: Target, *, verbose: bool = True) -> RunData:
    tag = secrets.token_hex(3)
    end = spec.warmup_s + spec.duration_s
    results: list[RequestResult] = []
    tasks: set[asyncio.Task] = set()
    corpus()  # read the text before the clock starts
    async with target.http() as http:
        t0 = time.perf_counter()
        poller = ServerPoller(http, target, t0)
        await poller.start()
        stop_polling = asyncio.Event()
        polling = asyncio.create_task(poller.run(stop_polling))

        def now() -> float:
            return time.perf_counter() - t0

        async def one(request: RequestSpec, scheduled: float | None = None) -> RequestResult:
            request = dataclasses.replace(request, id=f"{tag}-{request.id}")
            result = RequestResult.start(request, t0, scheduled)
            results.append(result)
            await stream_into(result, http, target, request, t0)
            return result

        def launch(request: RequestSpec, scheduled: float | None = None) -> asyncio.Task:
            task = asyncio.create_task(one(request, scheduled))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            return task

        async def closed_worker(sequence) -> None:
            while now() < end:
                result = await launch(next(sequence))
                if result.rejected:  # back off as told, rather than spin on 429s
                    await asyncio.sleep(1.0)

        async def open_arrivals(name: str, sequence) -> None:
            for at in spec.arrivals(name, end):
                await asyncio.sleep(max(0.0, at - now()))
                launch(next(sequence), scheduled=at)

        drivers = []
        for c in spec.classes:
            sequence = spec.requests(c.name)
            if c.open_loop:
                drivers.append(asyncio.create_task(open_arrivals(c.name, sequence)))
            else:
                drivers += [asyncio.create_task(closed_worker(sequence)) for _ in range(c.concurrency)]

        async def report() -> None:
            while True:
                await asyncio.sleep(10)
                done = sum(r.done is not None for r in results)
                phase = "warm-up" if now() < spec.warmup_s else "window" if now() < end else "drain"
                print(f"  t={now():6.1f}s [{phase}] sent {len(results)}, finished {done}, "
                      f"in flight {len(tasks)}", file=sys.stderr)

        reporter = asyncio.create_task(report()) if verbose else None
        await asyncio.sleep(max(0.0, end - now()))
        # Drain: drivers stop sending at `end`; what is in flight gets until the deadline.
        deadline = end + spec.drain_timeout_s
        while now() < deadline:
            busy = set(tasks) | {d for d in drivers if not d.done()}
            if not busy:
                break
            await asyncio.wait(busy, timeout=deadline - now(), return_when=asyncio.FIRST_COMPLETED)
        leftovers = list(tasks) + drivers
        for task in leftovers:
            task.cancel()
        outcomes = await asyncio.gather(*leftovers, return_exceptions=True)
        bugs = [e for e in outcomes if isinstance(e, Exception)]
        if bugs:  # requests record their own failures: anything else is a bug in the benchmark
            raise bugs[0]
        for r in results:
            if r.done is None:
                r.incomplete, r.error = True, "cancelled: still running when the run's drain time ended"
        wall = now()
        if reporter:
            reporter.cancel()
        stop_polling.set()
        await polling
        await poller.poll()  # the requests that finished last
    data = RunData(spec, target, results, (spec.warmup_s, end), wall, poller.export())
    join_server(data)
    return data


def join_server(data: RunData) -> None:
    """Attaches cadence's record of each request to the client's (by request id), with the
    server's times mapped onto the client's clock."""
    server = data.server
    offset = server.get("clock_offset_s")
    if offset is None or not server.get("requests"):
        return
    by_id = {r["request_id"]: r for r in server["requests"]}

    def local(t: float | None) -> float | None:
        return None if t is None else round(t - offset, 6)

    for result in data.results:
        record = by_id.get(result.id)
        if record is None:
            continue
        result.server = {
            "submitted": local(record["submitted"]), "admitted": local(record["admitted"]),
            "first_token": local(record["first_token"]), "finished": local(record["finished"]),
            "queue_s": None if record["admitted"] is None else record["admitted"] - record["submitted"],
            "ttft_s": None if record["first_token"] is None else record["first_token"] - record["submitted"],
            "prefill_chunks": record["prefill_chunks"], "decode_steps": record["decode_steps"],
            "prompt_tokens": record["prompt_tokens"], "output_tokens": record["output_tokens"],
            "finish_reason": record["finish_reason"],
            "token_times": [local(t) for t in record["token_times"]],
            # disaggregated serving: the KV handoff, and the first decode step's dispatch
            "transfer_start": local(record.get("transfer_start")),
            "transfer_end": local(record.get("transfer_end")),
            "transfer_bytes": record.get("transfer_bytes", 0),
            "first_decode": local(record.get("first_decode")),
        }
    server["iterations_client_clock"] = [
        {**it, "start": local(it["start"])} for it in server.get("iterations", [])
    ]
