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
    saved per-stage leaf [G_old', ...]     -> [G_new', ...], each stage the value of the old stage
                                              of its first layer (Optax's counters, Muon's
                                              Newton-Schulz coefficients: the same in every stage
                                              of an exact schedule, one update a step)

Orbax restores the saved state as it was saved (its shapes, whole on this process's first
device); one jitted function restacks it there, and every device of the new run takes its shard
of the result from its own process's host copy (`jax.make_array_from_callback`), so a run moves
between process counts too. (So a move needs one device's memory for the whole state: fine at the sizes
that train on one host, not yet for a state that only fits sharded.) Ouroboros' state holds what is in flight (the
stash, the error gradients, the weight versions), shaped by G and M: it moves once drained
(`Schedule.drain`, `--drain`), its parameters and optimizer state as an exact schedule's and its
ring restarted empty at the saved step (`Move.fresh`); an undrained one is refused in one line
(training/resume.py). DC-ASGD's history of past weights, kept only where gradients are more than
one update old, cannot move.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from ouroboros_jax import staging
from ouroboros_jax.errors import CheckpointError

# The settings a move may change between exact schedules (flat names, as the flags spell them).
LAYOUT_FIELDS = ('schedule', 'stages', 'data_parallel', 'microbatches', 'layers_per_stage')
# The settings that shape only Ouroboros' ring: a drained ring moves across them too.
RING_FIELDS = ('forward', 'flow', 'stash', 'stash_policy', 'stash_memory')
# The groups whose leaves lead with the stage axis (params and optimizer state alike).
STAGED_GROUPS = ('stages',)


@dataclasses.dataclass(frozen=True)
class Move:
  """A saved state's layout and the run's: `abstract` is what to restore, `apply` re-stages.

  The saved ring is restored as it is, or, where the run's cannot take it, as the checkpoint's
  tree metadata has it and then: `fresh`, the run's ring starts empty at the saved step (every
  buffer zero, its window from the step's first item); `add_window`, the saved ring with the
  window a running ring has (one saved before the ring kept its window)."""

  old_layers: tuple[int, ...]  # layers per (virtual) stage of the saved run
  new_layers: tuple[int, ...]
  fresh: bool = False  # nothing in flight (drained, or exact): the run's ring starts empty
  from_ring: bool = False  # the saved run is Ouroboros (drained)
  to_ring: bool = False  # the run is Ouroboros
  add_window: bool = False  # the ring as saved, before it kept its window: the window added
  microbatches: int = 1  # the run's (its ring's window counts items)
  warmup_steps: int = 0  # the run's synchronous warm-up (no item enters before its end)

  def describe(self) -> str:
    text = (
      f'the parameters and optimizer state re-staged from {len(self.old_layers)} stage(s) to '
      f'{len(self.new_layers)}'
    )
    if not self.fresh:
      return f'{text} (an exact schedule holds nothing in flight: nothing was drained or reset)'
    if self.from_ring:  # Ouroboros' stages take their first updates at different steps
      text += " (the ring drained before; each stage counts its first layer's updates)"
    if self.to_ring:
      text += "; the ring restarts empty at this step (a model's memory too)"
    return text

  def abstract(self, target, saved):
    """The saved state's abstract tree, placed whole on this process's first device (Orbax
    restores it there): the run's, with the saved layout's stage shapes, and the ring as
    `saved` (the checkpoint's tree metadata) has it when the run's cannot be restored."""
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    per_layer = per_layer_shapes(target)

    def old(path, leaf):
      shape = _old_shape(path, leaf.shape, self.old_layers, self.new_layers, per_layer)
      return jax.ShapeDtypeStruct(shape, leaf.dtype, sharding=device)

    abstract = jax.tree_util.tree_map_with_path(old, target)
    if not (self.fresh or self.add_window):
      return abstract
    as_saved = lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device)
    ring = jax.tree.map(as_saved, saved['ring'], is_leaf=lambda m: hasattr(m, 'shape'))
    return abstract.replace(ring=ring)

  def apply(self, state, target):
    """The restored state re-staged for the run, placed with the target's shardings."""
    if not self.fresh and self.old_layers != self.new_layers and not counters_agree(state):
      raise CheckpointError(
        "the checkpoint's stages took different numbers of updates, which no exact schedule "
        "does: it cannot move to another layout; resume with the checkpoint's flags."
      )
    per_layer = per_layer_shapes(target)
    move = lambda path, a: _restage(path, a, self.old_layers, self.new_layers, per_layer)
    restage = jax.jit(lambda s: jax.tree_util.tree_map_with_path(move, s))
    moved = jax.device_get(restage(state.replace(ring={})))
    moved = moved.replace(ring=self._ring(jax.device_get(state.ring), target.ring, moved.step))
    # Each process holds the whole moved state: every device takes its shard from it, whichever
    # process it belongs to (a 2-process run resumed in 1, or the reverse).
    place = lambda host, leaf: jax.make_array_from_callback(
      np.shape(host), leaf.sharding, lambda index: np.asarray(host)[index]
    )
    return jax.tree.map(place, moved, target)

  def _ring(self, saved, target, step):
    """The run's ring buffers on the host: as saved, fresh zeros, and the window where asked."""
    if not (self.fresh or self.add_window):
      return saved
    ring = jax.tree.map(lambda leaf: np.zeros(leaf.shape, leaf.dtype), target)
    ring = ring if self.fresh else dict(saved)
    if 'window' in target:  # [first, end) items: from the step the ring (re)starts at, open
      first = max(int(step), self.warmup_steps) if self.fresh else self.warmup_steps
      window = (first * self.microbatches, np.iinfo(np.int32).max)
      ring['window'] = np.broadcast_to(np.asarray(window, np.int32), target['window'].shape)
    return ring


