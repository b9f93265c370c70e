"""Fully sharded data parallelism (FSDP, ZeRO-3): `data_parallel` with `fsdp=True`.

    config = ScheduleConfig(name='data_parallel', data_parallel=4, fsdp=True)
    schedule = build_schedule(config, model, tx)   # -> build_fsdp

The step is backprop's, written for the whole batch (`synchronous.whole_model_grads` and the
grouped update), and jitted on a (1, D) mesh where JAX's sharding does the rest:

  - the batch is split over `data` on its rows;
  - every parameter leaf, and each optimizer state leaf shaped like one, is split over `data`
    on its largest axis that D divides (`fsdp_spec`); leaves no axis of which D divides (biases
    of odd sizes, scalars) are replicated;
  - XLA inserts the collectives: it gathers a layer's weights where the layer runs, reduces
    and scatters their gradients, and updates each shard on the device that holds it.

So each device holds 1/D of the parameters, gradients and optimizer state (MaxText's FSDP; the
compiler, not a hand-written engine, schedules the gathers). The gradient is backprop's: the
loss is the batch's mean, and every dropout key is backprop's (`staged.batch_key`), not a
replica's. Muon orthogonalises each whole matrix on one replica: the update moves the stage
group to the layer axis first (`layer_shards.by_whole_layers`, through `grouped`), and equals
backprop's Muon update (tested).
"""

from __future__ import annotations

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from ouroboros_jax import layer_shards, placement, staged, staging
from ouroboros_jax.errors import ConfigError, field_ref
from ouroboros_jax.placement import DATA
from ouroboros_jax.schedules.config import ResolvedSchedule, require_resolved
from ouroboros_jax.schedules.synchronous import grouped, synchronous_update, whole_model_grads
from ouroboros_jax.staged import Schedule, StagedModel, TrainState


def fsdp_spec(shape: tuple[int, ...], replicas: int) -> P:
  """Where FSDP keeps a leaf of `shape` on D = `replicas` devices: split over `data` on its
  largest axis that D divides (the first such axis where sizes tie), else replicated."""
  axis = layer_shards.split_axis(shape, replicas)
  if axis is None:
    return P()
  return P(*(DATA if a == axis else None for a in range(len(shape))))


def fsdp_shardings(state: TrainState, mesh: Mesh) -> TrainState:
  """The TrainState laid out for FSDP on `mesh`: parameters and optimizer state by `fsdp_spec`,
  the step counter replicated, no ring buffers."""
  replicas = mesh.shape[DATA]
  spec = lambda a: fsdp_spec(getattr(a, 'shape', ()), replicas)
  specs = TrainState(
    step=P(),
    params=jax.tree.map(spec, state.params),
    opt_state=jax.tree.map(spec, state.opt_state),
    ring=jax.tree.map(lambda _: P(), state.ring),
  )
  return placement.named(specs, mesh)


def build_fsdp(config: ResolvedSchedule, model: StagedModel, tx, *, devices=None) -> Schedule:
  """FSDP over D = config.data_parallel devices: backprop's step, its state sharded over the
  data replicas (see the module docstring). Idle fraction 0 (communication is not counted)."""
  config = require_resolved(config, 'build_fsdp')
  if model.memory is not None:
    raise ConfigError(
      f'{field_ref("fsdp", True)} runs models without a memory between batches; '
      'Transformer-XL keeps one per replica: use it without fsdp.'
    )
  mesh = placement.make_mesh(1, config.data_parallel, devices)
  optimizer = grouped(config, model, tx, mesh)

  def init(params, example_batch=None):
    placement.check_stage_params(params, config)
    if example_batch is not None:
      placement.check_batch(example_batch, config.data_parallel, 1)
    return placement.init_state(optimizer, params, mesh, shardings=fsdp_shardings)

  def step(state: TrainState, batch: dict):
    key = staged.batch_key(config.seed, state.step)
    with staging.recompute_layers(config.stash_policy):
      grads, loss, _ = whole_model_grads(model, state.params, batch, key, state.step, {})
    return synchronous_update(optimizer, state, grads, loss)

  return placement.make_schedule(
    'data_parallel', model, mesh, init, step, 0.0, lambda rows: config, shardings=fsdp_shardings
  )
