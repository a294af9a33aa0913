"""The names a request's "model" may give: the served model's, and its LoRA adapters'.

    models = ServedModels(["smollm2-135m"], adapters=("sql", "poems"))
    models.check(body_model)          # APIError 404 for a name not served here
    lora = models.lora(body_model)    # ((bank slot, 1.0),) for an adapter's name, else ()
    models.answer(body_model)         # the name the answer carries

The model's names are vLLM's --served-model-name (the first is the one answers carry); an
adapter's name (`--lora NAME=PATH`) selects that adapter, as vLLM's LoRA modules are requested,
and answers carry it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from cadence.server.api_error import APIError


class ServedModels:
    """`adapters`: the names of the adapters in the engine's bank, slot by slot; `slots`: the
    bank's size (default: as many), whose free slots `add` fills and `remove` frees."""

    def __init__(self, names: str | Sequence[str], adapters: Sequence[str] = (), slots: int | None = None):
        self.names = (names,) if isinstance(names, str) else tuple(names)
        if not self.names or not all(self.names):
            raise ValueError("a server needs at least one non-empty model name")
        self.name = self.names[0]
        self.slots = len(adapters) if slots is None else slots
        if self.slots < len(adapters):
            raise ValueError(f"{len(adapters)} LoRA adapters for a bank of {self.slots} slots")
        self.adapters: dict[str, int] = {}  # name -> bank slot
        # llama-server's global mix (POST /lora-adapters): what a request on the model itself
        # runs with where it gives no `lora` of its own, as (slot, scale) pairs.
        self.mix: tuple[tuple[int, float], ...] = ()
        self._users: list[tuple[Any, frozenset[int]]] = []  # (request, the slots it uses)
        for name in adapters:
            self.add(name)

    def free_slot(self) -> int:
        """The lowest slot no adapter holds; ValueError where none is free."""
        free = sorted(set(range(self.slots)) - set(self.adapters.values()))
        if not free:
            raise ValueError(f"every one of the {self.slots} LoRA slots is taken (--max_loras); "
                             "unload an adapter first")
        return free[0]

    def add(self, name: str, slot: int | None = None) -> int:
        """Names `slot` (default: the lowest free one) `name` and returns it; ValueError where
        the name is taken or no slot is free."""
        if not name or name in self.every:
            raise ValueError(f"a LoRA adapter's name must be new and non-empty; {name!r} is taken "
                             f"({', '.join(self.every)})")
        slot = self.free_slot() if slot is None else slot
        self.adapters[name] = slot
        return slot

    def remove(self, name: str) -> int:
        """Frees `name`'s slot and returns it; APIError 409 while a request uses it."""
        slot = self.adapters[name]
        users = self.users(slot)
        if users:
            raise APIError(409, f"LoRA adapter '{name}' is in use by {users} requests; unload it "
                                "once they are done", param="lora_name")
        self.mix = tuple((s, scale) for s, scale in self.mix if s != slot)
        return self.adapters.pop(name)

    def track(self, requests: Sequence[Any], lora: tuple[tuple[int, float], ...]) -> None:
        """Counts `requests` (`scheduler.request.Request`s) as using `lora`'s slots until they
        finish."""
        self._users = [(r, slots) for r, slots in self._users if not r.finished]
        if lora:
            self._users += [(r, frozenset(slot for slot, _ in lora)) for r in requests]

    def in_use(self) -> tuple[list[str], list[str]]:
        """The adapters unfinished requests use: those of requests holding a KV slot, and of
        those queued for one (names, sorted)."""
        names = {slot: name for name, slot in self.adapters.items()}
        running, waiting = set(), set()
        for r, slots in self._users:
            if not r.finished:
                (running if r.pool is not None else waiting).update(names[s] for s in slots if s in names)
        return sorted(running), sorted(waiting)

    def users(self, slot: int) -> int:
        """How many unfinished requests use `slot`."""
        return sum(1 for r, slots in self._users if slot in slots and not r.finished)

    @property
    def every(self) -> tuple[str, ...]:
        """Every name served: the model's, then the adapters'."""
        return self.names + tuple(self.adapters)

    def check(self, model: str | None) -> None:
        if model is not None and model not in self.every:
            raise APIError(404, f"model '{model}' is not served here; this server serves "
                                f"{', '.join(map(repr, self.every))}", param="model",
                           code="model_not_found")

    def check_base(self, model: str | None) -> None:
        """`check`, for what the base model alone serves (embeddings)."""
        self.check(model)
        if model in self.adapters:
            raise APIError(400, f"'{model}' is a LoRA adapter; embeddings are the base model's "
                                f"('{self.name}')", param="model")

    def check_lora(self, lora: tuple[tuple[int, float], ...]) -> None:
        """APIError 400 unless every slot `lora` names holds an adapter."""
        empty = [slot for slot, _ in lora if slot not in self.adapters.values()]
        if empty:
            raise APIError(400, f"LoRA adapter {empty[0]} is not loaded: the loaded ones are "
                                f"{sorted(self.adapters.values()) or 'none'}", param="lora")

    def lora(self, model: str | None) -> tuple[tuple[int, float], ...]:
        """The adapter `model` names, as a request's (bank slot, scale) pairs; for the model
        itself, the global mix (none unless POST /lora-adapters set one)."""
        return ((self.adapters[model], 1.0),) if model in self.adapters else self.mix

    def answer(self, model: str | None) -> str:
        """The model an answer names: the adapter the request named, else the served model."""
        return model if model in self.adapters else self.name
