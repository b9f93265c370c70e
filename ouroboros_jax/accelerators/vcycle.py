"""The multi-level V-cycle (Zou, Zhang, Deng; ICLR 2024; arXiv 2404.07999).

Three operators between a large model M1 and a small model M2, and a V-cycle built from them.

Coalescing (M1 -> M2), in width: channel c and channel c + n/2 of every width dimension are
merged (for the attention that is head i with head i + H/2, since head i holds channels
[i K, (i+1) K) and K = D / H stays the same; FFN neurons j and j + F/2; residual channels c and
c + D/2). Every weight matrix W (written [out, in] as in the paper) becomes

    W' = F_out W F_in^T,   F_out = S (row-normalised assignment: rows average their pair)
                           F_in  = T^T (0/1 assignment: the input side sums its pair)

with T[j, i] = 1 when large channel j merges into small channel i and S = T^T / 2. Biases and
LayerNorm scales and biases are averaged (S b), the embeddings' width likewise (they are
matrices whose output side is D). In depth, neighbouring layers are averaged:
layer'_i = (layer_2i + layer_2i+1) / 2, i.e. R[i, 2i] = R[i, 2i+1] = 0.5.

De-coalescing (M2 -> M1): every large channel (layer) copies the small one it was merged into,
the input side split evenly: W = T W' S (output side copied, input side halved), b = T b,
LayerNorm and embeddings copied; in depth layer_2i = layer_2i+1 = layer'_i.
Coalescing after de-coalescing gives M2 back exactly (S T = I).

Interpolation: theta = (1 - alpha) theta_M1 + alpha theta_decoalesced (alpha = 0.5 default).

What is function-preserving (all proved by `tests/test_vcycle.py` to float32 rounding):
  * width de-coalescing, pre-LN and post-LN, untied output projection: logits of
    decoalesce(M2) == logits of M2. The residual stream of the large model is T x' (every small
    channel duplicated) at every layer: a linear map with the input side split evenly maps
    duplicated inputs to duplicated outputs; attention sees each small head twice with the same
    head dimension, so the same scores; GELU is elementwise; and LayerNorm over an *exactly,
    uniformly* duplicated vector has the same mean and variance (every value appears twice), so
    it returns the duplicated normalised vector. (A non-uniform duplication, say some channels
    copied three times, would change the statistics and break this.)
  * tied embeddings: the output projection V^T has D on its *input* side, but V is de-coalesced
    as an embedding (copied), so plain maps give exactly 2x the logits. With
    `tied_compensation=True` (default) the LayerNorm that feeds the projection (pre-LN: the
    head's final LayerNorm; post-LN: the last layer's second LayerNorm, whose output only the
    head reads) is halved when de-coalescing and doubled (summed) when coalescing, which makes
    the tied case exact too and keeps coalesce(decoalesce(M2)) == M2.
  * not preserving: depth de-coalescing (a copied layer applies its residual update twice),
    coalescing in any direction (it loses information), and interpolation with alpha < 1.

V-cycle (`train_vcycle`): train M1 for n1 steps, coalesce, train M2 (larger lr, via
`tx_factory(level)`) for n2 steps, de-coalesce, interpolate with M1's weights from before
coalescing, continue M1; with more levels M2 itself runs a V-cycle before returning. Training
at every level uses the library's schedules (`build_schedule`, backprop by default).
From the command line: `ouroboros train --vcycle down=200,coarse=400[,levels=3,...]`
(`parse_plan` has the syntax; `phased.train_phased` runs it under the run's --schedule, every level
cut into --stages by the balanced split).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ouroboros_jax import costs, placement, schedules
from ouroboros_jax.errors import ConfigError
from ouroboros_jax.models import model as transformer
from ouroboros_jax.models import partition
from ouroboros_jax.models.model import ModelConfig

# ----------------------------------------------------------------------------- configs


def coarser_config(cfg: ModelConfig, *, width: bool = True, depth: bool = True) -> ModelConfig:
  """The config of the coalesced model: half the width (D, H, F) and/or half the depth."""
  changes = {}
  if width:
    for name in ('d_model', 'num_heads', 'd_ff'):
      if getattr(cfg, name) % 2:
        raise ConfigError(
          f'width coalescing halves {name} but {name}={getattr(cfg, name)} is '
          'odd; choose even --d-model/--num-heads/--d-ff or turn width '
          'coalescing off.'
        )
    changes.update(d_model=cfg.d_model // 2, num_heads=cfg.num_heads // 2, d_ff=cfg.d_ff // 2)
  if depth:
    if cfg.num_layers % 2:
      raise ConfigError(
        f'depth coalescing halves num_layers={cfg.num_layers}, which is odd; '
        'choose an even --num-layers or turn depth coalescing off.'
      )
    changes.update(num_layers=cfg.num_layers // 2)
  return dataclasses.replace(cfg, **changes)


def level_configs(
  cfg: ModelConfig, levels: int, *, width: bool = True, depth: bool = True
) -> list[ModelConfig]:
  """[M1, M2, ..., M_levels]: each one the coalescing of the one before."""
  out = [cfg]
  for _ in range(levels - 1):
    out.append(coarser_config(out[-1], width=width, depth=depth))
  return out


# ----------------------------------------------------------------------------- assignment maps


def copy_matrix(n: int) -> np.ndarray:
  """T [n, n/2]: T[j, i] = 1 when large channel j (j = i or i + n/2) merges into small i."""
  return np.tile(np.eye(n // 2, dtype=np.float32), (2, 1))


def average_matrix(n: int) -> np.ndarray:
  """S [n/2, n] = T^T / 2: the row-normalised assignment (each row averages its pair)."""
  return copy_matrix(n).T / 2


# The maps act on one axis of an array. Written with reshapes, equal to the matrix products
# (tests check them against `copy_matrix` / `average_matrix`).
def _pairs(a, axis):
  a = jnp.moveaxis(a, axis, -1)
  return a.reshape(*a.shape[:-1], 2, a.shape[-1] // 2)


def _merge(a, axis: int, how: str):
  """Coalesce one axis of size n to n/2: 'avg' (output side, S) or 'sum' (input side, T^T)."""
  pairs = _pairs(a, axis)
  merged = pairs[..., 0, :] + pairs[..., 1, :]
  merged = merged * 0.5 if how == 'avg' else merged
  return jnp.moveaxis(merged, -1, axis)


def _split(a, axis: int, how: str):
  """De-coalesce one axis of size n/2 to n: 'copy' (output side, T) or 'half' (input side,
  S^T: split evenly)."""
  a = jnp.moveaxis(a, axis, -1)
  a = a * 0.5 if how == 'half' else a
  return jnp.moveaxis(jnp.concatenate([a, a], axis=-1), -1, axis)


def _blocks(fn, a, axis: int, num_blocks: int, how: str):
  """Apply a per-axis map to each of `num_blocks` equal blocks of an axis (q, k, v of qkv)."""
  parts = jnp.split(a, num_blocks, axis=axis)
  return jnp.concatenate([fn(p, axis, how) for p in parts], axis=axis)


# Axis roles of every parameter, with layers stacked on a leading axis (hence the offsets):
# ('out', axis) is an output side (merge 'avg' / split 'copy'), ('in', axis) an input side
# (merge 'sum' / split 'half'); 'blocks' gives the number of equal blocks on that axis.
_LAYER_ROLES = {
  ('ln_attn', 'scale'): [('out', 1, 1)],
  ('ln_attn', 'bias'): [('out', 1, 1)],
  ('ln_mlp', 'scale'): [('out', 1, 1)],
  ('ln_mlp', 'bias'): [('out', 1, 1)],
  ('qkv', 'kernel'): [('in', 1, 1), ('out', 2, 3)],
  ('qkv', 'bias'): [('out', 1, 3)],
  ('attn_out', 'kernel'): [('in', 1, 1), ('out', 2, 1)],
  ('attn_out', 'bias'): [('out', 1, 1)],
  ('mlp_in', 'kernel'): [('in', 1, 1), ('out', 2, 1)],
  ('mlp_in', 'bias'): [('out', 1, 1)],
  ('mlp_out', 'kernel'): [('in', 1, 1), ('out', 2, 1)],
  ('mlp_out', 'bias'): [('out', 1, 1)],
}
_EMBED_ROLES = {('token', 'embedding'): [('out', 1, 1)], ('position', 'embedding'): [('out', 1, 1)]}
_HEAD_ROLES = {
  ('ln_final', 'scale'): [('out', 0, 1)],
  ('ln_final', 'bias'): [('out', 0, 1)],
  ('unembed', 'kernel'): [('in', 0, 1)],
}


def _map_group(tree: dict, roles: dict, coalescing: bool) -> dict:
  out = {}
  for module, leaves in tree.items():
    out[module] = {}
    for name, a in leaves.items():
      for side, axis, blocks in roles[(module, name)]:
        if coalescing:
          fn, how = _merge, ('avg' if side == 'out' else 'sum')
        else:
          fn, how = _split, ('copy' if side == 'out' else 'half')
        a = _blocks(fn, a, axis, blocks, how)
      out[module][name] = a
  return out


def _tied_norm(cfg: ModelConfig, params: dict, factor: float) -> dict:
  """Multiplies the LayerNorm that feeds the tied projection by `factor` (see module doc)."""
  if cfg.pre_ln:
    head = {
      **params['head'],
      'ln_final': jax.tree.map(lambda a: a * factor, params['head']['ln_final']),
    }
    return {**params, 'head': head}
  ln = jax.tree.map(lambda a: a.at[-1].multiply(factor), params['layers']['ln_mlp'])
  return {**params, 'layers': {**params['layers'], 'ln_mlp': ln}}


def _map_width(cfg: ModelConfig, params: dict, coalescing: bool, tied_compensation: bool):
  """Every group through its role table; the tied embedding's norm compensated (x2 or x1/2)."""
  out = {
    'embed': _map_group(params['embed'], _EMBED_ROLES, coalescing),
    'layers': _map_group(params['layers'], _LAYER_ROLES, coalescing),
    'head': _map_group(params['head'], _HEAD_ROLES, coalescing),
  }
  if tied_compensation and cfg.tie_embeddings:
    out = _tied_norm(cfg, out, 2.0 if coalescing else 0.5)
  return out


