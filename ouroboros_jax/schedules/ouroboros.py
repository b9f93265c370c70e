"""Ouroboros: delayed-gradient model parallelism on a ring of devices.

Yang, Huo, Wang, Huang, Carin. "Ouroboros: On Accelerating Training of Transformer-Based Language
Models", NeurIPS 2019. The paper published no code; this is its schedule written out exactly.

Placement (the paper's Figure 2). The model is cut into K = G + 1 modules on G devices of the
mesh axis `stage`. Module 1 (embedding V and layer group 0) and module K (final norm, output
projection V^T, softmax loss) share device 0, because V is tied; modules 2..K-1 (layer groups
1..G-1) sit on devices 1..G-1. Activations go 0 -> 1 -> ... -> G-1 -> 0, error gradients go the
other way: the ring is the snake that eats its tail. Layer group s is module k = s + 1.

At every step t (batch x_t is drawn at step t):

  1. Forward, locked (as in the paper and in DDG): batch t runs through groups 0..G-1 in order
     with the current weights; device s stashes what its delayed backward will need.
  2. Head (module K, device 0): loss_t, the head's gradient and delta_{G-1}^t, all fresh.
  3. Backward, every device at once: group s back-propagates batch t - (G - s) with the error
     gradient it received during step t - 1 and its stash of that batch. Module k's staleness is
     K - k = G - s: the head is fresh, group G-1 is 1 step stale, module 1 is G steps stale. The
     only thing that crosses devices in the backward is one ring hop: device s sends its input
     gradient to s - 1, and device 0 sends the head's fresh delta to G - 1, for the next step.
  4. Update: every module applies its own gradient with its own optimizer state. Group s has no
     gradient during its first G - s steps and does not update then. The tied V gets the head's
     fresh gradient of batch t plus module 1's stale input-embedding gradient of batch t - G,
     summed (`tied_grad='mean'` halves the sum once both exist).

Stash modes (what a device keeps between the forward of a batch and its delayed backward):
  graph   the forward's VJP residuals (as DDG): the gradient is taken at forward-time weights.
  replay  only the group's input (as Features Replay): the backward re-runs the forward at the
          current weights and takes the VJP there; one extra forward, far less memory.

Device s needs G - s + 1 stash slots (batches t - (G - s) .. t); SPMD gives every device the same
buffer shape, so each holds G + 1 slots and device s uses G - s + 1 of them. The embedding's
backward needs only the batch's tokens (its gradient does not depend on its weights), which are
stashed too. Stashes and the in-flight error gradient are part of `TrainState.ring`: they are
checkpointed, so a resumed run continues the same trajectory.

The pipelined forward (`forward='pipelined'`, beyond the paper; docs/design.md). In the
locked forward every device waits G - 1 rounds per step for its input. Pipelined, device s instead
forwards at step t what its predecessor produced at step t - 1, so every device runs one forward
and one backward per step at the same time and the step time approaches (F + B) / G. Counting one
ring hop per step, at step t:

  group s forwards batch t - s        (group 0 embeds batch t itself)
  the head sees batch t - G           (group G-1's output needs one more hop, back to device 0)
  group s back-propagates batch t - 2G + s   (the head's delta reaches G-1 one step later, then
                                              one more step per group on the way down)

so group s's gradient is 2G - s steps stale (the head G steps), group s keeps 2(G - s) + 1
batches in flight (every device holds 2G + 1 slots), and the forward of one batch itself uses
weights of different steps in different groups (as in PipeDream). A group starts updating at step
2G - s, the head at step G; the tied V gets the head's gradient of batch t - G plus module 1's of
batch t - 2G. `metrics['loss_batch']` says which batch a reported loss belongs to (t - G).
`reference.py` runs the same schedule with Python deques; the tests compare the two.

G = 1 puts every module on one device; there is no hop to wait for, so the step is plain backprop
(with either forward).
With `sync_warmup_steps = N` the first N steps are plain synchronous backprop over the same
placement (the `model_parallel` step: locked forward, locked backward, `ring.locked_grads`), and
the delayed schedule starts at step N with empty pipes.

The pieces it shares with `model_parallel` (stash, locked forward, head, embedding backward,
gathering the gradients) live in `ring.py`.

Everything runs inside one `jax.shard_map` over (stage, data): with data parallelism each data
replica runs its own ring on its share of the batch, and gradients are averaged over `data`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from ouroboros_jax import staged
from ouroboros_jax.schedules import compensation
from ouroboros_jax.schedules import ring as ring_lib
from ouroboros_jax.schedules.delays import lags, version_gaps
from ouroboros_jax.staged import STAGE, Schedule, StagedModel, TrainState


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
  tx: optax.GradientTransformation  # wrapped with the update-side compensations
  stash: ring_lib.Stash  # what a device keeps of each batch until its delayed backward
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
  embed_gap, stage_gaps = version_gaps(num_stages, config.forward)
  if num_stages == 1:  # no delay, nothing to compensate: exactly the paper's G = 1 step
    comp = compensation.Compensation()
  ring = _Ring(
    config=config,
    model=model,
    tx=compensation.wrap(comp, tx, max([embed_gap, *stage_gaps])),
    stash=ring_lib.Stash(model, config.stash, config.stash_policy),
    mesh=staged.make_mesh(num_stages, config.data_parallel, devices),
    head_lag=head_lag,
    backward_lags=tuple(backward_lags),
    embed_gap=embed_gap,
    stage_gaps=tuple(stage_gaps),
    compensation=comp,
  )
  return staged.make_schedule(
    'ouroboros',
    model,
    ring.mesh,
    functools.partial(_init, ring),
    functools.partial(_step, ring),
    idle_fraction(num_stages, forward=config.forward),
  )


# -- one step on one device of the ring: the four steps of the algorithm ---------------------------


def _ring_step(ring: _Ring, params, forward_params, buffers, batch, t, t_async):
  model, stash, num_stages, depth = ring.model, ring.stash, ring.num_stages, ring.depth
  s = jax.lax.axis_index(STAGE)
  params_s = ring_lib.local_stage_params(params)
  forward_s = ring_lib.local_stage_params(forward_params)  # = params_s unless predicted
  stash_S, batches_S = jax.tree.map(lambda a: a[0, 0], (buffers['stash'], buffers['batches']))
  memory = ring_lib.local_memory(buffers)  # this group's memory (Transformer-XL), or None
  lag = jnp.asarray(ring.backward_lags)[s]
  valid = t_async >= lag  # no gradient before the pipe has filled
  batch_index = t - lag  # the batch group s back-propagates now

  # 0. Read what the delayed backward and the head need *before* this step writes its own
  #    slots. With G > 1 every lag is >= 1, so the slots differ, and reading first lets XLA
  #    (on CPU with host.CPU_XLA_FLAGS) update the buffers in place instead of copying them.
  if num_stages > 1:
    stash_b, inputs_b = ring_lib.read_slot((stash_S, batches_S['inputs']), batch_index, depth)
  targets_h = (
    batch['targets']
    if ring.head_lag == 0
    else ring_lib.read_slot(batches_S['targets'], t - ring.head_lag, depth)
  )
  batches_S = ring_lib.write_slot(batches_S, batch, t, depth)

  # 1. Forward. Locked: batch t through every group, in G rounds where only device r computes.
  #    Pipelined: every group at once, each on what its predecessor sent during step t - 1.
  x = ring_lib.embed(model, forward_params['embed'], batch['inputs'], ring.key(t))
  if ring.pipelined:  # x_head: group G-1's output of batch t - G
    forward_batch = t - s
    x_head, kept, new_memory, act_next = ring_lib.pipelined_forward(
      stash, forward_s, x, buffers['act'][0, 0], ring.key(forward_batch), num_stages, memory
    )
    # While the pipe fills, group s forwards nothing real (t_async < s): its memory stays.
    new_memory = jax.tree.map(
      lambda new, old: jnp.where(t_async >= s, new, old), new_memory, memory
    )
  else:
    forward_batch = t
    x_head, kept, new_memory = ring_lib.locked_forward(
      stash, forward_s, x, ring.key(t), num_stages, memory
    )
  stash_S = ring_lib.write_slot(stash_S, kept, forward_batch, depth)
  if num_stages == 1:  # lag 0: the backward needs what was just kept
    stash_b, inputs_b = kept, batch['inputs']

  # 2. Head (module K, on device 0): fresh loss, head gradient and delta_{G-1} of its batch.
  loss, g_head, g_embed_fresh, delta_fresh = ring_lib.mask(
    t_async >= ring.head_lag, ring_lib.head(model, params, x_head, targets_h)
  )

  # 3. Backward, all devices at once: group s finishes batch t - (G - s) (pipelined: 2G - s).
  delta = delta_fresh if num_stages == 1 else buffers['delta'][0, 0]
  key_b = ring.key(batch_index)
  g_stage, dx = ring_lib.mask(valid, stash.backward(params_s, stash_b, delta, s, key_b))
  # Module 1 ends at the embedding: device 0 turns dx into V's stale input-side gradient.
  g_embed_stale = ring_lib.embed_backward(model, params['embed'], inputs_b, key_b, dx)
  # The one hop of the backward: s hands dx to s - 1; device 0 hands the head's delta to G - 1.
  delta_next = ring_lib.send_backward(jnp.where(s == 0, delta_fresh, dx), num_stages)

  # 4. Gradients, each on the device that owns it (embed and head live on device 0).
  g_embed = jax.tree.map(jnp.add, g_embed_fresh, g_embed_stale)
  if ring.config.tied_grad == 'mean' and model.tied_embedding:
    both = t_async >= ring.backward_lags[0]
    g_embed = jax.tree.map(lambda g: jnp.where(both, 0.5 * g, g), g_embed)
  grads, loss = ring_lib.gather_grads(g_embed, g_head, g_stage, loss)
  new_buffers = {'stash': stash_S, 'batches': batches_S, 'delta': delta_next}
  if ring.pipelined:
    new_buffers['act'] = act_next
  if new_memory is not None:
    new_buffers['memory'] = new_memory
  return grads, jax.tree.map(lambda a: a[None, None], new_buffers), loss


# -- the state and the step --------------------------------------------------------------------


def _init(ring: _Ring, params, example_batch):
  """The fresh TrainState, with zeroed ring buffers [G, R, slots, ...] for the stash, the
  batches in flight and the error gradient (and, pipelined, the activation) in flight; and a
  model's empty memory [G, R, ...] if it has one."""
  replicas, num_stages = ring.config.data_parallel, ring.num_stages
  staged.check_batch(example_batch, replicas, 'the data-parallel degree')
  local = jax.tree.map(
    lambda a: jax.ShapeDtypeStruct((a.shape[0] // replicas, *a.shape[1:]), a.dtype), example_batch
  )
  params_s = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), params['stages'])
  x = jax.eval_shape(ring.model.embed, params['embed'], local['inputs'], None)
  memory = staged.empty_memory(ring.model, params, example_batch, replicas)
  memory_s = jax.tree.map(lambda a: a[0, 0], memory.get('memory'))
  # Stage index and key traced, as in the step: what a graph stash keeps can depend on it.
  _, kept, _ = jax.eval_shape(
    ring.stash.forward, params_s, x, jnp.int32(0), jax.random.key(0), memory_s
  )
  buffer = lambda a, *lead: jnp.zeros((num_stages, replicas, *lead, *a.shape), a.dtype)

  def fresh_buffers():
    buffers = {
      **staged.empty_memory(ring.model, params, example_batch, replicas),
      'stash': jax.tree.map(lambda a: buffer(a, ring.depth), kept),
      'batches': jax.tree.map(lambda a: buffer(a, ring.depth), local),
      'delta': buffer(x),
    }
    if ring.pipelined:  # the activation in flight to each device
      buffers['act'] = buffer(x)
    return buffers

  return staged.init_state(ring.tx, params, ring.mesh, fresh_buffers, ring.model.shared)


