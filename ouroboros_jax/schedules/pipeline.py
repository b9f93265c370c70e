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

The code reads the same: `_device_grads` scans `_tick` over the device's row of the program;
`_tick` runs `_idle`, `_forward`, `_input_grad` (B) or `_weight_grad` (W), then `_send`. They all
read one `_Executor` (the schedule's settings and what they imply) and one `_Step` (the step's
micro-batches, parameters and key on this device).

Stash and inbox slots are reused as soon as their value is read for the last time, so the
memory a schedule holds is the table's (1F1B keeps p micro-batches where GPipe keeps m; XLA's
memory analysis orders them so, tests/test_pipeline.py). The gradient is exact: every (micro-batch,
stage) runs F, B and W once, and the loss is the micro-batch losses weighted by their shares
of the batch's (`ring.loss_shares`: 1/m each, or by a `loss_weight` such as valid tokens), so
the step gives backprop's parameters (tested for G in {2, 4}, M in {G, 2G}). A fused schedule
(GPipe, 1F1B, interleaved) and a split one (ZB-H1, ZB-V) differ only in their tables.

Placement. Device d holds the chunks `pipeline.stage_of(d, c)`: stage d for one chunk per device,
stages d, p + d, ... interleaved, stages d and 2p - 1 - d in ZB-V's V. The parameters keep the
model's stage order; a step with v > 1 chunks gathers each device's chunks to it (and the
gradients back), a resharding of the stage parameters per step that a production run would
avoid by storing them in device order. The embedding runs on the device of stage 0, the head on
the device of the last stage (device 0 in ZB-V, as in the Ouroboros ring); both are replicated,
and their gradients are summed over `stage`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ouroboros_jax import layer_shards, placement
from ouroboros_jax.schedules import ring, tables
from ouroboros_jax.schedules.config import ResolvedSchedule, require_resolved
from ouroboros_jax.schedules.stash import GraphStash, TappedStash
from ouroboros_jax.schedules.synchronous import DeviceGrads, replica_key, synchronous_schedule
from ouroboros_jax.staged import STAGE, PyTree, Schedule, StagedModel


class _Carry(NamedTuple):
  """What a device carries from tick to tick."""

  stash: PyTree  # leaves [stash slots, ...]: residuals of the chunks' forwards
  activations: jax.Array  # [activation slots, b, L, D]: inputs received for an F
  gradients: jax.Array  # [gradient slots, b, L, D]: output gradients received for a B and W
  for_w: PyTree  # leaves [stash slots, ...]: what a split backward's B hands its W
  # (TappedStash.input_grad: the taps' gradients, and the recorded inputs if B recomputed)
  grad_chunks: PyTree  # leaves [v, ...]: this device's chunk gradients
  grad_embed: PyTree
  grad_head: PyTree
  loss: jax.Array  # the micro-batch losses, each times its share (on the head's device)
  memory: PyTree  # leaves [v, m, b, ...]: each chunk's memory of each micro-batch's rows, or None


def pipeline_table(config: ResolvedSchedule) -> tables.Table:
  """The checked table of `config`'s schedule (one-line ConfigErrors for settings it cannot
  take)."""
  pipeline = tables.build(config.name, config.num_stages, config.microbatches, config.chunks)
  table = tables.place(pipeline)
  tables.check(table)
  return table


def idle_fraction(table: tables.Table) -> float:
  """Idle device-ticks over all device-ticks (F = B = W = one tick)."""
  bubble = tables.bubble(table)
  return bubble / (1 + bubble)


def gpipe_idle_fraction(num_stages: int, microbatches: int) -> float:
  """GPipe's idle fraction, (G-1)/(M+G-1): M + G - 1 forward ticks, device s busy in M of them
  (micro-batch i - s at tick i); the backward mirrors them. `idle_fraction` of its table."""
  return (num_stages - 1) / (microbatches + num_stages - 1)


def build_gpipe(
  config: ResolvedSchedule, model: StagedModel, tx, *, devices=None, bubble_fill: float = 0.0
) -> Schedule:
  """GPipe (Huang et al. 2019) run from its table: every forward, then every backward; idle
  (G-1)/(M+G-1) (`gpipe_idle_fraction`); every stage holds its M micro-batches' residuals until
  their backward. `build_schedule` runs the same for `config.name == 'gpipe'`."""
  config = dataclasses.replace(config, name='gpipe')
  return build_pipeline(config, model, tx, devices=devices, bubble_fill=bubble_fill)


