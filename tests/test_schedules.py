"""The baseline schedules against backprop, their bubbles, their hybrids and their errors.

Every schedule gets the same tiny Transformer (d_model 16, 2 heads, 4 layers, d_ff 32, seq 8),
the same initial parameters (cut with `partition.to_staged` for its layer split), the same batches
of 8 and the same AdamW; parameters are compared through `partition.from_staged`, so runs with
different stage counts are comparable.

Tolerance: parameters are O(0.02) (weights) to O(1) (norm scales) and move by ~5e-2 in 5 steps
of AdamW at lr 1e-2. A different but exact schedule changes only the order of float32 sums
(micro-batch accumulation, psum/pmean over devices), i.e. gradients by ~1e-7 relative, which
Adam's per-coordinate normalisation can amplify for near-zero gradient coordinates: observed
differences are <= 5.5e-6. ATOL = 2e-5 leaves over 3x margin and is 2500x below how far the
parameters move; a wrong gradient (a missing micro-batch, a stale stage) moves them by ~1e-3 or
more (Ouroboros' delayed gradients: 3e-2). Adam is blind to a uniform gradient scale, so the
per-step loss and the global gradient norm (taken before clipping) are compared too, at rtol
1e-5 (observed <= 1.1e-7): they catch a wrong 1/M or 1/D.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ouroboros_jax import placement, schedules, staged
from ouroboros_jax.models import model as transformer
from ouroboros_jax.models import partition
from ouroboros_jax.models.model import ConfigError
from ouroboros_jax.schedules import ScheduleConfig, build_schedule, ouroboros
from ouroboros_jax.schedules.compensation import Compensation

from helpers import cli_message, raises_for_cli

BATCH, SEQ, STEPS = 8, 8, 5
ATOL = 2e-5


def model_config(dropout=0.0):
  return transformer.ModelConfig(
    d_model=16, num_heads=2, num_layers=4, d_ff=32, seq_len=SEQ, dropout=dropout
  )


@functools.lru_cache(maxsize=None)
def initial_params():
  return transformer.init_params(model_config(), jax.random.key(0))


@functools.lru_cache(maxsize=None)
def batches():
  rng = np.random.default_rng(0)
  return tuple(
    {
      'inputs': jnp.asarray(rng.integers(0, 256, (BATCH, SEQ)), jnp.int32),
      'targets': jnp.asarray(rng.integers(0, 256, (BATCH, SEQ)), jnp.int32),
    }
    for _ in range(STEPS)
  )


@dataclasses.dataclass(frozen=True)
class Run:
  """One training run: a schedule, its layer split and its ScheduleConfig fields."""

  name: str
  layers_per_stage: tuple[int, ...]
  dropout: float = 0.0
  bubbles: str = 'zeros'  # gpipe's bubble fill: 'zeros' (the default) or 'nan'
  fields: tuple = ()  # other ScheduleConfig fields, as sorted (name, value) pairs


def run(name, layers_per_stage, *, dropout=0.0, bubbles='zeros', **fields):
  return Run(name, tuple(layers_per_stage), dropout, bubbles, tuple(sorted(fields.items())))


BACKPROP = run('backprop', (4,))
_RESULTS = {}


def trajectories(*runs):
  """For each run, ([params after each step, unstaged], [metrics of each step]) over STEPS steps.

  XLA compiles on one core and compiling dominates (seconds per schedule, milliseconds per step),
  so the runs not done yet are compiled side by side in threads; then they train one after the
  other (never two multi-device programs at once). Results are cached across tests.
  """
  todo = [r for r in dict.fromkeys(runs) if r not in _RESULTS]
  prepared = [_prepare(r) for r in todo]
  workers = max(1, min(len(todo), os.cpu_count() or 1, 4))
  with concurrent.futures.ThreadPoolExecutor(workers) as pool:
    compiled = list(pool.map(lambda lowered: lowered.compile(), [p[2] for p in prepared]))
  for r, (state, batch_sharding, _), step in zip(todo, prepared, compiled):
    params, metrics = [], []
    for batch in batches():
      state, m = step(state, jax.device_put(batch, batch_sharding))
      params.append(
        partition.from_staged(jax.tree.map(np.asarray, state.params), r.layers_per_stage)
      )
      metrics.append({k: float(v) for k, v in m.items()})
    _RESULTS[r] = params, metrics
  return [_RESULTS[r] for r in runs]


def _prepare(r: Run):
  """(initial state on the mesh, batch sharding, the lowered step with its shardings pinned)."""
  config = ScheduleConfig(name=r.name, num_stages=len(r.layers_per_stage), seed=3, **dict(r.fields))
  model = partition.transformer_stages(model_config(r.dropout), r.layers_per_stage)
  tx = staged.adamw(1e-2)
  if r.bubbles == 'zeros':
    schedule = build_schedule(config, model, tx)
  else:
    schedule = schedules.build_gpipe(config.resolve('cpu'), model, tx, bubble_fill=float(r.bubbles))
  mesh = schedule.mesh
  state = schedule.init(partition.to_staged(initial_params(), r.layers_per_stage), batches()[0])
  replicated = NamedSharding(mesh, P())
  on_mesh = lambda x: isinstance(x.sharding, NamedSharding) and x.sharding.mesh == mesh
  state = jax.tree.map(lambda x: x if on_mesh(x) else jax.device_put(x, replicated), state)
  state_sharding = jax.tree.map(lambda x: x.sharding, state)
  batch_sharding = placement.named(placement.batch_spec(batches()[0]), mesh)
  # Pinned shardings, so the compiled step takes its own output as its next input.
  step = jax.jit(
    schedule.step,
    in_shardings=(state_sharding, batch_sharding),
    out_shardings=(state_sharding, replicated),
  )
  return state, batch_sharding, step.lower(state, batches()[0])


def max_abs_diff(a, b):
  return max(float(np.max(np.abs(x - y))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def assert_same_training(got, want, what, *, steps=STEPS):
  """Parameters after `steps` steps within ATOL, loss and gradient norm of every step within
  rtol 1e-5 (Adam is blind to a gradient's scale; the norm is not)."""
  (params, metrics), (want_params, want_metrics) = got, want
  diff = max_abs_diff(params[steps - 1], want_params[steps - 1])
  assert diff < ATOL, f'{what}: parameters differ by {diff}'
  for key in ('loss', 'grad_norm'):
    np.testing.assert_allclose(
      [m[key] for m in metrics[:steps]],
      [m[key] for m in want_metrics[:steps]],
      rtol=1e-5,
      err_msg=f'{what}: {key}',
    )
  assert [m['loss_batch'] for m in metrics] == list(range(STEPS)), what


def assert_all_match_backprop(*runs):
  (want, *results) = trajectories(BACKPROP, *runs)
  assert max_abs_diff(want[0][-1], initial_params()) > 1e-2  # training really moved them
  for r, got in zip(runs, results):
    assert_same_training(got, want, r)


# ----------------------------------------------------------------------------- equivalences


def test_data_parallel_matches_backprop():
  assert_all_match_backprop(
    run('data_parallel', (4,), data_parallel=2), run('data_parallel', (4,), data_parallel=4)
  )


def test_model_parallel_matches_backprop():
  """G = 4, and G = 2 split unevenly (1, 3) on a stage 2 x data 2 mesh (and G = 2 alone in the
  dropout test below)."""
  assert_all_match_backprop(
    run('model_parallel', (1, 1, 1, 1)), run('model_parallel', (1, 3), data_parallel=2)
  )


def test_gpipe_matches_backprop_even_with_nan_in_its_bubbles():
  """G = 4 with M = 2 (most ticks of every device are idle), once with zeros and once with NaN
  as the bubbles' value (what an idle tick sends and an empty inbox slot holds), and G = 2 x
  data 2 with M = 4 (M = 1: the dropout test below). NaN bubbles must change nothing at all: no
  operation ever reads them."""
  zeros = run('gpipe', (1, 1, 1, 1), microbatches=2)
  nans = dataclasses.replace(zeros, bubbles='nan')
  assert_all_match_backprop(zeros, nans, run('gpipe', (2, 2), microbatches=4, data_parallel=2))
  (zero_params, zero_metrics), (nan_params, nan_metrics) = trajectories(zeros, nans)
  for a, b in zip(jax.tree.leaves(nan_params), jax.tree.leaves(zero_params)):
    assert np.all(np.isfinite(a))
    np.testing.assert_array_equal(a, b)
  assert nan_metrics == zero_metrics


def test_ring_schedules_draw_backprops_dropout_masks():
  """Dropout keys are per (batch, piece): with dropout 0.1, model_parallel and gpipe with one
  micro-batch still give exactly backprop's training (with the same layer split, since a
  stage splits its key over its layer slots)."""
  want, no_dropout, mp, gpipe = trajectories(
    run('backprop', (1, 3), dropout=0.1),
    BACKPROP,
    run('model_parallel', (1, 3), dropout=0.1),
    run('gpipe', (1, 3), dropout=0.1, microbatches=1),
  )
  assert max_abs_diff(want[0][-1], no_dropout[0][-1]) > 1e-3  # dropout is really on
  assert_same_training(mp, want, 'model_parallel')
  assert_same_training(gpipe, want, 'gpipe M=1')


def test_ouroboros_warmup_is_backprop_and_data_parallel_ring_is_whole_batch_ring():
  """Stage 2 x data 2 vs stage 2 x data 1, both with 2 synchronous warm-up steps then 3 delayed
  ones: the warm-up steps give backprop's training (they use model_parallel's gradient), the
  delayed steps do not, and splitting the batch over two rings changes nothing."""
  warmup, paper = 2, Compensation()
  one, two, plain = trajectories(
    run('ouroboros', (2, 2), sync_warmup_steps=warmup, compensation=paper),
    run('ouroboros', (2, 2), sync_warmup_steps=warmup, data_parallel=2, compensation=paper),
    BACKPROP,
  )
  assert_same_training(one, plain, 'ouroboros warm-up', steps=warmup)
  assert max_abs_diff(one[0][-1], plain[0][-1]) > 1e-3  # delayed: other gradients
  assert_same_training(two, one, 'ouroboros stage 2 x data 2')


# ----------------------------------------------------------------------------- idle fractions


def simulated_idle(busy_slots_per_device, total_slots):
  return 1.0 - busy_slots_per_device / total_slots


@pytest.mark.parametrize('num_stages', [1, 2, 4])
def test_idle_fractions(num_stages):
  model = partition.transformer_stages(model_config(), (4 // num_stages,) * num_stages)
  tx = staged.adamw(1e-3)
  build = lambda name, **kw: build_schedule(
    ScheduleConfig(name=name, num_stages=num_stages, **kw), model, tx
  )
  G = num_stages
  assert build('backprop').idle_fraction == 0.0
  assert build('data_parallel', data_parallel=2).idle_fraction == 0.0
  # model_parallel: G forward rounds (cost 1) and G backward rounds (cost 2), one device busy in
  # each; a device's busy time is 1 + 2 out of 3G.
  assert build('model_parallel').idle_fraction == pytest.approx(simulated_idle(3, 3 * G))
  assert build('model_parallel').idle_fraction == pytest.approx((G - 1) / G)
  for M in (1, 2, 4, 8):
    # gpipe: device s is busy at iteration i of M + G - 1 iff micro-batch i - s exists.
    iterations = M + G - 1
    busy = np.array([[0 <= i - s < M for i in range(iterations)] for s in range(G)])
    assert busy.sum(axis=1).tolist() == [M] * G
    idle = build('gpipe', microbatches=M).idle_fraction
    assert idle == pytest.approx(simulated_idle(M, iterations))
    assert idle == pytest.approx((G - 1) / (M + G - 1))
  assert build('gpipe', microbatches=1).idle_fraction == pytest.approx(
    build('model_parallel').idle_fraction
  )  # one micro-batch: no pipeline
  # Ouroboros: G locked forward rounds, then one backward everywhere at once.
  assert build('ouroboros').idle_fraction == pytest.approx(simulated_idle(1 + 2, G * 1 + 2))
  assert build('ouroboros').idle_fraction == pytest.approx(ouroboros.idle_fraction(G))
  if G == 4:
    assert build('model_parallel').idle_fraction == 0.75
    assert build('gpipe', microbatches=4).idle_fraction == pytest.approx(3 / 7)
    assert build('ouroboros').idle_fraction == pytest.approx(0.5)


# ----------------------------------------------------------------------------- errors


def test_batch_not_divisible_by_replicas_times_microbatches_is_a_clear_error():
  model = partition.transformer_stages(model_config(), (2, 2))
  params = partition.to_staged(initial_params(), (2, 2))
  tx = staged.adamw(1e-3)
  good, bad = batches()[0], {k: v[:6] for k, v in batches()[0].items()}

  gpipe = build_schedule(
    ScheduleConfig(name='gpipe', num_stages=2, data_parallel=2, microbatches=4), model, tx
  )
  with pytest.raises(ConfigError) as error:
    gpipe.init(params, bad)
  message = cli_message(error.value)
  assert '\n' not in message
  for part in ('batch size 6', '2 x 4 = 8', '--batch-size', '--data-parallel', '--microbatches'):
    assert part in message
  for part in ('batch_size', 'data_parallel', 'microbatches'):  # to a Python caller: the fields
    assert part in str(error.value)
  state = gpipe.init(params, good)
  with pytest.raises(ConfigError, match='2 x 4 = 8'):  # the step checks too
    gpipe.step(state, bad)

  with pytest.raises(ConfigError, match='1 x 3 = 3'):
    build_schedule(ScheduleConfig(name='gpipe', num_stages=2, microbatches=3), model, tx).init(
      params, good
    )
  for name in ('data_parallel', 'model_parallel'):
    schedule = build_schedule(ScheduleConfig(name=name, num_stages=2, data_parallel=3), model, tx)
    with raises_for_cli(r'batch size 8 is not divisible by --data-parallel = 3'):
      schedule.init(params, good)


def test_impossible_settings_are_clear_errors():
  model = partition.transformer_stages(model_config(), (2, 2))
  tx = staged.adamw(1e-3)
  with raises_for_cli('--microbatches must be >= 1, got 0'):
    build_schedule(ScheduleConfig(name='gpipe', num_stages=2, microbatches=0), model, tx)
  with raises_for_cli('unknown --schedule pipedream.*gpipe'):
    build_schedule(ScheduleConfig(name='pipedream'), model, tx)
  for name, fields in (
    ('model_parallel', {'num_stages': 16}),
    ('gpipe', {'num_stages': 4, 'data_parallel': 4}),
  ):
    with pytest.raises(ConfigError, match='need 16 devices'):
      build_schedule(ScheduleConfig(name=name, **fields), model, tx)
  schedule = build_schedule(ScheduleConfig(name='model_parallel', num_stages=4), model, tx)
  with raises_for_cli(r'has leading axis 2, but model_parallel with --stages 4 needs 4 \(one'):
    schedule.init(partition.to_staged(initial_params(), (2, 2)), batches()[0])
  assert schedules.SCHEDULES == (
    'backprop',
    'data_parallel',
    'model_parallel',
    'gpipe',
    '1f1b',
    'interleaved',
    'zb_h1',
    'zb_v',
    'ouroboros',
  )
