"""Growing the depth while training: multi-stage layerwise training (MSLT) and progressive stacking.

MSLT ("Progressively Stacking 2.0", arXiv 2011.13635): training starts from a shallow model and
the depth grows phase by phase by adding layers on top. In every phase after the first only the
newly added top layers (and the head) are trained; the earlier layers are frozen and run
*forward only*: no backward pass, no gradient, no optimizer update for them.
Progressive stacking (Gong et al., ICML 2019), its ancestor: train L layers, copy the whole stack
on top of itself (layers 1..L become L+1..2L) and keep training *all* layers.

Both are a `GrowthPlan` run by `train_growth(plan, cfg, batches, tx_factory)`. What the papers
leave open is an option here, with these defaults:

  init         'copy_top' (default): the k new layers copy the current top k layers, in order
               (k = L copies the whole stack: stacking); 'random': fresh layers, initialised as
               `model.init_params` would for the new depth.
  final_steps  0 (default): no final phase; > 0: a last phase at full depth training everything.
  opt_state    'reset' (default): every phase starts with a fresh optimizer state (the new
               phase's `tx_factory(phase)`); 'carry': layers that already existed keep their
               optimizer state (Adam moments and step count) from the last phase that trained
               them, new layers start fresh. The optimizer state is kept *per layer* (vmapped
               over the layer axis, as `staged` does per pipeline stage), which is what makes
               'carry' a slice-and-concatenate; for Adam it is the same update as one state.
  train_embedding  False (default): in MSLT phases after the first the embedding V is frozen
               with the bottom layers. With a tied embedding the output projection V^T is then
               frozen too, and only the new layers and the head's own parameters (final
               LayerNorm, untied unembedding) train. True: V also trains, through the head only
               (its input side stays forward-only).

How a layer is frozen (`mslt_grads`, `make_step`): the embedding and the bottom layers run
*outside* the function that `jax.value_and_grad` differentiates, and their output enters it
through `lax.stop_gradient`. So autodiff never sees them and the step has no backward for them:
`tests/test_growth.py` counts the step's matmul FLOPs from its jaxpr (`costs.matmul_flops`; XLA's
`cost_analysis()` counts a scan's body once whatever its length, so it cannot show this) and
finds each frozen layer costing exactly its forward. Frozen parameters are not inputs of the
optimizer update either, so they do not change (not even by weight decay). They run in training
mode (dropout on, if the model has dropout).

FLOPs in the log are the usual estimate per token: a frozen layer costs its forward F, a trained
layer F + 2F (forward and backward), the head 3 H (`costs`).

From the command line: `ouroboros train --growth mslt:1x300,2x300,4x*,all:300` or
`--growth stacking:2x300,4x*` (`parse_plan` has the syntax; `phased.train_phased` runs it, on
--schedule backprop only: a stage-parallel schedule would change its stages' layers mid-run).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Iterable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ouroboros_jax import costs, staged
from ouroboros_jax.errors import ConfigError
from ouroboros_jax.models import model as transformer
from ouroboros_jax.models.model import ModelConfig
from ouroboros_jax.update import clip_by_global_norm, update_group

METHODS = ('mslt', 'stacking')
INITS = ('copy_top', 'random')
OPT_STATES = ('reset', 'carry')


@dataclasses.dataclass(frozen=True)
class GrowthPlan:
  """Depth and length of every phase; see the module docstring for the options.

  depths: the model depth in each phase, strictly increasing; the last one is the full depth.
  steps: training steps of each phase (same length as depths).
  method: 'mslt' (train the new top layers only) or 'stacking' (train all layers).
  """

  depths: tuple[int, ...]
  steps: tuple[int, ...]
  method: str = 'mslt'
  init: str = 'copy_top'
  final_steps: int = 0
  opt_state: str = 'reset'
  train_embedding: bool = False

  def validate(self, cfg: ModelConfig | None = None) -> None:
    if self.method not in METHODS:
      raise ConfigError(f'unknown growth method {self.method!r}; choose mslt or stacking.')
    if self.init not in INITS:
      raise ConfigError(f'unknown growth init {self.init!r}; choose copy_top or random.')
    if self.opt_state not in OPT_STATES:
      raise ConfigError(f'unknown growth opt_state {self.opt_state!r}; choose reset or carry.')
    if not self.depths or len(self.depths) != len(self.steps):
      raise ConfigError(
        f'a growth plan needs one step count per phase: depths {self.depths}, steps {self.steps}.'
      )
    if any(d < 1 for d in self.depths) or any(b <= a for a, b in zip(self.depths, self.depths[1:])):
      raise ConfigError(
        f'growth depths must be positive and strictly increasing, got {self.depths}.'
      )
    if any(s < 0 for s in self.steps) or self.final_steps < 0:
      raise ConfigError('growth step counts must be >= 0.')
    if cfg is not None and self.depths[-1] != cfg.num_layers:
      raise ConfigError(
        f'the growth plan ends at depth {self.depths[-1]} but the model has '
        f'{cfg.num_layers} layers; make the last depth --num-layers.'
      )

  def phases(self) -> list[tuple[int, int, int]]:
    """[(depth, steps, number of frozen bottom layers)] including the final phase, if any."""
    out = []
    for i, (depth, steps) in enumerate(zip(self.depths, self.steps)):
      frozen = self.depths[i - 1] if (self.method == 'mslt' and i > 0) else 0
      out.append((depth, steps, frozen))
    if self.final_steps:
      out.append((self.depths[-1], self.final_steps, 0))
    return out


def stacking_plan(
  start_depth: int, num_doublings: int, steps: tuple[int, ...], opt_state: str = 'reset'
) -> GrowthPlan:
  """Progressive stacking: depth start, 2 start, 4 start, ... (e.g. 3 -> 6 -> 12)."""
  depths = tuple(start_depth * 2**i for i in range(num_doublings + 1))
  return GrowthPlan(
    depths=depths, steps=steps, method='stacking', init='copy_top', opt_state=opt_state
  )


# ----------------------------------------------------------------------------- growing


def grow(
  params: dict,
  new_depth: int,
  init: str = 'copy_top',
  *,
  cfg: ModelConfig | None = None,
  key: jax.Array | None = None,
) -> dict:
  """{'embed','layers' [L,...],'head'} -> the same with layers [new_depth, ...].

  'copy_top': new layer L + j (j = 0..k-1, k = new_depth - L) copies old layer (L - k + j) mod L,
    i.e. the top k layers in order; k = L is progressive stacking (layer i -> L + i), k > L
    repeats the stack.
  'random': fresh layers as `model.init_params(cfg with num_layers=new_depth, key)` makes its
    top k layers (needs cfg and key).
  """
  old = jax.tree.leaves(params['layers'])[0].shape[0]
  k = new_depth - old
  if k < 0:
    raise ConfigError(f'cannot grow {old} layers to {new_depth}.')
  if init == 'copy_top':
    return {**params, 'layers': _copy_top(params['layers'], k)}
  if init == 'random':
    if cfg is None or key is None:
      raise ConfigError("grow(init='random') needs cfg and key.")
    fresh = transformer.init_params(dataclasses.replace(cfg, num_layers=new_depth), key)
    return {**params, 'layers': _concat(params['layers'], _slice(fresh['layers'], old))}
  raise ConfigError(f'unknown growth init {init!r}; choose copy_top or random.')


@functools.partial(jax.jit, static_argnums=1)
def _copy_top(layers, k: int):
  """layers [L, ...] -> [L + k, ...], new layer L + j copying layer (L - k + j) mod L."""
  old = jax.tree.leaves(layers)[0].shape[0]
  source = np.asarray([(old - k + j) % old for j in range(k)], np.int32)
  return jax.tree.map(lambda a: jnp.concatenate([a, a[source]]), layers)


def stack(params: dict) -> dict:
  """Progressive stacking's step: layers 1..L copied to L+1..2L."""
  depth = jax.tree.leaves(params['layers'])[0].shape[0]
  return grow(params, 2 * depth, 'copy_top')


