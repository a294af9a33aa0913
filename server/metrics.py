"""Prometheus metrics for the server, named after vLLM's where an equivalent exists.

Everything is measured on the server side from the scheduler's records (times from
time.monotonic()), so a client's view (which adds transport and queueing in the client) can be
compared against it. The scheduler's gauges and counters are read when scraped, from one
snapshot (`Scheduler.stats()`), so they are never stale and agree with each other.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from cadence.scheduler.request import RequestRecord
from cadence.scheduler.priority import REJECTION_REASONS
from cadence.scheduler.scheduler import IterationRecord, KVTransfer, Scheduler
from cadence.scheduler.stats import DraftStats, PoolStats, SchedulerStats
from cadence.server.served_models import ServedModels

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                    1.0, 1.5, 2.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_TRANSFER_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                     0.5, 1.0, 2.5)
_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
# Priorities that get a `priority` label of their own: these, and those the scheduler's priority
# classes and latency targets name. Every other value a client sends shares OTHER_PRIORITY, so
# clients cannot grow /metrics without bound by choosing priorities.
LABELLED_PRIORITIES = frozenset(range(-2, 4))
OTHER_PRIORITY = "other"


def priority_labels(scheduler: Scheduler) -> frozenset[int]:
    """The priorities this scheduler's metrics label one by one (`LABELLED_PRIORITIES`)."""
    config = scheduler.config
    return LABELLED_PRIORITIES | {p for _, p in config.priority_classes.rules} | set(config.slo.ttft) | set(config.slo.itl)


