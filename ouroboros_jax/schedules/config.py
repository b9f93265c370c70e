"""`ScheduleConfig`: how a schedule places and runs the model (every schedule reads the same one)."""

from __future__ import annotations

import dataclasses

from ouroboros_jax.schedules.compensation import Compensation


@dataclasses.dataclass(frozen=True)
class ScheduleConfig:
  """How a schedule places and runs the model; fields a schedule does not use are ignored."""

  name: str = 'backprop'
  num_stages: int = 1
  data_parallel: int = 1
  clip_norm: float | None = 1.0
  seed: int = 0                  # dropout keys are derived from (seed, batch index)
  microbatches: int = 4          # gpipe: micro-batches per (data replica's) batch
  stash: str = 'graph'           # ouroboros: 'graph' (DDG) or 'replay' (Features Replay)
  stash_policy: str = 'all'      # ouroboros graph stash: which residuals (ring.STASH_POLICIES)
  forward: str = 'locked'        # ouroboros: 'locked' (the paper) or 'pipelined'
  sync_warmup_steps: int = 0     # ouroboros: plain backprop over the ring first
  tied_grad: str = 'sum'         # ouroboros: 'sum' or 'mean' of the tied embedding's two grads
  compensation: Compensation = Compensation()  # ouroboros: staleness compensation (none: paper)
