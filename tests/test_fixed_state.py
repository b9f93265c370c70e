"""Ouroboros' fixed state: what a device keeps whatever the batch (issue 40, item 5).

- The graph stash's forward weights: only the versions older than the step's own (its forward
  weights are at hand), each leaf kept as the narrower cast the forward reads it in
  (`stash.read_dtypes`), which changes nothing the step computes.
- DC-ASGD's weight history: with weight prediction and gaps of 1 (the streamed recipe) it is the
  weights less the latest update, which prediction keeps anyway; as one batch its max_delay
  slots are read before they are written.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from ouroboros_jax.schedules import ScheduleConfig, build_schedule
from ouroboros_jax.schedules import stash as stash_lib
from ouroboros_jax.schedules.compensation import Compensation, delay_compensation, remember_update
from ouroboros_jax.schedules.delays import Timing

from helpers import (
  adam,
  assert_trees_equal,
  max_abs_diff,
  random_batches,
  run_schedule,
  tiny_transformer,
)

RECIPE = Compensation(predict=True, dc_lambda=0.5)


def test_read_dtypes_follows_a_weight_through_loops_slices_and_checkpoints():
  bf16 = jnp.bfloat16

  def forward(p, x):
    def layer(h, w_DxD):
      return h @ w_DxD.astype(bf16), None

    h, _ = jax.lax.scan(layer, x, p['stacked'])
    one = jax.lax.dynamic_slice_in_dim(p['sliced'], 1, 1)[0]
    h = jax.checkpoint(lambda h, w: h @ w.astype(bf16))(h, one)
    scale = p['norm'].astype(bf16) * p['norm'].sum().astype(bf16)  # read wide as well as cast
    return h * scale, p['returned']

  p = {
    'stacked': jnp.ones((3, 4, 4)),
    'sliced': jnp.ones((2, 4, 4)),
    'norm': jnp.ones(4),
    'returned': jnp.ones(4),  # an output: it is read as it is
  }
  got = dict(zip(sorted(p), stash_lib.read_dtypes(forward, p, jnp.ones((2, 4), bf16))))
  assert got == {
    'norm': None,
    'returned': None,
    'sliced': jnp.dtype(bf16),
    'stacked': jnp.dtype(bf16),
  }
  # a forward that computes in float32 reads nothing narrower
  wide = lambda p, x: jax.lax.scan(lambda h, w: (h @ w, None), x, p['stacked'])[0]
  assert stash_lib.read_dtypes(wide, p, jnp.ones((2, 4))) == [None] * 4


def _ring_of(config, model, params, batch):
  return jax.eval_shape(build_schedule(config, model, adam()).init, params, batch).ring


def test_the_graph_stash_keeps_older_versions_of_bf16_weights_as_bf16():
  """Streamed, one older version per device (not two); as one batch G (not G + 1). This model's
  bf16 forward reads every weight as its bf16 cast (Linear and LayerNorm alike), so every
  version is kept in bf16."""
  model, params = tiny_transformer(3, num_layers=3, dtype='bfloat16')
  batch = random_batches(1)[0]
  for flow, micro, slots in (('stream', 4, 1), ('batch', 1, 3)):
    config = ScheduleConfig(
      name='ouroboros', num_stages=3, microbatches=micro, flow=flow, compensation=Compensation()
    )
    assert Timing(3, 'locked', micro, flow).weight_slots == slots
    weights = _ring_of(config, model, params, batch)['weights']
    for path, leaf in jax.tree_util.tree_leaves_with_path(weights):
      name = jax.tree_util.keystr(path)
      assert leaf.shape[2] == slots, name
      assert leaf.dtype == jnp.bfloat16, name


@pytest.mark.parametrize('flow, micro', [('stream', 2), ('batch', 1)])
def test_narrow_and_fewer_weight_versions_change_nothing(monkeypatch, flow, micro):
  """The same run bit for bit with every version kept in float32 (read_dtypes finding nothing):
  the bf16 casts are exact, and the step's own version is the step's forward weights."""
  model, params = tiny_transformer(2, num_layers=2, dtype='bfloat16', dropout=0.1)
  batches = random_batches(4, seed=4)
  config = ScheduleConfig(
    name='ouroboros', num_stages=2, microbatches=micro, flow=flow, compensation=RECIPE, seed=2
  )
  tx = optax.sgd(0.1)
  narrow, _ = run_schedule(config, model, tx, params, batches)
  assert {a.dtype for a in jax.tree.leaves(narrow.ring['weights'])} >= {jnp.dtype(jnp.bfloat16)}
  monkeypatch.setattr(stash_lib, 'read_dtypes', lambda fn, p, *a: [None] * len(jax.tree.leaves(p)))
  wide, _ = run_schedule(config, model, tx, params, batches)
  assert {a.dtype for a in jax.tree.leaves(wide.ring['weights'])} == {jnp.dtype(jnp.float32)}
  assert max_abs_diff(narrow.params, params) > 1e-3  # it trained
  assert_trees_equal(narrow.params, wide.params)


def _dc_updates(tx, grads_seq, w0):
  """The updates tx gives for a sequence of gradients, each at delay 1, applied as it goes."""
  tx = optax.with_extra_args_support(tx)
  state, w, out = tx.init(w0), w0, []
  for g in grads_seq:
    u, state = tx.update(g, state, w, delay=jnp.int32(1))
    w = optax.apply_updates(w, u)
    out.append(u)
  return out, state


def test_dc_reads_w_then_from_the_latest_update_as_from_its_history():
  """With prediction and gaps of 1, DC-ASGD keeps no history: w_then = w_now - u is the history's
  weights to float32 rounding, and the state loses a copy of the weights."""
  rng = np.random.default_rng(0)
  w0 = {'w': jnp.asarray(rng.normal(size=(8, 8)), jnp.float32)}
  grads = [{'w': jnp.asarray(rng.normal(size=(8, 8)), jnp.float32)} for _ in range(6)]
  chain = lambda **dc: remember_update(
    optax.chain(delay_compensation(0.5, 1, **dc), optax.with_extra_args_support(optax.sgd(0.1)))
  )
  history, history_state = _dc_updates(chain(), grads, w0)
  shared, shared_state = _dc_updates(chain(from_last_update=True), grads, w0)
  for a, b in zip(history, shared):
    np.testing.assert_allclose(b['w'], a['w'], rtol=1e-5, atol=1e-7)
  # the compensation did something: without it the updates differ
  plain, _ = _dc_updates(remember_update(optax.sgd(0.1)), grads, w0)
  assert max_abs_diff(plain[-1], history[-1]) > 1e-3
  size = lambda tree: sum(a.size for a in jax.tree.leaves(tree))
  assert size(history_state) - size(shared_state) == size(w0)  # one slot of history gone
  with pytest.raises(ValueError, match='remember_update'):
    _dc_updates(delay_compensation(0.5, 1, from_last_update=True), grads, w0)
  with pytest.raises(ValueError, match='at most 1'):
    delay_compensation(0.5, 2, from_last_update=True)


def test_dc_history_holds_max_delay_versions_and_reads_each_gap():
  """As one batch: max_delay slots, read before the write; gap tau gives the weights tau updates
  ago (w_0 before any), gap 0 the weights now, as the equations say."""
  weights = [jnp.float32(v) for v in (1.0, 2.0, 4.0, 8.0, 16.0)]  # w_n for n = 0..4
  w0 = {'w': weights[0]}
  tx = optax.with_extra_args_support(delay_compensation(1.0, 3))
  state = tx.init(w0)
  assert state.history['w'].shape == (3,)
  g = {'w': jnp.float32(1.0)}
  for n, w in enumerate(weights):
    for tau in range(4):
      u, _ = tx.update(g, state, {'w': w}, delay=jnp.int32(tau))
      ms = 0.05  # the running mean of g * g after one update from 0: (1 - 0.95) * 1
      w_then = w if tau == 0 else weights[max(n - tau, 0)]
      np.testing.assert_allclose(u['w'], 1 + 1 / np.sqrt(ms + 1e-7) * (w - w_then), rtol=1e-6)
    _, state = tx.update(g, state, {'w': w}, delay=jnp.int32(0))
    # keep the running mean as at the start, so every check above reads the same lambda
    state = state._replace(mean_square=jax.tree.map(jnp.zeros_like, state.mean_square))


def test_the_recipes_fixed_state_keeps_no_history_and_one_bf16_version():
  """Streamed recipe in bf16 (G = 2, M = 2): the stages' optimizer state is the optimizer's own
  (Adam here: two moments) plus DC's running mean and prediction's latest update, no history; the
  ring keeps one version of the weights, in bf16."""
  model, params = tiny_transformer(2, num_layers=2, dtype='bfloat16')
  batch = random_batches(1)[0]
  config = ScheduleConfig(
    name='ouroboros', num_stages=2, microbatches=2, flow='stream', compensation=RECIPE
  )
  state = jax.eval_shape(build_schedule(config, model, adam()).init, params, batch)
  nbytes = lambda tree: sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(tree))
  stage_params = nbytes(params['stages'])
  # Adam's mu and nu, DC's mean square, prediction's latest update: 4 copies; the history is gone
  assert nbytes(state.opt_state['stages']) == pytest.approx(4 * stage_params, rel=0.01)
  assert nbytes(state.ring['weights']) == stage_params // 2
