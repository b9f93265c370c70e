"""Resuming a checkpoint on another layout (issue 63): an exact schedule's state, re-staged.

A run's state is laid out by its schedule: every stage leaf of the parameters and of the
optimizer state leads with [G', N] (G' stages, or G x chunks virtual stages for interleaved; N
layers a stage holds at most, zero padding where a stage holds fewer), and the Optax counters
of the stage group lead with [G'] (`update.GroupedOptimizer` vmaps the update over stages).
Nothing else in an exact schedule's state depends on the layout: the embedding's and the head's
groups, the step, the data position and the dropout keys (from the seed and the batch index) are
the same whatever G, D, M or the schedule. The exact schedules (backprop, data_parallel with or
without FSDP, model_parallel, GPipe, 1F1B, interleaved, ZB-H1, ZB-V) all give backprop's
parameters, so a state moves between any two of them by restacking its layers:

    saved stage leaf [G_old', N_old, ...]  -> the model's L layers [L, ...] (`staging.from_staged`)
                                           -> [G_new', N_new, ...]          (`staging.to_staged`)
    saved counter [G_old']                 -> [G_new'], every stage's the same (one update a step)

Orbax restores the saved state as it was saved (its shapes, whole on this process's first
device); one jitted function restacks it there, and every device of the new run takes its shard
of the result from its own process's host copy (`jax.make_array_from_callback`), so a run moves
between process counts too. (So a move needs one device's memory for the whole state: fine at the sizes
that train on one host, not yet for a state that only fits sharded.) Ouroboros' state holds what is in flight (the
stash, the error gradients, the weight versions, the compensations' history), shaped by G and
M: moving it needs the ring drained first, which is not written yet, and is refused in one line.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from ouroboros_jax import staging
from ouroboros_jax.errors import CheckpointError

# The settings a move may change between exact schedules (flat names, as the flags spell them).
LAYOUT_FIELDS = ('schedule', 'stages', 'data_parallel', 'microbatches', 'layers_per_stage')
# The groups whose leaves lead with the stage axis (params and optimizer state alike).
STAGED_GROUPS = ('stages',)


@dataclasses.dataclass(frozen=True)
class Move:
  """A saved state's layout and the run's: `abstract` is what to restore, `apply` re-stages."""

  old_layers: tuple[int, ...]  # layers per (virtual) stage of the saved run
  new_layers: tuple[int, ...]

  def describe(self) -> str:
    return (
      f'the parameters and optimizer state re-staged from {len(self.old_layers)} stage(s) to '
      f'{len(self.new_layers)} (an exact schedule holds nothing in flight: nothing was drained '
      'or reset)'
    )

  def abstract(self, target):
    """The saved state's abstract tree: the run's, with the saved layout's stage shapes, placed
    whole on this process's first device (Orbax restores it there)."""
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])

    def old(path, leaf):
      shape = _old_shape(path, leaf.shape, self.old_layers, self.new_layers)
      return jax.ShapeDtypeStruct(shape, leaf.dtype, sharding=device)

    return jax.tree_util.tree_map_with_path(old, target)

  def apply(self, state, target):
    """The restored state re-staged for the run, placed with the target's shardings."""
    if not counters_agree(state):
      raise CheckpointError(
        "the checkpoint's stages took different numbers of updates, which no exact schedule "
        "does: it cannot move to another layout; resume with the checkpoint's flags."
      )
    move = lambda path, a: _restage(path, a, self.old_layers, self.new_layers)
    moved = jax.device_get(jax.jit(lambda s: jax.tree_util.tree_map_with_path(move, s))(state))
    # Each process holds the whole moved state: every device takes its shard from it, whichever
    # process it belongs to (a 2-process run resumed in 1, or the reverse).
    place = lambda host, leaf: jax.make_array_from_callback(
      np.shape(host), leaf.sharding, lambda index: np.asarray(host)[index]
    )
    return jax.tree.map(place, moved, target)


def _in_stage_group(path) -> bool:
  names = [getattr(k, 'key', getattr(k, 'name', None)) for k in path]
  return any(group in names for group in STAGED_GROUPS) and names[0] in ('params', 'opt_state')


def _kind(path, shape, layers: tuple[int, ...]) -> str:
  """'layer' for a [G', N, ...] stage leaf, 'counter' for a [G'] one, else 'whole'."""
  if not _in_stage_group(path):
    return 'whole'
  stages, width = len(layers), max(layers)
  if len(shape) >= 2 and tuple(shape[:2]) == (stages, width):
    return 'layer'
  if tuple(shape) == (stages,):
    return 'counter'
  raise CheckpointError(
    f'cannot move the state leaf {jax.tree_util.keystr(path)} of shape {tuple(shape)} to another '
    f'layout: it neither leads with [stages, layers] ({stages}, {width}) nor is a per-stage '
    "counter; resume with the checkpoint's flags."
  )


def _old_shape(path, shape, old_layers, new_layers) -> tuple:
  kind = _kind(path, shape, new_layers)
  if kind == 'layer':
    return (len(old_layers), max(old_layers), *shape[2:])
  return (len(old_layers),) if kind == 'counter' else tuple(shape)


def _restage(path, a, old_layers, new_layers):
  kind = _kind(path, a.shape, old_layers)
  if kind == 'layer':  # the staging functions' own tree, one leaf at a time
    layers = staging.from_staged({'embed': 0, 'stages': a, 'head': 0}, old_layers)['layers']
    return staging.to_staged({'embed': 0, 'layers': layers, 'head': 0}, new_layers)['stages']
  if kind == 'counter':  # every stage took the same updates: the first stage's count is all's
    return jnp.full((len(new_layers),), a[0], a.dtype)
  return a


def counters_agree(state) -> bool:
  """Whether every per-stage counter of a restored state is the same across stages (an exact
  schedule's always is); checked before a move, on the host."""
  agree = True

  def check(path, leaf):
    nonlocal agree
    if _in_stage_group(path) and np.ndim(leaf) == 1:
      values = np.asarray(leaf)
      agree = agree and bool((values == values[0]).all())

  jax.tree_util.tree_map_with_path(check, state)
  return agree
