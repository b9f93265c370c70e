"""Staging a model: its layers stacked into stage groups, and `from_layers`, the one public way in.

A model made of an embedding, N layers of one kind and a head becomes a `StagedModel` and its
stacked parameters with one call:

    staging = from_layers(embed, layer, head, layers=per_layer_params, num_stages=2)
    schedule = build_schedule(config, staging.model, tx)
    state = schedule.init(staging.params, example_batch)
    ...
    mine = staging.to_layers(state.params)      # back to the layout the layers came in

`embed`, `layer` and `head` may each be a pure function, a Flax NNX module, or a Flax Linen
module (or its `apply`); layers that take more than x (a mask, positions) get them from
`context=`, and `staging.check(my_loss, batch)` compares the staged loss with your own. The N
layers are cut into G contiguous stage groups of `layers_per_stage` layers; an uneven split is
stored padded, leaves [G, max layers per stage, ...], and each stage skips its padding slots by
`lax.cond` on its stage index (no FLOPs, no gradient), so every schedule runs it and the exact
ones still equal backprop. The built-in Transformer and
Transformer-XL are staged by the same pieces (`to_staged`, `stage_mask`, `scan_layers`).

Shape letters: G stage groups, N layer slots per group (the most layers any group has).
"""

from __future__ import annotations

import collections.abc
import contextlib
import contextvars
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ouroboros_jax import layer_shards
from ouroboros_jax.choices import STASH_POLICY_NAMES
from ouroboros_jax.errors import ConfigError, field_ref
from ouroboros_jax.staged import StagedModel

PyTree = Any

# ----------------------------------------------------------------------------- the stage layout


def even_split(num_layers: int, num_stages: int) -> tuple[int, ...]:
  """Layers per stage as even as they go, the extra layers on the last stages: device 0 also
  holds the embedding and the head, so it gets the fewest."""
  if num_stages < 1:
    raise ConfigError(f'{field_ref("num_stages", num_stages)} must be at least 1.')
  if num_stages > num_layers:
    raise ConfigError(
      f'{num_layers} layers cannot fill {field_ref("num_stages", num_stages)} stage groups '
      '(each needs at least one layer); use fewer stages or more layers.'
    )
  base, extra = divmod(num_layers, num_stages)
  return tuple(base + (g >= num_stages - extra) for g in range(num_stages))


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


# What a layer group's forward keeps for its backward (--stash-policy, any schedule), as
# `jax.checkpoint` policies. 'all' keeps every residual JAX's VJP saves. The others keep less and
# recompute the rest in the backward from what they kept: the gradient is unchanged, only bytes
# move from memory to recomputation. 'dots' keeps matmul outputs (elementwise ops, norms and
# softmax are recomputed); 'nothing' keeps only the inputs (and, on Ouroboros' ring, the
# forward's weights: the backward recomputes at them).
STASH_POLICIES = {
  'all': None,
  'dots': jax.checkpoint_policies.dots_saveable,
  'dots_no_batch': jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
  'nothing': jax.checkpoint_policies.nothing_saveable,
}
assert tuple(STASH_POLICIES) == STASH_POLICY_NAMES  # the names the CLI and plan list without JAX

# The per-layer recomputation the layer loops trace under (`recompute_layers`): a
# `jax.checkpoint` policy, or None (keep every residual).
_LAYER_POLICY: contextvars.ContextVar = contextvars.ContextVar('layer_policy', default=None)


@contextlib.contextmanager
def recompute_layers(policy: str):
  """Within it, `scan_layers` runs each layer under `jax.checkpoint` with the stash policy named
  (STASH_POLICIES; 'all': no recomputation): the layer loop keeps what the policy saves of
  each layer ('nothing': only its input) and recomputes the rest in the backward, one layer at a
  time. What backprop and data parallelism use for --stash-policy (the gradient is unchanged).
  It acts while a function is traced, so enter it inside the function `jax.jit` traces."""
  token = _LAYER_POLICY.set(STASH_POLICIES[policy])
  try:
    yield
  finally:
    _LAYER_POLICY.reset(token)


