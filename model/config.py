"""Model configuration for the Llama family (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM2, SmolLM3,
Granite 3) and Gemma 3.

One frozen dataclass describes every architecture cadence serves: RMSNorm, rotary position
embeddings (optionally with Llama-3 or YaRN frequency scaling, or any per-frequency factors as a
GGUF's `rope_freqs` tensor gives them), SwiGLU MLP and grouped-query attention, with Qwen2's q/k/v
biases, Qwen3's per-head query and key norms, SmolLM3's layers without rotary embeddings
(NoPE), Granite's four scalars (embeddings, residual branches, attention scores and logits
scaled), or Gemma 3's differences (sliding-window attention in most layers, with a RoPE base of
their own; GELU for SiLU; norms after attention and the MLP as well as before; the embeddings
scaled by sqrt(hidden_size)) where a family has them. It is hashable, so it can be a static
argument of a jitted function.

Non-goals: mixture-of-experts, position encodings other than rotary (or none), attention logit
soft-capping (Gemma 2).
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling, by its Hugging Face `rope_type`:

    - "llama3": Llama 3.1's. Frequencies whose wavelength is longer than the original context
      over `low_freq_factor` are divided by `factor`, those shorter than it over
      `high_freq_factor` kept, the ones between blended.
    - "yarn": YaRN's (Qwen2.5 and Qwen3 past 32k tokens). The rotated pairs that turn more than
      `beta_fast` times over the original context keep their frequency, those turning less than
      `beta_slow` times are divided by `factor`, with a linear ramp over the pairs between; and
      cos and sin are scaled by `attention_factor` (so every attention score by its square),
      by default 0.1 ln(factor) + 1.
    """

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    rope_type: str = "llama3"
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None

    def __post_init__(self) -> None:
        if self.rope_type not in ("llama3", "yarn"):
            raise ValueError(f"rope_type {self.rope_type!r}: cadence scales RoPE as llama3 or yarn")
        if not (math.isfinite(self.factor) and self.factor > 0):
            raise ValueError(f"RoPE scaling factor must be finite and positive, got {self.factor}")
        if self.original_max_position < 1:
            raise ValueError("original_max_position must be at least 1, got "
                             f"{self.original_max_position}")
        if self.rope_type == "yarn" and not self.beta_fast > self.beta_slow > 0:
            raise ValueError(f"YaRN needs beta_fast > beta_slow > 0, got {self.beta_fast} and "
                             f"{self.beta_slow}")
        if self.attention_factor is not None and not (math.isfinite(self.attention_factor)
                                                      and self.attention_factor > 0):
            raise ValueError("attention_factor must be finite and positive, got "
                             f"{self.attention_factor}")

    @property
    def magnitude(self) -> float:
        """What cos and sin are multiplied by: YaRN's attention factor, else 1."""
        if self.rope_type != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        return 0.1 * math.log(self.factor) + 1.0 if self.factor > 1 else 1.0

    @property
    def context(self) -> int:
        """The context the scaling stretches the model to: YaRN's original times its factor
        (as vLLM derives it; a checkpoint's own `max_position_embeddings` may say less)."""
        return int(self.original_max_position * self.factor) if self.rope_type == "yarn" else 0


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    # Divisors of RoPE's inverse frequencies, one per rotated pair [head_dim // 2], applied after
    # `rope_scaling`: llama.cpp's `rope_freqs` tensor (theta_i = position * base^(-2i/d) / f_i).
    rope_freq_factors: tuple[float, ...] | None = None
    tie_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 puts biases on the q/k/v projections
    # Qwen3 RMS-normalizes each head's query and key over head_dim (a learned scale [head_dim]
    # per layer for each), after the projections and before RoPE.
    qk_norm: bool = False
    # Layers whose queries and keys are not rotated (no position encoding of their own):
    # SmolLM3's every fourth, (i + 1) % 4 == 0. Sorted indices; () for every other family.
    no_rope_layers: tuple[int, ...] = ()
    # Granite's scalars (transformers' names): the embeddings times embedding_multiplier, each
    # residual branch (attention's and the MLP's output) times residual_multiplier, attention
    # scores times attention_multiplier (None: 1 / sqrt(head_dim)), the logits over
    # logits_scaling. At 1 (None) they change nothing, and nothing is computed for them.
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0
    # Gemma 3: the layers in `sliding_layers` attend to their last `sliding_window` positions
    # only (a query's own and the sliding_window - 1 before it), rotated with base
    # `rope_local_theta`, unscaled (None: as every other layer); the MLP's gate is GELU's
    # (`hidden_act` "gelu_tanh", tanh-approximated) rather than SiLU; `post_norms` adds an
    # RMSNorm to each branch's output (attention's and the MLP's) before the residual sum; the
    # logits are soft-capped, c * tanh(logits / c), by `final_logit_softcapping` where given.
    sliding_window: int = 0
    sliding_layers: tuple[int, ...] = ()
    rope_local_theta: float | None = None
    hidden_act: str = "silu"
    post_norms: bool = False
    final_logit_softcapping: float | None = None
    max_context: int = 4096
    name: str = "llama"
    # How the checkpoint says its embeddings are pooled (a GGUF's pooling_type, a
    # sentence-transformers folder's Pooling module): one of POOLING_TYPES, or None where it
    # says nothing. Read by the embedding doors' default (`server.flags.pooling`).
    pooling: str | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads}) for grouped-query attention"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        scalars = (self.embedding_multiplier, self.residual_multiplier, self.logits_scaling,
                   1.0 if self.attention_multiplier is None else self.attention_multiplier)
        if not all(math.isfinite(v) and v > 0 for v in scalars):
            raise ValueError(f"the embedding, residual, attention and logit scalars must be finite "
                             f"and positive, got {scalars}")
        for field in ("no_rope_layers", "sliding_layers"):
            layers = tuple(sorted({int(i) for i in getattr(self, field)}))  # a list from JSON, too
            object.__setattr__(self, field, layers)
            if layers and not 0 <= layers[0] <= layers[-1] < self.num_layers:
                raise ValueError(f"{field} {list(layers)} must be layers of the model's "
                                 f"{self.num_layers}")
        if bool(self.sliding_layers) != (self.sliding_window > 0):
            raise ValueError(f"a sliding window ({self.sliding_window}) needs the layers it applies "
                             f"to, and sliding_layers ({list(self.sliding_layers)}) a window")
        if self.hidden_act not in ("silu", "gelu_tanh"):
            raise ValueError(f"hidden_act {self.hidden_act!r}: cadence's MLPs gate with silu or "
                             "gelu_tanh")
        for name in ("rope_local_theta", "final_logit_softcapping"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be finite and positive, got {value}")
        if self.rope_freq_factors is not None:
            factors = tuple(float(f) for f in self.rope_freq_factors)  # a list from JSON, too
            object.__setattr__(self, "rope_freq_factors", factors)
            if len(factors) != self.head_dim // 2:
                raise ValueError(f"rope_freq_factors has {len(factors)} factors; head_dim "
                                 f"{self.head_dim} rotates {self.head_dim // 2} pairs")
            if not all(math.isfinite(f) and f > 0 for f in factors):
                raise ValueError("rope_freq_factors must be finite and positive")

    def window(self, layer: int) -> int:
        """How many positions a query of `layer` sees, its own included; 0: all before it."""
        return self.sliding_window if layer in self.sliding_layers else 0

    def local_rope(self, layer: int) -> bool:
        """Whether `layer` rotates with the sliding layers' own base (`rope_local_theta`)."""
        return self.rope_local_theta is not None and layer in self.sliding_layers

    @property
    def group_size(self) -> int:
        """Query heads served by each KV head."""
        return self.num_heads // self.num_kv_heads

    def num_params(self) -> int:
        d, h, kv, hd, f = (
            self.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim, self.ffn_size
        )
        attn = d * h * hd * 2 + d * kv * hd * 2
        if self.attention_bias:
            attn += h * hd + 2 * kv * hd
        if self.qk_norm:
            attn += 2 * hd
        layer = attn + 3 * d * f + (4 if self.post_norms else 2) * d
        embed = self.vocab_size * d * (1 if self.tie_embeddings else 2)
        return self.num_layers * layer + embed + d

    def kv_bytes_per_token(self, itemsize: int) -> int:
        """KV cache bytes one token occupies across all layers (keys and values)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        d = dict(d)
        if d.get("rope_scaling") is not None:
            d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
        return cls(**d)

    @classmethod
    def from_json(cls, text: str) -> ModelConfig:
        return cls.from_dict(json.loads(text))


# llama.cpp's pooling types, in its numbering (a GGUF's `<arch>.pooling_type`).
POOLING_TYPES = ("none", "mean", "cls", "last", "rank")


# A model small enough for CPU unit tests: every code path (GQA, tied embeddings) stays live.
TINY = ModelConfig(
    name="tiny",
    vocab_size=512,
    hidden_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    ffn_size=128,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_embeddings=True,
    max_context=512,
)

SMOLLM2_135M = ModelConfig(
    name="smollm2-135m",
    vocab_size=49152,
    hidden_size=576,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    ffn_size=1536,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    tie_embeddings=True,
    max_context=8192,
)

# The Llama-3-8B shape, for GPU benchmarks with random weights.
LLAMA3_8B = ModelConfig(
    name="llama3-8b",
    vocab_size=128256,
    hidden_size=4096,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    ffn_size=14336,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    rope_scaling=RopeScaling(),
    tie_embeddings=False,
    max_context=8192,
)

PRESETS: dict[str, ModelConfig] = {c.name: c for c in (TINY, SMOLLM2_135M, LLAMA3_8B)}
