"""A run's state in a form no layout shapes, and resuming it on another layout (issue 63).

A run's state is laid out by its schedule: every stage leaf of the parameters and of the
optimizer state leads with [G', N] (G' stages, or G x chunks virtual stages for interleaved; N
layers a stage holds at most, zero padding where a stage holds fewer), and the Optax counters
of the stage group lead with [G'] (`update.GroupedOptimizer` vmaps the update over stages).
Nothing else in an exact schedule's state depends on the layout: the embedding's and the head's
groups, the step, the data position and the dropout keys (from the seed and the batch index) are
the same whatever G, D, M or the schedule.

**The per-layer form** (`PER_LAYER`, what every checkpoint holds): the state as L stages of one
layer each, whatever layout trained it.

    stage leaf      [G', N, ...] -> [L, 1, ...]  each layer its own stage, no padding
    per-stage leaf  [G', ...]    -> [L, ...]     each layer the value of the stage holding it
                                                 (Optax's counters, Muon's Newton-Schulz
                                                 coefficients)

Only L shapes it, not G, D, M or the schedule; a stage leaf's own axes keep their sharding (a
data-parallel run's FSDP shards stay where they were). `stored` writes it on the devices, each
layer axis sharded over the stages where L divides evenly (else whole on each stage), so no
device holds more than a stage's share. What is in flight stays as the layout made it: an
Ouroboros ring is its own checkpoint item (checkpoint.py), and DC-ASGD's history of past weights
(kept only where gradients are more than one update old) stays [G', depth, N, ...].

**A resume** (`Move`) restores the per-layer form with Orbax's restore-with-sharding straight
onto the run's mesh (each process reads its own shards), and one jitted function re-stages it
with the run's shardings:

    stored leaf [L, 1, ...] -> [G_new', N_new, ...] (`staging.from_staged`, `staging.to_staged`)
    per-layer leaf [L, ...]  -> [G_new', ...], each stage the value of its first layer

The exact schedules (backprop, data_parallel with or without FSDP, model_parallel, GPipe, 1F1B,
interleaved, ZB-H1, ZB-V) all give backprop's parameters, so a state moves between any two of
them exactly. Ouroboros' ring moves once drained (`Schedule.drain`, `--drain`): its parameters
and optimizer state as an exact schedule's, its ring restarted empty at the saved step
(`Move.fresh`); an undrained one is refused in one line (training/resume.py).

Between the ring's compensations and an exact schedule's none (or any two), the optimizer's own
state moves from where one keeps it to where the other does (`compensation.inner_path`), and
each compensation's state starts from its init, zero (`Move.inner_paths`); a DC-ASGD history
that moves restarts as copies of the weights. With --fresh-optimizer the whole optimizer state
is the run's init (`Move.fresh_opt_state`). A checkpoint saved before the per-layer form
(stage-shaped, its ring inside the state) is restored as saved on one device, re-staged there,
and placed with `make_array_from_callback`.
"""

from __future__ import annotations

import dataclasses
import functools

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
# A checkpoint's meta 'state_form' when it holds the per-layer form (none before it).
PER_LAYER = 'per layer'


def stored_layers(meta: dict) -> tuple[int, ...]:
  """The layers per stage of the state a checkpoint holds: one per stage in the per-layer form,
  the run's layout before it."""
  layers = tuple(meta['layers_per_stage'])
  return (1,) * sum(layers) if meta.get('state_form') == PER_LAYER else layers


def stored(state, layers: tuple[int, ...]):
  """The state in the per-layer form, on the devices (its ring as it is): what is saved."""
  to = (1,) * sum(layers)
  run = state.replace(ring={})
  if tuple(layers) == to:
    return state
  kinds = kinds_of(run, layers)
  sharding = lambda k, a: _stored_sharding(k, a.sharding, _shape_as(k, a.shape, layers, to))
  shardings = jax.tree.map(sharding, kinds, run)
  return _restager(run, kinds, tuple(layers), to, shardings)(run).replace(ring=state.ring)


def _restager(run, kinds, frm, to, shardings):
  """The jitted re-staging of a state of `run`'s tree from `frm` to `to`, with `shardings`."""
  flat_kinds, treedef = jax.tree.flatten(kinds)
  flat_shardings = tuple(jax.tree.leaves(shardings))
  return _restager_of(treedef, tuple(flat_kinds), frm, to, flat_shardings)


