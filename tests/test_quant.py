"""Weight-only quantization (`model.quant`): the quantizers (per channel and grouped), the int8
tree against its spec, the model over int8 weights against the float model they stand for, and
the front doors' --weights."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from cadence.checkpoints.tokenizer import Tokenizer
from cadence.engine.reference import greedy_generate
from cadence.model import params as params_lib
from cadence.model.llama import forward
from cadence.model.paged_kv import PagedKVCache
from cadence.model import block_layout, cpu_kernels
from cadence.model.quant import (QMAX, dequantize, quantize, quantize_group_matrix, quantize_grouped,
                                   quantize_matrix)
from tests.serving import cli


def test_a_matrix_is_within_half_a_step_of_its_int8_form():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 48)).astype(np.float32) * np.linspace(0.01, 3, 48, dtype=np.float32)
    w[:, 5] = 0.0  # an all-zero channel
    for axis in (0, 1):
        q, scale = quantize_matrix(w, axis)
        assert isinstance(q, np.ndarray) and q.dtype == np.int8 and scale.dtype == np.float32
        assert scale.shape == (w.shape[axis],)
        back = q.astype(np.float32) * np.expand_dims(scale, 1 - axis)
        assert np.all(np.abs(back - w) <= np.expand_dims(scale, 1 - axis) / 2 + 1e-7)
        assert np.abs(q).max() == QMAX  # each channel's largest magnitude uses the whole range
    q, scale = quantize_matrix(w, 1)
    assert scale[5] == 1.0 and not q[:, 5].any()
    on_device, device_scale = quantize_matrix(jax.numpy.asarray(w), 1)  # XLA: amax * (1 / 127)
    np.testing.assert_allclose(np.asarray(device_scale), scale, rtol=2e-7)
    assert np.abs(np.asarray(on_device).astype(int) - q).max() <= 1


def test_the_int8_tree_is_its_spec(tiny_params, tiny_config):
    int8 = quantize(tiny_params, tiny_config)
    want = params_lib.abstract_params(tiny_config, weights="int8")
    flat = lambda t: {jax.tree_util.keystr(p): (a.shape, np.dtype(a.dtype))  # noqa: E731
                      for p, a in jax.tree_util.tree_leaves_with_path(t)}
    assert flat(int8) == flat(want)
    assert params_lib.weights_of(int8) == "int8" and params_lib.weights_of(tiny_params) == "float"
    assert "['layers_0']['attn']['q']['kernel_scale']" in flat(int8)
    assert flat(int8)["['embed']['embedding_scale']"] == ((tiny_config.vocab_size,), np.float32)
    with pytest.raises(ValueError, match="weights must be one of"):
        params_lib.param_specs(tiny_config, "int4")


def _logits(params, config):
    tokens = np.arange(3, 35, dtype=np.int32).reshape(2, 16)
    positions = np.tile(np.arange(16, dtype=np.int32), (2, 1))
    cache = PagedKVCache.create(config, 2, 16)
    run = jax.jit(lambda p, c: forward(p, tokens, positions, np.array([16, 11], np.int32), c,
                                       np.array([[0], [1]], np.int32), config=config)[0])
    return np.asarray(run(params, cache))


def test_the_int8_model_computes_the_model_its_weights_stand_for(tiny_params, tiny_config):
    """Against the dequantized float model: float rounding apart. Against the original float
    model: within 2% of the logits' range (this tiny model's logits reach ~50)."""
    int8 = quantize(tiny_params, tiny_config)
    got, stands_for = _logits(int8, tiny_config), _logits(dequantize(int8, tiny_config), tiny_config)
    scale = np.abs(stands_for).max()
    np.testing.assert_allclose(got, stands_for, rtol=0, atol=1e-5 * scale)
    original = _logits(tiny_params, tiny_config)
    assert np.abs(got - original).max() <= 0.02 * np.abs(original).max()
    assert not np.array_equal(got, original)  # it did read the int8 weights


@pytest.mark.slow
@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_cadence_generate_with_quantized_weights_gives_the_dequantized_reference(
        tiny_model_dir, tiny_params, tiny_config, weights):
    """On the CPU kernels --weights=int8/int4 are grouped (q8/q4), elsewhere int8 is per
    channel; either way the output is the reference's over the floats they stand for."""
    result = cli(tiny_model_dir, "cadence.server.generate_cli", "--prompt=The capital of France is",
                 "--max_tokens=12", "--temperature=0", f"--weights={weights}", "--decode_steps=4")
    if weights == "int4" and not cpu_kernels.available():
        assert result.returncode == 2 and "int4 runs on the CPU decode kernels" in result.stderr
        return
    assert result.returncode == 0, result.stderr
    tok = Tokenizer.from_hf_dir(tiny_model_dir[0] / "model")
    if cpu_kernels.available():
        floats = quantize_grouped(tiny_params, tiny_config, {"int8": "q8", "int4": "q4"}[weights])[0]
        assert f"matrices in {weights}" in result.stderr and "a float16 scale per 32 weights" in result.stderr
    else:
        floats = dequantize(quantize(tiny_params, tiny_config), tiny_config)
    ids = greedy_generate(floats, tiny_config, tok.encode("The capital of France is"), 12, tok.eos_ids)
    assert result.stdout.rstrip("\n") == tok.decode(ids, skip_special=True)
    assert f"{weights} weights" in result.stderr and "compilations_after_warmup: 0" in result.stderr


