"""Cutting the Transformer into pipeline stages: the cost model and the stage layout.

Device 0 of the ring holds module 1 (embedding + first layer group) *and* module K (final norm,
output projection, softmax loss), so it should get fewer layers than the others. `balance_layers`
picks per-stage layer counts minimising the largest per-device cost, counting the embedding, the
head and the loss on device 0. Uneven splits are stored padded: stage parameters have shape
[G, N, ...] with N = max layers per stage, and the padding layers are skipped by `lax.cond`.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ouroboros_jax import costs, txl
from ouroboros_jax import model as transformer
from ouroboros_jax.errors import ConfigError, field_ref
from ouroboros_jax.model import ModelConfig
from ouroboros_jax.staged import Memory, StagedModel, WeightSplit


def balance_layers(cfg: ModelConfig, num_stages: int) -> tuple[int, ...]:
  """Layers per stage, contiguous, minimising the most loaded device (`costs.balance_layers`)."""
  return costs.balance_layers(cfg.num_layers, num_stages, *costs.model_flops(cfg))


def parse_layers_per_stage(
  text: str | Sequence[int], num_layers: int, num_stages: int | None = None
) -> tuple[int, ...]:
  """'2,4,4,4' -> (2, 4, 4, 4), checked against the model depth and the stage count."""
  try:
    counts = tuple(int(c) for c in (text.split(',') if isinstance(text, str) else text))
  except ValueError:
    raise ConfigError(
      f'{field_ref("layers_per_stage")} must be comma-separated integers, got {text!r}.'
    )
  if any(c < 1 for c in counts):
    raise ConfigError(
      f'{field_ref("layers_per_stage", text)} has a stage with no layers; every stage needs '
      'at least one.'
    )
  if sum(counts) != num_layers:
    raise ConfigError(
      f'{field_ref("layers_per_stage", text)} sums to {sum(counts)} but the model has '
      f'{num_layers} layers; make them add up.'
    )
  if num_stages is not None and len(counts) != num_stages:
    raise ConfigError(
      f'{field_ref("layers_per_stage", text)} gives {len(counts)} stages but '
      f'{field_ref("num_stages")} is {num_stages}; make them agree.'
    )
  return counts


def stage_mask(layers_per_stage: Sequence[int]) -> np.ndarray:
  """[G, N] bool: which of the N padded layer slots of each stage hold a real layer."""
  width = max(layers_per_stage)
  return np.arange(width)[None, :] < np.asarray(layers_per_stage)[:, None]


def first_layers(layers_per_stage: Sequence[int]) -> np.ndarray:
  """[G]: the global index of each stage's first layer."""
  return np.cumsum([0, *layers_per_stage])[:-1]


def layer_index(layers_per_stage: Sequence[int]) -> np.ndarray:
  """[G, N]: the global layer in each padded slot (slot (g, n) holds layer first[g] + n; padding
  slots say 0, and `stage_mask` says which slots are real)."""
  mask_GxN = stage_mask(layers_per_stage)
  slots_GxN = first_layers(layers_per_stage)[:, None] + np.arange(mask_GxN.shape[1])[None]
  return np.where(mask_GxN, slots_GxN, 0)


def to_staged(params: dict, layers_per_stage: Sequence[int]) -> dict:
  """{'embed','layers' [N,...],'head'} -> {'embed','stages' [G,N,...],'head'} (zero padding)."""
  mask_GxN, index_GxN = stage_mask(layers_per_stage), layer_index(layers_per_stage)

  def gather(a):
    picked = a[index_GxN]
    return jnp.where(mask_GxN.reshape(mask_GxN.shape + (1,) * (a.ndim - 1)), picked, 0)

  return {
    'embed': params['embed'],
    'stages': jax.tree.map(gather, params['layers']),
    'head': params['head'],
  }


def from_staged(staged: dict, layers_per_stage: Sequence[int]) -> dict:
  """Inverse of `to_staged`: drop the padding, stack the layers back on one axis."""
  mask_GxN = stage_mask(layers_per_stage)
  rows, cols = np.nonzero(mask_GxN)  # row-major: stage by stage, layer by layer
  return {
    'embed': staged['embed'],
    'layers': jax.tree.map(lambda a: a[rows, cols], staged['stages']),
    'head': staged['head'],
  }


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
