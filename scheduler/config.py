"""The scheduler's configuration (`SchedulerConfig`), frozen, as the front doors build it."""

from __future__ import annotations

import dataclasses

from cadence.scheduler.policy import PolicyConfig
from cadence.scheduler.priority import SLO, PriorityClasses
from cadence.scheduler.speculative import SpeculativeConfig

KV_RESERVATIONS = ("live", "max")


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    policy: PolicyConfig = PolicyConfig()
    max_queue: int = 256  # waiting requests beyond this are refused with Overloaded
    # "live": a request holds the pages its written tokens need, growing as it goes.
    # "max": it holds max_seq_len tokens' worth from its first chunk on, as a contiguous slot
    # does (vLLM's "Orca (Max)" baseline): the comparison point for benchmarks.
    kv_reservation: str = "live"
    # Automatic prefix caching: a prompt's leading tokens whose KV some request computed already
    # (and that are not evicted yet) are reused, not prefilled again: whole pages by key, the
    # rest copied from the cached page agreeing longest (`scheduler.prefix_cache`).
    prefix_caching: bool = True
    # Bytes of host memory for the prefix cache's second tier (`scheduler.host_cache`): full
    # pages the device's cache evicts are copied there and back on a later hit instead of being
    # computed again. 0: no host tier.
    host_kv_cache_bytes: int = 0
    # What else the KV depends on besides the tokens (the model, its weights, the compute
    # dtype), folded into every page's key.
    cache_namespace: str = ""
    # The priority of a request that sends none, from its prompt's length (`scheduler.priority`).
    priority_classes: PriorityClasses = PriorityClasses()
    # Per-priority latency targets: a request predicted to miss its class's is refused at once.
    slo: SLO = SLO()
    # Seconds an iteration should take while requests decode: each iteration's prefill is sized
    # to it by the fitted cost of an iteration (`scheduler.cost`), so that a long prompt's chunks
    # stretch no stream's inter-token gap past it. None: chunks are sized by tokens alone.
    itl_target: float | None = None
    # Speculative decoding's drafts (prompt lookup), when the engine has a verify program
    # (`EngineConfig.speculative_tokens` > 0).
    speculative: SpeculativeConfig = SpeculativeConfig()

    def __post_init__(self) -> None:
        if self.itl_target is not None and not (0 < self.itl_target < float("inf")):
            raise ValueError(f"itl_target must be positive seconds, got {self.itl_target}")
        if self.host_kv_cache_bytes < 0:
            raise ValueError(f"host_kv_cache_bytes must be >= 0, got {self.host_kv_cache_bytes}")
        if self.host_kv_cache_bytes and not self.prefix_caching:
            raise ValueError("a host tier (--host_kv_cache_memory) holds the prefix cache's evicted "
                             "pages: it needs the prefix cache on (drop --noprefix_caching)")
        if self.kv_reservation not in KV_RESERVATIONS:
            raise ValueError(f"kv_reservation must be one of {KV_RESERVATIONS}, got {self.kv_reservation!r}")
