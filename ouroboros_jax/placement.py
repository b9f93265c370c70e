"""The mesh and placement every schedule shares: the (stage, data) mesh, where each piece of a
`TrainState` lives (stage groups sharded over `stage`, ring buffers over (stage, data), a
stash in host memory under `ring[HOST]`), the fresh state, and the step and evaluation jitted
the way every schedule's are."""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Mapping
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ouroboros_jax import layer_shards
from ouroboros_jax.errors import ConfigError, field_ref
from ouroboros_jax.staged import DATA, STAGE, PyTree, Schedule, StagedModel, TrainState, batch_rows
from ouroboros_jax.update import GroupedOptimizer


def make_schedule(
  name: str,
  model: StagedModel,
  mesh: Mesh,
  init: Callable,
  step: Callable,
  idle_fraction: float,
  settings: Callable,
  shardings: Callable | None = None,
) -> Schedule:
  """A Schedule with its step and evaluation jitted the way every schedule's are; the step keeps
  the state where `init_state` placed it (`shardings(state, mesh)`, by default
  `state_shardings`). `settings(rows)`: the ResolvedSchedule it runs a batch of `rows` rows
  with."""

  def checked_init(params, example_batch=None, *args, **kwargs):
    if example_batch is not None:
      check_batch_keys(example_batch)
    return init(params, example_batch, *args, **kwargs)

  shardings = shardings or state_shardings
  return Schedule(
    init=explain_sharding(checked_init),
    step=explain_sharding(jit_step(keep_placement(step, mesh, shardings))),
    evaluate=jit_evaluate(model),
    mesh=mesh,
    idle_fraction=idle_fraction,
    name=name,
    settings=settings,
    layout=lambda state: shardings(state, mesh),
  )


# ----------------------------------------------------------------------------- the user's shardings

# What JAX says when a sharding annotation in the model (jax.lax.with_sharding_constraint, Flax's
# nn.with_partitioning / nn.with_logical_constraint under a mesh) meets the step's mesh.
_SHARDING_ERRORS = (
  'with_sharding_constraint',
  'sharding_constraint inside jit',
  'should match the mesh of sharding',
  'is not found in mesh',
  'Mesh for all inputs should be equal',
)


def _user_sharding(message: str) -> str:
  """The user's annotation as JAX's message shows it: its spec, or its mesh's axes."""
  for pattern in (r'Got spec=(P\(.*?\))', r'Resource axis: .*? of (P\(.*?\)) is not found'):
    if found := re.search(pattern, message):
      return f'with_sharding_constraint(..., {found.group(1)})'
  meshes = re.findall(r'AbstractMesh\(([^)]*)\)', message)
  foreign = [m for m in meshes if STAGE not in m]
  if foreign:
    axes = tuple(re.findall(r"'([^']+)':", foreign[0]))
    return f'a sharding on the mesh with axes {axes}'
  return 'a with_sharding_constraint'


def sharding_error(error: Exception) -> ConfigError | None:
  """One line for a sharding annotation in the model that meets the schedule's mesh (None for
  any other error): it names the annotation, the library's mesh axes and what to do."""
  message = str(error)
  if not any(text in message for text in _SHARDING_ERRORS):
    return None
  return ConfigError(
    f'the model carries its own sharding annotation, {_user_sharding(message)}, but a schedule '
    f'runs embed, stage and loss on its own mesh, axes {(STAGE, DATA)}, manual inside the ring: '
    'each device already holds its stage and its share of the batch, so no annotation in the '
    'model can apply there; remove it from the model (Flax: pass unboxed params, nn.unbox(params), '
    'and no nn.with_logical_constraint rules or mesh around the step).'
  )


def explain_sharding(fn: Callable) -> Callable:
  """`fn` (a schedule's init or jitted step) raising `sharding_error`'s one line, from JAX's,
  when the model's own sharding annotation meets the schedule's mesh. A jitted step keeps its
  `lower`, `trace`, ..."""

  @functools.wraps(fn)
  def call(*args, **kwargs):
    try:
      return fn(*args, **kwargs)
    except Exception as error:  # only JAX's sharding errors are translated
      explained = None if isinstance(error, ConfigError) else sharding_error(error)
      if explained is None:
        raise
      raise explained from error

  for name in ('lower', 'trace', 'eval_shape'):
    if hasattr(fn, name):
      setattr(call, name, getattr(fn, name))
  return call


def keep_placement(step_fn: Callable, mesh: Mesh, shardings: Callable | None = None) -> Callable:
  """`step_fn` whose new state is laid out as `init_state` lays it out (`shardings`, by default
  `state_shardings`). Left to XLA, a leaf the step rebuilds from a replicated value (a shared
  parameter written back to every stage's slots) comes out replicated, and the next step
  compiles again for the new layout."""
  shardings = shardings or state_shardings

  def step(state, batch):
    new_state, metrics = step_fn(state, batch)
    return jax.lax.with_sharding_constraint(new_state, shardings(new_state, mesh)), metrics

  return step


