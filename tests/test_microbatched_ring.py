"""Ouroboros with micro-batches inside its step (`--microbatches M`): the batch goes round the
ring in M chunks with the delays of the whole batch, so the step equals the un-chunked one; the
slow reference runs the M chunks as M streams (reference.py)."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from ouroboros_jax.schedules import ScheduleConfig, build_schedule, reference
from ouroboros_jax.schedules.compensation import Compensation

from helpers import (
  adam,
  assert_trees_equal,
  max_abs_diff,
  random_batches,
  run_schedule,
  save_and_restore,
  tiny_transformer,
)

TXL = dict(arch='transformer-xl', mem_len=8, pre_ln=True)


# Each micro-batch draws its own dropout mask, so the M-stream reference is not the un-chunked
# one; that it ends elsewhere is checked in the first case only (in every case before: 4 more
# reference runs, ~5 s of a 15-minute suite).
@pytest.mark.parametrize(
  'num_stages, stash, forward, micro',
  [
    (2, 'graph', 'locked', 2),  # the first: the un-chunked reference ends elsewhere
    (3, 'replay', 'locked', 4),
    (3, 'graph', 'pipelined', 4),
    (2, 'replay', 'pipelined', 2),
    (1, 'graph', 'locked', 2),
  ],
)
def test_microbatched_ring_matches_slow_reference(num_stages, stash, forward, micro):
  """With dropout: every micro-batch draws its own mask, in the schedule as in the reference."""
  model, params = tiny_transformer(num_stages, dropout=0.1)
  batches = random_batches(2 * num_stages + 4, seed=2)
  options = dict(stash=stash, forward=forward, microbatches=micro, seed=3)
  config = ScheduleConfig(
    name='ouroboros', compensation=Compensation(), num_stages=num_stages, **options
  )
  state, losses = run_schedule(config, model, adam(), params, batches)
  want, want_losses, _ = reference.run(model, adam(), params, batches, config)
  head_lag = num_stages if forward == 'pipelined' and num_stages > 1 else 0
  # Losses ~5.5: rtol 1e-5, ~100 float32 ulps. Parameters: float32, Adam at lr 1e-2: sums in another
  # order move parameters by <= ~5e-6 (Adam amplifies near-zero gradient coordinates;
  # test_schedules.py's docstring); 2e-5 is 4x that, a wrong or stale gradient moves them by > 1e-3.
  np.testing.assert_allclose(losses[head_lag:], want_losses[head_lag:], rtol=1e-5)
  assert max_abs_diff(params, want) > 1e-2  # training really moved the weights
  assert max_abs_diff(state.params, want) < 2e-5
  if (num_stages, stash, forward, micro) != (2, 'graph', 'locked', 2):
    return
  # ... and the M streams are not one: the un-chunked reference ends elsewhere
  whole, _, _ = reference.run(
    model, adam(), params, batches, dataclasses.replace(config, microbatches=1)
  )
  assert max_abs_diff(whole, want) > 1e-3


@pytest.mark.parametrize('stash', ['graph', 'replay'])
def test_microbatched_transformer_xl_warmup_and_data_parallel_match_reference(stash):
  """The memory cut into micro-batch rows, the synchronous warm-up in micro-batches, a mean tie
  and (with the graph stash) two data replicas, each running its own M = 2 streams."""
  model, params = tiny_transformer(2, num_layers=4, **TXL)
  batches = random_batches(7, seed=1, batch=8)
  options = dict(stash=stash, microbatches=2, sync_warmup_steps=2, tied_grad='mean', seed=5)
  config = ScheduleConfig(name='ouroboros', compensation=Compensation(), num_stages=2, **options)
  state, _ = run_schedule(config, model, adam(), params, batches)
  want, _, _ = reference.run(model, adam(), params, batches, config)
  assert max_abs_diff(state.params, want) < 2e-5
  if stash == 'replay':  # the replicas' streams are the stash's business only once: graph's
    return
  replicas = ScheduleConfig(
    name='ouroboros', compensation=Compensation(), num_stages=2, data_parallel=2, **options
  )
  replicated, _ = run_schedule(replicas, model, adam(), params, batches)
  # The reference has no data replicas: two replicas of M = 2 are its four streams (without
  # dropout: each replica folds the same micro-batch indices into its key).
  four, _, _ = reference.run(
    model, adam(), params, batches, dataclasses.replace(config, microbatches=4)
  )
  assert max_abs_diff(replicated.params, four) < 2e-5


@pytest.mark.parametrize('forward', ['locked', 'pipelined'])
def test_microbatches_leave_the_step_unchanged_without_dropout(forward):
  """M chunks with the same delays and summed gradients: the un-chunked step, to rounding."""
  model, params = tiny_transformer(3)
  batches = random_batches(10, seed=4)
  run = lambda m: run_schedule(
    ScheduleConfig(
      name='ouroboros', compensation=Compensation(), num_stages=3, forward=forward, microbatches=m
    ),
    model,
    adam(),
    params,
    batches,
  )
  (whole, losses_1), (chunked, losses_4) = run(1), run(4)
  assert max_abs_diff(params, whole.params) > 1e-2
  assert max_abs_diff(whole.params, chunked.params) < 2e-5
  np.testing.assert_allclose(losses_4, losses_1, rtol=1e-5)


@pytest.mark.parametrize(
  'stash, forward', [('graph', 'locked'), ('replay', 'pipelined')], ids=['graph', 'replay']
)
def test_a_stash_in_host_memory_leaves_the_parameters_bit_identical(stash, forward, tmp_path):
  """--stash-memory pinned_host: the stash (and the graph stash's weights) wait in the host's
  pinned memory; every value is the same, and a checkpoint keeps them there."""
  model, params = tiny_transformer(2, dropout=0.1)
  batches = random_batches(6, seed=2)
  options = dict(
    name='ouroboros',
    compensation=Compensation(),
    num_stages=2,
    stash=stash,
    forward=forward,
    microbatches=2,
  )
  on_device, _ = run_schedule(ScheduleConfig(**options), model, adam(), params, batches)
  config = ScheduleConfig(**options, stash_memory='pinned_host')
  in_host, _ = run_schedule(config, model, adam(), params, batches)
  assert max_abs_diff(params, in_host.params) > 1e-2
  assert_trees_equal(on_device.params, in_host.params)
  assert_trees_equal(on_device.ring['stash'], in_host.ring['host']['stash'])
  kinds = {a.sharding.memory_kind for a in jax.tree.leaves(in_host.ring['host'])}
  assert 'pinned_host' in kinds and 'stash' not in in_host.ring
  assert {a.sharding.memory_kind for a in jax.tree.leaves(in_host.params)} == {'device'}

  schedule = build_schedule(config, model, adam())
  restored, _ = save_and_restore(schedule, in_host, params, batches[0], tmp_path, {'position': 6})
  assert_trees_equal(restored, in_host)
  restored_kinds = [a.sharding.memory_kind for a in jax.tree.leaves(restored.ring['host'])]
  assert restored_kinds == [a.sharding.memory_kind for a in jax.tree.leaves(in_host.ring['host'])]
