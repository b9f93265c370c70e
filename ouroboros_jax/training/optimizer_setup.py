"""A run's optimizer, built from its `TrainConfig`: the learning-rate schedule (`lr_schedule`,
linear warmup then cosine decay to `learning_rate * min_lr_ratio`) and the Optax optimizer
(`make_optimizer`).

The optimizer (`--optimizer auto`, `TrainConfig.resolved_optimizer`) is Muon for every schedule:
`optax.contrib.muon` on the layer kernels at their own rate (`config.DEFAULT_MUON_RATES`), Adam at
`learning_rate` on embeddings, norms and biases; AdamW (the paper's) for `--compensation none`,
`--growth` and `--vcycle` (optimizers.py has each). The schedule clips the global gradient norm to
`clip_norm` before the update.
"""

from __future__ import annotations

import optax

from ouroboros_jax import optimizers
from ouroboros_jax.training.config import TrainConfig


def lr_schedule(cfg: TrainConfig, steps: int | None = None, peak: float | None = None):
  """Linear warmup then cosine decay over `steps` (default cfg.steps) to `peak` (default
  cfg.learning_rate) times min_lr_ratio."""
  steps = cfg.steps if steps is None else steps
  peak = cfg.learning_rate if peak is None else peak
  return optax.warmup_cosine_decay_schedule(
    init_value=0.0,
    peak_value=peak,
    warmup_steps=max(min(cfg.warmup_steps, steps - 1), 0),
    decay_steps=max(steps, 1),
    end_value=peak * cfg.min_lr_ratio,
  )


def make_optimizer(cfg: TrainConfig, *, muon_dims: optimizers.MuonDims = optimizers.LIBRARY_DIMS):
  """--optimizer (Muon by default, `TrainConfig.resolved_optimizer`) with linear warmup and
  cosine decay; Muon's kernels follow the same schedule to their own peak. `muon_dims`: the
  model's matrices for Muon (`optimizers.muon_dimensions`; default: the built-in models', the
  CLI's; `recipe` passes a user's own)."""
  return optimizers.make_optimizer(
    cfg.resolved_optimizer(),
    lr_schedule(cfg),
    weight_decay=cfg.weight_decay,
    muon_learning_rate=lr_schedule(cfg, peak=cfg.resolved_muon_learning_rate()),
    b1=cfg.momentum,
    muon_dims=muon_dims,
    state_dtype=cfg.resolved_state_dtype(),
  )