def jit_step(step_fn: Callable) -> Callable:
  """`step_fn(state, batch)` jitted with the old state donated, so its buffers are reused."""
  return jax.jit(step_fn, donate_argnums=0)


def jit_evaluate(model: StagedModel) -> Callable:
  """The exact loss of a batch with every stage and no dropout."""
  return jax.jit(lambda params, batch: model.forward_loss(params, batch)[0])


# ----------------------------------------------------------------------------- mesh & placement


def platform(devices=None) -> str:
  """The platform ('cpu', 'gpu', 'tpu') of `devices`, by default JAX's devices."""
  return (jax.devices() if devices is None else devices)[0].platform


def make_mesh(num_stages: int, data_parallel: int = 1, devices=None) -> Mesh:
  """A (stage, data) mesh over the first num_stages * data_parallel devices."""
  devices = jax.devices() if devices is None else devices
  needed = num_stages * data_parallel
  if num_stages < 1 or data_parallel < 1:
    raise ConfigError(
      f'{field_ref("num_stages")} ({num_stages}) and {field_ref("data_parallel")} '
      f'({data_parallel}) must be >= 1.'
    )
  processes = jax.process_count()
  if needed > len(devices):
    more = (
      f'launch {needed} processes of one device each (`ouroboros launch --processes {needed}`)'
      if processes > 1
      else f'on a CPU machine simulate more (jax_num_cpu_devices={needed}; the command: '
      f'--cpu-devices {needed})'
    )
    raise ConfigError(
      f'{num_stages} stages x {data_parallel} data replicas need {needed} devices but only '
      f'{len(devices)} are visible; use fewer {field_ref("num_stages")} / '
      f'{field_ref("data_parallel")}, or {more}.'
    )
  used = devices[:needed]
  idle = sorted({d.process_index for d in devices} - {d.process_index for d in used})
  if processes > 1 and idle:
    # A process with no device in the mesh holds no part of the state and cannot run the step.
    raise ConfigError(
      f'{num_stages} stages x {data_parallel} data replicas use {needed} of the {len(devices)} '
      f'devices of {processes} processes, leaving process(es) {", ".join(map(str, idle))} '
      f'without one; use {field_ref("num_stages")} x {field_ref("data_parallel")} = '
      f'{len(devices)}, or fewer processes.'
    )
  grid = np.asarray(used).reshape(num_stages, data_parallel)
  return Mesh(grid, (STAGE, DATA))


def check_stage_params(params: PyTree, config) -> None:
  """One-line ConfigError, before anything is traced, unless every leaf of params['stages'] leads
  with the axis `config`'s schedule needs: one slice per stage group (`config.stage_groups`).
  backprop and data_parallel run every group on one device, so with num_stages=1 they take any
  count (the same on every leaf)."""
  if not isinstance(params, Mapping) or 'stages' not in params:
    raise ConfigError(
      "the parameters must be a dict {'embed': ..., 'stages': ..., 'head': ...} with every leaf "
      "of 'stages' stacked on a leading axis, one slice per stage group: ouroboros_jax.from_layers "
      "stages a model's layers so."
    )
  leaves = jax.tree_util.tree_leaves_with_path(params['stages'])
  if not leaves:
    return
  lead = lambda leaf: getattr(leaf, 'shape', ())[:1]  # () for a leaf with no leading axis
  where = lambda path: f"params['stages']{jax.tree_util.keystr(path)}"
  name, num_stages, groups = config.name, config.num_stages, config.stage_groups
  needs = f'{name} with {field_ref("num_stages", num_stages)}'
  if groups != num_stages:
    needs += f' x {groups // num_stages} chunks'
  if name in ('backprop', 'data_parallel') and num_stages == 1:  # any count, on every leaf
    first_path, first = leaves[0]
    groups = lead(first)[0] if lead(first) else 1
    needs = f'{name}, as {where(first_path)} has,'
  for path, leaf in leaves:
    if lead(leaf) != (groups,):
      actual = f'leading axis {lead(leaf)[0]}' if lead(leaf) else 'no leading axis'
      raise ConfigError(
        f'{where(path)} has {actual}, but {needs} needs {groups} (one slice per stage group): '
        'stage the layers with ouroboros_jax.from_layers(..., '
        f'num_stages={groups}).'
      )


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
  optimizer: GroupedOptimizer,
  params: PyTree,
  mesh: Mesh,
  ring: Callable[[], PyTree] | None = None,
  shardings: Callable | None = None,
) -> TrainState:
  """The fresh TrainState of every schedule: step 0, the params, one optimizer state per group,
  and the schedule's ring buffers (`ring()`, leaves [G, R, ...] sharded over (stage, data)), on
  `mesh` with the stage groups sharded over `stage` (or as `shardings(state, mesh)` lays it out:
  FSDP's). Built under jit, so the state owns its buffers (the step donates them; the caller's
  params stay)."""

  def fresh_state(params):
    return TrainState(
      step=jnp.zeros((), jnp.int32),
      params=params,
      opt_state=optimizer.init(params),
      ring=ring() if ring else {},
    )

  placed = (shardings or state_shardings)(jax.eval_shape(fresh_state, params), mesh)
  return jax.jit(fresh_state, out_shardings=placed)(params)


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