def build_pipeline(
  config: ResolvedSchedule, model: StagedModel, tx, *, devices=None, bubble_fill: float = 0.0
) -> Schedule:
  """The schedule of `config.name` (any of `tables.PIPELINES`) run from its table.

  `bubble_fill` is what an idle tick sends and an empty inbox slot holds: no operation ever
  reads it (the tests pass NaN and get the same numbers)."""
  table = pipeline_table(require_resolved(config, 'build_pipeline'))
  pipeline = table.pipeline
  tapped = not pipeline.fused and model.weight_split is not None
  executor = _Executor(
    model=model,
    pipeline=pipeline,
    program=tables.program(table),
    # The weights stay put all step, so no stash keeps them. The policy chooses which residuals
    # of a chunk's forward wait for its backward ('all' by default; 'nothing': the chunk's input).
    stash=(
      TappedStash(model.weight_split, recompute=config.stash_policy != 'all')
      if tapped
      else GraphStash(model, config.stash_policy, keep_weights=False)
    ),
    seed=config.seed,
    replicas=config.data_parallel,
    bubble_fill=bubble_fill,
  )
  mesh = placement.make_mesh(pipeline.num_stages, config.data_parallel, devices)
  device_grads = functools.partial(_device_grads, executor)
  grads = DeviceGrads(device_grads, idle_fraction(table), executor.stage_order)
  return synchronous_schedule(config, model, tx, mesh, grads)


@dataclasses.dataclass(frozen=True)
class _Executor:
  """What every tick of one pipeline schedule reads: the settings, and what they imply."""

  model: StagedModel
  pipeline: tables.Pipeline
  program: tables.Program  # the table as integer arrays [device, tick]
  stash: Any  # GraphStash, or TappedStash for a split schedule of a model with a WeightSplit
  seed: int
  replicas: int  # data replicas
  bubble_fill: float  # what an idle tick sends and an empty inbox slot holds (never read)

  @property
  def num_stages(self) -> int:
    return self.pipeline.num_stages

  @property
  def microbatches(self) -> int:
    return self.pipeline.microbatches

  @property
  def tapped(self) -> bool:
    """A split schedule's B and W through the model's taps (else: two halves of one VJP)."""
    return isinstance(self.stash, TappedStash)

  @property
  def stage_order(self) -> list[int]:
    """The virtual stages in the order the devices hold them (v consecutive per device)."""
    p, v = self.num_stages, self.pipeline.chunks
    return [self.pipeline.stage_of(d, c) for d in range(p) for c in range(v)]

  def operations_T(self, device) -> dict[str, jax.Array]:
    """This device's row of the program: per field, [ticks] (what lax.scan runs over)."""
    return {
      name: jnp.asarray(np.asarray(rows, np.int32))[device]
      for name, rows in self.program.fields.items()
    }


class _Step(NamedTuple):
  """One step's values on one device, which its operations read."""

  params: PyTree  # embed, head and this device's chunks (leaves [v, ...])
  inputs: jax.Array  # [m, b, ...]: the micro-batches
  targets: jax.Array  # [m, b, ...]
  shares: jax.Array  # [m]: each micro-batch's share of the step's loss (ring.loss_shares)
  key: jax.Array  # the batch's dropout key on this data replica
  index: jax.Array  # the batch's index t (for a model that takes it)
  nothing: PyTree  # shaped as an activation: what a tick sends when it sends nothing

  def key_of(self, i):
    return ring.microbatch_key(self.key, i, self.shares.shape[0])

  def chunk(self, c) -> PyTree:
    return jax.tree.map(lambda a: a[c], self.params['stages'])


# -- one step on one device: scan over the ticks of its row of the program ------------------------