# The maps are jitted (cfg static): one compiled program instead of hundreds of eager ops.
@functools.partial(jax.jit, static_argnums=0, static_argnames='tied_compensation')
def coalesce_width(cfg: ModelConfig, params: dict, *, tied_compensation: bool = True) -> dict:
  """Width coalescing of {'embed', 'layers' [N, ...], 'head'} (D, H, F halved)."""
  return _map_width(cfg, params, True, tied_compensation)


@functools.partial(jax.jit, static_argnums=0, static_argnames='tied_compensation')
def decoalesce_width(cfg: ModelConfig, params: dict, *, tied_compensation: bool = True) -> dict:
  """Width de-coalescing (D, H, F doubled): function-preserving, see the module docstring."""
  return _map_width(cfg, params, False, tied_compensation)


@jax.jit
def coalesce_depth(params: dict) -> dict:
  """Neighbouring layers averaged: layer'_i = (layer_2i + layer_2i+1) / 2."""
  layers = jax.tree.map(lambda a: (a[0::2] + a[1::2]) * 0.5, params['layers'])
  return {**params, 'layers': layers}


@jax.jit
def decoalesce_depth(params: dict) -> dict:
  """Each layer copied into the two it was merged from: layer_2i = layer_2i+1 = layer'_i."""
  return {**params, 'layers': jax.tree.map(lambda a: jnp.repeat(a, 2, axis=0), params['layers'])}


