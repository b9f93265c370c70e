"""A run's model and schedule from its `TrainConfig`, and nothing else: no data, no loop.

`ouroboros compile`, `plan` and `bench` build steps from here without importing the data stack
(Grain, TFDS, array_record), which `loop` needs and a machine that only compiles or times may
lack.
"""

from __future__ import annotations

import jax
import numpy as np

from ouroboros_jax import schedules, staged
from ouroboros_jax.accelerators import pld, stdloss
from ouroboros_jax.models import attention, partition
from ouroboros_jax.models import model as transformer
from ouroboros_jax.training.config import TrainConfig
from ouroboros_jax.training.optimizer_setup import make_optimizer


def build(cfg: TrainConfig):
  """(schedule, staged initial params, layers_per_stage) for a config; nothing is trained."""
  layers_per_stage = cfg.plans.layers_per_stage
  attention.check_platform(cfg.model.attention, jax.default_backend())
  # One compiled init instead of hundreds of eager ops (seconds on CPU).
  init = jax.jit(
    lambda key: partition.to_staged(transformer.init_params(cfg.model, key), layers_per_stage)
  )
  params = init(jax.random.key(cfg.seed))
  model = staged_model(cfg, layers_per_stage)
  schedule = schedules.build_schedule(cfg.schedule_config(), model, make_optimizer(cfg))
  return schedule, params, layers_per_stage


def staged_model(cfg: TrainConfig, layers_per_stage) -> staged.StagedModel:
  """The Transformer cut into stages, with PLD or the standardization loss when asked for."""
  if cfg.pld:
    return pld.pld_stages(cfg.model, layers_per_stage, *cfg.plans.pld)
  if cfg.std_loss:
    return stdloss.stdloss_stages(
      cfg.model, layers_per_stage, cfg.std_loss, cfg.plans.std_loss_layers
    )
  return partition.transformer_stages(cfg.model, layers_per_stage)


def example_batch(cfg: TrainConfig) -> dict:
  """A batch of cfg's shape, zeros (what `init` is shown)."""
  return jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), example_batch_shapes(cfg))


def example_batch_shapes(cfg: TrainConfig) -> dict:
  """The shapes of cfg's batches: {'inputs', 'targets'} [B, L] int32 (no memory spent)."""
  shape_BxL = (cfg.batch_size, cfg.model.seq_len)
  return {name: jax.ShapeDtypeStruct(shape_BxL, np.int32) for name in ('inputs', 'targets')}