def fsdp_stage_shardings(state: TrainState, mesh: Mesh) -> TrainState:
  """`state_shardings` with FSDP over the mesh's data replicas (a stage schedule's --fsdp):
  every parameter and optimizer state leaf also split over `data`. A stage leaf [G, N, ...] on
  an axis of one layer's shape (`layer_shards.layer_axes`), which the step's layer loops gather
  layer by layer; an embedding or head leaf on its largest free axis (`layer_shards.split_axis`),
  gathered whole as the step's shard_map takes it. The ring as before."""
  base = state_shardings(state, mesh)
  replicas = mesh.shape[DATA]

  def split(layered: bool):
    def leaf(a, sharding):
      spec = (*sharding.spec, *(None,) * (len(a.shape) - len(sharding.spec)))
      taken = [i for i, s in enumerate(spec) if s is not None or (layered and i < 2)]
      axis = layer_shards.split_axis(a.shape, replicas, taken=taken)
      if axis is None:
        return sharding
      spec = P(*(DATA if i == axis else s for i, s in enumerate(spec)))
      return NamedSharding(mesh, spec, memory_kind=sharding.memory_kind)

    return leaf

  by_group = lambda tree, specs: {
    group: jax.tree.map(split(group == 'stages'), tree[group], specs[group]) for group in tree
  }
  return base.replace(
    params=by_group(state.params, base.params), opt_state=by_group(state.opt_state, base.opt_state)
  )


def fsdp_param_specs(params: PyTree, replicas: int) -> PyTree:
  """`param_specs` of a stage schedule with --fsdp: each stage leaf's shard as it lies
  (`fsdp_stage_shardings`), the layer loops gathering it; embed and head whole."""

  def spec(a, axis):
    at = layer_shards.stage_axis(axis)
    return P(*(STAGE if i == 0 else DATA if i == at else None for i in range(a.ndim)))

  axes = layer_shards.layer_axes(params['stages'], replicas)
  return {**param_specs(params), 'stages': jax.tree.map(spec, params['stages'], axes)}


def step_param_specs(params: PyTree, config) -> PyTree:
  """The parameters' in_specs of a stage schedule's shard_map (`config` a ResolvedSchedule):
  each device's stage, or with --fsdp its shard of it (`fsdp_param_specs`)."""
  if config.fsdp:
    return fsdp_param_specs(params, config.data_parallel)
  return param_specs(params)


def step_grad_specs(params: PyTree, config) -> PyTree:
  """The gradients' out_specs of a stage schedule's shard_map: as its parameters', but with
  --shard-update each leaf on its replica's share (`layer_shards.grad_axes`), which the body
  reduce-scatters (`layer_shards.scatter_mean`) and the update splits."""
  if not config.shard_update:
    return step_param_specs(params, config)
  return update_specs(params, config.data_parallel)


def update_specs(params: PyTree, replicas: int) -> PyTree:
  """Specs like params under --shard-update: a stage leaf over `stage` on G, every leaf over
  `data` on the axis its update splits (`layer_shards.grad_axes`)."""
  axes = layer_shards.grad_axes(params, replicas)
  spec = lambda a, axis: P(*(DATA if i == axis else None for i in range(a.ndim)))
  rest = {g: jax.tree.map(spec, params[g], axes[g]) for g in params if g != 'stages'}
  stage = lambda a: _update_spec(a.shape, replicas)
  return {**rest, 'stages': jax.tree.map(stage, params['stages'])}


def _update_spec(shape: tuple[int, ...], replicas: int) -> P:
  """A stage leaf's spec under --shard-update: over `stage` on G, over `data` on the axis its
  update splits (`layer_shards.update_axis`)."""
  axis = layer_shards.update_axis(tuple(shape), replicas)
  return P(*(STAGE if i == 0 else DATA if i == axis else None for i in range(len(shape))))


