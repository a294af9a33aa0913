"""The policy: a pure planner that decides what the next iteration runs.

    plan = make_plan(running, waiting, free_slots, config, pages)
    plan.steps = decode_steps(plan, running, most, free_pages, page_size)   # multi-step decode
    if speculates(plan, running, engine_config, speculative, split, model is not None):  # speculative
        drafts = propose_drafts(plan, k, context, page_size, free_pages, model)  # model: optional

It reads request state and returns a `Plan` (requests to admit, prefill chunks, requests to
decode); it never touches the engine or mutates a request (but for drafting: a drafting row's
acceptance record, and a draft model's own engine, which `propose_drafts` asks for drafts). A
waiting request whose prompt starts with cached pages has them as `prefix` and `prefilled`
already (the scheduler looked them up): its prefill starts after them. Two policies:

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

Priorities (`Request.priority`, lower first, vLLM's semantics; every request 0 unless a client
or the server's priority classes say otherwise). With all priorities equal, none of this
changes a plan. Otherwise (`order_waiting`, then the chunked policy):

- the waiting queue is served by priority, in queue order within one (a preempted request
  first among its equals), except that a class with requests waiting and none running has its
  first one served before everybody: every class keeps a request in flight;
- a waiting request that finds no free slot, or too few pages, preempts running requests of a
  strictly lower priority (the lowest first, the most recently admitted among them), never
  the earliest-admitted running request of a class, and only if that makes room; equal
  priorities never preempt each other;
- the prefill budget goes to the best priority prefilling first (shortest remaining first),
  but while lower classes have prompts prefilling they get at least `lower_share` of it (at
  least one pack block), whatever arrives above them;
- with a `PrefillLimit` (the scheduler's, from an inter-token target of a class that is
  decoding), the classes below it prefill at most what keeps the iteration within its seconds
  by its cost, never less than that floor.

A `PrefillLimit` for every request (an inter-token target for all, `--itl_target`) caps every
prompt's chunks the same way, at least one pack block an iteration going through. With neither,
prefill is sized by tokens alone.

Hence the starvation bound: the earliest-admitted request of every class is never preempted
for priority and decodes every iteration, its class prefills at least `lower_share` of the
budget per iteration (shortest remaining first within it), so a class never stops progressing,
and requests of one class are admitted in arrival order. A request can still lose its pages to
memory pressure (the lowest priority, most recently admitted goes first), as without
priorities.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from cadence.model.arith import cdiv
from cadence.scheduler.draft_model import DraftModel
from cadence.scheduler.request import Request, State
from cadence.scheduler.speculative import Drafter, SpeculativeConfig

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
    # With several priorities prefilling: the least share of the prefill budget the lower ones
    # get, so that documents below chats are slowed, never starved.
    lower_share: float = 0.25

    def __post_init__(self) -> None:
        if self.name not in POLICIES:
            raise ValueError(f"unknown policy {self.name!r}; choose one of {', '.join(POLICIES)}")
        if self.chunk < 1 or self.token_budget < 1 or self.max_partial_prefills < 1:
            raise ValueError("token_budget, chunk and max_partial_prefills must all be >= 1")
        if self.pack_block < 1 or (self.pack_tokens is not None and self.pack_tokens < self.pack_block):
            raise ValueError("pack_block must be >= 1 and pack_tokens >= pack_block")
        if not 0.0 <= self.lower_share <= 1.0:
            raise ValueError(f"lower_share must be in [0, 1], got {self.lower_share}")

    def padded(self, tokens: int) -> int:
        return cdiv(tokens, self.pack_block) * self.pack_block


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
    drafted: int = 0  # speculative decoding: draft tokens the iteration's verify step scores
    # Running requests to preempt before admitting (`admit` needs their slots or pages): lower
    # priorities than those admitted.
    preempt: list[Request] = dataclasses.field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not (self.admit or self.prefill or self.decode or self.preempt)


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
    # Pages releasing a running request would free (those it holds alone); None: all it holds.
    releasable: Callable[[Request], int] | None = None

    def cost(self, r: Request, end: int) -> int:
        tokens = self.reserve or end
        return max(0, cdiv(tokens, self.page_size) - len(r.pages) - len(r.prefix)) + r.prefix_evictable

    def freed(self, r: Request) -> int:
        return len(r.pages) if self.releasable is None else self.releasable(r)


def wants_decode(r: Request) -> bool:
    return r.state is State.DECODING and r.dispatched < r.max_tokens


def decoded_end(r: Request, steps: int) -> int:
    """Positions `r` holds once `steps` decode steps from its next one are written: they
    write the KV of positions prompt_len + dispatched - 1 onwards."""
    return r.prompt_len + r.dispatched + steps - 1


def _is_long(r: Request, config: PolicyConfig) -> bool:
    """A prompt that needs more than one chunk: it holds a partial prefill across iterations."""
    return r.prefill_len - r.prefilled > config.chunk


def _firsts(requests: Sequence[Request]) -> dict[int, Request]:
    """The first request of each priority in `requests`, by priority."""
    firsts: dict[int, Request] = {}
    for r in requests:
        firsts.setdefault(r.priority, r)
    return firsts


def order_waiting(running: Sequence[Request], waiting: Sequence[Request]) -> list[Request]:
    """The order admission considers `waiting` in (queue order): by priority, except that the
    first waiting request of each class with none running comes first."""
    if all(r.priority == waiting[0].priority for r in waiting):
        return list(waiting)  # one class: queue order (running ones cannot be of another here)
    ordered = sorted(waiting, key=lambda r: r.priority)  # stable: queue order within a class
    present = {r.priority for r in running}
    firsts = {p: r for p, r in _firsts(ordered).items() if p not in present}
    return [*firsts.values(), *(r for r in ordered if firsts.get(r.priority) is not r)]


def protected(running: Sequence[Request]) -> set[Request]:
    """The earliest-admitted running request of each class (`running` is in slot-assignment
    order): never preempted for priority."""
    return set(_firsts(running).values())


@dataclasses.dataclass(frozen=True)
class PrefillLimit:
    """This iteration's prefill takes at most `seconds` by `cost` (of a plan's chunks, as
    (start, length) pairs: `scheduler.cost`) where it takes chunks of requests of a priority
    worse than `priority` (of every request: None), but those take at least a floor of tokens:
    below a priority, `lower_share` of the budget together (the lowest classes `lower_share`
    of that); for every request, a pack block for each of the best class prefilling and the
    classes below it. What keeps the iteration, and so the gap between two tokens of each stream decoding in
    it, within an inter-token target (`--itl_target`, or a priority's `--slo_itl`:
    `scheduler.priority`)."""

    priority: int | None
    seconds: float
    cost: Callable[[Sequence[tuple[int, int]]], float]

    def limits(self, r: Request) -> bool:
        return self.priority is None or r.priority > self.priority


def make_plan(
    running: Sequence[Request], waiting: Sequence[Request], free_slots: int, config: PolicyConfig,
    pages: PageBudget | None = None, limit: PrefillLimit | None = None,
) -> Plan:
    """`waiting` in queue order. `pages`: admit a request only if the pages its first chunk
    needs are free after what the running requests' next steps need (None: no limit). The
    scheduler still reserves the pages before dispatch, and preempts if a running request
    cannot grow. `limit`: the chunked policy's cap on lower priorities' prefill."""
    pages = pages or PageBudget(free=2**62, page_size=1)
    waiting = order_waiting(running, waiting) if waiting else []
    if config.name == "prefill-first":
        return _prefill_first(running, waiting, free_slots, config, pages)
    return _chunked(running, waiting, free_slots, config, pages, limit)


def pages_wanted(decoding: Sequence[Request], steps: int, page_size: int) -> int:
    """New pages the decoding requests need to write `steps` more positions each."""
    return sum(max(0, cdiv(decoded_end(r, steps), page_size) - len(r.pages)) for r in decoding)


def decode_steps(plan: Plan, running: Sequence[Request], most: int, free_pages: int, page_size: int) -> int:
    """Decode steps for the iteration's one dispatch (multi-step decoding, the engine's
    `decode_steps` at most): 1, unless the plan does nothing but decode, every request of the
    pool (`running`) is decoding (none mid-prompt, none with KV on its way in) and none has stop
    strings (the host finds those in text) or a grammar (the host fills its masks step by step);
    then as many as `most` allows and every request has tokens left for, so none ends sooner on
    its length, none masking its stop ids (min_tokens) samples past its mask, and the free
    pages hold, so nobody is preempted for them."""
    if most == 1 or plan.admit or plan.prefill or not plan.decode:
        return 1
    if any(r.state is not State.DECODING or r.params.stop or r.matcher is not None for r in running):
        return 1
    steps = min(most, min(r.max_tokens - r.dispatched for r in plan.decode))
    # A row masking its stop ids (min_tokens) unmasks between dispatches, never inside one.
    steps = min([steps] + [r.params.min_tokens - r.dispatched for r in plan.decode if r.masks_stops()])
    return max(steps, 1) if pages_wanted(plan.decode, steps, page_size) <= free_pages else 1


def speculates(plan: Plan, running: Sequence[Request], engine_config, config: SpeculativeConfig,
               split=None, model: bool = False) -> bool:
    """Whether an iteration decodes speculatively: the engine has a verify program
    (`speculative_tokens`), the plan does nothing but decode, at most `speculative_batch` rows
    (beyond it a step costs its compute more than its weight read, and drafts stop paying),
    every request of the pool (`running`) decodes (none mid-prompt, none with KV on its way in),
    no split step is in flight (`split`), and some row wants drafts this step from its own
    sequence or (with `model`: a draft model serves this pool) the draft model. Each decoding
    request's records count the step (`Drafter.wants`) whatever the answer, which its drafter
    keeps for the step (`Drafter.drafting`)."""
    if (not engine_config.speculative_tokens or plan.admit or plan.prefill or plan.preempt
            or not plan.decode or len(plan.decode) > engine_config.speculative_batch or split is not None):
        return False
    if any(r.state is not State.DECODING for r in running):
        return False
    wanting = False
    for r in plan.decode:
        r.drafter = r.drafter or Drafter(config, r.params.prediction)
        wanting |= r.drafter.wants(model)
    return wanting


def propose_drafts(plan: Plan, k: int, context: int, page_size: int, free_pages: int,
                   model: DraftModel | None = None) -> dict[Request, list[int]]:
    """Each drafting row's drafts: up to `k`, none past its max_tokens (a verify step's last
    token is the target's own) or `context`, and under a grammar those it allows (the first it
    does not, and all after, are dropped). They come from the row's own sequence
    (`Drafter.propose`: its prediction where its answer follows it, else its n-grams), and
    where those found nothing from the draft `model` if there is one (all such rows in one
    call), each source only while its record wants drafts. A source that found nothing sits
    out a few steps. Empty unless some row drafted, and if the pages the drafts need are not
    free: drafting never preempts."""
    drafts: dict[Request, list[int]] = {}
    asked: dict[Request, tuple[list[int], int]] = {}  # the draft model's rows
    for r in plan.decode:
        if r.state is not State.DECODING or r.drafter is None or not r.drafter.drafting:
            continue
        room = min(k, r.max_tokens - r.dispatched - 1, context - r.prompt_len - r.dispatched)
        if r.masks_stops():  # every position the step samples stays within its mask
            room = min(room, r.params.min_tokens - r.dispatched - 1)
        if room <= 0:
            continue
        if r.drafter.own:
            own = _allowed(r, r.drafter.propose(r.prompt_ids, r.output_ids, room))
            if own:
                drafts[r] = own
                continue
            r.drafter.acceptance.observe(0, 0)  # the sequence offered nothing
        if model is not None and r.drafter.by_model:
            asked[r] = (r.prompt_ids + r.output_ids, room)
    if asked:
        proposed = model.propose(asked)
        for r in asked:
            r.drafter.drafted_by_model()
            proposal = _allowed(r, proposed.get(r, []))
            if proposal:
                drafts[r] = proposal
            else:
                r.drafter.model_acceptance.observe(0, 0)
    if not drafts:
        return {}
    steps = 1 + max(len(d) for d in drafts.values())
    return drafts if pages_wanted(plan.decode, steps, page_size) <= free_pages else {}


def _allowed(r: Request, proposal: list[int]) -> list[int]:
    """The start of `proposal` that the row's grammar allows (all of it without one)."""
    return proposal[: r.matcher.allows(proposal)] if proposal and r.matcher is not None else proposal


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
        if cdiv(n, block) * block > budget:
            n = budget // block * block  # what fits, in whole blocks
        if n <= 0:
            break
        out.append(Chunk(r, start, n))
        start, budget = start + n, budget - cdiv(n, block) * block
    return out