def coalesce(
  cfg: ModelConfig,
  params: dict,
  *,
  width: bool = True,
  depth: bool = True,
  tied_compensation: bool = True,
) -> tuple[ModelConfig, dict]:
  """M1 -> (M2's config, M2's params): width first, then depth."""
  small_cfg = coarser_config(cfg, width=width, depth=depth)
  if width:
    params = coalesce_width(cfg, params, tied_compensation=tied_compensation)
  if depth:
    params = coalesce_depth(params)
  return small_cfg, params


def decoalesce(
  small_cfg: ModelConfig, params: dict, large_cfg: ModelConfig, *, tied_compensation: bool = True
) -> dict:
  """M2 -> M1-shaped params: depth first, then width (the inverse order of `coalesce`)."""
  width = large_cfg.d_model != small_cfg.d_model
  depth = large_cfg.num_layers != small_cfg.num_layers
  if coarser_config(large_cfg, width=width, depth=depth) != small_cfg:
    raise ConfigError(f'{small_cfg} is not the coalescing of {large_cfg}.')
  if depth:
    params = decoalesce_depth(params)
  if width:
    params = decoalesce_width(large_cfg, params, tied_compensation=tied_compensation)
  return params


@jax.jit
def interpolate(params_m1, params_decoalesced, alpha: float = 0.5):
  """(1 - alpha) theta_M1 + alpha theta_decoalesced, leaf by leaf. In floating point the
  endpoints are exact: alpha 0 gives M1, alpha 1 the de-coalesced model (finite values)."""
  return jax.tree.map(lambda a, b: (1.0 - alpha) * a + alpha * b, params_m1, params_decoalesced)


