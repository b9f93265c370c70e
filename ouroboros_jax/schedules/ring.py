"""The ring placement shared by the stage-parallel schedules (`model_parallel`, `ouroboros`).

Device 0 of the mesh axis `stage` holds the embedding, layer group 0 and the head (final norm,
output projection V^T, loss), because V is tied; device s holds layer group s. Activations go
0 -> 1 -> ... -> G-1 -> 0 and error gradients go the other way.

Every function here runs inside a `jax.shard_map` over (stage, data) and sees one device's share:
stage parameters with a leading axis of size 1, embed and head parameters replicated, and its data
replica's part of the batch. The pieces are small on purpose, so that a schedule written with them
reads like its algorithm:

  locked_forward    G rounds; in round r only device r runs its group (the others wait)
  head              the loss, its gradient and the error gradient of the last group, on device 0
  locked_backward   G rounds in reverse; in round r only device r back-propagates
  embed_backward    the input-side gradient of the embedding, on device 0
  gather_grads      the gradients from the devices that own them, averaged over data replicas
  locked_grads      all of the above: the exact gradient of `model_parallel` (and of Ouroboros'
                    synchronous warm-up)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ouroboros_jax import staged
from ouroboros_jax.staged import DATA, EMBED_PIECE, STAGE, StagedModel


def on_stage(stage_index, which, fn):
  """Run fn() on device `which` of the ring only; the others get zeros of the same shapes."""
  zeros = lambda: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), jax.eval_shape(fn))
  return jax.lax.cond(stage_index == which, fn, zeros)


def mask(valid, tree):
  """tree where valid, zeros elsewhere (a select: garbage in `tree` cannot leak through)."""
  return jax.tree.map(lambda a: jnp.where(valid, a, jnp.zeros_like(a)), tree)


def microbatches(tree, num_microbatches: int):
  """Leaves [B, ...] cut into [M, B/M, ...]: micro-batch m is rows m*B/M .. (m+1)*B/M - 1."""
  return jax.tree.map(lambda a: a.reshape(num_microbatches, -1, *a.shape[1:]), tree)


def whole_batch(tree):
  """`microbatches` undone: leaves [M, B/M, ...] -> [B, ...]."""
  return jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), tree)


def microbatch_key(key, m, num_microbatches: int):
  """Micro-batch m's dropout key: the batch's own key when the batch is not cut (as the exact
  pipelines do), so one micro-batch is the un-chunked step bit for bit."""
  return key if num_microbatches == 1 else jax.random.fold_in(key, m)


def read_slot(buffers, batch_index, depth: int):
  """The entries of batch `batch_index` in ring buffers of `depth` slots (slot = index % depth),
  in device memory wherever the buffers live."""
  return staged.to_device(jax.tree.map(lambda buf: buf[batch_index % depth], buffers))


def write_slot(buffers, values, batch_index, depth: int):
  """Ring buffers with batch `batch_index`'s slot overwritten by `values` (in place under jit
  when nothing reads the old buffer afterwards)."""
  values = staged.into_space_of(values, buffers)
  return jax.tree.map(lambda buf, v: buf.at[batch_index % depth].set(v), buffers, values)


def local_stage_params(params):
  """This device's layer group: the stage parameters without their leading axis of size 1."""
  return jax.tree.map(lambda a: a[0], params['stages'])


# What graph mode keeps of a group's forward, as `jax.checkpoint` policies. 'all' keeps every
# residual JAX's VJP saves. The others keep less and recompute the rest in the backward, from
# the kept values: the gradient is still exactly the one at forward-time weights (DDG), only
# bytes move from memory traffic to recomputation. 'dots' keeps matmul outputs (elementwise ops,
# norms and softmax are recomputed); 'nothing' keeps only the group's inputs and weights (the
# whole forward is recomputed, as in replay, but at the forward-time weights).
STASH_POLICIES = {
  'all': None,
  'dots': jax.checkpoint_policies.dots_saveable,
  'dots_no_batch': jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
  'nothing': jax.checkpoint_policies.nothing_saveable,
}