def test_int4_is_refused_off_the_cpu_kernels(tiny_model_dir):
    result = cli(tiny_model_dir, "cadence.server.generate_cli", "--prompt=Hi", "--weights=int4",
                 "--nocpu_kernels")
    assert result.returncode == 2
    assert "--weights=int4 runs on the CPU decode kernels" in result.stderr


@pytest.mark.parametrize("fmt", ["q8", "q4"])
def test_grouped_quantization_is_within_half_a_step_of_each_weight(fmt):
    """Each group of 32 rows of a column gets its own float16 scale (q4: and minimum); every
    weight is within half a step of what it becomes, a constant group included, and the
    grouped error is below the per-channel int8 one on columns whose magnitude varies."""
    rng = np.random.default_rng(1)
    w = rng.standard_normal((128, 40)).astype(np.float32) * np.linspace(0.01, 2, 128, dtype=np.float32)[:, None]
    w[32:64, 3] = 0.25  # a constant group
    q, scale, minimum = quantize_group_matrix(w, fmt)
    assert scale.dtype == np.float16 and scale.shape == (4, 40) and q.shape == w.shape
    assert (minimum is None) == (fmt == "q8")
    step = np.repeat(scale.astype(np.float32), 32, axis=0)
    back = block_layout.unpack_grouped(block_layout.pack_grouped(q, scale, minimum), 40)
    assert np.all(np.abs(back - w) <= step / 2 + 1e-3 * np.abs(w) + 1e-7)
    assert np.abs(back[32:64, 3] - 0.25).max() <= 1e-3
    per_channel, channel_scale = quantize_matrix(w, 1)
    if fmt == "q8":
        assert np.abs(back - w).mean() < 0.75 * np.abs(per_channel * channel_scale - w).mean()
    with pytest.raises(ValueError, match="multiples of 32"):
        quantize_group_matrix(w[:48], fmt)


def test_the_grouped_tree_stands_for_its_packed_matrices(tiny_params, tiny_config):
    """Every matrix packed, in the format asked for but the tied head, in q8 always; the float
    tree holds exactly what the packed matrices stand for."""
    floats, packed = quantize_grouped(tiny_params, tiny_config, "q4")
    assert cpu_kernels.grouped_format(packed[("embed", "embedding")]) == "q8"
    assert cpu_kernels.grouped_format(packed[("layers_0", "mlp", "up", "kernel")]) == "q4"
    for spec in params_lib.param_specs(tiny_config):
        array = params_lib.get(floats, spec.path)
        if spec.path not in packed:
            assert spec.path[-1] not in params_lib.MATRICES
            np.testing.assert_array_equal(array, params_lib.get(tiny_params, spec.path))
            continue
        matrix = array.T if spec.path[-1] == "embedding" else array
        np.testing.assert_array_equal(block_layout.unpack_grouped(packed[spec.path], matrix.shape[1]), matrix)
