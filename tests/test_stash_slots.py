"""Ouroboros' stash in micro-batch slots (delays.Timing.stash_slots): item u waits in slot
u % N from its forward to its backward, so the stash holds the micro-batches in flight, not
whole steps."""

from __future__ import annotations

import pytest

from ouroboros_jax.schedules import ScheduleConfig
from ouroboros_jax.schedules.compensation import Compensation
from ouroboros_jax.schedules.delays import Timing

from helpers import random_batches, tiny_transformer

# (G, forward, M, flow) -> slots of each group, and what the stash in step slots held (depth x M).
# Pipelined and streamed, group s keeps its lag in flight plus the item being forwarded,
# 2(G - s) + 1, at any M; locked, its backward waits G - 1 - s rounds of the wave more, 2(G - s).
SLOTS = [
  ((8, 'pipelined', 8, 'stream'), [17, 15, 13, 11, 9, 7, 5, 3], 24),
  ((8, 'pipelined', 16, 'stream'), [17, 15, 13, 11, 9, 7, 5, 3], 32),
  ((8, 'pipelined', 32, 'stream'), [17, 15, 13, 11, 9, 7, 5, 3], 64),
  ((8, 'locked', 8, 'stream'), [16, 14, 12, 10, 8, 6, 4, 2], 16),
  ((8, 'locked', 32, 'stream'), [16, 14, 12, 10, 8, 6, 4, 2], 64),
  ((4, 'pipelined', 4, 'stream'), [9, 7, 5, 3], 12),
  ((4, 'pipelined', 1, 'stream'), [9, 7, 5, 3], 9),
  ((2, 'locked', 1, 'stream'), [3, 2], 3),
  # As one batch a message takes a step: whole batches are in flight, one item fewer than before
  # pipelined (the slot of the item being forwarded is the one just read), as many locked.
  ((4, 'pipelined', 4, 'batch'), [33, 25, 17, 9], 36),
  ((4, 'locked', 4, 'batch'), [20, 15, 10, 5], 20),
  ((1, 'locked', 4, 'batch'), [1], 4),
]


@pytest.mark.parametrize('setting, slots, before', SLOTS, ids=[str(s[0]) for s in SLOTS])
def test_each_group_keeps_the_items_in_flight(setting, slots, before):
  timing = Timing(*setting)
  assert [timing.group_stash_slots(s) for s in range(timing.num_stages)] == slots
  assert timing.stash_slots == slots[0] <= before  # SPMD: every device holds group 0's
  assert timing.depth * timing.microbatches == before


def _ring_survives(timing: Timing, stage: int, slots: int) -> bool:
  """Plays the step's loop as ouroboros._round runs it (forward, then backward, round by round)
  on a ring of `slots` slots: whether every backward finds its own item's stash."""
  num_micro, ring = timing.microbatches, {}
  steps = timing.embed_gap + 4  # past the first backward of a real item, the pipe full
  forward_offset = 0 if timing.forward_hop else stage  # locked: the wave reaches s in round s
  backward_offset = 0 if timing.forward_hop else timing.num_stages - 1
  for t in range(steps):
    for r in range(timing.rounds):
      j, m = r - forward_offset, r - backward_offset
      if 0 <= j < num_micro:
        item = t * num_micro + j - timing.forward_ticks(stage)
        ring[item % slots] = item
      if 0 <= m < num_micro:
        item = t * num_micro + m - timing.backward_ticks(stage)
        if item >= 0 and ring.get(item % slots) != item:
          return False
  return True


@pytest.mark.parametrize('forward', ['locked', 'pipelined'])
@pytest.mark.parametrize('flow', ['batch', 'stream'])
@pytest.mark.parametrize('num_stages', [1, 2, 3, 4])
def test_the_slots_are_the_fewest_the_loop_survives(num_stages, flow, forward):
  for micro in (1, 2, 3, num_stages, 2 * num_stages, 4 * num_stages):
    timing = Timing(num_stages, forward, micro, flow)
    for s in range(num_stages):
      slots = timing.group_stash_slots(s)
      assert _ring_survives(timing, s, slots), (timing, s)
      assert slots == 1 or not _ring_survives(timing, s, slots - 1), (timing, s)


def test_one_group_streamed_is_the_batch_flow_and_the_reference():
  """G = 1 has no delay, so streaming changes nothing: bit for bit the batch flow, and the slow
  reference. (With the stash in whole steps, a streamed G = 1 wrote its one slot in two halves
  and the second put back the last step's residuals: 0.096 from the reference.)"""
  from ouroboros_jax.schedules import reference

  from helpers import adam, assert_trees_equal, max_abs_diff, run_schedule

  model, params = tiny_transformer(1, dropout=0.1)
  batches = random_batches(5, seed=2, batch=16)
  run = lambda flow: ScheduleConfig(
    name='ouroboros', compensation=Compensation(), seed=3, microbatches=2, flow=flow
  )
  streamed, _ = run_schedule(run('stream'), model, adam(), params, batches)
  batched, _ = run_schedule(run('batch'), model, adam(), params, batches)
  assert_trees_equal(streamed.params, batched.params)
  want, _, _ = reference.run(model, adam(), params, batches, run('stream'))
  assert max_abs_diff(params, want) > 1e-2  # training moved the weights
  assert max_abs_diff(streamed.params, want) < 2e-5
