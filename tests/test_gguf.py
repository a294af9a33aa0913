"""GGUF round trips: a tiny random Llama written the way llama.cpp's converter writes it."""

from __future__ import annotations

from pathlib import Path

import gguf
import jax
import numpy as np
import pytest

from checkpoints.errors import CheckpointError
from checkpoints.gguf import load_gguf, permute_rope_rows
from model.config import TINY
from tests.conftest import random_params
from tests.test_model import full_logits

Q = gguf.GGMLQuantizationType


def write_gguf(path: Path, config, params, quantize: bool, arch: str = "llama") -> None:
    """Writes params with GGUF names, [out, in] rows, permuted q/k, optionally quantized."""
    w = gguf.GGUFWriter(str(path), arch)
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

    def add(name: str, array: np.ndarray, qtype=Q.F32) -> None:
        array = np.ascontiguousarray(array, np.float32)
        if quantize and qtype != Q.F32:
            w.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, array)

    add("token_embd.weight", params["embed"]["embedding"], Q.Q8_0)
    for i in range(config.num_layers):
        L, blk = params[f"layers_{i}"], f"blk.{i}."
        add(blk + "attn_norm.weight", L["attn_norm"]["scale"])
        add(blk + "attn_q.weight", permute_rope_rows(L["attn"]["q"]["kernel"].T, config.num_heads), Q.Q4_1)
        add(blk + "attn_k.weight", permute_rope_rows(L["attn"]["k"]["kernel"].T, config.num_kv_heads), Q.Q4_1)
        add(blk + "attn_v.weight", L["attn"]["v"]["kernel"].T, Q.Q4_1)
        add(blk + "attn_output.weight", L["attn"]["o"]["kernel"].T, Q.Q8_0)
        add(blk + "ffn_norm.weight", L["mlp_norm"]["scale"])
        for proj in ("gate", "up", "down"):
            add(f"{blk}ffn_{proj}.weight", L["mlp"][proj]["kernel"].T, Q.Q4_1)
    add("output_norm.weight", params["final_norm"]["scale"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def quantize_like_the_writer(params):
    """What the quantized file holds, in cadence's layout: each tensor through quantize/dequantize."""
    def rows(a, qtype):  # quantization blocks run along rows as stored in the file
        a = np.ascontiguousarray(a, np.float32)
        return gguf.quants.dequantize(gguf.quants.quantize(a, qtype), qtype)

    def qd(kernel, qtype):  # kernels are stored as [out, in]
        return rows(kernel.T, qtype).T

    out = {"embed": {"embedding": rows(params["embed"]["embedding"], Q.Q8_0)},
           "final_norm": params["final_norm"]}
    for i in range(TINY.num_layers):
        L = params[f"layers_{i}"]
        # Quantization blocks run along rows of the [out, in] matrix, so permuting rows first
        # (as the file does) quantizes the same blocks: the round trip commutes with it.
        out[f"layers_{i}"] = {
            "attn_norm": L["attn_norm"], "mlp_norm": L["mlp_norm"],
            "attn": {"q": {"kernel": qd(L["attn"]["q"]["kernel"], Q.Q4_1)},
                     "k": {"kernel": qd(L["attn"]["k"]["kernel"], Q.Q4_1)},
                     "v": {"kernel": qd(L["attn"]["v"]["kernel"], Q.Q4_1)},
                     "o": {"kernel": qd(L["attn"]["o"]["kernel"], Q.Q8_0)}},
            "mlp": {p: {"kernel": qd(L["mlp"][p]["kernel"], Q.Q4_1)} for p in ("gate", "up", "down")},
        }
    return out


def test_f32_round_trip_is_exact(tmp_path, tiny_params):
    path = tmp_path / "tiny.gguf"
    write_gguf(path, TINY, tiny_params, quantize=False)
    config, params, fields = load_gguf(path)
    assert config.tie_embeddings and config.num_kv_heads == TINY.num_kv_heads
    assert fields["general.architecture"] == "llama"
    for (pa, a), (pb, b) in zip(_leaves(params), _leaves(tiny_params)):
        assert pa == pb
        np.testing.assert_array_equal(a, b, err_msg=pa)


def test_quantized_round_trip_matches_dequantized_weights_and_logits(tmp_path, tiny_params):
    path = tmp_path / "tiny-q.gguf"
    write_gguf(path, TINY, tiny_params, quantize=True)
    config, params, _ = load_gguf(path)
    want = quantize_like_the_writer(tiny_params)
    for (pa, a), (pb, b) in zip(_leaves(params), _leaves(want)):
        assert pa == pb
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6, err_msg=pa)
    tokens = np.arange(1, 30)
    np.testing.assert_allclose(
        full_logits(params, config, tokens), full_logits(want, TINY, tokens), rtol=1e-4, atol=1e-3
    )


def test_bad_files_get_clear_errors(tmp_path, tiny_params):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_gguf(tmp_path / "missing.gguf")
    corrupt = tmp_path / "corrupt.gguf"
    write_gguf(corrupt, TINY, tiny_params, quantize=False)
    corrupt.write_bytes(corrupt.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match="not a readable GGUF"):
        load_gguf(corrupt)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"definitely not gguf" * 10)
    with pytest.raises(CheckpointError, match="not a readable GGUF"):
        load_gguf(junk)
    other = tmp_path / "other.gguf"
    w = gguf.GGUFWriter(str(other), "mamba")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CheckpointError, match="architecture 'mamba' is not supported"):
        load_gguf(other)


def _leaves(tree):
    return [(jax.tree_util.keystr(p), np.asarray(v)) for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]]
