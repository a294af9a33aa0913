"""An engine's LoRA adapters (`model.lora`): the bank it places beside its weights, and
`set_adapter`, which puts an adapter into a slot while the engine serves.

    engine = Engine(params, model_config, EngineConfig(lora_slots=4, lora_rank=16), adapters=[sql])
    engine.set_adapter(1, poems)        # the bank keeps its shape: nothing compiles
    engine.lora_versions[1]             # counted on by each set: the prefix cache's key

Mixed into `engine.engine.Engine` (its params, config, device, model config and `tp`).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from cadence.model import lora
from cadence.model.lora import LoraAdapter
from cadence.model.params import cast


class LoraBank:
    def _place_lora_bank(self, adapters: Sequence[LoraAdapter]) -> None:
        """Adds the bank of `config.lora_slots` slots to the placed params, adapter i in slot i:
        the projections they change, or every projection where slots are left free (for
        `set_adapter`)."""
        slots = self.config.lora_slots
        if adapters and not slots:
            raise ValueError(f"{len(adapters)} LoRA adapters for an engine without a bank "
                             "(EngineConfig.lora_slots)")
        self._adapters: list[LoraAdapter | None] = [*adapters, *[None] * (slots - len(adapters))]
        # Each slot's version: a prompt's KV is cached under the adapters that computed it.
        self.lora_versions = [0] * slots
        if not slots:
            return
        self._lora_projections = (lora.PROJECTIONS if None in self._adapters else sorted(
            {p for a in adapters for p in a.projections}, key=lora.PROJECTIONS.index))
        self.params = self._with_lora_bank()

    def _with_lora_bank(self) -> dict:
        """The placed params with the bank's leaves of the adapters in its slots, in the compute
        dtype on this engine's device (a bank there already replaced); a decode tree's in the
        CPU kernels' layout, which they read. Under tensor parallelism the bank is whole on
        every device (XLA's partitioner adds each correction to the projection's shards), its
        k/v b's heads repeated as the weights' are."""
        bank = lora.bank_arrays(self.model_config, self._adapters, self.config.lora_slots,
                                self.config.lora_rank, self._lora_projections)
        dtype, tp = jnp.dtype(self.config.dtype), self.tp
        if tp is not None:
            bank = {(layer, proj): (a, tp.repeat_kv(b, 1) if proj in ("k", "v") else b)
                    for (layer, proj), (a, b) in bank.items()}
        where = self.device if tp is None else tp.replicated
        return lora.with_bank(self.params, bank, self.model_config.num_layers,
                              blocked=self.config.decode_matmul == "cpu",
                              place=lambda a: cast(jax.device_put(a, where), dtype))

    def set_adapter(self, slot: int, adapter: LoraAdapter | None) -> None:
        """Puts `adapter` in bank slot `slot` (None empties it) and counts the slot's version
        on. The bank keeps its shape, so nothing compiles; the caller makes sure no request
        uses the slot meanwhile (its rows would run with either adapter)."""
        if not 0 <= slot < self.config.lora_slots:
            raise ValueError(f"LoRA slot {slot} is outside the bank's {self.config.lora_slots}")
        before = self._adapters
        self._adapters = [adapter if i == slot else a for i, a in enumerate(before)]
        try:
            self.params = self._with_lora_bank()
        except ValueError:
            self._adapters = before
            raise
        self.lora_versions[slot] += 1