@functools.lru_cache(maxsize=32)
def _restager_of(treedef, kinds, frm, to, shardings):
  def restage(state):
    leaves = jax.tree.leaves(state)
    return jax.tree.unflatten(treedef, [_restage(k, a, frm, to) for k, a in zip(kinds, leaves)])

  return jax.jit(restage, out_shardings=jax.tree.unflatten(treedef, list(shardings)))


@dataclasses.dataclass(frozen=True)
class Move:
  """A saved state's layout and the run's: `abstract` is what to restore, `apply` re-stages.

  The saved ring is restored as it is, or, where the run's cannot take it: `fresh`, the run's
  ring starts empty at the saved step (every buffer zero, its window from the step's first
  item); `add_window`, the saved ring with the window a running ring has (one saved before the
  ring kept its window)."""

  old_layers: tuple[int, ...]  # layers per (virtual) stage of the saved run
  new_layers: tuple[int, ...]
  fresh: bool = False  # nothing in flight (drained, or exact): the run's ring starts empty
  from_ring: bool = False  # the saved run is Ouroboros (drained)
  to_ring: bool = False  # the run is Ouroboros
  add_window: bool = False  # the ring as saved, before it kept its window: the window added
  microbatches: int = 1  # the run's (its ring's window counts items)
  warmup_steps: int = 0  # the run's synchronous warm-up (no item enters before its end)
  per_layer: bool = False  # the checkpoint holds the per-layer form (else the saved layout's)
  # Where the optimizer's own state sits in the saved run's state and in the run's
  # (`compensation.inner_path`), and whether their compensations keep states of other parts.
  inner_paths: tuple = ((), ())
  remap: bool = False
  # --fresh-optimizer: the run's optimizer state at its init (placed as the run's), which the
  # resumed state takes instead of the saved one (read, then left).
  fresh_opt_state: object = None

  @property
  def stored_layers(self) -> tuple[int, ...]:
    return (1,) * sum(self.old_layers) if self.per_layer else self.old_layers

  @property
  def changed(self) -> bool:
    """Whether the run's layout differs from the saved run's (else the state is as it was)."""
    fresh_opt = self.fresh_opt_state is not None
    return (
      self.fresh or self.add_window or self.remap or fresh_opt or self.old_layers != self.new_layers
    )

  def describe(self, target=None) -> str:
    """What the move did, for the resume's line (`target`: the run's state, for its history)."""
    text = (
      f'the parameters and optimizer state re-staged from {len(self.old_layers)} stage(s) to '
      f'{len(self.new_layers)}'
    )
    if not self.fresh:
      text += ' (an exact schedule holds nothing in flight: nothing was drained or reset)'
    if self.fresh and self.from_ring:  # Ouroboros' stages take their first updates apart
      text += " (the ring drained before; each stage counts its first layer's updates)"
    if self.fresh and self.to_ring:
      text += "; the ring restarts empty at this step (a model's memory too)"
    history = target is not None and self.resets_history and _has_history(target)
    if self.remap or history:
      text += (
        "; the optimizer's own state moved, the compensations' (weight prediction's last "
        "update, DC-ASGD's mean g * g) start again from zero"
      )
    if history:
      text += "; DC-ASGD's history of past weights restarts as copies of the current weights"
    if self.fresh_opt_state is not None:
      text += "; the optimizer's state starts again from its init (--fresh-optimizer)"
    return text

  def abstract(self, target, saved):
    """What to restore: the run's tree with the stored form's shapes. Per-layer: with shardings
    from the run's, its ring as the run's (none where it restarts empty). Before it: whole on
    this process's first device, the ring as `saved` (the checkpoint's tree metadata) has it
    when the run's cannot take it."""
    if not self.per_layer:
      if self.resets_history:
        _refuse_history(target, saved)
      if self.remap or self.fresh_opt_state is not None:
        raise CheckpointError(
          'the checkpoint was saved before the per-layer form: its optimizer state moves only '
          "as it is; resume with the checkpoint's --compensation, without --fresh-optimizer."
        )
      return self._abstract_as_saved(target, saved)
    abstract = self._stored_abstract(target).replace(ring={} if self.fresh else target.ring)
    if not self._remaps(target, saved):
      return abstract
    where = jax.tree.leaves(target.params['stages'])[0].sharding
    return abstract.replace(opt_state=_saved_opt_state(saved['opt_state'], where))

  @property
  def resets_history(self) -> bool:
    """Whether DC-ASGD's history of past weights (shaped by the layout and the lag) restarts."""
    return self.fresh or self.old_layers != self.new_layers

  def _remaps(self, target, saved) -> bool:
    """Whether the saved optimizer state is read as its own tree and rebuilt in the run's
    (`_remapped`): the compensations keep states of other parts, or a DC-ASGD history (shaped
    by the saved layout and lag) restarts."""
    history = self.resets_history and (_has_history(target) or _has_history(saved or {}))
    return self.per_layer and (self.remap or history or self.fresh_opt_state is not None)

  def _stored_abstract(self, target):
    """The run's state (its ring left out) in the stored form, placed as `_stored_sharding`."""
    run = target.replace(ring={})
    kinds = kinds_of(run, self.new_layers)

    def leaf(kind, a):
      shape = _shape_as(kind, a.shape, self.new_layers, self.stored_layers)
      return jax.ShapeDtypeStruct(
        shape, a.dtype, sharding=_stored_sharding(kind, a.sharding, shape)
      )

    return jax.tree.map(leaf, kinds, run)

  def apply(self, state, target, saved=None):
    """The restored state re-staged for the run, placed with the target's shardings (`saved`:
    the checkpoint's tree metadata, as `abstract` had it)."""
    if self.changed and self.old_layers != self.new_layers and not self.fresh:
      _check_counters(state)
    if not self.per_layer:
      return self._apply_as_saved(state, target)
    run = target.replace(ring={})
    kinds = kinds_of(run, self.new_layers)
    shardings = jax.tree.map(lambda a: a.sharding, run)
    restage = _restager(run, kinds, self.stored_layers, self.new_layers, shardings)
    if self._remaps(target, saved):
      stored_opt = self._stored_abstract(target).opt_state
      paths = self.inner_paths if self.fresh_opt_state is None else ((), (None,))  # none taken
      state = state.replace(opt_state=_remapped(state.opt_state, stored_opt, *paths))
    moved = restage(state.replace(ring={}))
    if self.fresh_opt_state is not None:
      moved = moved.replace(opt_state=self.fresh_opt_state)
    if self.resets_history and _has_history(target):
      moved = _history_restarted(moved, kinds)
    if not self.fresh:
      return moved.replace(ring=state.ring)
    ring = self._ring(None, target.ring, int(moved.step))
    return moved.replace(ring=_placed(ring, target.ring))

  def _abstract_as_saved(self, target, saved):
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    run = target.replace(ring={})
    kinds = kinds_of(run, self.new_layers)
    old = lambda k, a: jax.ShapeDtypeStruct(
      _shape_as(k, a.shape, self.new_layers, self.old_layers), a.dtype, sharding=device
    )
    abstract = jax.tree.map(old, kinds, run)
    if not (self.fresh or self.add_window):
      return abstract.replace(ring=jax.tree.map(lambda a: old('whole', a), target.ring))
    as_saved = lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device)
    ring = jax.tree.map(as_saved, saved['ring'], is_leaf=lambda m: hasattr(m, 'shape'))
    return abstract.replace(ring=ring)

  def _apply_as_saved(self, state, target):
    """A stage-shaped checkpoint's move: re-staged on one device, placed from the host."""
    run = target.replace(ring={})
    kinds = kinds_of(run, self.new_layers)
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    shardings = jax.tree.map(lambda a: device, run)
    restage = _restager(run, kinds, self.old_layers, self.new_layers, shardings)
    moved = jax.device_get(restage(state.replace(ring={})))
    ring = self._ring(jax.device_get(state.ring), target.ring, moved.step)
    # Each process holds the whole moved state: every device takes its shard from it, whichever
    # process it belongs to (a 2-process run resumed in 1, or the reverse).
    return _placed(moved.replace(ring=ring), target)

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