def step_gathering(params: PyTree, config):
  """The context a stage schedule traces its shard_map in: with --fsdp, the layer loops gather
  each layer's shards (`layer_shards.gathered_layers`); with --shard-update the gradients are
  reduce-scattered (`layer_shards.scattered_grads`); else nothing."""
  if config.shard_update:
    return layer_shards.scattered_grads(params, config.data_parallel)
  if not config.fsdp:
    return contextlib.nullcontext()
  axes = layer_shards.layer_axes(params['stages'], config.data_parallel)
  return layer_shards.gathered_layers(axes, config.data_parallel)


def sharded_update_shardings(state: TrainState, mesh: Mesh) -> TrainState:
  """`state_shardings` with the optimizer state split over the data replicas and the parameters
  whole on every replica (--shard-update, ZeRO-1): a stage leaf [G, N, ...] over `data` on its
  layer axis N where R divides it (whole layers, as Muon's update runs), else as FSDP splits
  it (`fsdp_stage_shardings`, as are the embedding's and the head's).

  The step runs as without it, each replica holding its stage's weights whole, but reduce-scatters
  the gradients onto the share each replica updates (`step_grad_specs`). The update then runs on
  1/R of the stage's layers a replica (`update_layout`), and the new weights, laid out whole by
  this layout, are gathered once a step: no gather per layer or micro-batch as under --fsdp, for
  1/R of the optimizer state and of the update's work, and the all-reduce's bytes in all."""
  base, sharded = state_shardings(state, mesh), fsdp_stage_shardings(state, mesh)
  replicas = mesh.shape[DATA]

  def share(a, sharding):  # whole layers: the layout Muon's update runs in, no move each way
    return NamedSharding(mesh, _update_spec(a.shape, replicas), memory_kind=sharding.memory_kind)

  stages = jax.tree.map(share, state.opt_state['stages'], base.opt_state['stages'])
  return base.replace(opt_state={**sharded.opt_state, 'stages': stages})


def layout_for(config) -> Callable | None:
  """The state layout of a stage schedule's `config` (ResolvedSchedule): FSDP's over its data
  replicas where it asks for it, its optimizer state's alone with --shard-update, else None
  (`state_shardings`)."""
  if config.fsdp:
    return fsdp_stage_shardings
  return sharded_update_shardings if config.shard_update else None


def update_layout(config, mesh: Mesh) -> Callable | None:
  """The layout the optimizer update of `config` (ResolvedSchedule) runs its stage group in:
  whole layers over the data replicas with --fsdp or --shard-update (over gcd(replicas, layers)
  groups of them where the replicas do not divide the layers; `layer_shards.by_whole_layers`),
  else the state's own (None)."""
  sharded = config.fsdp or config.shard_update
  return layer_shards.by_whole_layers(mesh) if sharded else None


def check_pinned_host(mesh: Mesh) -> None:
  """One-line ConfigError when the mesh's devices have no pinned host memory."""
  device = mesh.devices.flat[0]
  kinds = {m.kind for m in device.addressable_memories()}
  if 'pinned_host' not in kinds:
    raise ConfigError(
      f'{field_ref("stash_memory", "pinned_host")} needs host memory the device can reach, and '
      f'{device.platform} devices have only {", ".join(sorted(kinds))}; use '
      f'{field_ref("stash_memory", "device")}.'
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
  batch_size = batch_rows(example_batch['inputs'])
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


BATCH_KEYS = ('inputs', 'targets')


def check_batch_keys(batch) -> None:
  """A batch is {'inputs': what the embedding takes, 'targets': what the loss takes}, each an
  array or a pytree of arrays that lead with the batch axis."""
  missing = [key for key in BATCH_KEYS if not isinstance(batch, Mapping) or key not in batch]
  if missing:
    have = sorted(batch) if isinstance(batch, Mapping) else type(batch).__name__
    raise ConfigError(
      f'the batch has no {" or ".join(repr(k) for k in missing)} (it has {have}); every schedule '
      "takes {'inputs': ..., 'targets': ...}; for a model that shifts its own inputs (Flax's "
      'lm1b), pass the same tokens as both.'
    )


def check_batch(batch: dict, replicas: int, microbatches: int = 1) -> None:
  """Every data replica gets B/R examples and cuts them into M micro-batches."""
  size, divisor = batch_rows(batch['inputs']), replicas * microbatches
  if size % divisor == 0:
    return
  if microbatches > 1:
    raise ConfigError(
      f'batch size {size} is not divisible by {field_ref("data_parallel")} x '
      f'{field_ref("microbatches")} = {replicas} x {microbatches} = {divisor}; choose '
      f'{field_ref("batch_size")} as a multiple of {divisor} or change '
      f'{field_ref("data_parallel")} / {field_ref("microbatches")}.'
    )
  raise ConfigError(
    f'batch size {size} is not divisible by {field_ref("data_parallel")} = {replicas}; '
    f'choose {field_ref("batch_size")} as a multiple of {replicas} or change '
    f'{field_ref("data_parallel")}.'
  )