# ----------------------------------------------------------------------------- the V-cycle


@dataclasses.dataclass(frozen=True)
class VCyclePlan:
  """One V-cycle over `levels` model sizes (level 0 = M1, the full model).

  down_steps[k]: steps of level k before it is coalesced (k = 0 .. levels-2).
  coarse_steps: steps of the smallest model (level levels-1).
  up_steps[k]: steps of level k after de-coalescing + interpolation (k = 0 .. levels-2); level 0's
    are the rest of the run.
  alpha: interpolation weight of the de-coalesced model.
  width, depth: which coalescing maps to use (both by default).
  opt_state: 'carry' (default): a level resumes with its optimizer state from before it was
    coalesced (the paper "continues training M1"); 'reset': a fresh optimizer state. Either way
    the rest of the schedule state restarts (step 0, empty Ouroboros pipes: their stashes would
    hold forwards of the weights from before the dip).
  """

  levels: int = 2
  down_steps: tuple[int, ...] = (100,)
  coarse_steps: int = 100
  up_steps: tuple[int, ...] = (100,)
  alpha: float = 0.5
  width: bool = True
  depth: bool = True
  opt_state: str = 'carry'
  tied_compensation: bool = True

  def validate(self) -> None:
    if self.levels < 1:
      raise ConfigError(f'a V-cycle needs >= 1 level, got {self.levels}.')
    if len(self.down_steps) != self.levels - 1 or len(self.up_steps) != self.levels - 1:
      raise ConfigError(
        f'a {self.levels}-level V-cycle needs {self.levels - 1} down_steps and '
        f'up_steps, got {self.down_steps} and {self.up_steps}.'
      )
    if not (self.width or self.depth) and self.levels > 1:
      raise ConfigError('a V-cycle needs width or depth coalescing (or both).')
    if not 0.0 <= self.alpha <= 1.0:
      raise ConfigError(f'V-cycle alpha must be in [0, 1], got {self.alpha}.')
    if self.opt_state not in ('carry', 'reset'):
      raise ConfigError(f'unknown V-cycle opt_state {self.opt_state!r}; choose carry or reset.')