def _in_stage_group(path) -> bool:
  names = [getattr(k, 'key', getattr(k, 'name', None)) for k in path]
  return any(group in names for group in STAGED_GROUPS) and names[0] in ('params', 'opt_state')


def _kind(path, shape, layers: tuple[int, ...], per_layer) -> str:
  """'layer' for a [G', N, ...] stage leaf whose rest is a layer parameter's shape (`per_layer`:
  those shapes), 'stage' for another [G', ...] one (a counter, Muon's Newton-Schulz
  coefficients), else 'whole'."""
  if not _in_stage_group(path):
    return 'whole'
  if any(getattr(k, 'name', None) == 'history' for k in path):
    raise CheckpointError(
      "the checkpoint's DC-ASGD history of past weights (kept where gradients are more than one "
      'update old: --flow batch, or fewer micro-batches than the lag) is shaped by its layout '
      "and cannot move; resume with the checkpoint's flags."
    )
  stages, width = len(layers), max(layers)
  if len(shape) >= 2 and tuple(shape[:2]) == (stages, width) and tuple(shape[2:]) in per_layer:
    return 'layer'
  if len(shape) >= 1 and shape[0] == stages:
    return 'stage'
  raise CheckpointError(
    f'cannot move the state leaf {jax.tree_util.keystr(path)} of shape {tuple(shape)} to another '
    f'layout: it leads with neither [stages, layers] ({stages}, {width}) nor [stages]; resume '
    "with the checkpoint's flags."
  )


def per_layer_shapes(state) -> set[tuple[int, ...]]:
  """The shapes of one layer's parameters ([G', N, ...] stage leaves without [G', N])."""
  return {tuple(a.shape[2:]) for a in jax.tree.leaves(state.params['stages'])}


def _old_shape(path, shape, old_layers, new_layers, per_layer) -> tuple:
  if old_layers == new_layers:
    return tuple(shape)
  kind = _kind(path, shape, new_layers, per_layer)
  if kind == 'layer':
    return (len(old_layers), max(old_layers), *shape[2:])
  return (len(old_layers), *shape[1:]) if kind == 'stage' else tuple(shape)


def _restage(path, a, old_layers, new_layers, per_layer):
  if old_layers == new_layers:
    return a
  kind = _kind(path, a.shape, old_layers, per_layer)
  if kind == 'layer':  # the staging functions' own tree, one leaf at a time
    layers = staging.from_staged({'embed': 0, 'stages': a, 'head': 0}, old_layers)['layers']
    return staging.to_staged({'embed': 0, 'layers': layers, 'head': 0}, new_layers)['stages']
  if kind == 'stage':  # each new stage takes the value of the old one of its first layer
    owner = np.repeat(np.arange(len(old_layers)), old_layers)
    return a[owner[np.cumsum([0, *new_layers[:-1]])]]
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