def scan_layers(
  layer: Callable,
  params_N: PyTree,
  x: PyTree,
  rng=None,
  *,
  active_N=None,
  per_layer_N=None,
  skipped: Callable | None = None,
  unroll: int | bool = True,
):
  """Runs N stacked layers in order by `lax.scan`: `layer(params, x, rng, per_layer) -> (y, out)`
  with each layer's slice of params_N, its own key (None without rng) and its slice of
  per_layer_N (None: nothing). A layer with `active_N[n]` False is skipped by `lax.cond`: x
  passes through, its out is `skipped(per_layer)` (default zeros), and it costs no FLOPs and gets
  no gradient (the padding slots of an uneven split; dropped layers). Under FSDP in a stage
  schedule (`layer_shards.gathered_layers`) each layer's weights are gathered from their shards
  as it runs. Returns (x, the outs stacked [N, ...])."""
  num = jax.tree.leaves(params_N)[0].shape[0]
  rngs_N = None if rng is None else jax.random.split(rng, num)
  policy, gathering = _LAYER_POLICY.get(), layer_shards.active()
  if gathering is not None:  # FSDP: this layer's weights gathered here, never kept
    run_layer = layer
    layer = lambda params, *rest: run_layer(layer_shards.gather(params, gathering), *rest)
    policy = layer_shards.keep_policy(policy)
  if policy is not None:
    # A rolled scan keeps XLA from merging the recompute with the forward; unrolled, it can.
    rolled = unroll == 1 and not isinstance(unroll, bool)
    layer = jax.checkpoint(layer, policy=policy, prevent_cse=not rolled)

  def body(x, sliced):
    params, layer_rng, active, extra = sliced
    run = lambda x: layer(params, x, layer_rng, extra)
    if active is None:
      return run(x)
    if skipped is None:
      skip = lambda x: (x, jax.tree.map(jnp.zeros_like, jax.eval_shape(run, x)[1]))
    else:
      skip = lambda x: (x, skipped(extra))
    return jax.lax.cond(active, run, skip, x)

  try:
    return jax.lax.scan(body, x, (params_N, rngs_N, active_N, per_layer_N), unroll=unroll)
  except TypeError as e:
    if 'carry input and carry output must have equal types' not in str(e):
      raise
    found = next((line for line in str(e).splitlines() if line.startswith('The input carry')), '')
    raise ConfigError(
      'a layer must give back an activation of the shape and dtype it was given (activations '
      f'travel between stages as they are), and this one does not: {found}'
    ) from None


def layered_stage(layer: Callable, layers_per_stage: Sequence[int]) -> Callable:
  """`stage(stage_params, x, stage_index, rng)` running a group's layers, `layer(params, x, rng)
  -> x`, over leaves [N, ...]; an uneven split's padding slots are skipped by the stage index."""
  mask_GxN = jnp.asarray(stage_mask(layers_per_stage))
  uneven = len(set(layers_per_stage)) > 1

  def stage(stage_params, x, stage_index, rng):
    active_N = mask_GxN[stage_index] if uneven else None
    one = lambda params, x, layer_rng, _: (layer(params, x, layer_rng), None)
    return scan_layers(one, stage_params, x, rng, active_N=active_N)[0]

  return stage


# ----------------------------------------------------------------------------- from_layers


