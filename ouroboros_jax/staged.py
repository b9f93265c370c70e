"""The one step interface every schedule shares, and the pieces they all use.

A model is given to a schedule as a `StagedModel`: three pure functions

    embed(embed_params, inputs, rng)                 -> x          (module 1, first part)
    stage(stage_params, x, stage_index, rng)         -> x          (one layer group)
    loss(head_params, embed_params, x, targets)      -> (loss, metrics)   (module K)

The activations x may be any pytree whose leaves lead with the batch axis (the standardization
loss carries {'h': hidden states, 'aux': the auxiliary loss so far, per row}; a user's model a
bool mask and int positions); ring buffers, stashes and the pipelines' inboxes hold them leaf by
leaf. A leaf that is not a float is not differentiated: its cotangent is zeros of its own dtype
(`pull`). A batch is {'inputs', 'targets'}, each an array or a pytree of them.

The loss of a batch is a mean. A model whose loss averages over a weight that varies from batch
to batch (the valid tokens of a padded batch) states it with `loss_weight(targets) -> scalar`:
every schedule then forms the gradient of the whole batch's weighted mean, whichever micro-batch
or replica a token falls in (schedules.ring.loss_shares); Ouroboros weighs each item by its own
batch's weight. Without one, every micro-batch and replica weighs the same. A model whose stages
need the index of the batch they run on (PLD's theta(t)) sets `takes_batch_index`: every schedule
then calls `stage(..., batch_index=t)`, with t the batch's index (the step that consumes it), the
same t its dropout key `batch_key(seed, t)` comes from.

with parameters laid out as

    params = {'embed': ..., 'stages': <every leaf stacked on a leading axis of size G>, 'head': ...}

The head gets the embedding parameters too, so a tied output projection (V^T) works. Any schedule
builder returns a `Schedule` whose `step(state, batch) -> (state, metrics)` is a pure jitted
function of a `TrainState` pytree, so schedules are interchangeable and their parameters are
directly comparable.

The optimizer step every schedule shares (one clip, an Optax update per module group) is
update.py's `GroupedOptimizer`; the mesh, where each piece of the state lives and the jitted
step are placement.py's.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from ouroboros_jax.optimizers import adamw  # noqa: F401  (staged.adamw, as the notebooks write it)

PyTree = Any
# The ring's mesh axes, named so that no user's own mesh axis ('data', 'stage', 'model') can be
# one of them: a model's sharding annotations on its own axes never meet the ring's manual axes.
STAGE, DATA = 'ouroboros_stage', 'ouroboros_data'


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
  # The stages take `batch_index=t` (see the module docstring).
  takes_batch_index: bool = False
  # What the loss of a batch of targets averages over (its valid tokens, say): targets -> a
  # scalar, from the targets alone. None: every row weighs the same. See `loss_shares`.
  loss_weight: Callable[..., jax.Array] | None = None

  def run_stage(self, stage_params, x, stage_index, rng, memory=None, batch_index=None):
    """(y, new memory): one stage with its memory; (y, None) for a model without one."""
    if self.memory is None:
      return self.stage(stage_params, x, stage_index, rng, **self._index(batch_index)), None
    return self.memory.stage(stage_params, x, stage_index, rng, memory, **self._index(batch_index))

  def _index(self, batch_index) -> dict:
    return {'batch_index': batch_index} if self.takes_batch_index else {}

  def recurrent_loss(self, params: PyTree, batch: dict, key, memory_G, batch_index=None):
    """`forward_loss` with every stage's memory (leaves [G, ...]), shaped for
    `jax.value_and_grad(..., has_aux=True)`: (loss, (metrics, the new memory [G, ...]))."""
    x = self.embed(params['embed'], batch['inputs'], piece_rng(key, EMBED_PIECE))
    new = []
    for s in range(stage_count(params)):
      at = lambda a: a[s]
      x, memory_s = self.run_stage(
        jax.tree.map(at, params['stages']),
        x,
        s,
        piece_rng(key, s),
        jax.tree.map(at, memory_G),
        batch_index,
      )
      new.append(memory_s)
    loss, metrics = self.loss(params['head'], params['embed'], x, batch['targets'])
    return loss, (metrics, jax.tree.map(lambda *m: jnp.stack(m), *new))

  def forward_loss(
    self, params: PyTree, batch: dict, key: jax.Array | None = None, batch_index=None
  ):
    """Plain composition on one device: embed, every stage in order, loss.

    `key` is the batch's dropout key (None: no dropout); the pieces draw from it exactly as they
    do inside the parallel schedules (`piece_rng`). `batch_index` is the batch's t, for a model
    that `takes_batch_index`.
    """
    x = self.embed(params['embed'], batch['inputs'], piece_rng(key, EMBED_PIECE))
    for s in range(stage_count(params)):
      stage_params = jax.tree.map(lambda a: a[s], params['stages'])
      x = self.stage(stage_params, x, s, piece_rng(key, s), **self._index(batch_index))
    return self.loss(params['head'], params['embed'], x, batch['targets'])


def stage_count(params: PyTree) -> int:
  return jax.tree.leaves(params['stages'])[0].shape[0]


def pull(vjp_fn, cotangent: PyTree, *like: PyTree) -> tuple:
  """`vjp_fn(cotangent)` with cotangents laid out as the library holds them: a leaf that is not
  a float (a bool mask, int positions between stages) has a cotangent of zeros of its own dtype,
  not JAX's `float0`, so ring buffers, stashes and `lax.cond` branches hold it like any other.
  `like`: one tree per output of vjp_fn (its primal, whose dtypes the cotangents take), or None
  for an output of floats only."""
  to_jax = lambda c: c if _is_float(c) else np.zeros(jnp.shape(c), jax.dtypes.float0)
  out = vjp_fn(jax.tree.map(to_jax, cotangent))
  back = lambda g, p: jnp.zeros(jnp.shape(p), p.dtype) if g.dtype == jax.dtypes.float0 else g
  return tuple(g if p is None else jax.tree.map(back, g, p) for g, p in zip(out, like))


def _is_float(a) -> bool:
  return jnp.issubdtype(jnp.result_type(a), jnp.inexact)


def batch_rows(x: PyTree) -> int:
  """The number of examples in activations x (every leaf leads with the batch axis)."""
  return jax.tree.leaves(x)[0].shape[0]


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
  settings(rows) -> ResolvedSchedule       what it runs a batch of `rows` rows with, every
    default resolved (Ouroboros' micro-batches may depend on the batch).
  layout(state) -> shardings               where `init` puts each leaf of a state (a TrainState
    of NamedShardings on `mesh`): for an abstract state, as `ouroboros compile` builds one.
  drain(state) -> state                    the state with nothing in flight: Ouroboros applies
    every gradient its ring holds (`ouroboros.drain`); an exact schedule's state as it is.
  """

  init: Callable[..., TrainState]
  step: Callable[..., tuple[TrainState, dict]]
  evaluate: Callable[..., jax.Array]
  mesh: Mesh
  idle_fraction: float
  name: str
  settings: Callable[[int], Any]
  layout: Callable[[Any], Any]
  drain: Callable[[TrainState], TrainState] = lambda state: state


EMBED_PIECE = -1


def batch_key(seed: int, batch_index):
  """The dropout key of batch t: the same wherever and whenever batch t is computed, so a
  replayed forward draws the same dropout mask as the original one."""
  return jax.random.fold_in(jax.random.key(seed), batch_index)


def piece_rng(key, piece):
  """The key of one piece of the model (a stage index, or EMBED_PIECE) for one batch."""
  return None if key is None else jax.random.fold_in(key, piece + 1)
