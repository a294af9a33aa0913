"""Loading llama.cpp's GGUF files into cadence's parameter tree.

    config, params, fields = load_gguf(path)

`params` follows the tree `model.params` describes (float32 NumPy arrays, kernels
[in, out]); `fields` is every metadata key decoded to plain Python values, from which
`checkpoints.tokenizer.Tokenizer.from_gguf_fields` builds the tokenizer.

    packed = load_packed(path, config)    # the block-quantized matrices, kept as they are

`packed` holds every matrix stored in a format the CPU decode kernels read directly (Q8_0,
Q4_0, Q4_1, Q5_0, Q5_1: 32 weights per float16 scale, and for Q4_1 and Q5_1 a float16
minimum; the K-quants Q2_K to Q6_K: 256-weight super-blocks with integer sub-block
scales; IQ4_NL and IQ4_XS, whose 4-bit codes index a table of 16 values), re-laid into the
kernels' grouped layout (`model.block_layout.pack_grouped` / `pack_superblocks`) with the same
values: dequantizing a packed matrix gives `params`' float32 matrix exactly. Other formats
(F16, BF16, the other IQ formats...) are left to `params` alone.

Three details matter for logits that match the Hugging Face model:
- Quantized tensors (Q8_0, Q4_1, ... anything the `gguf` package can dequantize) become float32.
- llama.cpp's converter permutes the rows of the query and key projections of "llama" (and
  "smollm3") models so its RoPE can rotate adjacent pairs; cadence rotates halves (as HF does),
  so the permutation is undone here. Qwen2 and Qwen3 GGUFs are not permuted (their RoPE rotates
  halves).
- "smollm3" is Llama with every fourth layer unrotated, (i + 1) % 4 == 0, as llama.cpp builds it
  (the file says nothing of it): `ModelConfig.no_rope_layers`.
- "granite" is Llama with four scalars, `embedding_scale`, `residual_scale`, `attention.scale`
  and `logit_scale` (0 or absent: none), `ModelConfig`'s multipliers.
- "gemma3" is Gemma 3's text model (`_gemma3`): sliding-window layers with a RoPE base of their
  own, GELU, norms after attention and the MLP, scaled embeddings, Qwen3's query and key norms.
  Its rows are not permuted (llama.cpp rotates its halves, as HF does).
- RoPE frequencies as llama.cpp computes them: its converter writes Llama 3.1/3.2's "llama3"
  frequency scaling as a `rope_freqs` tensor of per-frequency divisors (and no scaling metadata),
  which becomes `ModelConfig.rope_freq_factors` as it is (times a linear `rope.scaling.factor`
  where the metadata gives one). YaRN scaling (`rope.scaling.type` "yarn", as the converter
  writes Qwen2.5's and Qwen3's) becomes `ModelConfig.rope_scaling`, its cos and sin magnitude
  ggml's: 0.1 ln(factor) + 1, times `rope.scaling.yarn_attn_factor`.

Non-goals: the IQ formats but IQ4_NL and IQ4_XS in the kernels' format; LongRoPE scaling and
partial rotary embeddings (`rope.dimension_count` below the head size), which are refused;
architectures other than llama, qwen2, qwen3, smollm3, granite and gemma3 (Qwen3's
mixture-of-experts models are "qwen3moe", Granite's "granitemoe" and "granitehybrid", Gemma 2's
"gemma2", Gemma 3n's "gemma3n", refused with the rest).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable

import gguf
import jax
import numpy as np

from cadence.checkpoints.errors import CheckpointError
from cadence.checkpoints.gguf_file import read_gguf
from cadence.checkpoints.hf import FLOAT_DTYPES
from cadence.checkpoints.ranking import RankingHead
from cadence.model import block_layout
from cadence.model.config import POOLING_TYPES, ModelConfig, RopeScaling
from cadence.model.params import MATRICES, ParamSpec, build_tree, param_specs

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "smollm3", "granite", "gemma3")
PERMUTED_ARCHITECTURES = ("llama", "smollm3", "granite")  # q/k rows permuted by llama.cpp's converter
NO_ROPE_INTERVAL = 4  # SmolLM3's: layer i is unrotated where (i + 1) % 4 == 0 (llama.cpp's constant)
GEMMA3_PATTERN = 6  # Gemma 3's: layer i slides where i % 6 < 5, unless the file says (llama.cpp's)


def config_from_fields(fields: dict[str, Any], path: Path) -> ModelConfig:
    arch = fields.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise CheckpointError(
            f"{path}: GGUF architecture {arch!r} is not supported; cadence loads "
            f"{', '.join(SUPPORTED_ARCHITECTURES)} models"
        )

    def get(key: str, default: Any = None) -> Any:
        value = fields.get(f"{arch}.{key}", default)
        if value is None:
            raise CheckpointError(f"{path}: GGUF metadata lacks '{arch}.{key}'; the file is incomplete")
        return value

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    tokens = fields.get("tokenizer.ggml.tokens")
    vocab = int(fields.get(f"{arch}.vocab_size") or (len(tokens) if tokens else 0))
    if not vocab:
        raise CheckpointError(f"{path}: GGUF metadata has neither a vocab size nor a token list")
    head_dim = int(get("attention.key_length", fields.get(f"{arch}.rope.dimension_count", hidden // heads)))
    rotated = int(fields.get(f"{arch}.rope.dimension_count") or head_dim)
    if rotated != head_dim:
        raise CheckpointError(f"{path}: RoPE rotates {rotated} of each head's {head_dim} "
                              "dimensions; cadence rotates whole heads only")
    context = int(get("context_length"))
    layers = int(get("block_count"))
    yarn = yarn_scaling(fields, context, path)
    try:
        return ModelConfig(
            name=str(fields.get("general.name") or Path(path).stem),
            vocab_size=vocab,
            hidden_size=hidden,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(get("attention.head_count_kv", heads)),
            head_dim=head_dim,
            ffn_size=int(get("feed_forward_length")),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            rope_scaling=yarn,
            tie_embeddings=False,  # decided by the presence of output.weight in load_gguf
            attention_bias=arch == "qwen2",
            qk_norm=arch in ("qwen3", "gemma3"),
            no_rope_layers=tuple(i for i in range(layers) if (i + 1) % NO_ROPE_INTERVAL == 0)
            if arch == "smollm3" else (),
            **(_granite_scalars(fields) if arch == "granite" else {}),
            **(_gemma3(fields, layers, hidden, heads) if arch == "gemma3" else {}),
            max_context=max(context, yarn.context) if yarn else context,
            pooling=_pooling_type(fields.get(f"{arch}.pooling_type")),
        )
    except ValueError as e:  # ModelConfig's own checks
        raise CheckpointError(f"{path}: {e}") from None


def _pooling_type(value: Any) -> str | None:
    """A GGUF's pooling_type (llama.cpp's enum; -1, unspecified, and absent: None)."""
    if value is None or not 0 <= int(value) < len(POOLING_TYPES):
        return None
    return POOLING_TYPES[int(value)]


def _granite_scalars(fields: dict[str, Any]) -> dict[str, float | None]:
    """A granite file's scalars, as llama.cpp reads them (0 or absent: none)."""
    return {"embedding_multiplier": float(fields.get("granite.embedding_scale") or 1.0),
            "residual_multiplier": float(fields.get("granite.residual_scale") or 1.0),
            "attention_multiplier": float(fields.get("granite.attention.scale") or 0.0) or None,
            "logits_scaling": float(fields.get("granite.logit_scale") or 1.0)}