class Staging(NamedTuple):
  """What `from_layers` returns.

  model: the `StagedModel` every schedule takes.
  params: {'embed', 'stages' (leaves [G, N, ...]), 'head'}: what `Schedule.init` takes.
  layers_per_stage: the layers of each stage group (N = the largest).
  to_layers: staged params (e.g. `state.params`) -> {'embed', 'layers', 'head'}, the layers in
    the layout they came in (a list of per-layer trees, or stacked [num_layers, ...]).
  muon_dims: Muon's view of every kernel the modules describe (Flax `Dense`, `DenseGeneral`,
    NNX `Linear`, `LinearGeneral`: input axes, then output axes), by its path within its group,
    for `recipe(..., muon_dims=)` / `make_optimizer(..., muon_dims=)`; {} for pure functions.
  check(my_loss, batch): the staged model's loss on a batch against yours (see `check`).
  """

  model: StagedModel
  params: dict
  layers_per_stage: tuple[int, ...]
  to_layers: Callable[[dict], dict]
  muon_dims: dict

  def check(
    self,
    loss_of_batch: Callable[[dict], Any],
    batch: dict,
    *,
    params: dict | None = None,
    rtol: float = 1e-5,
    atol: float = 1e-6,
  ) -> tuple[float, float]:
    """(the staged model's loss, yours) on `batch`, after checking that they agree: the staged
    one is `model.forward_loss(params, batch)` (default `self.params`; no dropout), yours is
    `loss_of_batch(batch)` (a loss or (loss, aux); your own model as you run it, without
    dropout, e.g. through `nnx.view(model, deterministic=True)`). Raises ConfigError (one
    line, naming both losses) when |staged - yours| > atol + rtol * |yours|."""
    params = self.params if params is None else params
    staged = float(jax.jit(lambda p, b: self.model.forward_loss(p, b)[0])(params, batch))
    mine = loss_of_batch(batch)
    mine = float(mine[0] if isinstance(mine, tuple) else mine)
    if not abs(staged - mine) <= atol + rtol * abs(mine):  # NaN fails too
      raise ConfigError(
        f"Staging.check: the staged model's loss {staged:.7g} is not your loss {mine:.7g} on "
        f'this batch (|difference| {abs(staged - mine):.2g}); check the pieces, their order, the '
        'context the layers take and the loss against your model.'
      )
    return staged, mine


def from_layers(
  embed,
  layer,
  head,
  *,
  layers,
  embed_params=None,
  head_params=None,
  loss: Callable | None = None,
  num_stages: int | None = None,
  layers_per_stage: Sequence[int] | None = None,
  tied_embedding: bool = False,
  example_inputs=None,
  context: Callable[[Any], dict] | None = None,
  loss_weight: Callable[[Any], Any] | None = None,
) -> Staging:
  """A model of one embedding, N layers of one kind and a head, staged for every schedule.

  embed: the batch's 'inputs' (an array, or the dict it is) -> activations x; layer: x -> x (one
  layer); head: x -> what `loss` takes (logits). Each is a pure function, `embed(params, inputs,
  rng)`, `layer(params, x, rng)`, `head(params, x)` (with `tied_embedding`: `head(params,
  embed_params, x)`; rng: the piece's dropout key, None when the schedule draws none), a Flax NNX
  module, or a Flax Linen module or its `apply` (how each is called and seeded: `_piece`).
  layers: the N layers' parameters, a list (one tree per layer: Linen params, NNX `State`s or
    NNX modules) or one tree stacked on a leading axis of N (`nn.scan`, `nnx.vmap`). For an NNX
    `layer` it is the template whose structure every layer shares.
  embed_params, head_params: their parameters; an NNX module's own when left out. Linen's
    `Partitioned` boxes and NNX states are unboxed: the ring places the parameters itself.
  loss: (head's output, targets) -> loss or (loss, metrics); default: mean token cross-entropy
    of logits. loss_weight: targets -> what `loss` averages over (e.g. `(targets > 0).sum()`,
    a padded batch's valid tokens), for the whole batch's mean however the padding falls over
    micro-batches and replicas (`StagedModel.loss_weight`); None: every row weighs the same.
  num_stages or layers_per_stage: the stage groups (`ScheduleConfig.stage_groups`: num_stages,
    times 2 chunks for interleaved and zb_v); an uneven split pads and skips.
  example_inputs: token ids (shapes only, e.g. a batch's 'inputs'): Linen modules show their
    kernels' layouts only when run, so `muon_dims` covers Linen pieces only when given these.
  context: `context(inputs) -> dict` of what every layer needs besides x (a mask, positions,
    segment ids; each leaf leads with the batch axis), computed once per (micro-)batch at the
    embedding, carried between stages with x (`_with_context`); each layer is called
    `layer(x, **context)` (pure: `layer(params, x, rng, **context)`), the head takes x only.
  Raises ConfigError (one line) for layers that do not match or do not fill the stages.
  """
  (embed_fn, embed_params), layer_fn, (head_fn, head_params) = _pieces(
    (embed, layer, head), embed_params, head_params, tied_embedding
  )
  stacked, as_given = _stack(layers)
  layers_per_stage = _stage_split(stacked, num_stages, layers_per_stage)
  model = _staged_model(
    (embed_fn, layer_fn, head_fn), layers_per_stage, loss, context, tied_embedding, loss_weight
  )
  params, to_layers = _staged_params(
    {'embed': embed_params, 'layers': stacked, 'head': head_params}, layers_per_stage, as_given
  )
  pieces = (embed, embed_fn, embed_params), (layer, layer_fn, _first(stacked))
  dims = _muon_dims(*pieces, (head, head_fn, head_params), example_inputs, context)
  return Staging(model, params, tuple(layers_per_stage), to_layers, dims)


