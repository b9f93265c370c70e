"""The one step interface every schedule shares, and the pieces they all use.

A model is given to a schedule as a `StagedModel`: three pure functions

    embed(embed_params, inputs, rng)                 -> x          (module 1, first part)
    stage(stage_params, x, stage_index, rng)         -> x          (one layer group)
    loss(head_params, embed_params, x, targets)      -> (loss, metrics)   (module K)

with parameters laid out as

    params = {'embed': ..., 'stages': <every leaf stacked on a leading axis of size G>, 'head': ...}

The head gets the embedding parameters too, so a tied output projection (V^T) works. Any schedule
builder returns a `Schedule` whose `step(state, batch) -> (state, metrics)` is a pure jitted
function of a `TrainState` pytree, so schedules are interchangeable and their parameters are
directly comparable.

The optimizer step every schedule shares (one clip, an Optax update per module group) is
update.py's `GroupedOptimizer`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ouroboros_jax.errors import ConfigError
from ouroboros_jax.update import GroupedOptimizer

PyTree = Any
STAGE, DATA = 'stage', 'data'


@dataclasses.dataclass(frozen=True)
class WeightSplit:
  """How a stage defers its weight gradient (the zero-bubble paper's W) without recomputing the
  chain of input gradients: the stage runs with zero *taps* added to its weighted sub-layers'
  outputs, so one VJP in (input, taps) gives the input gradient (B) and every sub-layer's output
  gradient, and `weight_grad` turns those and the recorded sub-layer inputs into the weight
  gradient with matrix products only (W).

    taps(stage_params, x) -> zero taps (a pytree)
    stage(stage_params, x, stage_index, rng, taps) -> (y, recorded sub-layer inputs)
    weight_grad(stage_params, recorded, tap_grads) -> gradient laid out as stage_params
  """

  taps: Callable[..., Any]
  stage: Callable[..., tuple[jax.Array, Any]]
  weight_grad: Callable[..., Any]


@dataclasses.dataclass(frozen=True)
class Memory:
  """A state each stage carries from one batch to the next (Transformer-XL's memory of the
  previous segments' hidden states), for models whose batches continue each other row by row.

    init(stage_params, batch_size) -> one stage's empty memory (a pytree)
    stage(stage_params, x, stage_index, rng, memory) -> (y, the new memory)

  Every leaf of a memory has the batch on its leading axis (row b of batch t+1 continues row b
  of batch t), so a schedule can cut it into data replicas and micro-batches as it cuts the
  batch. The memory is not differentiated (its new value is computed under stop_gradient).
  Schedules keep it in `TrainState.ring['memory']`, leaves [G, R, B/R, ...]: stage s's memory
  lives on the device that owns stage s, each data replica's rows on that replica. Models
  without one run `stage`.
  """

  init: Callable[..., Any]
  stage: Callable[..., tuple[jax.Array, Any]]


@dataclasses.dataclass(frozen=True)
class StagedModel:
  """A model cut into embed -> G stages -> loss; see the module docstring for the signatures."""

  embed: Callable[..., jax.Array]
  stage: Callable[..., jax.Array]
  loss: Callable[..., tuple[jax.Array, dict]]
  tied_embedding: bool = True  # the loss reads embed params (they get a fresh head gradient)
  weight_split: WeightSplit | None = None  # a cheap W for the zero-bubble pipelines, if any
  memory: Memory | None = None  # a recurrent state per stage (Transformer-XL), if any
  # Names of top-level stage-parameter leaves ([G, N, ...]) that are ONE parameter used by every
  # layer of every stage (Transformer-XL's global biases u and v); see update.py.
  shared: tuple[str, ...] = ()

  def run_stage(self, stage_params, x, stage_index, rng, memory=None):
    """(y, new memory): one stage with its memory; (y, None) for a model without one."""
    if self.memory is None:
      return self.stage(stage_params, x, stage_index, rng), None
    return self.memory.stage(stage_params, x, stage_index, rng, memory)

  def recurrent_loss(self, params: PyTree, batch: dict, key, memory_G):
    """`forward_loss` with every stage's memory (leaves [G, ...]), shaped for
    `jax.value_and_grad(..., has_aux=True)`: (loss, (metrics, the new memory [G, ...]))."""
    x = self.embed(params['embed'], batch['inputs'], piece_rng(key, EMBED_PIECE))
    new = []
    for s in range(stage_count(params)):
      at = lambda a: a[s]
      x, memory_s = self.run_stage(
        jax.tree.map(at, params['stages']), x, s, piece_rng(key, s), jax.tree.map(at, memory_G)
      )
      new.append(memory_s)
    loss, metrics = self.loss(params['head'], params['embed'], x, batch['targets'])
    return loss, (metrics, jax.tree.map(lambda *m: jnp.stack(m), *new))

  def forward_loss(self, params: PyTree, batch: dict, key: jax.Array | None = None):
    """Plain composition on one device: embed, every stage in order, loss.

    `key` is the batch's dropout key (None: no dropout); the pieces draw from it exactly as they
    do inside the parallel schedules (`piece_rng`).
    """
    x = self.embed(params['embed'], batch['inputs'], piece_rng(key, EMBED_PIECE))
    for s in range(stage_count(params)):
      stage_params = jax.tree.map(lambda a: a[s], params['stages'])
      x = self.stage(stage_params, x, s, piece_rng(key, s))
    return self.loss(params['head'], params['embed'], x, batch['targets'])


def stage_count(params: PyTree) -> int:
  return jax.tree.leaves(params['stages'])[0].shape[0]


@flax.struct.dataclass
class TrainState:
  """Everything a run carries from step to step; all of it is checkpointed.

  step: number of steps taken so far (batch t is consumed by step t).
  params: {'embed', 'stages' [G, ...], 'head'}.
  opt_state: {'embed', 'stages' (vmapped over G), 'head'}: one Optax state per module group.
  ring: a schedule's in-flight buffers (Ouroboros stashes and error gradients); {} for the
    synchronous schedules.
  """

  step: jax.Array
  params: PyTree
  opt_state: PyTree
  ring: PyTree


class Schedule(NamedTuple):
  """What every schedule builder returns.

  init(params, example_batch) -> TrainState
  step(state, batch) -> (state, metrics)   pure and jitted; metrics['loss'] is the loss of the
    batch whose index is metrics['loss_batch'] (schedules with a delayed head report an older one).
  evaluate(params, batch) -> loss          exact loss with every stage, no dropout.
  idle_fraction: the fraction of device-steps doing no work, from the schedule itself.
  """

  init: Callable[..., TrainState]
  step: Callable[..., tuple[TrainState, dict]]
  evaluate: Callable[..., jax.Array]
  mesh: Mesh
  idle_fraction: float
  name: str


# ----------------------------------------------------------------------------- optimizer


def kernel_mask(tree):
  """True on matrices named 'kernel' (the layers' weights), False on embeddings, norms, biases."""
  return jax.tree_util.tree_map_with_path(
    lambda path, _: getattr(path[-1], 'key', None) == 'kernel', tree
  )


def adamw(
  learning_rate: float | optax.Schedule,
  *,
  weight_decay: float = 0.0,
  b1: float = 0.9,
  b2: float = 0.999,
  eps: float = 1e-8,
):
  """AdamW as the paper uses it; decay only on matrices named 'kernel' (not embeddings, norms or
  biases), so a parameter with a zero gradient does not move at all."""
  return optax.adamw(
    learning_rate, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, mask=kernel_mask
  )


def make_schedule(
  name: str, model: StagedModel, mesh: Mesh, init: Callable, step: Callable, idle_fraction: float
) -> Schedule:
  """A Schedule with its step and evaluation jitted the way every schedule's are; the step keeps
  the state where `init_state` placed it."""
  return Schedule(
    init=init,
    step=jit_step(keep_placement(step, mesh)),
    evaluate=jit_evaluate(model),
    mesh=mesh,
    idle_fraction=idle_fraction,
    name=name,
  )


def keep_placement(step_fn: Callable, mesh: Mesh) -> Callable:
  """`step_fn` whose new state is laid out as `init_state` lays it out. Left to XLA, a leaf the
  step rebuilds from a replicated value (a shared parameter written back to every stage's slots)
  comes out replicated, and the next step compiles again for the new layout."""

  def step(state, batch):
    new_state, metrics = step_fn(state, batch)
    return jax.lax.with_sharding_constraint(new_state, state_shardings(new_state, mesh)), metrics

  return step


def jit_step(step_fn: Callable) -> Callable:
  """`step_fn(state, batch)` jitted with the old state donated, so its buffers are reused."""
  return jax.jit(step_fn, donate_argnums=0)


def jit_evaluate(model: StagedModel) -> Callable:
  """The exact loss of a batch with every stage and no dropout."""
  return jax.jit(lambda params, batch: model.forward_loss(params, batch)[0])


# ----------------------------------------------------------------------------- mesh & placement


def make_mesh(num_stages: int, data_parallel: int = 1, devices=None) -> Mesh:
  """A (stage, data) mesh over the first num_stages * data_parallel devices."""
  devices = jax.devices() if devices is None else devices
  needed = num_stages * data_parallel
  if num_stages < 1 or data_parallel < 1:
    raise ConfigError(
      f'stages ({num_stages}) and data parallel degree ({data_parallel}) must be '
      '>= 1; fix --stages / --data-parallel.'
    )
  processes = jax.process_count()
  if needed > len(devices):
    more = (
      f'launch {needed} processes of one device each (`ouroboros launch --processes {needed}`)'
      if processes > 1
      else f'on a CPU machine simulate more with --cpu-devices {needed}'
    )
    raise ConfigError(
      f'{num_stages} stages x {data_parallel} data replicas need {needed} devices but only '
      f'{len(devices)} are visible; use fewer --stages/--data-parallel, or {more}.'
    )
  used = devices[:needed]
  idle = sorted({d.process_index for d in devices} - {d.process_index for d in used})
  if processes > 1 and idle:
    # A process with no device in the mesh holds no part of the state and cannot run the step.
    raise ConfigError(
      f'{num_stages} stages x {data_parallel} data replicas use {needed} of the {len(devices)} '
      f'devices of {processes} processes, leaving process(es) {", ".join(map(str, idle))} '
      f'without one; use --stages x --data-parallel = {len(devices)}, or fewer processes.'
    )
  grid = np.asarray(used).reshape(num_stages, data_parallel)
  return Mesh(grid, (STAGE, DATA))


def param_specs(params: PyTree) -> PyTree:
  """Stage parameters sharded over `stage` on their leading axis; embed and head replicated."""
  return {
    'embed': jax.tree.map(lambda _: P(), params['embed']),
    'stages': jax.tree.map(lambda _: P(STAGE), params['stages']),
    'head': jax.tree.map(lambda _: P(), params['head']),
  }


def opt_state_specs(opt_state: PyTree) -> PyTree:
  """The stages' optimizer states sharded over `stage`; the other groups' replicated."""
  return {
    group: jax.tree.map(lambda _: P(STAGE) if group == 'stages' else P(), state)
    for group, state in opt_state.items()
  }


def ring_specs(ring: PyTree) -> PyTree:
  """A schedule's ring buffers have leaves [G, R, ...]: one slice per (stage, data) device."""
  return jax.tree.map(lambda _: P(STAGE, DATA), ring)


def init_state(
  optimizer: GroupedOptimizer, params: PyTree, mesh: Mesh, ring: Callable[[], PyTree] | None = None
) -> TrainState:
  """The fresh TrainState of every schedule: step 0, the params, one optimizer state per group,
  and the schedule's ring buffers (`ring()`, leaves [G, R, ...] sharded over (stage, data)), on
  `mesh` with the stage groups sharded over `stage`. Built under jit, so the state owns its
  buffers (the step donates them; the caller's params stay)."""

  def fresh_state(params):
    return TrainState(
      step=jnp.zeros((), jnp.int32),
      params=params,
      opt_state=optimizer.init(params),
      ring=ring() if ring else {},
    )

  shardings = state_shardings(jax.eval_shape(fresh_state, params), mesh)
  return jax.jit(fresh_state, out_shardings=shardings)(params)


# Ring buffers under state.ring[HOST] live in the host's pinned memory (JAX memory kind
# 'pinned_host'), not the device's: what waits across steps without being read every step.
HOST = 'host'


def _floating(a) -> bool:
  return not jax.dtypes.issubdtype(a.dtype, jax.dtypes.extended) and jnp.issubdtype(
    a.dtype, jnp.floating
  )


def _in_host(a) -> bool:
  return jax.typeof(a).memory_space == jax.memory.Space.Host


def to_device(tree):
  """Leaves held in host memory (`--stash-memory pinned_host`) copied to the device's."""
  move = lambda a: jax.device_put(a, jax.memory.Space.Device) if _in_host(a) else a
  return jax.tree.map(move, tree)


def into_space_of(values, buffers):
  """values moved to the memory (device or host) of the buffers they are written into."""
  move = lambda v, buf: jax.device_put(v, jax.memory.Space.Host) if _in_host(buf) else v
  return jax.tree.map(move, values, buffers)


def state_shardings(state: TrainState, mesh: Mesh) -> TrainState:
  """`state_specs` as NamedShardings on mesh, the ring's HOST buffers in pinned host memory."""
  shardings = named(state_specs(state), mesh)
  if HOST not in state.ring:
    return shardings
  # Only floating-point buffers (activations, weights: the bulk) move. Keys, masks and indices
  # a stash may keep stay on the device: they are a few bytes, XLA hands keys back there, and
  # the TPU cannot slice packed 8-bit buffers in host memory.
  in_host = lambda a, s: s.with_memory_kind('pinned_host') if _floating(a) else s
  ring = dict(shardings.ring)
  ring[HOST] = jax.tree.map(in_host, state.ring[HOST], ring[HOST])
  return shardings.replace(ring=ring)


def check_pinned_host(mesh: Mesh) -> None:
  """One-line ConfigError when the mesh's devices have no pinned host memory."""
  device = mesh.devices.flat[0]
  kinds = {m.kind for m in device.addressable_memories()}
  if 'pinned_host' not in kinds:
    raise ConfigError(
      f'--stash-memory pinned_host needs host memory the device can reach, and {device.platform} '
      f'devices have only {", ".join(sorted(kinds))}; use --stash-memory device.'
    )


def state_specs(state: TrainState) -> TrainState:
  """Where every leaf of a TrainState lives: stage groups, their optimizer states and the ring
  buffers sharded over `stage` (the buffers also over `data`), the rest replicated."""
  return TrainState(
    step=P(),
    params=param_specs(state.params),
    opt_state=opt_state_specs(state.opt_state),
    ring=ring_specs(state.ring),
  )


def empty_memory(model: StagedModel, params: PyTree, example_batch, replicas: int = 1) -> dict:
  """{'memory': leaves [G, R, B/R, ...]}: every stage's empty memory for batches shaped like
  `example_batch`, split over R data replicas (`ring_specs` places it); {} for a model without
  a memory."""
  if model.memory is None:
    return {}
  if example_batch is None:
    raise ConfigError(
      'this model keeps a memory from batch to batch, whose shape follows the batch; call '
      'init(params, example_batch).'
    )
  batch_size = example_batch['inputs'].shape[0]
  local = batch_size // replicas
  memory_G = jax.vmap(lambda p: model.memory.init(p, local))(params['stages'])
  return {'memory': jax.tree.map(lambda a: jnp.repeat(a[:, None], replicas, axis=1), memory_G)}


def batch_spec(batch: PyTree) -> PyTree:
  """Batches are split over `data` on their leading axis and replicated over `stage`."""
  return jax.tree.map(lambda _: P(DATA), batch)


def named(specs: PyTree, mesh: Mesh) -> PyTree:
  """PartitionSpecs -> NamedShardings on `mesh` (PartitionSpecs are leaves here)."""
  return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda s: isinstance(s, P))


def shard(tree: PyTree, specs: PyTree, mesh: Mesh) -> PyTree:
  return jax.device_put(tree, named(specs, mesh))


def place_batch(batch: dict, mesh: Mesh) -> dict:
  """A host batch (numpy, the same in every process) on the mesh: split over `data`,
  replicated over `stage`; each process keeps the rows of its own devices."""
  return shard(batch, batch_spec(batch), mesh)


def onto_mesh(tree: PyTree, mesh: Mesh) -> PyTree:
  """Replicates over the mesh every leaf not placed on it yet (a schedule's `init` leaves some
  scalars off it). A jitted step returns its state on the mesh; feeding it a state that is not
  there yet would compile the step a second time at step 2."""
  replicated = NamedSharding(mesh, P())

  def place(x):
    on_mesh = isinstance(x.sharding, NamedSharding) and x.sharding.mesh == mesh
    return x if on_mesh else jax.device_put(x, replicated)

  return jax.tree.map(place, tree)


def check_batch(batch: dict, replicas: int, microbatches: int = 1) -> None:
  """Every data replica gets B/R examples and cuts them into M micro-batches."""
  size, divisor = batch['inputs'].shape[0], replicas * microbatches
  if size % divisor == 0:
    return
  if microbatches > 1:
    raise ConfigError(
      f'batch size {size} is not divisible by --data-parallel x --microbatches = {replicas} x '
      f'{microbatches} = {divisor}; choose --batch-size as a multiple of {divisor} or change '
      '--data-parallel / --microbatches.'
    )
  raise ConfigError(
    f'batch size {size} is not divisible by --data-parallel = {replicas}; '
    f'choose --batch-size as a multiple of {replicas} or change --data-parallel.'
  )


EMBED_PIECE = -1


def batch_key(seed: int, batch_index):
  """The dropout key of batch t: the same wherever and whenever batch t is computed, so a
  replayed forward draws the same dropout mask as the original one."""
  return jax.random.fold_in(jax.random.key(seed), batch_index)


def piece_rng(key, piece):
  """The key of one piece of the model (a stage index, or EMBED_PIECE) for one batch."""
  return None if key is None else jax.random.fold_in(key, piece + 1)


# ----------------------------------------------------------------------------- split backward


def stage_input_grad(model: StagedModel, params_s, x, stage_index, rng, delta):
  """B of the zero-bubble split: the gradient of a stage's input for output gradient `delta`,
  from a VJP in the input only (what the previous stage waits for)."""
  run = lambda h: model.stage(params_s, h, stage_index, rng)
  return jax.vjp(run, x)[1](delta)[0]


def stage_weight_grad(model: StagedModel, params_s, x, stage_index, rng, delta):
  """W of the zero-bubble split: the gradient of a stage's weights, from a VJP in the weights
  only (nothing downstream waits for it, so a schedule can run it late). B and W together equal
  the full VJP (tests/test_tables.py)."""
  run = lambda p: model.stage(p, x, stage_index, rng)
  return jax.vjp(run, params_s)[1](delta)[0]
