"""MSLT and progressive stacking: growing, freezing (no backward for frozen layers), the driver."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import optax
import pytest

from ouroboros_jax import costs
from ouroboros_jax.accelerators import growth
from ouroboros_jax.models import model as transformer
from ouroboros_jax.models.model import ConfigError

from helpers import assert_trees_equal, random_batches

SEQ, VOCAB = 8, 32
CFG = transformer.ModelConfig(
  vocab_size=VOCAB, d_model=16, num_heads=2, num_layers=4, d_ff=32, seq_len=SEQ
)


def batch_of(seed=0, size=2):
  return random_batches(1, seed, batch=size, seq=SEQ, vocab=VOCAB)[0]


@pytest.fixture(scope='module')
def params():
  return transformer.init_params(CFG, jax.random.key(0))


def layer(params, i):
  return jax.tree.map(lambda a: np.asarray(a[i]), params['layers'])


def test_grow_copies_the_top_layers_and_stacking_doubles(params):
  three = {**params, 'layers': jax.tree.map(lambda a: a[:3], params['layers'])}
  grown = growth.grow(three, 5)  # copy_top: new layers 3, 4 copy the top two, 1 and 2
  for i, source in enumerate([0, 1, 2, 1, 2]):
    assert_trees_equal(layer(grown, i), layer(three, source))
  assert_trees_equal(grown['embed'], three['embed'])
  two = {**params, 'layers': jax.tree.map(lambda a: a[:2], params['layers'])}
  stacked = growth.stack(two)  # layers 1..L -> L+1..2L
  assert jax.tree.leaves(stacked['layers'])[0].shape[0] == 4
  for i, source in enumerate([0, 1, 0, 1]):
    assert_trees_equal(layer(stacked, i), layer(two, source))
  fresh = growth.grow(two, 4, 'random', cfg=CFG, key=jax.random.key(5))
  assert_trees_equal(layer(fresh, 1), layer(two, 1))
  assert jax.tree.leaves(fresh['layers'])[0].shape[0] == 4
  for i in (2, 3):
    for old in (0, 1):
      assert not np.array_equal(layer(fresh, i)['qkv']['kernel'], layer(two, old)['qkv']['kernel'])
  with pytest.raises(ConfigError):
    growth.grow(two, 3, 'random')  # needs cfg and key


def test_frozen_layers_have_no_backward(params):
  """Matmul FLOPs read off the jaxpr (scan-length aware): with nothing frozen the step costs
  3x the forward (backprop); each frozen layer then costs exactly its forward F, i.e. 2F less
  than a trained one (F + 2F): no backward is computed for it."""
  batch = batch_of()
  one_layer = {**params, 'layers': jax.tree.map(lambda a: a[:1], params['layers'])}
  forward = costs.matmul_flops(
    lambda p: transformer.layers(
      CFG, p['layers'], transformer.embed(CFG, p['embed'], batch['inputs'])
    ),
    one_layer,
  )
  step = lambda num_frozen: costs.matmul_flops(
    lambda p: growth.mslt_grads(CFG, p, batch, None, num_frozen, train_embedding=True)[:2], params
  )
  full = step(0)
  assert full == 3 * costs.matmul_flops(lambda p: transformer.loss_fn(CFG, p, batch)[0], params)
  for num_frozen in (1, 3):
    assert step(num_frozen) == full - 2 * num_frozen * forward


def test_train_growth_runs_a_plan(params):
  """MSLT 1 -> 2 layers: the log, the FLOP accounting, and in phase 1 layer 0 and the embedding
  frozen (bit for bit, although the optimizer's weight decay would move any parameter it
  updates) while the new layer 1 (a copy of layer 0) and the head train."""
  cfg = transformer.ModelConfig(
    vocab_size=VOCAB, d_model=16, num_heads=2, num_layers=2, d_ff=32, seq_len=SEQ
  )
  batches = [batch_of(seed) for seed in range(4)]
  plan = growth.GrowthPlan(depths=(1, 2), steps=(2, 2), opt_state='carry')
  start = {**params, 'layers': jax.tree.map(lambda a: a[:1], params['layers'])}
  ends = {}
  grown, log = growth.train_growth(
    plan,
    cfg,
    iter(batches),
    lambda phase: optax.chain(optax.add_decayed_weights(0.1), optax.sgd(1e-2)),
    growth.GrowthRun(params=start, on_phase_end=lambda i, p: ends.setdefault(i, p)),
  )
  assert [r['phase'] for r in log] == [0, 0, 1, 1]
  assert [r['frozen'] for r in log] == [0, 0, 1, 1]
  assert [r['step'] for r in log] == list(range(4))
  tokens = 2 * SEQ
  per_step = [
    costs.step_flops(dataclasses.replace(cfg, num_layers=d), tokens, frozen_layers=f)
    for d, f in [(1, 0)] * 2 + [(2, 1)] * 2
  ]
  np.testing.assert_allclose([r['flops'] for r in log], np.cumsum(per_step))
  assert per_step[2] < costs.step_flops(dataclasses.replace(cfg, num_layers=2), tokens)
  assert all(np.isfinite(r['loss']) for r in log)
  assert jax.tree.leaves(grown['layers'])[0].shape[0] == 2
  assert not np.array_equal(layer(ends[0], 0)['qkv']['kernel'], layer(start, 0)['qkv']['kernel'])
  assert_trees_equal(layer(grown, 0), layer(ends[0], 0))
  assert_trees_equal(grown['embed'], ends[0]['embed'])
  for name in ('qkv', 'mlp_out'):
    assert not np.array_equal(layer(grown, 1)[name]['kernel'], layer(ends[0], 0)[name]['kernel'])
  assert not np.array_equal(
    grown['head']['ln_final']['scale'], ends[0]['head']['ln_final']['scale']
  )


def test_plan_validation():
  with pytest.raises(ConfigError, match='increasing'):
    growth.GrowthPlan(depths=(2, 2), steps=(1, 1)).validate()
  with pytest.raises(ConfigError, match='num-layers'):
    growth.GrowthPlan(depths=(1, 2), steps=(1, 1)).validate(CFG)
  plan = growth.stacking_plan(3, 2, (5, 7, 9))
  assert plan.depths == (3, 6, 12) and plan.method == 'stacking'
  assert [f for _, _, f in plan.phases()] == [0, 0, 0]
  assert [
    f for _, _, f in growth.GrowthPlan(depths=(1, 2, 4), steps=(1, 1, 1), final_steps=3).phases()
  ] == [0, 1, 2, 0]
