"""One executor for every exact pipeline that is written as a table (`tables.py`).

    config = ScheduleConfig(name='zb_h1', num_stages=4, microbatches=8)
    schedule = build_schedule(config, model, tx)      # -> build_pipeline
    state, metrics = schedule.step(state, batch)      # backprop's gradient of the mean loss

`tables.program` turns a schedule's table into integer arrays [device, tick]. Inside one
`jax.shard_map` over (stage, data) every device scans over the ticks; at each tick it

  1. runs its operation with `lax.switch` (idle, F, B or W) on micro-batch `microbatch` of its
     chunk `chunk` (virtual stage k):
       F  embeds the micro-batch (k = 0) or takes the activation in its inbox, runs the chunk,
          keeps the VJP's residuals in a stash slot; on the last stage it also runs the head
          and keeps the loss's gradient for its own B;
       B  the input gradient from the stashed residuals and the output gradient in its inbox
          (k = 0: on into the embedding's gradient);
       W  the chunk's weight gradient from the same residuals, added to its gradient;
  2. moves the value its operation sends (F's output, B's input gradient) one hop: one
     `ppermute` per channel the program uses (device d to d + o), and the receiver keeps it in
     the inbox slot the program names.

Stash and inbox slots are reused as soon as their value is read for the last time, so the
memory a schedule holds is the table's (1F1B keeps p micro-batches where GPipe keeps m; XLA's
memory analysis orders them so, tests/test_pipeline.py). The gradient is exact: every (micro-batch,
stage) runs F, B and W once, and the loss is the mean of the micro-batch losses, so the step
gives backprop's parameters (tested for G in {2, 4}, M in {G, 2G}). A fused schedule (GPipe,
1F1B, interleaved) and a split one (ZB-H1, ZB-V) differ only in their tables.

Placement. Device d holds the chunks `pipeline.stage_of(d, c)`: stage d for one chunk per device,
stages d, p + d, ... interleaved, stages d and 2p - 1 - d in ZB-V's V. The parameters keep the
model's stage order; a step with v > 1 chunks gathers each device's chunks to it (and the
gradients back), a resharding of the stage parameters per step that a production run would
avoid by storing them in device order. The embedding runs on the device of stage 0, the head on
the device of the last stage (device 0 in ZB-V, as in the Ouroboros ring); both are replicated,
and their gradients are summed over `stage`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ouroboros_jax import staged
from ouroboros_jax.schedules import ring, tables
from ouroboros_jax.schedules.config import ScheduleConfig
from ouroboros_jax.schedules.synchronous import replica_key, synchronous_schedule
from ouroboros_jax.staged import DATA, STAGE, PyTree, Schedule, StagedModel, WeightSplit


class _Carry(NamedTuple):
  """What a device carries from tick to tick."""

  stash: PyTree  # leaves [stash slots, ...]: residuals of the chunks' forwards
  activations: jax.Array  # [activation slots, b, L, D]: inputs received for an F
  gradients: jax.Array  # [gradient slots, b, L, D]: output gradients received for a B and W
  tap_grads: PyTree  # leaves [stash slots, ...]: a split backward's output gradients, B to W
  grad_chunks: PyTree  # leaves [v, ...]: this device's chunk gradients
  grad_embed: PyTree
  grad_head: PyTree
  loss: jax.Array  # mean over micro-batches of the micro-batch losses (on the head's device)
  memory: PyTree  # leaves [v, m, b, ...]: each chunk's memory of each micro-batch's rows, or None


def pipeline_table(config: ScheduleConfig) -> tables.Table:
  """The checked table of `config`'s schedule (one-line ConfigErrors for settings it cannot
  take)."""
  pipeline = tables.build(config.name, config.num_stages, config.num_microbatches, config.chunks)
  table = tables.place(pipeline)
  tables.check(table)
  return table


def idle_fraction(table: tables.Table) -> float:
  """Idle device-ticks over all device-ticks (F = B = W = one tick)."""
  bubble = tables.bubble(table)
  return bubble / (1 + bubble)


def build_pipeline(config: ScheduleConfig, model: StagedModel, tx, *, devices=None) -> Schedule:
  """The schedule of `config.name` (any of `tables.PIPELINES`) run from its table."""
  table = pipeline_table(config)
  pipeline, program = table.pipeline, tables.program(table)
  p, m, replicas = pipeline.num_stages, pipeline.microbatches, config.data_parallel
  mesh = staged.make_mesh(p, replicas, devices)
  stage_order = [pipeline.stage_of(d, c) for d in range(p) for c in range(pipeline.chunks)]
  fields_PxT = {name: np.asarray(rows, np.int32) for name, rows in program.fields.items()}
  tapped = not pipeline.fused and model.weight_split is not None
  # The weights stay put all step, so no stash keeps them.
  stash = TappedStash(model.weight_split) if tapped else ring.Stash(model, keep_weights=False)
  last = pipeline.last_stage

  def device_grads(params, batch, t, buffers):
    s = jax.lax.axis_index(STAGE)
    key = replica_key(config.seed, t, replicas)
    micro_key = lambda i: key if m == 1 else jax.random.fold_in(key, i)
    split = lambda a: a.reshape(m, a.shape[0] // m, *a.shape[1:])
    inputs_M, targets_M = split(batch['inputs']), split(batch['targets'])
    embed_p, head_p, chunks = params['embed'], params['head'], params['stages']
    chunk_params = lambda c: jax.tree.map(lambda a: a[c], chunks)
    embed_of = lambda e, i: ring.embed(model, e, inputs_M[i], micro_key(i))
    x_like = jax.eval_shape(embed_of, embed_p, 0)
    zeros_x = jnp.zeros(x_like.shape, x_like.dtype)
    zeros = lambda tree: jax.tree.map(jnp.zeros_like, tree)

    def forward(carry: _Carry, op):
      i, k = op['microbatch'], op['stage']
      x = jax.lax.cond(
        k == 0, lambda: embed_of(embed_p, i), lambda: carry.activations[op['inbox_slot']]
      )
      c = op['chunk']
      memory = jax.tree.map(lambda a: a[c, i], carry.memory)  # None without a memory
      y, kept, memory = stash.forward(chunk_params(c), x, k, micro_key(i), memory)
      new_memory = jax.tree.map(lambda a, new: a.at[c, i].set(new), carry.memory, memory)

      def head():  # the loss of micro-batch i, as 1/m of the step's
        loss_of = lambda h, e, y: model.loss(h, e, y, targets_M[i])[0]
        loss, vjp_fn = jax.vjp(loss_of, head_p, embed_p, y)
        return (loss / m, *vjp_fn(jnp.full_like(loss, 1 / m)))

      no_head = lambda: (jnp.zeros(()), zeros(head_p), zeros(embed_p), y)
      loss, g_head, g_embed, sent = jax.lax.cond(k == last, head, no_head)
      carry = carry._replace(
        stash=ring.write_slot(carry.stash, kept, op['stash_slot'], program.stash_slots),
        grad_head=_add(carry.grad_head, g_head),
        grad_embed=_add(carry.grad_embed, g_embed),
        loss=carry.loss + loss,
        memory=new_memory,
      )
      return carry, sent  # the activation to the next stage, or the head's gradient to our B

    def kept_and_delta(carry: _Carry, op):
      kept = ring.read_slot(carry.stash, op['stash_slot'], program.stash_slots)
      return kept, carry.gradients[op['inbox_slot']]

    def backward(carry: _Carry, op):  # the whole VJP: (weight gradient, input gradient)
      kept, delta = kept_and_delta(carry, op)
      params_c, key = chunk_params(op['chunk']), micro_key(op['microbatch'])
      return stash.backward(params_c, kept, delta, op['stage'], key)

    def add_chunk_grad(carry: _Carry, op, g_chunk) -> _Carry:
      add_at = lambda g, w: g.at[op['chunk']].add(w)
      return carry._replace(grad_chunks=jax.tree.map(add_at, carry.grad_chunks, g_chunk))

    def input_grad(carry: _Carry, op):
      """B. A fused schedule takes the whole VJP here, as one backward (its W is empty). A split
      one (ZB) takes the input gradient: through the model's taps when it has a `WeightSplit`
      (keeping the taps' gradients for W), else as the input half of the VJP (XLA removes the
      weight half)."""
      if tapped:
        kept, delta = kept_and_delta(carry, op)
        params_c, key = chunk_params(op['chunk']), micro_key(op['microbatch'])
        dx, tap_grads = stash.input_grad(params_c, kept, delta, op['stage'], key)
        slot = op['stash_slot']
        carry = carry._replace(
          tap_grads=ring.write_slot(carry.tap_grads, tap_grads, slot, program.stash_slots)
        )
      else:
        g_chunk, dx = backward(carry, op)
        carry = add_chunk_grad(carry, op, g_chunk) if pipeline.fused else carry
      embed_grad = lambda: jax.vjp(lambda e: embed_of(e, op['microbatch']), embed_p)[1](dx)[0]
      g_embed = jax.lax.cond(op['stage'] == 0, embed_grad, lambda: zeros(embed_p))
      return carry._replace(grad_embed=_add(carry.grad_embed, g_embed)), dx

    def weight_grad(carry: _Carry, op):
      """W of a split schedule: from the taps' gradients (matrix products only), else as the
      weight half of the VJP (which recomputes the input-gradient chain)."""
      if tapped:
        kept = ring.read_slot(carry.stash, op['stash_slot'], program.stash_slots)
        tap_grads = ring.read_slot(carry.tap_grads, op['stash_slot'], program.stash_slots)
        g_chunk = stash.weight_grad(chunk_params(op['chunk']), kept, tap_grads)
      else:
        g_chunk, _ = backward(carry, op)
      return add_chunk_grad(carry, op, g_chunk), zeros_x

    idle = lambda carry, op: (carry, zeros_x)

    def tick(carry: _Carry, op):
      operations = (idle, forward, input_grad, idle if pipeline.fused else weight_grad)
      carry, sent = jax.lax.switch(op['kind'], operations, carry, op)
      activations, gradients = carry.activations, carry.gradients
      for o in program.channels:  # what device s - o sent this tick
        got = (
          sent if o == 0 else jax.lax.ppermute(sent, STAGE, [(d, (d + o) % p) for d in range(p)])
        )
        store, slot = op[f'store_{o}'], op[f'slot_{o}']
        activations = _keep(activations, slot, got, store == tables.ACTIVATIONS)
        gradients = _keep(gradients, slot, got, store == tables.GRADIENTS)
      return carry._replace(activations=activations, gradients=gradients), None

    slots = lambda like: jax.tree.map(
      lambda a: jnp.zeros((program.stash_slots, *a.shape), a.dtype), like
    )
    # A memory (leaves [v, 1, B/R, ...] here: this device's chunks) cut into micro-batch rows.
    memory = buffers.get('memory')
    memory = jax.tree.map(lambda a: a[:, 0].reshape(a.shape[0], m, -1, *a.shape[3:]), memory)
    first_memory = jax.tree.map(lambda a: a[0, 0], memory)
    _, kept_like, _ = jax.eval_shape(
      lambda: stash.forward(chunk_params(0), zeros_x, 0, micro_key(0), first_memory)
    )
    start = _Carry(
      stash=slots(kept_like),
      tap_grads=slots(model.weight_split.taps(chunk_params(0), zeros_x)) if tapped else {},
      activations=jnp.zeros((program.activation_slots, *x_like.shape), x_like.dtype),
      gradients=jnp.zeros((program.gradient_slots, *x_like.shape), x_like.dtype),
      grad_chunks=zeros(chunks),
      grad_embed=zeros(embed_p),
      grad_head=zeros(head_p),
      loss=jnp.zeros(()),
      memory=memory,
    )
    ops_T = {name: jnp.asarray(rows)[s] for name, rows in fields_PxT.items()}
    end, _ = jax.lax.scan(tick, start, ops_T)
    from_owner = lambda tree: jax.lax.psum(tree, STAGE)
    grads = {
      'embed': from_owner(end.grad_embed),
      'head': from_owner(end.grad_head),
      'stages': end.grad_chunks,
    }
    if end.memory is not None:
      rows = lambda a: a.reshape(a.shape[0], 1, -1, *a.shape[3:])
      buffers = {**buffers, 'memory': jax.tree.map(rows, end.memory)}
    return (*jax.lax.pmean((grads, from_owner(end.loss)), DATA), buffers)

  return synchronous_schedule(
    config, model, tx, mesh, device_grads, idle_fraction(table), stage_order=stage_order
  )


class TappedStash:
  """F, B and W of a stage through its model's `staged.WeightSplit` (the zero-bubble split
  without a second chain): F keeps the VJP in (input, taps), less the weights (they do not change
  within a step), and the recorded sub-layer inputs; B gives the input gradient and the taps'
  gradients; W multiplies those with the recorded inputs into the weight gradient."""

  def __init__(self, split: WeightSplit):
    self.split = split

  def _vjp(self, params_s, x, stage_index, key):
    rng = staged.piece_rng(key, stage_index)
    run = lambda h, taps: self.split.stage(params_s, h, stage_index, rng, taps)
    return jax.vjp(run, x, self.split.taps(params_s, x), has_aux=True)

  def forward(self, params_s, x, stage_index, key, memory=None):
    """-> (the stage's output, what B and W need of it, None), as `ring.Stash` (the models with
    a weight split have no memory)."""
    del memory
    y, vjp_fn, inputs = self._vjp(params_s, x, stage_index, key)
    kept = {'vjp': ring.without_weights(jax.tree.leaves(vjp_fn), params_s), 'inputs': inputs}
    return y, kept, None

  def input_grad(self, params_s, kept, delta, stage_index, key):
    """-> (the input gradient, the taps' gradients) for output gradient delta."""
    vjp_of = lambda h: self._vjp(params_s, h, stage_index, key)[1]
    treedef, positions = ring.vjp_layout(vjp_of, params_s, delta)
    vjp_fn = jax.tree.unflatten(treedef, ring.with_weights(kept['vjp'], positions, params_s))
    return vjp_fn(delta)

  def weight_grad(self, params_s, kept, tap_grads):
    return self.split.weight_grad(params_s, kept['inputs'], tap_grads)


def _add(a: PyTree, b: PyTree) -> PyTree:
  return jax.tree.map(jnp.add, a, b)


def _keep(buffer: jax.Array, slot, value: jax.Array, where) -> jax.Array:
  """buffer with `value` in `slot` where `where`, unchanged otherwise (in place under jit)."""
  return buffer.at[slot].set(jnp.where(where, value, buffer[slot]))
