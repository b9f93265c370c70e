"""The synchronous schedules: exact gradients, each computed in one `jax.shard_map`.

  backprop        one device, exact gradients (the reference everything is compared with).
  data_parallel   R replicas of the whole model on the `data` axis, gradients averaged (`pmean`).
  model_parallel  the ring placement with locked forward and backward: exact, idle (G-1)/G.

Each computes its gradient inside one `jax.shard_map` (the communication is written out) and
hands it to `synchronous_update`; so do the exact pipelines (GPipe, 1F1B, ...: pipeline.py, from
their tables), through `synchronous_schedule`. See `ouroboros_jax.schedules` for the table of all
schedules.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from ouroboros_jax import layer_shards, placement, staged, staging
from ouroboros_jax.schedules import ring
from ouroboros_jax.schedules.config import ResolvedSchedule, require_resolved
from ouroboros_jax.staged import DATA, STAGE, Schedule, StagedModel, TrainState
from ouroboros_jax.update import GroupedOptimizer


def grouped(config: ResolvedSchedule, model: StagedModel, tx, mesh: Mesh) -> GroupedOptimizer:
  """The per-group optimizer step of a schedule on `mesh`: tx, the config's clip, the model's
  shared leaves, and with FSDP the update on whole layers (`placement.update_layout`)."""
  return GroupedOptimizer(tx, config.clip_norm, model.shared, placement.update_layout(config, mesh))


def synchronous_update(optimizer: GroupedOptimizer, state: TrainState, grads, loss):
  """The optimizer half of every synchronous step: all groups ready, metrics of batch t."""
  params, opt_state, grad_norm = optimizer.apply(state.params, state.opt_state, grads)
  new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
  return new_state, {'loss': loss, 'loss_batch': state.step, 'grad_norm': grad_norm}


def replica_key(seed: int, t, replicas: int):
  """Batch t's dropout key on this data replica: replicas draw different masks."""
  key = staged.batch_key(seed, t)
  return key if replicas == 1 else jax.random.fold_in(key, jax.lax.axis_index(DATA))


# ----------------------------------------------------------------------------- backprop


def build_backprop(config: ResolvedSchedule, model: StagedModel, tx, *, devices=None) -> Schedule:
  """Plain backprop of the whole composition on one device (with any number of stage groups).

  Idle fraction 0: one device, always busy.
  """
  config = require_resolved(config, 'build_backprop')
  mesh = placement.make_mesh(1, 1, devices)
  optimizer = grouped(config, model, tx, mesh)

  def init(params, example_batch=None):
    placement.check_stage_params(params, config)
    memory = lambda: placement.empty_memory(model, params, example_batch)
    return placement.init_state(optimizer, params, mesh, memory)

  def step(state: TrainState, batch: dict):
    key = staged.batch_key(config.seed, state.step)
    with staging.recompute_layers(config.stash_policy):
      grads, loss, buffers = whole_model_grads(
        model, state.params, batch, key, state.step, state.ring
      )
    new_state, metrics = synchronous_update(optimizer, state, grads, loss)
    return new_state.replace(ring=buffers), metrics

  return placement.make_schedule('backprop', model, mesh, init, step, 0.0, lambda rows: config)


# ----------------------------------------------------------------------------- shared plumbing


def whole_model_grads(model: StagedModel, params, batch, key, t, buffers):
  """(grads, loss, buffers) of the plain composition on one device (or one data replica), for
  batch t: with a memory (`buffers['memory']`, leaves [G, 1, ...]) every stage reads and renews
  its own."""
  if 'memory' not in buffers:
    value_and_grad = jax.value_and_grad(model.forward_loss, has_aux=True)
    (loss, _), grads = value_and_grad(params, batch, key, t)
    return grads, loss, buffers
  memory_G = jax.tree.map(lambda a: a[:, 0], buffers['memory'])
  (loss, (_, memory_G)), grads = jax.value_and_grad(model.recurrent_loss, has_aux=True)(
    params, batch, key, memory_G, t
  )
  return grads, loss, {'memory': jax.tree.map(lambda a: a[:, None], memory_G)}


class DeviceGrads(NamedTuple):
  """A synchronous schedule's gradient on each device of its mesh (see `synchronous_schedule`),
  the fraction of device time it leaves idle, and (v chunks per device) the order in which the
  devices hold the stage groups."""

  fn: Callable
  idle_fraction: float
  stage_order: list[int] | None = None