# The scheduler's readings (`scheduler.stats.SchedulerStats`), read in one call when scraped:
# name -> (type, help, the value from the snapshot). Gauges are "gauge", counters "counter"
# (exposed with _total). vLLM's own names for some (what routers and vLLM dashboards read)
# follow as aliases.
_READINGS: dict[str, tuple[str, str, Callable[[SchedulerStats], float]]] = {
    "cadence:num_requests_running": ("gauge", "Requests holding a KV slot.", lambda s: s.num_running),
    "cadence:num_requests_waiting": ("gauge", "Requests queued for a slot.", lambda s: s.num_waiting),
    "cadence:kv_cache_usage_perc": ("gauge", "Fraction of the KV page pool held (0-1).", lambda s: s.kv_usage),
    "cadence:kv_pages_used": ("gauge", "KV pages held by requests.", lambda s: s.kv_pages_used),
    "cadence:kv_pages_total": ("gauge", "KV pages in the pool.", lambda s: s.kv_pages_total),
    "cadence:kv_pages_cached": ("gauge", "KV pages holding a reusable prefix, held by requests or evictable.",
                                lambda s: s.kv_pages_cached),
    "cadence:kv_page_utilization_perc": (
        "gauge", "Of the token slots in held KV pages, the fraction holding a real token (0-1).",
        lambda s: s.kv_page_utilization),
    "cadence:num_preemptions_total": (
        "gauge", "Requests preempted (KV dropped, recomputed later): the pool was full, or a better "
        "priority needed the room.", lambda s: s.preemptions),
    "cadence:num_priority_preemptions_total": (
        "gauge", "Of those, preempted to make room for a request of a better priority.",
        lambda s: s.priority_preemptions),
    "cadence:compilations_after_warmup": (
        "gauge", "XLA compilations since warm-up ended (should stay 0).", lambda s: s.compilations_after_warmup),
    "cadence:compilations_on_demand": (
        "gauge", "XLA compilations of the programs warm-up left for their first use (--warmup=needed), "
        "counted apart from compilations_after_warmup.", lambda s: s.compilations_on_demand),
    "cadence:kv_transfer_backlog": (
        "gauge", "Disaggregated: prefilled requests waiting for the decode pool's slots or pages.",
        lambda s: s.transfer_backlog),
    "cadence:kv_transfers_in_flight": (
        "gauge", "Disaggregated: requests whose KV is on its way to the decode pool.",
        lambda s: s.transfers_in_flight),
    "cadence:prefix_cache_queries": ("counter", "Prompt tokens looked up in the prefix cache at admission "
                                     "(vLLM's prefix_cache_queries).", lambda s: s.prefix_queries),
    "cadence:prefix_cache_hits": ("counter", "Of those, tokens whose KV the cache held, not prefilled "
                                  "(vLLM's prefix_cache_hits).", lambda s: s.prefix_hits),
    "cadence:prefix_cache_host_hits": ("counter", "Of the prefix cache's hits, tokens whose KV was copied back "
                                       "from its host tier (--host_kv_cache_memory).", lambda s: s.host_kv_hits),
    "cadence:host_kv_cache_pages": ("gauge", "KV pages the prefix cache's host tier holds.",
                                    lambda s: s.host_kv_pages),
    "cadence:host_kv_cache_bytes": ("gauge", "Bytes of host memory those pages take.", lambda s: s.host_kv_bytes),
    "cadence:kv_pages_evicted": ("counter", "Cached KV pages evicted (their prefix forgotten) to make room.",
                                 lambda s: s.kv_pages_evicted),
    "cadence:prompt_tokens_forked": ("counter", "Prompt tokens the later choices of an n > 1 request took "
                                     "from the first one's KV, not prefilled.", lambda s: s.forked_tokens),
    "cadence:spec_decode_num_drafts": ("counter", "Speculative decoding: verify steps' rows that drafted "
                                       "(vLLM's spec_decode_num_drafts).", lambda s: s.spec_drafts),
    "cadence:spec_decode_num_draft_tokens": ("counter", "Draft tokens verified (vLLM's "
                                             "spec_decode_num_draft_tokens).", lambda s: s.spec_draft_tokens),
    "cadence:spec_decode_num_accepted_tokens": ("counter", "Of those, accepted: tokens decoded beyond "
                                                "one per step (vLLM's spec_decode_num_accepted_tokens).",
                                                lambda s: s.spec_accepted_tokens),
}
_VLLM_NAMES = {
    "vllm:num_requests_running": "cadence:num_requests_running",
    "vllm:num_requests_waiting": "cadence:num_requests_waiting",
    "vllm:kv_cache_usage_perc": "cadence:kv_cache_usage_perc",
    "vllm:prefix_cache_queries": "cadence:prefix_cache_queries",
    "vllm:prefix_cache_hits": "cadence:prefix_cache_hits",
    "vllm:spec_decode_num_drafts": "cadence:spec_decode_num_drafts",
    "vllm:spec_decode_num_draft_tokens": "cadence:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "cadence:spec_decode_num_accepted_tokens",
}
# The draft model's (`--draft_model`), reported only where one drafts.
_DRAFT_READINGS: dict[str, tuple[str, str, Callable[[DraftStats], float]]] = {
    "cadence:draft_model_draft_tokens": ("counter", "Of the draft tokens verified, the draft model's (the "
                                         "rest are prompt lookup's or a prediction's).", lambda d: d.draft_tokens),
    "cadence:draft_model_accepted_tokens": ("counter", "Of those, accepted.", lambda d: d.accepted_tokens),
    "cadence:draft_model_caught_up_tokens": ("counter", "Tokens the draft model prefilled to catch a row's "
                                             "draft KV up with its sequence.", lambda d: d.caught_up_tokens),
    "cadence:draft_model_evicted_rows": ("counter", "Rows whose draft KV gave its pages to others (they catch "
                                         "up from their first token if they draft again).", lambda d: d.evicted_rows),
    "cadence:draft_model_kv_pages_used": ("gauge", "Pages of the draft model's KV pool holding rows' draft KV.",
                                          lambda d: d.kv_pages_used),
    "cadence:draft_model_kv_pages_total": ("gauge", "Pages in the draft model's KV pool.",
                                           lambda d: d.kv_pages_total),
}
# Per pool ("colocated", or "prefill" and "decode").
_POOL_READINGS: dict[str, tuple[str, Callable[[PoolStats], float]]] = {
    "cadence:pool_queue_length": ("Requests waiting for the pool: the queue for the one that admits, "
                                  "the transfer backlog for the decode pool.", lambda p: p.queue_length),
    "cadence:pool_requests_running": ("Requests holding a slot of the pool.", lambda p: p.running),
    "cadence:pool_kv_pages_used": ("KV pages of the pool held by requests.", lambda p: p.kv_pages_used),
    "cadence:pool_kv_pages_total": ("KV pages in the pool.", lambda p: p.kv_pages_total),
}