# ----------------------------------------------------------------------------- the step


def init_opt_state(tx: optax.GradientTransformation, params: dict) -> dict:
  """One optimizer state per group, the layers' vmapped over the layer axis (one per layer)."""
  return {
    'embed': tx.init(params['embed']),
    'layers': jax.vmap(tx.init)(params['layers']),
    'head': tx.init(params['head']),
  }


def _slice(tree, start, stop=None):
  return jax.tree.map(lambda a: a[start:stop], tree)


def _concat(bottom, top):
  return jax.tree.map(lambda a, b: jnp.concatenate([a, b]), bottom, top)


def frozen_forward(cfg: ModelConfig, params: dict, num_frozen: int, inputs, rng):
  """Embedding and the bottom `num_frozen` layers, forward only: their output under
  `stop_gradient`. Call it outside any differentiated function."""
  rng_embed, rng_bottom = (None, None) if rng is None else jax.random.split(rng)
  x_BxLxD = transformer.embed(cfg, params['embed'], inputs, rng_embed)
  x_BxLxD = transformer.layers(cfg, _slice(params['layers'], 0, num_frozen), x_BxLxD, rng_bottom)
  return jax.lax.stop_gradient(x_BxLxD)


def top_loss(cfg: ModelConfig, trainable: dict, embed_params: dict, x_BxLxD, targets, rng):
  """The differentiated part of an MSLT step: the trained top layers and the head.

  trainable: {'layers': top layers, 'head': ..., optionally 'embed'} (the tied projection uses
  trainable['embed'] when present, else the frozen `embed_params`).
  """
  x_BxLxD = transformer.layers(cfg, trainable['layers'], x_BxLxD, rng)
  embed_params = trainable.get('embed', embed_params)
  return transformer.head_loss(cfg, trainable['head'], embed_params, x_BxLxD, targets)[0]


