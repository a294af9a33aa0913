"""Hugging Face checkpoints: `config.json` → `ModelConfig`, safetensors → the params pytree.

Contract: `load_hf_config` accepts the Llama, Mistral, Qwen2, Qwen3 (dense), SmolLM3 and Granite
families (`model_type` "llama", "mistral", "qwen2", "qwen3", "smollm3", "granite"; SmolLM3's
`no_rope_layers`, or every `no_rope_layer_interval`-th layer, unrotated; Granite's four
multipliers) and Gemma 3's text models ("gemma3_text": Gemma3ForCausalLM, its sliding layers
from `layer_types` or `sliding_window_pattern`; its norms store their scale less 1, which is
added as they load and taken off as they are saved) and refuses, with a `CheckpointError`,
anything cadence would run wrongly: other activations, biases outside q/k/v, RoPE scaling other
than Llama 3's, YaRN and linear, a sliding window shorter than the context outside Gemma 3,
attention logit soft-capping. `load_hf_params` reads one
`*.safetensors` file or the shards named by `model.safetensors.index.json`, checks every
expected tensor is there with the expected shape before reading any data, and returns float32
numpy arrays with kernels transposed to [in, out].
Which tensor goes where, in which shape, is `model.params.param_specs`, the one description of
the parameter tree that every loader reads. `save_hf` writes the same layout back (tests, export).

Non-goals: pytorch `.bin` files, quantized safetensors (GPTQ, AWQ, FP8), Mistral's
`consolidated.safetensors` naming, Gemma 3's multimodal checkpoints (Gemma3ForConditionalGeneration).
"""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path
from typing import Any

import ml_dtypes  # also registers numpy's "bfloat16", which safetensors needs for BF16
import numpy as np
import safetensors.numpy
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from cadence.checkpoints.errors import CheckpointError
from cadence.model.config import ModelConfig, RopeScaling
from cadence.model.params import build_tree, get, param_specs

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "smollm3": "SmolLM3ForCausalLM", "granite": "GraniteForCausalLM",
                 "gemma3_text": "Gemma3ForCausalLM"}
# HF's per-family defaults for fields a config.json may omit.
_DEFAULT_MAX_POSITIONS = {"llama": 2048, "mistral": 32768, "qwen2": 32768, "qwen3": 32768,
                          "smollm3": 32768, "granite": 2048, "gemma3_text": 131072}
_DEFAULT_ROPE_THETA = {"smollm3": 2e6, "gemma3_text": 1e6}  # (others: 10000)
_DEFAULT_TIED = {"smollm3": True, "gemma3_text": True}  # (others: untied)
_GEMMA3_PATTERN = 6  # transformers' sliding_window_pattern default: of each 6 layers, the last is full
# The float dtypes checkpoints store tensors in, by their name in safetensors and GGUF; a
# converted checkpoint keeps each as its source stored it (`checkpoints.store`).
FLOAT_DTYPES = {"F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
                "BF16": np.dtype(ml_dtypes.bfloat16)}
_SAVE_DTYPES = {dtype.name: dtype for dtype in FLOAT_DTYPES.values()}  # save_hf's, by name
_INDEX = "model.safetensors.index.json"
Params = dict[str, Any]