@dataclasses.dataclass(frozen=True)
class VCycleRun:
  """How `train_vcycle` runs a plan: every level's schedule, where it starts, the callbacks.

  schedule_config: how every level trains (default backprop); with several stages each level is
    cut by `partition.balance_layers`.
  key: initialises M1's parameters when `params` is None (default key(schedule_config.seed)).
  params: optional starting parameters of M1.
  on_phase_end: optional callback(level, phase, params) with the level's {'embed', 'layers',
    'head'} params after its 'down' / 'coarse' / 'up' training and after 'interpolate'.
  on_step: optional callback(log row, params_fn) after every step; params_fn() returns the
    level's current {'embed', 'layers', 'head'} params (the row's loss is still a jax scalar).
  """

  schedule_config: schedules.ScheduleConfig | None = None
  key: jax.Array | None = None
  params: dict | None = None
  on_phase_end: Callable[[int, str, dict], None] | None = None
  on_step: Callable[[dict, Callable[[], dict]], None] | None = None


def train_vcycle(
  plan: VCyclePlan,
  cfg: ModelConfig,
  batches: Iterable[dict],
  tx_factory: Callable[[int], optax.GradientTransformation],
  run: VCycleRun | None = None,
):
  """Runs one (multi-level) V-cycle. Returns (params of M1, log, the level configs).

  tx_factory(level) -> that level's optimizer (give smaller levels a larger lr). run: the
  schedule, the starting point and the callbacks (default `VCycleRun()`). log: one dict per
  step {'level', 'phase' ('down' | 'coarse' | 'up'), 'step' (global), 'loss', 'flops'
  (cumulative, `costs.step_flops`)}.
  """
  run = run or VCycleRun()
  plan.validate()
  configs = level_configs(cfg, plan.levels, width=plan.width, depth=plan.depth)
  schedule_config = run.schedule_config or schedules.ScheduleConfig()
  for c in configs:
    c.validate()
    costs.check_stages(c.num_layers, schedule_config.num_stages)
  cycle = _Cycle(plan, configs, schedule_config, tx_factory, run, iter(batches))
  params = run.params
  if params is None:
    params = transformer.init_params(
      cfg, jax.random.key(schedule_config.seed) if run.key is None else run.key
    )
  return cycle.run_level(0, params), cycle.log, configs


class _Cycle:
  """A running V-cycle: its plan and levels, the batches, the log and the FLOPs so far."""

  def __init__(self, plan, configs, schedule_config, tx_factory, run: VCycleRun, batches):
    self.plan, self.configs, self.schedule_config = plan, configs, schedule_config
    self.tx_factory, self.run = tx_factory, run
    first = next(batches)
    self.batches = itertools.chain([first], batches)
    self.example = jax.tree.map(np.zeros_like, jax.device_get(first))  # fixes the state's shapes
    self.log, self.t, self.flops = [], 0, 0.0
    self.layers_per_stage = [
      partition.balance_layers(c, schedule_config.num_stages) for c in configs
    ]

  def report(self, level: int, phase: str, params: dict) -> None:
    if self.run.on_phase_end is not None:
      self.run.on_phase_end(level, phase, params)

  def train(self, level: int, state, schedule, steps: int, phase: str):
    """`steps` steps of `schedule` from `state`, a log row each."""
    for _ in range(steps):
      batch = next(self.batches)
      state, metrics = schedule.step(state, placement.place_batch(batch, schedule.mesh))
      tokens = batch['inputs'].shape[0] * batch['inputs'].shape[1]
      self.flops += costs.step_flops(self.configs[level], tokens)
      row = {
        'level': level,
        'phase': phase,
        'step': self.t,
        'loss': metrics['loss'],
        'flops': self.flops,
      }
      if self.run.on_step is not None:
        self.run.on_step(row, lambda: _layout(tuple(self.layers_per_stage[level]))[1](state.params))
      self.log.append({**row, 'loss': float(metrics['loss'])})
      self.t += 1
    return state

  def run_level(self, level: int, params: dict) -> dict:
    """Level `level` from `params`: down (at the smallest level: coarse) training, then the
    levels below on its coalescing, the interpolation and up training. Returns its params."""
    plan, level_cfg = self.plan, self.configs[level]
    model = partition.transformer_stages(level_cfg, self.layers_per_stage[level])
    schedule = schedules.build_schedule(self.schedule_config, model, self.tx_factory(level))
    to_staged, from_staged = _layout(tuple(self.layers_per_stage[level]))
    # One program, not an eager op per optimizer-state leaf; the state is then put on the
    # schedule's mesh, where its step returns it (else the second step compiles again).
    init = lambda p, b: placement.onto_mesh(jax.jit(schedule.init)(p, b), schedule.mesh)
    state = init(to_staged(params), self.example)
    last = level == plan.levels - 1
    state = self.train(
      level,
      state,
      schedule,
      plan.coarse_steps if last else plan.down_steps[level],
      'coarse' if last else 'down',
    )
    before = from_staged(state.params)
    self.report(level, 'coarse' if last else 'down', before)
    if last:
      return before
    small_cfg, small = coalesce(
      level_cfg,
      before,
      width=plan.width,
      depth=plan.depth,
      tied_compensation=plan.tied_compensation,
    )
    small = self.run_level(level + 1, small)
    back = decoalesce(small_cfg, small, level_cfg, tied_compensation=plan.tied_compensation)
    merged = interpolate(before, back, plan.alpha)
    self.report(level, 'interpolate', merged)
    # A fresh state: step 0 and empty pipes (a delayed schedule's stashes hold forwards of the
    # weights from before the dip); 'carry' keeps the level's optimizer state.
    fresh = init(to_staged(merged), self.example)
    state = fresh.replace(opt_state=state.opt_state) if plan.opt_state == 'carry' else fresh
    state = self.train(level, state, schedule, plan.up_steps[level], 'up')
    after = from_staged(state.params)
    self.report(level, 'up', after)
    return after