def _gemma3(fields: dict[str, Any], layers: int, hidden: int, heads: int) -> dict[str, Any]:
    """A gemma3 file's differences from Llama, as llama.cpp builds the model: sliding layers
    where `attention.sliding_window` is set (those `attention.sliding_window_pattern` marks, or
    of each 6 layers all but the last), rotated with `rope.freq_base_swa` (default 10000); the
    embeddings scaled by sqrt(hidden); queries by 1 / sqrt(hidden / heads) in the 62-layer model
    (27B), by the usual 1 / sqrt(head_dim) elsewhere; GELU; norms after each branch too. Its
    norms' weights are stored with Gemma's 1 added (the converter adds it)."""
    window = int(fields.get("gemma3.attention.sliding_window") or 0)
    pattern = fields.get("gemma3.attention.sliding_window_pattern", GEMMA3_PATTERN)
    if isinstance(pattern, (list, tuple)):
        sliding = tuple(i for i, on in enumerate(pattern[:layers]) if on)
    else:
        n = int(pattern)
        sliding = tuple(i for i in range(layers) if n == 0 or i % n < n - 1)
    cap = float(fields.get("gemma3.final_logit_softcapping") or 0.0)
    return {"sliding_window": window, "sliding_layers": sliding if window else (),
            "rope_local_theta": float(fields.get("gemma3.rope.freq_base_swa") or 10000.0)
            if window else None,
            "hidden_act": "gelu_tanh", "post_norms": True,
            "embedding_multiplier": hidden ** 0.5,
            "attention_multiplier": (heads / hidden) ** 0.5 if layers == 62 else None,
            "final_logit_softcapping": cap or None}


