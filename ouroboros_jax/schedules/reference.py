"""A slow, single-device Ouroboros written straight from the equations (docs/design.md).

A Python loop over steps and over modules, with explicit deques: `stashes[s]` holds what group s
kept of every batch still in flight, `inbox[s]` the error gradient for group s's output that
arrived during the previous step. Nothing is sharded, nothing is jitted: it exists so the tests
can check the real schedule (`ouroboros.py`) number for number. (The model's pieces and the
optimizer update are each jitted on their own, only so that the loop runs in seconds.)
"""

from __future__ import annotations

import collections
import dataclasses

import jax
import jax.numpy as jnp

from ouroboros_jax import staged
from ouroboros_jax.errors import ConfigError, field_ref
from ouroboros_jax.schedules.config import ResolvedSchedule, ScheduleConfig
from ouroboros_jax.schedules.delays import Timing
from ouroboros_jax.staged import EMBED_PIECE
from ouroboros_jax.update import GroupedOptimizer


class SlowCompensation:
  """The staleness compensations written straight from their formulas (compensation.py cites
  them), one module group at a time, with Python lists for what they remember:

    shrink      g <- shrink * g                                       if the gradient is delayed
    DC-ASGD-a   g <- g + lambda0 / sqrt(MS(g)) * g * g * (w_now - w_then),
                MS(g) <- 0.95 MS(g) + 0.05 g * g,  w_then = the weights `delay` updates ago
    base        u <- tx(g)
    PipeMare    u <- u / max(delay, 1)^(1 - min(n / T, 1)),  n = the group's updates so far
    prediction  the forward runs at w + h * gap * (w(t) - w(t-1)), the group's latest step,
                h = predict_horizon (1: the gap itself)

  A group that is not ready keeps its weights and everything it remembers.
  """

  def __init__(self, compensation, tx, params, clip_norm):
    self.comp, self.clip_norm = compensation, clip_norm
    self.tx_update = jax.jit(tx.update)
    groups = self.split(params)
    self.opt = {k: tx.init(p) for k, p in groups.items()}
    self.history = {k: [p] for k, p in groups.items()}  # history[k][n]: after n updates
    self.mean_square = {k: jax.tree.map(jnp.zeros_like, p) for k, p in groups.items()}
    self.latest = {k: jax.tree.map(jnp.zeros_like, p) for k, p in groups.items()}

  @staticmethod
  def split(params):
    groups = {'embed': params['embed'], 'head': params['head']}
    for s in range(staged.stage_count(params)):
      groups[s] = jax.tree.map(lambda a, s=s: a[s], params['stages'])
    return groups

  @staticmethod
  def join(groups, num_stages):
    return {
      'embed': groups['embed'],
      'head': groups['head'],
      'stages': jax.tree.map(lambda *a: jnp.stack(a), *[groups[s] for s in range(num_stages)]),
    }

  def predicted(self, params, gaps):
    """params with group k moved by gaps[k] times its latest step (gaps: group -> int)."""
    groups = self.split(params)
    for k, gap in gaps.items():
      if self.comp.predict and gap:
        h = self.comp.predict_horizon
        groups[k] = jax.tree.map(lambda w, u, g=h * gap: w + g * u, groups[k], self.latest[k])
    return self.join(groups, staged.stage_count(params))

  def apply(self, params, grads, ready, delays):
    num_stages = staged.stage_count(params)
    norm = float(jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree.leaves(grads))))
    scale = min(1.0, self.clip_norm / (norm + 1e-6)) if self.clip_norm else 1.0
    groups, grad_groups = self.split(params), self.split(grads)
    for k, w in groups.items():
      if not ready[k]:
        continue
      g, delay = jax.tree.map(lambda x: x * scale, grad_groups[k]), delays[k]
      n = len(self.history[k]) - 1
      if delay > 0 and self.comp.shrink != 1.0:
        g = jax.tree.map(lambda x: self.comp.shrink * x, g)
      if self.comp.dc_lambda:
        self.mean_square[k] = jax.tree.map(
          lambda m, x: 0.95 * m + 0.05 * x * x, self.mean_square[k], g
        )
        w_then = self.history[k][max(n - delay, 0)]
        g = jax.tree.map(
          lambda x, m, a, b: x + self.comp.dc_lambda / jnp.sqrt(m + 1e-7) * x * x * (a - b),
          g,
          self.mean_square[k],
          w,
          w_then,
        )
      u, self.opt[k] = self.tx_update(g, self.opt[k], w)
      if self.comp.pipemare_steps:
        u = jax.tree.map(
          lambda x: x * max(delay, 1) ** -(1 - min(n / self.comp.pipemare_steps, 1.0)), u
        )
      new_w = jax.tree.map(jnp.add, w, u)
      self.latest[k] = jax.tree.map(jnp.subtract, new_w, w)
      self.history[k].append(new_w)
      groups[k] = new_w
    return self.join(groups, num_stages)


