"""The standardization loss (Collins, Balle, Shlens 2019; arXiv 1903.00925).

An auxiliary training loss that pushes the pre-activations x of a layer towards zero mean and unit
variance per channel: the KL divergence KL(N(mu_i, sigma_i^2) || N(0, 1)) summed over channels,

    L_std = 0.5 * sum_i (mu_i^2 + sigma_i^2 - log sigma_i^2 - 1),

with mu_i, sigma_i^2 the mean and (population) variance of channel i over the batch and the
sequence, as batch norm would take them. It is weighted (the paper uses 1e-6 .. 1.0) and added to
the task loss during training only; evaluation uses the plain model.

Where it is measured in the Transformer (`site`):
  'mlp_preact' (default)  the input of the MLP's GELU, mlp_in(LN(h)) [B, L, F]: the pre-activation
                          of the layer's nonlinearity, as in the paper.
  'mlp_input'             the input of the MLP, LN(h) (pre-LN) or h (post-LN) [B, L, D].

Single device: `loss_with_stdloss(cfg, params, batch, StdLoss(weight, layer))`. Inside pipeline
stages (any schedule): `stdloss_stages(...)` returns a `StagedModel` whose activations are
{'h': the hidden states [B, L, D], 'aux': the weighted auxiliary loss so far [B] (float32, the
same value in every row)}; each stage adds the terms of the regularised layers it holds, the head
adds mean(aux) to the task loss. Its gradient travels back through 'aux' like any activation
gradient (stale under Ouroboros, as the rest of that stage's gradient). The statistics are those
of the examples the stage sees: a data replica's share of the batch, a micro-batch. 'aux' is
kept per row because every leaf of an activation leads with the batch axis (staged.py), so the
schedules cut it into replicas and micro-batches as they cut the hidden states.

The layer is `model.Block`'s computation written out (`block_with_site`), so that the site
activation can be returned; it uses the block's own submodules and `model.dropout`, and a test
checks it against the model.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ouroboros_jax.errors import ConfigError
from ouroboros_jax.models import model as transformer
from ouroboros_jax.models import partition
from ouroboros_jax.models.model import ModelConfig
from ouroboros_jax.staged import StagedModel

SITES = ('mlp_preact', 'mlp_input')
EPS = 1e-5  # added to each channel's variance (`standardization_loss`)


class StdLoss(NamedTuple):
  """The auxiliary loss of a run: weight * L_std of `layers`' (0-based: an int or a sequence)
  activation at `site`."""

  weight: float
  layers: int | Sequence[int]
  site: str = 'mlp_preact'


class Terms(NamedTuple):
  """Which layers of a stack add their L_std, how strongly (weight_N, 0 for none), at `site`."""

  weight_N: Any
  site: str = 'mlp_preact'


def standardization_loss(x, *, eps: float = EPS):
  """0.5 * sum_i (mu_i^2 + var_i - log var_i - 1) over the last axis (channels i), with the mean
  and population variance of each channel over all other axes. `eps` is added to the variance
  (inside the log and out) so a constant channel gives a large, finite loss."""
  x = x.astype(jnp.float32)
  axes = tuple(range(x.ndim - 1))
  mu_C = jnp.mean(x, axis=axes)
  var_C = jnp.mean(jnp.square(x - mu_C), axis=axes) + eps
  return 0.5 * jnp.sum(jnp.square(mu_C) + var_C - jnp.log(var_C) - 1.0)


def block_with_site(cfg: ModelConfig, block_params, x_BxLxD, rng=None, site: str = 'mlp_preact'):
  """One Transformer layer (as `model.Block.__call__`, same dropout key use) that also returns the
  activation at `site`. -> (output x_BxLxD, site activation)."""
  if site not in SITES:
    raise ConfigError(f'unknown standardization-loss site {site!r}; choose {", ".join(SITES)}.')
  block = transformer._merge(transformer._graphdefs(cfg)[1], block_params)
  rate = cfg.dropout
  rng_attn, rng_mlp = (None, None) if rng is None else jax.random.split(rng)
  drop = transformer.dropout
  if cfg.pre_ln:
    h = x_BxLxD + drop(block.attention(block.ln_attn(x_BxLxD)), rate, rng_attn)
    u = block.ln_mlp(h)
  else:
    h = block.ln_attn(x_BxLxD + drop(block.attention(x_BxLxD), rate, rng_attn))
    u = h
  pre = block.mlp_in(u)
  mlp = drop(block.mlp_out(jax.nn.gelu(pre)), rate, rng_mlp)
  out = h + mlp if cfg.pre_ln else block.ln_mlp(h + mlp)
  return out.astype(x_BxLxD.dtype), (pre if site == 'mlp_preact' else u)


def layers_with_stdloss(cfg: ModelConfig, layer_params, x_BxLxD, rng, terms: Terms, active_N=None):
  """`model.layers` (same scan, same per-layer dropout keys, same `lax.cond` skip of inactive
  layers) that also returns sum_l weight_N[l] * L_std(layer l's `site` activation), `terms`.

  The statistics are computed in every layer (one mean/variance reduction of the activation
  each: no matmul), so the same code serves every pipeline stage whichever layers it holds.
  """
  num = jax.tree.leaves(layer_params)[0].shape[0]
  rngs_N = None if rng is None else jax.random.split(rng, num)
  weight_N, site = jnp.asarray(terms.weight_N, jnp.float32), terms.site

  def body(carry, per_layer):
    x, aux = carry
    params, layer_rng, active, weight = per_layer

    def run(x):
      y, act = block_with_site(cfg, params, x, layer_rng, site)
      return y, standardization_loss(act)

    if active is None:
      y, l_std = run(x)
    else:
      y, l_std = jax.lax.cond(active, run, lambda x: (x, jnp.zeros((), jnp.float32)), x)
    return (y, aux + weight * l_std), None

  (x_BxLxD, aux), _ = jax.lax.scan(
    body,
    (x_BxLxD, jnp.zeros((), jnp.float32)),
    (layer_params, rngs_N, active_N, weight_N),
    unroll=cfg.scan_unroll(),
  )
  return x_BxLxD, aux


def _layer_weights(num_layers: int, weight: float, layer) -> np.ndarray:
  """[L] weights: `weight` at the regularised layer(s) (an int or a sequence), 0 elsewhere."""
  chosen = [layer] if isinstance(layer, (int, np.integer)) else list(layer)
  if not chosen or any(not 0 <= int(l) < num_layers for l in chosen):
    raise ConfigError(
      f"standardization-loss layer {layer} is outside the model's "
      f'{num_layers} layers; choose 0 .. {num_layers - 1}.'
    )
  weight_N = np.zeros(num_layers, np.float32)
  weight_N[np.asarray(chosen, int)] = weight
  return weight_N


def loss_with_stdloss(
  cfg: ModelConfig, params, batch: dict, std_loss: StdLoss, rng=None, *, training: bool = True
):
  """Task loss + weight * standardization loss of the chosen layers' site activation
  (`std_loss`), composed like `model.loss_fn` (same dropout keys: the task loss is its).

  -> (total, {'loss': task loss, 'stdloss': the unweighted auxiliary loss (summed over the
  chosen layers), 'total': total}). training=False returns the task loss alone as total.
  """
  if std_loss.site not in SITES:
    raise ConfigError(
      f'unknown standardization-loss site {std_loss.site!r}; choose {", ".join(SITES)}.'
    )
  chosen_L = _layer_weights(cfg.num_layers, 1.0, std_loss.layers)
  rng_embed, rng_layers = (None, None) if rng is None else jax.random.split(rng)
  x_BxLxD = transformer.embed(cfg, params['embed'], batch['inputs'], rng_embed)
  x_BxLxD, std = layers_with_stdloss(
    cfg, params['layers'], x_BxLxD, rng_layers, Terms(chosen_L, std_loss.site)
  )
  task, _ = transformer.head_loss(cfg, params['head'], params['embed'], x_BxLxD, batch['targets'])
  total = task + std_loss.weight * std if training else task
  return total, {'loss': task, 'stdloss': std, 'total': total}


def stdloss_stages(
  cfg: ModelConfig,
  layers_per_stage: Sequence[int],
  weight: float,
  layer,
  *,
  site: str = 'mlp_preact',
) -> StagedModel:
  """`partition.transformer_stages` plus the standardization loss of global layer `layer`
  (0-based; or a sequence of layers), carried to the head beside the hidden states (see the
  module docstring). Every stage runs the same code (`layers_with_stdloss` with its slice of
  a [G, N] weight table), so it is SPMD-uniform: no branch on the stage index, and a graph-mode
  Ouroboros stash has one fixed structure.

  Training (the stage has an rng) adds weight * L_std; evaluation (rng None) runs the plain
  layers and adds nothing, so the loss is the task loss. With the same rng a stage's output is
  `transformer_stages`' (same dropout keys). The loss metrics hold the task loss as 'task_loss'.
  """
  if site not in SITES:
    raise ConfigError(f'unknown standardization-loss site {site!r}; choose {", ".join(SITES)}.')
  weight_N = _layer_weights(cfg.num_layers, weight, layer)
  mask_GxN = partition.stage_mask(layers_per_stage)
  index_GxN = partition.layer_index(layers_per_stage)
  weight_GxN = jnp.asarray(np.where(mask_GxN, weight_N[index_GxN], 0.0))
  mask_GxN = jnp.asarray(mask_GxN)
  uneven = len(set(layers_per_stage)) > 1

  def embed(embed_params, tokens, rng):
    h_BxLxD = transformer.embed(cfg, embed_params, tokens, rng)
    return {'h': h_BxLxD, 'aux': jnp.zeros(h_BxLxD.shape[:1], jnp.float32)}

  def stage(stage_params, x, stage_index, rng):
    active_N = mask_GxN[stage_index] if uneven else None
    if rng is None:  # evaluation: plain layers, nothing added
      h = transformer.layers(cfg, stage_params, x['h'], None, transformer.PerLayer(active_N))
      return {'h': h, 'aux': x['aux']}
    terms = Terms(weight_GxN[stage_index], site)
    h, std = layers_with_stdloss(cfg, stage_params, x['h'], rng, terms, active_N)
    return {'h': h, 'aux': x['aux'] + std}

  def loss(head_params, embed_params, x, targets):
    task, _ = transformer.head_loss(cfg, head_params, embed_params, x['h'], targets)
    total = task + jnp.mean(x['aux']).astype(task.dtype)
    return total, {'loss': total, 'task_loss': task}

  return StagedModel(embed=embed, stage=stage, loss=loss, tied_embedding=cfg.tie_embeddings)
