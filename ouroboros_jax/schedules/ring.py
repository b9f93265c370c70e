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

from ouroboros_jax import layer_shards, placement, staged
from ouroboros_jax.schedules.stash import GraphStash
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


def slots_by_microbatch(tree, num_microbatches: int):
  """Ring buffers of batches [depth, B, ...] seen as [depth, M, B/M, ...], slot by micro-batch."""
  return jax.tree.map(lambda a: a.reshape(a.shape[0], num_microbatches, -1, *a.shape[2:]), tree)


def whole_batch(tree):
  """`microbatches` undone: leaves [M, B/M, ...] -> [B, ...]."""
  return jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), tree)


# Activations and their gradients are pytrees (staged.py): indexed, written and selected leaf by
# leaf.
def at(tree, i):
  """Entry i of every leaf ([n, ...] -> [...])."""
  return jax.tree.map(lambda a: a[i], tree)


def set_at(tree, i, values):
  """Every leaf with entry i replaced by the matching leaf of `values`."""
  return jax.tree.map(lambda a, v: a.at[i].set(v), tree, values)


def select(pred, on_true, on_false):
  """on_true where pred, else on_false, leaf by leaf."""
  return jax.tree.map(lambda a, b: jnp.where(pred, a, b), on_true, on_false)


def set_where(buffers, slot, values, when):
  """Buffers [slots, ...] with `values` in `slot` where `when` and unchanged elsewhere: a select,
  not a cond, so that XLA updates the buffers in place under jit."""
  old = jax.tree.map(lambda buf: buf[slot], buffers)
  values = jax.tree.map(lambda new, o: jnp.where(when, new, o), values, old)
  return jax.tree.map(lambda buf, v: buf.at[slot].set(v), buffers, values)


def microbatch_key(key, m, num_microbatches: int):
  """Micro-batch m's dropout key: the batch's own key when the batch is not cut (as the exact
  pipelines do), so one micro-batch is the un-chunked step bit for bit."""
  return key if num_microbatches == 1 else jax.random.fold_in(key, m)


def read_items(buffers, first, depth: int, aligned: bool):
  """The M consecutive items first .. first + M - 1 from ring buffers [depth, M, ...] that hold
  item u in slot (u // M % depth, u % M): leaves [M, ...], in device memory wherever the buffers
  live. `aligned` (first a multiple of M): one slot; otherwise they span two. Slots are read
  whole, as a host-memory buffer can only be sliced by a scalar index."""

  def read(buf):
    num_micro, block = buf.shape[1], first // buf.shape[1]
    if aligned:
      return placement.to_device(buf[block % depth])
    two = [placement.to_device(buf[(block + i) % depth]) for i in (0, 1)]
    return jax.lax.dynamic_slice_in_dim(jnp.concatenate(two), first % num_micro, num_micro)

  return jax.tree.map(read, buffers)


def read_slot(buffers, batch_index, depth: int):
  """The entries of batch `batch_index` in ring buffers of `depth` slots (slot = index % depth),
  in device memory wherever the buffers live."""
  return placement.to_device(jax.tree.map(lambda buf: buf[batch_index % depth], buffers))


def write_slot(buffers, values, batch_index, depth: int):
  """Ring buffers with batch `batch_index`'s slot overwritten by `values` (in place under jit
  when nothing reads the old buffer afterwards)."""
  values = jax.tree.map(lambda buf, v: v.astype(buf.dtype), buffers, values)  # on the device
  values = placement.into_space_of(values, buffers)
  return jax.tree.map(lambda buf, v: buf.at[batch_index % depth].set(v), buffers, values)


def write_slot_where(buffers, values, index, depth: int, when):
  """`write_slot` where `when`, the buffers unchanged elsewhere: a select, not a cond, so that
  XLA updates the buffers in place under jit."""
  values = select(when, values, read_slot(buffers, index, depth))
  return write_slot(buffers, values, index, depth)


