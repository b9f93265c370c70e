"""What one device of Ouroboros' ring keeps per micro-batch in flight: the shapes its buffers are
made of, traced as the step traces the model (`ouroboros._init` allocates them)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from ouroboros_jax import layer_shards, placement, staged
from ouroboros_jax.schedules import stash as stash_lib


def device_shapes(ring, fn, *args):
  """`jax.eval_shape(fn, *args)` as one device runs fn inside the step's shard_map (the ring's
  axes manual), so the model is traced here as the step traces it (its own sharding annotations
  meet the same mesh: placement.sharding_error)."""
  on_device = jax.shard_map(fn, mesh=ring.mesh, in_specs=P(), out_specs=P(), check_vma=False)
  return jax.eval_shape(on_device, *args)


class ItemShapes(NamedTuple):
  """The shapes one device's ring buffers are made of."""

  local: Any  # a data replica's batch
  x_micro: Any  # one micro-batch's activation
  kept: Any  # what the stash keeps of one micro-batch
  weights_s: Any  # graph: the forward's weights as the ring keeps them; None: replay


def item_shapes(ring, params, example_batch) -> ItemShapes:
  """What one device keeps per micro-batch in flight, traced as the step traces it (with
  --fsdp, from its shards of the stage, each layer gathered as it runs)."""
  with placement.step_gathering(params, ring.config):
    return _item_shapes(ring, params, example_batch, layer_shards.active())


def _item_shapes(ring, params, example_batch, gathering) -> ItemShapes:
  replicas, num_micro = ring.config.data_parallel, ring.num_microbatches
  divided = lambda tree, n: jax.tree.map(
    lambda a: jax.ShapeDtypeStruct((a.shape[0] // n, *a.shape[1:]), a.dtype), tree
  )
  local = divided(example_batch, replicas)
  micro = divided(local, num_micro)
  params_s = jax.tree.map(
    lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype),
    layer_shards.local_shapes(params['stages'], gathering),
  )
  x_micro = device_shapes(ring, ring.model.embed, params['embed'], micro['inputs'], None)
  memory = jax.eval_shape(
    lambda: placement.empty_memory(ring.model, params, example_batch, replicas)
  )
  memory_micro = jax.tree.map(  # one micro-batch's rows of one device's memory, for the shapes
    lambda a: jax.ShapeDtypeStruct((a.shape[2] // num_micro, *a.shape[3:]), a.dtype),
    memory.get('memory'),
  )
  # Stage index and key traced, as in the step: what a graph stash keeps can depend on it.
  index, key = jnp.int32(0), jax.random.key(0)
  forward = ring.stash.forward
  _, kept, _ = device_shapes(ring, forward, params_s, x_micro, index, key, memory_micro, index)
  weights_s = None
  if ring.stash.at_forward_weights:  # the weights each item in flight was forwarded with
    weights_s = kept_weights(ring, params_s, x_micro, memory_micro)
  return ItemShapes(local, x_micro, kept, weights_s)


def kept_weights(ring, params_s, x_micro, memory_micro):
  """The shapes of the forward's weights as the ring keeps them: each leaf the group's forward
  only reads as a narrower cast (a bf16 forward's kernels) is kept as that cast, which the
  backward widens again without loss (`stash.read_dtypes`); the others as they are."""

  def stage_forward(p, x, stage_index, key, memory, batch_index):
    rng = staged.piece_rng(key, stage_index)
    return ring.model.run_stage(p, x, stage_index, rng, memory, batch_index)

  on_device = jax.shard_map(
    stage_forward, mesh=ring.mesh, in_specs=P(), out_specs=P(), check_vma=False
  )
  narrow = stash_lib.read_dtypes(
    on_device, params_s, x_micro, jnp.int32(0), jax.random.key(0), memory_micro, jnp.int32(0)
  )
  leaves, treedef = jax.tree.flatten(params_s)
  return jax.tree.unflatten(
    treedef, [jax.ShapeDtypeStruct(a.shape, d or a.dtype) for a, d in zip(leaves, narrow)]
  )
