"""The optimizers every schedule can use, by name, and the masks they share.

adamw   optax.adamw: the paper's optimizer.
nadamw  optax.nadamw with b1 0.99 by default: Nesterov momentum with a long memory, the recipe
        of Ajanthan et al. (ICML 2025, arXiv 2505.01099) for asynchronous pipelines.
muon    optax.contrib.muon on the layer kernels (Jordan et al. 2024), Adam on the rest.

Weight decay applies to layer kernels only (`kernel_mask`), so a parameter with a zero gradient
does not move at all. The staleness compensations that wrap these live in
schedules/compensation.py; the learning-rate schedule of a run in training/config.py.
"""

from __future__ import annotations

import jax
import optax

from ouroboros_jax.errors import ConfigError, field_ref

OPTIMIZERS = ('adamw', 'nadamw', 'muon')


def kernel_mask(tree):
  """True on matrices named 'kernel' (the layers' weights), False on embeddings, norms, biases."""
  return jax.tree_util.tree_map_with_path(
    lambda path, _: getattr(path[-1], 'key', None) == 'kernel', tree
  )


def adamw(
  learning_rate: float | optax.Schedule,
  *,
  weight_decay: float = 0.0,
  b1: float = 0.9,
  b2: float = 0.999,
  eps: float = 1e-8,
):
  """AdamW as the paper uses it; decay only on matrices named 'kernel' (not embeddings, norms or
  biases), so a parameter with a zero gradient does not move at all."""
  return optax.adamw(
    learning_rate, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, mask=kernel_mask
  )


def muon_dimensions(tree):
  """Muon's view of each parameter: a layer kernel [..., in, out] is a batch of in x out matrices
  (the stacked layer axis is a batch axis of the orthogonalisation); everything else is None,
  which optax.contrib.muon gives to Adam."""

  def dims(path, leaf):
    if getattr(path[-1], 'key', None) != 'kernel' or leaf.ndim < 2:
      return None
    return optax.contrib.MuonDimensionNumbers(
      reduction_axis=leaf.ndim - 2, output_axis=leaf.ndim - 1
    )

  return jax.tree_util.tree_map_with_path(dims, tree)


B2, EPS = 0.999, 1e-8  # Adam's (and the Adam part of Muon's) second moment and epsilon


def make_optimizer(
  name: str,
  learning_rate,
  *,
  weight_decay: float = 0.0,
  muon_learning_rate=None,
  b1: float | None = None,
) -> optax.GradientTransformation:
  """The base optimizer by name; weight decay on layer kernels only, in every case; Adam's second
  moment decay B2 and epsilon EPS.

  adamw   optax.adamw (b1 0.9): the paper's optimizer.
  nadamw  optax.nadamw with b1 0.99 by default: Nesterov momentum with a long memory, the recipe
          of Ajanthan et al. (ICML 2025, arXiv 2505.01099) for asynchronous pipelines.
  muon    optax.contrib.muon (beta 0.95 by default, Nesterov) on the layer kernels at
          `muon_learning_rate`, Adam at `learning_rate` on embeddings, norms and biases
          (Jordan et al. 2024, github.com/KellerJordan/Muon).
  """
  if name == 'adamw':
    return adamw(
      learning_rate, b1=0.9 if b1 is None else b1, b2=B2, eps=EPS, weight_decay=weight_decay
    )
  if name == 'nadamw':
    return optax.nadamw(
      learning_rate,
      b1=0.99 if b1 is None else b1,
      b2=B2,
      eps=EPS,
      weight_decay=weight_decay,
      mask=kernel_mask,
    )
  if name == 'muon':
    return optax.contrib.muon(
      learning_rate if muon_learning_rate is None else muon_learning_rate,
      beta=0.95 if b1 is None else b1,
      weight_decay=weight_decay,
      weight_decay_mask=kernel_mask,
      adam_learning_rate=learning_rate,
      adam_b1=0.9,
      adam_b2=B2,
      eps=EPS,
      muon_weight_dimension_numbers=muon_dimensions,
    )
  raise ConfigError(f'unknown {field_ref("optimizer", name)}; use {" or ".join(OPTIMIZERS)}.')
