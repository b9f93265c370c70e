"""FSDP inside the stage schedules: each layer's weights gathered where the layer runs.

Under `fsdp=True` a stage schedule (the exact pipelines, Ouroboros) keeps every stage leaf
[G, N, ...] split over its D data replicas on one axis of a layer's own shape (`layer_axes`: the
largest that D divides; never the stage or the layer axis). Its step's shard_map hands each
device its shard, and the layer loop (`staging.scan_layers`) gathers one layer's weights at a
time, just before the layer runs (`gather`). The gathered copy is never kept for the backward:
it carries the checkpoint name GATHERED, which no stash policy saves (`keep_policy`), so the
backward gathers it again. A stage then holds 1/D of its weights plus one layer's whole, not the
whole stage, in every schedule and at every recomputation policy.

The gather's transpose is a reduce-scatter: each device's gradient of a gathered leaf comes back
as its shard, summed over the replicas. A weight gradient computed whole (zero-bubble's W from
the taps) is reduce-scattered onto the shard (`to_shards`). `replica_mean` then divides the
gathered leaves' sums by D and averages the rest over the replicas (`pmean`): backprop's mean.

The step enters `gathered_layers(axes, D)` around its shard_map, so every layer loop traced in
it (forward, recomputation, backward) gathers; outside it nothing changes.

The optimizer update runs on whole layers (`by_whole_layers`): Muon orthogonalises each layer's
whole matrix, and on a leaf split across a layer's own axis the compiler splits each
Newton-Schulz product over the replicas and repeats the rest on every one of them. Moved to the
layer axis for the update, each replica holds N/D whole layers and orthogonalises only those,
with an all-to-all each way; where D does not divide N, the layers go over gcd(D, N) groups of
replicas and each layer's matrices over the replicas of its group.

Under --shard-update (ZeRO-1) the weights stay whole and only the update is split: a stage leaf's
optimizer state over the replicas on the axis `update_axis` gives (whole layers where R divides
N), an embedding or head leaf's as FSDP splits it (`grad_axes`). The step's shard_map then
leaves those leaves' gradients unreduced where `replica_mean` runs (a micro-batch loop sums them
locally) and reduce-scatters each onto its axis once, at the end of its body (`scatter_mean`):
half an all-reduce's bytes, each replica receiving the mean of exactly the share it updates.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Any, Callable, NamedTuple

import jax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ouroboros_jax.errors import ConfigError
from ouroboros_jax.staged import DATA, STAGE

PyTree = Any

GATHERED = 'fsdp_gathered_layer'  # the checkpoint name of a layer's gathered weights


class Gathering(NamedTuple):
  """What the layer loops of a step traced under `gathered_layers` gather."""

  axes: PyTree  # like params['stages']: the axis of one layer's leaf split over DATA, or None
  replicas: int


_GATHERING: contextvars.ContextVar = contextvars.ContextVar('layer_gathering', default=None)


class Scattering(NamedTuple):
  """What the shard_map body of a step traced under `scattered_grads` reduce-scatters."""

  axes: PyTree  # like params: the axis of a leaf its update splits (`grad_axes`), or None
  replicas: int


_SCATTERING: contextvars.ContextVar = contextvars.ContextVar('grad_scattering', default=None)


def split_axis(shape: tuple[int, ...], replicas: int, taken=()) -> int | None:
  """The axis FSDP splits a leaf of `shape` on over `replicas` data replicas: its largest
  axis not in `taken` that `replicas` divides (the first where sizes tie); None: none does, or
  one replica (the leaf stays whole on each)."""
  axes = [
    a
    for a, size in enumerate(shape)
    if a not in taken and size >= replicas and size % replicas == 0
  ]
  if replicas == 1 or not axes:
    return None
  return max(axes, key=lambda a: (shape[a], -a))


def layer_axes(stages: PyTree, replicas: int) -> PyTree:
  """For stage leaves shaped [G, N, ...]: the axis of one layer's leaf (its shape without G and
  N) that FSDP splits over `replicas` (`split_axis` of that shape), or None where none
  divides (the leaf stays whole on every replica)."""
  return jax.tree.map(lambda a: split_axis(tuple(a.shape[2:]), replicas), stages)


def update_axis(shape: tuple[int, ...], replicas: int) -> int | None:
  """The axis --shard-update splits a stage leaf [G, N, ...]'s optimizer state (and gradient) on
  over `replicas`: the layer axis N where they divide it (whole layers, as Muon updates them),
  else FSDP's axis of one layer's shape (`split_axis`), else None (whole on each replica)."""
  if replicas > 1 and len(shape) >= 2 and shape[1] % replicas == 0:
    return 1
  return split_axis(shape, replicas, taken=(0, 1))


def grad_axes(params: PyTree, replicas: int) -> PyTree:
  """Like params ({'embed', 'stages', 'head'}): the axis --shard-update splits each leaf's
  optimizer state and gradient on over `replicas`, a stage leaf's `update_axis`, an embedding or
  head leaf's FSDP axis (`split_axis`), or None (whole on every replica)."""
  axes = {
    group: jax.tree.map(lambda a: split_axis(tuple(a.shape), replicas), tree)
    for group, tree in params.items()
    if group != 'stages'
  }
  stage = lambda a: update_axis(tuple(a.shape), replicas)
  return {**axes, 'stages': jax.tree.map(stage, params['stages'])}


