"""What a device keeps of a batch between a layer group's forward and its backward.

Every stash has the same two halves (the `Stash` protocol):

  forward(params_s, x, stage_index, key, memory=None, batch_index=None)
      -> (y, kept, new memory or None)
  backward(params_s, kept, delta, stage_index, key, batch_index=None)
      -> (weight gradient, input gradient)

(`key` is the batch's dropout key, `batch_index` its t, for a model that `takes_batch_index`.)

  GraphStash   the forward's VJP residuals (as DDG): the gradient is taken at the weights of
               the forward. A checkpoint `policy` (STASH_POLICIES) chooses which residuals
               are kept; the rest are recomputed in the backward, at the same weights.
  ReplayStash  only the group's input (as Features Replay): the backward re-runs the forward
               at the weights it is given and takes the VJP there; one extra forward.
  TappedStash  the zero-bubble split of a model with a `staged.WeightSplit`: B (`input_grad`)
               and W (`weight_grad`) apart, from one forward's residuals and recorded inputs.

`at_forward_weights` says whether the backward needs the weights of the forward (a schedule
whose weights change between the two, Ouroboros, must keep them).
"""

from __future__ import annotations

from typing import Protocol

import jax
import jax.extend
import jax.numpy as jnp

from ouroboros_jax import staged
from ouroboros_jax.choices import DEFAULT_STASH_POLICY
from ouroboros_jax.staged import StagedModel, WeightSplit
from ouroboros_jax.staging import STASH_POLICIES

# What graph mode keeps of a group's forward (`staging.STASH_POLICIES`, which every schedule's
# --stash-policy names; the layer loop reads it too).


class Stash(Protocol):
  """The two halves every stash has (see the module docstring)."""

  at_forward_weights: bool

  def forward(self, params_s, x, stage_index, key, memory=None, batch_index=None): ...

  def backward(self, params_s, kept, delta, stage_index, key, batch_index=None): ...


def make_stash(
  model: StagedModel, mode: str = 'graph', policy: str = DEFAULT_STASH_POLICY, **options
) -> Stash:
  """The stash `mode` names ('graph' with `policy` and `options`, or 'replay')."""
  return GraphStash(model, policy, **options) if mode == 'graph' else ReplayStash(model)


class _ModelStash:
  """A stash of a `StagedModel`'s stage (`self.model`)."""

  model: StagedModel

  def _run(self, params_s, x, stage_index, key, memory=None, batch_index=None):
    """(the group's output, its new memory (None without one)), with the group's dropout key."""
    rng = staged.piece_rng(key, stage_index)
    return self.model.run_stage(params_s, x, stage_index, rng, memory, batch_index)


class GraphStash(_ModelStash):
  """The forward's VJP residuals. Only the VJP's leaves are kept; its tree structure is rebuilt
  in the backward from an abstract trace of the same forward (`vjp_layout`), so the backward does
  not depend on which forward was traced before it. A group maps its input to an output of the
  same shape (activations travel around the ring), so the output gradient gives the input's shape.

  `keep_weights=False` (for schedules whose weights do not change between a forward and its
  backward, or that keep the forward's weights themselves) leaves out the residuals that are the
  weights and takes them from the params the backward is given: the stash holds activations."""

  at_forward_weights = True

  def __init__(
    self, model: StagedModel, policy: str = DEFAULT_STASH_POLICY, keep_weights: bool = True
  ):
    self.model, self.policy, self.keep_weights = model, STASH_POLICIES[policy], keep_weights

  def _vjp(self, params_s, x, stage_index, key, memory=None, batch_index=None):
    run = lambda p, h: self._run(p, h, stage_index, key, memory, batch_index)
    if self.policy is not None:
      run = jax.checkpoint(run, policy=self.policy)
    return jax.vjp(run, params_s, x, has_aux=True)  # (y, vjp_fn, new memory)

  def _memory_like(self, params_s, x_like):
    """The shape of the memory a forward on x_like read (None for a model without one)."""
    if self.model.memory is None:
      return None
    rows = staged.batch_rows(x_like)
    return jax.eval_shape(lambda p: self.model.memory.init(p, rows), params_s)

  def forward(self, params_s, x, stage_index, key, memory=None, batch_index=None):
    y, vjp_fn, new_memory = self._vjp(params_s, x, stage_index, key, memory, batch_index)
    leaves = jax.tree.leaves(vjp_fn)
    return y, leaves if self.keep_weights else without_weights(leaves, params_s), new_memory

  def backward(self, params_s, kept, delta, stage_index, key, batch_index=None):
    vjp_of = lambda h, m: self._vjp(params_s, h, stage_index, key, m, batch_index)[1]
    memory_like = self._memory_like(params_s, delta)
    treedef, positions = vjp_layout(vjp_of, params_s, delta, memory_like)
    if not self.keep_weights:
      kept = with_weights(kept, positions, params_s)
    return staged.pull(jax.tree.unflatten(treedef, kept), delta, params_s, delta)