@functools.lru_cache(maxsize=None)
def _layout(layers_per_stage: tuple[int, ...]):
  """Jitted (to_staged, from_staged) for one stage layout."""
  return (
    jax.jit(lambda p: partition.to_staged(p, layers_per_stage)),
    jax.jit(lambda p: partition.from_staged(p, layers_per_stage)),
  )


# ----------------------------------------------------------------------------- the flag


def parse_plan(text: str, total_steps: int) -> tuple[VCyclePlan, float]:
  """The `--vcycle` flag -> (VCyclePlan, lr_scale) for a run of `total_steps` steps.

      --vcycle down=N[/N..],coarse=N[,up=N[/N..]][,levels=K][,alpha=A][,width=0|1][,depth=0|1]
               [,lr_scale=S][,opt=carry|reset]

  levels (default 2) model sizes; down[k] steps of level k before coalescing (k = 0..K-2, '/'
  between levels), coarse the steps of the smallest model, up[k] after de-coalescing (default:
  up[0] = the rest of `total_steps`, up[k] = down[k] for k >= 1). alpha 0.5, width and depth
  coalescing both on, opt carry (defaults of `VCyclePlan`). Level k trains with the learning
  rate times lr_scale^k (default 1; the paper gives the small model a larger one). The steps
  must add up to `total_steps`. E.g. --vcycle down=200,coarse=400 for --steps 1000.
  """

  options = _plan_options(text)
  fields, lr_scale = _plan_values(text, options)
  levels, down, coarse = fields['levels'], fields['down_steps'], fields['coarse_steps']
  if levels < 2:
    raise _bad_plan(text, f'levels must be >= 2, got {levels}')
  if coarse is None or len(down) != levels - 1:
    raise _bad_plan(text, f'a {levels}-level cycle needs coarse=N and {levels - 1} down steps')
  up = _up_steps(text, options, fields, total_steps)
  if min((*down, coarse, *up)) < 0:
    raise _bad_plan(text, 'step counts must be >= 0')
  if not lr_scale > 0:
    raise _bad_plan(text, f'lr_scale must be positive, got {lr_scale}')
  plan = VCyclePlan(**fields, up_steps=up, opt_state=options.get('opt', 'carry'))
  try:
    plan.validate()
  except ConfigError as e:
    raise _bad_plan(text, str(e).rstrip('.')) from None
  return plan, lr_scale