def token_cross_entropy(logits_BxLxV, targets_BxL):
  """Mean next-token cross-entropy (nats) of logits, computed in float32: (loss, {'loss'})."""
  logp_BxLxV = jax.nn.log_softmax(logits_BxLxV.astype(jnp.float32))
  loss = -jnp.take_along_axis(logp_BxLxV, targets_BxL[..., None], axis=-1).mean()
  return loss, {'loss': loss}


def _pieces(pieces, embed_params, head_params, tied_embedding: bool):
  """`from_layers`' pieces (embed, layer, head) as pure functions (`_piece`): ((embed, its
  parameters), layer, (head, its parameters)), the parameters given or an NNX module's own."""
  embed, layer, head = pieces
  embed_fn, embed_default = _piece(embed, 'embed', takes_rng=True)
  layer_fn, _ = _piece(layer, 'layer', takes_rng=True)
  head_fn, head_default = _piece(head, 'head', takes_rng=False)
  if tied_embedding and not _is_pure(head):
    raise ConfigError(
      f'{field_ref("tied_embedding")} needs a pure head, head(params, embed_params, x), to read '
      'the embedding; pass one, or tie nothing.'
    )
  embed_params = _params(embed_params, embed_default, 'embed_params', 'embed')
  head_params = _params(head_params, head_default, 'head_params', 'head')
  return (embed_fn, embed_params), layer_fn, (head_fn, head_params)


def _staged_model(
  pieces, layers_per_stage, loss, context, tied_embedding: bool, loss_weight
) -> StagedModel:
  """`from_layers`' StagedModel of its pure pieces (embed, layer, head) and its loss (None:
  `token_cross_entropy`)."""
  embed_fn, layer_fn, head_fn = pieces
  loss = token_cross_entropy if loss is None else loss
  staged_embed, staged_layer, take_x = _with_context(embed_fn, layer_fn, context)
  return StagedModel(
    embed=staged_embed,
    stage=layered_stage(staged_layer, layers_per_stage),
    loss=_head_loss(head_fn, loss, take_x, tied_embedding),
    tied_embedding=tied_embedding,
    loss_weight=loss_weight,
  )


def _stage_split(
  stacked: PyTree, num_stages: int | None, layers_per_stage: Sequence[int] | None
) -> tuple[int, ...]:
  """`from_layers`' stage groups of the layers `stacked` on a leading axis: `layers_per_stage`
  checked, or an even split into num_stages."""
  num_layers = jax.tree.leaves(stacked)[0].shape[0]
  if layers_per_stage is not None:
    return parse_layers_per_stage(layers_per_stage, num_layers, num_stages)
  if num_stages is None:
    raise ConfigError(
      f'from_layers needs {field_ref("num_stages")} or {field_ref("layers_per_stage")}; pass one.'
    )
  return even_split(num_layers, num_stages)


def _head_loss(head_fn: Callable, loss: Callable, take_x: Callable, tied_embedding: bool):
  """`StagedModel.loss` of `from_layers`' head and loss: (loss, metrics) of the head's output."""

  def head_loss(head_p, embed_p, x, targets):
    x = take_x(x)
    out = head_fn(head_p, embed_p, x) if tied_embedding else head_fn(head_p, x)
    result = loss(out, targets)
    return result if isinstance(result, tuple) else (result, {})

  return head_loss