def mslt_grads(
  cfg: ModelConfig, params: dict, batch: dict, rng, num_frozen: int, train_embedding: bool = False
):
  """(loss, grads of the trainable groups, the trainable groups) of one batch.

  num_frozen = 0: plain backprop of `model.loss_fn` (same keys), every group trainable.
  num_frozen > 0: the embedding and layers [0, num_frozen) run forward only (`frozen_forward`,
  outside `value_and_grad`); layers [num_frozen, L), the head and (train_embedding) V are
  differentiated.
  """
  if num_frozen == 0:
    loss_of = lambda p: transformer.loss_fn(cfg, p, batch, rng)[0]
    loss, grads = jax.value_and_grad(loss_of)(params)
    return loss, grads, params
  rng_frozen, rng_top = (None, None) if rng is None else jax.random.split(rng)
  x_BxLxD = frozen_forward(cfg, params, num_frozen, batch['inputs'], rng_frozen)
  trainable = {'layers': _slice(params['layers'], num_frozen), 'head': params['head']}
  if train_embedding:
    trainable['embed'] = params['embed']
  loss, grads = jax.value_and_grad(top_loss, argnums=1)(
    cfg, trainable, params['embed'], x_BxLxD, batch['targets'], rng_top
  )
  return loss, grads, trainable


def make_step(
  cfg: ModelConfig,
  tx: optax.GradientTransformation,
  num_frozen: int,
  *,
  train_embedding: bool = False,
  clip_norm: float | None = 1.0,
  seed: int = 0,
):
  """A jitted `step(params, opt_state, batch, t) -> (params, opt_state, loss)`.

  The gradient is `mslt_grads` of batch t (dropout key `staged.batch_key(seed, t)`); the global
  norm of the trainable gradient is clipped, then each trainable group (embedding, head, each
  trained layer) takes an optimizer step with its own state. Frozen parameters and their
  optimizer states are passed through untouched.
  """

  @jax.jit
  def step(params, opt_state, batch, t):
    loss, grads, trainable = mslt_grads(
      cfg, params, batch, staged.batch_key(seed, t), num_frozen, train_embedding
    )
    grads, _ = clip_by_global_norm(grads, clip_norm)
    update = functools.partial(update_group, tx)
    new_params, new_opt = dict(params), dict(opt_state)
    for group in ('embed', 'head'):
      if group in trainable:
        new_params[group], new_opt[group] = update(params[group], opt_state[group], grads[group])
    top_p, top_s = jax.vmap(update)(
      trainable['layers'], _slice(opt_state['layers'], num_frozen), grads['layers']
    )
    new_params['layers'] = _concat(_slice(params['layers'], 0, num_frozen), top_p)
    new_opt['layers'] = _concat(_slice(opt_state['layers'], 0, num_frozen), top_s)
    return new_params, new_opt, loss

  return step


# ----------------------------------------------------------------------------- the driver