_PLAN_OPTIONS = ('levels', 'down', 'coarse', 'up', 'alpha', 'width', 'depth', 'lr_scale', 'opt')


def _bad_plan(text: str, why: str) -> ConfigError:
  return ConfigError(
    f'--vcycle {text!r}: {why}; the syntax is down=N[/N..],coarse=N'
    '[,up=N[/N..]][,levels=K][,alpha=A][,width=0|1][,depth=0|1]'
    '[,lr_scale=S][,opt=carry|reset], e.g. --vcycle down=200,coarse=400.'
  )


def _plan_options(text: str) -> dict[str, str]:
  """--vcycle's KEY=VALUE items, every KEY one of `_PLAN_OPTIONS`."""
  options = {}
  for item in filter(None, (i.strip() for i in text.split(','))):
    key, sep, value = item.partition('=')
    if not sep:
      raise _bad_plan(text, f'{item!r} is not KEY=VALUE')
    options[key.strip()] = value.strip()
  unknown = set(options) - set(_PLAN_OPTIONS)
  if unknown:
    raise _bad_plan(text, f'unknown option {sorted(unknown)[0]!r}')
  return options


def _plan_values(text: str, options: dict[str, str]) -> tuple[dict, float]:
  """The numbers and switches of --vcycle (VCyclePlan's fields but up_steps and opt_state; the
  down steps () and coarse steps None when not given) and lr_scale."""
  try:
    levels = int(options.get('levels', 2))
    down = tuple(int(v) for v in options['down'].split('/')) if 'down' in options else ()
    coarse = int(options['coarse']) if 'coarse' in options else None
    alpha = float(options.get('alpha', 0.5))
    lr_scale = float(options.get('lr_scale', 1.0))
    flags = {k: options.get(k, '1') for k in ('width', 'depth')}
    if any(v not in ('0', '1', 'true', 'false') for v in flags.values()):
      raise ValueError
    width, depth = (flags[k] in ('1', 'true') for k in ('width', 'depth'))
  except ValueError:
    raise _bad_plan(text, 'a value is not a number (width/depth take 0 or 1)') from None
  fields = {
    'levels': levels,
    'down_steps': down,
    'coarse_steps': coarse,
    'alpha': alpha,
    'width': width,
    'depth': depth,
  }
  return fields, lr_scale


def _up_steps(text: str, options: dict[str, str], fields: dict, total_steps: int):
  """The up steps: given (one may be *, the rest of `total_steps`) or (the rest, down[1:])."""
  levels, down, coarse = fields['levels'], fields['down_steps'], fields['coarse_steps']
  if 'up' in options:
    try:
      up = tuple(-1 if v == '*' else int(v) for v in options['up'].split('/'))
    except ValueError:
      raise _bad_plan(text, 'up steps must be integers or *') from None
    if len(up) != levels - 1:
      raise _bad_plan(text, f'a {levels}-level cycle needs {levels - 1} up steps')
  else:
    up = (-1,) + down[1:]
  known = sum(down) + coarse + sum(u for u in up if u >= 0)
  if sum(u < 0 for u in up) > 1:
    raise _bad_plan(text, 'only one up step may be *')
  if any(u < 0 for u in up):
    if known > total_steps:
      raise _bad_plan(text, f'its phases take {known} steps but --steps is {total_steps}')
    return tuple(total_steps - known if u < 0 else u for u in up)
  if known != total_steps:
    raise _bad_plan(
      text, f'its phases take {known} steps but --steps is {total_steps}; make them add up'
    )
  return up


def level_steps(plan: VCyclePlan) -> list[int]:
  """Steps each level trains in the whole cycle (down + up; the coarsest: coarse)."""
  return [plan.down_steps[k] + plan.up_steps[k] for k in range(plan.levels - 1)] + [
    plan.coarse_steps
  ]