def _staged_params(params: dict, layers_per_stage: Sequence[int], as_given: Callable):
  """(`Staging.params`, `Staging.to_layers`): `from_layers`' parameters ({'embed', 'layers'
  stacked, 'head'}) in the stage layout, and the way back to the layout the layers came in."""

  def to_layers(staged_params: dict) -> dict:
    flat = from_staged(staged_params, layers_per_stage)
    return {**flat, 'layers': as_given(flat['layers'])}

  return to_staged(params, layers_per_stage), to_layers


def _first(stacked: PyTree) -> PyTree:
  return jax.tree.map(lambda a: a[0], stacked)


def _with_context(embed_fn: Callable, layer_fn: Callable, context: Callable | None):
  """(embed, layer, the head's x) of the staged model. Without `context`: the pieces as they are.
  With it: the embedding's activations are {'x': x, **context(inputs)}, every layer takes
  `layer_fn(params, x, rng, **context)` and passes the context on, and the head reads 'x'."""
  if context is None:
    return embed_fn, layer_fn, lambda x: x

  def embed(params, inputs, rng):
    x = embed_fn(params, inputs, rng)
    return {'x': x, **_context_of(context, inputs, x)}

  def layer(params, act, rng):
    extra = {name: leaf for name, leaf in act.items() if name != 'x'}
    return {**act, 'x': layer_fn(params, act['x'], rng, **extra)}

  return embed, layer, lambda act: act['x']


def _context_of(context: Callable, inputs, x) -> dict:
  """`context(inputs)`, checked: a dict without 'x' whose every leaf leads with x's batch axis."""
  extra = context(inputs)
  if not isinstance(extra, collections.abc.Mapping) or 'x' in extra:
    got = "the key 'x'" if isinstance(extra, collections.abc.Mapping) else type(extra).__name__
    raise ConfigError(
      f'from_layers: context(inputs) must return a dict of what the layers take besides x, not '
      f"{got}; return e.g. {{'mask': ...}} under other names (x is the activations' own)."
    )
  rows = jax.tree.leaves(x)[0].shape[0]
  for path, leaf in jax.tree_util.tree_leaves_with_path(dict(extra)):
    if jnp.ndim(leaf) == 0 or jnp.shape(leaf)[0] != rows:
      raise ConfigError(
        f'from_layers: context{jax.tree_util.keystr(path)} has shape {jnp.shape(leaf)}, but what '
        f'travels between stages leads with the batch axis ({rows} rows); broadcast it, e.g. '
        f'jnp.broadcast_to(leaf, ({rows}, ...)).'
      )
  return dict(extra)


def _muon_dims(embed, layer, head, example_inputs, context=None) -> dict:
  """{path within its group: kernel_dims} for the kernels of Flax's linear modules in the pieces
  (NNX: read from the modules; Linen: recorded while the pieces run on `example_inputs`, shapes
  only).
  A path two groups read differently is left out (the library's rule then warns about it)."""
  from ouroboros_jax.optimizers import kernel_dims

  found: dict[str, Any] = {}
  clashes = set()

  def add(path, in_axes, out_axes):
    key, dims = '/'.join(map(str, (*path, 'kernel'))), kernel_dims(in_axes, out_axes)
    if found.setdefault(key, dims) != dims:
      clashes.add(key)

  nnx = _nnx()
  for piece, _, _ in (embed, layer, head):
    if isinstance(piece, nnx.Module):
      for path, module in nnx.iter_graph(piece):
        if isinstance(module, nnx.LinearGeneral):
          add(path, len(module.in_features), len(module.out_features))
        elif isinstance(module, nnx.Linear):
          add(path, 1, 1)
  linen = [piece for piece, _, _ in (embed, layer, head) if _linen_module(piece) is not None]
  if linen and example_inputs is not None:
    for path, in_axes, out_axes in _linen_kernels(embed, layer, head, example_inputs, context):
      add(path, in_axes, out_axes)
  return {key: dims for key, dims in found.items() if key not in clashes}


