"""Progressive layer dropping (PLD; Zhang & He, NeurIPS 2020, arXiv 2010.13369).

Every pre-LN layer l = 1..L (its *global* index, also when the layers are cut into pipeline
stages) carries a gate G_l ~ Bernoulli(p_l(t)) drawn afresh for every batch:

    h   = x + G_l * attn(LN(x)) / p_l
    out = h + G_l * ffn(LN(h)) / p_l

with the time schedule and the depth schedule

    theta(t) = (1 - theta_bar) * exp(-gamma * t) + theta_bar          (theta(0) = 1)
    p_l(t)   = 1 - (l / L) * (1 - theta(t))                          (lower layers kept more)

A dropped layer is skipped by `lax.cond` inside `model.layers` (no FLOPs, forward or backward);
a kept layer multiplies both residual branches by 1/p_l, so the expected output is unchanged.
At evaluation (rng None) every layer runs, unscaled: the plain model. Defaults theta_bar = 0.5,
gamma = 0.001 are DeepSpeed's; the paper's heuristic is gamma ~ 100 / total steps. PLD needs
pre-LN blocks: with post-LN blocks a skipped layer would also skip its LayerNorms (ConfigError).

Where the step t comes from. The gates of batch t are drawn at theta(t), t the batch's index
(the step that consumes it). `pld_stages` sets `StagedModel.takes_batch_index`, so every schedule
calls a stage with `batch_index=t` of the batch it runs: under Ouroboros a delayed or replayed
backward re-runs the stage with the *batch's* t and its key, so it draws the gates of the
forward (the gradient is of the network that ran). `tests/test_pld.py` checks the sharded
Ouroboros step with PLD against the slow reference, in both stash modes.

`training/loop.py` wires it up (`--pld THETA_BAR,GAMMA`); `kept_layers` re-draws the gates on the
host, so the FLOPs a run reports are those of the layers it really ran.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp

from ouroboros_jax import staged
from ouroboros_jax.errors import ConfigError, field_ref
from ouroboros_jax.models import model as transformer
from ouroboros_jax.models import partition
from ouroboros_jax.models.model import ModelConfig
from ouroboros_jax.staged import StagedModel

DEFAULT_THETA_BAR = 0.5
DEFAULT_GAMMA = 0.001
_GATE_SALT = 0x504C44  # 'PLD': the gate key is fold_in(rng, salt), dropout keeps rng itself


# ----------------------------------------------------------------------------- schedules


def theta(t, theta_bar: float = DEFAULT_THETA_BAR, gamma: float = DEFAULT_GAMMA):
  """Global keep ratio at step t: (1 - theta_bar) exp(-gamma t) + theta_bar."""
  t = jnp.asarray(t, jnp.float32)
  return (1.0 - theta_bar) * jnp.exp(-gamma * t) + theta_bar


def keep_probs(
  t,
  num_layers: int,
  theta_bar: float = DEFAULT_THETA_BAR,
  gamma: float = DEFAULT_GAMMA,
  layer_ids=None,
):
  """p_l(t) = 1 - (l / L)(1 - theta(t)) for the 1-based global layer indices `layer_ids`
  (default 1..L)."""
  layer_ids = jnp.arange(1, num_layers + 1) if layer_ids is None else jnp.asarray(layer_ids)
  return 1.0 - layer_ids.astype(jnp.float32) / num_layers * (1.0 - theta(t, theta_bar, gamma))


def gate_key(rng):
  """The key the gates of a layer stack are drawn from, given the stack's rng (the layers'
  dropout keys come from rng itself, as in the plain model)."""
  return jax.random.fold_in(rng, _GATE_SALT)


def draw_gates(key, p_N):
  """G_l ~ Bernoulli(p_l) -> (active_N bool, scale_N = 1 / p_N). p = 1 always keeps."""
  u_N = jax.random.uniform(key, jnp.shape(p_N))
  return u_N < p_N, 1.0 / p_N


def sample_gates(
  key,
  t,
  num_layers: int,
  theta_bar: float = DEFAULT_THETA_BAR,
  gamma: float = DEFAULT_GAMMA,
  layer_ids=None,
):
  """The gates of layers `layer_ids` (1-based, default 1..L) at step t -> (active, 1 / p)."""
  return draw_gates(key, keep_probs(t, num_layers, theta_bar, gamma, layer_ids))


def check_config(cfg: ModelConfig, theta_bar: float, gamma: float) -> None:
  if not cfg.pre_ln:
    raise ConfigError(
      'progressive layer dropping needs pre-LN blocks (a skipped post-LN layer '
      f'would skip its LayerNorms too); use {field_ref("pre_ln", True)} or turn PLD off.'
    )
  if not (0.0 < theta_bar <= 1.0 and gamma >= 0.0):
    raise ConfigError(
      f'PLD needs theta_bar in (0, 1] and gamma >= 0, got {theta_bar} and {gamma}; the defaults '
      'are 0.5 and 0.001 (the paper suggests gamma ~ 100 / total steps).'
    )


# ----------------------------------------------------------------------------- single device


class Rates(NamedTuple):
  """PLD's schedules: theta(t) falls from 1 to theta_bar at rate gamma (module docstring)."""

  theta_bar: float = DEFAULT_THETA_BAR
  gamma: float = DEFAULT_GAMMA


