"""Activation recomputation for every schedule (--stash-policy): what a layer group's forward
keeps for its backward changes memory and time, never the gradient.

Backprop and data parallelism recompute per layer (`staging.recompute_layers` around the layer
loop), model_parallel and the table pipelines per layer group (their stash keeps the policy's
residuals of each micro-batch in flight; the zero-bubble split's B recomputes, its W does not).
Each schedule under each policy is checked against plain backprop, which keeps every residual;
the compiler's own memory analysis shows that the policy keeps less."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest

from ouroboros_jax.errors import ConfigError
from ouroboros_jax.models import model as transformer
from ouroboros_jax.models import partition
from ouroboros_jax.schedules import ScheduleConfig, build_schedule

from helpers import max_abs_diff, random_batches, run_schedule, tiny_transformer

BATCHES = random_batches(2, batch=8)
SGD = optax.sgd(0.5)
# Each step builder; of the exact pipelines, which share one executor (pipeline.py) and recompute
# in it, 1F1B (a chunk a device, a fused backward) and ZB-V (two chunks, B and W apart through
# the tiny Transformer's taps) take every path a table does (GPipe, interleaved and ZB-H1 too
# before: 11 s of a 15-minute suite).
SCHEDULES = [
  ('backprop', 1, {}),
  ('data_parallel', 1, {'data_parallel': 2}),
  ('model_parallel', 2, {}),
  ('1f1b', 2, {}),
  ('zb_v', 2, {}),
]


def _config(name, num_stages, policy, **fields) -> ScheduleConfig:
  return ScheduleConfig(name=name, num_stages=num_stages, stash_policy=policy, **fields)


def _model(config: ScheduleConfig, **model):
  layers = (4 // config.stage_groups,) * config.stage_groups
  staged, params = tiny_transformer(
    config.stage_groups, num_layers=4, layers_per_stage=layers, **model
  )
  return staged, params, layers


def _trained(config: ScheduleConfig):
  staged, params, layers = _model(config)
  state, _ = run_schedule(config, staged, SGD, params, BATCHES)
  return partition.from_staged(jax.device_get(state.params), layers)


@pytest.fixture(scope='module')
def backprop_params():
  return _trained(_config('backprop', 1, 'all'))


@pytest.mark.parametrize('name, num_stages, fields', SCHEDULES, ids=[s[0] for s in SCHEDULES])
def test_every_policy_leaves_the_gradient_as_backprop_s(backprop_params, name, num_stages, fields):
  """Two SGD steps at 0.5 under 'dots' and 'nothing' equal plain backprop's within float32
  rounding of a different summation order (micro-batches, replicas: 2e-8 seen); a gradient
  computed from a stale or missing residual moves the parameters by more than 1e-3."""
  for policy in ('dots', 'nothing'):
    got = _trained(_config(name, num_stages, policy, **fields))
    assert max_abs_diff(got, backprop_params) < 1e-6, policy


def _temp_bytes(config: ScheduleConfig) -> int:
  """The step's scratch memory (activations and residuals) as XLA:CPU compiles it, for 4 layers
  of width 32 on 8 x 64 tokens."""
  cfg = transformer.ModelConfig(d_model=32, num_heads=2, num_layers=4, d_ff=128, seq_len=64)
  layers = (4 // config.stage_groups,) * config.stage_groups
  params = partition.to_staged(transformer.init_params(cfg, jax.random.key(0)), layers)
  schedule = build_schedule(config, partition.transformer_stages(cfg, layers), SGD)
  batch = {k: jnp.zeros((8, 64), jnp.int32) for k in ('inputs', 'targets')}
  state = schedule.init(params, batch)
  return schedule.step.lower(state, batch).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize(
  'name, num_stages, fields',
  [('backprop', 1, {}), ('1f1b', 2, {'microbatches': 4}), ('zb_h1', 2, {'microbatches': 4})],
  ids=['backprop', '1f1b', 'zb_h1'],
)
def test_keeping_nothing_needs_less_scratch_memory(name, num_stages, fields):
  """'nothing' keeps each layer's input (backprop) or each micro-batch's stage input (the
  pipelines) where 'all' keeps every residual: the compiled step's scratch memory shrinks."""
  keep_all = _temp_bytes(_config(name, num_stages, 'all', **fields))
  keep_nothing = _temp_bytes(_config(name, num_stages, 'nothing', **fields))
  assert keep_nothing < 0.8 * keep_all, (keep_nothing, keep_all)


def test_the_default_policy_is_ouroboros_nothing_and_all_elsewhere():
  assert ScheduleConfig(name='ouroboros', num_stages=2).resolved_stash_policy == 'nothing'
  assert ScheduleConfig(name='1f1b', num_stages=2).resolved_stash_policy == 'all'
  resolved = ScheduleConfig(name='1f1b', num_stages=2).resolve('cpu', 8)
  assert resolved.stash_policy == 'all' and resolved.label == '1f1b M=4'
  assert _config('1f1b', 2, 'nothing').label == '1f1b M=4 keep=nothing'
  with pytest.raises(
    ConfigError, match="unknown stash_policy='everything'; choose one of auto, all"
  ):
    _config('gpipe', 2, 'everything').validate()
