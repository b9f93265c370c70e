"""ouroboros_jax: Ouroboros delayed-gradient model parallelism for Transformer LMs, in JAX.

The pieces a researcher imports into their own code:

    from ouroboros_jax import StagedModel, ScheduleConfig, build_schedule, adamw
    from ouroboros_jax import Compensation, make_optimizer

`StagedModel` describes any model as embed -> stages -> loss; `build_schedule` turns it into a
pure, jitted `step(state, batch) -> (state, metrics)` for backprop, Ouroboros or a baseline.
`ScheduleConfig(compensation=Compensation(predict=True))` with `make_optimizer('muon', ...)` is
the staleness-robust Ouroboros (compensation.py); `Compensation()` is the paper's method.
Every error a user can fix is a `UserError` (errors.py) with a one-line message.
"""

from ouroboros_jax.errors import ConfigError, UserError
from ouroboros_jax.staged import Schedule, StagedModel, TrainState, adamw
from ouroboros_jax.schedules.compensation import Compensation, make_optimizer
from ouroboros_jax.schedules import SCHEDULES, ScheduleConfig, build_schedule

__all__ = ['SCHEDULES', 'Compensation', 'ConfigError', 'Schedule', 'ScheduleConfig',
           'StagedModel', 'TrainState', 'UserError', 'adamw', 'build_schedule', 'make_optimizer']