def _placed(host, target):
  """Host arrays placed as `target` says, every device taking its shard from its own process's
  copy (`jax.make_array_from_callback`)."""
  place = lambda h, leaf: jax.make_array_from_callback(
    np.shape(h), leaf.sharding, lambda index: np.asarray(h)[index], dtype=leaf.dtype
  )
  return jax.tree.map(place, host, target)


def _saved_opt_state(metadata, where):
  """The abstract of a saved optimizer state of other compensations, as its own tree (Orbax's
  metadata: dicts and lists): a layer leaf ([L, 1, ...]) sharded over the run's stages where L
  divides (`where`: a stage leaf's sharding), the rest whole on every device."""

  def leaf(path, m):
    sharding = where
    if isinstance(where, jax.sharding.NamedSharding):
      layer = _names(path)[0] in STAGED_GROUPS and len(m.shape) >= 2 and m.shape[1] == 1
      stages = jax.sharding.PartitionSpec(*where.spec[:1]) if layer else None
      whole = jax.sharding.PartitionSpec()
      sharding = jax.sharding.NamedSharding(where.mesh, whole)
      if stages is not None:
        sharding = _stored_sharding('layer', sharding.update(spec=stages), m.shape)
    return jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=sharding)

  is_leaf = lambda m: hasattr(m, 'shape')
  return jax.tree_util.tree_map_with_path(leaf, metadata, is_leaf=is_leaf)