class _SchedulerReadings:
    """The scheduler's gauges and counters, from one `Scheduler.stats()` per scrape (a
    prometheus Gauge or Counter cannot take a function per scrape for all of them at once)."""

    def __init__(self, scheduler: Scheduler, model_name: str, label: Callable[[int], str]):
        self.scheduler, self.model_name, self.label = scheduler, model_name, label

    def _family(self, name: str, kind: str, doc: str, value: float):
        family = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(name, doc, labels=["model_name"])
        family.add_metric([self.model_name], value)
        return family

    def collect(self):
        stats = self.scheduler.stats()
        readings = {**_READINGS, **{alias: _READINGS[name] for alias, name in _VLLM_NAMES.items()}}
        # vLLM v0's name for the usage, still read by some routers.
        readings["vllm:gpu_cache_usage_perc"] = (
            "gauge", "Fraction of the KV page pool held (0-1); vLLM v0's name.", lambda s: s.kv_usage)
        for name, (kind, doc, value) in readings.items():
            yield self._family(name, kind, doc, value(stats))
        for name, (kind, doc, value) in (_DRAFT_READINGS.items() if stats.draft else ()):
            yield self._family(name, kind, doc, value(stats.draft))
        for name, (doc, value) in _POOL_READINGS.items():
            family = GaugeMetricFamily(name, doc, labels=["model_name", "pool"])
            for pool in stats.pools:
                family.add_metric([self.model_name, pool.name], value(pool))
            yield family
        rejected = CounterMetricFamily(
            "cadence:requests_rejected", "Requests refused with 429 at submission, by reason: the "
            "queue was full, or the request was predicted to miss its class's TTFT or ITL target.",
            labels=["model_name", "reason"])
        for reason in REJECTION_REASONS:
            rejected.add_metric([self.model_name, reason], stats.rejections.get(reason, 0))
        yield rejected
        waiting = GaugeMetricFamily("cadence:num_requests_waiting_by_priority",
                                    "Requests queued for a slot, per priority.",
                                    labels=["model_name", "priority"])
        counts = collections.Counter({"0": 0})
        for priority, count in stats.waiting_by_priority.items():
            counts[self.label(priority)] += count
        for label, count in sorted(counts.items()):
            waiting.add_metric([self.model_name, label], count)
        yield waiting


