"""The exact pipelines run from their tables (schedules/pipeline.py): backprop's parameters for
every schedule, G and M; the same dropout masks as gpipe; the data axis; the memory XLA reports; bad
settings."""

from __future__ import annotations

import dataclasses
import functools

import jax
import pytest

from ouroboros_jax import staged
from ouroboros_jax.choices import EXACT_PIPELINES
from ouroboros_jax.errors import ConfigError
from ouroboros_jax.models import model as transformer
from ouroboros_jax.perf import memory
from ouroboros_jax.schedules import ScheduleConfig, build_schedule, pipeline, ring, tables
from ouroboros_jax.training.field_flags import override
from ouroboros_jax.training.presets import get_preset
from ouroboros_jax.update import GroupedOptimizer

from helpers import (
  adam,
  max_abs_diff,
  raises_for_cli,
  random_batches,
  run_schedule,
  tiny_transformer,
)

STEPS, BATCH = 4, 8
ATOL = 5e-5  # float32 after 4 Adam steps at lr 1e-2 (measured: ~5e-6):
# reordered micro-batch sums, amplified by Adam on near-zero coordinates; 10x that, and a wrong
# gradient (a missing micro-batch) moves parameters by > 1e-3. Losses: abs 1e-5 on ~5.5, ~20 ulps.


def chunks_of(name):
  return tables.DEFAULT_CHUNKS.get(name, 1)


@functools.cache
def backprop(groups, dropout=0.0):
  """Backprop's (state, losses) on the model cut into `groups` one-layer groups."""
  model, params = tiny_transformer(groups, num_layers=groups, dropout=dropout)
  return run_schedule(ScheduleConfig(), model, adam(), params, random_batches(STEPS, batch=BATCH))


def run(name, stages, microbatches, dropout=0.0, **fields):
  groups = stages * chunks_of(name)
  model, params = tiny_transformer(groups, num_layers=groups, dropout=dropout)
  config = ScheduleConfig(name=name, num_stages=stages, microbatches=microbatches, **fields)
  return run_schedule(config, model, adam(), params, random_batches(STEPS, batch=BATCH))


# Every pipeline with as many micro-batches as stages and with twice as many (each at one
# depth, in turn), and at G = 4, M = 8 (16 cases before: 53 s of a 15-minute suite).
@pytest.mark.parametrize(
  'name, stages, microbatches',
  [
    *((name, 2 + 2 * (i % 2), 2 + 2 * (i % 2)) for i, name in enumerate(EXACT_PIPELINES)),
    *((name, 2, 4) for name in EXACT_PIPELINES[::2]),
    *((name, 4, 8) for name in EXACT_PIPELINES),
  ],
)
def test_every_pipeline_gives_backprops_parameters(name, stages, microbatches):
  (state, losses), (want, want_losses) = (
    run(name, stages, microbatches),
    backprop(stages * chunks_of(name)),
  )
  assert max_abs_diff(state.params, want.params) < ATOL
  assert losses == pytest.approx(want_losses, abs=1e-5)


def test_gpipe_and_1f1b_draw_each_microbatchs_own_dropout_masks():
  """With dropout, micro-batch m of batch t draws its masks from fold_in(batch_key(seed, t), m),
  as written straight out here on one device: the mean of the M micro-batches' gradients, one
  GroupedOptimizer step each. GPipe's table equals it, and 1F1B (another order of the same work)
  too; backprop, whose masks differ, does not."""
  model, params = tiny_transformer(2, num_layers=2, dropout=0.1)
  config = ScheduleConfig(name='gpipe', num_stages=2, microbatches=4)
  optimizer = GroupedOptimizer(adam(), config.clip_norm)
  grad_of = jax.jit(jax.grad(lambda p, b, k: model.forward_loss(p, b, k)[0]))
  want, opt_state = params, optimizer.init(params)
  for t, batch in enumerate(random_batches(STEPS, batch=BATCH)):
    key, micro = staged.batch_key(config.seed, t), ring.microbatches(batch, 4)
    grads = [grad_of(want, jax.tree.map(lambda a: a[m], micro), jax.random.fold_in(key, m))
             for m in range(4)]  # fmt: skip
    mean = jax.tree.map(lambda *g: sum(g) / 4, *grads)
    want, opt_state, _ = optimizer.apply(want, opt_state, mean)
  gpipe, _ = run('gpipe', 2, 4, dropout=0.1)
  one_f_one_b, _ = run('1f1b', 2, 4, dropout=0.1)
  assert max_abs_diff(gpipe.params, want) < ATOL
  assert max_abs_diff(one_f_one_b.params, want) < ATOL
  assert max_abs_diff(backprop(2, dropout=0.1)[0].params, want) > 1e-3