class ReplayStash(_ModelStash):
  """Only the group's input, and the memory the forward read (a model with a memory keeps
  (input, memory)); the backward re-runs the forward at the weights it is given."""

  at_forward_weights = False

  def __init__(self, model: StagedModel):
    self.model = model

  def forward(self, params_s, x, stage_index, key, memory=None, batch_index=None):
    y, new_memory = self._run(params_s, x, stage_index, key, memory, batch_index)
    return y, (x if self.model.memory is None else (x, memory)), new_memory

  def backward(self, params_s, kept, delta, stage_index, key, batch_index=None):
    x, memory = (kept, None) if self.model.memory is None else kept
    run = lambda p, h: self._run(p, h, stage_index, key, memory, batch_index)
    return staged.pull(jax.vjp(run, params_s, x, has_aux=True)[1], delta, params_s, x)


class TappedStash:
  """F, B and W of a stage through its model's `staged.WeightSplit` (the zero-bubble split
  without a second chain). F keeps the VJP in (input, taps), less the weights (they do not change
  within a step), and the recorded sub-layer inputs; B gives the input gradient and the taps'
  gradients; W multiplies those with the recorded inputs into the weight gradient.

  `recompute=True` (any stash policy but 'all'): F keeps only the stage's input, B re-runs the
  forward from it and takes the VJP there, and hands W the recorded inputs beside the taps'
  gradients. So B recomputes and W does not; the recorded inputs wait from B to W, not from F."""

  at_forward_weights = False

  def __init__(self, split: WeightSplit, recompute: bool = False):
    self.split, self.recompute = split, recompute

  def _vjp(self, params_s, x, stage_index, key):
    rng = staged.piece_rng(key, stage_index)
    run = lambda h, taps: self.split.stage(params_s, h, stage_index, rng, taps)
    return jax.vjp(run, x, self.split.taps(params_s, x), has_aux=True)

  def forward(self, params_s, x, stage_index, key, memory=None, batch_index=None):
    """The models with a weight split have no memory and do not take the batch index."""
    del memory, batch_index
    y, vjp_fn, inputs = self._vjp(params_s, x, stage_index, key)
    if self.recompute:  # XLA drops the VJP's unused residuals
      return y, x, None
    kept = {'vjp': without_weights(jax.tree.leaves(vjp_fn), params_s), 'inputs': inputs}
    return y, kept, None

  def input_grad(self, params_s, kept, delta, stage_index, key):
    """B: (the input gradient, what W needs besides F's stash: {'tap_grads'}, and with
    `recompute` the recorded inputs too) for output gradient delta."""
    if self.recompute:
      _, vjp_fn, inputs = self._vjp(params_s, kept, stage_index, key)
      dx, tap_grads = staged.pull(vjp_fn, delta, delta, None)
      return dx, {'tap_grads': tap_grads, 'inputs': inputs}
    vjp_of = lambda h: self._vjp(params_s, h, stage_index, key)[1]
    treedef, positions = vjp_layout(vjp_of, params_s, delta)
    vjp_fn = jax.tree.unflatten(treedef, with_weights(kept['vjp'], positions, params_s))
    dx, tap_grads = staged.pull(vjp_fn, delta, delta, None)
    return dx, {'tap_grads': tap_grads}

  def weight_grad(self, params_s, kept, for_w):
    """W: the weight gradient from the taps' gradients and the recorded inputs."""
    return self.split.weight_grad(params_s, *self.recorded(kept, for_w))

  def recorded(self, kept, for_w):
    """What W reads besides the weights: (the recorded sub-layer inputs, the taps' gradients)."""
    return (for_w['inputs'] if self.recompute else kept['inputs']), for_w['tap_grads']

  def backward(self, params_s, kept, delta, stage_index, key, batch_index=None):
    del batch_index
    dx, for_w = self.input_grad(params_s, kept, delta, stage_index, key)
    return self.weight_grad(params_s, kept, for_w), dx


def _weight_positions(residuals: list, params_s) -> tuple[int | None, ...]:
  """For each VJP residual, the index of the weight leaf it is (the same traced array), or None."""
  index = {id(leaf): i for i, leaf in enumerate(jax.tree.leaves(params_s))}
  return tuple(index.get(id(leaf)) for leaf in residuals)


