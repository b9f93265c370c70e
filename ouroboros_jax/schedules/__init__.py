"""Every training schedule behind one builder: `build_schedule(config, model, tx)`.

    config = ScheduleConfig(name='gpipe', num_stages=4, microbatches=8, data_parallel=2)
    schedule = build_schedule(config, model, tx)
    state = schedule.init(params, example_batch)
    state, metrics = schedule.step(state, batch)        # pure, jitted, same for every schedule

Schedules (G = num_stages, R = data_parallel, M = microbatches; idle = the fraction of
device-time doing no work, with a backward costing twice a forward):
  backprop        one device, exact gradients (the reference everything is compared with). Idle 0.
  data_parallel   R replicas of the whole model on the `data` axis, each on B/R examples;
                  gradients and loss averaged with `pmean`. Idle 0.
  model_parallel  the Ouroboros ring placement (embed, group 0 and head on device 0, group s on
                  device s), locked forward and locked backward: exact gradients, but in every
                  round all devices but one wait. Idle (G-1)/G.
  gpipe           M micro-batches pipelined through the same placement; exact gradient of the
                  mean micro-batch loss. Idle (G-1)/(M+G-1), the bubble.
  1f1b            the exact pipelines written as tables (`tables`, run by `pipeline`): 1F1B
  interleaved     (GPipe's bubble, p micro-batches of activations instead of M), interleaved
  zb_h1           1F1B with --chunks v model chunks per device (bubble (G-1)/(v M)), ZB-H1
  zb_v            (backward split into input and weight gradients, bubble (G-1)/(3M)) and ZB-V
                  (two chunks per device in a V, bubble (G-1)/(6M) under a per-step barrier).
                  Exact gradient of the mean micro-batch loss, as gpipe.
  ouroboros       delayed-gradient model parallelism on the ring (see `ouroboros.py`).
                  Idle (G-1)/(G+2).

The stage schedules (model_parallel, gpipe, ouroboros) combine with data parallelism on the 2-D
mesh (stage x data): every data replica runs its own ring on its share of the batch and the
gradients are averaged over `data`. backprop and data_parallel run every stage group in order on
one device (any `num_stages` of the parameters works; the mesh has one stage row).

All of them take the same `StagedModel`, the same Optax transformation (applied per module group
after one global-norm clip, see `staged.apply_gradients`) and the same batches, so their
parameters can be compared number for number. Every synchronous schedule computes its gradient
in one `jax.shard_map` (the communication is written out) and hands it to `synchronous_update`.

Dropout: batch t's key is `staged.batch_key(seed, t)`; data replicas fold in their replica index
and gpipe folds in the micro-batch index (M > 1), so with dropout those differ from backprop by
their masks only. (Ouroboros keeps one key for all its replicas.)

The modules: `config` (ScheduleConfig), `synchronous` (the four exact schedules), `tables` (exact
pipelines as data) and `pipeline` (their one executor), `ouroboros`
(the delayed ring, its algorithm), `ring` (the ring's pieces), `delays` (which batch each piece
works on), `compensation` (staleness compensation and the optimizers), `reference` (a slow,
unjitted Ouroboros written from the equations, for tests).
"""

from __future__ import annotations

import optax

from ouroboros_jax.choices import EXACT_PIPELINES, SCHEDULES
from ouroboros_jax.schedules.config import ScheduleConfig
from ouroboros_jax.schedules.synchronous import (
  build_backprop,
  build_data_parallel,
  build_gpipe,
  build_model_parallel,
  gpipe_idle_fraction,
  model_parallel_idle_fraction,
  replica_key,
  synchronous_update,
)
from ouroboros_jax.staged import Schedule, StagedModel, check_batch

__all__ = [
  'SCHEDULES',
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
  """The builder every caller uses: checks `config` (one-line ConfigErrors), then dispatches on
  `config.name`."""
  config.validate()
  builders = {
    'backprop': build_backprop,
    'data_parallel': build_data_parallel,
    'model_parallel': build_model_parallel,
    'gpipe': build_gpipe,
  }
  if config.name in builders:
    return builders[config.name](config, model, tx, devices=devices)
  if config.name in EXACT_PIPELINES:
    from ouroboros_jax.schedules.pipeline import build_pipeline

    return build_pipeline(config, model, tx, devices=devices)
  if config.name == 'ouroboros':
    from ouroboros_jax.schedules import ouroboros

    return ouroboros.build(config, model, tx, devices=devices)
  raise AssertionError(config.name)  # validate() knows SCHEDULES
