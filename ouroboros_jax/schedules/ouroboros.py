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
With M micro-batches the batch goes round the ring in M chunks with the whole batch's delays.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from ouroboros_jax import placement, staged
from ouroboros_jax.schedules import compensation
from ouroboros_jax.schedules import ring as ring_lib
from ouroboros_jax.schedules.delays import lags, version_gaps
from ouroboros_jax.schedules.stash import Stash, make_stash
from ouroboros_jax.staged import STAGE, Schedule, StagedModel, TrainState
from ouroboros_jax.update import GroupedOptimizer


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
  head_lag: int  # the head computes the loss of batch t - head_lag
  backward_lags: tuple[int, ...]  # group s back-propagates batch t - backward_lags[s]
  embed_gap: int  # version gaps (delays.version_gaps), for the compensations
  stage_gaps: tuple[int, ...]
  compensation: compensation.Compensation

  @property
  def num_stages(self) -> int:
    return self.config.num_stages

  @property
  def pipelined(self) -> bool:
    return self.config.forward == 'pipelined' and self.num_stages > 1

  @property
  def num_microbatches(self) -> int:
    return self.config.num_microbatches

  def micro_key(self, key, m):
    return ring_lib.microbatch_key(key, m, self.num_microbatches)

  @property
  def depth(self) -> int:
    """Stash slots per device: G + 1 locked, 2G + 1 pipelined."""
    return max(self.backward_lags) + 1

  def key(self, batch_index):
    return staged.batch_key(self.config.seed, batch_index)


def build(
  config, model: StagedModel, tx: optax.GradientTransformation, *, devices=None
) -> Schedule:
  """The Ouroboros schedule: `init(params, example_batch)` and a jitted `step(state, batch)`.

  `config.compensation` (compensation.py) wraps `tx` with the update-side compensations and,
  with `predict`, runs each module's forward at its predicted weights."""
  num_stages = config.num_stages
  comp = config.compensation
  compensation.check_fits(comp, config.stash)
  head_lag, backward_lags = lags(num_stages, config.forward)
  mesh = placement.make_mesh(num_stages, config.data_parallel, devices)
  if config.stash_memory == 'pinned_host':
    placement.check_pinned_host(mesh)
  embed_gap, stage_gaps = version_gaps(num_stages, config.forward)
  if num_stages == 1:  # no delay, nothing to compensate: exactly the paper's G = 1 step
    comp = compensation.Compensation()
  ring = _Ring(
    config=config,
    model=model,
    optimizer=GroupedOptimizer(
      compensation.wrap(comp, tx, max([embed_gap, *stage_gaps])), config.clip_norm, model.shared
    ),
    # Graph: the weights are kept once per batch ('weights'), not once per micro-batch.
    stash=make_stash(model, config.stash, config.stash_policy, keep_weights=False),
    mesh=mesh,
    head_lag=head_lag,
    backward_lags=tuple(backward_lags),
    embed_gap=embed_gap,
    stage_gaps=tuple(stage_gaps),
    compensation=comp,
  )
  return placement.make_schedule(
    'ouroboros',
    model,
    ring.mesh,
    functools.partial(_init, ring),
    functools.partial(_step, ring),
    idle_fraction(num_stages, forward=config.forward),
  )


# -- one step on one device of the ring: the four steps of the algorithm ---------------------------


class _Forwarded(NamedTuple):
  """What the forward wave and the head of one step leave on a device."""

  kept_M: Any  # what the stash keeps of each of this step's micro-batches
  memory_M: Any  # the model's renewed memory, micro-batch by micro-batch (None without one)
  loss: jax.Array  # device 0: the head's loss of its batch
  g_head: Any  # device 0: the head's gradient ...
  g_embed: Any  # ... and the tied embedding's head-side gradient, both fresh
  delta_fresh_M: jax.Array  # device 0: the head's delta_{G-1} of each micro-batch
  sent_M: jax.Array  # pipelined: each micro-batch's output, received during step t + 1


