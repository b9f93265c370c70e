"""Ouroboros with streamed micro-batches (`flow='stream'`): the M micro-batches of a step flow
round the ring one tick apart and across updates, so group s's gradient is ceil(lag / M)
updates old (delays.Timing). Checked against the slow reference, which runs one stream of
micro-batches M ticks per step (reference.py)."""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest

from ouroboros_jax.schedules import ScheduleConfig, build_schedule, delays, reference
from ouroboros_jax.schedules.compensation import Compensation
from ouroboros_jax.schedules.delays import Timing

from helpers import (
  adam,
  assert_trees_equal,
  max_abs_diff,
  random_batches,
  run_schedule,
  save_and_restore,
  tiny_transformer,
)

RECIPE = Compensation(predict=True, dc_lambda=0.5)  # the default recipe's compensations


def test_streamed_gaps_are_one_update_once_M_covers_the_lag():
  """Locked, group s lags G - s micro-batches; pipelined 2(G - s): ceil over M updates."""
  assert Timing(4, 'locked', 4, 'stream').stage_gaps == [1, 1, 1, 1]
  assert Timing(8, 'locked', 8, 'stream').stage_gaps == [1] * 8
  assert Timing(4, 'pipelined', 4, 'stream').stage_gaps == [2, 2, 1, 1]
  assert Timing(4, 'pipelined', 8, 'stream').stage_gaps == [1] * 4
  assert Timing(4, 'locked', 2, 'stream').stage_gaps == [2, 2, 1, 1]
  # as one batch the gaps stay the paper's, whatever M
  assert Timing(4, 'locked', 4, 'batch').stage_gaps == [4, 3, 2, 1]
  assert Timing(4, 'pipelined', 4, 'batch').stage_gaps == [8, 6, 4, 2]


# Issue 62's table: (G, M) -> (pipelined age, locked age), in updates.
AGES = {(16, 8): (4, 2), (16, 16): (2, 1), (16, 32): (1, 1), (8, 4): (4, 2), (8, 8): (2, 1)}


@pytest.mark.parametrize('G, M', list(AGES))
def test_the_gradient_age_is_the_lag_over_M_rounded_up(G, M):
  """The oldest gradient (the embedding's) is ceil(lag / M) updates old, lag G locked, 2G
  pipelined; as one batch it is the lag in whole steps, whatever M."""
  ages = tuple(delays.gradient_age(G, forward, M) for forward in ('pipelined', 'locked'))
  assert ages == AGES[(G, M)] == (math.ceil(2 * G / M), math.ceil(G / M))
  assert delays.gradient_age(G, 'pipelined', M, 'batch') == 2 * G
  assert delays.gradient_age(G, 'locked', M, 'batch') == G
  assert delays.gradient_age(1, 'locked', M) == 0


@pytest.mark.parametrize(
  'num_stages, stash, forward, micro, comp',
  [
    (3, 'graph', 'locked', 4, None),  # M > G: every gap 1, two weight versions in a step
    (3, 'replay', 'pipelined', 2, None),  # items straddle steps on both sides
    (4, 'graph', 'pipelined', 2, RECIPE),  # gaps 2, 2, 1, 1; the default compensations
    (2, 'graph', 'locked', 2, RECIPE),
  ],
  ids=['graph-locked', 'replay-pipelined', 'graph-pipelined-recipe', 'graph-locked-recipe'],
)
def test_streamed_ring_matches_slow_reference(num_stages, stash, forward, micro, comp):
  """Which micro-batch each group back-propagates, with which weights, and the update: the
  schedule equals the reference's one stream of micro-batches, with dropout."""
  model, params = tiny_transformer(num_stages, dropout=0.1)
  batches = random_batches(num_stages + 4, seed=2)
  options = dict(stash=stash, forward=forward, microbatches=micro, seed=3, flow='stream')
  config = ScheduleConfig(
    name='ouroboros', num_stages=num_stages, compensation=comp or Compensation(), **options
  )
  state, losses = run_schedule(config, model, adam(), params, batches)
  want, want_losses, _ = reference.run(model, adam(), params, batches, config)
  # Losses ~5.5: rtol 1e-5, ~100 float32 ulps. Parameters: float32, Adam at lr 1e-2: sums in another
  # order move parameters by <= ~5e-6 (Adam amplifies near-zero gradient coordinates;
  # test_schedules.py's docstring); 2e-5 is 4x that, a wrong or stale gradient moves them by > 1e-3.
  np.testing.assert_allclose(
    [x for x in losses if x], [x for x in want_losses if x is not None], rtol=1e-5
  )
  assert max_abs_diff(params, want) > 1e-2  # training really moved the weights
  assert max_abs_diff(state.params, want) < 2e-5
  # ... and streaming is not batching: the same micro-batches as one batch end elsewhere
  batched, _, _ = reference.run(
    model, adam(), params, batches, compensation=config.compensation, **{**options, 'flow': 'batch'}
  )
  assert max_abs_diff(batched, want) > 1e-3