@dataclasses.dataclass(frozen=True)
class GrowthRun:
  """How `train_growth` runs a plan: where it starts, the step's settings and the callbacks.

  key: initialises the parameters (default key(seed)) and the layers `init='random'` adds.
  params: optional starting parameters of depth plan.depths[0] (else `init_params` with `key`).
  clip_norm, seed: the global-norm clipping and the dropout keys' seed of every step
    (`make_step`).
  on_phase_end: optional callback(phase_index, params) after every phase (evaluation,
    checkpoints, tests).
  on_step: optional callback(log row, params) after every step (the loss is then still on the
    device: row['loss'] is a jax scalar; the log keeps floats).
  """

  key: jax.Array | None = None
  params: dict | None = None
  clip_norm: float | None = 1.0
  seed: int = 0
  on_phase_end: Callable[[int, dict], None] | None = None
  on_step: Callable[[dict, dict], None] | None = None


def train_growth(
  plan: GrowthPlan,
  cfg: ModelConfig,
  batches: Iterable[dict],
  tx_factory: Callable[[int], optax.GradientTransformation],
  run: GrowthRun = GrowthRun(),
):
  """Runs a whole plan with plain backprop (one device). Returns (params, log).

  cfg: the full-size model (num_layers = plan.depths[-1]); the phases run the same config with
    fewer layers. tx_factory(phase_index) -> the phase's optimizer. run: the starting point, the
    step's settings and the callbacks (default `GrowthRun()`). log: one dict per step {'phase',
    'step' (global, from 0), 'depth', 'frozen', 'loss' (of that step's batch), 'flops'
    (cumulative estimate, `costs.step_flops`)}.
  """
  plan.validate(cfg)
  cfg.validate()
  batches: Iterator[dict] = iter(batches)
  key = jax.random.key(run.seed) if run.key is None else run.key
  key_init, key_grow = jax.random.split(key)
  params = run.params
  if params is None:
    params = transformer.init_params(dataclasses.replace(cfg, num_layers=plan.depths[0]), key_init)
  log, t, flops, opt_state = [], 0, 0.0, None
  for phase_index, (depth, steps, num_frozen) in enumerate(plan.phases()):
    params, opt_state, step = _start_phase(
      plan, cfg, run, tx_factory, key_grow, (phase_index, depth, num_frozen), params, opt_state
    )
    for _ in range(steps):
      batch = next(batches)
      params, opt_state, loss = step(params, opt_state, batch, t)
      tokens = batch['inputs'].shape[0] * batch['inputs'].shape[1]
      flops += costs.step_flops(
        dataclasses.replace(cfg, num_layers=depth), tokens, frozen_layers=num_frozen
      )
      row = {
        'phase': phase_index,
        'step': t,
        'depth': depth,
        'frozen': num_frozen,
        'loss': loss,
        'flops': flops,
      }
      if run.on_step is not None:
        run.on_step(row, params)
      log.append({**row, 'loss': float(loss)})
      t += 1
    if run.on_phase_end is not None:
      run.on_phase_end(phase_index, params)
  return params, log


def _start_phase(
  plan: GrowthPlan, cfg: ModelConfig, run: GrowthRun, tx_factory, key_grow, phase, params, opt_state
):
  """A phase's start: `params` grown to the phase's depth, the optimizer state of its optimizer
  (`GrowthPlan.opt_state`), and its step. `phase`: (its index, depth, frozen layers)."""
  phase_index, depth, num_frozen = phase
  current = jax.tree.leaves(params['layers'])[0].shape[0]
  if depth > current:
    params = grow(params, depth, plan.init, cfg=cfg, key=jax.random.fold_in(key_grow, phase_index))
  tx = tx_factory(phase_index)
  opt_state = jax.jit(
    functools.partial(_phase_opt_state, plan.opt_state, tx, previous_depth=current)
  )(params, opt_state)
  step = make_step(
    dataclasses.replace(cfg, num_layers=depth),
    tx,
    num_frozen,
    train_embedding=plan.train_embedding,
    clip_norm=run.clip_norm,
    seed=run.seed,
  )
  return params, opt_state, step


def _phase_opt_state(
  mode: str, tx, params: dict, previous: dict | None, previous_depth: int
) -> dict:
  """'reset': a fresh state; 'carry': the previous state for the groups and the layers it has
  (the first `previous_depth`)."""
  fresh = init_opt_state(tx, params)
  if mode == 'reset' or previous is None:
    return fresh
  if jax.tree.structure(fresh) != jax.tree.structure(previous):
    raise ConfigError(
      "growth opt_state='carry' needs the same optimizer in every phase (its "
      "state changed structure); use opt_state='reset' or one tx_factory "
      'result.'
    )
  layers = _concat(previous['layers'], _slice(fresh['layers'], previous_depth))
  return {'embed': previous['embed'], 'layers': layers, 'head': previous['head']}