def _ring_step(ring: _Ring, params, forward_params, buffers, batch, t):
  """Step t of the ring on device s (inside the shard_map): (grads, new buffers, loss)."""
  s, depth = jax.lax.axis_index(STAGE), ring.depth
  backward_batch = t - jnp.asarray(ring.backward_lags)[s]  # the batch group s back-propagates
  forward_batch = t - s if ring.pipelined else t  # the batch group s forwards
  local = lambda tree: jax.tree.map(lambda a: a[0, 0], tree)
  kept_buffers = buffers.get(placement.HOST, buffers)  # offloaded, or beside the others
  stash_S, weights_S = local(kept_buffers['stash']), local(kept_buffers.get('weights'))
  batches_S = local(buffers['batches'])

  # 0. Read what the delayed backward and the head need *before* this step writes its own
  #    slots. With G > 1 every lag is >= 1, so the slots differ, and reading first lets XLA
  #    (on CPU with host.CPU_XLA_FLAGS) update the buffers in place instead of copying them.
  read = lambda: ring_lib.read_slot(
    (stash_S, weights_S, batches_S['inputs']), backward_batch, depth
  )
  if ring.num_stages > 1:
    pending = read()
  head_targets = (
    batch['targets']
    if ring.head_lag == 0
    else ring_lib.read_slot(batches_S['targets'], t - ring.head_lag, depth)
  )
  batches_S = ring_lib.write_slot(batches_S, batch, t, depth)
  if weights_S is not None:  # graph: the backward differentiates at the forward's weights
    forward_s = ring_lib.local_stage_params(forward_params)
    weights_S = ring_lib.write_slot(weights_S, forward_s, forward_batch, depth)

  # 1. Forward and 2. head, one micro-batch at a time.
  seen = {'inputs': batch['inputs'], 'targets': head_targets}
  fwd = _forward_wave(ring, params, forward_params, buffers, seen, t)
  # One write of the slot after the wave, rather than the stash carried through it: a loop's
  # carry is a buffer of its own, and carrying the stash would cost copies of all of it.
  stash_S = ring_lib.write_slot(stash_S, fwd.kept_M, forward_batch, depth)
  if ring.num_stages == 1:  # lag 0: the backward needs what was just kept
    pending = read()

  # 3. Backward, all devices at once, with the error gradient received during step t - 1.
  received_M = (
    fwd.delta_fresh_M
    if ring.num_stages == 1
    else ring_lib.microbatches(_local(buffers['delta']), ring.num_microbatches)
  )
  g_stage, g_embed_stale, delta_next_M = _backward_chain(
    ring, params, pending, (received_M, fwd.delta_fresh_M), backward_batch, t
  )

  # 4. Gradients, each on the device that owns it (embed and head live on device 0).
  g_embed = jax.tree.map(jnp.add, fwd.g_embed, g_embed_stale)
  t_async = t - ring.config.sync_warmup_steps
  if ring.config.tied_grad == 'mean' and ring.model.tied_embedding:
    both = t_async >= ring.backward_lags[0]
    g_embed = jax.tree.map(lambda g: jnp.where(both, 0.5 * g, g), g_embed)
  grads, loss = ring_lib.gather_grads(g_embed, fwd.g_head, g_stage, fwd.loss)
  kept = {'stash': stash_S} if weights_S is None else {'stash': stash_S, 'weights': weights_S}
  written = {'batches': batches_S, 'kept': kept}
  new_buffers = _new_buffers(ring, buffers, fwd, written, delta_next_M, t)
  return grads, jax.tree.map(lambda a: a[None, None], new_buffers), loss


