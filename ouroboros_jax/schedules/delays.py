"""When each Ouroboros module sees which batch: the delays, in one place (no JAX).

Read by the schedule, the slow reference, the simulator and the compensations. G = num_stages,
s = 0..G-1 the layer group, t the step (batch t enters at step t). See docs/algorithm.md.

With M micro-batches per step the ring's clock is the tick: micro-batch m of batch t is item
u = t*M + m and enters the ring at tick u. Under `flow='batch'` the M micro-batches of a step
travel as one batch (a message between neighbours takes M ticks, one step), so every delay is
the paper's, counted in batches. Under `flow='stream'` they stream continuously across updates
(a message takes one tick), so group s's gradient is about ceil(lag / M) updates old, where lag
is its lag in micro-batches: at most one update once M reaches the largest lag, at any depth
(PipeDream-2BW's constant delay, Narayanan et al., ICML 2021).
"""

from __future__ import annotations

import dataclasses
import itertools


def _ceil_div(a: int, b: int) -> int:
  return -(-a // b)


@dataclasses.dataclass(frozen=True)
class Timing:
  """Item u's ticks on the ring, and what they imply for the buffers and the compensations."""

  num_stages: int
  forward: str = 'locked'  # 'locked' or 'pipelined'
  microbatches: int = 1
  flow: str = 'batch'  # 'batch' or 'stream'

  @property
  def hop(self) -> int:
    """Ticks a message takes from a device to its neighbour."""
    return self.microbatches if self.flow == 'batch' else 1

  @property
  def forward_hop(self) -> int:
    """Ticks between group s's forward of an item and group s + 1's: 0 in the locked wave."""
    return self.hop if self.forward == 'pipelined' and self.num_stages > 1 else 0

  @property
  def head_ticks(self) -> int:
    """The head computes item u's loss at tick u + head_ticks."""
    return self.num_stages * self.forward_hop

  def forward_ticks(self, stage: int) -> int:
    """Group `stage` forwards item u at tick u + forward_ticks(stage)."""
    return stage * self.forward_hop

  def backward_ticks(self, stage: int) -> int:
    """Group `stage` back-propagates item u at tick u + backward_ticks(stage): one hop per group
    from the head back to it (0 when G = 1: the backward follows the head at once)."""
    if self.num_stages == 1:
      return 0
    return self.head_ticks + (self.num_stages - stage) * self.hop

  def first_step(self, ticks: int) -> int:
    """The first step in which an event `ticks` after an item's entry happens to a real item."""
    return ticks // self.microbatches

  @property
  def stage_gaps(self) -> list[int]:
    """Updates between the weights group s forwards an item with and those its gradient is
    applied to: ceil of its forward-to-backward ticks over M (exact under flow='batch')."""
    return [
      _ceil_div(self.backward_ticks(s) - self.forward_ticks(s), self.microbatches)
      for s in range(self.num_stages)
    ]

  @property
  def embed_gap(self) -> int:
    """The same for the embedding, module 1's first piece (it embeds an item at its entry)."""
    return _ceil_div(self.backward_ticks(0), self.microbatches)

  @property
  def depth(self) -> int:
    """Slots of whole batches (their inputs and targets) a device keeps until the head and the
    embedding's backward have read them: ceil(largest lag / M) + 1."""
    return self.embed_gap + 1

  @property
  def drain_steps(self) -> int:
    """Steps of a drain (`ouroboros.drain`): the ring takes no new item and back-propagates what
    it holds, the last item entered reaching the embedding's backward ceil(largest lag / M)
    steps later (0 when G = 1: nothing waits)."""
    return self.embed_gap

  @property
  def weight_slots(self) -> int:
    """Slots of a graph stash's forward weights, one per update's version: the current version
    is the step's own forward weights, so only the older ones wait, as many as the largest
    group's gap (ceil(lag / M) updates; 1 when nothing waits, so the buffer keeps its shape)."""
    return max(*self.stage_gaps, 1)

  # -- the step's loop: one round per tick, the forward, the head and the backward of each ------

  @property
  def rounds(self) -> int:
    """Rounds of a step's loop. Pipelined, one per tick. Locked, the forward of a tick crosses
    the G groups within it, group s in the tick's round + s, so the wave takes G - 1 more."""
    return self.microbatches + self.backward_round(0)

  def forward_round(self, stage: int, index: int) -> int:
    """The round in which group `stage` forwards the index-th item it forwards in a step."""
    return index + (0 if self.forward_hop else stage)

  def backward_round(self, index: int) -> int:
    """The round in which every group back-propagates the index-th item it back-propagates in a
    step, after its forward in that round: the round in which the head sees its index-th item
    (round index pipelined; locked, the last group's output reaches the head in round G - 1)."""
    return index + (0 if self.forward_hop else self.num_stages - 1)

  def _forward_order(self, stage: int, item: int) -> tuple:
    tick = item + self.forward_ticks(stage)
    return tick // self.microbatches, self.forward_round(stage, tick % self.microbatches), 0

  def _backward_order(self, stage: int, item: int) -> tuple:
    tick = item + self.backward_ticks(stage)
    return tick // self.microbatches, self.backward_round(tick % self.microbatches), 1

  def group_stash_slots(self, stage: int) -> int:
    """Micro-batch slots group `stage`'s stash needs, item u in slot u % N: the fewest N for
    which item u + N is forwarded after item u is back-propagated, in the step's loop order
    (step, round, forward before backward). Pipelined that is the items in flight, lag + 1
    (2(G - s) + 1 streamed); locked the backward of a tick waits for the wave to reach the
    head, G - 1 - s rounds after group s's forward, so it can be up to that many more."""
    items = range(self.microbatches)
    for slots in itertools.count(1):
      if all(self._forward_order(stage, u + slots) > self._backward_order(stage, u) for u in items):
        return slots
    raise AssertionError('unreachable')

  @property
  def stash_slots(self) -> int:
    """Micro-batch slots of the stash on every device (SPMD: each holds the deepest group's)."""
    return max(self.group_stash_slots(s) for s in range(self.num_stages))


def unit_gap_microbatches(num_stages: int, forward: str = 'locked') -> int:
  """The fewest streamed micro-batches per update that make every gradient at most one update
  old: the embedding's lag in micro-batches, G locked and 2G pipelined (1 when G = 1)."""
  return max(Timing(num_stages, forward, 1, 'stream').embed_gap, 1)


def gradient_age(
  num_stages: int, forward: str = 'locked', microbatches: int = 1, flow: str = 'stream'
) -> int:
  """Updates between the weights the oldest gradient of a step was computed at and the weights it
  is applied to: the embedding's, ceil(lag / M) streamed, with lag G ticks locked and 2G
  pipelined (G and 2G whole batches as one batch). 0 when G = 1."""
  if num_stages == 1:
    return 0
  return Timing(num_stages, forward, microbatches, flow).embed_gap


def staleness(num_stages: int) -> list[int]:
  """Steps between the forward and the backward of each layer group in the locked forward: G - s
  (0 when G = 1)."""
  return [0] if num_stages == 1 else [num_stages - s for s in range(num_stages)]


def lags(num_stages: int, forward: str = 'locked') -> tuple[int, list[int]]:
  """(head lag, per-group backward lag) in steps, whole batches: at step t the head computes the
  loss of batch t - head_lag and group s back-propagates batch t - lag[s]; neither updates
  before its lag."""
  timing = Timing(num_stages, forward)
  return timing.head_ticks, [timing.backward_ticks(s) for s in range(num_stages)]


def backward_batch(t: int, stage: int, num_stages: int, forward: str = 'locked') -> int:
  """The batch group `stage` back-propagates at step t (negative: none yet)."""
  return t - lags(num_stages, forward)[1][stage]


def forward_batch(t: int, stage: int, num_stages: int, forward: str = 'locked') -> int:
  """The batch group `stage` forwards at step t (negative: none yet)."""
  return t - Timing(num_stages, forward).forward_ticks(stage)


def version_gaps(
  num_stages: int, forward: str = 'locked', microbatches: int = 1, flow: str = 'batch'
) -> tuple[int, list[int]]:
  """(embedding gap, per-group gaps): how many updates lie between the weights a module's forward
  of a batch uses and the weights that batch's gradient is applied to. Locked: group s forwards
  batch t at step t and applies its gradient at step t + (G - s). Pipelined: it forwards batch b
  at step b + s and back-propagates it at step b + 2G - s, a gap of 2(G - s); the embedding
  (module 1's first piece) embeds batch t at step t, a gap of 2G. The head is always fresh (0).
  Streamed micro-batches: `Timing`."""
  timing = Timing(num_stages, forward, microbatches, flow)
  return timing.embed_gap, timing.stage_gaps