def pld_layers(cfg: ModelConfig, layer_params, x_BxLxD, rng, keep_N, active_N=None):
  """`model.layers` with PLD gates drawn at keep probabilities keep_N (p_l(t) of these N layers,
  `keep_probs` at their global indices).

  rng None (evaluation): every layer (of `active_N`, when given) runs, unscaled. Otherwise the
  gates are drawn from `gate_key(rng)` and the layers' dropout keys come from rng, as in the
  plain model (so theta = 1 gives the plain model, dropout masks included).
  """
  if rng is None:
    return transformer.layers(cfg, layer_params, x_BxLxD, None, transformer.PerLayer(active_N))
  gate_N, scale_N = draw_gates(gate_key(rng), keep_N)
  if active_N is not None:
    gate_N = gate_N & active_N
  per_layer = transformer.PerLayer(gate_N, scale_N.astype(x_BxLxD.dtype))
  return transformer.layers(cfg, layer_params, x_BxLxD, rng, per_layer)


def pld_loss_fn(cfg: ModelConfig, params, batch: dict, rng, step, rates: Rates = Rates()):
  """`model.loss_fn` with PLD on {'embed', 'layers', 'head'} params at training step `step`.
  Same key use as `model.loss_fn`, so theta = 1 gives its value."""
  check_config(cfg, *rates)
  rng_embed, rng_layers = (None, None) if rng is None else jax.random.split(rng)
  x_BxLxD = transformer.embed(cfg, params['embed'], batch['inputs'], rng_embed)
  keep_L = keep_probs(step, cfg.num_layers, *rates)
  x_BxLxD = pld_layers(cfg, params['layers'], x_BxLxD, rng_layers, keep_L)
  return transformer.head_loss(cfg, params['head'], params['embed'], x_BxLxD, batch['targets'])


