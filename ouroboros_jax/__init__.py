"""ouroboros_jax: Ouroboros delayed-gradient model parallelism for Transformer LMs, in JAX.

The pieces a researcher imports into their own code:

    from ouroboros_jax import from_layers, StagedModel, ScheduleConfig, build_schedule, adamw
    from ouroboros_jax import recipe, Compensation, make_optimizer, kernel_dims
    from ouroboros_jax import TrainConfig, get_preset, override

`from_layers(embed, layer, head, layers=..., num_stages=G)` stages a model of one embedding, N
layers of one kind and a head (pure functions, Flax NNX or Linen modules) into a `StagedModel`
and its stacked parameters, uneven splits included (staging.py). `StagedModel` describes any
model as embed -> stages -> loss; `build_schedule` turns it into a
pure, jitted `step(state, batch) -> (state, metrics)` for backprop, Ouroboros or a baseline.
`recipe('ouroboros', num_stages, batch_size)` gives the library's default recipe, resolved as
`ouroboros train` resolves it: the `ScheduleConfig` (compensation, flow and micro-batches for the
platform) and the Optax optimizer (Muon) that `build_schedule` takes (training/recipe.py). A bare
`ScheduleConfig(name='ouroboros')` resolves to the same schedule when built; the paper's method is
`compensation=Compensation()`.
`ouroboros_jax.training.loop.train(cfg)` runs a whole `TrainConfig`. Every error a user can fix
is a `UserError` (errors.py) with a one-line message. The folders are the layers:
docs/architecture.md.
"""

from __future__ import annotations

import importlib

from ouroboros_jax import txl  # noqa: F401  (registers Transformer-XL with model.init_params)
from ouroboros_jax.errors import ConfigError, UserError
from ouroboros_jax.optimizers import kernel_dims, make_optimizer
from ouroboros_jax.schedules import SCHEDULES, ScheduleConfig, build_schedule
from ouroboros_jax.schedules.compensation import Compensation
from ouroboros_jax.staged import Schedule, StagedModel, TrainState, adamw
from ouroboros_jax.staging import Staging, from_layers

# Loaded on first use: the training stack imports Orbax, Grain and TFDS.
_LAZY = {
  'TrainConfig': 'ouroboros_jax.training.config',
  'get_preset': 'ouroboros_jax.training.config',
  'override': 'ouroboros_jax.training.config',
  'Recipe': 'ouroboros_jax.training.recipe',
  'recipe': 'ouroboros_jax.training.recipe',
}
# Where the modules of the old flat layout went: `from ouroboros_jax import presets` still works.
MOVED_MODULES = {
  'presets': 'training.config',
  'checkpoint': 'training.checkpoint',
  'data': 'training.data',
  'rundir': 'training.rundir',
  'sample': 'training.sample',
  'train': 'training.loop',
  'ring': 'schedules.ring',
  'ouroboros': 'schedules.ouroboros',
  'reference': 'schedules.reference',
  'delays': 'schedules.delays',
  'compensation': 'schedules.compensation',
  'pld': 'accelerators.pld',
  'growth': 'accelerators.growth',
  'vcycle': 'accelerators.vcycle',
  'stdloss': 'accelerators.stdloss',
  'bench': 'perf.bench',
  'simulate': 'perf.simulate',
  'memory': 'perf.memory',
  'launch': 'runtime.launch',
  'distributed': 'runtime.distributed',
  'host': 'runtime.host',
}


def __getattr__(name: str):
  if name in _LAZY:
    return getattr(importlib.import_module(_LAZY[name]), name)
  if name in MOVED_MODULES:
    return importlib.import_module(f'ouroboros_jax.{MOVED_MODULES[name]}')
  raise AttributeError(f'module ouroboros_jax has no attribute {name!r}')


__all__ = [
  'SCHEDULES',
  'Compensation',
  'ConfigError',
  'Recipe',
  'Schedule',
  'ScheduleConfig',
  'StagedModel',
  'Staging',
  'TrainConfig',
  'TrainState',
  'UserError',
  'adamw',
  'build_schedule',
  'from_layers',
  'get_preset',
  'kernel_dims',
  'make_optimizer',
  'override',
  'recipe',
]