def _device_grads(executor: _Executor, params, batch, t, buffers):
  """(grads, loss, buffers) of batch t on this device (see `synchronous_schedule`): the ticks,
  then the embedding's and head's gradients from their devices, averaged over data replicas."""
  m = executor.microbatches
  key = replica_key(executor.seed, t, executor.replicas)
  inputs, targets = ring.microbatches((batch['inputs'], batch['targets']), m)
  x_like = jax.eval_shape(
    lambda: ring.embed(executor.model, params['embed'], ring.at(inputs, 0), key)
  )
  nothing = jax.tree.map(lambda a: jnp.full(a.shape, executor.bubble_fill, a.dtype), x_like)
  shares = ring.loss_shares(executor.model, targets)
  step = _Step(params, inputs, targets, shares, key, t, nothing)
  # A memory (leaves [v, 1, B/R, ...]: this device's chunks) cut into micro-batch rows.
  memory = jax.tree.map(
    lambda a: a[:, 0].reshape(a.shape[0], m, -1, *a.shape[3:]), buffers.get('memory')
  )
  operations_T = executor.operations_T(jax.lax.axis_index(STAGE))
  tick = functools.partial(_tick, executor, step)
  end, _ = jax.lax.scan(tick, _start(executor, step, memory), operations_T)
  from_owner = lambda tree: jax.lax.psum(tree, STAGE)
  grads = {
    'embed': from_owner(end.grad_embed),
    'head': from_owner(end.grad_head),
    'stages': end.grad_chunks,
  }
  if end.memory is not None:
    rows = lambda a: a.reshape(a.shape[0], 1, -1, *a.shape[3:])
    buffers = {**buffers, 'memory': jax.tree.map(rows, end.memory)}
  return (*layer_shards.replica_mean(grads, from_owner(end.loss)), buffers)


def _start(executor: _Executor, step: _Step, memory) -> _Carry:
  """Empty slots, zero gradients, and the memory (leaves [v, m, b, ...], or None)."""
  program, x = executor.program, step.nothing
  zeros = lambda tree: jax.tree.map(jnp.zeros_like, tree)
  slots = lambda like: jax.tree.map(
    lambda a: jnp.zeros((program.stash_slots, *a.shape), a.dtype), like
  )
  inbox = lambda count: jax.tree.map(
    lambda a: jnp.full((count, *a.shape), executor.bubble_fill, a.dtype), x
  )

  # The stash's shape from F's own trace: stage, micro-batch and chunk traced int32 as F gets them
  # (a table row's entries), not Python ints. What a stash keeps can depend on it: a stage that
  # skips a pad layer by `jnp.where(stage_index ...)` keeps one residual set for a traced index
  # and another for a Python int.
  def forward_of(k, i, c):
    memory_ci = jax.tree.map(lambda a: a[c, i], memory)
    return executor.stash.forward(step.chunk(c), x, k, step.key_of(i), memory_ci, step.index)

  index = jnp.zeros((), jnp.int32)  # operations_T's dtype
  _, kept_like, _ = jax.eval_shape(forward_of, index, index, index)
  input_grad = lambda kept, delta: executor.stash.input_grad(
    step.chunk(0), kept, delta, index, step.key_of(0)
  )
  return _Carry(
    stash=slots(kept_like),
    for_w=slots(jax.eval_shape(input_grad, kept_like, x)[1]) if executor.tapped else {},
    activations=inbox(program.activation_slots),
    gradients=inbox(program.gradient_slots),
    grad_chunks=zeros(step.params['stages']),
    grad_embed=zeros(step.params['embed']),
    grad_head=zeros(step.params['head']),
    loss=jnp.zeros(()),
    memory=memory,
  )


class _Sums(NamedTuple):
  """What the operations add to over the step (the only state a tick's switch carries)."""

  grad_chunks: PyTree  # leaves [v, ...]
  grad_embed: PyTree
  grad_head: PyTree
  loss: jax.Array


class _Slots(NamedTuple):
  """The slots of this tick's operation: read from the buffers before it runs, written back
  after (F: its residuals and memory; a tapped B: what it hands W; every other operation hands
  back what it read)."""

  kept: PyTree  # the stash slot: F's residuals of this (micro-batch, chunk)
  for_w: PyTree  # what a tapped B hands its W ({} otherwise)
  memory: PyTree  # this chunk's memory of this micro-batch (None without a memory)