def _forward_wave(ring: _Ring, params, forward_params, buffers, seen, t) -> _Forwarded:
  """Steps 1 and 2 on device s: the forward of this step's micro-batches and the head on each.

  Locked: a wave in which group s forwards micro-batch r - s in round r (only device 0 in
  round 0, as in the paper when M = 1), so the forward takes M + G - 1 rounds of 1/M of the
  work. Pipelined: every group forwards micro-batch r in round r, on what its predecessor sent
  during step t - 1. The head runs on device 0 on each micro-batch of its batch as it arrives:
  fresh loss, head gradient and delta_{G-1}, each 1/M of the batch's. `seen` holds the batch's
  inputs and the targets of the batch the head sees."""
  model, stash, num_stages, num_micro = (
    ring.model,
    ring.stash,
    ring.num_stages,
    ring.num_microbatches,
  )
  pipelined, s = ring.pipelined, jax.lax.axis_index(STAGE)
  t_async = t - ring.config.sync_warmup_steps
  cut = lambda tree: ring_lib.microbatches(tree, num_micro)
  forward_s = ring_lib.local_stage_params(forward_params)  # = params_s unless predicted
  inputs_M, targets_M = cut(seen['inputs']), cut(seen['targets'])
  received_M = cut(_local(buffers['act'])) if pipelined else None
  memory_M = cut(ring_lib.local_memory(buffers))  # or None
  x_like = jax.eval_shape(lambda: ring_lib.embed(model, forward_params['embed'], inputs_M[0], None))
  b_f = t - s if pipelined else t  # the batch group s forwards
  key_f = ring.key(b_f)
  run_forward = lambda x, m, mem: stash.forward(forward_s, x, s, ring.micro_key(key_f, m), mem, b_f)
  first_memory = jax.tree.map(lambda a: a[0], memory_M)
  no_kept = _zeros(jax.eval_shape(run_forward, x_like, 0, first_memory)[1])
  head_zeros = _zeros(jax.eval_shape(lambda: ring_lib.head(model, params, x_like, targets_M[0])))

  def forward_round(r, carry):
    received, kept_M, memory_M, head_sum, delta_fresh_M, sent_M = carry
    m = r if pipelined else r - s
    active = (m >= 0) & (m < num_micro)
    m = jnp.clip(m, 0, num_micro - 1)
    x0 = ring_lib.embed(model, forward_params['embed'], inputs_M[m], ring.micro_key(ring.key(t), m))
    x = ring_lib.select(s == 0, x0, ring_lib.at(received_M, m) if pipelined else received)
    memory = ring_lib.at(memory_M, m)
    y, kept, memory = jax.lax.cond(
      active, run_forward, lambda x, m, mem: (x, no_kept, mem), x, m, memory
    )
    kept_M = ring_lib.set_where(kept_M, m, kept, active)
    memory_M = jax.tree.map(lambda a, new: a.at[m].set(new), memory_M, memory)
    sent = ring_lib.send_forward(y, num_stages)
    if pipelined:  # to be received during step t + 1; the head reads last step's
      sent_M = ring_lib.set_at(sent_M, m, sent)
      m_h, x_h = r, ring_lib.at(received_M, r)
    else:  # group G-1's output of micro-batch r - (G - 1) has just reached device 0
      m_h, x_h = r - (num_stages - 1), sent
    head_on = (m_h >= 0) & (t_async >= ring.head_lag)
    m_h = jnp.clip(m_h, 0, num_micro - 1)
    loss, g_head, g_embed, delta = ring_lib.head(
      model, params, x_h, targets_M[m_h], 1.0 / num_micro, when=head_on
    )
    head_sum = jax.tree.map(jnp.add, head_sum, (loss, g_head, g_embed))
    delta_fresh_M = ring_lib.set_where(delta_fresh_M, m_h, delta, head_on)
    return sent, kept_M, memory_M, head_sum, delta_fresh_M, sent_M

  rounds = num_micro if pipelined else num_micro + num_stages - 1
  zeros_M = jax.tree.map(lambda a: jnp.zeros((num_micro, *a.shape), a.dtype), x_like)
  carry = (
    _zeros(x_like),
    jax.tree.map(lambda a: jnp.zeros((num_micro, *a.shape), a.dtype), no_kept),
    memory_M,
    head_zeros[:3],
    zeros_M,
    zeros_M,
  )
  _, kept_M, memory_M, (loss, g_head, g_embed), delta_fresh_M, sent_M = jax.lax.fori_loop(
    0, rounds, forward_round, carry
  )
  return _Forwarded(kept_M, memory_M, loss, g_head, g_embed, delta_fresh_M, sent_M)