class Stash:
  """What a device keeps of a batch between its group's forward and its group's backward.

  graph   the forward's VJP residuals (as DDG): the gradient is taken at forward-time weights.
          `policy` (a key of STASH_POLICIES) chooses which residuals are kept.
  replay  only the group's input (as Features Replay): the backward re-runs the forward at the
          weights it is given and takes the VJP there; one extra forward, far less memory.

  In graph mode only the VJP's leaves are kept; its tree structure is rebuilt in the backward
  from an abstract trace of the same forward (`vjp_structure`), so the backward does not depend
  on which forward was traced before it. A group maps its input to an output of the same shape
  (activations travel around the ring), so the output gradient gives the input's shape.

  `keep_weights=False` (graph mode, for schedules whose weights do not change between a forward
  and its backward: the exact pipelines) leaves out the residuals that are the weights themselves
  and takes them from the params the backward is given: the stash then holds activations only.
  """

  def __init__(
    self, model: StagedModel, mode: str = 'graph', policy: str = 'all', keep_weights: bool = True
  ):
    self.model, self.graph_mode = model, mode == 'graph'
    self.policy = STASH_POLICIES[policy]
    self.keep_weights = keep_weights

  def run(self, params_s, x, stage_index, key, memory=None):
    """(the group's output, its new memory (None without one))."""
    rng = staged.piece_rng(key, stage_index)
    return self.model.run_stage(params_s, x, stage_index, rng, memory)

  def _vjp(self, params_s, x, stage_index, key, memory=None):
    run = lambda p, h: self.run(p, h, stage_index, key, memory)
    if self.policy is not None:
      run = jax.checkpoint(run, policy=self.policy)
    return jax.vjp(run, params_s, x, has_aux=True)  # (y, vjp_fn, new memory)

  def vjp_structure(self, params_s, x_like, stage_index, key):
    """(the tree structure of the graph-mode forward's VJP, for inputs shaped like x_like; which
    of its leaves are weights: the index of the weight leaf, or None)."""
    memory_like = self._memory_like(params_s, x_like)
    return vjp_layout(
      lambda h, m: self._vjp(params_s, h, stage_index, key, m)[1], params_s, x_like, memory_like
    )

  def _memory_like(self, params_s, x_like):
    """The shape of the memory a forward on x_like read (None for a model without one)."""
    if self.model.memory is None:
      return None
    return jax.eval_shape(lambda p: self.model.memory.init(p, x_like.shape[0]), params_s)

  def forward(self, params_s, x, stage_index, key, memory=None):
    """-> (the group's output, what to keep for its backward, its new memory (None without
    one)). Replay keeps the memory the forward read beside its input."""
    if not self.graph_mode:
      y, new_memory = self.run(params_s, x, stage_index, key, memory)
      return y, (x if memory is None else (x, memory)), new_memory
    y, vjp_fn, new_memory = self._vjp(params_s, x, stage_index, key, memory)
    leaves = jax.tree.leaves(vjp_fn)
    return y, leaves if self.keep_weights else without_weights(leaves, params_s), new_memory

  def backward(self, params_s, kept, delta, stage_index, key):
    """-> (gradient of the group's weights, gradient of its input) for output gradient delta."""
    if self.graph_mode:  # at forward-time weights, from the kept residuals
      treedef, positions = self.vjp_structure(params_s, delta, stage_index, key)
      if not self.keep_weights:
        kept = with_weights(kept, positions, params_s)
      vjp_fn = jax.tree.unflatten(treedef, kept)
    else:  # replay: re-run the forward at the given weights (and the memory it read)
      x, memory = kept if isinstance(kept, tuple) else (kept, None)
      run = lambda p, h: self.run(p, h, stage_index, key, memory)
      _, vjp_fn, _ = jax.vjp(run, params_s, x, has_aux=True)
    return vjp_fn(delta)


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


def send_forward(x, num_stages: int):
  """Send x from every stage s to s + 1 (G-1 wraps to 0): activations travel forward."""
  return jax.lax.ppermute(x, STAGE, [(s, (s + 1) % num_stages) for s in range(num_stages)])


def send_backward(x, num_stages: int):
  """Send x from every stage s to s - 1 (0 wraps to G-1): error gradients travel back."""
  return jax.lax.ppermute(x, STAGE, [(s, (s - 1) % num_stages) for s in range(num_stages)])


def embed(model: StagedModel, embed_params, tokens, key):
  """Module 1's first piece (computed on every device; only device 0's result travels)."""
  return model.embed(embed_params, tokens, staged.piece_rng(key, EMBED_PIECE))


def locked_forward(stash: Stash, params_s, x, key, num_stages: int, memory=None):
  """G rounds: in round r only device r runs its group on x (and keeps its stash); then every
  device passes x on to the next. Returns (the last group's output, now on device 0, kept, this
  device's new memory (None without one))."""
  s = jax.lax.axis_index(STAGE)
  forward = lambda x: stash.forward(params_s, x, s, key, memory)
  _, kept_shape, _ = jax.eval_shape(forward, x)
  empty = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), kept_shape)

  def forward_round(r, carry):
    x, kept, mem = carry
    y, kept, mem = jax.lax.cond(r == s, forward, lambda x: (x, kept, mem), x)
    return send_forward(y, num_stages), kept, mem

  return jax.lax.fori_loop(0, num_stages, forward_round, (x, empty, memory))


def pipelined_forward(stash: Stash, params_s, x, received, key, num_stages: int, memory=None):
  """Every group at once, each on what its predecessor sent during the previous step (device 0
  on the fresh embedding x); the outputs move one hop on. Returns (what device 0 received from
  group G-1 one step ago, for the head; kept; the new memory; the outputs sent on)."""
  s = jax.lax.axis_index(STAGE)
  y, kept, new_memory = stash.forward(params_s, jnp.where(s == 0, x, received), s, key, memory)
  return received, kept, new_memory, send_forward(y, num_stages)