def local_stage_params(params):
  """This device's layer group: the stage parameters without their leading axis of size 1."""
  return jax.tree.map(lambda a: a[0], params['stages'])


def send_forward(x, num_stages: int):
  """Send x from every stage s to s + 1 (G-1 wraps to 0): activations travel forward."""
  return jax.lax.ppermute(x, STAGE, [(s, (s + 1) % num_stages) for s in range(num_stages)])


def send_backward(x, num_stages: int):
  """Send x from every stage s to s - 1 (0 wraps to G-1): error gradients travel back."""
  return jax.lax.ppermute(x, STAGE, [(s, (s - 1) % num_stages) for s in range(num_stages)])


def embed(model: StagedModel, embed_params, tokens, key):
  """Module 1's first piece (computed on every device; only device 0's result travels)."""
  return model.embed(embed_params, tokens, staged.piece_rng(key, EMBED_PIECE))


def locked_forward(forward, x, num_stages: int, memory=None):
  """G rounds: in round r only device r runs its group on x (`forward(x) -> (y, kept, new
  memory)`, a stash's forward) and keeps its stash; then every device passes x on to the next.
  Returns (the last group's output, now on device 0, kept, this device's new memory (None
  without one))."""
  s = jax.lax.axis_index(STAGE)
  _, kept_shape, _ = jax.eval_shape(forward, x)
  empty = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), kept_shape)

  def forward_round(r, carry):
    x, kept, mem = carry
    y, kept, mem = jax.lax.cond(r == s, forward, lambda x: (x, kept, mem), x)
    return send_forward(y, num_stages), kept, mem

  return jax.lax.fori_loop(0, num_stages, forward_round, (x, empty, memory))


def head_vjp(model: StagedModel, params, x, targets, share=1.0):
  """Module K's loss on x and, for cotangent `share` (the micro-batch's share of the step's
  loss, `loss_shares`), its gradients: (loss, head gradient, the head's embed gradient, the
  gradient of x). The head of the ring (`head`) and of the table pipelines (pipeline.py)."""
  loss_of = lambda head_p, embed_p, h: model.loss(head_p, embed_p, h, targets)[0]
  loss, vjp_fn = jax.vjp(loss_of, params['head'], params['embed'], x)
  return (loss, *staged.pull(vjp_fn, jnp.full_like(loss, share), None, None, x))


def head(model: StagedModel, params, x, targets, share=1.0, when=True):
  """Module K on device 0: (loss, head gradient, the head's embed gradient, delta_{G-1}), all
  scaled by `share` (the micro-batch's share of the step's loss, `loss_shares`); zeros on the
  other devices, and where `when` is false."""

  def loss_and_grads():
    loss, *grads = head_vjp(model, params, x, targets, share)
    return (loss * share, *grads)

  return on_stage(jnp.where(when, jax.lax.axis_index(STAGE), -1), 0, loss_and_grads)


def loss_shares(model: StagedModel, targets_M):
  """[M] float32: each micro-batch's share of the loss of the batch its targets_M ([M, b, ...])
  cut from, times the data replicas R, so that the mean over replicas of the share-weighted
  sums is the loss the model states for the whole batch. Without a `loss_weight` every
  micro-batch weighs the same (1/M). With one, micro-batch m's loss is the mean over its weight
  w_m (its valid tokens), and its share is R w_m / (the sum of w over every replica's
  micro-batches): the gradient is that of the whole batch's weighted mean, however unevenly the
  weight falls. A batch of weight 0 has shares 0 (no NaN)."""
  num_micro = jax.tree.leaves(targets_M)[0].shape[0]
  if model.loss_weight is None:
    return jnp.full((num_micro,), 1.0 / num_micro, jnp.float32)
  weight_M = micro_weights(model, targets_M)
  return shares_of(weight_M, weight_M.sum())


def micro_weights(model: StagedModel, targets_M):
  """[M] float32: the `loss_weight` of each micro-batch of targets_M ([M, b, ...])."""
  return jax.vmap(model.loss_weight)(targets_M).astype(jnp.float32)