def _linen_kernels(
  embed, layer, head, inputs, context=None
) -> list[tuple[tuple[str, ...], int, int]]:
  """(module path, input axes, output axes) of each Linen Dense / DenseGeneral the Linen pieces
  call on `inputs` (and the layer on `context(inputs)`; `nn.intercept_methods` under
  `jax.eval_shape`: no FLOPs)."""
  from flax import linen

  calls, recording = [], [False]  # record inside the Linen pieces only: a pure function's
  # modules may sit under other paths than its parameters'

  def record(next_fun, args, kwargs, context):
    module = context.module
    linear = isinstance(module, (linen.Dense, linen.DenseGeneral))
    if recording[0] and context.method_name == '__call__' and linear:
      axis = getattr(module, 'axis', -1)
      features = module.features
      in_axes = len(axis) if isinstance(axis, (tuple, list)) else 1
      out_axes = len(features) if isinstance(features, (tuple, list)) else 1
      calls.append((tuple(module.scope.path), in_axes, out_axes))
    return next_fun(*args, **kwargs)

  def run(piece, p, *args, **extra):
    recording[0] = _linen_module(piece[0]) is not None
    try:
      return piece[1](p, *args, **extra)
    finally:
      recording[0] = False

  def trace(embed_p, layer_p, head_p):
    x = run(embed, embed_p, inputs, None)
    x = run(layer, layer_p, x, None, **({} if context is None else context(inputs)))
    return run(head, head_p, x) if _linen_module(head[0]) is not None else x

  with linen.intercept_methods(record):
    jax.eval_shape(trace, embed[2], layer[2], head[2])
  return calls


# ----------------------------------------------------------------------------- the pieces


def _nnx():
  from flax import nnx

  return nnx


def _linen_module(piece):
  """The Linen module of `piece` (a module, or a module's `apply`), or None."""
  from flax import linen

  if isinstance(piece, linen.Module):
    return piece
  owner = getattr(piece, '__self__', None)
  if isinstance(owner, linen.Module) and getattr(piece, '__name__', '') == 'apply':
    return owner
  return None


def _is_pure(piece) -> bool:
  return not isinstance(piece, _nnx().Module) and _linen_module(piece) is None


def _piece(piece, what: str, *, takes_rng: bool):
  """(a pure function of (params, *args[, rng], **context), the module's own parameters or
  None) of one of `from_layers`' pieces:
    - a pure function: as it is; rng is the piece's dropout key, None when the schedule draws
      none;
    - a Flax NNX module, called as `module(x)` with the parameters (`nnx.Param`) it is given;
      every RNG stream it holds is reseeded from the piece's key (a dropout built without rngs
      gets one), and without a key (`evaluate`; the head always) it runs its deterministic view,
      no dropout; its other state (batch statistics) is the module's own and is not trained;
    - a Flax Linen module or its `apply`, called as `apply({'params': p}, x)` (with
      `rngs={'dropout': rng}` when there is a key)."""
  if isinstance(piece, _nnx().Module):
    return _nnx_piece(piece, takes_rng)
  module = _linen_module(piece)
  if module is not None:

    def apply(p, *args, **context):
      rngs = None
      if takes_rng:
        *args, rng = args
        rngs = None if rng is None else {'dropout': rng}
      return module.apply({'params': p}, *args, rngs=rngs, **context)

    return apply, None
  if not callable(piece):
    raise ConfigError(
      f'from_layers: {what} must be a function, an NNX module or a Linen module, got '
      f'{type(piece).__name__}.'
    )
  return piece, None


def _nnx_piece(piece, takes_rng: bool):
  """An NNX module as a pure function of its parameters. Every call merges a fresh module in
  its own trace (the user's module is never mutated) and, given the piece's key, reseeds every
  RNG stream it holds from that key alone; without a key (`evaluate`, the head) it runs its
  deterministic view (`nnx.view(..., deterministic=True)`: no dropout)."""
  nnx = _nnx()
  graphdef, params, rest = nnx.split(piece, nnx.Param, ...)
  rest = nnx.to_pure_dict(rest)  # arrays, not the module's Variables: merged afresh per trace

  def call(p, *args, **context):
    rng = args[-1] if takes_rng else None
    module = nnx.merge(graphdef, p, rest)
    module = _deterministic(module) if rng is None else _seeded(module, rng)
    return module(*(args[:-1] if takes_rng else args), **context)

  return call, nnx.to_pure_dict(params)


def _deterministic(module):
  return _nnx().view(module, deterministic=True, raise_if_not_found=False)


