"""Cutting the Transformer into pipeline stages: the cost model and the stage layout.

Device 0 of the ring holds module 1 (embedding + first layer group) *and* module K (final norm,
output projection, softmax loss), so it should get fewer layers than the others. `balance_layers`
picks per-stage layer counts minimising the largest per-device cost, counting the embedding, the
head and the loss on device 0. The layout itself (padding, the mask, stacking and the way back)
is staging.py's, the same for the built-in models as for a user's (`staging.from_layers`).
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp

from ouroboros_jax import costs
from ouroboros_jax.models import model as transformer
from ouroboros_jax.models import txl
from ouroboros_jax.models.model import ModelConfig
from ouroboros_jax.staged import Memory, StagedModel, WeightSplit
from ouroboros_jax.staging import (  # noqa: F401  (the stage layout, where the callers import it)
  first_layers,
  from_staged,
  layer_index,
  parse_layers_per_stage,
  stage_mask,
  to_staged,
)


def balance_layers(cfg: ModelConfig, num_stages: int) -> tuple[int, ...]:
  """Layers per stage, contiguous, minimising the most loaded device (`costs.balance_layers`)."""
  return costs.balance_layers(cfg.num_layers, num_stages, *costs.model_flops(cfg))


def transformer_stages(cfg: ModelConfig, layers_per_stage: Sequence[int]) -> StagedModel:
  """The Transformer LM as embed -> stages -> tied head, for any schedule (`cfg.arch`: the GPT
  model of model.py, or Transformer-XL, `txl_stages`)."""
  if cfg.arch == txl.ARCH:
    return txl_stages(cfg, layers_per_stage)
  mask_GxN = jnp.asarray(stage_mask(layers_per_stage))
  uneven = len(set(layers_per_stage)) > 1

  def stage(stage_params, x_BxLxD, stage_index, rng, taps_N=None):
    # Even splits need no masking; uneven ones skip their padding slots (no FLOPs spent).
    active_N = mask_GxN[stage_index] if uneven else None
    per_layer = transformer.PerLayer(active_N=active_N, taps_N=taps_N)
    return transformer.layers(cfg, stage_params, x_BxLxD, rng, per_layer)

  layer_count = lambda stage_params: jax.tree.leaves(stage_params)[0].shape[0]
  return StagedModel(
    embed=lambda p, tokens_BxL, rng: transformer.embed(cfg, p, tokens_BxL, rng),
    stage=stage,
    loss=lambda head, emb, x, targets: transformer.head_loss(cfg, head, emb, x, targets),
    tied_embedding=cfg.tie_embeddings,
    weight_split=WeightSplit(
      taps=lambda p, x: transformer.zero_taps(cfg, layer_count(p), x),
      stage=stage,
      weight_grad=lambda p, inputs, tap_grads: transformer.tapped_weight_grads(
        cfg, inputs, tap_grads
      ),
    ),
  )


def txl_stages(cfg: ModelConfig, layers_per_stage: Sequence[int]) -> StagedModel:
  """Transformer-XL as embed -> stages -> tied head. With `cfg.mem_len` > 0 every stage keeps
  the memory of its own layers (`StagedModel.memory`), [N, B, mem_len, D] per stage; `stage`
  alone runs without a memory (evaluation of single windows)."""
  mask_GxN = jnp.asarray(stage_mask(layers_per_stage))
  uneven = len(set(layers_per_stage)) > 1

  def stage_with_memory(stage_params, x_BxLxD, stage_index, rng, memory):
    active_N = mask_GxN[stage_index] if uneven else None
    return txl.layers(cfg, stage_params, x_BxLxD, memory, rng, active_N=active_N)

  layer_count = lambda stage_params: jax.tree.leaves(stage_params)[0].shape[0]
  memory = None
  if cfg.mem_len:
    memory = Memory(
      init=lambda p, batch_size: txl.init_memory(
        cfg, layer_count(p), batch_size, cfg.mem_len, cfg.compute_dtype
      ),
      stage=stage_with_memory,
    )
  return StagedModel(
    embed=lambda p, tokens_BxL, rng: txl.embed(cfg, p, tokens_BxL, rng),
    stage=lambda p, x, stage_index, rng: stage_with_memory(p, x, stage_index, rng, None)[0],
    loss=lambda head, emb, x, targets: transformer.head_loss(cfg, head, emb, x, targets),
    tied_embedding=cfg.tie_embeddings,
    memory=memory,
    shared=txl.shared_leaves(cfg),
  )
