"""Transformer-XL under the schedules: the memory lives in the state, on the device of its stage.

The exact schedules must give backprop's parameters *and memory* after several steps (a memory
carried wrongly, e.g. rows of another micro-batch or the memory of another step, changes both);
Ouroboros must equal its slow reference, which keeps each group's memory as a Python value.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from ouroboros_jax.models import partition, txl
from ouroboros_jax.models.model import ConfigError, ModelConfig
from ouroboros_jax.schedules import ScheduleConfig, build_schedule, reference
from ouroboros_jax.schedules.compensation import Compensation

from helpers import (
  SEQ,
  adam,
  max_abs_diff,
  random_batches,
  run_schedule,
  save_and_restore,
  tiny_transformer,
)

TXL = dict(arch='transformer-xl', mem_len=8)
STEPS = 4


def _txl(num_stages, **kw):
  return tiny_transformer(num_stages, num_layers=4, **{**TXL, **kw})


def _memory(state):
  """Every stage's memory as [G, B, ...] (the data replicas' rows joined)."""
  merge = lambda a: np.asarray(a).reshape(a.shape[0], -1, *a.shape[3:])
  return jax.tree.map(merge, jax.device_get(state.ring['memory']))


def _assert_same_memory(state, want):
  got, expected = _memory(state), _memory(want)
  np.testing.assert_array_equal(got['filled'], expected['filled'])
  # float32 hidden states O(1): 2e-5 ~ 100 ulps of reordered sums; a stale memory differs by O(1).
  np.testing.assert_allclose(got['hidden'], expected['hidden'], atol=2e-5)


@pytest.fixture(scope='module')
def backprop_run():  # no dropout: replicas and micro-batches draw their own masks
  model, params = _txl(2)
  batches = random_batches(STEPS, batch=8)
  config = ScheduleConfig(name='backprop', seed=3)
  state, losses = run_schedule(config, model, adam(), params, batches)
  return model, params, batches, state, losses


@pytest.mark.parametrize(
  'name, stages, replicas, micro',
  [('data_parallel', 1, 2, 1), ('model_parallel', 2, 1, 1), ('gpipe', 2, 1, 2), ('gpipe', 2, 2, 2)],
)
def test_exact_schedules_carry_backprops_memory(backprop_run, name, stages, replicas, micro):
  model, params, batches, want, want_losses = backprop_run
  config = ScheduleConfig(
    name=name, num_stages=stages, data_parallel=replicas, microbatches=micro, seed=3
  )
  state, losses = run_schedule(config, model, adam(), params, batches)
  # Losses ~5.5: rtol 1e-5, ~100 float32 ulps. Parameters: float32, Adam at lr 1e-2: sums in another
  # order move parameters by <= ~5e-6 (Adam amplifies near-zero gradient coordinates;
  # test_schedules.py's docstring); 2e-5 is 4x that, a wrong or stale gradient moves them by > 1e-3.
  np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
  assert max_abs_diff(state.params, want.params) < 2e-5
  _assert_same_memory(state, want)


def test_backprop_memory_is_the_previous_segments_hidden_states(backprop_run):
  """After the steps every row's memory is full (filled = mem_len) and holds real states."""
  _, _, _, state, _ = backprop_run
  memory = _memory(state)
  assert memory['filled'].min() == 8 and np.abs(memory['hidden']).max() > 0


# Each stash at one depth (both stashes at both depths: test_ouroboros.py, without a memory).
@pytest.mark.parametrize('num_stages, stash', [(2, 'replay'), (3, 'graph')])
def test_ouroboros_matches_slow_reference(num_stages, stash):
  model, params = _txl(num_stages, dropout=0.1)
  batches = random_batches(6, seed=1)
  config = ScheduleConfig(
    name='ouroboros', compensation=Compensation(), num_stages=num_stages, stash=stash, seed=2
  )
  state, losses = run_schedule(config, model, adam(), params, batches)
  want, want_losses, _ = reference.run(
    model, adam(), params, batches, stash=stash, seed=2, compensation=Compensation()
  )
  np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
  assert max_abs_diff(params, want) > 1e-2
  assert max_abs_diff(state.params, want) < 2e-5
  for name in txl.SHARED:  # the global u, v: one value in every slot, though stages start late
    slots = np.asarray(state.params['stages'][name]).reshape(-1, 2, 8)
    np.testing.assert_array_equal(slots, np.broadcast_to(slots[0], slots.shape))
    assert np.abs(slots[0] - np.asarray(params['stages'][name])[0, 0]).max() > 1e-3


