"""A GGUF of random weights in llama.cpp's Q4_K_M mix, of a real model's shape: what loading and
serving a model that size costs, where the model itself cannot be fetched.

    python -m cadence.bench.random_gguf --shape=qwen2.5-3b --tokenizer_from=qwen.gguf --out=q3b.gguf

Every matrix is random valid blocks (random codes and sub-block scales, float16 scales drawn so
that weights stay within about 0.06, as a trained model's do), chosen per tensor as llama.cpp's
Q4_K_M chooses: Q4_K, with Q6_K for the LM head and for attn_v and ffn_down in the layers
`use_more_bits` picks; Q5_0 where a row is not whole 256-weight super-blocks (as llama.cpp
falls back). Norms are ones and biases small. `--tokenizer_from` copies another GGUF's
tokenizer and chat template (its vocabulary must be the shape's), so cadence serves the file as
it would the real model; its replies are noise.
"""

from __future__ import annotations

import dataclasses

from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
from absl import app, flags

from cadence.model.config import ModelConfig
from cadence.model.params import ParamSpec, param_specs

Q = gguf.GGMLQuantizationType

# The shapes of real models (their published configs), by name, with their GGUF architecture.
SHAPES: dict[str, tuple[str, ModelConfig]] = {
    "qwen2.5-0.5b": ("qwen2", ModelConfig(
        name="qwen2.5-0.5b-shape", vocab_size=151936, hidden_size=896, num_layers=24, num_heads=14,
        num_kv_heads=2, head_dim=64, ffn_size=4864, rms_norm_eps=1e-6, rope_theta=1e6,
        tie_embeddings=True, attention_bias=True, max_context=32768)),
    "qwen2.5-3b": ("qwen2", ModelConfig(
        name="qwen2.5-3b-shape", vocab_size=151936, hidden_size=2048, num_layers=36, num_heads=16,
        num_kv_heads=2, head_dim=128, ffn_size=11008, rms_norm_eps=1e-6, rope_theta=1e6,
        tie_embeddings=True, attention_bias=True, max_context=32768)),
    "qwen3-0.6b": ("qwen3", ModelConfig(
        name="qwen3-0.6b-shape", vocab_size=151936, hidden_size=1024, num_layers=28, num_heads=16,
        num_kv_heads=8, head_dim=128, ffn_size=3072, rms_norm_eps=1e-6, rope_theta=1e6,
        tie_embeddings=True, qk_norm=True, max_context=40960)),
}

# The float16 fields of each block format, by byte offset in a block: scales (d), minimums (m,
# dmin).
HALVES = {Q.Q8_0: (0,), Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2),
          Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,), Q.IQ4_NL: (0,), Q.IQ4_XS: (0,),
          Q.Q3_K: (108,), Q.Q2_K: (80, 82), Q.IQ2_XXS: (0,)}
# The range of those float16 fields per format: weights up to about 0.06.
SCALES = {Q.Q6_K: (5e-6, 1.5e-5), Q.Q4_K: (2e-5, 6e-5), Q.Q5_K: (1e-5, 3e-5), Q.Q5_0: (1e-3, 3e-3),
          Q.Q8_0: (2e-4, 5e-4), Q.Q5_1: (1e-3, 3e-3), Q.Q4_0: (2e-3, 6e-3), Q.Q4_1: (2e-3, 6e-3),
          Q.IQ4_NL: (2e-4, 5e-4), Q.IQ4_XS: (5e-6, 1.5e-5), Q.Q3_K: (2e-4, 5e-4), Q.Q2_K: (5e-4, 1.5e-3),
          Q.IQ2_XXS: (2e-4, 5e-4)}


