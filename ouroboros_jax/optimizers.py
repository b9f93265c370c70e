"""The optimizers every schedule can use, by name, and the masks they share.

adamw   optax.adamw: the paper's optimizer.
nadamw  optax.nadamw with b1 0.99 by default: Nesterov momentum with a long memory, the recipe
        of Ajanthan et al. (ICML 2025, arXiv 2505.01099) for asynchronous pipelines.
muon    optax.contrib.muon on the layer kernels (Jordan et al. 2024), Adam on the rest; which
        leaves are matrices, and how: `muon_dimensions`, with the user's `muon_dims` for their
        own model (`kernel_dims` for a DenseGeneral or Einsum kernel).

Weight decay applies to layer kernels only (`kernel_mask`; under Muon, to the leaves it
orthogonalises), so a parameter with a zero gradient does not move at all. The staleness
compensations that wrap these live in schedules/compensation.py; the learning-rate schedule of a
run in training/optimizer_setup.py.
"""

from __future__ import annotations

import fnmatch
import functools
import warnings
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import optax

from ouroboros_jax.errors import ConfigError, field_ref

OPTIMIZERS = ('adamw', 'nadamw', 'muon')
# Each optimizer's first-moment decay (AdamW's and NAdamW's b1, Muon's beta) when none is given.
DEFAULT_MOMENTUM = {'adamw': 0.9, 'nadamw': 0.99, 'muon': 0.95}
# The stored precision of the per-weight state kept from step to step (--state-dtype): the
# optimizers' first moment (optax's mu_dtype: Muon's momentum, Adam's first moment; Adam's second
# moment stays in the parameters' dtype) and the staleness compensations' (DC-ASGD's running mean
# of g * g, weight prediction's latest update). Each is computed in float32 and rounded where it
# is stored. 'auto' resolves it (`TrainConfig.resolved_state_dtype`).
STATE_DTYPES = ('float32', 'bfloat16')


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
  mu_dtype=None,
):
  """AdamW as the paper uses it; decay only on matrices named 'kernel' (not embeddings, norms or
  biases), so a parameter with a zero gradient does not move at all. `mu_dtype`: optax's, the
  first moment's stored dtype (None: the parameters')."""
  return optax.adamw(
    learning_rate,
    b1=b1,
    b2=b2,
    eps=eps,
    mu_dtype=mu_dtype,
    weight_decay=weight_decay,
    mask=kernel_mask,
  )


def state_jnp_dtype(state_dtype: str):
  """A resolved --state-dtype (STATE_DTYPES) as the dtype its states are stored in; a one-line
  ConfigError for anything else ('auto' included: `TrainConfig.resolved_state_dtype` resolves
  it)."""
  if state_dtype == 'auto':
    raise ValueError(
      'state_jnp_dtype takes a resolved state_dtype; TrainConfig.resolved_state_dtype resolves '
      "'auto'."
    )
  if state_dtype not in STATE_DTYPES:
    raise ConfigError(
      f'unknown {field_ref("state_dtype", state_dtype)}; use auto, {" or ".join(STATE_DTYPES)}.'
    )
  return jnp.dtype(state_dtype)


MuonDims = (
  Mapping[str, 'optax.contrib.MuonDimensionNumbers | None']
  | Callable[[str, jax.Array], 'optax.contrib.MuonDimensionNumbers | None']
)
"""A user's view of their matrices for Muon (`make_optimizer(..., muon_dims=)`), either

- a mapping of leaf paths ('layers/attn/query/kernel'; glob patterns allowed, '*' crosses '/';
  the first match wins) to `kernel_dims(...)` (or any `optax.contrib.MuonDimensionNumbers`), or
  to None for Adam; a leaf no key matches gets the library's rule (`muon_dimensions`), or
- a callable (path, leaf) -> MuonDimensionNumbers | None, which decides every leaf itself."""


def kernel_dims(in_axes: int = 1, out_axes: int = 1) -> optax.contrib.MuonDimensionNumbers:
  """Muon's view of a Flax `Dense` / `DenseGeneral` / `Einsum` kernel: its last `in_axes +
  out_axes` axes are its input axes, then its output axes (DenseGeneral's `axis` and `features`),
  orthogonalised as one (product of input axes) x (product of output axes) matrix; every axis in
  front (stacked layers, stages) is a batch axis. Counted from the end, so one spec fits the
  kernel stacked or not: q/k/v [(G, N,) D, H, K] is kernel_dims(1, 2), the output projection
  [(G, N,) H, K, D] kernel_dims(2, 1), a Dense kernel [(G, N,) D, F] kernel_dims()."""
  if in_axes < 1 or out_axes < 1:
    raise ConfigError(
      f'kernel_dims needs in_axes >= 1 and out_axes >= 1, got {in_axes}, {out_axes}.'
    )
  return optax.contrib.MuonDimensionNumbers(
    reduction_axis=tuple(range(-(in_axes + out_axes), -out_axes)),
    output_axis=tuple(range(-out_axes, 0)),
  )