def _remapped(saved, stored, saved_inner: tuple, run_inner: tuple):
  """The run's optimizer state (`stored`: its abstract, stored form) from a saved one of other
  compensations (a tree of dicts and lists): in each group, the optimizer's own state taken from
  where the saved one keeps it, every compensation's leaf zero (as its init makes it)."""

  def leaf(path, a):
    keys = [_key(k) for k in path]
    group, rest = keys[0], tuple(keys[1:])
    if rest[: len(run_inner)] != tuple(run_inner):
      return _zeros(a)
    node = saved[group]
    for key in (*saved_inner, *rest[len(run_inner) :]):
      node = node[key]
    if tuple(node.shape) != tuple(a.shape):
      raise CheckpointError(
        f"the checkpoint's optimizer state {jax.tree_util.keystr(path)} has shape "
        f"{tuple(node.shape)}, the run's {tuple(a.shape)}: resume with the checkpoint's flags."
      )
    return node

  return jax.tree_util.tree_map_with_path(leaf, stored)


def _zeros(a):
  """Zeros of an abstract leaf's shape and dtype, placed as it says."""
  return jax.numpy.zeros(a.shape, a.dtype, device=a.sharding)  # one compile a shape, not a leaf


def _history_restarted(state, kinds):
  """The state with DC-ASGD's history as its init makes it: `depth` copies of the current
  weights (a stage's [G', depth, N, ...] from its [G', N, ...])."""

  def leaf(path, kind, h):
    if kind != 'history':
      return h
    keys = [_key(k) for k in path]
    group, rest = keys[1], keys[keys.index('history') + 1 :]
    if group not in state.params:
      raise CheckpointError(
        f"DC-ASGD's history of the {group!r} group cannot restart on another layout; resume "
        "with the checkpoint's flags."
      )
    p = functools.reduce(lambda node, k: node[k], rest, state.params[group])
    axis = 1 if group == STAGED_GROUPS[0] else 0
    copies = lambda w: jax.numpy.broadcast_to(jax.numpy.expand_dims(w, axis), h.shape).astype(
      h.dtype
    )
    return jax.jit(copies, out_shardings=h.sharding)(p)

  return jax.tree_util.tree_map_with_path(leaf, kinds, state)


def _key(k):
  """A path entry as Orbax's metadata spells it: a dict key or field name, or a list index."""
  for name in ('key', 'name', 'idx'):
    if hasattr(k, name):
      return getattr(k, name)
  raise TypeError(f'unknown path entry {k!r}')


def _names(path) -> list:
  return [getattr(k, 'key', getattr(k, 'name', None)) for k in path]


def kinds_of(run, layers: tuple[int, ...]):
  """Each leaf's kind in a run's state laid out as `layers` (its ring left out): 'layer' for a
  [G', N, ...] stage leaf whose rest is a layer parameter's shape, 'stage' for another [G', ...]
  one (a counter, Muon's Newton-Schulz coefficients), 'history' for DC-ASGD's past weights,
  else 'whole'."""
  per_layer = {tuple(a.shape[2:]) for a in jax.tree.leaves(run.params['stages'])}
  return jax.tree_util.tree_map_with_path(
    lambda path, a: _kind(path, a.shape, tuple(layers), per_layer), run
  )


