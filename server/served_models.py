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

from cadence.server.protocol import APIError


class ServedModels:
    def __init__(self, names: str | Sequence[str], adapters: Sequence[str] = ()):
        self.names = (names,) if isinstance(names, str) else tuple(names)
        if not self.names or not all(self.names):
            raise ValueError("a server needs at least one non-empty model name")
        self.name = self.names[0]
        self.adapters = {name: slot for slot, name in enumerate(adapters)}  # name -> bank slot
        if len(self.adapters) != len(adapters) or set(self.adapters) & set(self.names):
            raise ValueError(f"LoRA adapters' names {list(adapters)} must be distinct, and none "
                             f"the model's ({', '.join(self.names)})")

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

    def lora(self, model: str | None) -> tuple[tuple[int, float], ...]:
        """The adapter `model` names, as a request's (bank slot, scale) pairs; none for the model."""
        return ((self.adapters[model], 1.0),) if model in self.adapters else ()

    def answer(self, model: str | None) -> str:
        """The model an answer names: the adapter the request named, else the served model."""
        return model if model in self.adapters else self.name