# The library's own models (model.py, txl.py): the modules whose `kernel` is a [..., in, out]
# matrix (any leading axes are stacked layers and stages), as the `MuonDims` the CLI passes for
# them (`training.optimizer_setup.make_optimizer`); a user's model gets no such exemption by
# name. And the leaves that are no matrix.
LIBRARY_KERNELS = frozenset({'qkv', 'attn_out', 'mlp_in', 'mlp_out', 'r_net', 'unembed'})
LIBRARY_DIMS = {
  pattern: kernel_dims()
  for module in sorted(LIBRARY_KERNELS)
  for pattern in (f'{module}/kernel', f'*/{module}/kernel')
}
NOT_MATRICES = frozenset({'bias', 'scale', 'embedding'})  # and names ending in '_bias',
# '_embedding' (a position embedding [1, L, D] is a table, not a matrix)
# The module groups the schedules apply an optimizer to one at a time (update.GROUPS).
GROUPS = ('embed', 'stages', 'head')


class MuonDimsWarning(UserWarning):
  """A matrix-shaped leaf that `muon_dimensions`'s rule cannot place for certain."""


def leaf_path(path) -> str:
  """'layers/qkv/kernel': a key path of jax.tree_util as the '/'-joined names `MuonDims` match."""
  names = []
  for key in path:
    for attr in ('key', 'name', 'idx'):
      if hasattr(key, attr):
        names.append(str(getattr(key, attr)))
        break
    else:
      names.append(str(key))
  return '/'.join(names)


def _library_dims(path: str, leaf, warned: set[str] | None, bias_shape=None):
  """The library's rule for one leaf; a warning, once per path in `warned`, where it guesses.
  `bias_shape`: the shape of the kernel's sibling 'bias', if it has one."""
  names = path.split('/')
  name = names[-1]
  if leaf.ndim < 2 or name in NOT_MATRICES or name.endswith(('_bias', '_embedding')):
    return None
  if name == 'kernel':
    if leaf.ndim > 2 and not _one_in_one_out(leaf.shape, bias_shape):
      _warn_once(
        warned,
        path,
        f'Muon reads the kernel {path!r} {tuple(leaf.shape)} as [..., in, out]: its leading '
        f'{leaf.ndim - 2} axes are batch axes (stacked layers or stages). If it is a DenseGeneral '
        f'or Einsum kernel with several input or output axes, pass muon_dims={{{path!r}: '
        'optimizers.kernel_dims(in_axes=..., out_axes=...)}; kernel_dims() confirms '
        '[..., in, out].',
      )
    return optax.contrib.MuonDimensionNumbers(
      reduction_axis=leaf.ndim - 2, output_axis=leaf.ndim - 1
    )
  _warn_once(
    warned,
    path,
    f"{path!r} {tuple(leaf.shape)} is matrix-shaped but not named 'kernel': Muon leaves it to "
    f'Adam, without weight decay. Pass muon_dims={{{path!r}: optimizers.kernel_dims(in_axes=..., '
    'out_axes=...)} to orthogonalise it (kernel_dims() for [..., in, out]), or None to confirm '
    'Adam.',
  )
  return None


def _one_in_one_out(kernel_shape, bias_shape) -> bool:
  """Whether a kernel's bias shows it is [..., in, out] (a Dense / Linear kernel, stacked): its
  bias is then [..., out], the kernel's shape without its input axis. A kernel with several input
  axes has a bias of fewer axes; one with several output axes [..., in, o1, ..., ob] has a bias
  of this shape only if in = o1 = ... = o(b-1), which makes the kernel's last axes but one equal:
  that case stays a guess."""
  if bias_shape is None or len(kernel_shape) < 3:
    return False
  dense_bias = tuple(kernel_shape[:-2]) + tuple(kernel_shape[-1:])
  return tuple(bias_shape) == dense_bias and kernel_shape[-3] != kernel_shape[-2]


def _warn_once(warned: set[str] | None, path: str, message: str) -> None:
  if warned is not None:
    if path in warned:
      return
    warned.add(path)
  warnings.warn(message, MuonDimsWarning, stacklevel=2)