# YaRN's keys llama.cpp reads beside the factor, at the values where they change nothing
# (an ext_factor of -1 is llama.cpp's "the type's default", 1 for YaRN).
_YARN_NEUTRAL = {"rope.scaling.attn_factor": (1.0,), "rope.scaling.yarn_ext_factor": (1.0, -1.0),
                 "rope.scaling.yarn_log_multiplier": (0.0,)}


def yarn_scaling(fields: dict[str, Any], context: int, path: Path) -> RopeScaling | None:
    """A YaRN file's scaling, as llama.cpp reads it: the factor, the original context (the
    file's context length if not given), the ramp's betas, and `yarn_attn_factor` multiplying
    the magnitude ggml computes. The serving context it stretches to is original x factor (or
    the file's context length, where that says more). None for any other scaling type."""
    arch = fields["general.architecture"]
    if fields.get(f"{arch}.rope.scaling.type") != "yarn":
        return None
    for key, neutral in _YARN_NEUTRAL.items():
        value = fields.get(f"{arch}.{key}")
        if value is not None and float(value) not in neutral:
            raise CheckpointError(f"{path}: YaRN with {arch}.{key} = {value} is not supported; "
                                  f"cadence applies YaRN as transformers does ({key} {neutral[0]:g})")
    factor = float(fields.get(f"{arch}.rope.scaling.factor") or 1.0)
    try:
        scaling = RopeScaling(
            rope_type="yarn", factor=factor,
            original_max_position=int(fields.get(f"{arch}.rope.scaling.original_context_length") or context),
            beta_fast=float(fields.get(f"{arch}.rope.scaling.yarn_beta_fast") or 32.0),
            beta_slow=float(fields.get(f"{arch}.rope.scaling.yarn_beta_slow") or 1.0))
        attn = float(fields.get(f"{arch}.rope.scaling.yarn_attn_factor") or 1.0)
        return scaling if attn == 1.0 else dataclasses.replace(scaling, attention_factor=attn * scaling.magnitude)
    except ValueError as e:
        raise CheckpointError(f"{path}: {e}") from None


