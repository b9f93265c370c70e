"""Every training schedule behind one builder: `build_schedule(name, model, tx, ...)`.

    schedule = build_schedule('ouroboros', model, tx, num_stages=4)
    state = schedule.init(params, example_batch)
    state, metrics = schedule.step(state, batch)        # pure, jitted, same for every schedule

Schedules:
  backprop       one device, exact gradients (the reference everything is compared with).
  ouroboros      delayed-gradient model parallelism on a ring of stages (see `ouroboros.py`).

All of them take the same `StagedModel`, the same Optax transformation (applied per module group
after one global-norm clip, see `staged.apply_gradients`) and the same batches, so their
parameters can be compared number for number.
"""

from __future__ import annotations

import dataclasses

import jax
import optax

from ouroboros_jax import staged
from ouroboros_jax.model import ConfigError
from ouroboros_jax.staged import Schedule, StagedModel, TrainState

SCHEDULES = ('backprop', 'ouroboros')


@dataclasses.dataclass(frozen=True)
class ScheduleConfig:
  """How a schedule places and runs the model; fields a schedule does not use are ignored."""

  name: str = 'backprop'
  num_stages: int = 1
  data_parallel: int = 1
  clip_norm: float | None = 1.0
  seed: int = 0                  # dropout keys are derived from (seed, batch index)
  stash: str = 'graph'           # ouroboros: 'graph' (DDG) or 'replay' (Features Replay)
  sync_warmup_steps: int = 0     # ouroboros: plain backprop over the ring first
  tied_grad: str = 'sum'         # ouroboros: 'sum' or 'mean' of the tied embedding's two grads


def build_schedule(config: ScheduleConfig, model: StagedModel,
                   tx: optax.GradientTransformation, *, devices=None) -> Schedule:
  """The builder every caller uses; dispatches on `config.name`."""
  if config.name == 'backprop':
    return build_backprop(config, model, tx, devices=devices)
  if config.name == 'ouroboros':
    from ouroboros_jax import ouroboros
    return ouroboros.build(config, model, tx, devices=devices)
  raise ConfigError(f'unknown schedule {config.name!r}; choose one of {", ".join(SCHEDULES)}.')


def synchronous_update(config: ScheduleConfig, tx, state: TrainState, grads, loss):
  """The optimizer half of every synchronous step: all groups ready, metrics of batch t."""
  params, opt_state, grad_norm = staged.apply_gradients(
      tx, state.params, state.opt_state, grads, clip_norm=config.clip_norm)
  new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
  return new_state, {'loss': loss, 'loss_batch': state.step, 'grad_norm': grad_norm}


def make_evaluate(model: StagedModel):
  return jax.jit(lambda params, batch: model.forward_loss(params, batch)[0])


def build_backprop(config: ScheduleConfig, model: StagedModel, tx, *, devices=None) -> Schedule:
  """Plain backprop of the whole composition on one device (with any number of stage groups)."""
  mesh = staged.make_mesh(1, config.data_parallel, devices)

  def init(params, example_batch=None):
    del example_batch
    return TrainState(step=jax.numpy.zeros((), jax.numpy.int32), params=params,
                      opt_state=staged.init_opt_state(tx, params), ring={})

  @jax.jit
  def step(state: TrainState, batch: dict):
    key = staged.batch_key(config.seed, state.step)
    (loss, _), grads = jax.value_and_grad(model.forward_loss, has_aux=True)(
        state.params, batch, key)
    return synchronous_update(config, tx, state, grads, loss)

  return Schedule(init=init, step=step, evaluate=make_evaluate(model), mesh=mesh,
                  idle_fraction=0.0, name='backprop')