def run(
  model: staged.StagedModel,
  tx,
  params,
  batches,
  config: ScheduleConfig | None = None,
  *,
  drain: bool = False,
  **fields,
):
  """Trains on `batches` in order; returns (params, losses, updated).

  drain=True: then steps on with no new item entering until no stash, inbox or message holds
  anything (a pipeline's flush: the schedule's `drain`), each step as any step.

  `config`: the Ouroboros settings as `build_schedule` takes them, the one record of a schedule's
  settings (or its fields as keywords: `ScheduleConfig(name='ouroboros', num_stages=G, **fields)`
  with G the params' groups). Its `auto`s resolve as the schedule resolves them
  (`ScheduleConfig.resolve` on JAX's backend and the batches' rows): the compensation is the
  recipe on a delayed ring, `Compensation()` the paper's method. Its staleness compensation runs
  as `SlowCompensation` writes it, with `tx` as the base optimizer. The reference is one replica.

  losses[t] is the loss the head computed at step t (None while the pipe fills), updated[t] lists
  the groups ('embed', 0..G-1, 'head') that changed their weights at step t.

  forward='locked': batch t runs through every group at step t (the paper).
  forward='pipelined': at step t group 0 forwards batch t and group s > 0 forwards what group
  s - 1 produced at step t - 1; the head sees group G-1's output one step later.

  microbatches=M: rows m*B/M .. (m+1)*B/M - 1 of a batch are its micro-batch m (dropout key
  fold_in(key of the batch, m)), and the head's loss is weighted by the item's share of its own
  batch's loss: 1/M, or w_m / (the batch's weight) for a model with a `loss_weight` (each
  item's gradient is that of its batch's weighted mean, whichever step applies it). A stream is a
  queue of micro-batches going round the ring one tick at a time, with its own stashes and inboxes.
  flow='batch': micro-batch m of every batch forms stream m, which ticks once per step, exactly
  as a whole batch would. flow='stream': one stream takes micro-batch m of batch t at tick
  tM + m and ticks M times per step. Either way every step sums the gradients of its ticks and
  applies them once.
  """
  num_stages = staged.stage_count(params)
  if config is None:
    config = ScheduleConfig(name='ouroboros', num_stages=num_stages, **fields)
  elif fields:
    raise TypeError(f'reference.run takes a config or its fields, not both: {sorted(fields)}')
  config.validate()
  if (config.name, config.num_stages, config.data_parallel) != ('ouroboros', num_stages, 1):
    raise ConfigError(
      f"the slow reference runs {field_ref('name', 'ouroboros')} on one replica of the params' "
      f'{num_stages} groups, not {config.name} with {field_ref("num_stages", config.num_stages)} x '
      f'{field_ref("data_parallel", config.data_parallel)}.'
    )
  rows = staged.batch_rows(batches[0]['inputs'])
  ring = SlowRing(model, tx, params, config.resolve(jax.default_backend(), rows))
  for t in range(len(batches)):
    ring.step(t, batches)
  t = len(batches)
  while drain and ring.holds_anything():
    ring.step(t, batches)
    t += 1
  return ring.params, ring.losses, ring.updated


