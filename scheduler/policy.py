"""The policy: a pure planner that decides what the next iteration runs.

    plan = make_plan(running, waiting, free_slots, config, pages)

It reads request state and returns a `Plan` (requests to admit, prefill chunks, requests to
decode); it never touches the engine or mutates a request. A waiting request whose prompt
starts with cached pages has them as `prefix` and `prefilled` already (the scheduler looked them
up): its prefill starts after them. Two policies:

- `chunked` (default, after Sarathi-Serve): every decoding request advances every iteration;
  prefill fills what is left of a per-iteration token budget, at most `chunk` tokens per request
  per iteration, all of them in one packed prefill program (each chunk charged its size padded
  to the engine's pack block, and no more than one program holds). At most `max_partial_prefills` long prompts (more than one chunk) are in flight
  at once, while short ones are admitted whenever a slot is free, even past long ones waiting;
  the shortest remaining prompt is served first. A chat that arrives behind long documents thus
  reaches its first token within an iteration or two instead of waiting for the documents.
- `prefill-first`: a waiting prompt is admitted and prefilled whole (in as many chunk programs as
  it takes) in one iteration during which no decode runs: the classic baseline, and the source
  of the prefill-decode interference cadence exists to remove.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from cadence.scheduler.request import Request, State

POLICIES = ("chunked", "prefill-first")
MIN_PREFILL_TOKENS = 16


@dataclasses.dataclass(frozen=True)
class PolicyConfig:
    name: str = "chunked"
    token_budget: int = 256  # tokens per iteration, decode and prefill together
    chunk: int = 256  # most prompt tokens one request prefills per iteration
    max_partial_prefills: int = 2  # long prompts (more than one chunk) prefilling at once
    # The engine's packed prefill (set by the scheduler from the engine): chunks are laid out on
    # multiples of `pack_block` tokens, at most `pack_tokens` per program. The chunked policy
    # charges each chunk its padded size and plans at most one program's worth per iteration.
    pack_block: int = 1
    pack_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.name not in POLICIES:
            raise ValueError(f"unknown policy {self.name!r}; choose one of {', '.join(POLICIES)}")
        if self.chunk < 1 or self.token_budget < 1 or self.max_partial_prefills < 1:
            raise ValueError("token_budget, chunk and max_partial_prefills must all be >= 1")
        if self.pack_block < 1 or (self.pack_tokens is not None and self.pack_tokens < self.pack_block):
            raise ValueError("pack_block must be >= 1 and pack_tokens >= pack_block")

    def padded(self, tokens: int) -> int:
        return -(-tokens // self.pack_block) * self.pack_block


@dataclasses.dataclass(frozen=True)
class Chunk:
    request: Request
    start: int
    length: int

    @property
    def final(self) -> bool:
        return self.start + self.length == self.request.prefill_len


@dataclasses.dataclass
class Plan:
    admit: list[Request] = dataclasses.field(default_factory=list)
    prefill: list[Chunk] = dataclasses.field(default_factory=list)
    decode: list[Request] = dataclasses.field(default_factory=list)
    steps: int = 1  # decode steps each request of `decode` runs, in one dispatch

    @property
    def empty(self) -> bool:
        return not (self.admit or self.prefill or self.decode)


@dataclasses.dataclass(frozen=True)
class PageBudget:
    """The KV pages the plan may still hand out, so that admission follows memory, not slots.

    A request costs the pages its work this iteration adds to what it holds; with `reserve`
    (tokens, the contiguous baseline) it costs a whole reservation once, then nothing. A waiting
    request's prefix-cache hit (`Request.prefix`) needs no new pages, but the cached pages of it
    that nobody holds leave the free count when it takes them."""

    free: int
    page_size: int
    reserve: int | None = None

    def cost(self, r: Request, end: int) -> int:
        tokens = self.reserve or end
        return max(0, -(-tokens // self.page_size) - len(r.pages) - len(r.prefix)) + r.prefix_evictable


def wants_decode(r: Request) -> bool:
    return r.state is State.DECODING and r.dispatched < r.max_tokens


def _is_long(r: Request, config: PolicyConfig) -> bool:
    """A prompt that needs more than one chunk: it holds a partial prefill across iterations."""
    return r.prefill_len - r.prefilled > config.chunk


def make_plan(
    running: Sequence[Request], waiting: Sequence[Request], free_slots: int, config: PolicyConfig,
    pages: PageBudget | None = None,
) -> Plan:
    """`pages`: admit a request only if the pages its first chunk needs are free after what the
    running requests' next steps need (None: no limit). The scheduler still reserves the pages
    before dispatch, and preempts if a running request cannot grow."""
    pages = pages or PageBudget(free=2**62, page_size=1)
    if config.name == "prefill-first":
        return _prefill_first(running, waiting, free_slots, config, pages)
    return _chunked(running, waiting, free_slots, config, pages)


def running_cost(running: Sequence[Request], config: PolicyConfig, pages: PageBudget) -> int:
    """Pages the running requests' next steps need: a decode's next token, a partial prefill's
    next chunk (at most)."""
    cost = 0
    for r in running:
        if wants_decode(r):
            cost += pages.cost(r, r.prompt_len + r.dispatched)
        elif r.state is State.PREFILLING:
            cost += pages.cost(r, min(r.prefill_len, r.prefilled + config.chunk))
    return cost


def _chunks(r: Request, start: int, budget: int, chunk: int, block: int = 1) -> list[Chunk]:
    """Chunks of at most `chunk` tokens from `start` whose sizes padded to `block` fit
    `budget`; a chunk that is not the prompt's last is a whole number of blocks."""
    out = []
    while start < r.prefill_len:
        n = min(chunk, r.prefill_len - start)
        if -(-n // block) * block > budget:
            n = budget // block * block  # what fits, in whole blocks
        if n <= 0:
            break
        out.append(Chunk(r, start, n))
        start, budget = start + n, budget - -(-n // block) * block
    return out


def _prefill_first(running, waiting, free_slots, config, pages) -> Plan:
    if waiting and free_slots and pages.cost(waiting[0], waiting[0].prefill_len) <= pages.free - running_cost(running, config, pages):
        r = waiting[0]
        return Plan(admit=[r], prefill=_chunks(r, r.prefilled, r.prefill_len, config.chunk))
    return Plan(decode=[r for r in running if wants_decode(r)])


def _chunked(running, waiting, free_slots, config, pages) -> Plan:
    plan = Plan(decode=[r for r in running if wants_decode(r)])
    free_pages = pages.free - running_cost(running, config, pages)
    # Decodes alone may fill the budget; a small floor keeps prompts from starving. Prefill
    # counts padded tokens and stays within one packed program.
    budget = max(config.token_budget - len(plan.decode), MIN_PREFILL_TOKENS, config.pack_block)
    if config.pack_tokens is not None:
        budget = min(budget, config.pack_tokens)
    prefilling = [r for r in running if r.state is State.PREFILLING]
    long_prompts = sum(1 for r in prefilling if _is_long(r, config))
    for r in waiting:
        if free_slots == 0:
            break
        if _is_long(r, config) and long_prompts >= config.max_partial_prefills:
            continue  # enough long prompts in flight; a short one behind this may still pass
        cost = pages.cost(r, min(r.prefill_len, r.prefilled + config.chunk))
        if cost > free_pages:
            break  # memory, not slots, is what is short; first come, first served
        free_pages -= cost
        plan.admit.append(r)
        prefilling.append(r)
        long_prompts += _is_long(r, config)
        free_slots -= 1
    # Shortest remaining prompt first: a chat passes a document that is mid-prefill.
    prefilling.sort(key=lambda r: r.prefill_len - r.prefilled)
    for r in prefilling:
        if budget <= 0:
            break
        chunk = _chunks(r, r.prefilled, min(budget, config.padded(config.chunk)), config.chunk,
                        config.pack_block)
        plan.prefill.extend(chunk)
        budget -= sum(config.padded(c.length) for c in chunk)
    return plan
