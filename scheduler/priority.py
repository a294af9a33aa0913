"""Priority classes and SLO-aware admission: who runs first, and who is told no at the door.

    classes = PriorityClasses.parse("1024=1,8192=2")   # prompts > 1024 tokens: 1, > 8192: 2
    classes.of(prompt_tokens)                          # a request's priority when it sends none
    slo = SLO.parse(ttft="0=2,1=120", itl="0=0.25")    # per-priority targets, in seconds
    control = AdmissionControl(slo)                    # fed every IterationRecord (`observe`)
    control.check(priority, tokens_ahead)              # None, or the Rejection to answer with

A priority is an integer, lower first (vLLM's semantics); 0 unless the request or a class says
otherwise. The policy (`scheduler.policy`) orders, preempts and shares the prefill budget by
it; this module only decides what a request's priority is and whether to queue it at all.

Admission predicts a new request's time to first token from the prefill work queued ahead of
it (prompt tokens not yet prefilled, of its own priority or better, its own prompt included)
over the prefill rate the server measured in its recent iterations, plus the two iterations a
first token takes to reach the client (it is computed, then applied one iteration behind).
A request whose prediction exceeds its class's TTFT target by more than the margin is refused
at once (HTTP 429 with Retry-After: the seconds by which the queue ahead of it must shrink):
queueing it would only make it, and everything behind it, miss. Until the server has measured a
rate, everything is admitted.

An inter-token (ITL) target shapes the plan first (`prefill_limit`): while requests of a
priority with one are decoding, the prompts of worse priorities prefill at most what the
iteration can carry within the target, by the scheduler's fitted cost of an iteration
(`scheduler.cost`), never less than their `lower_share` floor. What that cannot save is
refused: a request is refused while the recent decode step exceeds by the margin the target of
a better priority that is running, or its own when nothing worse is running (when something
is, the cap is what serves it). The scheduler's `itl_target` (`--itl_target`) is such a target
for every request, without refusals: while anything decodes, the prefill of every prompt is
sized to it (at least one pack block an iteration, so prompts always move).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping

from cadence.scheduler.cost import IterationCost
from cadence.scheduler.policy import PrefillLimit, wants_decode
from cadence.scheduler.request import Request, State


def _pairs(text: str, what: str, value: Callable[[str], float]) -> dict[int, float]:
    """`K=V,K=V` (K an integer) into {K: V}."""
    out: dict[int, float] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, eq, val = item.partition("=")
        try:
            if not eq:
                raise ValueError
            k, v = int(key), value(val)
        except ValueError:
            raise ValueError(f"{what}: expected comma-separated INTEGER=VALUE pairs, got {item!r}") from None
        if k in out:
            raise ValueError(f"{what}: {k} is given twice")
        out[k] = v
    return out


@dataclasses.dataclass(frozen=True)
class PriorityClasses:
    """The priority a request gets when it sends none, from its prompt's length: `rules` are
    (tokens, priority) pairs, a prompt of more than `tokens` tokens taking that priority (the
    largest threshold it exceeds wins); shorter prompts get 0."""

    rules: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        if any(tokens < 0 for tokens, _ in self.rules):
            raise ValueError("priority class thresholds must be >= 0 tokens")
        object.__setattr__(self, "rules", tuple(sorted(self.rules)))

    @classmethod
    def parse(cls, text: str) -> PriorityClasses:
        """`TOKENS=PRIORITY[,...]`, e.g. `1024=1`: prompts longer than 1024 tokens get priority 1."""
        rules = _pairs(text, "--priority_classes", int)
        return cls(tuple(rules.items()))

    def of(self, prompt_tokens: int) -> int:
        priority = 0
        for tokens, p in self.rules:
            if prompt_tokens > tokens:
                priority = p
        return priority


@dataclasses.dataclass(frozen=True)
class SLO:
    """Per-priority latency targets in seconds (a priority with none is never refused for it)."""

    ttft: Mapping[int, float] = dataclasses.field(default_factory=dict)
    itl: Mapping[int, float] = dataclasses.field(default_factory=dict)
    margin: float = 0.25  # refuse only when the prediction exceeds the target by this fraction
    window: float = 10.0  # seconds of recent iterations the rates are measured over

    def __post_init__(self) -> None:
        for name, targets in (("ttft", self.ttft), ("itl", self.itl)):
            bad = [p for p, t in targets.items() if not (t > 0 and math.isfinite(t))]
            if bad:
                raise ValueError(f"SLO {name} targets must be positive seconds (priority {bad[0]})")
        if not (self.margin >= 0 and self.window > 0):
            raise ValueError("SLO margin must be >= 0 and window > 0")

    @classmethod
    def parse(cls, ttft: str = "", itl: str = "", margin: float = 0.25) -> SLO:
        """`PRIORITY=SECONDS[,...]` for each, e.g. ttft="0=2,1=120"."""
        return cls(_pairs(ttft, "--slo_ttft", float), _pairs(itl, "--slo_itl", float), margin)

    @property
    def active(self) -> bool:
        return bool(self.ttft or self.itl)


# Why a submission was refused (HTTP 429): the labels of cadence:requests_rejected_total.
REJECTION_REASONS = ("queue_full", "ttft_slo", "itl_slo")


@dataclasses.dataclass(frozen=True)
class Rejection:
    reason: str  # "ttft_slo" or "itl_slo" (REJECTION_REASONS)
    retry_after: int  # seconds, for the Retry-After header
    message: str


@dataclasses.dataclass(frozen=True)
class _Sample:
    end: float
    wall: float
    prefill_tokens: int
    decode_steps: int  # steps per decode dispatch (0: no decode ran)


class AdmissionControl:
    """The measured rates and the admission rule. `observe` runs on the loop threads, `check`
    on submitters' threads."""

    def __init__(self, slo: SLO, clock: Callable[[], float] = time.monotonic):
        self.slo, self.clock = slo, clock
        self._samples: collections.deque[_Sample] = collections.deque()
        self._lock = threading.Lock()

    def observe(self, start: float, wall: float, prefill_tokens: int, decode_slots: int,
                decode_steps: int) -> None:
        """One iteration's record (`scheduler.IterationRecord`'s fields)."""
        horizon = self.clock() - self.slo.window
        with self._lock:
            self._samples.append(_Sample(start + wall, wall, prefill_tokens, decode_steps if decode_slots else 0))
            while len(self._samples) > 1 and self._samples[0].end < horizon:
                self._samples.popleft()

    def _recent(self) -> list[_Sample]:
        with self._lock:
            samples = list(self._samples)
        horizon = self.clock() - self.slo.window
        recent = [s for s in samples if s.end >= horizon]
        return recent or samples[-1:]  # an idle server: its last measurement still stands

    def prefill_rate(self) -> float | None:
        """Prompt tokens per second over recent iterations that prefilled (None: none yet)."""
        prefilled = [s for s in self._recent() if s.prefill_tokens]
        seconds = sum(s.wall for s in prefilled)
        return sum(s.prefill_tokens for s in prefilled) / seconds if seconds > 0 else None

    def iteration_time(self) -> float | None:
        recent = self._recent()
        return sum(s.wall for s in recent) / len(recent) if recent else None

    def step_time(self) -> float | None:
        """Seconds per decode step over recent iterations that decoded: the server's ITL now."""
        decoded = [s for s in self._recent() if s.decode_steps]
        steps = sum(s.decode_steps for s in decoded)
        return sum(s.wall for s in decoded) / steps if steps else None

    def check(self, priority: int, tokens_ahead: int, running: frozenset[int] = frozenset()
              ) -> Rejection | None:
        """Whether to refuse a request of `priority` with `tokens_ahead` prompt tokens to
        prefill before its first token (its own included); `running`: the priorities of the
        requests running now."""
        slo = self.slo
        target = slo.ttft.get(priority)
        rate = None if target is None else self.prefill_rate()
        iteration = None if rate is None else self.iteration_time()
        if iteration is not None:
            predicted = tokens_ahead / rate + 2 * iteration
            if predicted > target * (1 + slo.margin):
                return Rejection(
                    "ttft_slo", max(1, math.ceil(predicted - target)),
                    f"the server is overloaded: a request of priority {priority} would wait about "
                    f"{predicted:.1f} s for its first token ({tokens_ahead} prompt tokens ahead at "
                    f"{rate:.0f} tokens/s), past its {target:g} s target; retry later")
        # Inter-token targets: its own, unless worse priorities are running (the policy caps
        # their prefill for it, and refusing it would not help), and those of better ones
        # running (its prefill would slow them).
        missed = [p for p in slo.itl
                  if (p < priority and p in running)
                  or (p == priority and not any(q > priority for q in running))]
        step = self.step_time() if missed else None
        for p in sorted(missed):
            if step is not None and step > slo.itl[p] * (1 + slo.margin):
                whose = "its" if p == priority else f"the running priority {p}'s"
                return Rejection(
                    "itl_slo", max(1, math.ceil(slo.window / 2)),
                    f"the server is overloaded: decode steps take {step * 1000:.0f} ms, past "
                    f"{whose} {slo.itl[p] * 1000:g} ms inter-token target; retry later")
        return None