def _backward_chain(ring: _Ring, params, pending, deltas, backward_batch, t):
  """Step 3 on device s, one micro-batch at a time: group s finishes batch `backward_batch`
  (t - (G - s); pipelined t - (2G - s)) from `pending` (its stash, weights and inputs of that
  batch) and the error gradients `deltas` (received during step t - 1; the head's fresh ones).
  Module 1 ends at the embedding: device 0 turns dx into V's stale input-side gradient. The one
  hop of the backward: s hands dx to s - 1; device 0 hands the head's delta to G - 1.
  Returns (stage gradient, embedding gradient, the deltas sent, by micro-batch)."""
  model, stash, s = ring.model, ring.stash, jax.lax.axis_index(STAGE)
  stash_b, weights_b, inputs_b = pending
  received_M, delta_fresh_M = deltas
  valid = t - ring.config.sync_warmup_steps >= jnp.asarray(ring.backward_lags)[s]  # pipe full
  inputs_b_M = ring_lib.microbatches(inputs_b, ring.num_microbatches)
  key_b = ring.key(backward_batch)
  params_s = ring_lib.local_stage_params(params)
  at_weights = params_s if weights_b is None else weights_b  # replay: the current weights

  def backward_micro(m, carry):
    g_stage, g_embed, delta_next_M = carry
    key_m = ring.micro_key(key_b, m)
    kept, delta = ring_lib.at(stash_b, m), ring_lib.at(received_M, m)
    g_m, dx = ring_lib.mask(
      valid, stash.backward(at_weights, kept, delta, s, key_m, backward_batch)
    )
    g_embed_m = ring_lib.embed_backward(model, params['embed'], inputs_b_M[m], key_m, dx)
    sent = ring_lib.send_backward(
      ring_lib.select(s == 0, ring_lib.at(delta_fresh_M, m), dx), ring.num_stages
    )
    add = lambda a, b: jax.tree.map(jnp.add, a, b)
    return add(g_stage, g_m), add(g_embed, g_embed_m), ring_lib.set_at(delta_next_M, m, sent)

  one = lambda tree: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), tree)
  backward_shapes = lambda kept, x: stash.backward(at_weights, kept, x, s, key_b, backward_batch)
  no_grad = _zeros(jax.eval_shape(backward_shapes, one(stash_b), one(received_M)))
  zeros_M = _zeros(received_M)
  return jax.lax.fori_loop(
    0, ring.num_microbatches, backward_micro, (no_grad[0], _zeros(params['embed']), zeros_M)
  )


def _new_buffers(ring: _Ring, buffers, fwd: _Forwarded, written, delta_next_M, t):
  """The ring buffers this step leaves for the next one, on device s (`written`: the batches
  and the stash with this step's slots written)."""
  kept = written['kept']
  new_buffers = {'batches': written['batches'], 'delta': ring_lib.whole_batch(delta_next_M)}
  if placement.HOST in buffers:
    new_buffers[placement.HOST] = kept
  else:
    new_buffers.update(kept)
  if ring.pipelined:
    new_buffers['act'] = ring_lib.whole_batch(fwd.sent_M)
  if fwd.memory_M is not None:
    new_memory = ring_lib.whole_batch(fwd.memory_M)
    if ring.pipelined:  # while the pipe fills, group s forwards nothing real (t_async < s)
      s, t_async = jax.lax.axis_index(STAGE), t - ring.config.sync_warmup_steps
      old = ring_lib.local_memory(buffers)
      new_memory = jax.tree.map(lambda a, b: jnp.where(t_async >= s, a, b), new_memory, old)
    new_buffers['memory'] = new_memory
  return new_buffers