def rope_freq_factors(fields: dict[str, Any], rope_freqs: np.ndarray | None, half: int,
                      path: Path) -> tuple[float, ...] | None:
    """The divisor of each RoPE frequency as llama.cpp applies it (theta_i = position *
    base^(-2i/d) / rope_freqs[i] * freq_scale): the file's `rope_freqs` tensor times the
    metadata's linear scaling factor (1 / freq_scale; llama.cpp's scaling type defaults to linear,
    and "none" ignores the factor, as does "yarn", whose factor `yarn_scaling` reads). None when
    every divisor is 1."""
    arch = fields["general.architecture"]
    kind = fields.get(f"{arch}.rope.scaling.type", "linear")
    scale = float(fields.get(f"{arch}.rope.scaling.factor")
                  or fields.get(f"{arch}.rope.scale_linear") or 1.0)  # 0 means unscaled too
    if kind in ("none", "yarn"):
        scale = 1.0
    elif kind != "linear" and scale != 1.0:
        raise CheckpointError(f"{path}: RoPE scaling type {kind!r} (factor {scale:g}) is not "
                              "supported; cadence applies linear and YaRN scaling and "
                              "per-frequency factors (rope_freqs) only")
    factors = np.full(half, scale, np.float64)
    if rope_freqs is not None:
        if not np.all(np.isfinite(rope_freqs) & (rope_freqs > 0)):
            raise CheckpointError(f"{path}: tensor rope_freqs.weight holds factors that are not "
                                  "finite and positive; the file is damaged")
        factors *= rope_freqs
    return None if np.all(factors == 1.0) else tuple(float(f) for f in factors)