def backlog(waiting: Iterable[Request], running: Iterable[Request]) -> dict[int, tuple[int, int]]:
    """Per priority: (requests waiting, prompt tokens waiting or mid-prefill), what admission
    (`tokens_ahead`) and the metrics read, taken by the admitting loop each iteration."""
    counts: dict[int, list[int]] = {}
    for r in waiting:
        entry = counts.setdefault(r.priority, [0, 0])
        entry[0] += 1
        entry[1] += r.prefill_len - r.prefilled
    for r in running:
        if r.state is State.PREFILLING:
            counts.setdefault(r.priority, [0, 0])[1] += r.prefill_len - r.prefilled
    return {p: (n, tokens) for p, (n, tokens) in counts.items()}


def tokens_ahead(r: Request, backlog: dict[int, tuple[int, int]], inbox: Iterable[Request]) -> int:
    """Prompt tokens to prefill before `r`'s first token: the backlog of its priority and
    better, those submitted since (`inbox`), and its own."""
    ahead = sum(tokens for p, (_, tokens) in backlog.items() if p <= r.priority)
    return ahead + sum(q.prompt_len for q in inbox if q.priority <= r.priority) + r.prompt_len


def prefill_limit(slo: SLO, target: float | None, cost: IterationCost, running: Iterable[Request]
                  ) -> PrefillLimit | None:
    """The prefill cap for the next iteration: with `target` (seconds, the scheduler's
    `itl_target`) every request's prefill, while anything decodes; with inter-token targets of
    priorities that are decoding, the prefill of worse ones, within the tightest. None while
    neither applies, or while `cost` has no model yet."""
    decoding = [r for r in running if wants_decode(r)]
    targeted = {r.priority for r in decoding} & slo.itl.keys()
    seconds = [slo.itl[p] for p in targeted] + ([target] if target is not None and decoding else [])
    if not seconds:
        return None
    budget = cost.prefill_seconds(min(seconds), decoding)
    if budget is None:
        return None
    return PrefillLimit(None if target is not None else max(targeted), budget, cost.prefill)