def _kind(path, shape, layers: tuple[int, ...], per_layer) -> str:
  names = _names(path)
  if 'history' in names:  # in any group's optimizer state
    return 'history'
  if not (any(g in names for g in STAGED_GROUPS) and names[0] in ('params', 'opt_state')):
    return 'whole'
  stages, width = len(layers), max(layers)
  if len(shape) >= 2 and tuple(shape[:2]) == (stages, width) and tuple(shape[2:]) in per_layer:
    return 'layer'
  if len(shape) >= 1 and shape[0] == stages:
    return 'stage'
  raise CheckpointError(
    f'cannot lay out the state leaf {jax.tree_util.keystr(path)} of shape {tuple(shape)} by '
    f'layer: it leads with neither [stages, layers] ({stages}, {width}) nor [stages].'
  )


def _shape_as(kind: str, shape, frm, to) -> tuple:
  """A leaf's shape laid out as `frm`, laid out as `to`."""
  if kind == 'layer':
    return (len(to), max(to), *shape[2:])
  return (len(to), *shape[1:]) if kind == 'stage' else tuple(shape)


def _stored_sharding(kind: str, sharding, shape):
  """The sharding of a leaf of the stored form, from the run's: a layer axis keeps the run's
  stage axis where it divides evenly, a per-layer value is whole on every device, the rest of a
  leaf keeps its own."""
  if kind in ('whole', 'history') or not isinstance(sharding, jax.sharding.NamedSharding):
    return sharding
  spec = tuple(sharding.spec) + (None,) * (len(shape) - len(sharding.spec))
  axes = spec[0] if isinstance(spec[0], tuple) else (spec[0],)
  size = int(np.prod([sharding.mesh.shape[a] for a in axes if a is not None]))
  lead = spec[0] if kind == 'layer' and shape[0] % size == 0 else None
  rest = (None, *spec[2:]) if kind == 'layer' else spec[1:]
  return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(lead, *rest))


def _restage(kind: str, a, frm, to):
  """One leaf laid out as `frm`, laid out as `to` (traced)."""
  if frm == to or kind in ('whole', 'history'):
    return a
  if kind == 'layer':  # the staging functions' own tree, one leaf at a time
    layers = staging.from_staged({'embed': 0, 'stages': a, 'head': 0}, frm)['layers']
    return staging.to_staged({'embed': 0, 'layers': layers, 'head': 0}, to)['stages']
  owner = np.repeat(np.arange(len(frm)), frm)  # each new stage: the old one of its first layer
  return a[owner[np.cumsum([0, *to[:-1]])]]


def _has_history(tree) -> bool:
  """Whether a state (or a checkpoint's tree metadata) holds DC-ASGD's history of weights."""
  leaves = jax.tree_util.tree_leaves_with_path(tree, is_leaf=lambda m: hasattr(m, 'shape'))
  return any('history' in _names(path) for path, _ in leaves)


def _refuse_history(target, saved) -> None:
  """A CheckpointError where a checkpoint from before the per-layer form, or the run, keeps
  DC-ASGD's history of past weights: that form's move cannot restart it."""
  if _has_history(target) or _has_history(saved if isinstance(saved, dict) else {}):
    raise CheckpointError(
      "the checkpoint's DC-ASGD history of past weights (kept where gradients are more than one "
      'update old: --flow batch, or fewer micro-batches than the lag) is shaped by its layout, '
      "and the checkpoint predates the per-layer form; resume with the checkpoint's flags."
    )


def _check_counters(state) -> None:
  """A CheckpointError where the restored per-stage counters differ across stages (no exact
  schedule's do: each takes one update a step), checked on the host."""
  agree = True
  for path, leaf in jax.tree_util.tree_leaves_with_path(state.replace(ring={})):
    names = _names(path)
    if any(g in names for g in STAGED_GROUPS) and names[0] == 'opt_state' and np.ndim(leaf) == 1:
      values = np.asarray(leaf)
      agree = agree and bool((values == values[0]).all())
  if not agree:
    raise CheckpointError(
      "the checkpoint's stages took different numbers of updates, which no exact schedule "
      "does: it cannot move to another layout; resume with the checkpoint's flags."
    )
