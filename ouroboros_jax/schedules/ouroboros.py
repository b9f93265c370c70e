"""Ouroboros: delayed-gradient model parallelism on a ring of devices.

Yang, Huo, Wang, Huang, Carin, NeurIPS 2019; the full statement is docs/algorithm.md. K = G + 1
modules on G devices: device 0 holds module 1 (embedding V, layer group 0) and module K (norm,
tied V^T, loss); layer group s is on device s. At every step t:

  1. Forward, locked: batch t runs through groups 0..G-1 with the current weights; device s
     stashes what its delayed backward needs (graph: VJP residuals; replay: the input).
  2. Head, device 0: loss_t, the head's gradient and delta_{G-1}^t, all fresh.
  3. Backward, every device at once: group s back-propagates batch t - (G - s) with the error
     gradient it received during step t - 1, then sends its input gradient one hop back.
  4. Update: each module with its own optimizer state, once its first gradient has arrived; the
     tied V sums the head's fresh gradient and module 1's stale one.

Pipelined (`forward='pipelined'`): group s forwards batch t - s and back-propagates t - 2G + s.
With M micro-batches the batch goes round the ring in M chunks (as one batch, with the whole
batch's delays; streamed, one tick apart across updates), a step is one loop of rounds that each
forward, head and back-propagate one chunk, and a chunk's stash waits in a micro-batch slot of
its own from its forward to its backward: a device keeps what is in flight (delays.Timing).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from ouroboros_jax import layer_shards, placement, staged
from ouroboros_jax.errors import ConfigError
from ouroboros_jax.schedules import compensation, ring_shapes, stash_layout
from ouroboros_jax.schedules import ring as ring_lib
from ouroboros_jax.schedules.delays import Timing
from ouroboros_jax.schedules.stash import Stash, make_stash
from ouroboros_jax.staged import STAGE, Schedule, StagedModel, TrainState
from ouroboros_jax.update import GroupedOptimizer

# The end of the window of items a running ring takes: none (a drain sets it; `_Ring.real`).
OPEN_END = jnp.iinfo(jnp.int32).max


def idle_fraction(
  num_stages: int, backward_over_forward: float = 2.0, forward: str = 'locked'
) -> float:
  """Idle device-time per step with equal stages (B = 2F by default). Locked: G forward rounds,
  each device busy in one, then one backward everywhere at once. Pipelined: every device runs
  one forward and one backward every step, so none idles once the pipe is full."""
  if forward == 'pipelined':
    return 0.0
  f, b = 1.0, backward_over_forward
  return (num_stages - 1) * f / (num_stages * f + b)


@dataclasses.dataclass(frozen=True)
class _Ring:
  """What every step of one Ouroboros schedule reads: the settings, and what they imply."""

  config: Any  # the ScheduleConfig
  model: StagedModel
  optimizer: GroupedOptimizer  # its tx wrapped with the update-side compensations
  stash: Stash  # what a device keeps of each batch until its delayed backward
  mesh: Any
  timing: Timing  # when each group sees which micro-batch (delays.py)
  compensation: compensation.Compensation

  @property
  def num_stages(self) -> int:
    return self.config.num_stages

  @property
  def pipelined(self) -> bool:
    return self.timing.forward_hop > 0

  @property
  def num_microbatches(self) -> int:
    return self.config.microbatches

  @functools.cached_property
  def slots(self) -> stash_layout.SlotLayout:
    """The stash's micro-batch slots: what each group needs, what each device holds."""
    return stash_layout.layout(self.timing, self.config.stash_memory)

  @property
  def depth(self) -> int:
    """Slots of whole batches (inputs and targets) per device: G + 1 locked and 2G + 1
    pipelined as one batch; ceil(largest lag / M) + 1 streamed (`Timing.depth`)."""
    return self.timing.depth

  @property
  def aligned(self) -> bool:
    """Whether every event of a step happens to the M items of one batch (as one batch)."""
    return self.timing.flow == 'batch' or self.num_microbatches == 1

  def items(self, t, ticks):
    """The M items (micro-batches u = t'M + m) that an event `ticks` after their entry happens
    to during step t, in tick order."""
    return t * self.num_microbatches + jnp.arange(self.num_microbatches) - ticks

  def real(self, items, window):
    """Which items entered the ring: those in the ring's `window` [first, end) of items (none
    during the synchronous warm-up, none from a drain's start: `fresh_window`)."""
    return (items >= window[0]) & (items < window[1])

  def any_real(self, items, window):
    """Whether any of a step's items (ascending) is real: whether its event updates a module."""
    return (items[-1] >= window[0]) & (items[0] < window[1])

  def fresh_window(self, first_step: int):
    """The window of a ring that starts empty at `first_step`, every later item entering."""
    return jnp.asarray([first_step * self.num_microbatches, OPEN_END], jnp.int32)

  def item_key(self, item):
    """Item u's dropout key: micro-batch u % M of batch u // M."""
    num_micro = self.num_microbatches
    return ring_lib.microbatch_key(self.key(item // num_micro), item % num_micro, num_micro)

  def key(self, batch_index):
    return staged.batch_key(self.config.seed, batch_index)


def build(
  config, model: StagedModel, tx: optax.GradientTransformation, *, devices=None
) -> Schedule:
  """The Ouroboros schedule: `init(params, example_batch)` and a jitted `step(state, batch)`.

  `config.compensation` (compensation.py; 'auto': `ScheduleConfig.resolve_compensation`) wraps
  `tx` with the update-side compensations and, with `predict`, runs each module's forward at its
  predicted weights. A config without ‹microbatches› takes them from the batch `init` and `step`
  are given, resolved as the CLI resolves them (`ScheduleConfig.resolve`, on the devices'
  platform)."""
  num_stages = config.num_stages
  comp = config.resolved_compensation
  compensation.check_fits(comp, config.stash)
  mesh = placement.make_mesh(num_stages, config.data_parallel, devices)
  if config.stash_memory == 'pinned_host':
    placement.check_pinned_host(mesh)
  if num_stages == 1:  # no delay, nothing to compensate: exactly the paper's G = 1 step
    comp = compensation.Compensation()
  # Graph: the weights are kept once per step ('weights'), not once per micro-batch.
  stash = make_stash(model, config.stash, config.resolved_stash_policy, keep_weights=False)
  platform = mesh.devices.flat[0].platform

  @functools.cache
  def ring(batch_size: int) -> _Ring:  # the micro-batches, and what they imply, for this batch
    run = config.resolve(platform, batch_size)
    timing = Timing(num_stages, run.forward, run.microbatches, run.flow)
    return _Ring(
      config=run,
      model=model,
      optimizer=GroupedOptimizer(
        compensation.wrap(comp, tx, max([timing.embed_gap, *timing.stage_gaps])),
        run.clip_norm,
        model.shared,
        placement.update_layout(run, mesh),
      ),
      stash=stash,
      mesh=mesh,
      timing=timing,
      compensation=comp,
    )

  rows = lambda batch: staged.batch_rows(batch['inputs'])
  schedule = placement.make_schedule(
    'ouroboros',
    model,
    mesh,
    lambda params, example_batch: _init(ring(rows(example_batch)), params, example_batch),
    lambda state, batch: _step(ring(rows(batch)), state, batch),
    idle_fraction(num_stages, forward=config.forward),
    lambda rows: ring(rows).config,
    placement.layout_for(config),
  )
  held_rows = lambda state: rows({'inputs': _no_batch(state, mesh)['inputs']})
  return schedule._replace(drain=lambda state: drain(ring(held_rows(state)), schedule, state))


def drain(ring: _Ring, schedule: Schedule, state: TrainState) -> TrainState:
  """The state at step T with nothing in flight, as a pipeline's flush leaves it: from T on the
  ring takes no new item (its window ends at T's first) and runs `Timing.drain_steps` more
  steps, each as any step runs. So every item of batches 0 .. T - 1 is back-propagated by
  every group with the error gradient that comes round, at the weights its stash kept (graph;
  replay: the current ones), and applied by each module's own update with its compensations, a
  module updating only in a step that reaches a real item (the slow reference's `drain`).
  Then the ring starts again empty at step T: its buffers fresh (a model's memory too), its
  window from T's first item; the parameters and the optimizer state keep every update."""
  steps = int(jax.device_get(state.step))
  first_step = max(steps, ring.config.sync_warmup_steps)  # (nothing in flight before that)
  end = first_step * ring.num_microbatches
  window = state.ring['window']
  close = jax.jit(lambda w: w.at[..., 1].set(end), out_shardings=window.sharding)
  no_batch = _no_batch(state, ring.mesh)
  state = state.replace(ring={**state.ring, 'window': close(window)})
  for _ in range(ring.timing.drain_steps):
    state, _ = schedule.step(state, no_batch)
  fresh = _init(ring, state.params, no_batch, first_step)
  return state.replace(step=jax.device_put(jnp.int32(steps), state.step.sharding), ring=fresh.ring)


def _no_batch(state: TrainState, mesh) -> dict:
  """A batch of zeros shaped like those the ring holds, split over the data replicas as a batch
  is: what a drain's steps are given (no item of it enters the ring)."""
  sharding = jax.sharding.NamedSharding(mesh, P(staged.DATA))

  def zeros(held):  # [G, R, depth, rows, ...] -> [R x rows, ...]
    shape = (held.shape[1] * held.shape[3], *held.shape[4:])
    return jax.make_array_from_callback(
      shape, sharding, lambda index: np.zeros(shape, held.dtype)[index]
    )

  return jax.tree.map(zeros, state.ring['batches'])


# -- one step on one device of the ring: the four steps of the algorithm ---------------------------
#
# The ring's clock is the tick: micro-batch m of batch t is item u = tM + m and enters at tick u
# (delays.Timing). Step t runs ticks tM .. tM + M - 1 as one loop of rounds (Timing.rounds): in
# each, every device forwards an item, the head (device 0) computes the loss of the item that has
# come round the ring, and every device back-propagates an item, in that order. Nothing a round
# reads is written by a later round and the weights change only between steps, so this is the
# tick-by-tick order of the algorithm. A message between neighbours waits in a FIFO of `hop`
# ticks: M as one batch (it arrives next step), 1 streamed (next round). What a group keeps of an
# item waits from its forward to its backward in a ring of micro-batch slots, item u in slot
# u % N: the items in flight, not whole steps (stash_layout: where each device's slots live).


class _StepInputs(NamedTuple):
  """What every round of step t on device s reads."""

  params: Any
  forward_params: Any  # the weights of the forward (= params unless predicted)
  inputs_M: Any  # the batch entering the ring, micro-batch by micro-batch
  head_targets_M: Any  # the targets ...
  head_shares_M: jax.Array  # ... and loss shares of the items the head sees this step
  backward_inputs_M: Any  # the inputs of the items back-propagated this step (the embedding's)
  backward_weights: Any  # graph: m -> the weights item m was forwarded with; None: replay
  items_b: jax.Array  # the items group s back-propagates this step, in order
  mirror_items_b: jax.Array  # ... and group G - 1 - s (a balanced stash's lent slots)
  t: jax.Array
  window: jax.Array  # [first, end): the items that entered the ring (`_Ring.real`)


class _Carry(NamedTuple):
  """What a round hands the next."""

  received: Any  # locked: what the predecessor sent this round
  act_fifo: Any  # pipelined: the activations in flight to this device (`hop` slots); else None
  stash_N: Any  # what this device keeps of each item in flight, item u in slot u % N
  memory_M: Any  # the model's memory, micro-batch by micro-batch (None without one)
  head_sum: Any  # device 0: (loss, head gradient, the head's embed gradient), summed
  g_stage: Any  # this group's delayed gradient, summed
  g_embed: Any  # device 0: the embedding's delayed (input-side) gradient, summed
  delta_fifo: Any  # the error gradients in flight to this device (`hop` slots)


def _ring_step(ring: _Ring, params, forward_params, buffers, batch, t):
  """Step t of the ring on device s (inside the shard_map): (grads, new buffers, loss)."""
  s, timing, num_micro = jax.lax.axis_index(STAGE), ring.timing, ring.num_microbatches
  kept_buffers = buffers.get(placement.HOST, buffers)  # offloaded, or beside the others
  weights_W = _local(buffers.get('weights'))  # on the device, wherever the stash waits
  batches_S = ring_lib.write_slot(_local(buffers['batches']), batch, t, ring.depth)
  by_item = lambda tree: ring_lib.slots_by_microbatch(tree, num_micro)
  read = lambda tree, items: ring_lib.read_items(by_item(tree), items[0], ring.depth, ring.aligned)
  backward_ticks = jnp.asarray([timing.backward_ticks(g) for g in range(ring.num_stages)])
  items_b, items_h = ring.items(t, backward_ticks[s]), ring.items(t, timing.head_ticks)
  head_targets_M = read(batches_S['targets'], items_h)
  # Graph: the backward differentiates at the weights each item was forwarded with. This step's
  # forward weights are at hand; only the older versions wait in the ring (Timing.weight_slots).
  forward_s = ring_lib.local_stage_params(forward_params)
  version_now = t  # the weights of an item forwarded in step t are version t
  step = _StepInputs(
    params=params,
    forward_params=forward_params,
    inputs_M=ring_lib.microbatches(batch['inputs'], num_micro),
    head_targets_M=head_targets_M,
    head_shares_M=_head_shares(ring, batches_S, head_targets_M, items_h),
    backward_inputs_M=read(batches_S['inputs'], items_b),
    backward_weights=_backward_weights(ring, weights_W, forward_s, version_now, items_b),
    items_b=items_b,
    mirror_items_b=ring.items(t, backward_ticks[ring.num_stages - 1 - s]),
    t=t,
    window=_local(buffers['window']),
  )
  carry = _first_carry(ring, step, buffers, _local(kept_buffers['stash']))
  # Locked, the first G - 1 rounds only fill the wave: no backward reaches a group before the
  # head has seen the step's first item. A loop of their own, so that every round of the second
  # back-propagates (a backward under a cond would cost its temporaries twice).
  fill = timing.backward_round(0)
  carry = jax.lax.fori_loop(0, fill, functools.partial(_fill_round, ring, step), carry)
  out = jax.lax.fori_loop(fill, timing.rounds, functools.partial(_round, ring, step), carry)
  kept = {'stash': out.stash_N}
  if weights_W is not None:  # after every read of the step: XLA updates the slot in place
    kept['weights'] = ring_lib.write_slot(weights_W, forward_s, version_now, timing.weight_slots)
  loss, g_head, g_embed = out.head_sum
  g_embed = jax.tree.map(jnp.add, g_embed, out.g_embed)  # the head's fresh one, module 1's stale
  if ring.config.tied_grad == 'mean' and ring.model.tied_embedding:
    module_1 = ring.items(t, timing.backward_ticks(0))  # module 1's stale one, and the head's
    both = ring.any_real(module_1, step.window) & ring.any_real(items_h, step.window)
    g_embed = jax.tree.map(lambda g: jnp.where(both, 0.5 * g, g), g_embed)
  grads, loss = ring_lib.gather_grads(g_embed, g_head, out.g_stage, loss)
  return grads, _new_buffers(ring, buffers, kept, batches_S, out), loss


def _new_buffers(ring: _Ring, buffers, kept, batches_S, out: _Carry):
  """The ring buffers [G, R, ...] the step leaves: the batches, the stash (on the device or in
  the host's memory), the messages in flight and a model's memory."""
  new_buffers = {
    'batches': batches_S,
    'delta': ring_lib.whole_batch(out.delta_fifo),
    'window': _local(buffers['window']),
  }
  if placement.HOST in buffers:
    new_buffers[placement.HOST] = {'stash': kept.pop('stash')}
  new_buffers.update(kept)
  if ring.pipelined:
    new_buffers['act'] = ring_lib.whole_batch(out.act_fifo)
  if out.memory_M is not None:
    new_buffers['memory'] = ring_lib.whole_batch(out.memory_M)
  return jax.tree.map(lambda a: a[None, None], new_buffers)


def _first_carry(ring: _Ring, step: _StepInputs, buffers, stash_N) -> _Carry:
  """The loop's carry before round 0: the messages in flight from the last step, the stash and
  the memory as the buffers hold them, and zero sums."""
  model, hop, s = ring.model, ring.timing.hop, jax.lax.axis_index(STAGE)
  x_like = jax.eval_shape(
    lambda: ring_lib.embed(model, step.forward_params['embed'], ring_lib.at(step.inputs_M, 0), None)
  )
  head_like = jax.eval_shape(  # x_like an argument: jnp functions take no ShapeDtypeStruct
    lambda x: ring_lib.head(model, step.params, x, ring_lib.at(step.head_targets_M, 0)), x_like
  )
  params_s = ring_lib.local_stage_params(step.params)
  at_weights = params_s if step.backward_weights is None else step.backward_weights(0)
  grads_like = jax.eval_shape(  # of a slot's stash and an error gradient
    lambda kept, x: ring.stash.backward(at_weights, kept, x, s, ring.item_key(step.t), 0),
    ring_lib.read_slot(stash_N, 0, ring.slots.slots),
    x_like,
  )
  return _Carry(
    received=_zeros(x_like),
    act_fifo=ring_lib.microbatches(_local(buffers['act']), hop) if ring.pipelined else None,
    stash_N=stash_N,
    memory_M=ring_lib.microbatches(ring_lib.local_memory(buffers), ring.num_microbatches),
    head_sum=_zeros(head_like[:3]),
    g_stage=_zeros(grads_like[0]),
    g_embed=_zeros(step.params['embed']),
    delta_fifo=ring_lib.microbatches(_local(buffers['delta']), hop),
  )


def _round(ring: _Ring, step: _StepInputs, r, carry: _Carry) -> _Carry:
  """Round r of the step: 1. forward, 2. head, 3. backward (a balanced stash's lent item on its
  way back from the round's start)."""
  m, s = r - ring.timing.backward_round(0), jax.lax.axis_index(STAGE)
  back = stash_layout.lent_back(ring.slots, carry.stash_N, step.mirror_items_b[m], s)
  carry, x_head = _forward_round(ring, step, r, carry)
  carry, delta_head = _head_round(ring, step, r, x_head, carry)
  return _backward_round(ring, step, r, delta_head, carry, back)


def _fill_round(ring: _Ring, step: _StepInputs, r, carry: _Carry) -> _Carry:
  """A round of the locked wave before the head has seen an item of the step: the forward only."""
  return _forward_round(ring, step, r, carry)[0]


def _forward_round(ring: _Ring, step: _StepInputs, r, carry: _Carry):
  """Step 1 in round r on device s: group s forwards its next item of the step (device 0 embeds
  it first), keeps what its backward needs in the item's stash slot and sends its output on.
  Locked, it forwards micro-batch r - s of the step's batch, as it reaches it in the wave;
  pipelined, what its predecessor sent `hop` ticks ago. Returns (carry, what reaches the head:
  G-1's output, sent this round (locked) or `hop` ticks ago (pipelined))."""
  model, timing, num_micro = ring.model, ring.timing, ring.num_microbatches
  s, hop = jax.lax.axis_index(STAGE), timing.hop
  j, item, active = _forwarded(ring, step.t, r, s)
  entering = step.t * num_micro + j  # device 0 embeds the item entering the ring now
  x0 = ring_lib.embed(
    model, step.forward_params['embed'], ring_lib.at(step.inputs_M, j), ring.item_key(entering)
  )
  received, act_fifo = carry.received, carry.act_fifo
  if ring.pipelined:  # what the predecessor sent hop ticks ago; its slot takes what comes now
    received = ring_lib.at(act_fifo, r % hop)
  forward_s = ring_lib.local_stage_params(step.forward_params)  # = params_s unless predicted

  def run_forward(x, memory):
    return ring.stash.forward(forward_s, x, s, ring.item_key(item), memory, item // num_micro)

  x = ring_lib.select(s == 0, x0, received)
  memory = ring_lib.at(carry.memory_M, item % num_micro)
  no_kept = _zeros(jax.eval_shape(run_forward, x, memory)[1])
  y, kept, new_memory = jax.lax.cond(
    active, run_forward, lambda x, memory: (x, no_kept, memory), x, memory
  )
  mirror = _forwarded(ring, step.t, r, ring.num_stages - 1 - s)[1:]
  stash_N = stash_layout.write(ring.slots, carry.stash_N, kept, item, active, *mirror, s)
  # Only a real item renews the memory (while a pipe fills, a group forwards zeros).
  memory_M = ring_lib.set_where(
    carry.memory_M, item % num_micro, new_memory, ring.real(item, step.window)
  )
  sent = ring_lib.send_forward(y, ring.num_stages)
  if ring.pipelined:
    act_fifo = ring_lib.set_at(act_fifo, r % hop, sent)
  x_head = received if ring.pipelined else sent
  carry = carry._replace(received=sent, act_fifo=act_fifo, stash_N=stash_N, memory_M=memory_M)
  return carry, x_head


def _forwarded(ring: _Ring, t, r, s):
  """(j, item, active): group s's forward in round r of step t: its index among the items the
  group forwards in the step (clipped), that item, and whether the round has one."""
  num_micro, timing = ring.num_microbatches, ring.timing
  j = r - timing.forward_round(s, 0)
  active = (j >= 0) & (j < num_micro)
  j = jnp.clip(j, 0, num_micro - 1)
  return j, t * num_micro + j - s * timing.forward_hop, active


def _head_round(ring: _Ring, step: _StepInputs, r, x_head, carry: _Carry):
  """Step 2 in round r on device 0: the head on the item that has just come round the ring, its
  k-th of the step: fresh loss, head gradient and delta_{G-1}, each times the item's share of
  its batch's loss. Returns (carry, delta_{G-1}: zeros elsewhere and for no real item)."""
  num_micro = ring.num_microbatches
  k = r - ring.timing.backward_round(0)
  items_h = ring.items(step.t, ring.timing.head_ticks)
  head_on = (k >= 0) & ring.real(items_h[jnp.clip(k, 0, num_micro - 1)], step.window)
  k = jnp.clip(k, 0, num_micro - 1)
  targets = ring_lib.at(step.head_targets_M, k)
  loss, g_head, g_embed, delta = ring_lib.head(
    ring.model, step.params, x_head, targets, step.head_shares_M[k], when=head_on
  )
  head_sum = jax.tree.map(jnp.add, carry.head_sum, (loss, g_head, g_embed))
  return carry._replace(head_sum=head_sum), delta


def _backward_round(ring: _Ring, step: _StepInputs, r, delta_head, carry: _Carry, back) -> _Carry:
  """Step 3 in round r on device s: group s back-propagates its m-th item of the step with the
  error gradient its successor sent `hop` ticks ago (device G-1: the head's; G = 1: this round's)
  from what its forward kept in the item's slot. Module 1 ends at the embedding: device 0 turns
  dx into V's stale input-side gradient. The one hop of the backward: s hands dx to s - 1;
  device 0 hands the head's delta to G - 1."""
  model, stash, num_micro = ring.model, ring.stash, ring.num_microbatches
  s, hop = jax.lax.axis_index(STAGE), ring.timing.hop
  m = r - ring.timing.backward_round(0)  # in 0 .. M - 1: the fill rounds have no backward
  item = step.items_b[m]
  key = ring.item_key(item)
  kept = stash_layout.read(ring.slots, carry.stash_N, item, back, s)
  delta = delta_head if ring.num_stages == 1 else ring_lib.at(carry.delta_fifo, m % hop)
  at_weights = (
    ring_lib.local_stage_params(step.params)
    if step.backward_weights is None
    else step.backward_weights(m)
  )

  # A select, not a cond: an item that has not entered the ring (the pipe filling) is computed
  # and dropped, which costs no memory a cond's two branches would.
  backward = stash.backward(at_weights, kept, delta, s, key, item // num_micro)
  g_m, dx = ring_lib.mask(ring.real(item, step.window), backward)
  inputs = ring_lib.at(step.backward_inputs_M, m)
  g_embed_m = ring_lib.embed_backward(model, step.params['embed'], inputs, key, dx)
  sent = ring_lib.send_backward(ring_lib.select(s == 0, delta_head, dx), ring.num_stages)
  add = lambda a, b: jax.tree.map(jnp.add, a, b)
  return carry._replace(
    g_stage=add(carry.g_stage, g_m),
    g_embed=add(carry.g_embed, g_embed_m),
    delta_fifo=ring_lib.set_at(carry.delta_fifo, m % hop, sent),
  )


def _head_shares(ring: _Ring, batches_S, targets_M, items_h):
  """[M]: each item the head sees this step, its share of its own batch's loss: 1/M, or (a
  model with a `loss_weight`) its weight over its batch's, over every data replica
  (`ring_lib.loss_shares`). Streamed, the items may span two batches, whose weights are read
  from the batches in flight."""
  model, num_micro = ring.model, ring.num_microbatches
  if model.loss_weight is None or ring.aligned:  # aligned: the M items are one batch
    return ring_lib.loss_shares(model, targets_M)
  weigh = functools.partial(ring_lib.micro_weights, model)
  batch_targets = lambda b: ring_lib.read_slot(batches_S['targets'], b, ring.depth)
  first = items_h[0] // num_micro
  totals = [
    weigh(ring_lib.microbatches(batch_targets(b), num_micro)).sum() for b in (first, first + 1)
  ]
  own_total_M = jnp.where(items_h // num_micro == first, *totals)
  return ring_lib.shares_of(weigh(targets_M), own_total_M)


def _backward_weights(ring: _Ring, weights_W, forward_s, version_now, items_b):
  """m -> the weights item items_b[m] was forwarded with (graph; None: replay). As one batch the
  step's items share one version; streamed they span two, both read once. Version `version_now`
  is this step's forward weights `forward_s`; the older ones are read from the ring's slots."""
  if weights_W is None:
    return None
  num_micro, timing = ring.num_microbatches, ring.timing
  forward_ticks = jax.lax.axis_index(STAGE) * timing.forward_hop
  version = (items_b + forward_ticks) // num_micro  # the step each item was forwarded in

  def read(
    v,
  ):  # kept narrow where the forward reads only the cast (ring_shapes.kept_weights): widened back
    older = jax.tree.map(
      lambda a, w: a.astype(w.dtype),
      ring_lib.read_slot(weights_W, v, timing.weight_slots),
      forward_s,
    )
    if ring.aligned and ring.num_stages > 1:  # as one batch nothing reads this step's version
      return older
    return ring_lib.select(v == version_now, forward_s, older)

  if ring.aligned:
    weights = read(version[0])
    return lambda m: weights
  older, newer = read(version[0]), read(version[0] + 1)
  return lambda m: ring_lib.select(version[m] == version[0], older, newer)


def _zeros(shapes):
  return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes)


def _local(buffer):
  """This device's entry of a ring buffer [G, R, ...] (its stage and data replica)."""
  return jax.tree.map(lambda a: a[0, 0], buffer)


# -- the state and the step --------------------------------------------------------------------


def _init(ring: _Ring, params, example_batch, first_step: int | None = None):
  """The fresh TrainState, with zeroed ring buffers [G, R, ...]: the stash, a micro-batch per
  slot [Timing.stash_slots, ...], and, graph, the forward's weights [Timing.weight_slots, ...];
  the batches in flight [Timing.depth, ...]; the window of items that enter, [first, end) (from
  `first_step`, by default the warm-up's end); the error gradient (and, pipelined, the
  activation) in flight, `hop` micro-batches each; and a model's empty memory, if any."""
  replicas, timing = ring.config.data_parallel, ring.timing
  placement.check_batch(example_batch, replicas, ring.num_microbatches)
  placement.check_stage_params(params, ring.config)  # before anything is traced
  shapes = ring_shapes.item_shapes(ring, params, example_batch)
  in_flight = jax.tree.map(  # a FIFO of `hop` micro-batches in flight to each device
    lambda a: jax.ShapeDtypeStruct((timing.hop * a.shape[0], *a.shape[1:]), a.dtype), shapes.x_micro
  )
  buffer = lambda a, *lead: jnp.zeros((ring.num_stages, replicas, *lead, *a.shape), a.dtype)

  def fresh_buffers():
    stash = {'stash': jax.tree.map(lambda a: buffer(a, ring.slots.slots), shapes.kept)}
    if shapes.weights_s is not None:
      stash['weights'] = jax.tree.map(lambda a: buffer(a, timing.weight_slots), shapes.weights_s)
    buffers = {
      **placement.empty_memory(ring.model, params, example_batch, replicas),
      'batches': jax.tree.map(lambda a: buffer(a, ring.depth), shapes.local),
      'delta': jax.tree.map(buffer, in_flight),
      'window': jnp.broadcast_to(
        ring.fresh_window(ring.config.sync_warmup_steps if first_step is None else first_step),
        (ring.num_stages, replicas, 2),
      ),
    }
    if ring.config.stash_memory == 'pinned_host':  # waits in host memory (placement.HOST),
      buffers[placement.HOST] = {'stash': stash.pop('stash')}  # the weights' versions on the
    buffers.update(stash)  # device (XLA's TPU compiler cannot squeeze bf16 weights in host memory)
    if ring.pipelined:  # the activation in flight to each device
      buffers['act'] = jax.tree.map(buffer, in_flight)
    return buffers

  layout = placement.layout_for(ring.config)
  return placement.init_state(ring.optimizer, params, ring.mesh, fresh_buffers, layout)


def _grads(ring: _Ring, state: TrainState, forward_params, batch, t, t_async):
  """(grads, ring buffers, loss): the delayed gradients, or during the synchronous warm-up
  model_parallel's exact ones over the same ring (the pipes stay empty)."""
  param_specs = placement.step_param_specs(state.params, ring.config)
  buffer_specs = placement.ring_specs(state.ring)
  grad_specs = placement.step_grad_specs(state.params, ring.config)
  delayed = jax.shard_map(
    layer_shards.with_scatter_mean(functools.partial(_ring_step, ring)),
    mesh=ring.mesh,
    in_specs=(param_specs, param_specs, buffer_specs, placement.batch_spec(batch), P()),
    out_specs=(grad_specs, buffer_specs, P()),
    check_vma=False,
  )

  def ouroboros_grads():
    return delayed(state.params, forward_params, state.ring, batch, t)

  def locked(params, batch, t, buffers):  # micro-batch by micro-batch, summed
    num_micro = ring.num_microbatches
    batch_M = ring_lib.microbatches(batch, num_micro)
    memory_M = ring_lib.microbatches(ring_lib.local_memory(buffers), num_micro)

    shares_M = ring_lib.loss_shares(ring.model, batch_M['targets'])

    def micro(m, carry):
      grads, loss, memory_M = carry
      memory = ring_lib.at(memory_M, m)
      grads_m, loss_m, memory = ring_lib.locked_grads(
        ring.model,
        params,
        ring_lib.at(batch_M, m),
        ring.item_key(t * num_micro + m),
        t,
        memory,
        share=shares_M[m],
      )
      memory_M = jax.tree.map(lambda a, new: a.at[m].set(new), memory_M, memory)
      add = lambda total, g: total + g
      return jax.tree.map(add, grads, grads_m), add(loss, loss_m), memory_M

    no_grads = _zeros({k: params[k] for k in ('embed', 'stages', 'head')})
    grads, loss, memory_M = jax.lax.fori_loop(
      0, num_micro, micro, (no_grads, jnp.zeros(()), memory_M)
    )
    return grads, ring_lib.with_memory(buffers, ring_lib.whole_batch(memory_M)), loss

  def warmup_grads():  # the pipes stay empty; a memory follows the batches
    synchronous = jax.shard_map(
      layer_shards.with_scatter_mean(locked),
      mesh=ring.mesh,
      in_specs=(param_specs, placement.batch_spec(batch), P(), buffer_specs),
      out_specs=(grad_specs, buffer_specs, P()),
      check_vma=False,
    )
    return synchronous(state.params, batch, t, state.ring)

  with placement.step_gathering(state.params, ring.config):
    if ring.config.sync_warmup_steps:
      return jax.lax.cond(t_async < 0, warmup_grads, ouroboros_grads)
    return ouroboros_grads()


def _check_rows(ring: _Ring, state: TrainState, batch: dict) -> None:
  """One-line ConfigError for a batch of another size than the one the state was made for (its
  ring keeps the batches in flight, `init`'s example batch's rows each)."""
  held = jax.tree.leaves(state.ring['batches'])[0].shape[3] * ring.config.data_parallel
  rows = staged.batch_rows(batch['inputs'])
  if rows != held:
    raise ConfigError(
      f'batch of {rows} rows, but this Ouroboros state was made for batches of {held} (the '
      "example batch given to init); its ring holds the batches in flight, so every step's "
      'batch has their size: give batches of that size, or init a state with this one.'
    )


def _step(ring: _Ring, state: TrainState, batch: dict):
  placement.check_batch(batch, ring.config.data_parallel, ring.num_microbatches)
  _check_rows(ring, state, batch)
  model, t, timing = ring.model, state.step, ring.timing
  t_async = t - ring.config.sync_warmup_steps
  warm = t_async < 0
  # Each group's version gap, 0 during the synchronous warm-up. The tied embedding counts as
  # fresh for the update (it gets the head's fresh gradient every step); its forward in module 1
  # is predicted with module 1's gap.
  no_gap = lambda gap: jnp.where(warm, 0, gap)
  gap_G = jnp.asarray(timing.stage_gaps)
  delays = {
    'embed': no_gap(0 if model.tied_embedding else timing.embed_gap),
    'stages': no_gap(gap_G),
    'head': jnp.int32(0),
  }
  forward_params = state.params
  if ring.compensation.predict:
    forward_params = compensation.predict_weights(
      state.params,
      state.opt_state,
      {'embed': no_gap(timing.embed_gap), 'stages': no_gap(gap_G), 'head': 0},
      ring.compensation.predict_horizon,
    )
  grads, buffers, loss = _grads(ring, state, forward_params, batch, t, t_async)

  # A module updates in a step in which a real item reaches it (the ring's window).
  window = state.ring['window'][0, 0]
  reached = lambda ticks: ring.any_real(ring.items(t, ticks), window)
  head_ready = warm | reached(timing.head_ticks)
  backward_G = [timing.backward_ticks(s) for s in range(ring.num_stages)]
  ready = {
    'embed': (head_ready & model.tied_embedding) | warm | reached(backward_G[0]),
    'stages': warm | jnp.stack([reached(ticks) for ticks in backward_G]),
    'head': head_ready,
  }
  params, opt_state, grad_norm = ring.optimizer.apply(
    state.params, state.opt_state, grads, ready, delays if ring.compensation.active else None
  )
  new_state = state.replace(step=t + 1, params=params, opt_state=opt_state, ring=buffers)
  # The batch of the step's first head item (streamed, the head's items may span two batches).
  head_batch = (t * ring.num_microbatches - timing.head_ticks) // ring.num_microbatches
  loss_batch = jnp.where(warm, t, head_batch)
  return new_state, {'loss': loss, 'loss_batch': loss_batch, 'grad_norm': grad_norm}
