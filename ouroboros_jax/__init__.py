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
is a `UserError` (errors.py) with a one-line message. The folders are the layers
(docs/architecture.md): the built-in models in `models/`, the data in `data/`. An old module path
(moved.py) still imports until 0.2.0, with a `DeprecationWarning` that names the new one.
"""

from __future__ import annotations

from ouroboros_jax import moved
from ouroboros_jax.errors import ConfigError, UserError

# txl registers Transformer-XL with model.init_params
from ouroboros_jax.models import txl  # noqa: F401
from ouroboros_jax.optimizers import kernel_dims, make_optimizer
from ouroboros_jax.schedules import SCHEDULES, ResolvedSchedule, ScheduleConfig, build_schedule
from ouroboros_jax.schedules.compensation import Compensation
from ouroboros_jax.staged import Schedule, StagedModel, TrainState, adamw
from ouroboros_jax.staging import Staging, from_layers

moved.install()  # the old module paths (moved.MOVED) still import, with a DeprecationWarning

# Loaded on first use: the training stack imports Orbax, Grain and TFDS.
_LAZY = {
  'TrainConfig': 'ouroboros_jax.training.config',
  'get_preset': 'ouroboros_jax.training.presets',
  'override': 'ouroboros_jax.training.field_flags',
  'Recipe': 'ouroboros_jax.training.recipe',
  'recipe': 'ouroboros_jax.training.recipe',
}
__getattr__ = moved.module_getattr(__name__, _LAZY)  # and the old paths (moved.MOVED)

__all__ = [
  'SCHEDULES',
  'Compensation',
  'ConfigError',
  'Recipe',
  'Schedule',
  'ResolvedSchedule',
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