class _Stream:
  """A queue of micro-batches round the ring, one tick at a time: `stashes[s]` holds (clock,
  step, VJP or input) of every item in flight in group s, `delta_inbox[s]` the error gradient
  sent to group s during the previous tick, `act_inbox[s]` (pipelined) the activation sent to
  it, `head_inbox` (pipelined) what group G-1 sent the head. Item `clock` is micro-batch
  `item(clock)` = (batch, m)."""

  def __init__(self, num_stages: int, item):
    self.item = item
    self.stashes = [collections.deque() for _ in range(num_stages)]
    self.delta_inbox = [None] * num_stages
    self.act_inbox = [None] * num_stages
    self.head_inbox = None


class _Items:
  """items[clock]: the data of a stream's item (micro-batch m of batch b), cut lazily."""

  def __init__(self, batches, stream: _Stream, cut):
    self.batches, self.stream, self.cut = batches, stream, cut

  def __getitem__(self, clock):
    b, m = self.stream.item(clock)
    return self.cut(self.batches[b], m)


class SlowRing:
  """The ring as Python objects: one `_Stream` per micro-batch, the weights, the optimizer and
  each group's memory (all rows) shared by them."""

  def __init__(self, model: staged.StagedModel, tx, params, config: ResolvedSchedule):
    """`config`: resolved (`ScheduleConfig.resolve`), as `run` gives it."""
    self.config, self.params = config, params
    self.flow = config.flow
    self.num_stages = staged.stage_count(params)
    self.pipelined = config.forward == 'pipelined' and self.num_stages > 1
    memory = model.memory and staged.Memory(
      init=model.memory.init, stage=jax.jit(model.memory.stage)
    )
    self.model = dataclasses.replace(
      model,
      embed=jax.jit(model.embed),
      stage=jax.jit(model.stage),
      loss=jax.jit(model.loss),
      memory=memory,
    )
    self.memory = [None] * self.num_stages  # group s's memory (Transformer-XL), once it runs
    self.num_micro = config.microbatches
    optimizer = GroupedOptimizer(tx, config.clip_norm, model.shared)
    self.apply_gradients = jax.jit(optimizer.apply)
    self.opt_state = optimizer.init(params)
    comp = config.compensation
    active = comp.active
    if active and model.shared:
      raise ConfigError(
        'the slow reference has no staleness compensation for parameters shared by every layer '
        '(Transformer-XL global u, v); compare without compensation, or with '
        f'{field_ref("untie_r", True)}.'
      )
    self.slow = SlowCompensation(comp, tx, params, config.clip_norm) if active else None
    if self.flow == 'stream':
      self.streams = [_Stream(self.num_stages, lambda c: divmod(c, self.num_micro))]
    else:
      self.streams = [
        _Stream(self.num_stages, lambda c, m=m: (c, m)) for m in range(self.num_micro)
      ]
    # In its own clock every stream's delays are those of one batch per tick.
    self.timing = Timing(self.num_stages, config.forward)
    self.losses, self.updated = [], []

  def holds_anything(self) -> bool:
    """Whether an item is still in flight: in a stash, or as a message to a group or the head."""
    return any(
      any(stream.stashes)
      or any(x is not None for x in (*stream.delta_inbox, *stream.act_inbox, stream.head_inbox))
      for stream in self.streams
    )

  def key(self, batch_index, m=0):
    key = staged.batch_key(self.config.seed, batch_index)
    return key if self.num_micro == 1 else jax.random.fold_in(key, m)

  def micro(self, batch, m):
    """Micro-batch m: its rows of every leaf."""
    rows = staged.batch_rows(batch['inputs']) // self.num_micro
    return jax.tree.map(lambda a: a[m * rows : (m + 1) * rows], batch)

  def share(self, batch, m) -> float:
    """Micro-batch m's share of `batch`'s loss: 1/M, or its weight over the batch's."""
    if self.model.loss_weight is None:
      return 1.0 / self.num_micro
    weight = [
      float(self.model.loss_weight(self.micro(batch, k)['targets'])) for k in range(self.num_micro)
    ]
    return weight[m] / sum(weight) if sum(weight) > 0 else 0.0

  def stage_params(self, params, s):
    return jax.tree.map(lambda a: a[s], params['stages'])

  def ticks(self, t: int):
    """(stream, clock) of the ticks of step t, in order."""
    if self.flow == 'stream':
      return [(self.streams[0], t * self.num_micro + m) for m in range(self.num_micro)]
    return [(stream, t) for stream in self.streams]

  def step(self, t: int, batches) -> None:
    if t < self.config.sync_warmup_steps:
      return self.warmup_step(t, batches[t])
    forward_params = self.forward_params(t)
    total, losses = None, []
    ready, gap, head_ready = [False] * self.num_stages, [0] * self.num_stages, False
    for stream, clock in self.ticks(t):
      items = _Items(batches, stream, self.micro)
      head_input = self.forward(stream, forward_params, t, clock, items)
      loss, g_head, g_embed, delta_head = self.head(head_input, items, batches, stream)
      g_stages, ready_s, gap_s, g_embed = self.backward(
        stream, t, clock, items, delta_head, g_embed
      )
      ready = [a or b for a, b in zip(ready, ready_s)]
      gap = [max(a, b) for a, b in zip(gap, gap_s)]
      head_ready |= delta_head is not None
      grads = (g_head, g_embed, g_stages)
      total = grads if total is None else jax.tree.map(jnp.add, total, grads)
      if loss is not None:
        losses.append(loss)
    g_head, g_embed, g_stages = total
    if self.config.tied_grad == 'mean' and self.model.tied_embedding and head_ready and ready[0]:
      g_embed = jax.tree.map(lambda g: 0.5 * g, g_embed)  # the head's and module 1's
    self.losses.append(sum(losses) if losses else None)
    self.update(g_embed, g_head, g_stages, ready, gap, head_ready=head_ready)

  def memory_of(self, s: int, rows: int, m: int = 0):
    """Micro-batch m's rows of group s's memory (an empty one before its first forward); None
    without a memory."""
    if self.model.memory is None:
      return None
    if self.memory[s] is None:
      self.memory[s] = self.model.memory.init(self.stage_params(self.params, s), rows)
    return self.micro_rows(self.memory[s], m)

  def micro_rows(self, tree, m):
    rows = lambda a: a[
      m * (a.shape[0] // self.num_micro) : (m + 1) * (a.shape[0] // self.num_micro)
    ]
    return jax.tree.map(rows, tree)

  def set_memory(self, s: int, m: int, memory) -> None:
    """Micro-batch m's rows of group s's memory replaced by `memory`."""
    if memory is None:
      return
    rows = jax.tree.leaves(memory)[0].shape[0]
    self.memory[s] = jax.tree.map(
      lambda a, new: a.at[m * rows : (m + 1) * rows].set(new), self.memory[s], memory
    )

  def warmup_step(self, t: int, batch) -> None:
    """Plain backprop of batch t (the synchronous warm-up), micro-batch by micro-batch."""
    model, groups = self.model, ['embed', *range(self.num_stages), 'head']
    loss, grads = 0.0, None
    for m in range(self.num_micro):
      micro = self.micro(batch, m)
      if model.memory is None:
        (loss_m, _), grads_m = jax.value_and_grad(model.forward_loss, has_aux=True)(
          self.params, micro, self.key(t, m), t
        )
      else:
        rows = staged.batch_rows(micro['inputs'])
        memory_G = jax.tree.map(
          lambda *a: jnp.stack(a),
          *[self.memory_of(s, rows * self.num_micro, m) for s in range(self.num_stages)],
        )
        (loss_m, (_, memory_G)), grads_m = jax.value_and_grad(model.recurrent_loss, has_aux=True)(
          self.params, micro, self.key(t, m), memory_G, t
        )
        for s in range(self.num_stages):
          self.set_memory(s, m, jax.tree.map(lambda a, s=s: a[s], memory_G))
      share = self.share(batch, m)
      grads_m = jax.tree.map(lambda g: g * share, grads_m)
      loss += float(loss_m) * share
      grads = grads_m if grads is None else jax.tree.map(jnp.add, grads, grads_m)
    if self.slow:
      self.params = self.slow.apply(
        self.params, grads, {k: True for k in groups}, {k: 0 for k in groups}
      )
    else:
      self.params, self.opt_state, _ = self.apply_gradients(self.params, self.opt_state, grads)
    self.losses.append(loss)
    self.updated.append(groups)

  def forward_params(self, t: int):
    """The current weights (or, predicting, the weights each group's gradient of this step's
    forward will be applied to: delays.Timing's gaps)."""
    if not (self.slow and self.num_stages > 1):
      return self.params
    o = self.config
    timing = Timing(self.num_stages, o.forward, self.num_micro, self.flow)
    return self.slow.predicted(
      self.params, {**dict(enumerate(timing.stage_gaps)), 'embed': timing.embed_gap}
    )

  def stage_fn(self, stream: _Stream, s: int, clock: int, memory):
    """Group s's forward of item `clock`, as a function of (its weights, its input)."""
    b, m = stream.item(clock)
    key = staged.piece_rng(self.key(b, m), s)
    return lambda p, h: self.model.run_stage(p, h, s, key, memory, b)

  def forward(self, stream: _Stream, forward_params, t: int, clock: int, items):
    """Tick `clock` of one stream at step t: item `clock` enters, and every group forwards what
    reaches it, keeping its VJP (graph) or its input (replay). Returns what reaches the head:
    (clock of the item, activation), or None."""
    num_stages, model = self.num_stages, self.model
    b, m = stream.item(clock)
    new_act, carried = [None] * num_stages, None
    if b < len(items.batches):  # else a drain: no new item enters
      key = staged.piece_rng(self.key(b, m), EMBED_PIECE)
      carried = (clock, model.embed(forward_params['embed'], items[clock]['inputs'], key))
    for s in range(num_stages):
      if self.pipelined and s > 0:
        carried = stream.act_inbox[s]
      if carried is None:  # pipelined: nothing has reached this group yet
        continue
      c, x = carried
      m = stream.item(c)[1]
      memory = self.memory_of(s, staged.batch_rows(x) * self.num_micro, m)
      run_s = self.stage_fn(stream, s, c, memory)
      if self.config.stash == 'graph':
        y, vjp_fn, new_memory = jax.vjp(
          run_s, self.stage_params(forward_params, s), x, has_aux=True
        )
        stream.stashes[s].append((c, t, vjp_fn))
      else:  # replay keeps the input and the memory the forward read
        y, new_memory = run_s(self.stage_params(forward_params, s), x)
        stream.stashes[s].append((c, t, (x, memory)))
      self.set_memory(s, m, new_memory)
      carried = (c, y)
      new_act[(s + 1) % num_stages] = carried
    if not self.pipelined:
      return carried
    head_input, stream.head_inbox, stream.act_inbox = stream.head_inbox, new_act[0], new_act
    return head_input

  def head(self, head_input, items, batches, stream: _Stream):
    """Module K: (loss, head gradient, its embed gradient, delta_{G-1}) of the item that
    reached the head, fresh and weighted by its share of its batch's loss (`share`); None,
    zeros and None while the pipe fills."""
    zeros = lambda tree: jax.tree.map(jnp.zeros_like, tree)
    if head_input is None:
      return None, zeros(self.params['head']), zeros(self.params['embed']), None
    clock, x = head_input
    targets = items[clock]['targets']
    loss, head_vjp = jax.vjp(
      lambda hp, ep, h: self.model.loss(hp, ep, h, targets)[0],
      self.params['head'],
      self.params['embed'],
      x,
    )
    b, m = stream.item(clock)
    weight = self.share(batches[b], m)
    return (
      float(loss) * weight,
      *staged.pull(head_vjp, jnp.full_like(loss, weight), None, None, x),
    )

  def backward(self, stream: _Stream, t: int, clock: int, items, delta_head, g_embed):
    """Tick `clock` at step t: every group back-propagates the item its delayed error gradient
    belongs to; returns (stage gradients, which groups have one, their gaps in steps, the
    embedding's gradient)."""
    num_stages, params, model = self.num_stages, self.params, self.model
    new_inbox = [None] * num_stages
    g_stages = [
      jax.tree.map(jnp.zeros_like, self.stage_params(params, s)) for s in range(num_stages)
    ]
    ready = [False] * num_stages
    gap = [0] * num_stages  # steps since the forward of the item applied now
    for s in range(num_stages):
      delta = delta_head if num_stages == 1 else stream.delta_inbox[s]
      if delta is None:
        continue
      c, forward_step, kept = stream.stashes[s].popleft()
      assert c == clock - self.timing.backward_ticks(s), (s, c, clock)
      gap[s] = t - forward_step
      if self.config.stash == 'graph':
        g_stages[s], dx = staged.pull(kept, delta, None, delta)
      else:
        x, memory = kept
        run_s = self.stage_fn(stream, s, c, memory)
        vjp_fn = jax.vjp(run_s, self.stage_params(params, s), x, has_aux=True)[1]
        g_stages[s], dx = staged.pull(vjp_fn, delta, None, x)
      ready[s] = True
      if s > 0:
        new_inbox[s - 1] = dx
        continue
      # Module 1 ends at the embedding of item c.
      key = staged.piece_rng(self.key(*stream.item(c)), EMBED_PIECE)
      embed_c = lambda e: model.embed(e, items[c]['inputs'], key)
      g_stale = staged.pull(jax.vjp(embed_c, params['embed'])[1], dx, None)[0]
      g_embed = jax.tree.map(jnp.add, g_embed, g_stale)
    if num_stages > 1:
      new_inbox[num_stages - 1] = delta_head
    stream.delta_inbox = new_inbox
    return g_stages, ready, gap, g_embed

  def update(self, g_embed, g_head, g_stages, ready, gap, *, head_ready: bool) -> None:
    """Every group with a gradient applies it; the others keep their weights exactly."""
    grads = {
      'embed': g_embed,
      'head': g_head,
      'stages': jax.tree.map(lambda *g: jnp.stack(g), *g_stages),
    }
    embed_ready = (self.model.tied_embedding and head_ready) or ready[0]
    if self.slow:  # the tied embedding counts as fresh (it gets the head's gradient every step)
      delays = {'embed': 0 if self.model.tied_embedding else gap[0], 'head': 0}
      ready_of = {'embed': embed_ready, 'head': head_ready, **dict(enumerate(ready))}
      self.params = self.slow.apply(
        self.params, grads, ready_of, {**delays, **dict(enumerate(gap))}
      )
    else:
      ready_tree = {'embed': embed_ready, 'stages': jnp.asarray(ready), 'head': head_ready}
      self.params, self.opt_state, _ = self.apply_gradients(
        self.params, self.opt_state, grads, ready_tree
      )
    self.updated.append(
      (['embed'] if embed_ready else [])
      + [s for s in range(self.num_stages) if ready[s]]
      + (['head'] if head_ready else [])
    )