# ----------------------------------------------------------------------------- the flag


def parse_plan(text: str, num_layers: int, total_steps: int) -> GrowthPlan:
  """The `--growth` flag -> a GrowthPlan for a model of `num_layers` trained `total_steps`.

      METHOD:DEPTHxSTEPS,DEPTHxSTEPS,...[,all:STEPS][,init=copy_top|random][,embed=train]

  METHOD is mslt (train only the new top layers; the lower ones run forward only) or stacking
  (grow and train everything). One STEPS may be `*`: the rest of `total_steps`. The step counts
  (with the final all-layer phase `all:STEPS`, MSLT only) must add up to `total_steps`, and the
  last depth must be `num_layers`. Examples for a 4-layer model and --steps 1000:

      mslt:1x250,2x250,4x250,all:250     stacking:2x400,4x*     mslt:2x300,4x*,init=random
  """

  def bad(why: str):
    return ConfigError(
      f'--growth {text!r}: {why}; the syntax is METHOD:DEPTHxSTEPS,...'
      '[,all:STEPS][,init=copy_top|random] with METHOD mslt or stacking, e.g. '
      f'--growth mslt:{max(num_layers // 2, 1)}x300,{num_layers}x*.'
    )

  method, sep, rest = text.partition(':')
  method = method.strip().lower()
  if not sep or method not in METHODS:
    raise bad('it must start with mslt: or stacking:')
  depths, steps, options, final = _plan_items(rest, bad)
  if not depths:
    raise bad('it has no DEPTHxSTEPS phase')
  if final is not None and method != 'mslt':
    raise bad('a final all:STEPS phase belongs to mslt (stacking trains every layer anyway)')
  counts = _step_counts(steps + ([final] if final is not None else []), total_steps, bad)
  unknown = set(options) - {'init', 'embed'}
  if unknown:
    raise bad(f'unknown option {sorted(unknown)[0]!r} (options: init, embed)')
  if options.get('embed', 'frozen') not in ('frozen', 'train'):
    raise bad('embed= takes frozen or train')
  plan = GrowthPlan(
    depths=tuple(depths),
    steps=tuple(counts[: len(depths)]),
    method=method,
    init=options.get('init', 'copy_top'),
    final_steps=counts[-1] if final is not None else 0,
    train_embedding=options.get('embed') == 'train',
  )
  try:
    plan.validate(dataclasses.replace(ModelConfig(), num_layers=num_layers))
  except ConfigError as e:
    raise bad(str(e).rstrip('.')) from None
  return plan


def _plan_items(rest: str, bad: Callable[[str], ConfigError]):
  """The comma-separated items of a --growth plan after METHOD: (depths, their STEPS as written,
  the key=value options, the final all:STEPS or None)."""
  depths, steps, options, final = [], [], {}, None
  for item in filter(None, (i.strip() for i in rest.split(','))):
    if item.startswith('all:'):
      final = item[4:]
    elif '=' in item:
      key, _, value = item.partition('=')
      options[key.strip()] = value.strip()
    elif 'x' in item:
      depth, _, count = item.partition('x')
      if not depth.strip().isdigit():
        raise bad(f'{item!r} is not DEPTHxSTEPS')
      depths.append(int(depth))
      steps.append(count.strip())
    else:
      raise bad(f'{item!r} is not DEPTHxSTEPS, all:STEPS or an option')
  return depths, steps, options, final


def _step_counts(
  counts: list[str], total_steps: int, bad: Callable[[str], ConfigError]
) -> list[int]:
  """Each phase's STEPS as written (one may be `*`, the rest of `total_steps`) -> the step
  counts, which must add up to `total_steps`."""
  if sum(c == '*' for c in counts) > 1:
    raise bad('only one phase may take the rest of the steps (*)')
  if any(c != '*' and not c.isdigit() for c in counts):
    raise bad('every STEPS must be a non-negative integer or *')
  known = sum(int(c) for c in counts if c != '*')
  if '*' in counts:
    if known > total_steps:
      raise bad(f'its phases take {known} steps but --steps is {total_steps}')
    counts = [str(total_steps - known) if c == '*' else c for c in counts]
  elif known != total_steps:
    raise bad(
      f'its phases take {known} steps but --steps is {total_steps}; make them add up '
      'or end with DEPTHx*'
    )
  return [int(c) for c in counts]