def _tick(executor: _Executor, step: _Step, carry: _Carry, op):
  """One tick: 1. run the operation (idle, F, B or W); 2. move the value it sends one hop.

  The operation runs in a `lax.switch` that carries only the sums and one slot of each buffer:
  the buffers themselves (stash, inboxes, memory) are read and written around it by index. A
  switch that carried them made XLA copy every buffer in every branch of every tick, which the
  pieces a step is built from never pay (docs/results/simulator_calibration.md)."""
  weight_grad = _idle if executor.pipeline.fused else _weight_grad  # fused: B took the VJP
  operations = [
    functools.partial(run, executor, step) for run in (_idle, _forward, _input_grad, weight_grad)
  ]
  depth, slot = executor.program.stash_slots, op['stash_slot']
  c, i = op['chunk'], op['microbatch']
  read = _Slots(
    kept=ring.read_slot(carry.stash, slot, depth),
    for_w=ring.read_slot(carry.for_w, slot, depth),
    memory=jax.tree.map(lambda a: a[c, i], carry.memory),
  )
  inbox = ring.at(carry.activations, op['inbox_slot'])
  delta = ring.at(carry.gradients, op['inbox_slot'])
  sums = _Sums(carry.grad_chunks, carry.grad_embed, carry.grad_head, carry.loss)
  sums, written, sent = jax.lax.switch(op['kind'], operations, sums, read, inbox, delta, op)
  carry = carry._replace(
    stash=ring.write_slot(carry.stash, written.kept, slot, depth),
    for_w=ring.write_slot(carry.for_w, written.for_w, slot, depth),
    memory=jax.tree.map(lambda a, new: a.at[c, i].set(new), carry.memory, written.memory),
    grad_chunks=sums.grad_chunks,
    grad_embed=sums.grad_embed,
    grad_head=sums.grad_head,
    loss=sums.loss,
  )
  return _send(executor, carry, op, sent), None


def _send(executor: _Executor, carry: _Carry, op, sent) -> _Carry:
  """One `ppermute` per channel o the program uses (device d to d + o); this device keeps what
  device d - o sent in the inbox slot its program names (or nowhere)."""
  p = executor.num_stages
  activations, gradients = carry.activations, carry.gradients
  for o in executor.program.channels:
    hop = [(d, (d + o) % p) for d in range(p)]
    got = sent if o == 0 else jax.lax.ppermute(sent, STAGE, hop)
    store, slot = op[f'store_{o}'], op[f'slot_{o}']
    activations = ring.set_where(activations, slot, got, store == tables.ACTIVATIONS)
    gradients = ring.set_where(gradients, slot, got, store == tables.GRADIENTS)
  return carry._replace(activations=activations, gradients=gradients)


# -- the operations: (sums, slots read, inbox activation, inbox gradient, op) ----------------------
# -> (sums, slots to write back, the value sent on)


def _idle(executor: _Executor, step: _Step, sums: _Sums, read: _Slots, inbox, delta, op):
  del executor, inbox, delta, op
  return sums, read, step.nothing


def _forward(executor: _Executor, step: _Step, sums: _Sums, read: _Slots, inbox, delta, op):
  """F: embed micro-batch i (virtual stage k = 0) or take the activation in the inbox, run chunk
  c keeping its residuals in the stash slot; on the last stage also the head. Sends the output
  to the next stage, or the head's gradient to this stage's own B."""
  del delta
  i, k, c = op['microbatch'], op['stage'], op['chunk']
  embed = lambda: ring.embed(
    executor.model, step.params['embed'], ring.at(step.inputs, i), step.key_of(i)
  )
  x = jax.lax.cond(k == 0, embed, lambda: inbox)
  y, kept, memory = executor.stash.forward(
    step.chunk(c), x, k, step.key_of(i), read.memory, step.index
  )
  zeros = lambda tree: jax.tree.map(jnp.zeros_like, tree)
  no_head = lambda: (jnp.zeros(()), zeros(step.params['head']), zeros(step.params['embed']), y)
  head = lambda: _head(executor, step, y, i)
  loss, g_head, g_embed, sent = jax.lax.cond(k == executor.pipeline.last_stage, head, no_head)
  sums = sums._replace(
    grad_head=_add(sums.grad_head, g_head),
    grad_embed=_add(sums.grad_embed, g_embed),
    loss=sums.loss + loss,
  )
  return sums, read._replace(kept=kept, memory=memory), sent


def _head(executor: _Executor, step: _Step, y, i):
  """The loss of micro-batch i times its share of the step's (1/m, or its weight's share:
  `ring.loss_shares`), and its gradients (`ring.head_vjp`)."""
  share = step.shares[i]
  loss, g_head, g_embed, dy = ring.head_vjp(
    executor.model, step.params, y, ring.at(step.targets, i), share
  )
  return loss * share, g_head, g_embed, dy