class _LoraReadings:
    """vLLM's `lora_requests_info`: the adapters running requests use and those queued ones
    use, as labels (comma-separated names), beside the bank's size; its value is the time of
    the reading."""

    def __init__(self, models: ServedModels):
        self.models = models

    def collect(self):
        running, waiting = self.models.in_use()
        for name in ("cadence:lora_requests_info", "vllm:lora_requests_info"):
            family = GaugeMetricFamily(name, "LoRA adapters in use: running_lora_adapters by requests "
                                       "holding a KV slot, waiting_lora_adapters by queued ones.",
                                       labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"])
            family.add_metric([str(self.models.slots), ",".join(waiting), ",".join(running)], time.time())
            yield family


# What the server observes itself, from the scheduler's request, iteration and transfer records:
# (attribute, type, name, help, the label besides model_name or None, a histogram's buckets), in
# the order /metrics lists them. A family with a label of its own is kept whole (`.labels(...)`
# when observing), with the default priority's series and each pool's there from the start; one
# without is kept as its one series. Per-priority latencies sum over the label for all requests.
_OBSERVED = (
    ("ttft", Histogram, "cadence:time_to_first_token_seconds", "Submission to first token, server side.",
     "priority", _LATENCY_BUCKETS),
    ("itl", Histogram, "cadence:inter_token_latency_seconds", "Gap between consecutive output tokens.",
     "priority", _LATENCY_BUCKETS),
    ("e2e", Histogram, "cadence:e2e_request_latency_seconds", "Submission to finish.", "priority",
     _LATENCY_BUCKETS),
    ("queue", Histogram, "cadence:request_queue_time_seconds", "Time waiting for a KV slot (the first time).",
     "priority", _LATENCY_BUCKETS),
    ("prefill", Histogram, "cadence:request_prefill_time_seconds", "Admission to first token.", None,
     _LATENCY_BUCKETS),
    ("decode", Histogram, "cadence:request_decode_time_seconds", "First token to finish.", None,
     _LATENCY_BUCKETS),
    ("iteration_tokens", Histogram, "cadence:iteration_tokens_total",
     "Tokens (decode + prefill) per scheduler iteration.", None, _TOKEN_BUCKETS),
    ("prompt_tokens", Counter, "cadence:prompt_tokens", "Prompt tokens processed.", None, None),
    ("generation_tokens", Counter, "cadence:generation_tokens", "Output tokens generated.", None, None),
    ("finished", Counter, "cadence:request_success", "Finished requests by finish reason.",
     "finished_reason", None),
    ("prefill_programs", Counter, "cadence:prefill_programs", "Packed prefill programs run (each carries "
     "every prompt chunk an iteration planned, normally in one).", None, None),
    ("prefill_chunks", Counter, "cadence:prefill_chunks", "Prompt chunks prefilled; divided by "
     "cadence:prefill_programs_total, the chunks one program carried.", None, None),
    ("transfer_seconds", Histogram, "cadence:kv_transfer_seconds", "Disaggregated: a request's KV, from "
     "ready on the prefill device to landed on the decode device.", None, _TRANSFER_BUCKETS),
    ("transfer_bytes", Counter, "cadence:kv_transfer_bytes", "Disaggregated: KV bytes moved from the "
     "prefill pool to the decode pool.", None, None),
    # Each engine's pool: "colocated", or "prefill" and "decode".
    ("busy", Counter, "cadence:pool_busy_seconds", "Wall time of each pool's iterations that ran a "
     "program; its rate is the pool's busy fraction.", "pool", None),
)


class Metrics:
    """The server's /metrics: the families of `_OBSERVED` as attributes, fed by the scheduler's
    listeners, and the scheduler's own readings (`_SchedulerReadings`) read when scraped."""

    def __init__(self, scheduler: Scheduler, model_name: str, models: ServedModels | None = None):
        self.registry = r = CollectorRegistry()
        self._labelled = priority_labels(scheduler)
        self._labels = labels = {"model_name": model_name}
        at_start = {"priority": ("0",), "pool": tuple(pool.name for pool in scheduler.pools)}
        for attribute, kind, name, doc, label, buckets in _OBSERVED:
            names = ["model_name"] if label is None else ["model_name", label]
            family = kind(name, doc, names, registry=r, **({} if buckets is None else {"buckets": buckets}))
            for value in at_start.get(label, ()):
                family.labels(**{label: value}, **labels)
            setattr(self, attribute, family if label else family.labels(**labels))
        r.register(_SchedulerReadings(scheduler, model_name, self.priority_label))
        if models is not None and models.slots:
            r.register(_LoraReadings(models))
        scheduler.listeners.append(self.on_request)
        scheduler.iteration_listeners.append(self.on_iteration)
        scheduler.transfer_listeners.append(self.on_transfer)

    def priority_label(self, priority: int) -> str:
        return str(priority) if priority in self._labelled else OTHER_PRIORITY

    def on_request(self, record: RequestRecord) -> None:  # scheduler thread
        self.finished.labels(finished_reason=record.finish_reason, **self._labels).inc()
        self.prompt_tokens.inc(record.prompt_tokens)
        self.generation_tokens.inc(record.output_tokens)
        labels = {"priority": self.priority_label(record.priority), **self._labels}
        self.e2e.labels(**labels).observe(record.finished - record.submitted)
        if record.queue_time is not None:
            self.queue.labels(**labels).observe(record.queue_time)
        if record.first_token is not None:
            self.ttft.labels(**labels).observe(record.first_token - record.submitted)
            self.decode.observe(record.finished - record.first_token)
            if record.admitted is not None:
                self.prefill.observe(record.first_token - record.admitted)
        times = record.token_times
        itl = self.itl.labels(**labels)
        for earlier, later in zip(times, times[1:]):
            itl.observe(later - earlier)

    def on_iteration(self, record: IterationRecord) -> None:  # a loop thread
        self.busy.labels(pool=record.pool, **self._labels).inc(record.wall)
        # (a verify step's accepted drafts are tokens beyond its one per decoding row)
        self.iteration_tokens.observe(record.decode_slots * record.decode_steps + record.accepted
                                      + record.prefill_tokens)
        self.prefill_programs.inc(record.prefill_programs)
        self.prefill_chunks.inc(record.prefill_chunks)

    def on_transfer(self, transfer: KVTransfer) -> None:  # the transfer watcher
        self.transfer_seconds.observe(transfer.end - transfer.start)
        self.transfer_bytes.inc(transfer.bytes)

    def render(self) -> bytes:
        return generate_latest(self.registry)