def _seeded(module, rng):
  """`module` (a fresh merge) with its i-th RNG stream keyed fold_in(rng, i), its count reset,
  and a stream of the same kind for each dropout module built without rngs: the same key, the
  same masks, in any schedule."""
  nnx = _nnx()
  nodes = [node for _, node in nnx.iter_graph(module)]
  streams = [node for node in nodes if isinstance(node, nnx.RngStream)]
  for i, stream in enumerate(streams):
    shape = stream.key.get_value().shape
    key = jax.random.fold_in(rng, i)
    if shape:  # a split stream (nnx.split_rngs): one key per slot
      key = jax.random.split(key, int(np.prod(shape))).reshape(shape)
    stream.key.set_value(key)
    stream.count.set_value(jnp.zeros(shape, jnp.uint32))
  needy = [node for node in nodes if _draws_without_rngs(node)]
  for j, node in enumerate(needy, len(streams)):
    node.rngs = nnx.RngStream(jax.random.fold_in(rng, j), tag='dropout')
  return module


def _draws_without_rngs(node) -> bool:
  """An NNX dropout (nnx.Dropout, attention dropout) built without rngs, which would fail."""
  nnx = _nnx()
  if isinstance(node, nnx.Dropout):
    return node.rngs is None and node.rate > 0
  if isinstance(node, nnx.MultiHeadAttention):
    return node.rngs is None and node.dropout_rate > 0
  return False


def _params(given, default, name: str, what: str):
  if given is None and default is None:
    raise ConfigError(
      f'from_layers: pass {name}= (the parameters of {what}); only an NNX module brings its own.'
    )
  return _unbox(default if given is None else given)


def _unbox(tree: PyTree) -> PyTree:
  """Plain arrays: Linen's `Partitioned` boxes and NNX `State`s / `Variable`s / modules unboxed."""
  from flax import linen

  nnx = _nnx()
  if isinstance(tree, nnx.Module):
    tree = nnx.state(tree, nnx.Param)
  if isinstance(tree, nnx.State):
    tree = nnx.to_pure_dict(tree)
  tree = linen.meta.unbox(tree)
  is_variable = lambda v: isinstance(v, nnx.Variable)
  return jax.tree.map(lambda v: v.value if is_variable(v) else v, tree, is_leaf=is_variable)


def _stack(layers) -> tuple[PyTree, Callable[[PyTree], Any]]:
  """(the layers stacked [N, ...], the way back to the layout they were given in)."""
  if isinstance(layers, collections.abc.Sequence):  # a list, a tuple, an nnx.List of modules
    layers = list(layers)
    if not layers:
      raise ConfigError('from_layers: `layers` is empty; pass one parameter tree per layer.')
    trees = [_unbox(tree) for tree in layers]
    first = jax.tree.structure(trees[0])
    for i, tree in enumerate(trees[1:], 1):
      if jax.tree.structure(tree) != first:
        raise ConfigError(
          f'from_layers: layer {i} has other parameters than layer 0 ({_paths(tree, trees[0])}); '
          'every layer must be the same kind.'
        )
      shapes = [(jnp.shape(a), jnp.result_type(a)) for a in jax.tree.leaves(tree)]
      if shapes != [(jnp.shape(a), jnp.result_type(a)) for a in jax.tree.leaves(trees[0])]:
        raise ConfigError(
          f'from_layers: layer {i} has parameters of other shapes or dtypes than layer 0; every '
          'layer must be the same kind.'
        )
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *trees)
    count = len(trees)
    back = lambda stacked: [jax.tree.map(lambda a, i=i: a[i], stacked) for i in range(count)]
    return stacked, back
  stacked = _unbox(layers)
  leading = {jnp.shape(a)[:1] for a in jax.tree.leaves(stacked)}
  if len(leading) != 1 or () in leading:
    raise ConfigError(
      'from_layers: stacked `layers` must lead with the layer axis on every leaf (found leading '
      f'axes {sorted(leading)}); pass a list with one tree per layer instead.'
    )
  return stacked, lambda stacked: stacked


def _paths(tree, other) -> str:
  names = lambda t: {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(t)}
  differ = sorted(names(tree) ^ names(other))
  return ', '.join(differ[:3]) or 'another structure'