def stage_axis(axis: int | None) -> int | None:
  """The axis of a stage leaf [G, N, ...] that one layer's `axis` is."""
  return None if axis is None else axis + 2


@contextlib.contextmanager
def gathered_layers(axes: PyTree, replicas: int):
  """Within it (while a step's shard_map body is traced), `scan_layers` gathers each layer's
  weights over DATA by `axes` (`layer_axes`), and `replica_mean` knows which leaves it did."""
  token = _GATHERING.set(Gathering(axes, replicas))
  try:
    yield
  finally:
    _GATHERING.reset(token)


@contextlib.contextmanager
def scattered_grads(params: PyTree, replicas: int):
  """Within it, `replica_mean` leaves the gradients of the leaves of `params` that
  --shard-update splits unreduced, and `scatter_mean` reduce-scatters them (`grad_axes`)."""
  token = _SCATTERING.set(Scattering(grad_axes(params, replicas), replicas))
  try:
    yield
  finally:
    _SCATTERING.reset(token)


def active() -> Gathering | None:
  """The gathering of the step being traced (None: the weights arrive whole)."""
  return _GATHERING.get()


def gather(params: PyTree, gathering: Gathering) -> PyTree:
  """One layer's weights whole from each replica's shard, named GATHERED."""
  if jax.tree.structure(params) != jax.tree.structure(gathering.axes):
    raise ConfigError(
      'fsdp gathers a stage one layer at a time, so the layer loop must run over the stage '
      "parameters as they are (params['stages'], one leading axis per layer); this model's "
      'layer loop runs over another tree: use it without fsdp.'
    )

  def whole(a, axis):
    if axis is None:
      return a
    return checkpoint_name(jax.lax.all_gather(a, DATA, axis=axis, tiled=True), GATHERED)

  return jax.tree.map(whole, params, gathering.axes)


def keep_policy(policy: Callable | None) -> Callable:
  """The checkpoint policy a gathering layer runs under: `policy` (a stash policy, which saves
  matmul outputs at most), or for None (keep every residual) everything but the gathered
  weights: neither the GATHERED name nor the all_gather it names (JAX would save that value
  under its other name)."""
  if policy is not None:
    return policy

  def all_but_gathered(prim, *_, **params):
    if prim.name == 'all_gather':
      return False
    return prim.name != 'name' or params.get('name') != GATHERED

  return all_but_gathered


def to_shards(grads_N: PyTree, like_N: PyTree, gathering: Gathering) -> PyTree:
  """A chunk's weight gradient (leaves [N, ...]) onto this device's shards: leaves computed
  whole (larger than `like_N`'s) are reduce-scattered over DATA; shard-shaped ones (through
  `gather`'s transpose) are already summed over the replicas."""

  def shard(g, a, axis):
    if axis is None or g.shape == a.shape:
      return g
    return jax.lax.psum_scatter(g, DATA, scatter_dimension=axis + 1, tiled=True)

  return jax.tree.map(shard, grads_N, like_N, gathering.axes)