def head_vjp(model: StagedModel, params, x, targets, weight: float = 1.0):
  """Module K's loss on x and, for cotangent `weight` (1/M for one of M micro-batches), its
  gradients: (loss, head gradient, the head's embed gradient, the gradient of x). The head of
  the ring (`head`) and of the table pipelines (pipeline.py)."""
  loss_of = lambda head_p, embed_p, h: model.loss(head_p, embed_p, h, targets)[0]
  loss, vjp_fn = jax.vjp(loss_of, params['head'], params['embed'], x)
  return (loss, *vjp_fn(jnp.full_like(loss, weight)))


def head(model: StagedModel, params, x, targets, weight: float = 1.0, when=True):
  """Module K on device 0: (loss, head gradient, the head's embed gradient, delta_{G-1}), all
  scaled by `weight` (1/M for one of M micro-batches); zeros on the other devices, and where
  `when` is false."""

  def loss_and_grads():
    loss, *grads = head_vjp(model, params, x, targets, weight)
    return (loss if weight == 1.0 else loss * weight, *grads)

  return on_stage(jnp.where(when, jax.lax.axis_index(STAGE), -1), 0, loss_and_grads)


def locked_backward(stash: Stash, params_s, kept, delta, key, num_stages: int):
  """The head's delta (on device 0) goes to device G-1; then rounds r = G-1 .. 0 in which only
  device r back-propagates and hands its input gradient to r - 1. Returns (this device's group
  gradient, and on device 0 the input gradient of group 0)."""
  s = jax.lax.axis_index(STAGE)
  g_shape, _ = jax.eval_shape(lambda: stash.backward(params_s, kept, delta, s, key))
  no_grad = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), g_shape)

  def backward_round(i, carry):
    send, g_stage = carry
    received = send_backward(send, num_stages)  # device r hears from r + 1 (G-1 from 0)
    g_stage, send = jax.lax.cond(
      s == num_stages - 1 - i,
      lambda: stash.backward(params_s, kept, received, s, key),
      lambda: (g_stage, send),
    )
    return send, g_stage

  dx, g_stage = jax.lax.fori_loop(0, num_stages, backward_round, (delta, no_grad))
  return g_stage, dx


def embed_grad(model: StagedModel, embed_params, tokens, key, dx):
  """The embedding's input-side gradient for the gradient dx of its output (`embed` with the
  same tokens and key). Of the ring (`embed_backward`) and of the table pipelines."""
  return jax.vjp(lambda e: embed(model, e, tokens, key), embed_params)[1](dx)[0]


def embed_backward(model: StagedModel, embed_params, tokens, key, dx):
  """Module 1 ends at the embedding: device 0 turns dx into V's input-side gradient."""
  backward = lambda: embed_grad(model, embed_params, tokens, key, dx)
  return on_stage(jax.lax.axis_index(STAGE), 0, backward)


def gather_grads(g_embed, g_head, g_stage, loss):
  """Each gradient from the device that owns it (embed and head live on device 0, group s on
  device s), then averaged over the data replicas; so is the loss. Returns (grads, loss)."""
  from_device0 = lambda tree: jax.lax.psum(tree, STAGE)
  grads = {
    'embed': from_device0(g_embed),
    'head': from_device0(g_head),
    'stages': jax.tree.map(lambda g: g[None], g_stage),
  }
  return jax.lax.pmean((grads, from_device0(loss)), DATA)


def local_memory(buffers):
  """This device's memory from ring buffers {'memory': [1, 1, ...]} (None when there is none)."""
  return jax.tree.map(lambda a: a[0, 0], buffers['memory']) if 'memory' in buffers else None


def with_memory(buffers, memory):
  """Ring buffers with this device's memory replaced (unchanged when memory is None)."""
  if memory is None:
    return buffers
  return {**buffers, 'memory': jax.tree.map(lambda a: a[None, None], memory)}


def locked_grads(model: StagedModel, params, batch, key, num_stages: int, memory=None):
  """Plain synchronous backprop over the ring: the exact gradient of `batch`, as (grads, loss,
  this device's new memory (None without one)).

  Locked forward, head on device 0, locked backward, embedding backward; in every round all
  devices but one wait. This is `model_parallel`'s step and Ouroboros' synchronous warm-up.
  """
  stash = Stash(model, 'graph')
  params_s = local_stage_params(params)
  x = embed(model, params['embed'], batch['inputs'], key)
  x, kept, memory = locked_forward(stash, params_s, x, key, num_stages, memory)
  loss, g_head, g_embed_out, delta = head(model, params, x, batch['targets'])
  g_stage, dx = locked_backward(stash, params_s, kept, delta, key, num_stages)
  g_embed_in = embed_backward(model, params['embed'], batch['inputs'], key, dx)
  grads, loss = gather_grads(jax.tree.map(jnp.add, g_embed_out, g_embed_in), g_head, g_stage, loss)
  return grads, loss, memory