@pytest.mark.parametrize('pre_ln, layers_per_stage', [(True, (2, 2)), (False, (1, 3))])
def test_the_tapped_split_is_the_full_vjp(pre_ln, layers_per_stage):
  """B (input gradient and the taps' gradients) and W (weight gradient from the taps' gradients
  and the recorded sub-layer inputs) of the Transformer's WeightSplit give the stage's full VJP,
  pre- and post-LN, with dropout, on an uneven stage (padding layers skipped)."""
  model, params = tiny_transformer(
    2, pre_ln=pre_ln, dropout=0.1, num_layers=4, layers_per_stage=layers_per_stage
  )
  stash = pipeline.TappedStash(model.weight_split)
  x = jax.random.normal(jax.random.key(1), (BATCH, 8, 16))
  delta = jax.random.normal(jax.random.key(2), x.shape)
  key = jax.random.key(3)
  for s in range(2):
    params_s = jax.tree.map(lambda a: a[s], params['stages'])
    y, kept, _ = jax.jit(stash.forward, static_argnums=2)(params_s, x, s, key)
    dx, tap_grads = stash.input_grad(params_s, kept, delta, s, key)
    g = stash.weight_grad(params_s, kept, tap_grads)
    run = lambda p, h: model.stage(p, h, s, staged.piece_rng(key, s))
    want_y, vjp_fn = jax.vjp(run, params_s, x)
    want_g, want_dx = vjp_fn(delta)
    # One stage, float32, the same VJP split in two: y ~ O(1), a few ulps; dx and g sum over
    # 64 tokens in another order, ~64 * 2^-24 * O(1); a wrong tap moves them by O(0.1).
    assert max_abs_diff(y, want_y) < 1e-6
    assert max_abs_diff(dx, want_dx) < 1e-5
    assert max_abs_diff(g, want_g) < 1e-5


def test_without_a_weight_split_zb_takes_two_vjps_and_is_still_exact():
  groups = 2
  model, params = tiny_transformer(groups, num_layers=groups)
  model = dataclasses.replace(model, weight_split=None)
  config = ScheduleConfig(name='zb_h1', num_stages=2, microbatches=4)
  state, _ = run_schedule(config, model, adam(), params, random_batches(STEPS, batch=BATCH))
  assert max_abs_diff(state.params, backprop(groups)[0].params) < ATOL


def test_a_pipeline_on_each_data_replica_gives_backprops_parameters():
  (state, _), (want, _) = run('zb_h1', 2, 2, data_parallel=2), backprop(2)
  assert max_abs_diff(state.params, want.params) < ATOL


def test_the_schedules_idle_fraction_is_its_tables_bubble():
  model, _ = tiny_transformer(4, num_layers=4)
  got = build_schedule(ScheduleConfig(name='zb_h1', num_stages=4, microbatches=8), model, adam())
  assert got.idle_fraction == pytest.approx((3 / 24) / (1 + 3 / 24))


def test_xla_memory_orders_1f1b_below_gpipe_at_twice_as_many_microbatches_as_stages():
  """1F1B keeps p micro-batches' residuals where GPipe keeps all M = 2p (G = 4, M = 8)."""
  cfg = transformer.ModelConfig(d_model=32, num_heads=2, num_layers=4, d_ff=64, seq_len=32)
  report = lambda name: memory.memory_report(
    cfg, ScheduleConfig(name=name, num_stages=4, microbatches=8).resolve('cpu'), batch_size=16
  )
  gpipe, one_f_one_b = report('gpipe'), report('1f1b')
  if 'temp_bytes' not in gpipe:
    pytest.fail('this backend reports no memory analysis')
  assert one_f_one_b['temp_bytes'] < 0.75 * gpipe['temp_bytes']


def test_bad_pipeline_settings_name_the_flag_and_the_fix():
  model, params = tiny_transformer(4, num_layers=4)
  with raises_for_cli('--microbatches 6 is not a multiple of --stages 4; use --microbatches 8'):
    build_schedule(ScheduleConfig(name='interleaved', num_stages=4, microbatches=6), model, adam())
  with raises_for_cli('--chunks 3 applies to --schedule interleaved only'):
    ScheduleConfig(name='ouroboros', num_stages=2, chunks=3).validate()
  schedule = build_schedule(
    ScheduleConfig(name='1f1b', num_stages=2, microbatches=4, data_parallel=2), model, adam()
  )
  with raises_for_cli('--data-parallel x --microbatches = 2 x 4 = 8'):
    schedule.init(params, random_batches(1, batch=4)[0])
  with pytest.raises(ConfigError, match='2 x 2 chunks = 4 groups, more than the model.s 3 layers'):
    override(get_preset('tiny'), {'schedule': 'zb_v', 'stages': 2, 'num_layers': 3}).validate()
  wrong_cut = tiny_transformer(2, num_layers=4)[1]  # 2 groups where interleaved runs 4
  interleaved = build_schedule(
    ScheduleConfig(name='interleaved', num_stages=2, microbatches=2), model, adam()
  )
  with pytest.raises(ConfigError, match=r'num_stages=4\)'):
    interleaved.init(wrong_cut)
