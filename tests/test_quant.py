"""Weight-only int8 (`model.quant`): the quantizer, the int8 tree against its spec, the model
over int8 weights against the float model they stand for, and the front doors' --weights."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from cadence.checkpoints.tokenizer import Tokenizer
from cadence.engine.reference import greedy_generate
from cadence.model import params as params_lib
from cadence.model.llama import forward
from cadence.model.paged_kv import PagedKVCache
from cadence.model.quant import QMAX, dequantize, quantize, quantize_matrix
from tests.test_disaggregated_engine import cli


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
def test_cadence_generate_with_int8_weights_gives_the_dequantized_reference(tiny_model_dir, tiny_params,
                                                                            tiny_config):
    result = cli(tiny_model_dir, "cadence.server.generate_cli", "--prompt=The capital of France is",
                 "--max_tokens=12", "--temperature=0", "--weights=int8", "--decode_steps=4")
    assert result.returncode == 0, result.stderr
    tok = Tokenizer.from_hf_dir(tiny_model_dir[0] / "model")
    floats = dequantize(quantize(tiny_params, tiny_config), tiny_config)
    ids = greedy_generate(floats, tiny_config, tok.encode("The capital of France is"), 12, tok.eos_ids)
    assert result.stdout.rstrip("\n") == tok.decode(ids, skip_special=True)
    assert "int8 weights" in result.stderr and "compilations_after_warmup: 0" in result.stderr