def load_hf_config(folder: str | Path, *, name: str | None = None) -> ModelConfig:
    """Reads `folder/config.json`; `name` defaults to the model's HF name or the folder's."""
    folder = Path(folder)
    raw = _read_json(folder / "config.json")
    model_type = raw.get("model_type")
    if model_type not in ARCHITECTURES:
        raise CheckpointError(f"{folder / 'config.json'}: model_type {model_type!r} is not "
                              f"supported; cadence loads {', '.join(sorted(ARCHITECTURES))}")
    for arch in raw.get("architectures") or []:
        if arch != ARCHITECTURES[model_type]:
            raise CheckpointError(f"{folder / 'config.json'}: architecture {arch!r} is not "
                                  f"supported; cadence loads {', '.join(ARCHITECTURES.values())}")

    def need(key: str) -> Any:
        if raw.get(key) is None:
            raise CheckpointError(f"{folder / 'config.json'} lacks {key!r}; add it or re-export "
                                  "the checkpoint with transformers")
        return raw[key]

    hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
    max_context = int(raw.get("max_position_embeddings") or _DEFAULT_MAX_POSITIONS[model_type])
    _check_supported(folder, raw, model_type, max_context)
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}  # transformers v5 / v4
    # transformers' Qwen3Config defaults head_dim to 128, not hidden / heads
    head_dim = int(raw.get("head_dim") or (128 if model_type == "qwen3" else hidden // heads))
    scaling, factors = _rope_scaling(folder, rope, max_context, head_dim)
    tie = bool(raw.get("tie_word_embeddings", _DEFAULT_TIED.get(model_type, False)))
    layers = int(need("num_hidden_layers"))
    if not tie and _lm_head_absent(folder):
        tie = True  # some exports drop lm_head.weight yet leave tie_word_embeddings false
    try:
        return ModelConfig(
            name=name or str(raw.get("_name_or_path") or folder.name).rstrip("/").split("/")[-1],
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            ffn_size=int(need("intermediate_size")),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(raw.get("rope_theta") or rope.get("rope_theta")
                             or _DEFAULT_ROPE_THETA.get(model_type, 10000.0)),
            rope_scaling=scaling,
            rope_freq_factors=factors,
            tie_embeddings=tie,
            attention_bias=model_type == "qwen2",
            qk_norm=model_type in ("qwen3", "gemma3_text"),
            no_rope_layers=_no_rope_layers(folder, raw, layers) if model_type == "smollm3" else (),
            **(_granite_multipliers(raw) if model_type == "granite" else {}),
            **(_gemma3(folder, raw, layers, hidden, head_dim) if model_type == "gemma3_text" else {}),
            max_context=max(max_context, scaling.context) if scaling else max_context,
            pooling=_pooling(folder),
        )
    except ValueError as e:  # ModelConfig's own consistency checks
        raise CheckpointError(f"{folder / 'config.json'}: {e}") from e


# sentence-transformers' pooling modes (a Pooling module's config.json) as llama.cpp names
# them, or by their own names where llama.cpp has none.
_ST_POOLING = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean",
               "pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
               "pooling_mode_weightedmean_tokens": "weightedmean",
               "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len"}


def _pooling(folder: Path) -> str | None:
    """A sentence-transformers folder's pooling (modules.json's Pooling module), or None."""
    if not (folder / "modules.json").is_file():
        return None
    modules: Any = _read_json(folder / "modules.json")  # (a list)
    for module in modules if isinstance(modules, list) else []:
        if isinstance(module, dict) and str(module.get("type", "")).endswith(".Pooling"):
            mode = _read_json(folder / str(module.get("path", "")) / "config.json")
            return next((name for key, name in _ST_POOLING.items() if mode.get(key)), None)
    return None


def _no_rope_layers(folder: Path, raw: dict[str, Any], layers: int) -> tuple[int, ...]:
    """SmolLM3's unrotated layers, as transformers reads them: `no_rope_layers` holds a flag per
    layer (1: rotated), else every `no_rope_layer_interval`-th layer (4) is unrotated."""
    flags = raw.get("no_rope_layers")
    if flags is None:
        interval = int(raw.get("no_rope_layer_interval") or 4)
        flags = [int((i + 1) % interval != 0) for i in range(layers)]
    if not isinstance(flags, list) or len(flags) != layers or not all(f in (0, 1) for f in flags):
        raise CheckpointError(f"{folder / 'config.json'}: no_rope_layers must be a 0 or 1 for each "
                              f"of the {layers} layers")
    return tuple(i for i, rotated in enumerate(flags) if not rotated)


def _gemma3(folder: Path, raw: dict[str, Any], layers: int, hidden: int,
            head_dim: int) -> dict[str, Any]:
    """Gemma 3's fields, as transformers reads them: the sliding layers (`layer_types`, else
    all but every `sliding_window_pattern`-th), their RoPE base, the query scale
    (query_pre_attn_scalar^-1/2), the logits' soft cap."""
    kinds = raw.get("layer_types")
    if kinds is None:
        n = int(raw.get("sliding_window_pattern") or _GEMMA3_PATTERN)
        kinds = ["full_attention" if (i + 1) % n == 0 else "sliding_attention" for i in range(layers)]
    if (not isinstance(kinds, list) or len(kinds) != layers
            or not set(kinds) <= {"sliding_attention", "full_attention"}):
        raise CheckpointError(f"{folder / 'config.json'}: layer_types must name sliding_attention "
                              f"or full_attention for each of the {layers} layers")
    window = int(raw.get("sliding_window") or 0)
    scalar = float(raw.get("query_pre_attn_scalar") or head_dim)
    return {"sliding_window": window,
            "sliding_layers": tuple(i for i, k in enumerate(kinds) if k == "sliding_attention")
            if window else (),
            "rope_local_theta": float(raw.get("rope_local_base_freq") or 10000.0) if window else None,
            "hidden_act": "gelu_tanh", "post_norms": True, "embedding_multiplier": hidden ** 0.5,
            "attention_multiplier": None if scalar == head_dim else scalar ** -0.5,
            "final_logit_softcapping": raw.get("final_logit_softcapping")}


def _norm_offset(config: ModelConfig) -> float:
    """What a checkpoint's norm weights lack of the scale they apply: Gemma's store it less 1
    (Gemma, alone among the families cadence reads, has norms after its branches)."""
    return 1.0 if config.post_norms else 0.0


def _granite_multipliers(raw: dict[str, Any]) -> dict[str, float]:
    """Granite's scalars at transformers' defaults where config.json leaves them out (its
    attention scores are scaled by attention_multiplier alone, 1.0 by default)."""
    return {"embedding_multiplier": float(raw.get("embedding_multiplier", 1.0)),
            "residual_multiplier": float(raw.get("residual_multiplier", 1.0)),
            "attention_multiplier": float(raw.get("attention_multiplier", 1.0)),
            "logits_scaling": float(raw.get("logits_scaling", 1.0))}


def load_hf_params(folder: str | Path, config: ModelConfig, *, keep_16_bit: bool = False) -> Params:
    """Reads every tensor of `config` from `folder`'s safetensors as float32 numpy arrays; with
    `keep_16_bit`, F16 and BF16 tensors stay as stored (a conversion saves them so)."""
    folder = Path(folder)
    files = _tensor_files(folder)
    specs = {s.hf_name: s for s in param_specs(config)}
    missing = [n for n in specs if n not in files]
    unexpected = [n for n in files if n not in specs and not _ignorable(n, config)]
    if missing or unexpected:
        raise CheckpointError(
            f"{folder}: tensors do not match {config.name}'s config.json: missing "
            f"[{_listing(missing)}], unexpected [{_listing(unexpected)}]; point cadence at the "
            "folder of a complete Llama/Mistral/Qwen2/Qwen3 checkpoint")
    by_file: dict[Path, list[str]] = {}
    for hf_name in specs:
        by_file.setdefault(files[hf_name], []).append(hf_name)

    bad = []  # headers first, so a wrong checkpoint fails before gigabytes are read
    for path, names in by_file.items():
        with _safe_open(path) as f:
            for hf_name in names:
                header = f.get_slice(hf_name)
                shape, dtype = tuple(header.get_shape()), header.get_dtype()
                if shape != specs[hf_name].stored_shape or dtype not in FLOAT_DTYPES:
                    bad.append(f"{hf_name} {dtype}{list(shape)} (want "
                               f"{list(specs[hf_name].stored_shape)} in F32/F16/BF16)")
    if bad:
        raise CheckpointError(f"{folder}: tensors with the wrong shape or dtype for "
                              f"{config.name}: {_listing(bad)}; check config.json matches the "
                              "weights (quantized safetensors are not supported)")

    arrays: dict[str, np.ndarray] = {}
    with tqdm(total=len(specs), desc=f"loading {folder.name}", unit="tensor", disable=None) as bar:
        for path, names in by_file.items():
            with open(path, "rb") as f:
                where = tensor_offsets(f)
                for hf_name in names:
                    spec, array = specs[hf_name], read_tensor(f, *where[hf_name])
                    array = array.T if spec.transpose else array
                    if spec.path[-1] == "scale" and _norm_offset(config):
                        array = array.astype(np.float32) + _norm_offset(config)
                    arrays[hf_name] = np.ascontiguousarray(
                        array, dtype=None if keep_16_bit else np.float32)
                    bar.update()
    return build_tree(specs.values(), lambda spec: arrays[spec.hf_name])


def tensor_offsets(f) -> dict[str, tuple[int, np.dtype, tuple[int, ...]]]:
    """A safetensors file's tensors (open, binary): name -> (byte offset, dtype, shape), read
    from its header (an 8-byte little-endian length, then that much JSON)."""
    size = int.from_bytes(f.read(8), "little")
    header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return {name: (8 + size + entry["data_offsets"][0], FLOAT_DTYPES[entry["dtype"]], tuple(entry["shape"]))
            for name, entry in header.items() if entry["dtype"] in FLOAT_DTYPES}


def read_tensor(f, offset: int, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    """One tensor read into memory of its own with plain reads. safetensors' reader maps the
    file, and the mapped pages a load touches count as resident beside the arrays made from
    them: loading a checkpoint held it about twice (6.8 GB for a 3.2 GiB one)."""
    array = np.empty(shape, dtype)
    f.seek(offset)
    if f.readinto(memoryview(array.reshape(-1).view(np.uint8))) != array.nbytes:
        raise CheckpointError(f"{f.name}: the file ends inside a tensor; download it again")
    return array


def save_hf(folder: str | Path, config: ModelConfig, params: Params, *, dtype: str = "float32",
            max_shard_bytes: int | None = None) -> None:
    """Writes `config.json` and the params in HF layout: one `model.safetensors`, or shards of
    at most `max_shard_bytes` (one tensor may exceed it) with `model.safetensors.index.json`."""
    folder = Path(folder)
    if dtype not in _SAVE_DTYPES:
        raise CheckpointError(f"save_hf dtype {dtype!r}: use one of {', '.join(_SAVE_DTYPES)}")
    raw_config = hf_config_dict(config, dtype)  # refuses what config.json cannot say, first
    if any(folder.glob("*.safetensors")):
        raise CheckpointError(f"{folder} already holds safetensors; save into an empty folder")
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for spec in param_specs(config):
        array = np.asarray(_get(params, spec.path))
        if array.shape != spec.shape:
            raise CheckpointError(f"params {'/'.join(spec.path)} has shape {list(array.shape)}, "
                                  f"{config.name} needs {list(spec.shape)}")
        array = array.T if spec.transpose else array
        if spec.path[-1] == "scale":
            array = array - _norm_offset(config)
        tensors[spec.hf_name] = np.ascontiguousarray(array, dtype=_SAVE_DTYPES[dtype])

    shards: list[dict[str, np.ndarray]] = [{}]
    for hf_name, array in tensors.items():
        size = sum(a.nbytes for a in shards[-1].values())
        if max_shard_bytes and shards[-1] and size + array.nbytes > max_shard_bytes:
            shards.append({})
        shards[-1][hf_name] = array
    if len(shards) == 1:
        safetensors.numpy.save_file(shards[0], folder / "model.safetensors",
                                    metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards, 1):
            file_name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            safetensors.numpy.save_file(shard, folder / file_name, metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, file_name))
        index = {"metadata": {"total_size": sum(a.nbytes for a in tensors.values())},
                 "weight_map": weight_map}
        (folder / _INDEX).write_text(json.dumps(index, indent=2))
    (folder / "config.json").write_text(json.dumps(raw_config, indent=2))


def hf_config_dict(config: ModelConfig, dtype: str = "float32") -> dict[str, Any]:
    """`config` as a transformers `config.json` (Qwen2 when it has q/k/v biases, Qwen3 when it
    has q/k norms, SmolLM3 when some layers are unrotated, Granite when it has multipliers,
    Gemma 3 when it has norms after each branch, else Llama)."""
    factors = config.rope_freq_factors
    if factors is not None and (len(set(factors)) > 1 or config.rope_scaling is not None):
        raise CheckpointError(f"{config.name}: per-frequency RoPE factors (a GGUF's rope_freqs) "
                              "have no Hugging Face config.json form; cannot export this model")
    granite = (config.embedding_multiplier, config.residual_multiplier, config.attention_multiplier,
               config.logits_scaling) != (1.0, 1.0, None, 1.0)
    if config.post_norms:
        _check_gemma3(config)
        model_type = "gemma3_text"
    elif config.attention_bias + config.qk_norm + bool(config.no_rope_layers) + granite > 1:
        raise CheckpointError(f"{config.name}: q/k/v biases, q/k norms, unrotated layers and "
                              "Granite's multipliers together are no transformers architecture; "
                              "cannot export this model")
    else:
        model_type = ("qwen2" if config.attention_bias else "qwen3" if config.qk_norm
                      else "smollm3" if config.no_rope_layers else "granite" if granite else "llama")
    raw: dict[str, Any] = {
        "_name_or_path": config.name,
        "architectures": [ARCHITECTURES[model_type]],
        "model_type": model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "intermediate_size": config.ffn_size,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": None,
        "tie_word_embeddings": config.tie_embeddings,
        "max_position_embeddings": config.max_context,
        "torch_dtype": dtype,
    }
    s = config.rope_scaling
    if factors is not None:
        raw["rope_scaling"] = {"rope_type": "linear", "factor": factors[0]}
    elif s is not None and s.rope_type == "yarn":
        raw["rope_scaling"] = {"rope_type": "yarn", "factor": s.factor,
                               "original_max_position_embeddings": s.original_max_position,
                               "beta_fast": s.beta_fast, "beta_slow": s.beta_slow}
        if s.attention_factor is not None:
            raw["rope_scaling"]["attention_factor"] = s.attention_factor
    elif s is not None:
        raw["rope_scaling"] = {"rope_type": "llama3", "factor": s.factor,
                               "low_freq_factor": s.low_freq_factor,
                               "high_freq_factor": s.high_freq_factor,
                               "original_max_position_embeddings": s.original_max_position}
    if model_type in ("qwen2", "qwen3"):
        raw.update(use_sliding_window=False, sliding_window=config.max_context)
    if model_type in ("qwen3", "smollm3", "granite"):
        raw.update(attention_bias=False)  # transformers reads it (for q/k/v and o)
    if model_type == "granite":
        raw.update(embedding_multiplier=config.embedding_multiplier, mlp_bias=False,
                   residual_multiplier=config.residual_multiplier, logits_scaling=config.logits_scaling,
                   attention_multiplier=(config.head_dim ** -0.5 if config.attention_multiplier is None
                                         else config.attention_multiplier))
    if model_type == "smollm3":
        unrotated = set(config.no_rope_layers)
        raw.update(no_rope_layers=[int(i not in unrotated) for i in range(config.num_layers)],
                   use_sliding_window=False, mlp_bias=False)
    if model_type == "gemma3_text":
        del raw["hidden_act"]  # (Gemma's is `hidden_activation`)
        sliding = set(config.sliding_layers)
        raw.update(hidden_activation="gelu_pytorch_tanh", attention_bias=False,
                   rope_local_base_freq=config.rope_local_theta or config.rope_theta,
                   sliding_window=config.sliding_window or config.max_context,
                   layer_types=["sliding_attention" if i in sliding else "full_attention"
                                for i in range(config.num_layers)],
                   query_pre_attn_scalar=(config.head_dim if config.attention_multiplier is None
                                          else config.attention_multiplier ** -2),
                   final_logit_softcapping=config.final_logit_softcapping, attn_logit_softcapping=None)
    return raw


def _check_gemma3(config: ModelConfig) -> None:
    """Refuses to export norms after each branch (`post_norms`) without the rest of Gemma 3."""
    gemma = dict(hidden_act="gelu_tanh", qk_norm=True, embedding_multiplier=config.hidden_size ** 0.5,
                 residual_multiplier=1.0, logits_scaling=1.0, attention_bias=False, no_rope_layers=())
    if any(getattr(config, k) != v for k, v in gemma.items()) or config.rope_scaling is not None:
        raise CheckpointError(f"{config.name}: norms after each branch without the rest of Gemma 3 "
                              "are no transformers architecture; cannot export this model")


def _check_supported(folder: Path, raw: dict[str, Any], model_type: str, max_context: int) -> None:
    where = folder / "config.json"
    if model_type == "gemma3_text":
        act = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise CheckpointError(f"{where}: hidden_activation {act!r} is not supported; cadence "
                                  "runs Gemma 3's MLPs with gelu_pytorch_tanh")
        if raw.get("attn_logit_softcapping") is not None:
            raise CheckpointError(f"{where}: attention logit soft-capping is not supported")
        return
    if raw.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{where}: hidden_act {raw['hidden_act']!r} is not supported; "
                              "cadence runs SwiGLU (silu) MLPs only")
    if model_type in ("llama", "qwen3", "smollm3", "granite") and (raw.get("attention_bias") or raw.get("mlp_bias")):
        raise CheckpointError(f"{where}: attention_bias/mlp_bias on a {model_type} model is not "
                              "supported; cadence has biases on q/k/v only (Qwen2)")
    window = raw.get("sliding_window")
    if model_type in ("qwen2", "qwen3", "smollm3") and not raw.get("use_sliding_window", False):
        window = None
    if window is not None and int(window) < max_context:
        raise CheckpointError(f"{where}: sliding_window {window} is shorter than the context "
                              f"({max_context}); cadence attends over the full context, so use "
                              "a checkpoint without a sliding window")