def _prefill_first(running, waiting, free_slots, config, pages) -> Plan:
    if waiting and free_slots and pages.cost(waiting[0], waiting[0].prefill_len) <= pages.free - running_cost(running, config, pages):
        r = waiting[0]
        return Plan(admit=[r], prefill=_chunks(r, r.prefilled, r.prefill_len, config.chunk))
    return Plan(decode=[r for r in running if wants_decode(r)])


def _chunked(running, waiting, free_slots, config, pages, limit=None) -> Plan:
    plan = Plan(decode=[r for r in running if wants_decode(r)])
    free_pages = pages.free - running_cost(running, config, pages)
    # Decodes alone may fill the budget; a small floor keeps prompts from starving. Prefill
    # counts padded tokens and stays within one packed program.
    budget = max(config.token_budget - len(plan.decode), MIN_PREFILL_TOKENS, config.pack_block)
    if config.pack_tokens is not None:
        budget = min(budget, config.pack_tokens)
    prefilling = [r for r in running if r.state is State.PREFILLING]
    long_prompts = sum(1 for r in prefilling if _is_long(r, config))
    victims = _Victims(running, waiting, config, pages)
    for r in waiting:
        if _is_long(r, config) and long_prompts >= config.max_partial_prefills:
            if free_slots == 0:
                break
            continue  # enough long prompts in flight; a short one behind this may still pass
        cost = pages.cost(r, min(r.prefill_len, r.prefilled + config.chunk))
        if free_slots == 0 or cost > free_pages:
            # Memory or slots are short: room from lower priorities, or first come, first served.
            room = victims.make_room(r.priority, slots=0 if free_slots else 1,
                                     pages=max(0, cost - free_pages))
            if room is None:
                break
            taken, freed = room
            for v in taken:
                plan.preempt.append(v)
                if v in plan.decode:
                    plan.decode.remove(v)
                if v in prefilling:
                    prefilling.remove(v)
                    long_prompts -= _is_long(v, config)
            free_slots += len(taken)
            free_pages += freed
        free_pages -= cost
        plan.admit.append(r)
        prefilling.append(r)
        long_prompts += _is_long(r, config)
        free_slots -= 1
    # The best priority first, and among equals the shortest remaining prompt: a chat passes a
    # document that is mid-prefill. Lower priorities keep their share.
    prefilling.sort(key=lambda r: (r.priority, r.prefill_len - r.prefilled))
    best = [r for r in prefilling if r.priority == prefilling[0].priority] if prefilling else []
    lower = prefilling[len(best):]
    block = config.pack_block
    floor = max(block, int(budget * config.lower_share) // block * block)
    reserve = 0
    if lower:
        wanted = sum(config.padded(min(config.chunk, r.prefill_len - r.prefilled)) for r in lower)
        reserve = min(wanted, floor, budget)
    cap = _Cap(limit) if limit else None
    best_floor = lower_floor = 0
    if cap:
        if lower and limit.limits(best[0]):  # the best leave the lower their reserve
            cap.keep = limit.cost([(lower[0].prefilled, reserve)])
        if limit.priority is None:  # a target for everyone: each class moves a block at least
            best_floor, lower_floor = block, block if lower else 0
        elif limit.limits(best[0]):  # every class prefilling is below a decoding one: they
            # share the floor, the lowest their share of it
            lower_floor = min(reserve, max(block, int(floor * config.lower_share) // block * block))
            best_floor = floor - lower_floor
        else:  # the classes below a decoding one, not the best prefilling, share the floor
            lower_floor = floor
    left = _fill(plan, best, budget - reserve, config, cap, floor=best_floor)
    if cap:
        cap.keep = 0.0
    _fill(plan, lower, left + reserve, config, cap, floor=lower_floor)
    return plan


@dataclasses.dataclass
class _Cap:
    limit: PrefillLimit
    keep: float = 0.0  # seconds of it the requests being filled leave to those after them

    def tokens(self, r: Request, room: int, plan: Plan, config: PolicyConfig) -> int:
        """The most of `room` (padded tokens) whose chunk of `r`, beside the plan's, keeps its
        prefill within the limit."""
        seconds = self.limit.seconds - self.keep
        planned = [(c.start, c.length) for c in plan.prefill]
        for n in range(room // config.pack_block * config.pack_block, 0, -config.pack_block):
            length = min(n, config.chunk, r.prefill_len - r.prefilled)
            if self.limit.cost([*planned, (r.prefilled, length)]) <= seconds:
                return config.padded(length)
        return 0


def _fill(plan: Plan, requests: list[Request], budget: int, config: PolicyConfig,
          cap: _Cap | None = None, floor: int = 0) -> int:
    """Adds chunks of `requests`, in order, within `budget` padded tokens (and, for those
    `cap` limits, within its seconds, but together at least `floor` tokens); returns what is
    left of `budget`."""
    for r in requests:
        if budget <= 0:
            break
        room = min(budget, config.padded(config.chunk))
        limited = cap is not None and cap.limit.limits(r)
        if limited:
            room = min(room, max(floor, cap.tokens(r, room, plan, config)))
        chunk = _chunks(r, r.prefilled, room, config.chunk, config.pack_block)
        plan.prefill.extend(chunk)
        used = sum(config.padded(c.length) for c in chunk)
        budget -= used
        if limited:
            floor = max(0, floor - used)
    return budget


class _Victims:
    """Running requests a waiting one of a better priority may preempt (`make_room`)."""

    def __init__(self, running: Sequence[Request], waiting: Sequence[Request], config: PolicyConfig,
                 pages: PageBudget):
        self.config, self.pages = config, pages
        # Kept: each class's first, and the first sequence of a group whose later ones wait to
        # take its prompt's pages (`Request.forking`).
        keep = protected(running) | {r.fork_parent for r in waiting if r.forking}
        # Lowest priority first, the most recently admitted first among equals. A request in
        # the middle of a handoff (disaggregated) is not preempted here.
        self.candidates = sorted(
            (r for r in reversed(running)
             if r not in keep and r.state in (State.PREFILLING, State.DECODING)
             and not r.pooled_dispatched),
            key=lambda r: -r.priority)

    def frees(self, r: Request) -> int:
        """Pages preempting `r` gives back: those it holds alone, and what its next step would
        have taken."""
        return self.pages.freed(r) + running_cost([r], self.config, self.pages)

    def make_room(self, priority: int, slots: int, pages: int) -> tuple[list[Request], int] | None:
        """The fewest candidates of priority worse than `priority`, in order, whose preemption
        frees `slots` slots and `pages` pages, and the pages they free; None (nothing taken)
        if they cannot."""
        taken: list[Request] = []
        freed = 0
        for r in self.candidates:
            if slots <= len(taken) and pages <= freed:
                break
            if r.priority <= priority:
                break  # the rest are no worse
            taken.append(r)
            freed += self.frees(r)
        if slots > len(taken) or pages > freed:
            return None
        for r in taken:
            self.candidates.remove(r)
        return taken, freed
