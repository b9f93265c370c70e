"""Staleness compensation: what makes delayed gradients train (nearly) as well as exact ones.

In Ouroboros, module k computes the gradient of a batch at the weights w_k(t) of its forward and
applies it tau_k steps later, to w_k(t + tau_k) (tau_k is the *version gap*, `version_gaps` in
ouroboros.py: G - s for group s with the locked forward, 2(G - s) with the pipelined one; 0 for the
head). The pieces here attack that gap from three sides, each where the fix lives:

  the optimizer      `optimizers.make_optimizer(name, ...)`: AdamW (the paper's), NAdamW with a
                     high beta1 (Ajanthan et al., ICML 2025), or Muon (Jordan et al. 2024;
                     Zmushko et al. 2026 find it far less sensitive to delay than AdamW);
  the gradient       Optax transformations that read the extra argument `delay` (the module's
                     version gap, passed by `update.GroupedOptimizer`): `shrink_delayed` (FDG),
                     `delay_compensation` (DC-ASGD-a);
  the update         `scale_by_delay` (PipeMare's learning-rate rescheduling);
  the forward        weight prediction (SpecTrain / PipeOptim): `remember_update` keeps each
                     group's latest update u in its optimizer state and `predict_weights` runs
                     module k's forward at w_k + tau_k * u_k, the weights its gradient will be
                     applied to.

A `Compensation` record says which of them a run uses (`--compensation predict,dc ...`); the
schedule wraps the optimizer with `wrap(compensation, tx, max_gap)`. Every piece is the identity
when the gap is 0, so a schedule without delay (G = 1, the synchronous warm-up) is unchanged bit
for bit, and `Compensation()` (none) leaves the optimizer exactly as it was given.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from ouroboros_jax import optimizers
from ouroboros_jax.errors import ConfigError, field_ref

PyTree = Any
COMPENSATIONS = ('predict', 'pipemare', 'dc', 'shrink')


# ----------------------------------------------------------------------------- what a run uses


@dataclasses.dataclass(frozen=True)
class Compensation:
  """Which staleness compensations a delayed schedule applies, with their strengths.

  predict          forward at w + tau * (latest update) (SpecTrain, Chen et al. 2018; PipeOptim,
                   arXiv 2312.00839)
  predict_horizon  with predict: the forward runs at w + predict_horizon * tau * u, the latest
                   update extrapolated over that multiple of the gap (1: the gap itself)
  pipemare_steps   > 0: PipeMare's rate rescheduling, lr / tau^(1 - min(t / T, 1)) with
                   T = pipemare_steps (Yang et al., MLSys 2021)
  dc_lambda        > 0: DC-ASGD-a's delay compensation of the gradient with strength lambda_0
                   (Zheng et al., ICML 2017); needs the graph stash (the gradient at w_then)
  shrink           < 1: delayed gradients scaled by this factor (FDG, Huo et al.)
  state_dtype      the stored precision of the per-weight state they keep (DC-ASGD's running
                   mean of g * g, prediction's latest update; `optimizers.STATE_DTYPES`): computed
                   in float32, rounded where stored. Not a compensation of its own (`active`).
                   `TrainConfig.resolved_compensation` gives the run's --state-dtype.
  """

  predict: bool = False
  predict_horizon: float = 1.0
  pipemare_steps: int = 0
  dc_lambda: float = 0.0
  shrink: float = 1.0
  state_dtype: str = 'float32'

  @property
  def active(self) -> bool:
    return dataclasses.replace(self, state_dtype='float32') != Compensation()

  def names(self) -> tuple[str, ...]:
    on = {
      'predict': self.predict,
      'pipemare': self.pipemare_steps > 0,
      'dc': self.dc_lambda > 0,
      'shrink': self.shrink != 1.0,
    }
    return tuple(name for name in COMPENSATIONS if on[name])


def spec_names(spec: str) -> tuple[str, ...]:
  """The compensations a --compensation spec lists (() for 'none' or ''): the one check of the
  flag's spelling, a one-line ConfigError for an unknown, repeated or contradictory name.

  'auto' (the default: the recipe, `ScheduleConfig.resolve_compensation`) and 'none'
  stand alone; 'auto' comes back as ('auto',).
  """
  names = [n.strip() for n in spec.split(',') if n.strip()]
  unknown = [n for n in names if n not in ('auto', 'none', *COMPENSATIONS)]
  if unknown:
    raise ConfigError(
      f'unknown {field_ref("compensation")} {",".join(unknown)}; use auto, none, or a comma '
      f'list of {", ".join(COMPENSATIONS)} (e.g. {field_ref("compensation", "predict,dc")}).'
    )
  repeated = sorted({n for n in names if names.count(n) > 1}, key=names.index)
  if repeated:
    raise ConfigError(
      f'{field_ref("compensation", spec)} lists {", ".join(repeated)} more than once; name '
      f'each compensation once ({field_ref("compensation", ",".join(dict.fromkeys(names)))}).'
    )
  alone = next((n for n in names if n in ('auto', 'none')), None)
  if alone and len(names) > 1:
    meaning = 'means no compensation' if alone == 'none' else 'picks the recipe itself'
    raise ConfigError(
      f'{field_ref("compensation", spec)}: {alone} ({meaning}) cannot be combined with other '
      f'compensations; use {field_ref("compensation", alone)} or '
      f'{field_ref("compensation", ",".join(n for n in names if n != alone))}.'
    )
  if alone == 'none':
    return ()
  return tuple(names)


def parse(
  spec: str,
  *,
  steps: int,
  dc_lambda: float = 1.0,
  shrink: float = 0.5,
  pipemare_steps: int = 0,
  predict_horizon: float = 1.0,
) -> Compensation:
  """'none' or a comma list of COMPENSATIONS ('predict,dc') -> Compensation.

  The strengths apply to the names that are listed; pipemare_steps 0 means a quarter of `steps`.
  """
  names = spec_names(spec)
  if names == ('auto',):
    raise ValueError(
      "parse takes a resolved spec; ScheduleConfig.resolve_compensation resolves 'auto'."
    )
  if not names:
    return Compensation()
  if not dc_lambda > 0:
    raise ConfigError(f'{field_ref("dc_lambda")} must be > 0, got {dc_lambda}.')
  if not 0 < shrink <= 1:
    raise ConfigError(f'{field_ref("shrink")} must be in (0, 1], got {shrink}.')
  if not predict_horizon > 0:
    raise ConfigError(
      f'{field_ref("predict_horizon")} must be > 0 (1: predict over the gap itself), got '
      f'{predict_horizon}.'
    )
  if pipemare_steps < 0:
    raise ConfigError(
      f'{field_ref("pipemare_steps")} must be >= 0 (0: a quarter of {field_ref("steps")}), '
      f'got {pipemare_steps}.'
    )
  return Compensation(
    predict='predict' in names,
    predict_horizon=predict_horizon if 'predict' in names else 1.0,
    pipemare_steps=(pipemare_steps or max(steps // 4, 1)) if 'pipemare' in names else 0,
    dc_lambda=dc_lambda if 'dc' in names else 0.0,
    shrink=shrink if 'shrink' in names else 1.0,
  )


def check_fits(compensation: Compensation, stash: str) -> None:
  """One-line ConfigError for a compensation that cannot work with the stash mode."""
  if compensation.dc_lambda and stash != 'graph':
    raise ConfigError(
      f"{field_ref('compensation', 'dc')} needs the gradient at the forward's weights, which "
      f'only {field_ref("stash", "graph")} keeps (replay takes it at the current weights); use '
      f'{field_ref("stash", "graph")} or drop dc.'
    )


# ----------------------------------------------------------------------------- optimizers


# ----------------------------------------------------------------------------- on the gradient


def _gap(delay):
  return jnp.asarray(0 if delay is None else delay, jnp.int32)


def _read(stored, like):
  """A stored state as the arithmetic reads it: widened to the dtype of the values it meets (the
  float32 gradients and weights of float32 master weights), never narrowed."""
  return stored.astype(jnp.promote_types(stored.dtype, like.dtype))


def shrink_delayed(factor: float) -> optax.GradientTransformationExtraArgs:
  """g -> factor * g for a delayed gradient (delay > 0); fresh gradients pass unchanged.

  Huo, Gu, Huang. "Training Neural Networks Using Features Replay", NeurIPS 2018, and the
  delayed-gradient shrinking of FDG (github.com/ZHUANGHP/FDG).
  """

  def update(updates, state, params=None, *, delay=None, **extra):
    del params, extra
    stale = _gap(delay) > 0
    return jax.tree.map(lambda g: jnp.where(stale, factor * g, g), updates), state

  return optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update)


class DelayCompensationState(NamedTuple):
  count: jax.Array  # updates applied so far (n)
  history: PyTree  # weights after updates n - depth .. n - 1, update i's in slot i % depth (all
  #                  w_0 at first); () when w_then is the weights less the latest update
  mean_square: PyTree  # running mean of g * g, for the adaptive strength


def delay_compensation(
  strength: float,
  max_delay: int,
  decay: float = 0.95,
  eps: float = 1e-7,
  *,
  from_last_update: bool = False,
  state_dtype: str = 'float32',
) -> optax.GradientTransformationExtraArgs:
  """DC-ASGD-a: g + lambda_t * g * g * (w_now - w_then), lambda_t = strength / sqrt(MS(g)).

  Zheng, Meng, Wang, Chen, Yu, Ma, Liu. "Asynchronous Stochastic Gradient Descent with Delay
  Compensation", ICML 2017 (arXiv 1609.08326), eq. 10 and the adaptive lambda of section 5
  (MS(g) a running mean of g * g with `decay`). g * g is the diagonal approximation of the Hessian;
  w_then is the weights the gradient was computed at, `delay` updates ago (a delay of 0 is the
  weights now). Needs gradients taken at w_then (the graph stash).

  Where w_then comes from: the transformation keeps the last max_delay weights of its group
  (read before this update's weights are written, so max_delay slots suffice). With
  `from_last_update` and delays of at most 1 (the streamed ring), it keeps none: w_then is w_now
  less the group's latest update, which weight prediction keeps anyway (`remember_update` hands
  it over as the extra argument `last_update`), so the history costs no second copy of the
  weights. w_now - (w_now - u) equals the update u to float32 rounding.

  `state_dtype` (`optimizers.STATE_DTYPES`): the running mean is kept in it, computed in float32
  from the float32 read of the stored one (the step's own compensation reads the unrounded one);
  the history keeps the weights as they are (a difference of bf16-rounded weights would be
  mostly rounding).
  """
  if from_last_update and max_delay > 1:
    raise ValueError(
      f'delay_compensation(from_last_update=True) reads w_then as w_now less the latest update, '
      f'which covers a delay of at most 1, not {max_delay}.'
    )
  depth = max(max_delay, 1)
  stored = optimizers.state_jnp_dtype(state_dtype)

  def init(params):
    return _initial_state(params, 0 if from_last_update else depth, stored)

  def update(updates, state, params=None, *, delay=None, last_update=None, **extra):
    del extra
    if params is None:
      raise ValueError('delay_compensation needs the parameters (w_now).')
    n, tau = state.count, _gap(delay)
    if from_last_update:
      w_then, history = _weights_before_last_update(params, tau, last_update), ()
    else:
      w_then, history = _weights_from_history(state, params, tau, depth)
    compensated, mean_square = _compensate(
      updates, params, w_then, state.mean_square, (strength, decay, eps)
    )
    mean_square = jax.tree.map(lambda m: m.astype(stored), mean_square)
    return compensated, DelayCompensationState(n + 1, history, mean_square)

  return optax.GradientTransformationExtraArgs(init, update)


# ----------------------------------------------------------------------------- on the update


def _initial_state(params, depth: int, stored) -> DelayCompensationState:
  """`delay_compensation`'s state before its first update: a history of `depth` copies of the
  weights (none for 0), the running mean of g * g at zero in the `stored` dtype."""
  return DelayCompensationState(
    count=jnp.zeros((), jnp.int32),
    history=()
    if not depth
    else jax.tree.map(lambda p: jnp.broadcast_to(p, (depth, *p.shape)), params),
    mean_square=jax.tree.map(lambda p: jnp.zeros_like(p, stored), params),
  )


def _compensate(updates, params, w_then, mean_square, settings):
  """DC-ASGD-a's step (`delay_compensation`): the compensated gradients and the running mean of
  g * g updated, in float32. `settings`: (strength, decay, eps)."""
  strength, decay, eps = settings
  mean_square = jax.tree.map(
    lambda m, g: decay * _read(m, g) + (1 - decay) * g * g, mean_square, updates
  )
  compensated = jax.tree.map(
    lambda g, w, w0, m: (g + strength / jnp.sqrt(m + eps) * g * g * (w - w0)).astype(g.dtype),
    updates,
    params,
    w_then,
    mean_square,
  )
  return compensated, mean_square


def _weights_before_last_update(params, tau, last_update):
  """`delay_compensation(from_last_update=True)`'s w_then: w_now less the group's latest update
  (w_now itself at a delay of 0)."""
  if last_update is None:
    raise ValueError(
      'delay_compensation(from_last_update=True) needs the latest update: wrap it with '
      'remember_update (Compensation(predict=True)).'
    )
  return jax.tree.map(lambda w, u: jnp.where(tau == 0, w, w - _read(u, w)), params, last_update)


def _weights_from_history(state: DelayCompensationState, params, tau, depth: int):
  """`delay_compensation`'s w_then read from its history of the last `depth` weights (w_now at a
  delay of 0), and the history with w_now written in."""
  n = state.count
  # Slot (n - tau) % depth holds the weights after update n - tau; when n < tau it was never
  # written and holds w_0, which is what the weights were before this group's first update.
  w_then = jax.tree.map(
    lambda h, w: jnp.where(tau == 0, w, h[(n - tau) % depth]), state.history, params
  )
  history = jax.tree.map(lambda h, w: h.at[n % depth].set(w), state.history, params)
  return w_then, history


class DelayScaleState(NamedTuple):
  count: jax.Array


def scale_by_delay(anneal_steps: int) -> optax.GradientTransformationExtraArgs:
  """PipeMare's learning-rate rescheduling: the update of a module with delay tau is divided by
  tau^(1 - min(t / T, 1)), T = anneal_steps (t counts this group's updates): a delayed module
  starts at lr / tau and reaches the full rate at T.

  Yang, Zhang, Sa et al. "PipeMare: Asynchronous Pipeline Parallel DNN Training", MLSys 2021
  (arXiv 1910.05124), section 3.1; as PluralisResearch/AsyncPP's `adjust_learning_rate`.
  """

  def update(updates, state, params=None, *, delay=None, **extra):
    del params, extra
    tau = jnp.maximum(_gap(delay), 1).astype(jnp.float32)
    exponent = 1.0 - jnp.minimum(state.count / anneal_steps, 1.0)
    scale = tau**-exponent  # exactly 1 when tau is 1 (and so when fresh)
    return (
      jax.tree.map(lambda u: (u * scale).astype(u.dtype), updates),
      DelayScaleState(state.count + 1),
    )

  return optax.GradientTransformationExtraArgs(
    lambda params: DelayScaleState(jnp.zeros((), jnp.int32)), update
  )


# ----------------------------------------------------------------------------- on the forward


class LastUpdateState(NamedTuple):
  inner: optax.OptState
  last_update: PyTree  # u(t-1) = w(t) - w(t-1): the group's latest update (0 before any), in
  #                      the state dtype


def remember_update(
  tx: optax.GradientTransformation, state_dtype: str = 'float32'
) -> optax.GradientTransformationExtraArgs:
  """tx whose state also keeps the update it returned last, for `predict_weights`, stored in
  `state_dtype` (`optimizers.STATE_DTYPES`; its readers widen it again)."""
  tx = optax.with_extra_args_support(tx)
  stored = optimizers.state_jnp_dtype(state_dtype)

  def init(params):
    return LastUpdateState(
      tx.init(params), jax.tree.map(lambda p: jnp.zeros_like(p, stored), params)
    )

  def update(updates, state, params=None, **extra):
    # The latest update goes to the inner transformations too: DC-ASGD may read w_then from it.
    updates, inner = tx.update(updates, state.inner, params, last_update=state.last_update, **extra)
    return updates, LastUpdateState(inner, jax.tree.map(lambda u: u.astype(stored), updates))

  return optax.GradientTransformationExtraArgs(init, update)


def predict_weights(
  params: PyTree, opt_state: PyTree, gaps: PyTree, horizon: float = 1.0
) -> PyTree:
  """w + tau * u per group: the weights each group is predicted to have when the gradient of the
  forward it is about to run gets applied (SpecTrain; PipeOptim with the update as direction);
  with `horizon` h (`Compensation.predict_horizon`), w + h * tau * u.

  params and opt_state are a schedule's {'embed', 'stages', 'head'} trees (opt_state made with a
  `remember_update` optimizer); gaps has one version gap per group: a scalar for 'embed' and
  'head', one per stage ([G]) for 'stages'. A gap of 0 returns the weights unchanged.

  A parameter every layer shares (an opt_state['shared'] group, `update.GroupedOptimizer`) moves
  by its own latest update, in each stage's slots with that stage's gap: the weights that
  stage's gradient will meet.
  """

  def group(p, state, gap):
    gap = horizon * jnp.asarray(gap, jnp.float32)

    def shift(w, u):
      g = gap.reshape(gap.shape + (1,) * (w.ndim - gap.ndim)).astype(w.dtype)
      return jnp.where(g == 0, w, w + g * u.astype(w.dtype))

    return jax.tree.map(shift, p, last_update(state))

  predicted = {name: group(params[name], opt_state[name], gaps[name]) for name in params}
  if 'shared' in opt_state:
    gap_G = horizon * jnp.asarray(gaps['stages'], jnp.float32)

    def shift_slots(w_GxN, u):
      g = gap_G.reshape(gap_G.shape + (1,) * (w_GxN.ndim - gap_G.ndim)).astype(w_GxN.dtype)
      return jnp.where(g == 0, w_GxN, w_GxN + g * u.astype(w_GxN.dtype))

    moved = {
      name: shift_slots(params['stages'][name], u)
      for name, u in last_update(opt_state['shared']).items()
    }
    predicted['stages'] = {**predicted['stages'], **moved}
  return predicted


def last_update(state) -> PyTree:
  if not isinstance(state, LastUpdateState):
    raise ConfigError(
      'weight prediction needs the optimizer wrapped by compensation.wrap '
      '(remember_update); build the schedule with Compensation(predict=True).'
    )
  return state.last_update


# ----------------------------------------------------------------------------- the whole recipe


def parts(compensation: Compensation) -> tuple[str, ...]:
  """What `wrap(compensation, tx, ...)` chains, in its order ('tx' for tx itself; 'predict' for
  the latest update kept around the chain): two compensations with the same parts keep states of
  one structure (a DC-ASGD history aside, whose depth is the lag's)."""
  if not compensation.active:
    return ()
  chained = [('shrink', compensation.shrink != 1.0), ('dc', compensation.dc_lambda > 0)]
  chained += [('tx', True), ('pipemare', compensation.pipemare_steps > 0)]
  names = tuple(name for name, on in chained if on)
  return names + (('predict',) if compensation.predict else ())


def inner_path(compensation: Compensation) -> tuple:
  """Where the state of `wrap(compensation, tx, ...)` keeps tx's own state: the keys from it down
  to tx's (() where nothing wraps tx); every other leaf is a compensation's, zero at its init (a
  DC-ASGD history aside: copies of the weights)."""
  names = parts(compensation)
  if not names:
    return ()
  chain = [name for name in names if name != 'predict']
  return (('inner',) if 'predict' in names else ()) + (chain.index('tx'),)


def wrap(
  compensation: Compensation, tx: optax.GradientTransformation, max_gap: int
) -> optax.GradientTransformation:
  """tx with the compensations a run asked for, in their order: shrink and DC-ASGD on the gradient
  before tx, PipeMare on tx's update, the latest update remembered for weight prediction.

  With Compensation() tx is returned as it is (the paper-exact method)."""
  if not compensation.active:
    return tx
  parts = []
  if compensation.shrink != 1.0:
    parts.append(shrink_delayed(compensation.shrink))
  if compensation.dc_lambda > 0:
    from_last_update = compensation.predict and max_gap <= 1  # the streamed ring's recipe
    parts.append(
      delay_compensation(
        compensation.dc_lambda,
        max_gap,
        from_last_update=from_last_update,
        state_dtype=compensation.state_dtype,
      )
    )
  parts.append(optax.with_extra_args_support(tx))
  if compensation.pipemare_steps > 0:
    parts.append(scale_by_delay(compensation.pipemare_steps))
  chained = optax.chain(*parts)
  return remember_update(chained, compensation.state_dtype) if compensation.predict else chained