def _zeros(shapes):
  return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes)


def _local(buffer):
  """This device's entry of a ring buffer [G, R, ...] (its stage and data replica)."""
  return jax.tree.map(lambda a: a[0, 0], buffer)


# -- the state and the step --------------------------------------------------------------------


def _init(ring: _Ring, params, example_batch):
  """The fresh TrainState, with zeroed ring buffers [G, R, ...]: the stash [slots, M, ...] and,
  graph, the forward's weights [slots, ...]; the batches in flight [slots, ...]; the error
  gradient (and, pipelined, the activation) in flight; and a model's empty memory, if any."""
  replicas, num_stages, num_micro = (
    ring.config.data_parallel,
    ring.num_stages,
    ring.num_microbatches,
  )
  placement.check_batch(example_batch, replicas, num_micro)
  local = jax.tree.map(
    lambda a: jax.ShapeDtypeStruct((a.shape[0] // replicas, *a.shape[1:]), a.dtype), example_batch
  )
  micro = jax.tree.map(
    lambda a: jax.ShapeDtypeStruct((a.shape[0] // num_micro, *a.shape[1:]), a.dtype), local
  )
  params_s = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), params['stages'])
  x = jax.eval_shape(ring.model.embed, params['embed'], local['inputs'], None)
  x_micro = jax.eval_shape(ring.model.embed, params['embed'], micro['inputs'], None)
  memory = jax.eval_shape(
    lambda: placement.empty_memory(ring.model, params, example_batch, replicas)
  )
  memory_micro = jax.tree.map(  # one micro-batch's rows of one device's memory, for the shapes
    lambda a: jax.ShapeDtypeStruct((a.shape[2] // num_micro, *a.shape[3:]), a.dtype),
    memory.get('memory'),
  )
  # Stage index and key traced, as in the step: what a graph stash keeps can depend on it.
  _, kept, _ = jax.eval_shape(
    ring.stash.forward,
    params_s,
    x_micro,
    jnp.int32(0),
    jax.random.key(0),
    memory_micro,
    jnp.int32(0),
  )
  buffer = lambda a, *lead: jnp.zeros((num_stages, replicas, *lead, *a.shape), a.dtype)

  def fresh_buffers():
    stash = {'stash': jax.tree.map(lambda a: buffer(a, ring.depth, num_micro), kept)}
    if ring.stash.at_forward_weights:  # the weights each batch in flight was forwarded with
      stash['weights'] = jax.tree.map(lambda a: buffer(a, ring.depth), params_s)
    buffers = {
      **placement.empty_memory(ring.model, params, example_batch, replicas),
      'batches': jax.tree.map(lambda a: buffer(a, ring.depth), local),
      'delta': jax.tree.map(buffer, x),
    }
    if ring.config.stash_memory == 'pinned_host':  # waits in host memory (placement.HOST)
      buffers[placement.HOST] = stash
    else:
      buffers.update(stash)
    if ring.pipelined:  # the activation in flight to each device
      buffers['act'] = jax.tree.map(buffer, x)
    return buffers

  return placement.init_state(ring.optimizer, params, ring.mesh, fresh_buffers)


def _grads(ring: _Ring, state: TrainState, forward_params, batch, t, t_async):
  """(grads, ring buffers, loss): the delayed gradients, or during the synchronous warm-up
  model_parallel's exact ones over the same ring (the pipes stay empty)."""
  param_specs = placement.param_specs(state.params)
  buffer_specs = placement.ring_specs(state.ring)
  delayed = jax.shard_map(
    functools.partial(_ring_step, ring),
    mesh=ring.mesh,
    in_specs=(param_specs, param_specs, buffer_specs, placement.batch_spec(batch), P()),
    out_specs=(param_specs, buffer_specs, P()),
    check_vma=False,
  )

  def ouroboros_grads():
    return delayed(state.params, forward_params, state.ring, batch, t)

  def locked(params, batch, t, buffers):  # micro-batch by micro-batch, summed
    num_micro = ring.num_microbatches
    batch_M = ring_lib.microbatches(batch, num_micro)
    memory_M = ring_lib.microbatches(ring_lib.local_memory(buffers), num_micro)

    def micro(m, carry):
      grads, loss, memory_M = carry
      memory = ring_lib.at(memory_M, m)
      grads_m, loss_m, memory = ring_lib.locked_grads(
        ring.model, params, ring_lib.at(batch_M, m), ring.micro_key(ring.key(t), m), t, memory
      )
      memory_M = jax.tree.map(lambda a, new: a.at[m].set(new), memory_M, memory)
      add = lambda total, g: total + g / num_micro
      return jax.tree.map(add, grads, grads_m), add(loss, loss_m), memory_M

    no_grads = _zeros({k: params[k] for k in ('embed', 'stages', 'head')})
    grads, loss, memory_M = jax.lax.fori_loop(
      0, num_micro, micro, (no_grads, jnp.zeros(()), memory_M)
    )
    return grads, ring_lib.with_memory(buffers, ring_lib.whole_batch(memory_M)), loss

  def warmup_grads():  # the pipes stay empty; a memory follows the batches
    synchronous = jax.shard_map(
      locked,
      mesh=ring.mesh,
      in_specs=(param_specs, placement.batch_spec(batch), P(), buffer_specs),
      out_specs=(param_specs, buffer_specs, P()),
      check_vma=False,
    )
    return synchronous(state.params, batch, t, state.ring)

  if ring.config.sync_warmup_steps:
    return jax.lax.cond(t_async < 0, warmup_grads, ouroboros_grads)
  return ouroboros_grads()


def _step(ring: _Ring, state: TrainState, batch: dict):
  placement.check_batch(batch, ring.config.data_parallel, ring.num_microbatches)
  model, t = ring.model, state.step
  t_async = t - ring.config.sync_warmup_steps
  warm = t_async < 0
  # Each group's version gap, 0 during the synchronous warm-up. The tied embedding counts as
  # fresh for the update (it gets the head's fresh gradient every step); its forward in module 1
  # is predicted with module 1's gap.
  no_gap = lambda gap: jnp.where(warm, 0, gap)
  gap_G = jnp.asarray(ring.stage_gaps)
  delays = {
    'embed': no_gap(0 if model.tied_embedding else ring.embed_gap),
    'stages': no_gap(gap_G),
    'head': jnp.int32(0),
  }
  forward_params = state.params
  if ring.compensation.predict:
    forward_params = compensation.predict_weights(
      state.params,
      state.opt_state,
      {'embed': no_gap(ring.embed_gap), 'stages': no_gap(gap_G), 'head': 0},
    )
  grads, buffers, loss = _grads(ring, state, forward_params, batch, t, t_async)

  # A module starts updating once its first gradient exists (t_async >= its lag).
  head_ready = warm | (t_async >= ring.head_lag)
  ready = {
    'embed': (head_ready & model.tied_embedding) | warm | (t_async >= ring.backward_lags[0]),
    'stages': warm | (t_async >= jnp.asarray(ring.backward_lags)),
    'head': head_ready,
  }
  params, opt_state, grad_norm = ring.optimizer.apply(
    state.params, state.opt_state, grads, ready, delays if ring.compensation.active else None
  )
  new_state = state.replace(step=t + 1, params=params, opt_state=opt_state, ring=buffers)
  loss_batch = jnp.where(warm, t, t - ring.head_lag)
  return new_state, {'loss': loss, 'loss_batch': loss_batch, 'grad_norm': grad_norm}
