"""ouroboros_jax: Ouroboros delayed-gradient model parallelism for Transformer LMs, in JAX.

The pieces a researcher imports into their own code:

    from ouroboros_jax import StagedModel, ScheduleConfig, build_schedule, adamw

`StagedModel` describes any model as embed -> stages -> loss; `build_schedule` turns it into a
pure, jitted `step(state, batch) -> (state, metrics)` for backprop, Ouroboros or a baseline.
"""

from ouroboros_jax.staged import Schedule, StagedModel, TrainState, adamw
from ouroboros_jax.schedules import SCHEDULES, ScheduleConfig, build_schedule

__all__ = ['SCHEDULES', 'Schedule', 'ScheduleConfig', 'StagedModel', 'TrainState', 'adamw',
           'build_schedule']