def muon_dimensions(tree, dims: MuonDims | None = None, *, warned: set[str] | None = None):
  """Muon's view of each parameter, a tree of `optax.contrib.MuonDimensionNumbers` (None: Adam) for
  `optax.contrib.muon(muon_weight_dimension_numbers=)`: from the user's `dims` (`MuonDims`) where
  it places a leaf, else from the library's rule for its own models. That rule orthogonalises a
  leaf named 'kernel' as [..., in, out] (leading axes: stacked layers and stages, batch axes of the
  orthogonalisation), and gives Adam to biases, norms' scales, embeddings and vectors. It warns
  (`MuonDimsWarning`, naming the leaf and what to pass) where it guesses: a kernel of 3+ axes
  outside the library's own modules (a DenseGeneral kernel looks the same) unless its sibling
  'bias' is [..., out], which shows one input and one output axis (a stacked Dense / NNX Linear
  kernel), and a matrix-shaped leaf not named 'kernel' (it gets Adam). `warned`: the paths
  already warned about, which are not warned about again (make_optimizer keeps one set per
  optimizer); None: warn every call.

  The schedules apply the optimizer per module group ('embed', each stage, 'head'), so `dims`
  names paths within a group ('qkv/kernel'); on a whole {'embed', 'stages', 'head'} tree a
  pattern matches the full path or, failing that, the path within its group, so the optimizer
  reads each leaf as the schedules do."""

  shapes = {leaf_path(p): jnp.shape(a) for p, a in jax.tree_util.tree_leaves_with_path(tree)}
  whole = isinstance(tree, Mapping) and set(tree) == set(GROUPS)

  def leaf_dims(key_path, leaf):
    path = leaf_path(key_path)
    if callable(dims):
      return dims(path, leaf)
    # On a whole {'embed', 'stages', 'head'} tree, a pattern also matches the path within its
    # group, as the schedules (which apply the optimizer per group) read it.
    for candidate in (path, path.partition('/')[2]) if whole else (path,):
      for pattern, spec in (dims or {}).items():
        if fnmatch.fnmatchcase(candidate, pattern):
          return spec
    bias = shapes.get(path[: -len('kernel')] + 'bias') if path.endswith('kernel') else None
    return _library_dims(path, leaf, warned, bias)

  return jax.tree_util.tree_map_with_path(leaf_dims, tree)


B2, EPS = 0.999, 1e-8  # Adam's (and the Adam part of Muon's) second moment and epsilon


def make_optimizer(
  name: str,
  learning_rate,
  *,
  weight_decay: float = 0.0,
  muon_learning_rate=None,
  b1: float | None = None,
  muon_dims: MuonDims | None = None,
  state_dtype: str = 'float32',
) -> optax.GradientTransformation:
  """The base optimizer by name; weight decay on layer kernels only, in every case; Adam's second
  moment decay B2 and epsilon EPS; the first moment stored in `state_dtype` (STATE_DTYPES,
  optax's `mu_dtype`; float32: as optax keeps it for float32 parameters).

  adamw   optax.adamw (b1 0.9): the paper's optimizer.
  nadamw  optax.nadamw with b1 0.99 by default: Nesterov momentum with a long memory, the recipe
          of Ajanthan et al. (ICML 2025, arXiv 2505.01099) for asynchronous pipelines.
  muon    optax.contrib.muon (beta 0.95 by default, Nesterov) on the layer kernels at
          `muon_learning_rate`, Adam at `learning_rate` on embeddings, norms and biases
          (Jordan et al. 2024, github.com/KellerJordan/Muon). Which leaves are matrices, and
          which of their axes are inputs, outputs and batch: `muon_dimensions` with the user's
          `muon_dims` (e.g. {'*/query/kernel': kernel_dims(1, 2)} for a DenseGeneral q
          kernel [..., D, H, K]); its weight decay applies to every leaf it orthogonalises.
  """
  mu_dtype = state_jnp_dtype(state_dtype)
  if name == 'adamw':
    return adamw(
      learning_rate,
      b1=DEFAULT_MOMENTUM['adamw'] if b1 is None else b1,
      b2=B2,
      eps=EPS,
      weight_decay=weight_decay,
      mu_dtype=mu_dtype,
    )
  if name == 'nadamw':
    return optax.nadamw(
      learning_rate,
      b1=DEFAULT_MOMENTUM['nadamw'] if b1 is None else b1,
      b2=B2,
      eps=EPS,
      weight_decay=weight_decay,
      mask=kernel_mask,
      mu_dtype=mu_dtype,
    )
  if name == 'muon':
    return optax.contrib.muon(
      learning_rate if muon_learning_rate is None else muon_learning_rate,
      beta=DEFAULT_MOMENTUM['muon'] if b1 is None else b1,
      mu_dtype=mu_dtype,  # the Muon momentum and the Adam part's first moment
      weight_decay=weight_decay,
      weight_decay_mask=None,  # every Muon leaf: the Adam leaves take adam_weight_decay (0)
      adam_learning_rate=learning_rate,
      adam_b1=0.9,
      adam_b2=B2,
      eps=EPS,
      muon_weight_dimension_numbers=functools.partial(
        muon_dimensions, dims=muon_dims, warned=set()
      ),
    )
  raise ConfigError(f'unknown {field_ref("optimizer", name)}; use {" or ".join(OPTIMIZERS)}.')