def replica_mean(grads: dict, loss):
  """(grads, loss) averaged over the data replicas: the gathered stage leaves' replica sums
  divided by D, the rest by `pmean` (as without FSDP). Under `scattered_grads` the leaves it
  scatters stay as they are, this replica's own, for `scatter_mean` to reduce once."""
  gathering, scattering = active(), _SCATTERING.get()
  if gathering is None and scattering is None:
    return jax.lax.pmean((grads, loss), DATA)
  if scattering is not None:
    own = lambda g, axis: g if axis is not None else jax.lax.pmean(g, DATA)
    return jax.tree.map(own, grads, scattering.axes), jax.lax.pmean(loss, DATA)
  mean = lambda g, axis: g / gathering.replicas if axis is not None else jax.lax.pmean(g, DATA)
  stages = jax.tree.map(mean, grads['stages'], gathering.axes)
  rest = {k: v for k, v in grads.items() if k != 'stages'}
  rest, loss = jax.lax.pmean((rest, loss), DATA)
  return {**rest, 'stages': stages}, loss


def scatter_mean(grads: dict) -> dict:
  """Under `scattered_grads`, at the end of a step's shard_map body: each leaf `replica_mean`
  left unreduced reduce-scattered over DATA onto its axis (`grad_axes`) and divided by R, this
  replica's share of the mean (the body's out_specs split it so); else grads."""
  scattering = _SCATTERING.get()
  if scattering is None:
    return grads

  def scatter(g, axis):
    if axis is None:
      return g
    return jax.lax.psum_scatter(g, DATA, scatter_dimension=axis, tiled=True) / scattering.replicas

  return jax.tree.map(scatter, grads, scattering.axes)


def with_scatter_mean(body: Callable) -> Callable:
  """A step's shard_map body (its gradients first among its outputs) ending in `scatter_mean`."""

  def scattering(*args):
    grads, *rest = body(*args)
    return (scatter_mean(grads), *rest)

  return scattering


def local_shapes(stages: PyTree, gathering: Gathering | None) -> PyTree:
  """ShapeDtypeStructs of one device's shards of the stage leaves `stages` ([G, N, ...]); as
  they are without a gathering."""
  if gathering is None:
    return stages

  def local(a, axis):
    shape = list(a.shape)
    if axis is not None:
      shape[stage_axis(axis)] //= gathering.replicas
    return jax.ShapeDtypeStruct(tuple(shape), a.dtype)

  return jax.tree.map(local, stages, gathering.axes)


def by_whole_layers(mesh: Mesh) -> Callable[[PyTree], PyTree]:
  """The layout a stage group's Muon update runs in under FSDP or --shard-update on `mesh`: every
  leaf [G, N, ...] of the trees it is given split over `stage` on G and its layers over the data
  replicas, so each replica orthogonalises whole layers, not a share of every layer's matrix (see
  the module docstring). Where the D replicas divide N, each holds N/D whole layers; where they
  do not, the layers go over gcd(D, N) groups of consecutive replicas, each layer's leaf split
  over the D / gcd replicas of its group on its largest axis they divide (`split_layers_mesh`):
  the compiler splits the Newton-Schulz products over D / gcd replicas and repeats the rest on
  each of them, not on all D (1B FSDP on v5e:8x8, D = 64, 24 layers: 1580 GFLOP a chip against
  6999 on the state's shards, docs/results/regime.md). The per-layer vectors (biases, norms)
  move with them, which the TPU compiler gives fewer temporaries than a step of mixed layouts
  (1B FSDP on v5e:2x4: 4.76 GiB against 5.63 moving the matrices alone). A leaf with no layer
  axis, or whose N shares no factor with D, keeps its layout."""
  replicas = mesh.shape[DATA]

  def whole_layers(a):
    groups = math.gcd(replicas, a.shape[1]) if a.ndim >= 2 else 1
    if groups == 1:
      return a
    within = replicas // groups
    axis = None if within == 1 else split_axis(tuple(a.shape[2:]), within)
    spec = [STAGE, LAYER_GROUP] + [WITHIN if i == axis else None for i in range(a.ndim - 2)]
    return jax.lax.with_sharding_constraint(
      a, NamedSharding(split_layers_mesh(mesh, groups), P(*spec))
    )

  return lambda tree: jax.tree.map(whole_layers, tree)


LAYER_GROUP, WITHIN = 'ouroboros_layer_group', 'ouroboros_within_group'


def split_layers_mesh(mesh: Mesh, groups: int) -> Mesh:
  """`mesh` (stage, data) with its data axis cut into (LAYER_GROUP: `groups`, WITHIN: the rest),
  the same devices in the same order: consecutive data replicas form a group."""
  stages, replicas = mesh.shape[STAGE], mesh.shape[DATA]
  devices = mesh.devices.reshape(stages, groups, replicas // groups)
  return Mesh(devices, (STAGE, LAYER_GROUP, WITHIN))
