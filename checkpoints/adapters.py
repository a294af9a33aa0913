"""LoRA adapters from disk: a PEFT folder (what vLLM's --lora-modules takes) or a GGUF adapter
(llama.cpp's convert_lora_to_gguf.py output, what llama-server's --lora takes), as the
`model.lora.LoraAdapter` the engine's bank holds.

    adapter = load_adapter("path/to/adapter", base_config, name="sql")

A PEFT folder holds `adapter_config.json` (`r`, `lora_alpha`, `use_rslora`, `rank_pattern`,
`alpha_pattern`) and `adapter_model.safetensors`, whose tensors are named after the base
model's modules: `base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight` [r, in] and
`...lora_B.weight` [out, r]; a module's scale is alpha / r (alpha / sqrt(r) with rsLoRA), from
the patterns where they name it. A GGUF adapter (`general.type` "adapter", `adapter.type`
"lora") holds `blk.3.attn_q.weight.lora_a` [r, in] and `.lora_b` [out, r], its alpha in
`adapter.lora.alpha` (0: a scale of 1), its q and k rows in llama.cpp's order where the
architecture's converter permutes them (undone here, as for the base model's weights).

Refused, with a `CheckpointError` that says why: adapters of other modules (the embedding, the
LM head: vLLM's extra-vocabulary adapters), trained biases, DoRA, `modules_to_save`, pickled
`adapter_model.bin`, a rank or a shape that does not fit the base model.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import numpy as np

from cadence.checkpoints.errors import CheckpointError
from cadence.checkpoints.gguf import PERMUTED_ARCHITECTURES, dequantized, unpermute_rope_rows
from cadence.checkpoints.gguf_file import read_gguf
from cadence.checkpoints.hf import read_tensor, tensor_offsets
from cadence.model.config import ModelConfig
from cadence.model.lora import LoraAdapter
from cadence.model.params import param_specs

_PEFT_TENSOR = re.compile(r"base_model\.model\.(?P<module>.+)\.lora_(?P<side>[AB])\.weight")


def load_adapter(path: str | Path, config: ModelConfig, name: str | None = None) -> LoraAdapter:
    """The adapter at `path` (a PEFT folder or a GGUF file) for a base model of `config`, named
    `name` (default: the folder's or file's name)."""
    path = Path(path)
    name = name or path.stem
    if path.is_dir():
        adapter = _load_peft(path, config, name)
    elif path.is_file() and path.suffix == ".gguf":
        adapter = _load_gguf(path, config, name)
    else:
        raise CheckpointError(f"LoRA adapter {path}: not a PEFT folder (adapter_config.json and "
                              "adapter_model.safetensors) or a .gguf adapter file")
    try:
        adapter.check(config)
    except ValueError as e:
        raise CheckpointError(f"LoRA adapter {path} does not fit {config.name}: {e}") from None
    return adapter


def _modules(config: ModelConfig) -> dict[str, tuple[int, str, int]]:
    """Every projection an adapter may change, by its module's name in Hugging Face's tree
    (`model.layers.3.self_attn.q_proj`) and in GGUF's (`blk.3.attn_q`): (layer, projection,
    the heads llama.cpp permutes its rows by)."""
    out = {}
    for spec in param_specs(config):
        if len(spec.path) == 4 and spec.path[1] in ("attn", "mlp") and spec.path[3] == "kernel":
            layer = int(spec.path[0].removeprefix("layers_"))
            entry = (layer, spec.path[2], spec.rope_heads)
            out[spec.hf_name.removesuffix(".weight")] = entry
            out[spec.gguf_name.removesuffix(".weight")] = entry
    return out


def _load_peft(folder: Path, config: ModelConfig, name: str) -> LoraAdapter:
    settings = _adapter_config(folder)
    tensors = folder / "adapter_model.safetensors"
    if not tensors.is_file():
        bin_file = " (adapter_model.bin is a pickle, which cadence does not load: save the "
        bin_file += "adapter with safe_serialization)" if (folder / "adapter_model.bin").exists() else ""
        raise CheckpointError(f"LoRA adapter {folder}: no adapter_model.safetensors{bin_file}")
    modules = _modules(config)
    pairs: dict[str, dict[str, np.ndarray]] = {}
    with open(tensors, "rb") as f:
        for tensor, where in tensor_offsets(f).items():
            match = _PEFT_TENSOR.fullmatch(tensor)
            if match is None or match["module"] not in modules:
                raise CheckpointError(
                    f"LoRA adapter {folder}: tensor {tensor} adapts no projection cadence serves "
                    "adapters on (a layer's q/k/v/o_proj, gate/up/down_proj; not the embedding, "
                    "the LM head or biases)")
            pairs.setdefault(match["module"], {})[match["side"]] = read_tensor(f, *where)
    weights = {}
    for module, sides in pairs.items():
        if set(sides) != {"A", "B"}:
            raise CheckpointError(f"LoRA adapter {folder}: {module} has lora_{''.join(sides)} alone")
        a, b = sides["A"].astype(np.float32), sides["B"].astype(np.float32)  # [r, in], [out, r]
        rank = a.shape[0]
        alpha = _pattern(settings.get("alpha_pattern") or {}, module, settings["lora_alpha"])
        scale = alpha / (math.sqrt(rank) if settings.get("use_rslora") else rank)
        layer, proj, _ = modules[module]
        weights[(layer, proj)] = (np.ascontiguousarray(a.T), np.ascontiguousarray((b * scale).T))
    return _adapter(folder, name, weights)


def _adapter_config(folder: Path) -> dict[str, Any]:
    path = folder / "adapter_config.json"
    try:
        settings = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"LoRA adapter {folder}: no adapter_config.json; point at a PEFT "
                              "adapter's folder") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"LoRA adapter {path} is not valid JSON ({e})") from None
    kind = settings.get("peft_type", "LORA")
    refusals = [(kind != "LORA", f"peft_type {kind} (cadence serves LoRA)"),
                (bool(settings.get("use_dora")), "DoRA (use_dora)"),
                (bool(settings.get("modules_to_save")), "modules_to_save (whole modules trained)"),
                (settings.get("bias", "none") != "none", f"trained biases (bias={settings.get('bias')!r})"),
                (bool(settings.get("fan_in_fan_out")), "fan_in_fan_out (GPT-2's Conv1D layers)"),
                (not isinstance(settings.get("lora_alpha"), (int, float)), "no numeric lora_alpha")]
    for refused, what in refusals:
        if refused:
            raise CheckpointError(f"LoRA adapter {folder}: {what} is not supported")
    return settings


def _pattern(patterns: dict[str, Any], module: str, default: float) -> float:
    """PEFT's per-module override: the value of the first key that names `module` (the whole
    name, or its last dotted parts)."""
    for key, value in patterns.items():
        if re.fullmatch(rf"(.*\.)?{key}", module):
            return float(value)
    return float(default)


def _load_gguf(path: Path, config: ModelConfig, name: str) -> LoraAdapter:
    try:
        fields, tensors = read_gguf(path)
    except Exception as e:  # ValueError, struct.error, UnicodeDecodeError...
        raise CheckpointError(f"LoRA adapter {path} is not a readable GGUF file ({e})") from None
    if fields.get("general.type") != "adapter" or fields.get("adapter.type") != "lora":
        raise CheckpointError(f"LoRA adapter {path}: a GGUF model, not a LoRA adapter (general.type "
                              f"{fields.get('general.type')!r}, adapter.type {fields.get('adapter.type')!r})")
    alpha = float(fields.get("adapter.lora.alpha", 0.0))
    permute = fields.get("general.architecture") in PERMUTED_ARCHITECTURES
    modules = _modules(config)
    weights = {}
    for tensor in tensors:
        module, _, side = tensor.rpartition(".weight.lora_")
        if side not in ("a", "b") or module not in modules:
            raise CheckpointError(f"LoRA adapter {path}: tensor {tensor} adapts no projection cadence "
                                  "serves adapters on (a layer's attn_q/k/v/output, ffn_gate/up/down)")
        if side == "b":
            continue
        if f"{module}.weight.lora_b" not in tensors:
            raise CheckpointError(f"LoRA adapter {path}: {module} has lora_a alone")
        a, b = (dequantized(path, tensors[f"{module}.weight.lora_{s}"]) for s in "ab")  # [r, in], [out, r]
        layer, proj, heads = modules[module]
        if permute and heads:
            b = unpermute_rope_rows(b, heads)
        scale = alpha / a.shape[0] if alpha else 1.0
        weights[(layer, proj)] = (np.ascontiguousarray(a.T), np.ascontiguousarray((b * scale).T))
    return _adapter(path, name, weights)


def _adapter(path: Path, name: str, weights: dict) -> LoraAdapter:
    if not weights:
        raise CheckpointError(f"LoRA adapter {path} holds no LoRA matrices")
    return LoraAdapter(name, max(a.shape[1] for a, _ in weights.values()), weights)