def synchronous_schedule(
  config: ResolvedSchedule, model: StagedModel, tx, mesh: Mesh, grads: DeviceGrads
) -> Schedule:
  """A synchronous schedule (`config.name`) from its per-device gradient.

  grads.fn(params, batch, t, buffers) -> (grads, loss, buffers) runs inside one
  `jax.shard_map` over the (stage, data) mesh: it sees its stage's parameters (leading axis 1),
  its replica's share of the batch, the step index t and its share of `TrainState.ring` (a
  model's memory, if it has one; else {}), and returns gradients laid out as the parameters
  (stage gradients on their own device, embed and head gradients replicated) and the batch's
  loss, both averaged over `data`, and the renewed buffers; then `synchronous_update`.

  `grads.stage_order` (v chunks per device): the parameters' stage groups in the order the
  devices hold them, v consecutive per device; the step gathers them so (and their gradients
  back).
  """
  device_grads, idle_fraction, stage_order = grads
  num_stages, replicas = mesh.shape[STAGE], mesh.shape[DATA]
  name = config.name
  microbatches = config.microbatches
  groups = len(stage_order) if stage_order else num_stages
  reorder = stage_order is not None and list(stage_order) != list(range(groups))
  optimizer = grouped(config, model, tx, mesh)

  def init(params, example_batch=None):
    if example_batch is not None:
      placement.check_batch(example_batch, replicas, microbatches)
    placement.check_stage_params(params, config)
    memory = lambda: placement.empty_memory(model, params, example_batch, replicas)
    return placement.init_state(optimizer, params, mesh, memory, placement.layout_for(config))

  def step(state: TrainState, batch: dict):
    placement.check_batch(batch, replicas, microbatches)
    param_specs, buffer_specs = (
      placement.step_param_specs(state.params, config),
      placement.ring_specs(state.ring),
    )
    grads_of = jax.shard_map(
      layer_shards.with_scatter_mean(device_grads),
      mesh=mesh,
      in_specs=(param_specs, placement.batch_spec(batch), P(), buffer_specs),
      out_specs=(placement.step_grad_specs(state.params, config), P(), buffer_specs),
      check_vma=False,
    )
    held, buffers = state.params, state.ring
    if reorder:  # the stage groups (and their memories) in the order the devices hold them
      order = jnp.asarray(stage_order)
      held = {**held, 'stages': jax.tree.map(lambda a: a[order], held['stages'])}
      buffers = jax.tree.map(lambda a: a[order], buffers)
    with placement.step_gathering(state.params, config):
      grads, loss, buffers = grads_of(held, batch, state.step, buffers)
    if reorder:
      back = jnp.asarray(np.argsort(stage_order))
      grads = {**grads, 'stages': jax.tree.map(lambda g: g[back], grads['stages'])}
      buffers = jax.tree.map(lambda a: a[back], buffers)
    new_state, metrics = synchronous_update(optimizer, state, grads, loss)
    return new_state.replace(ring=buffers), metrics

  settings, layout = (lambda rows: config), placement.layout_for(config)
  return placement.make_schedule(name, model, mesh, init, step, idle_fraction, settings, layout)


# ----------------------------------------------------------------------------- data parallel


def build_data_parallel(
  config: ResolvedSchedule, model: StagedModel, tx, *, devices=None
) -> Schedule:
  """R replicas of the whole model on the `data` axis of a (1, R) mesh.

  Parameters are replicated, the batch is split over `data`; each replica back-propagates its
  B/R examples through every stage group in order, then `lax.pmean` averages the gradients (and
  the loss) over `data`, each replica's weighted by its share of the batch's loss
  (`ring.loss_shares`: R w_r / sum of w, 1 without a `loss_weight`): the batch's mean loss, so
  the gradient is backprop's. Idle fraction 0: every device works all the time (communication
  is not counted).
  """
  replicas = require_resolved(config, 'build_data_parallel').data_parallel
  mesh = placement.make_mesh(1, replicas, devices)

  def device_grads(params, batch, t, buffers):
    key = replica_key(config.seed, t, replicas)
    with staging.recompute_layers(config.stash_policy):
      grads, loss, buffers = whole_model_grads(model, params, batch, key, t, buffers)
    if model.loss_weight is not None:  # R w_r / w: this replica's share of the batch's loss
      share = ring.loss_shares(model, jax.tree.map(lambda a: a[None], batch['targets']))[0]
      grads, loss = jax.tree.map(lambda a: a * share, (grads, loss))
    return (*layer_shards.replica_mean(grads, loss), buffers)

  return synchronous_schedule(config, model, tx, mesh, DeviceGrads(device_grads, 0.0))


# ----------------------------------------------------------------------------- model parallel


def model_parallel_idle_fraction(num_stages: int) -> float:
  """G forward rounds of time F and G backward rounds of time B = 2F, one device busy in each:
  idle = (G-1)(F+B) / (G(F+B)) = (G-1)/G."""
  return (num_stages - 1) / num_stages


def build_model_parallel(
  config: ResolvedSchedule, model: StagedModel, tx, *, devices=None
) -> Schedule:
  """Naive model parallelism on the Ouroboros ring: what Ouroboros removes.

  Placement as Ouroboros: embedding, group 0 and the head on device 0, group s on device s
  (`ring.py`). Locked forward: rounds r = 0..G-1, only device r runs its group, keeping its VJP,
  and passes the activation on; the head on device 0 gives the loss and delta_{G-1}. Locked
  backward: the delta goes to device G-1, then rounds r = G-1..0 in which only device r
  back-propagates and hands its input gradient to r-1; device 0 ends at the embedding. The
  gradient is exact (backprop's). With R > 1 every data replica runs its own ring on B/R
  examples and the gradients are averaged over `data`.

  Idle fraction (G-1)/G (`model_parallel_idle_fraction`): in each of the G forward rounds (F)
  and G backward rounds (B = 2F) one device works and G-1 wait.
  """
  config = require_resolved(config, 'build_model_parallel')
  num_stages, replicas = config.num_stages, config.data_parallel
  mesh = placement.make_mesh(num_stages, replicas, devices)

  def device_grads(params, batch, t, buffers):
    key = replica_key(config.seed, t, replicas)
    memory = ring.local_memory(buffers)
    policy = config.stash_policy
    share = ring.loss_shares(model, jax.tree.map(lambda a: a[None], batch['targets']))[0]
    grads, loss, memory = ring.locked_grads(model, params, batch, key, t, memory, policy, share)
    return grads, loss, ring.with_memory(buffers, memory)

  idle = model_parallel_idle_fraction(num_stages)
  return synchronous_schedule(config, model, tx, mesh, DeviceGrads(device_grads, idle))