def test_streamed_transformer_xl_warmup_mean_tie_and_replicas_match_reference():
  """A memory renewed micro-batch by micro-batch in tick order, the synchronous warm-up, a
  mean tie, and two data replicas each streaming its own rows."""
  model, params = tiny_transformer(2, num_layers=4, arch='transformer-xl', mem_len=8)
  batches = random_batches(7, seed=1, batch=8)
  options = dict(microbatches=2, sync_warmup_steps=2, tied_grad='mean', seed=5, flow='stream')
  state, _ = run_schedule(
    ScheduleConfig(name='ouroboros', compensation=Compensation(), num_stages=2, **options),
    model,
    adam(),
    params,
    batches,
  )
  want, _, _ = reference.run(model, adam(), params, batches, compensation=Compensation(), **options)
  assert max_abs_diff(state.params, want) < 2e-5
  # Two replicas, each streaming its own rows: fed the same half-batch twice they agree, so
  # their mean gradient is one half-batch stream's, which the reference runs alone.
  halves = [{k: v[:4] for k, v in b.items()} for b in batches]
  twice = [{k: np.concatenate([v, v]) for k, v in b.items()} for b in halves]
  replicated, _ = run_schedule(
    ScheduleConfig(
      name='ouroboros', compensation=Compensation(), num_stages=2, data_parallel=2, **options
    ),
    model,
    adam(),
    params,
    twice,
  )
  half, _, _ = reference.run(model, adam(), params, halves, compensation=Compensation(), **options)
  assert max_abs_diff(replicated.params, half) < 2e-5
  assert max_abs_diff(half, want) > 1e-3


def test_one_microbatch_streams_as_one_batch_and_the_stash_shrinks(tmp_path):
  """M = 1: streaming is the paper's ring, bit for bit. M = 4 at G = 4, locked: 8 micro-batches
  kept per device (group 0's 2G: its lag G and the G - 1 rounds the wave takes to reach the
  head) instead of the (G + 1) M = 20 as one batch, and a checkpoint resumes the stream
  exactly."""
  model, params = tiny_transformer(4, dropout=0.1)
  batches = random_batches(8, seed=6)
  config = lambda flow, micro: ScheduleConfig(
    name='ouroboros',
    compensation=Compensation(),
    num_stages=4,
    microbatches=micro,
    flow=flow,
    seed=1,
  )
  run = lambda flow, micro: run_schedule(config(flow, micro), model, adam(), params, batches)
  assert_trees_equal(run('stream', 1)[0].params, run('batch', 1)[0].params)
  schedule = build_schedule(config('stream', 4), model, adam())  # its step traced once
  streamed = run_schedule(config('stream', 4), model, adam(), params, batches, schedule)[0]
  # the ring's buffers have their shapes from the start
  batched = build_schedule(config('batch', 4), model, adam()).init(params, batches[0])
  slots = lambda state: jax.tree.leaves(state.ring['stash'])[0].shape[2]
  assert (slots(streamed), slots(batched)) == (8, 20)
  assert (
    jax.tree.leaves(streamed.ring['delta'])[0].shape[2] * 4
    == (jax.tree.leaves(batched.ring['delta'])[0].shape[2])
  )  # one micro-batch in flight per hop, not a whole batch

  state = schedule.init(params, batches[0])
  for batch in batches[:4]:
    state, _ = schedule.step(state, batch)
  restored, _ = save_and_restore(schedule, state, params, batches[0], tmp_path, {'position': 4})
  for batch in batches[4:]:
    state, _ = schedule.step(state, batch)
    restored, _ = schedule.step(restored, batch)
  assert_trees_equal(restored.params, state.params)
  assert_trees_equal(state.params, streamed.params)
