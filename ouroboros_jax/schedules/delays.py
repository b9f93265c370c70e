"""When each Ouroboros module sees which batch: the delays, in one place (no JAX).

Read by the schedule, the slow reference, the simulator and the compensations. G = num_stages,
s = 0..G-1 the layer group, t the step (batch t enters at step t). See docs/algorithm.md.
"""

from __future__ import annotations


def staleness(num_stages: int) -> list[int]:
  """Steps between the forward and the backward of each layer group in the locked forward: G - s
  (0 when G = 1)."""
  return [0] if num_stages == 1 else [num_stages - s for s in range(num_stages)]


def lags(num_stages: int, forward: str = 'locked') -> tuple[int, list[int]]:
  """(head lag, per-group backward lag): at step t the head computes the loss of batch
  t - head_lag and group s back-propagates batch t - lag[s]; neither updates before its lag."""
  if num_stages > 1 and forward == 'pipelined':
    return num_stages, [2 * num_stages - s for s in range(num_stages)]
  return 0, staleness(num_stages)


def backward_batch(t: int, stage: int, num_stages: int, forward: str = 'locked') -> int:
  """The batch group `stage` back-propagates at step t (negative: none yet)."""
  return t - lags(num_stages, forward)[1][stage]


def forward_batch(t: int, stage: int, num_stages: int, forward: str = 'locked') -> int:
  """The batch group `stage` forwards at step t (negative: none yet)."""
  return t - stage if num_stages > 1 and forward == 'pipelined' else t


def version_gaps(num_stages: int, forward: str = 'locked') -> tuple[int, list[int]]:
  """(embedding gap, per-group gaps): how many updates lie between the weights a module's forward
  of a batch uses and the weights that batch's gradient is applied to. Locked: group s forwards
  batch t at step t and applies its gradient at step t + (G - s). Pipelined: it forwards batch b
  at step b + s and back-propagates it at step b + 2G - s, a gap of 2(G - s); the embedding
  (module 1's first piece) embeds batch t at step t, a gap of 2G. The head is always fresh (0)."""
  head_lag, backward_lags = lags(num_stages, forward)
  offset = (lambda s: s) if head_lag else (lambda s: 0)  # the step group s forwards batch 0
  return backward_lags[0], [lag - offset(s) for s, lag in enumerate(backward_lags)]