def _input_grad(executor: _Executor, step: _Step, sums: _Sums, read: _Slots, inbox, delta, op):
  """B. A fused schedule takes the whole VJP here, as one backward (its W is empty). A split
  one (ZB) takes the input gradient: through the model's taps when it has a `WeightSplit`
  (keeping the taps' gradients for W), else as the input half of the VJP (XLA removes the
  weight half). On virtual stage 0 the input gradient goes on into the embedding's."""
  del inbox
  i = op['microbatch']
  if executor.tapped:
    dx, for_w = executor.stash.input_grad(
      step.chunk(op['chunk']), read.kept, delta, op['stage'], step.key_of(i)
    )
    read = read._replace(for_w=for_w)
  else:
    g_chunk, dx = _backward(executor, step, read.kept, delta, op)
    sums = _add_chunk_grad(sums, op, g_chunk) if executor.pipeline.fused else sums
  embed_grad = lambda: ring.embed_grad(
    executor.model, step.params['embed'], ring.at(step.inputs, i), step.key_of(i), dx
  )
  g_embed = ring.on_stage(op['stage'], 0, embed_grad)
  return sums._replace(grad_embed=_add(sums.grad_embed, g_embed)), read, dx


def _weight_grad(executor: _Executor, step: _Step, sums: _Sums, read: _Slots, inbox, delta, op):
  """W of a split schedule: from the taps' gradients (matrix products only), else as the weight
  half of the VJP (which recomputes the input-gradient chain). Sends nothing."""
  del inbox
  if executor.tapped and layer_shards.active() is not None:
    g_shards = _sharded_weight_grad(executor, step, read, op)
    return _add_chunk_grad(sums, op, g_shards), read, step.nothing
  if executor.tapped:
    g_chunk = executor.stash.weight_grad(step.chunk(op['chunk']), read.kept, read.for_w)
  else:
    g_chunk, _ = _backward(executor, step, read.kept, delta, op)
  return _add_chunk_grad(sums, op, g_chunk), read, step.nothing


def _sharded_weight_grad(executor: _Executor, step: _Step, read: _Slots, op):
  """W under FSDP, one layer at a time: each layer's weight gradient from its taps, then
  reduce-scattered onto this device's shards before the next layer's is made, so the chunk's
  whole float32 gradient never exists at once (made whole and scattered together, it grew
  ZB-H1's peak with FSDP where 1F1B's fell). The taps, the recorded inputs and the weights all
  have the chunk's layers on their leading axis."""
  params_N, gathering = step.chunk(op['chunk']), layer_shards.active()
  split = executor.stash.split

  def one_layer(layer):
    params_1, inputs_1, tap_grads_1 = jax.tree.map(lambda a: a[None], layer)
    g_1 = split.weight_grad(params_1, inputs_1, tap_grads_1)
    return jax.tree.map(lambda g: g[0], layer_shards.to_shards(g_1, params_1, gathering))

  return jax.lax.map(one_layer, (params_N, *executor.stash.recorded(read.kept, read.for_w)))


def _backward(executor: _Executor, step: _Step, kept, delta, op):
  """The chunk's whole VJP: (weight gradient, input gradient)."""
  params_c, key = step.chunk(op['chunk']), step.key_of(op['microbatch'])
  return executor.stash.backward(params_c, kept, delta, op['stage'], key, step.index)


def _add_chunk_grad(sums: _Sums, op, g_chunk) -> _Sums:
  gathering = layer_shards.active()
  if gathering is not None:  # FSDP: a W computed whole goes onto this device's shards (a
    # gradient already shard-shaped, `_sharded_weight_grad`'s, passes `to_shards` as it is)
    like = jax.tree.map(lambda g: g[0], sums.grad_chunks)
    g_chunk = layer_shards.to_shards(g_chunk, like, gathering)
  add_at = lambda g, w: g.at[op['chunk']].add(w)
  return sums._replace(grad_chunks=jax.tree.map(add_at, sums.grad_chunks, g_chunk))


def _add(a: PyTree, b: PyTree) -> PyTree:
  return jax.tree.map(jnp.add, a, b)