def _rope_scaling(folder: Path, rope: dict[str, Any], max_positions: int,
                  head_dim: int) -> tuple[RopeScaling | None, tuple[float, ...] | None]:
    """config.json's RoPE scaling as `ModelConfig.rope_scaling` (llama3, yarn) or, for linear,
    `rope_freq_factors` (every frequency divided by the factor), as transformers computes it."""
    kind = rope.get("rope_type", rope.get("type", "default"))
    where = folder / "config.json"
    if kind == "default":
        return None, None
    if kind == "linear":
        if rope.get("factor") is None:
            raise CheckpointError(f"{where}: linear RoPE scaling without a factor")
        return None, (float(rope["factor"]),) * (head_dim // 2)
    try:
        if kind == "llama3":
            default = RopeScaling()
            return RopeScaling(
                factor=float(rope.get("factor", default.factor)),
                low_freq_factor=float(rope.get("low_freq_factor", default.low_freq_factor)),
                high_freq_factor=float(rope.get("high_freq_factor", default.high_freq_factor)),
                original_max_position=int(rope.get("original_max_position_embeddings",
                                                   default.original_max_position))), None
        if kind == "yarn":
            return _yarn(where, rope, max_positions), None
    except ValueError as e:
        raise CheckpointError(f"{where}: {e}") from None
    raise CheckpointError(f"{where}: rope_type {kind!r} is not supported; cadence implements "
                          "default, linear, llama3 and yarn RoPE")


def _yarn(where: Path, rope: dict[str, Any], max_positions: int) -> RopeScaling:
    """transformers' YaRN parameters: without a factor, max_position_embeddings over the
    original; without an attention factor, DeepSeek's mscale pair where both are given."""
    if rope.get("truncate", True) is not True:
        raise CheckpointError(f"{where}: YaRN with truncate false is not supported; cadence "
                              "rounds the ramp's ends to whole pairs, as transformers does by default")
    original = int(rope.get("original_max_position_embeddings") or max_positions)
    factor = float(rope.get("factor") or max_positions / original)

    def mscale(m: float) -> float:
        return 0.1 * m * math.log(factor) + 1.0 if factor > 1 else 1.0

    attention = rope.get("attention_factor")
    if attention is None and rope.get("mscale") and rope.get("mscale_all_dim"):
        attention = mscale(float(rope["mscale"])) / mscale(float(rope["mscale_all_dim"]))
    return RopeScaling(rope_type="yarn", factor=factor, original_max_position=original,
                       beta_fast=float(rope.get("beta_fast") or 32.0),
                       beta_slow=float(rope.get("beta_slow") or 1.0),
                       attention_factor=None if attention is None else float(attention))


@contextlib.contextmanager
def _safe_open(path: Path):
    """safetensors' reader of `path`; a file it cannot read (a truncated download, or not a
    safetensors file) is a `CheckpointError` that says so."""
    try:
        with safe_open(path, framework="numpy") as f:
            yield f
    except SafetensorError as e:
        raise CheckpointError(f"{path}: not a whole safetensors file ({e}); download it again") from None


def _tensor_files(folder: Path) -> dict[str, Path]:
    """Tensor name → the safetensors file holding it."""
    index = folder / _INDEX
    if index.exists():
        weight_map = _read_json(index).get("weight_map") or {}
        for file_name in sorted(set(weight_map.values())):
            if not (folder / file_name).exists():
                raise CheckpointError(f"{index} names shard {file_name}, which is missing; "
                                      "download the complete checkpoint")
        return {name: folder / file_name for name, file_name in weight_map.items()}
    single = folder / "model.safetensors"
    paths = [single] if single.exists() else sorted(folder.glob("*.safetensors"))
    if not paths:
        raise CheckpointError(f"{folder} holds no *.safetensors files; cadence reads Hugging Face "
                              "checkpoints in safetensors format (not pytorch_model.bin)")
    files: dict[str, Path] = {}
    for path in paths:
        with _safe_open(path) as f:
            for name in f.keys():
                if name in files:
                    raise CheckpointError(f"tensor {name} is in both {files[name].name} and "
                                          f"{path.name}; keep one copy of the checkpoint")
                files[name] = path
    return files


def _lm_head_absent(folder: Path) -> bool:
    """True when `folder` has safetensors without an `lm_head.weight` (unreadable: False)."""
    try:
        return "lm_head.weight" not in _tensor_files(folder)
    except (CheckpointError, OSError):
        return False


def _ignorable(hf_name: str, config: ModelConfig) -> bool:
    # Old exports carry RoPE buffers; tied checkpoints sometimes carry a copy of the embedding.
    return hf_name.endswith("rotary_emb.inv_freq") or (
        config.tie_embeddings and hf_name == "lm_head.weight")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError as e:
        raise CheckpointError(f"{path} not found; point cadence at a Hugging Face model "
                              "folder") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON ({e}); download it again") from e


def _listing(names: list[str], limit: int = 8) -> str:
    more = f", ... (+{len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def _get(tree: Params, path: tuple[str, ...]) -> Any:
    try:
        return get(tree, path)
    except KeyError as e:
        raise CheckpointError(f"params lack {'/'.join(path)}; build them for this "
                              "config") from e
