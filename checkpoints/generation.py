"""A model's own sampling defaults: what a request that names no sampling field gets.

    defaults = GenerationDefaults.from_hf_dir(folder)      # generation_config.json
    defaults = GenerationDefaults.from_gguf_fields(fields) # general.sampling.* metadata
    GenerationDefaults.load(converted_folder)              # generation.json, written at conversion

Model authors publish the settings their model was tuned to be sampled with; a small instruct
model sampled at the API's neutral temperature 1.0 wanders off into nonsense, so front doors
use these when a request leaves a field out (as vLLM does with `generation_config.json`). Only
the fields the source sets are kept (`None` elsewhere), and `source` says where they came from,
for the start-up message. Known models without such metadata get theirs from the registry
(`checkpoints/registry.py`, from the model card).

Non-goals: penalties and other fields cadence does not implement; `do_sample` (as in vLLM, the
published temperature applies whether or not the file asks transformers to sample).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from cadence.checkpoints.errors import CheckpointError

FILE = "generation.json"  # in a converted folder


@dataclasses.dataclass(frozen=True)
class GenerationDefaults:
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    source: str = ""

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p", "top_k"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not math.isfinite(value) or value < 0):
                raise CheckpointError(f"{self.source or 'generation defaults'}: {name} must be a "
                                      f"non-negative number, got {value!r}")

    @property
    def empty(self) -> bool:
        return self.temperature is None and self.top_p is None and self.top_k is None

    def describe(self) -> str:
        if self.empty:
            return "none published"
        values = ", ".join(f"{k}={v}" for k, v in self._values().items())
        return f"{values} ({self.source})" if self.source else values

    def _values(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("temperature", "top_p", "top_k")
                if getattr(self, k) is not None}

    @classmethod
    def from_mapping(cls, values: dict[str, Any], source: str, names: dict[str, str]) -> GenerationDefaults:
        """`names` maps our field names to the keys `values` spells them with."""
        found = {ours: values[theirs] for ours, theirs in names.items() if values.get(theirs) is not None}
        if "top_k" in found and isinstance(found["top_k"], float) and found["top_k"].is_integer():
            found["top_k"] = int(found["top_k"])
        return cls(**found, source=source)

    @classmethod
    def from_hf_dir(cls, folder: str | Path) -> GenerationDefaults:
        path = Path(folder) / "generation_config.json"
        if not path.is_file():
            return cls()
        try:
            values = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{path} is not valid JSON ({e}); fix or remove it") from None
        names = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k"}
        return cls.from_mapping(values, f"{path.name}", names)

    @classmethod
    def from_gguf_fields(cls, fields: dict[str, Any]) -> GenerationDefaults:
        names = {"temperature": "general.sampling.temp", "top_p": "general.sampling.top_p",
                 "top_k": "general.sampling.top_k"}
        return cls.from_mapping(fields, "the GGUF's general.sampling metadata", names)

    def file_bytes(self) -> bytes:
        return json.dumps({**self._values(), "source": self.source}, indent=2).encode()

    @classmethod
    def load(cls, folder: str | Path) -> GenerationDefaults:
        """What a converted folder recorded; empty for folders converted before it did."""
        path = Path(folder) / FILE
        if not path.is_file():
            return cls()
        values = json.loads(path.read_text())
        return cls(**{k: values.get(k) for k in ("temperature", "top_p", "top_k")},
                   source=values.get("source", ""))