def unpermute_rope_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's q/k permutation. w [heads*head_dim, ...] in GGUF row order."""
    rows = w.shape[0]
    head_dim = rows // num_heads
    return (
        w.reshape(num_heads, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def permute_rope_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's q/k permutation (HF rotate-half rows -> adjacent pairs); for writing GGUF."""
    rows = w.shape[0]
    head_dim = rows // num_heads
    return (
        w.reshape(num_heads, 2, head_dim // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


# GGUF's 16-bit float tensors, as NumPy reads them.
_SIXTEEN_BIT = {gguf.GGMLQuantizationType[name]: FLOAT_DTYPES[name] for name in ("F16", "BF16")}


def dequantized(path: Path, tensor) -> np.ndarray:
    """A GGUF tensor (a `gguf.ReaderTensor`) as float32, or CheckpointError naming a type the
    `gguf` package cannot dequantize."""
    try:
        return np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), np.float32)
    except NotImplementedError:
        raise CheckpointError(f"{path}: tensor {tensor.name} has type {tensor.tensor_type.name}, which "
                              "cadence cannot dequantize; use an F32, F16, BF16, Q8_0 or Q4_x file") from None


def load_gguf(
    path: str | Path, progress: Callable[[int, int], None] | None = None, *, packable: bool = True,
    keep_16_bit: bool = False,
) -> tuple[ModelConfig, dict, dict[str, Any]]:
    """Reads and dequantizes a GGUF file. `progress(done, total)` is called per tensor. With
    `packable=False`, the matrices `load_packed` packs are not dequantized: their leaves are
    `jax.ShapeDtypeStruct`s (a conversion stores their blocks alone). With `keep_16_bit`, F16
    and BF16 tensors stay as stored (a conversion saves them so)."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"GGUF file {path} does not exist; check the path")
    try:
        fields, tensors = read_gguf(path)
    except Exception as e:  # ValueError, struct.error, UnicodeDecodeError...
        raise CheckpointError(
            f"{path} is not a readable GGUF file ({type(e).__name__}: {e}); "
            "re-download or re-convert it"
        ) from None
    config = config_from_fields(fields, path)
    arch = fields["general.architecture"]
    done, total = 0, len(tensors)

    def tick() -> None:
        nonlocal done
        done += 1
        if progress:
            progress(done, total)

    def take(name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in tensors:
            raise CheckpointError(f"{path}: tensor {name} is missing; the file is incomplete")
        t = tensors[name]
        if keep_16_bit and t.tensor_type in _SIXTEEN_BIT:
            array = np.ascontiguousarray(t.data).view(_SIXTEEN_BIT[t.tensor_type])
        else:
            array = dequantized(path, t)
        if array.shape != shape:
            raise CheckpointError(f"{path}: tensor {name} has shape {array.shape}, expected {shape}")
        tick()
        return array

    half = config.head_dim // 2
    rope_freqs = take("rope_freqs.weight", (half,)) if "rope_freqs.weight" in tensors else None
    config = dataclasses.replace(config, tie_embeddings="output.weight" not in tensors,
                                 rope_freq_factors=rope_freq_factors(fields, rope_freqs, half, path))
    permute = arch in PERMUTED_ARCHITECTURES

    def tensor(spec: ParamSpec) -> np.ndarray | jax.ShapeDtypeStruct:
        if not packable and _packs(spec, tensors.get(spec.gguf_name)):
            tick()
            shape = spec.stored_shape[::-1] if spec.transpose else spec.stored_shape
            return jax.ShapeDtypeStruct(shape, np.float32)
        array = take(spec.gguf_name, spec.stored_shape)
        if permute and spec.rope_heads:
            array = unpermute_rope_rows(array, spec.rope_heads)
        # Contiguous here, one tensor at a time: made contiguous over the finished tree, every
        # transposed matrix was held twice at once (Qwen2.5-0.5B: a 5.6 GB peak for 2 GB).
        return np.ascontiguousarray(array.T if spec.transpose else array)

    return config, build_tree(param_specs(config), tensor), fields


def load_ranking(path: str | Path) -> RankingHead | None:
    """A reranker's head (`checkpoints.ranking`), where the file has one (llama.cpp writes
    `cls.output` and a "rerank" prompt template for the rerankers it converts)."""
    path = Path(path)
    fields, tensors = read_gguf(path)
    head = {name: dequantized(path, t) for name, t in tensors.items() if name.startswith("cls.")}
    return RankingHead.from_gguf(fields, head, path)


# GGUF's block formats the grouped kernels read, by the bytes of a block: 32 weights (Q8_0,
# Q4_0, Q4_1, Q5_0, Q5_1: a float16 scale d, Q4_1's and Q5_1's float16 minimum m; w = d q (+ m))
# or a 256-weight super-block (the K-quants: a float16 d, Q2_K/Q4_K/Q5_K's float16 dmin, and a
# scale (and minimum) per sub-block of 32 weights (Q2_K, Q3_K, Q6_K: 16), as integers), and the
# IQ4s, whose 4-bit codes index a table of 16 values (IQ4_NL: 32 weights to a float16 scale; IQ4_XS: a super-block of 256 with
# signed 6-bit sub-block scales). `unpack_blocks` reads them as `gguf.quants` does; `FORMAT`
# names the kernels' layout each becomes.
PACKABLE = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q2_K": 84, "Q3_K": 110,
            "Q4_K": 144, "Q5_K": 176, "Q6_K": 210, "IQ4_NL": 18, "IQ4_XS": 136}
FORMAT = {"Q8_0": "q8", "Q4_0": "q4", "Q4_1": "q4", "Q5_0": "q5", "Q5_1": "q51", "Q2_K": "q2k",
          "Q3_K": "q3k", "Q4_K": "q4k", "Q5_K": "q5k", "Q6_K": "q6k", "IQ4_NL": "iq4nl", "IQ4_XS": "iq4xs"}
SUPERBLOCK = 256  # weights per K-quant super-block


def _nibbles(qs: np.ndarray, run: int) -> np.ndarray:
    """GGUF's 4-bit codes [..., bytes] in runs of `run` bytes, each run's low nibbles then its
    high ones: [..., 2 * bytes]."""
    qs = qs.reshape(*qs.shape[:-1], -1, 1, run) >> np.array([0, 4], np.uint8).reshape(2, 1)
    return (qs & 15).reshape(*qs.shape[:-3], -1)


def _bits(qh: np.ndarray, run: int, width: int) -> np.ndarray:
    """GGUF's `width`-bit planes [..., bytes] in runs of `run` bytes, each run's lowest bits
    first: [..., 8 / width * bytes]."""
    shifts = np.arange(0, 8, width, dtype=np.uint8).reshape(-1, 1)
    qh = qh.reshape(*qh.shape[:-1], -1, 1, run) >> shifts
    return (qh & ((1 << width) - 1)).reshape(*qh.shape[:-3], -1)


def unpack_blocks(data: np.ndarray, kind: str, columns: int) -> dict[str, np.ndarray]:
    """A GGUF tensor's rows of blocks (uint8 [rows, columns / weights per block * block bytes])
    as the arguments of `block_layout.pack_grouped` / `pack_superblocks` for its `FORMAT`, each
    [rows, ...] (a row's codes [rows, columns], its per-block values [rows, blocks]): the codes
    q (Q8_0 int8; Q4_x 0..15; Q5_0 -16..15; Q5_1 0..31; Q2_K 0..3; Q3_K -4..3; Q4_K 0..15; Q5_K 0..31;
    Q6_K -32..31; the IQ4s' table indices 0..15), float16
    `scale` / `minimum` (32-weight formats) or `d` / `dmin` (K-quants), and the K-quants'
    integer `sub_scale` / `sub_min` [rows, columns / 32 or / 16]."""
    rows = data.shape[0]
    per_block = SUPERBLOCK if kind.endswith(("_K", "_XS")) else 32
    blocks = np.ascontiguousarray(data).reshape(rows, columns // per_block, PACKABLE[kind])

    def half(at: int) -> np.ndarray:
        return blocks[..., at:at + 2].copy().view(np.float16)[..., 0]

    def flat(a: np.ndarray) -> np.ndarray:
        return a.reshape(rows, -1)

    if kind == "Q8_0":
        return {"q": flat(blocks[..., 2:].copy().view(np.int8)), "scale": half(0)}
    if kind == "Q4_1":
        return {"q": flat(_nibbles(blocks[..., 4:], 16)), "scale": half(0), "minimum": half(2)}
    if kind == "IQ4_NL":
        return {"q": flat(_nibbles(blocks[..., 2:], 16)), "scale": half(0)}
    if kind == "IQ4_XS":  # d, scales_h u16, scales_l u8[4], qs[128]: sub-block j's scale is
        # scales_l's nibble j (low first) | scales_h's bits 2j, 2j + 1 at bit 4, less 32
        low = _nibbles(blocks[..., 4:8], 4)[..., [0, 4, 1, 5, 2, 6, 3, 7]]
        high = _bits(blocks[..., 2:4], 2, 2)[..., [0, 2, 4, 6, 1, 3, 5, 7]]
        sub_scale = (low | (high << 4)).astype(np.int8) - np.int8(32)
        q = _nibbles(blocks[..., 8:].reshape(rows, -1, 8, 16), 16).reshape(rows, -1, 256)
        return {"q": flat(q), "d": half(0), "sub_scale": flat(sub_scale)}
    if kind == "Q4_0":
        scale = half(0)
        return {"q": flat(_nibbles(blocks[..., 2:], 16)), "scale": scale,
                "minimum": (scale.astype(np.float32) * -8).astype(np.float16)}
    if kind in ("Q5_0", "Q5_1"):  # d (, m), qh: bit j of the little-endian word is weight j's
        at = 2 if kind == "Q5_0" else 4
        high = _bits(blocks[..., at:at + 4], 4, 1)
        high = high.reshape(rows, -1, 8, 4).swapaxes(-1, -2).reshape(rows, -1, 32)
        q = _nibbles(blocks[..., at + 4:], 16) | (high << 4)
        if kind == "Q5_1":
            return {"q": flat(q), "scale": half(0), "minimum": half(2)}
        return {"q": flat(q.astype(np.int8) - np.int8(16)), "scale": half(0)}
    if kind == "Q2_K":  # scales[16] (a sub-block's scale in the low nibble, its minimum high), qs[64], d, dmin
        scales = blocks[..., :16]
        return {"q": flat(_bits(blocks[..., 16:80], 32, 2)), "d": half(80), "dmin": half(82),
                "sub_scale": flat(scales & 15), "sub_min": flat(scales >> 4)}
    if kind == "Q3_K":  # hmask[32], qs[64], 12 bytes of 6-bit scales, d
        low = _bits(blocks[..., 32:96], 32, 2)  # two runs of 32 bytes, 2 bits a weight
        offset = 1 - _bits(blocks[..., :32], 32, 1)  # a clear hmask bit: the code less 4
        q = low.astype(np.int8) - (offset << 2).astype(np.int8)
        scales = (_nibbles(blocks[..., 96:104], 8) | (_bits(blocks[..., 104:108], 4, 2) << 4))
        return {"q": flat(q), "d": half(108), "sub_scale": flat(scales.astype(np.int8) - np.int8(32))}
    if kind == "Q6_K":  # ql[128], qh[64], scales int8[16], d
        low = _nibbles(blocks[..., :128].reshape(rows, -1, 2, 64), 64).reshape(rows, -1, 256)
        high = _bits(blocks[..., 128:192].reshape(rows, -1, 2, 32), 32, 2).reshape(rows, -1, 256)
        q = (low | (high << 4)).astype(np.int8) - np.int8(32)
        return {"q": flat(q), "d": half(208), "sub_scale": flat(blocks[..., 192:208].copy().view(np.int8))}
    # Q4_K, Q5_K: d, dmin, 12 bytes of 6-bit scales and minimums, (Q5_K: qh[32]), qs[128]
    sub_scale, sub_min = gguf.quants.Q4_K.get_scale_min(blocks[..., 4:16].reshape(-1, 12))
    q = _nibbles(blocks[..., -128:].reshape(rows, -1, 4, 32), 32).reshape(rows, -1, 256)
    if kind == "Q5_K":
        q = q | (_bits(blocks[..., 16:48], 32, 1) << 4)
    return {"q": flat(q), "d": half(0), "dmin": half(2), "sub_scale": flat(sub_scale),
            "sub_min": flat(sub_min)}


def pack_blocks(parts: dict[str, np.ndarray], kind: str) -> np.ndarray:
    """`unpack_blocks`' parts of a [rows, columns] tensor (rows: output columns) in the
    kernels' layout for W [columns, rows]."""
    fmt = FORMAT[kind]
    t = {name: a.T for name, a in parts.items()}
    if fmt in ("q8", "q4", "q5", "iq4nl", "q51"):
        return block_layout.pack_grouped(t["q"], t["scale"], t.get("minimum"), fmt)
    return block_layout.pack_superblocks(fmt, t["q"], t["d"], t["sub_scale"], t.get("dmin"), t.get("sub_min"))


def _packs(spec: ParamSpec, t: Any) -> bool:
    """Whether `load_packed` packs the file's tensor `t` for `spec` (a matrix in a block
    format the kernels read)."""
    return t is not None and spec.path[-1] in MATRICES and t.tensor_type.name in PACKABLE


def load_packed(path: str | Path, config: ModelConfig) -> dict[tuple[str, ...], tuple[np.ndarray, str]]:
    """Every matrix of the file in a `PACKABLE` format, as (`pack_blocks` array, the GGUF
    type's name), by its path in the params tree. The embedding's entry is the embedding
    transposed (its rows are a tied LM head's output columns), whose columns an embedding
    lookup reads, tied or not (`cpu_kernels.take_columns`)."""
    fields, tensors = read_gguf(path)
    permute = fields.get("general.architecture") in PERMUTED_ARCHITECTURES
    out = {}
    for spec in param_specs(config):
        t = tensors.get(spec.gguf_name)
        if not _packs(spec, t):
            continue
        kind = t.tensor_type.name
        rows, columns = spec.stored_shape  # GGUF [out, in]
        parts = unpack_blocks(t.data, kind, columns)
        if parts["q"].shape[0] != rows:
            raise CheckpointError(f"{path}: tensor {spec.gguf_name} has {parts['q'].shape[0]} rows, expected {rows}")
        if permute and spec.rope_heads:
            parts = {name: unpermute_rope_rows(a, spec.rope_heads) for name, a in parts.items()}
        packed = pack_blocks(parts, kind)
        out[spec.path] = (packed, kind)
    return out