def _grads(ring: _Ring, state: TrainState, forward_params, batch, t, t_async):
  """(grads, ring buffers, loss): the delayed gradients, or during the synchronous warm-up
  model_parallel's exact ones over the same ring (the pipes stay empty)."""
  param_specs = staged.param_specs(state.params)
  buffer_specs = staged.ring_specs(state.ring)
  delayed = jax.shard_map(
    functools.partial(_ring_step, ring),
    mesh=ring.mesh,
    in_specs=(param_specs, param_specs, buffer_specs, staged.batch_spec(batch), P(), P()),
    out_specs=(param_specs, buffer_specs, P()),
    check_vma=False,
  )

  def ouroboros_grads():
    return delayed(state.params, forward_params, state.ring, batch, t, t_async)

  def locked(params, batch, t, buffers):
    memory = ring_lib.local_memory(buffers)
    grads, loss, memory = ring_lib.locked_grads(
      ring.model, params, batch, ring.key(t), ring.num_stages, memory
    )
    return grads, ring_lib.with_memory(buffers, memory), loss

  def warmup_grads():  # the pipes stay empty; a memory follows the batches
    synchronous = jax.shard_map(
      locked,
      mesh=ring.mesh,
      in_specs=(param_specs, staged.batch_spec(batch), P(), buffer_specs),
      out_specs=(param_specs, buffer_specs, P()),
      check_vma=False,
    )
    return synchronous(state.params, batch, t, state.ring)

  if ring.config.sync_warmup_steps:
    return jax.lax.cond(t_async < 0, warmup_grads, ouroboros_grads)
  return ouroboros_grads()


def _step(ring: _Ring, state: TrainState, batch: dict):
  staged.check_batch(batch, ring.config.data_parallel, 'the data-parallel degree')
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
  params, opt_state, grad_norm = staged.apply_gradients(
    ring.tx,
    state.params,
    state.opt_state,
    grads,
    clip_norm=ring.config.clip_norm,
    embed_ready=(head_ready & model.tied_embedding) | warm | (t_async >= ring.backward_lags[0]),
    stages_ready_G=warm | (t_async >= jnp.asarray(ring.backward_lags)),
    head_ready=head_ready,
    delays=delays if ring.compensation.active else None,
    shared=model.shared,
  )
  new_state = state.replace(step=t + 1, params=params, opt_state=opt_state, ring=buffers)
  loss_batch = jnp.where(warm, t, t - ring.head_lag)
  return new_state, {'loss': loss, 'loss_batch': loss_batch, 'grad_norm': grad_norm}
