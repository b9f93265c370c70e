"""The multi-level V-cycle: level shapes, the coalescing maps, what is function-preserving."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from ouroboros_jax import costs
from ouroboros_jax.accelerators import vcycle
from ouroboros_jax.models import model as transformer
from ouroboros_jax.models.model import ConfigError

SEQ, VOCAB = 8, 32
BIG = transformer.ModelConfig(
  vocab_size=VOCAB, d_model=16, num_heads=4, num_layers=4, d_ff=32, seq_len=SEQ
)


def random_params(cfg, seed=0, std=0.3):
  """Parameters of cfg's shapes, every leaf random (LayerNorm scales around 1): a harder test of
  function preservation than the initialisation (where biases are 0 and scales 1)."""
  shapes = jax.eval_shape(lambda: transformer.init_params(cfg, jax.random.key(0)))
  rng = np.random.default_rng(seed)

  def fill(path, leaf):
    base = 1.0 if getattr(path[-1], 'key', None) == 'scale' else 0.0
    return jnp.asarray(base + std * rng.standard_normal(leaf.shape), leaf.dtype)

  return jax.tree_util.tree_map_with_path(fill, shapes)


def shapes(tree):
  return jax.tree.map(lambda a: tuple(a.shape), tree)


TOKENS = jnp.asarray(np.random.default_rng(1).integers(0, VOCAB, (2, SEQ)), jnp.int32)


def logits_of(cfg):
  @jax.jit
  def run(params):
    x = transformer.embed(cfg, params['embed'], TOKENS)
    x = transformer.layers(cfg, params['layers'], x)
    return transformer.logits(cfg, params['head'], params['embed'], x)

  return run


def test_level_configs_and_shapes():
  configs = vcycle.level_configs(BIG, 3)
  assert [(c.d_model, c.num_heads, c.d_ff, c.num_layers) for c in configs] == [
    (16, 4, 32, 4),
    (8, 2, 16, 2),
    (4, 1, 8, 1),
  ]
  assert all(c.head_dim == BIG.head_dim for c in configs)  # heads merge, head size stays
  assert [c.num_layers for c in vcycle.level_configs(BIG, 2, width=False)] == [4, 2]
  assert [c.d_model for c in vcycle.level_configs(BIG, 2, depth=False)] == [16, 8]
  params = random_params(BIG)
  for big, small in zip(configs, configs[1:]):
    small_cfg, small_params = vcycle.coalesce(big, params)
    assert small_cfg == small
    assert shapes(small_params) == shapes(random_params(small))
    assert shapes(vcycle.decoalesce(small, small_params, big)) == shapes(params)
    params = small_params
  with pytest.raises(ConfigError, match='odd'):
    vcycle.coarser_config(configs[2])


def test_maps_are_the_papers_matrices():
  """Reshape-based maps == W' = F_out W F_in^T (paper's [out, in] layout; our kernels are
  [in, out]) with F_out = S (averaging) and F_in = T^T (summing), and W = T W' S back."""
  params = random_params(BIG)
  small = vcycle.coalesce_width(BIG, params, tied_compensation=False)
  T_D, S_D = vcycle.copy_matrix(16), vcycle.average_matrix(16)
  _T_F, S_F = vcycle.copy_matrix(32), vcycle.average_matrix(32)
  W = np.asarray(params['layers']['mlp_in']['kernel'][1]).T  # [F, D] = [out, in]
  # float32 products with 0/1 and 1/2 maps, a few terms per entry of O(0.02) weights: ~1e-9
  # rounding; 1e-6 (1e-7 for the de-coalescing) is far above it and far below a wrong map's O(0.02).
  np.testing.assert_allclose(
    np.asarray(small['layers']['mlp_in']['kernel'][1]).T, S_F @ W @ T_D, atol=1e-6
  )  # F_in^T = (T^T)^T = T
  W_qkv = np.asarray(params['layers']['qkv']['kernel'][0]).T  # [3D, D]
  want = np.concatenate([S_D @ W_qkv[16 * i : 16 * (i + 1)] @ T_D for i in range(3)])
  np.testing.assert_allclose(np.asarray(small['layers']['qkv']['kernel'][0]).T, want, atol=1e-6)
  np.testing.assert_allclose(
    small['embed']['token']['embedding'],
    np.asarray(params['embed']['token']['embedding']) @ S_D.T,
    atol=1e-6,
  )
  large = vcycle.decoalesce_width(BIG, small, tied_compensation=False)
  W_small = np.asarray(small['layers']['mlp_out']['kernel'][2]).T  # [D/2, F/2]
  np.testing.assert_allclose(
    np.asarray(large['layers']['mlp_out']['kernel'][2]).T, T_D @ W_small @ S_F, atol=1e-7
  )
  np.testing.assert_array_equal(np.asarray(S_D @ T_D), np.eye(8))