@pytest.mark.parametrize('stash', ['graph', 'replay'])
def test_pipelined_ouroboros_with_warmup_matches_slow_reference(stash):
  model, params = _txl(2)
  # Not seed 4: on its batches plain backprop itself, started from two states 6e-8 apart (the
  # float rounding of two exact paths), ends its next step 4e-3 apart (seeds 3, 5-8: < 3e-7), so
  # no tolerance tells a bug from rounding there.
  batches = random_batches(8, seed=5)
  config = ScheduleConfig(
    name='ouroboros',
    compensation=Compensation(),
    num_stages=2,
    stash=stash,
    forward='pipelined',
    sync_warmup_steps=2,
  )
  state, _ = run_schedule(config, model, adam(), params, batches)
  want, _, _ = reference.run(
    model,
    adam(),
    params,
    batches,
    stash=stash,
    forward='pipelined',
    sync_warmup_steps=2,
    compensation=Compensation(),
  )
  assert max_abs_diff(state.params, want) < 2e-5


def test_resume_is_bitwise_with_the_memory_in_the_state(tmp_path):
  model, params = _txl(2)
  batches = random_batches(6)
  config = ScheduleConfig(name='ouroboros', compensation=Compensation(), num_stages=2)
  schedule = build_schedule(config, model, adam())
  straight, _ = run_schedule(config, model, adam(), params, batches, schedule)
  state = schedule.init(params, batches[0])
  for batch in batches[:3]:
    state, _ = schedule.step(state, batch)
  restored, _ = save_and_restore(schedule, state, params, batches[0], tmp_path, {'position': 3})
  assert np.asarray(restored.ring['memory']['filled']).min() == 8  # the memory was saved
  for batch in batches[3:]:
    restored, _ = schedule.step(restored, batch)
  for a, b in zip(jax.tree.leaves(straight), jax.tree.leaves(restored)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_without_memory_every_schedule_runs_it():
  """mem_len 0: relative attention only, no state; the table pipelines run it too."""
  model, params = _txl(2, mem_len=0)
  assert model.memory is None
  batches = random_batches(2, batch=8)
  want, _ = run_schedule(ScheduleConfig(name='backprop'), model, adam(), params, batches)
  config = ScheduleConfig(name='zb_h1', num_stages=2, microbatches=2)
  state, _ = run_schedule(config, model, adam(), params, batches)
  assert max_abs_diff(state.params, want.params) < 2e-5


# 1F1B (a chunk a device, a fused backward) and ZB-V (two chunks, a split backward): every path of
# the one executor the tables share (interleaved and ZB-H1 too before: 12 s of a 15-minute suite).
@pytest.mark.parametrize('name', ['1f1b', 'zb_v'])
def test_table_pipelines_carry_backprops_memory(name):
  """Each chunk's memory of each micro-batch's rows, on the device that holds the chunk."""
  chunks = 2 if name in ('interleaved', 'zb_v') else 1
  model, params = _txl(2 * chunks)
  batches = random_batches(3, batch=8)
  want, want_losses = run_schedule(ScheduleConfig(name='backprop'), model, adam(), params, batches)
  config = ScheduleConfig(name=name, num_stages=2, microbatches=2, chunks=chunks)
  state, losses = run_schedule(config, model, adam(), params, batches)
  np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
  assert max_abs_diff(state.params, want.params) < 2e-5
  _assert_same_memory(state, want)


def test_init_without_an_example_batch_is_a_clear_error():
  model, params = _txl(2)
  schedule = build_schedule(ScheduleConfig(name='backprop'), model, adam())
  with pytest.raises(ConfigError, match='example_batch'):
    schedule.init(params)


def test_uneven_stages_keep_each_layers_memory():
  model, params = _txl(2, layers_per_stage=(1, 3))
  batches = random_batches(3, batch=8)
  want, _ = run_schedule(ScheduleConfig(name='backprop'), model, adam(), params, batches)
  config = ScheduleConfig(name='model_parallel', num_stages=2)
  state, _ = run_schedule(config, model, adam(), params, batches)
  assert max_abs_diff(state.params, want.params) < 2e-5
  assert max_abs_diff(state.ring, want.ring) < 2e-5


def test_global_biases_train_as_one_parameter():
  """u and v are one parameter read by every layer: backprop on uneven stage groups (1, 2, with
  a padding slot) trains them exactly as a loss written with ONE u and ONE v does under AdamW
  after a global-norm clip, straight from the equations (the gradient is the sum over layers)."""
  cfg = ModelConfig(d_model=16, num_heads=2, num_layers=3, d_ff=32, seq_len=SEQ, **TXL)
  layers_per_stage = (1, 2)
  flat = txl.init_params(cfg, jax.random.key(0))
  model = partition.transformer_stages(cfg, layers_per_stage)
  assert model.shared == txl.SHARED
  batches = random_batches(STEPS, batch=4)
  config = ScheduleConfig(name='backprop', seed=3, clip_norm=0.05)  # the clip binds
  state, _ = run_schedule(
    config, model, adam(), partition.to_staged(flat, layers_per_stage), batches
  )
  got = partition.from_staged(jax.device_get(state.params), layers_per_stage)

  def one_pair(p):  # the model written with one u and one v
    tied = {n: jnp.broadcast_to(p[n], (cfg.num_layers, *p[n].shape)) for n in txl.SHARED}
    return {'embed': p['embed'], 'layers': {**p['layers'], **tied}, 'head': p['head']}

  want = {**flat, **{n: flat['layers'][n][0] for n in txl.SHARED}}
  want['layers'] = {k: v for k, v in flat['layers'].items() if k not in txl.SHARED}
  tx, memory = adam(), txl.init_memory(cfg, cfg.num_layers, 4, cfg.mem_len)
  opt_state = tx.init(want)
  for batch in batches:
    loss = lambda p, memory: txl.loss_fn(cfg, one_pair(p), batch, memory)[0][0]
    grads = jax.grad(loss)(want, memory)
    memory = txl.loss_fn(cfg, one_pair(want), batch, memory)[1]
    norm = optax.tree.norm(grads)
    grads = jax.tree.map(lambda g: g * min(1.0, 0.05 / (norm + 1e-6)), grads)
    updates, opt_state = tx.update(grads, opt_state, want)
    want = optax.apply_updates(want, updates)
  for name in txl.SHARED:
    copies = got['layers'][name]
    np.testing.assert_array_equal(copies, np.broadcast_to(copies[0], copies.shape))
    # One device, the same AdamW steps unrolled by hand: float32 rounding of the same sums, a few
    # ulps of O(1) parameters (2e-6 ~ 16 ulps); a shared u updated per copy differs by > 1e-3.
    np.testing.assert_allclose(copies[0], want[name], atol=2e-6)
  assert max_abs_diff(got, one_pair(want)) < 2e-6
  assert (
    np.abs(np.asarray(want['r_w_bias']) - np.asarray(flat['layers']['r_w_bias'][0])).max() > 1e-3
  )


def test_untied_biases_stay_per_layer():
  """--untie-r: every layer draws and trains its own u and v (no shared state)."""
  model, params = _txl(2, untie_r=True)
  assert model.shared == ()
  u = np.asarray(params['stages']['r_w_bias']).reshape(4, -1)
  assert np.abs(u[0] - u[1]).max() > 0
  state = build_schedule(ScheduleConfig(name='backprop'), model, adam()).init(
    params, random_batches(1, batch=4)[0]
  )
  assert 'shared' not in state.opt_state