def pld_stages(
  cfg: ModelConfig,
  layers_per_stage: Sequence[int],
  theta_bar: float = DEFAULT_THETA_BAR,
  gamma: float = DEFAULT_GAMMA,
) -> StagedModel:
  """`partition.transformer_stages` with progressive layer dropping in every stage.

  Every schedule passes a stage the index t of its batch (`batch_index`; a single-device call:
  `model.forward_loss(params, batch, key, batch_index=t)`). Each stage draws the gates of its own
  global layers from its own rng, so the draw is the same wherever the stage runs (one device, a
  ring, a pipeline).
  """
  check_config(cfg, theta_bar, gamma)
  mask_GxN = jnp.asarray(partition.stage_mask(layers_per_stage))
  first_G = partition.first_layers(layers_per_stage)
  uneven = len(set(layers_per_stage)) > 1

  def embed(embed_params, inputs, rng):
    return transformer.embed(cfg, embed_params, inputs, rng)

  def stage(stage_params, x_BxLxD, stage_index, rng, batch_index=None):
    active_N = mask_GxN[stage_index] if uneven else None
    if rng is None:  # evaluation: every layer, unscaled
      return transformer.layers(cfg, stage_params, x_BxLxD, None, transformer.PerLayer(active_N))
    if batch_index is None:
      raise ConfigError(
        'a PLD stage is training (it has an rng) but was given no batch index: call '
        'forward_loss(params, batch, key, batch_index=t), or run it through a schedule.'
      )
    ids_N = jnp.asarray(first_G)[stage_index] + 1 + jnp.arange(max(layers_per_stage))
    keep_N = keep_probs(batch_index, cfg.num_layers, theta_bar, gamma, ids_N)
    return pld_layers(cfg, stage_params, x_BxLxD, rng, keep_N, active_N)

  def loss(head_params, embed_params, x_BxLxD, targets):
    return transformer.head_loss(cfg, head_params, embed_params, x_BxLxD, targets)

  return StagedModel(
    embed=embed, stage=stage, loss=loss, tied_embedding=cfg.tie_embeddings, takes_batch_index=True
  )


def expected_layer_fraction(
  t, num_layers: int, theta_bar: float = DEFAULT_THETA_BAR, gamma: float = DEFAULT_GAMMA
) -> float:
  """Expected fraction of layers run at step t: mean_l p_l(t) (the FLOP saving is 1 - this)."""
  return float(jnp.mean(keep_probs(t, num_layers, theta_bar, gamma)))


# ----------------------------------------------------------------------------- options & FLOPs


def parse(text: str) -> tuple[float, float]:
  """'theta_bar,gamma' (the `--pld` flag) -> (theta_bar, gamma); 'default' gives DeepSpeed's
  (0.5, 0.001). Raises a one-line ConfigError for anything else."""
  if text.strip().lower() in ('default', 'on'):
    return DEFAULT_THETA_BAR, DEFAULT_GAMMA
  parts = text.split(',')
  try:
    if len(parts) != 2:
      raise ValueError
    theta_bar, gamma = float(parts[0]), float(parts[1])
  except ValueError:
    raise ConfigError(
      f'--pld takes THETA_BAR,GAMMA (e.g. --pld 0.5,0.001, or --pld default), got {text!r}.'
    ) from None
  if not 0.0 < theta_bar <= 1.0:
    raise ConfigError(f'--pld theta_bar must be in (0, 1], got {theta_bar}; 0.5 is the default.')
  if not gamma >= 0.0:
    raise ConfigError(
      f'--pld gamma must be >= 0, got {gamma}; 0.001 is the default (or about 100 / --steps).'
    )
  return theta_bar, gamma


@functools.partial(jax.jit, static_argnames=('layers_per_stage', 'num_layers'))
def kept_layers(
  seed: int,
  steps,
  layers_per_stage: tuple[int, ...],
  num_layers: int,
  theta_bar: float,
  gamma: float,
):
  """[T] number of layers a `pld_stages` model really ran at each training step in `steps`.

  Re-draws the gates on the host exactly as the stages draw them when stage s of batch t gets
  the key `staged.piece_rng(staged.batch_key(seed, t), s)`, i.e. under backprop,
  model_parallel, ouroboros (both forwards and stash modes), data_parallel with one replica and
  gpipe with one micro-batch. (With several data replicas or micro-batches each draws its own
  gates; `expected_layer_fraction` is then the right count on average.)
  """
  firsts = partition.first_layers(layers_per_stage)

  def one(t):
    key = staged.batch_key(seed, t)
    total = jnp.zeros((), jnp.int32)
    for s, (first, count) in enumerate(zip(firsts, layers_per_stage)):
      # pld_layers draws one gate per padded slot; only the stage's real layers count.
      width = max(layers_per_stage)
      ids = first + 1 + jnp.arange(width)
      active, _ = sample_gates(
        gate_key(staged.piece_rng(key, s)), t, num_layers, theta_bar, gamma, ids
      )
      total += jnp.sum(active[:count])
    return total

  return jax.vmap(one)(jnp.asarray(steps))