def without_weights(residuals: list, params_s) -> list:
  """The VJP residuals that are not the weights themselves (what a stash must keep when the
  weights do not change before the backward)."""
  positions = _weight_positions(residuals, params_s)
  return [leaf for leaf, w in zip(residuals, positions) if w is None]


def with_weights(kept: list, positions, params_s) -> list:
  """`without_weights` undone: the residuals again, weights taken from params_s."""
  weights, rest = jax.tree.leaves(params_s), iter(kept)
  return [next(rest) if w is None else weights[w] for w in positions]


def vjp_layout(vjp_of, params_s, *like):
  """(tree structure, weight positions) of the VJP `vjp_of(*args)` returns, from an abstract
  trace on arrays shaped like `like`."""
  layout = []

  def leaves(*args):
    flat, treedef = jax.tree.flatten(vjp_of(*args))
    layout.append((treedef, _weight_positions(flat, params_s)))
    return flat

  jax.eval_shape(leaves, *like)
  return layout[0]


# -- the forward's weights, kept narrow where the forward only reads them narrow -------------------

# Value-preserving ops a weight may pass through on its way to its cast (a cast commutes with them):
# the layer loop's slices of stacked weights and a module's reshapes.
_PASS_THROUGH = frozenset(
  {'slice', 'dynamic_slice', 'squeeze', 'reshape', 'expand_dims', 'transpose', 'copy', 'copy_p'}
)


def read_dtypes(fn, params, *args) -> list:
  """For each leaf of `params`, the narrower floating dtype `fn(params, *args)` reads it in, if
  every read of it is a cast to that one dtype (a bf16 forward of float32 weights: Flax casts
  each kernel where it is used); else None.

  Where a leaf's entry is a dtype, keeping the leaf's cast instead of the leaf loses nothing:
  `fn` at `cast.astype(leaf.dtype)` computes exactly what it computes at the leaf, and so does its
  VJP (a cast's transpose is a cast). Found on `fn`'s jaxpr, following each leaf into loops,
  checkpoints, calls and branches; any other read (a float32 norm scale, an unknown primitive)
  keeps the leaf as it is."""
  closed = jax.make_jaxpr(fn)(params, *args)
  leaves = jax.tree.leaves(params)
  out = []
  for var, leaf in zip(closed.jaxpr.invars[: len(leaves)], leaves):
    dtypes = _cast_reads(closed.jaxpr, var)
    narrow = (
      dtypes is not None
      and len(dtypes) == 1
      and jnp.issubdtype(next(iter(dtypes)), jnp.floating)
      and jnp.dtype(next(iter(dtypes))).itemsize < jnp.dtype(leaf.dtype).itemsize
    )
    out.append(jnp.dtype(next(iter(dtypes))) if narrow else None)
  return out


def _cast_reads(jaxpr, var) -> set | None:
  """The dtypes `var` is cast to in `jaxpr`, if casts are all that read it (through pass-through
  ops and into sub-jaxprs); None if anything else reads it or it is an output."""
  if any(out is var for out in jaxpr.outvars):
    return None
  found = set()
  for eqn in jaxpr.eqns:
    positions = [i for i, v in enumerate(eqn.invars) if v is var]
    if not positions:
      continue
    name = eqn.primitive.name
    if name == 'convert_element_type':
      found.add(jnp.dtype(eqn.params['new_dtype']))
      continue
    if name in _PASS_THROUGH and positions == [0]:
      inner = _cast_reads(jaxpr, eqn.outvars[0])
      if inner is None:
        return None
      found |= inner
      continue
    subs = _sub_jaxprs(eqn)
    if not subs:
      return None
    for sub in subs:
      offset = len(eqn.invars) - len(sub.invars)  # cond: its branch index comes first
      if offset < 0 or any(i < offset for i in positions):
        return None
      for i in positions:
        inner = _cast_reads(sub, sub.invars[i - offset])
        if inner is None:
          return None
        found |= inner
  return found


def _sub_jaxprs(eqn) -> list:
  """The jaxprs an equation runs on its operands in order (scan, checkpoint, jit, custom rules,
  shard_map, each branch of a cond); [] for any other equation (a while loop splits its operands
  between two jaxprs and is not followed)."""
  if eqn.primitive.name == 'while':
    return []
  subs = []
  for value in eqn.params.values():
    for item in value if isinstance(value, (tuple, list)) else (value,):
      jaxpr = getattr(item, 'jaxpr', item)  # a ClosedJaxpr's, or a Jaxpr
      if isinstance(jaxpr, jax.extend.core.Jaxpr):
        subs.append(jaxpr)
  return subs
