"""`recipe`: the library's default recipe in one Python call, resolved where the CLI resolves it.

    r = recipe('ouroboros', num_stages=2, batch_size=32, steps=1000)
    schedule = build_schedule(r.schedule, model, r.optimizer)
    r = recipe('data_parallel', data_parallel=2, batch_size=32)   # 2 replicas, not 2 stages

A bare `ScheduleConfig(name='ouroboros')` resolves its `auto`s when it is built, to the same
schedule (`ScheduleConfig.resolve`); the paper's method is `compensation=Compensation()`.
`recipe` gives the resolved settings and the optimizer, what `ouroboros train` gives for the same
flags: it builds the `TrainConfig` the CLI builds (the preset, the flags applied by
`field_flags.override`) and asks it the same questions, `TrainConfig.schedule_config` (the
compensation, the flow and the micro-batches for the platform) and `optimizer_setup.make_optimizer`
(the optimizer, its rates and their warmup and cosine decay). No default is restated here.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any, NamedTuple

import optax

from ouroboros_jax import optimizers
from ouroboros_jax.errors import ConfigError, field_ref
from ouroboros_jax.schedules.config import ResolvedSchedule, ScheduleConfig
from ouroboros_jax.training import config, field_flags, optimizer_setup, presets

# The TrainConfig flags that shape the schedule or the optimizer, besides ScheduleConfig's own
# (--schedule, --stages, --microbatches, --flow, ...): what `recipe` takes as keywords.
RECIPE_FLAGS = (
  'optimizer',
  'muon_learning_rate',
  'momentum',
  'state_dtype',
  'compensation',
  'dc_lambda',
  'shrink',
  'pipemare_steps',
  'predict_horizon',
  'warmup_steps',
  'min_lr_ratio',
  'weight_decay',
  'seed',
)


class Recipe(NamedTuple):
  """A resolved run without its model: what `build_schedule(schedule, model, optimizer)` takes."""

  schedule: ResolvedSchedule  # resolved for the platform: compensation, flow, micro-batches
  optimizer: optax.GradientTransformation  # with its learning-rate schedule over `config.steps`
  config: config.TrainConfig  # the run the CLI resolves for the same flags and stores in its
  # config.json (`TrainConfig.resolved`: no auto left)


def recipe(
  name: str = 'ouroboros',
  num_stages: int = 1,
  batch_size: int | None = None,
  *,
  platform: str | None = None,
  steps: int | None = None,
  learning_rate: float | None = None,
  preset: str = 'tiny',
  muon_dims: optimizers.MuonDims | None = None,
  **flags: Any,
) -> Recipe:
  """The schedule settings and the Optax optimizer `ouroboros train --preset PRESET --schedule
  NAME --stages NUM_STAGES --batch-size ... --steps ... --learning-rate ...` resolves on
  `platform` ('cpu', 'gpu', 'tpu'; None: `jax.default_backend()`).

  batch_size, steps, learning_rate: None keeps the preset's (the micro-batches divide the batch;
  the learning rates warm up and decay over `steps`). `flags`: any other flag that shapes the
  schedule or the optimizer, by its field name: ScheduleConfig's (`microbatches=`, `forward=`,
  `flow=`, `stash=`, `clip_norm=`, `data_parallel=`, ...) and `RECIPE_FLAGS`. The paper's method
  is explicit: `compensation='none'` (which also makes `optimizer='auto'` AdamW). `muon_dims`:
  your model's matrices for Muon (`optimizers.kernel_dims`; see `optimizers.muon_dimensions`).

  num_stages (the second argument) is a pipelined schedule's stage count, not a device count:
  backprop runs on one device, data parallelism on `data_parallel=R` replicas
  (`recipe('data_parallel', data_parallel=2)`).
  The optimizer is applied per module group ('embed', each stage, 'head') by the schedules;
  applied to the whole {'embed', 'stages', 'head'} tree it reads every leaf as they do
  (`optimizers.muon_dimensions`), but without their global-norm clip.
  Raises ConfigError (one line, naming the flag) where the CLI would."""
  _check_stages(name, num_stages)
  given = {'schedule': name, 'stages': num_stages, **flags}
  for flag, value in (
    ('batch_size', batch_size),
    ('steps', steps),
    ('learning_rate', learning_rate),
  ):
    if value is not None:
      given[flag] = value
  for flag in flags:
    field = config.fields().get(flag)
    if field is None or (field.owner is not ScheduleConfig and flag not in RECIPE_FLAGS):
      known = [f for f, v in config.fields().items() if v.owner is ScheduleConfig]
      close = difflib.get_close_matches(flag, known + list(RECIPE_FLAGS), n=1)
      hint = f'; did you mean {field_ref(close[0])}?' if close else ''
      raise ConfigError(
        f'recipe() takes the flags of the schedule and the optimizer, not {field_ref(flag)}{hint}'
      )
  cfg = field_flags.override(presets.get_preset(preset), given)  # as the CLI's config_from_args
  _validate(cfg)
  # A user's model: their muon_dims, never the built-in models' (which would place a user's
  # module that happens to share a name, e.g. a DenseGeneral 'qkv', silently and wrongly).
  optimizer = optimizer_setup.make_optimizer(cfg, muon_dims={} if muon_dims is None else muon_dims)
  return Recipe(cfg.schedule_config(platform), optimizer, cfg.resolved(platform))


def _check_stages(name: str, num_stages: int) -> None:
  """A stage count given to a schedule that runs every layer on each device, read as what the
  caller likely meant: a device count."""
  if name == 'data_parallel' and num_stages != 1:
    raise ConfigError(
      f"recipe('data_parallel', {num_stages}): the second argument is num_stages, a pipeline's "
      f'stage count, and data parallelism keeps every layer on each device; pass '
      f"data_parallel={num_stages} for {num_stages} replicas: recipe('data_parallel', "
      f'data_parallel={num_stages}).'
    )
  if name == 'backprop' and num_stages != 1:
    raise ConfigError(
      f"recipe('backprop', {num_stages}): the second argument is num_stages, a pipeline's stage "
      "count, and backprop runs every layer on one device; drop it, or use recipe('data_parallel', "
      f'data_parallel={num_stages}) for {num_stages} devices.'
    )


def _validate(cfg: config.TrainConfig) -> None:
  """The CLI's checks, for a model as deep as the schedule's groups: the preset's model is not
  the one the schedule will run, whose layers meet the stages when it is built."""
  deep = max(cfg.model.num_layers, cfg.schedule.stage_groups)
  dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, num_layers=deep)).validate()
