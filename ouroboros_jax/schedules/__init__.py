"""Every training schedule behind one builder: `build_schedule(config, model, tx)`.

    config = ScheduleConfig(name='gpipe', num_stages=4, microbatches=8, data_parallel=2)
    schedule = build_schedule(config, model, tx)
    state = schedule.init(params, example_batch)
    state, metrics = schedule.step(state, batch)        # pure, jitted, same for every schedule

Every schedule takes the same `StagedModel`, Optax transformation and batches, so their
parameters can be compared number for number. The schedules, what each computes and its idle
time: docs/design.md; Ouroboros: docs/algorithm.md.

The modules: `config` (ScheduleConfig), `synchronous` (backprop, data_parallel, model_parallel),
`fsdp` (data_parallel with its state sharded), `tables` (the exact pipelines, GPipe to ZB-V, as
data) and `pipeline` (their one executor),
`ouroboros` (the delayed ring), `ring` (the ring's pieces), `delays` (which batch each piece works
on), `compensation` (staleness compensation and the optimizers), `reference` (a slow Ouroboros
written from the equations).
"""

from __future__ import annotations

import optax

from ouroboros_jax import placement
from ouroboros_jax.choices import SCHEDULES
from ouroboros_jax.errors import ConfigError
from ouroboros_jax.placement import check_batch
from ouroboros_jax.schedules import tables
from ouroboros_jax.schedules.config import ResolvedSchedule, ScheduleConfig
from ouroboros_jax.schedules.fsdp import build_fsdp
from ouroboros_jax.schedules.pipeline import build_gpipe, build_pipeline, gpipe_idle_fraction
from ouroboros_jax.schedules.synchronous import (
  build_backprop,
  build_data_parallel,
  build_model_parallel,
  model_parallel_idle_fraction,
  replica_key,
  synchronous_update,
)
from ouroboros_jax.staged import Schedule, StagedModel

__all__ = [
  'SCHEDULES',
  'ResolvedSchedule',
  'ScheduleConfig',
  'build_schedule',
  'build_backprop',
  'build_data_parallel',
  'build_gpipe',
  'build_model_parallel',
  'check_batch',
  'gpipe_idle_fraction',
  'model_parallel_idle_fraction',
  'replica_key',
  'synchronous_update',
]


def build_schedule(
  config: ScheduleConfig, model: StagedModel, tx: optax.GradientTransformation, *, devices=None
) -> Schedule:
  """The builder every caller uses: checks `config` (one-line ConfigErrors), resolves it on the
  devices' platform (`ScheduleConfig.resolve`; Ouroboros' micro-batches from the batch `init` is
  given, which they may cut) and dispatches on `config.name`. Every schedule's `init` checks the
  parameters' stage groups against `config` (`placement.check_stage_params`) before it traces
  anything."""
  if not isinstance(config, ScheduleConfig):
    given = repr(config) if isinstance(config, str) else f'a {type(config).__name__}'
    raise ConfigError(
      f'build_schedule takes a ScheduleConfig, not {given}; pass '
      "ScheduleConfig(name='ouroboros', num_stages=G, ...) or recipe(...).schedule."
    )
  config.validate()
  if config.name == 'ouroboros':
    from ouroboros_jax.schedules import ouroboros

    return ouroboros.build(config, model, tx, devices=devices)
  config = config.resolve(placement.platform(devices))
  if config.fsdp and config.name == 'data_parallel':  # the stage schedules: their own layout
    return build_fsdp(config, model, tx, devices=devices)
  builders = {
    'backprop': build_backprop,
    'data_parallel': build_data_parallel,
    'model_parallel': build_model_parallel,
  }
  if config.name in builders:
    return builders[config.name](config, model, tx, devices=devices)
  if config.name in tables.PIPELINES:  # gpipe and the other exact pipelines: from their tables
    return build_pipeline(config, model, tx, devices=devices)
  raise AssertionError(config.name)  # validate() knows SCHEDULES
