"""Draining Ouroboros' ring (issue 63): from step T no new item enters, and the steps that
follow back-propagate and apply every item in flight (`Schedule.drain`). Checked against the slow
reference's flush (`reference.run(drain=True)`), which steps on until nothing is in flight."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from ouroboros_jax.schedules import ScheduleConfig, build_schedule, reference
from ouroboros_jax.schedules.compensation import Compensation
from ouroboros_jax.schedules.delays import Timing

from helpers import (
  adam,
  assert_trees_equal,
  max_abs_diff,
  random_batches,
  run_schedule,
  tiny_transformer,
)

RECIPE = Compensation(predict=True, dc_lambda=0.5)  # the default recipe's compensations
STEPS = 4  # batches before the drain


@pytest.mark.parametrize(
  'num_stages, forward, flow, micro, stash, comp',
  [
    (2, 'locked', 'stream', 2, 'graph', RECIPE),  # the default flow and compensations
    (3, 'pipelined', 'stream', 2, 'replay', Compensation()),  # items straddle the steps
    (2, 'pipelined', 'batch', 2, 'graph', Compensation()),  # the paper's delays: 4 steps
  ],
  ids=['locked-stream-recipe', 'pipelined-stream-replay', 'pipelined-batch'],
)
def test_a_drain_applies_what_is_in_flight_as_the_reference_does(
  num_stages, forward, flow, micro, stash, comp
):
  """After T steps and a drain, every group has applied every batch's gradient, each at the
  weights its stash kept and with the error gradient that came round: the reference's
  parameters, which differ from the undrained ones. The drained state is at step T with an
  empty ring, which takes new batches from T on."""
  model, params = tiny_transformer(num_stages, dropout=0.1)
  batches = random_batches(STEPS + 2, seed=4)
  config = ScheduleConfig(
    name='ouroboros',
    num_stages=num_stages,
    forward=forward,
    flow=flow,
    microbatches=micro,
    stash=stash,
    compensation=comp,
    seed=3,
  )
  schedule = build_schedule(config, model, adam())
  state, losses = run_schedule(config, model, adam(), params, batches[:STEPS], schedule)
  undrained = jax.device_get(state.params)  # (the drain's steps donate the state, as a step's do)
  drained = schedule.drain(state)
  want, _, updated = reference.run(model, adam(), params, batches[:STEPS], config, drain=True)
  # as test_stream_ring.py's bound: sums in another order, Adam at 1e-2 (<= ~5e-6)
  assert max_abs_diff(drained.params, want) < 2e-5
  assert max_abs_diff(drained.params, undrained) > 1e-3  # the drain applied something
  timing = Timing(num_stages, forward, micro, flow)
  assert len(updated) == STEPS + timing.drain_steps  # the reference's flush as long
  assert int(drained.step) == STEPS
  data = lambda a: (
    jax.random.key_data(a) if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key) else a
  )
  ring = jax.device_get(jax.tree.map(data, drained.ring))
  assert not any(np.any(a) for a in jax.tree.leaves({**ring, 'window': 0}))
  np.testing.assert_array_equal(ring['window'][0, 0], [STEPS * micro, np.iinfo(np.int32).max])
  # It trains on: the first step whose head sees only new items reports a loss close to the
  # last one before the drain (the loss stays continuous), and none is lost on the way.
  before = [x for x in losses if x][-1]
  losses = []
  for batch in batches[STEPS:] + batches[:STEPS]:
    drained, metrics = schedule.step(drained, batch)
    losses.append(float(metrics['loss']))
  first_full = -(-timing.head_ticks // micro)
  assert np.all(np.isfinite(losses)) and abs(losses[first_full] - before) < 0.1 * before


def test_an_exact_schedule_has_nothing_to_drain():
  model, params = tiny_transformer(2)
  config = ScheduleConfig(name='model_parallel', num_stages=2)
  state, _ = run_schedule(config, model, adam(), params, random_batches(2))
  assert build_schedule(config, model, adam()).drain(state) is state


def test_a_ring_saved_before_its_window_resumes_with_the_window_added(tmp_path):
  """A checkpoint of a ring from before the window (ring_layout 'micro-batch slots', no window
  leaf) is restored as saved and given the window its ring had then, [the warm-up's end, open):
  the state restored is the state saved, bit for bit, and steps on as it would have."""
  import orbax.checkpoint as ocp

  from ouroboros_jax.training import checkpoint, relayout, resume

  model, params = tiny_transformer(2)
  batches = random_batches(4, seed=1)
  config = ScheduleConfig(name='ouroboros', num_stages=2, microbatches=2, flow='stream')
  schedule = build_schedule(config, model, adam())
  state, _ = run_schedule(config, model, adam(), params, batches[:3], schedule)
  saved = jax.device_get(state)  # (a step donates the state it is given)
  manager = checkpoint.make_manager(str(tmp_path))
  old = state.replace(ring={k: v for k, v in state.ring.items() if k != 'window'})
  meta = {'schedule': 'ouroboros', 'ring_layout': resume.RING_LAYOUT_WITHOUT_WINDOW}
  # As that version wrote it: the ring inside the state item, stage-shaped.
  items = dict(state=ocp.args.StandardSave(old), data=ocp.args.JsonSave({}))
  manager.save(3, args=ocp.args.Composite(**items, meta=ocp.args.JsonSave(meta)))
  manager.wait_until_finished()
  target = checkpoint.abstract_like(schedule.init(params, batches[0]))
  move = relayout.Move((1, 1), (1, 1), add_window=True, microbatches=2)
  restored, _, step, _ = checkpoint.restore_newest(manager, target, lambda meta: move)
  manager.close()
  assert step == 3
  assert_trees_equal(restored, saved)
  want, _ = schedule.step(state, batches[3])
  got, _ = schedule.step(restored, batches[3])
  assert max_abs_diff(got.params, want.params) == 0.0