@pytest.mark.parametrize(
  'pre_ln,tied',
  [(False, False), (True, True), (False, True)],
  ids=['postLN-untied', 'preLN-tied', 'postLN-tied'],
)
def test_width_decoalescing_preserves_the_function(pre_ln, tied):
  """logits(decoalesce(M2)) == logits(M2), with every parameter random. With a tied embedding
  the plain maps give exactly twice the logits; the final-norm compensation fixes that. And
  coalesce(decoalesce(M2)) == M2 exactly."""
  big = dataclasses.replace(BIG, pre_ln=pre_ln, tie_embeddings=tied)
  small = vcycle.coarser_config(big, depth=False)
  m2 = random_params(small, seed=2)
  want = logits_of(small)(m2)
  big_logits = logits_of(big)
  large = vcycle.decoalesce(small, m2, big)
  # float32 logits O(1) through 4 layers whose sums run over twice as many terms: ~1e-6 relative;
  # rtol 1e-5 / atol 2e-5 is 10x that; a map that breaks the function moves logits by O(1).
  np.testing.assert_allclose(big_logits(large), want, atol=2e-5, rtol=1e-5)
  if tied:
    plain = vcycle.decoalesce(small, m2, big, tied_compensation=False)
    np.testing.assert_allclose(big_logits(plain), 2 * want, atol=4e-5, rtol=1e-5)
  back = vcycle.coalesce(big, large, depth=False)[1]
  jax.tree.map(np.testing.assert_array_equal, back, m2)


def test_untied_pre_ln_and_what_is_not_preserved():
  """Pre-LN with an untied head is preserved too; de-coalescing in depth is not (a copied layer
  applies its update twice), though coalesce(decoalesce(.)) is still the identity."""
  big = dataclasses.replace(BIG, tie_embeddings=False)
  small_w = vcycle.coarser_config(big, depth=False)
  m2 = random_params(small_w, seed=3)
  np.testing.assert_allclose(
    logits_of(big)(vcycle.decoalesce(small_w, m2, big)),
    logits_of(small_w)(m2),
    atol=2e-5,
    rtol=1e-5,
  )
  small_d = vcycle.coarser_config(big, width=False)
  m2_deep = random_params(small_d, seed=4)
  deep = vcycle.decoalesce(small_d, m2_deep, big)
  gap = np.max(np.abs(logits_of(big)(deep) - logits_of(small_d)(m2_deep)))
  assert gap > 1e-2
  jax.tree.map(np.testing.assert_array_equal, vcycle.coalesce_depth(deep), m2_deep)


def test_interpolation_endpoints_are_exact():
  a, b = random_params(BIG, seed=5), random_params(BIG, seed=6)
  jax.tree.map(np.testing.assert_array_equal, vcycle.interpolate(a, b, 0.0), a)
  jax.tree.map(np.testing.assert_array_equal, vcycle.interpolate(a, b, 1.0), b)
  mid = vcycle.interpolate(a, b, 0.25)
  jax.tree.map(
    # 0.75 x + 0.25 y in float32: one ulp or two.
    lambda m, x, y: np.testing.assert_allclose(m, 0.75 * x + 0.25 * y, rtol=1e-6, atol=1e-6),
    mid,
    a,
    b,
  )


def test_train_vcycle_runs_the_cycle():
  """Two levels: train M1, coalesce, train M2, de-coalesce, interpolate, continue M1."""
  rng = np.random.default_rng(0)
  batches = [
    {
      'inputs': rng.integers(0, VOCAB, (2, SEQ)).astype(np.int32),
      'targets': rng.integers(0, VOCAB, (2, SEQ)).astype(np.int32),
    }
    for _ in range(5)
  ]
  plan = vcycle.VCyclePlan(levels=2, down_steps=(2,), coarse_steps=2, up_steps=(1,), alpha=0.5)
  seen = {}
  params0 = random_params(BIG, std=0.02)
  final, log, configs = vcycle.train_vcycle(
    plan,
    BIG,
    iter(batches),
    lambda level: optax.sgd(0.1 * 2**level),
    vcycle.VCycleRun(
      params=params0, on_phase_end=lambda level, phase, p: seen.setdefault((level, phase), p)
    ),
  )
  assert [(r['level'], r['phase']) for r in log] == [(0, 'down')] * 2 + [(1, 'coarse')] * 2 + [
    (0, 'up')
  ]
  assert [c.d_model for c in configs] == [16, 8]
  assert all(np.isfinite(r['loss']) for r in log)
  flops = [costs.step_flops(configs[lv], 2 * SEQ) for lv in (0, 0, 1, 1, 0)]
  np.testing.assert_allclose([r['flops'] for r in log], np.cumsum(flops))
  assert flops[2] < flops[0] / 4  # half the width and half the depth
  assert shapes(final) == shapes(params0)
  # The interpolation is between M1 before coalescing and the de-coalesced trained M2.
  back = vcycle.decoalesce(configs[1], seen[(1, 'coarse')], BIG)
  want = vcycle.interpolate(seen[(0, 'down')], back, 0.5)
  jax.tree.map(
    # The same interpolation, written twice: float32 rounding, a few ulps.
    lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7),
    seen[(0, 'interpolate')],
    want,
  )
  jax.tree.map(np.testing.assert_array_equal, seen[(0, 'up')], final)
