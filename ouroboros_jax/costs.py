"""The one FLOP count and cost model: what a layer, the head and a step cost, and how the layers
are balanced over the ring's devices.

Everything that counts FLOPs (the training loop's `flops` column, the growth and V-cycle drivers,
the stage balance, the simulator, the benchmark's predictions) uses these formulas. Per token, in
the forward pass:

    layer  F = 2 (4 d^2 + 2 d f) + 2 L d     QKV and output projections, the MLP, causal scores
    head   H = 2 d V + 5 V + 2 d             the tied output projection, softmax and loss

with d = d_model, f = d_ff, L = seq_len, V = vocabulary. A backward costs twice its forward, so a
trained layer costs 3F and a frozen one (forward only) F. `matmul_flops` counts a traced
function's matmuls from its jaxpr instead: the tests use it to prove the formulas.
"""

from __future__ import annotations

from typing import Callable

from ouroboros_jax.errors import (
  ConfigError,
  field_ref,
)  # standard library only, like this module: the

# simulator reads the costs without JAX or NumPy


def layer_flops(d_model: int, d_ff: int, seq_len: int) -> float:
  """Forward FLOPs per token of one Transformer layer (F above)."""
  d = d_model
  return 2 * (4 * d * d + 2 * d * d_ff) + 2 * seq_len * d


def head_flops(d_model: int, vocab: int) -> float:
  """Forward FLOPs per token of the embedding, output projection and softmax loss (H above)."""
  return 2 * d_model * vocab + 5 * vocab + 2 * d_model


# optax.contrib.muon's Newton-Schulz steps (`ns_steps`), which the library leaves at its default.
NEWTON_SCHULZ_STEPS = 5
# The values an optimizer's elementwise pass moves per parameter: Adam reads the parameter, its
# gradient and two moments and writes three back; Muon's momentum pass moves 5 (the same order).
UPDATE_VALUES_PER_PARAM = 7


def newton_schulz_flops(rows: int, cols: int, steps: int = NEWTON_SCHULZ_STEPS) -> float:
  """Matmul FLOPs of Muon's orthogonalisation of one rows x cols matrix (optax.contrib.muon's
  `orthogonalize_via_newton_schulz`): each step X <- a X + (b A + c A A) X with A = X X^T on the
  short side m (n the long one), 2 m^2 n + 2 m^3 + 2 m^2 n."""
  m, n = sorted((rows, cols))
  return steps * (4 * m * m * n + 2 * m**3)


def layer_update_flops(optimizer: str, d_model: int, d_ff: int) -> float:
  """Matmul FLOPs of one layer's optimizer update: Muon orthogonalises its four kernels whole
  (QKV d x 3d, the attention's output d x d, the MLP's d x f and f x d:
  `optimizers.muon_dimensions`); AdamW's and NAdamW's updates are elementwise (none)."""
  if optimizer != 'muon':
    return 0.0
  d = d_model
  return (
    newton_schulz_flops(d, 3 * d) + newton_schulz_flops(d, d) + 2 * newton_schulz_flops(d, d_ff)
  )


def model_flops(cfg) -> tuple[float, float]:
  """(F, H) of a `ModelConfig`."""
  return (layer_flops(cfg.d_model, cfg.d_ff, cfg.seq_len), head_flops(cfg.d_model, cfg.vocab_size))


def step_flops(cfg, tokens: int, trained_layers=None, frozen_layers: int = 0):
  """FLOPs of one training step on `tokens` tokens: 3F per trained layer (all of cfg's by
  default; PLD passes the layers it kept, a number or an array of them), F per frozen one, 3H
  for the head."""
  per_layer, head = model_flops(cfg)
  trained = cfg.num_layers - frozen_layers if trained_layers is None else trained_layers
  return (3.0 * (trained * per_layer + head) + frozen_layers * per_layer) * tokens


def check_stages(num_layers: int, num_stages: int) -> None:
  """Every stage holds at least one layer."""
  if num_stages < 1:
    raise ConfigError(f'{field_ref("num_stages")} must be >= 1, got {num_stages}.')
  if num_stages > num_layers:
    raise ConfigError(
      f'{field_ref("num_stages", num_stages)} cuts the model into {num_stages} groups of '
      f'whole layers, one or more each, but the model has only {num_layers} '
      f'layer{"s" * (num_layers != 1)}; use {field_ref("num_stages", num_layers)} or fewer, or '
      f'{field_ref("num_layers", num_stages)} or more.'
    )


def balance_layers(
  num_layers: int, num_stages: int, layer_cost: float, device0_extra: float
) -> tuple[int, ...]:
  """Contiguous layers per stage minimising the busiest device. Device 0 of the ring holds the
  embedding and the head as well as the first group, so it pays `device0_extra` and gets fewer
  layers than the others."""
  check_stages(num_layers, num_stages)
  best = None
  for first in range(1, num_layers - num_stages + 2):
    rest, others = num_layers - first, num_stages - 1
    if others == 0 and rest:
      continue
    counts = [first] + [rest // others + (i < rest % others) for i in range(others)]
    cost = max([first * layer_cost + device0_extra] + [n * layer_cost for n in counts[1:]])
    if best is None or cost < best[0]:
      best = (cost, tuple(counts))
  return best[1]


def matmul_flops(fn: Callable, *args) -> int:
  """Matmul FLOPs (2 * multiply-adds of every `dot_general`) of fn(*args), read off its jaxpr.

  Unlike XLA's `cost_analysis()`, which counts the body of a `while` loop (every `lax.scan`,
  hence `model.layers`) once whatever its trip count, this multiplies a scan body by its length.
  A `cond` counts its most expensive branch. Used to prove what a step differentiates.
  """
  import jax

  return _jaxpr_flops(jax.make_jaxpr(fn)(*args).jaxpr)


def _jaxpr_flops(jaxpr) -> int:
  import jax.extend.core as jex_core
  import numpy as np

  total = 0
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name == 'dot_general':
      (contract, _), _ = eqn.params['dimension_numbers']
      lhs = eqn.invars[0].aval.shape
      depth = int(np.prod([lhs[i] for i in contract])) if contract else 1
      total += 2 * int(np.prod(eqn.outvars[0].aval.shape)) * depth
    elif name == 'scan':
      total += eqn.params['length'] * _jaxpr_flops(eqn.params['jaxpr'].jaxpr)
    elif name == 'cond':
      total += max(_jaxpr_flops(branch.jaxpr) for branch in eqn.params['branches'])
    else:
      for sub in jex_core.jaxprs_in_params(eqn.params):
        total += _jaxpr_flops(sub)
  return total