def random_blocks(rng: np.random.Generator, qtype: Q, rows: int, columns: int,
                  low: float | None = None, high: float | None = None) -> np.ndarray:
    """Random valid blocks of a [rows, columns] tensor in `qtype` (uint8 [rows, bytes], as
    GGUF stores it): random bytes for the codes and integer sub-block scales, float16 scales
    and minimums uniform in [low, high] (default: `SCALES`)."""
    if low is None:
        low, high = SCALES[qtype]
    per, size = gguf.GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, (rows, columns // per, size), dtype=np.uint8)
    for at in HALVES[qtype]:
        data[..., at:at + 2] = rng.uniform(low, high, (rows, columns // per, 1)).astype(np.float16).view(np.uint8)
    return data.reshape(rows, -1)


def _use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's choice of the layers whose attn_v and ffn_down get more bits in a _M mix: the
    first and last eighth, and every third between."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def q4_k_m(spec: ParamSpec, config: ModelConfig) -> Q:
    """The type llama.cpp's Q4_K_M gives a tensor (float32 for vectors)."""
    if len(spec.shape) == 1:
        return Q.F32
    name = spec.gguf_name
    if name == "output.weight" or (name == "token_embd.weight" and config.tie_embeddings):
        wanted = Q.Q6_K
    elif name.endswith(("attn_v.weight", "ffn_down.weight")):
        wanted = Q.Q6_K if _use_more_bits(int(name.split(".")[1]), config.num_layers) else Q.Q4_K
    else:
        wanted = Q.Q4_K
    return wanted if spec.stored_shape[1] % 256 == 0 else Q.Q5_0


def add_shape(w: gguf.GGUFWriter, config: ModelConfig) -> None:
    """The architecture keys that give `config`'s shape, as llama.cpp's converter writes them."""
    w.add_block_count(config.num_layers)
    w.add_context_length(config.max_context)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.ffn_size)
    w.add_head_count(config.num_heads)
    w.add_head_count_kv(config.num_kv_heads)
    w.add_rope_freq_base(config.rope_theta)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_vocab_size(config.vocab_size)
    w.add_rope_dimension_count(config.head_dim)
    w.add_key_length(config.head_dim)  # a head's width, which hidden / heads need not be
    w.add_value_length(config.head_dim)
    yarn = config.rope_scaling
    if yarn is not None and yarn.rope_type == "yarn":  # as the converter writes Qwen2.5's, Qwen3's
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(yarn.factor)
        w.add_rope_scaling_orig_ctx_len(yarn.original_max_position)
        if (yarn.beta_fast, yarn.beta_slow) != (32.0, 1.0):
            w.add_rope_scaling_yarn_beta_fast(yarn.beta_fast)
            w.add_rope_scaling_yarn_beta_slow(yarn.beta_slow)
        if yarn.attention_factor is not None:  # llama.cpp's multiplies the magnitude it computes
            default = dataclasses.replace(yarn, attention_factor=None).magnitude
            w.add_rope_scaling_yarn_attn_factor(yarn.attention_factor / default)


def write_random_gguf(path: str | Path, config: ModelConfig, arch: str = "llama",
                      metadata: Callable[[gguf.GGUFWriter], None] | None = None,
                      mix: Callable[[ParamSpec, ModelConfig], Q] = q4_k_m, seed: int = 0) -> int:
    """Writes `config`'s tensors as random blocks of `mix`'s types (vectors: norms ones, biases
    small), with `metadata(writer)` adding keys (a tokenizer); returns the file's bytes."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    add_shape(w, config)
    w.add_name(config.name)
    if metadata:
        metadata(w)
    for spec in param_specs(config):
        qtype = mix(spec, config)
        if qtype == Q.F32:
            bias = spec.path[-1] == "bias"
            w.add_tensor(spec.gguf_name, (rng.normal(0, 0.02, spec.shape) if bias
                                          else np.ones(spec.shape)).astype(np.float32))
        else:
            rows, columns = spec.stored_shape
            w.add_tensor(spec.gguf_name, random_blocks(rng, qtype, rows, columns), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path).stat().st_size


def write_gguf_adapter(path: str | Path, config: ModelConfig, adapter, alpha: float,
                       arch: str = "llama") -> None:
    """A LoRA adapter (`model.lora.LoraAdapter`, its b scaled by alpha / r) as llama.cpp's
    convert_lora_to_gguf.py writes one: `general.type` "adapter", its alpha, and per projection
    `<tensor>.lora_a` [r, in] and `.lora_b` [out, r] in float32 without the alpha / r, the
    q/k rows of `lora_b` permuted for `arch`'s RoPE order where its converter permutes them."""
    from cadence.checkpoints.gguf import PERMUTED_ARCHITECTURES, permute_rope_rows

    specs = {(int(s.path[0].removeprefix("layers_")), s.path[2]): s for s in param_specs(config)
             if len(s.path) == 4 and s.path[3] == "kernel"}
    w = gguf.GGUFWriter(str(path), arch)
    w.add_type("adapter")
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", alpha)
    for key, (a, b) in adapter.weights.items():
        spec = specs[key]
        b_rows = b.T / (alpha / a.shape[1])
        if arch in PERMUTED_ARCHITECTURES and spec.rope_heads:
            b_rows = permute_rope_rows(b_rows, spec.rope_heads)
        for side, array in (("a", a.T), ("b", b_rows)):
            w.add_tensor(f"{spec.gguf_name}.lora_{side}", np.ascontiguousarray(array, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def copy_tokenizer(source: str | Path) -> Callable[[gguf.GGUFWriter], None]:
    """`write_random_gguf`'s `metadata`: every `tokenizer.*` key of the GGUF at `source`."""
    reader = gguf.GGUFReader(str(source))
    keys = [(name, field.contents(), field.types) for name, field in reader.fields.items()
            if name.startswith("tokenizer.")]

    def add(w: gguf.GGUFWriter) -> None:
        for name, value, types in keys:
            w.add_key_value(name, value, types[0], types[1] if len(types) > 1 else None)
    return add


def main(argv: list[str]) -> None:
    del argv
    f = flags.FLAGS
    arch, config = SHAPES[f.shape]
    size = write_random_gguf(f.out, config, arch,
                             copy_tokenizer(f.tokenizer_from) if f.tokenizer_from else None,
                             seed=f.seed)
    matrices = sum(int(np.prod(s.shape)) for s in param_specs(config) if len(s.shape) == 2)
    print(f"wrote {f.out}: {config.name}, {matrices / 1e9:.2f}B matrix weights, "
          f"{size / 2**20:.0f} MiB")


if __name__ == "__main__":  # the flags only here: tests import this module beside the server's
    flags.DEFINE_enum("shape", "qwen2.5-3b", list(SHAPES), "The model shape to write.")
    flags.DEFINE_string("tokenizer_from", None, "A GGUF whose tokenizer to copy (its vocabulary "
                        "the shape's): Qwen2.5's for the qwen2.5 and qwen3 shapes (both 151,936).")
    flags.DEFINE_string("out", None, "The GGUF to write.", required=True)
    flags.DEFINE_integer("seed", 0, "Random seed.")
    app.run(main)