def shares_of(weight_M, local_total):
  """R w_m / (the batch's weight over every data replica); 0 for a batch of weight 0."""
  total = jax.lax.psum(local_total, DATA)
  replicas = jax.lax.axis_size(DATA)
  return jnp.where(total > 0, replicas * weight_M / jnp.where(total > 0, total, 1.0), 0.0)


def locked_backward(backward, delta, num_stages: int):
  """The head's delta (on device 0) goes to device G-1; then rounds r = G-1 .. 0 in which only
  device r back-propagates (`backward(delta) -> (group gradient, input gradient)`, a stash's
  backward) and hands its input gradient to r - 1. Returns (this device's group gradient, and on
  device 0 the input gradient of group 0)."""
  s = jax.lax.axis_index(STAGE)
  g_shape, _ = jax.eval_shape(backward, delta)
  no_grad = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), g_shape)

  def backward_round(i, carry):
    send, g_stage = carry
    received = send_backward(send, num_stages)  # device r hears from r + 1 (G-1 from 0)
    g_stage, send = jax.lax.cond(
      s == num_stages - 1 - i, lambda: backward(received), lambda: (g_stage, send)
    )
    return send, g_stage

  dx, g_stage = jax.lax.fori_loop(0, num_stages, backward_round, (delta, no_grad))
  return g_stage, dx


def embed_grad(model: StagedModel, embed_params, tokens, key, dx):
  """The embedding's input-side gradient for the gradient dx of its output (`embed` with the
  same tokens and key). Of the ring (`embed_backward`) and of the table pipelines."""
  return staged.pull(jax.vjp(lambda e: embed(model, e, tokens, key), embed_params)[1], dx, None)[0]


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
  return layer_shards.replica_mean(grads, from_device0(loss))


def local_memory(buffers):
  """This device's memory from ring buffers {'memory': [1, 1, ...]} (None when there is none)."""
  return jax.tree.map(lambda a: a[0, 0], buffers['memory']) if 'memory' in buffers else None


def with_memory(buffers, memory):
  """Ring buffers with this device's memory replaced (unchanged when memory is None)."""
  if memory is None:
    return buffers
  return {**buffers, 'memory': jax.tree.map(lambda a: a[None, None], memory)}


def locked_grads(
  model: StagedModel, params, batch, key, batch_index, memory=None, policy: str = 'all', share=1.0
):
  """Plain synchronous backprop over the ring: the exact gradient of `batch` (batch
  `batch_index`, dropout key `key`) times its `share` of the step's loss (`loss_shares`), as
  (grads, loss, this device's new memory (None without one)).

  Locked forward, head on device 0, locked backward, embedding backward; in every round all
  devices but one wait. This is `model_parallel`'s step and Ouroboros' synchronous warm-up.
  `policy` (staging.STASH_POLICIES) is what each group keeps of its forward for its backward: by
  default the whole VJP, as backprop keeps it; the rest is recomputed, per group.
  """
  stash = GraphStash(model, policy, keep_weights=False)  # the weights stay put all step
  s, num_stages = jax.lax.axis_index(STAGE), jax.lax.axis_size(STAGE)
  params_s = local_stage_params(params)
  x = embed(model, params['embed'], batch['inputs'], key)
  forward = lambda x: stash.forward(params_s, x, s, key, memory, batch_index)
  x, kept, memory = locked_forward(forward, x, num_stages, memory)
  loss, g_head, g_embed_out, delta = head(model, params, x, batch['targets'], share)
  backward = lambda delta: stash.backward(params_s, kept, delta, s, key, batch_index)
  g_stage, dx = locked_backward(backward, delta, num_stages)
  g_embed_in = embed_backward(model, params['embed'], batch['inputs'], key, dx)
  grads, loss = gather_grads(jax.tree.map(jnp.add, g_embed_out, g_embed_in), g_head, g_stage, loss)
  return grads, loss, memory
