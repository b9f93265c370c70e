"""--state-dtype: the stored precision of the per-weight optimizer and compensation state (issue 40,
item 5). Muon's momentum (and Adam's first moment, optax's `mu_dtype`), DC-ASGD's running mean of
g * g and weight prediction's latest update are computed in float32 and stored in the setting's
dtype; 'auto' is bfloat16 when the model computes in bfloat16, float32 otherwise."""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from ouroboros_jax import cli_parsers, optimizers, recipe
from ouroboros_jax.schedules import ScheduleConfig, build_schedule
from ouroboros_jax.schedules.compensation import Compensation, delay_compensation, remember_update
from ouroboros_jax.training import field_flags, optimizer_setup, presets

from helpers import (
  assert_trees_equal,
  max_abs_diff,
  raises_for_cli,
  random_batches,
  tiny_transformer,
)

BF16 = jnp.dtype(jnp.bfloat16)
U = 2.0**-8  # bfloat16's unit roundoff: 8 significant bits, round to nearest
PER_WEIGHT = ('.mu', '.mean_square', '.last_update')  # the states the setting stores


def _recipe(state_dtype, **flags):
  """The default recipe (Muon + prediction + DC, streamed) at G = 2 as the CLI builds it."""
  cfg = field_flags.override(
    presets.get_preset('tiny'),
    {'schedule': 'ouroboros', 'stages': 2, 'steps': 20, 'state_dtype': state_dtype, **flags},
  )
  cfg.validate()
  return cfg, cfg.schedule_config('cpu'), optimizer_setup.make_optimizer(cfg)


def _dtypes(opt_state) -> dict[str, set]:
  """The dtypes of the optimizer state's per-weight states, by kind, and of the rest."""
  out = {}
  for path, leaf in jax.tree_util.tree_leaves_with_path(opt_state):
    key = jax.tree_util.keystr(path)
    kind = next((k for k in PER_WEIGHT if k in key), '.nu' if '.nu' in key else 'other')
    out.setdefault(kind, set()).add(leaf.dtype)
  return out


@pytest.mark.parametrize('state_dtype', ['float32', 'bfloat16'])
def test_the_per_weight_states_are_stored_in_the_setting(state_dtype):
  cfg, run, tx = _recipe(state_dtype)
  model, params = tiny_transformer(2)
  state = jax.eval_shape(build_schedule(run, model, tx).init, params, random_batches(1)[0])
  got = _dtypes(state.opt_state)
  assert set(got) >= {*PER_WEIGHT, '.nu'}, got  # Muon's momentum, Adam's moments, DC, prediction
  for kind in PER_WEIGHT:
    assert got[kind] == {jnp.dtype(state_dtype)}, kind
  assert got['.nu'] == {jnp.dtype(jnp.float32)}  # Adam's second moment stays with the parameters
  assert {a.dtype for a in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.float32)}
  assert run.compensation.state_dtype == state_dtype == cfg.resolved('cpu').state_dtype


def test_auto_is_bf16_state_for_a_bf16_model_and_float32_otherwise():
  for dtype in ('float32', 'bfloat16'):
    cfg, run, _ = _recipe('auto', dtype=dtype)
    assert cfg.resolved_state_dtype() == dtype
    assert cfg.resolved('cpu').state_dtype == dtype  # what config.json stores and a resume compares
    assert run.compensation.state_dtype == dtype
  # none keeps nothing per weight: the paper's method stays Compensation() itself
  cfg, run, _ = _recipe('bfloat16', compensation='none')
  assert run.compensation == Compensation() and not run.compensation.active
  assert not Compensation(state_dtype='bfloat16').active


def _steps(tx, grads, params, **extra):
  """tx's updates and final state over the gradients, applied as they come (eagerly)."""
  tx = optax.with_extra_args_support(tx)
  state, out = tx.init(params), []
  for g in grads:
    u, state = tx.update(g, state, params, **extra)
    params = optax.apply_updates(params, u)
    out.append(u)
  return out, state, params


def _tree(seed, shapes={'layers': {'mlp_in': {'kernel': (2, 8, 16)}}, 'embedding': (32, 8)}):  # noqa: B006
  key = iter(jax.random.split(jax.random.key(seed), 4))
  return jax.tree.map(
    lambda s: jax.random.normal(next(key), s), shapes, is_leaf=lambda s: isinstance(s, tuple)
  )


def test_float32_state_is_the_code_as_it_was_bit_for_bit():
  """float32: Muon and AdamW as optax builds them without mu_dtype, and DC-ASGD reading w_then
  from prediction's latest update by the formulas as they were written before the setting (no
  cast anywhere), every update and state bit for bit."""
  params, grads = _tree(0), [_tree(s) for s in range(1, 5)]
  with warnings.catch_warnings():
    warnings.simplefilter('ignore', optimizers.MuonDimsWarning)
    muon = optimizers.make_optimizer('muon', 1e-2, muon_learning_rate=0.02, state_dtype='float32')
    before = optax.contrib.muon(  # make_optimizer's call before --state-dtype
      0.02,
      beta=0.95,
      weight_decay=0.0,
      weight_decay_mask=None,
      adam_learning_rate=1e-2,
      adam_b1=0.9,
      adam_b2=optimizers.B2,
      eps=optimizers.EPS,
      muon_weight_dimension_numbers=lambda p: optimizers.muon_dimensions(p),
    )
    ours, theirs = _steps(muon, grads, params), _steps(before, grads, params)
  assert_trees_equal(ours, theirs)
  adam = optimizers.make_optimizer('adamw', 1e-2, weight_decay=0.1, state_dtype='float32')
  plain = optax.adamw(
    1e-2,
    b1=0.9,
    b2=optimizers.B2,
    eps=optimizers.EPS,
    weight_decay=0.1,
    mask=optimizers.kernel_mask,
  )
  assert_trees_equal(_steps(adam, grads, params), _steps(plain, grads, params))

  # the streamed recipe's compensation: DC-ASGD-a with w_then = w - (latest update), SGD after it
  lam, decay, eps, lr = 0.5, 0.95, 1e-7, 0.1
  tx = remember_update(
    optax.chain(
      delay_compensation(lam, 1, decay, eps, from_last_update=True, state_dtype='float32'),
      optax.with_extra_args_support(optax.sgd(lr)),
    ),
    'float32',
  )
  state = optax.with_extra_args_support(tx).init(params)
  ms, last, w = jax.tree.map(jnp.zeros_like, params), jax.tree.map(jnp.zeros_like, params), params
  for g in grads:
    u, state = tx.update(g, state, w, delay=jnp.int32(1))
    # as it was: w_then = w - u; MS = decay MS + (1 - decay) g g; g + lam / sqrt(MS + eps) g g dw
    w_then = jax.tree.map(lambda w, u: w - u, w, last)
    ms = jax.tree.map(lambda m, g: decay * m + (1 - decay) * g * g, ms, g)
    comp = jax.tree.map(
      lambda g, w, w0, m: g + lam / jnp.sqrt(m + eps) * g * g * (w - w0), g, w, w_then, ms
    )
    last = jax.tree.map(lambda c: -lr * c, comp)
    assert_trees_equal(u, last)
    assert_trees_equal(state.last_update, last)
    assert_trees_equal(state.inner[0].mean_square, ms)
    w = optax.apply_updates(w, u)


def _run(state_dtype, steps=8):
  """The recipe (G = 2, M = 2 streamed, Muon 0.02 + prediction + DC) through the schedule:
  the parameters after each step and the optimizer state after the first."""
  model, params = tiny_transformer(2, num_layers=2)
  batches = random_batches(steps, seed=5)
  run = ScheduleConfig(
    name='ouroboros',
    num_stages=2,
    microbatches=2,
    flow='stream',
    compensation=Compensation(predict=True, dc_lambda=1.0, state_dtype=state_dtype),
  )
  with warnings.catch_warnings():
    warnings.simplefilter('ignore', optimizers.MuonDimsWarning)
    tx = optimizers.make_optimizer('muon', 5e-3, muon_learning_rate=0.02, state_dtype=state_dtype)
    schedule = build_schedule(run, model, tx)
    state = schedule.init(params, batches[0])
    trajectory, first = [jax.device_get(state.params)], None
    for batch in batches:
      state, _ = schedule.step(state, batch)
      trajectory.append(jax.device_get(state.params))
      first = first or jax.device_get(state.opt_state)
  return trajectory, first


def test_bf16_state_is_the_float32_state_rounded_and_stays_close():
  """After the first step (the same inputs) every bf16 state is the float32 one rounded, bit for
  bit: the arithmetic is float32 and only the store rounds. After that the runs part by the
  rounding alone. The bound: each update reads its states once rounded (relative error at most
  U = 2^-8 each), so it is off by about U of its own size; the differences add up over the steps
  and the trajectories' own divergence compounds them (1.1-2.4x over these 8 steps when written),
  so after t steps the parameters differ by at most 4 U sum_t max|w_t - w_t-1|. A state that is
  wrong rather than rounded (a momentum lost, a stale update) is off by its own size, ~1/U times
  more."""
  wide, wide_state = _run('float32')
  narrow, narrow_state = _run('bfloat16')
  assert_trees_equal(wide[1], narrow[1])  # the first update reads the zero states
  for kind in PER_WEIGHT:
    pick = lambda tree: [  # noqa: E731
      leaf
      for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
      if kind in jax.tree_util.keystr(path)
    ]
    rounded = [np.asarray(a).astype(BF16) for a in pick(wide_state)]
    stored = pick(narrow_state)
    assert stored and all(s.dtype == BF16 for s in stored), kind
    assert any(np.any(np.asarray(r, np.float32) != 0) for r in rounded), kind  # not all zeros
    for r, s in zip(rounded, stored):
      np.testing.assert_array_equal(np.asarray(s), r)
  path = 0.0
  for t in range(1, len(wide)):
    path += max_abs_diff(wide[t], wide[t - 1])
    assert max_abs_diff(wide[t], narrow[t]) <= 4 * U * path, t
  assert max_abs_diff(wide[-1], narrow[-1]) > 0  # the rounding is there


def test_the_cli_flag_and_the_python_api_resolve_the_same():
  parser = cli_parsers.make_parser()
  for flags, want in (
    ([], 'float32'),
    (['--dtype', 'bfloat16'], 'bfloat16'),
    (['--state-dtype', 'bfloat16'], 'bfloat16'),
    (['--state-dtype', 'float32', '--dtype', 'bfloat16'], 'float32'),
  ):
    args = parser.parse_args(['train', '--schedule', 'ouroboros', '--stages', '2', *flags])
    cfg = cli_parsers.config_from_args(args)
    assert cfg.resolved('cpu').state_dtype == want, flags
    assert cfg.schedule_config('cpu').compensation.state_dtype == want
    if '--dtype' not in flags:  # recipe() takes the schedule's and the optimizer's flags
      keywords = {'state_dtype': flags[1]} if flags else {}
      run = recipe('ouroboros', 2, platform='cpu', **keywords)
      assert run.config.state_dtype == want
      assert dataclasses.asdict(run.schedule) == dataclasses.asdict(cfg.schedule_config('cpu'))
      params = _tree(0)
      with warnings.catch_warnings():
        warnings.simplefilter('ignore', optimizers.MuonDimsWarning)
        got = jax.eval_shape(run.optimizer.init, params)
        cli_state = jax.eval_shape(optimizer_setup.make_optimizer(cfg).init, params)
      assert jax.tree.map(lambda a: a.dtype, got) == jax.tree.map(lambda a: a.dtype, cli_state)
      assert _dtypes(got)['.mu'] == {jnp.dtype(want)}


def test_a_bad_state_dtype_is_one_line_naming_the_choices():
  with raises_for_cli(r'unknown --state-dtype bf16; use auto, float32 or bfloat16\.$'):
    _recipe('bf16')
  with raises_for_cli('unknown --state-dtype float16'):
    recipe('ouroboros', 2, platform='cpu', state_dtype='float16')
  model, params = tiny_transformer(2)
  with raises_for_cli('unknown --state-dtype half'):
    build_schedule(
      ScheduleConfig(
        name='ouroboros', num_stages=2, compensation=Compensation(predict=True, state_dtype='half')
      ),
      model,
      optax.sgd(0.1),
    ).init(params, random_batches(1)[0])


def test_a_resume_compares_the_state_dtype_and_old_runs_stored_float32():
  """It shapes the optimizer state, so a resume compares its resolution ('auto' and its value
  alike); a run saved before the setting kept every state in float32."""
  import json

  from ouroboros_jax.training import checkpoint, resume

  bf16 = field_flags.override(
    presets.get_preset('tiny'), {'schedule': 'ouroboros', 'stages': 2, 'dtype': 'bfloat16'}
  )
  saved = resume.run_meta(bf16, (1, 1))
  explicit = field_flags.override(bf16, {'state_dtype': 'bfloat16'})
  assert resume.check_resumable(saved, explicit, (1, 1), 'OUT') == []
  with pytest.raises(
    checkpoint.CheckpointError,
    match='--state-dtype bfloat16 but the flags give --state-dtype float32',
  ):
    resume.check_resumable(
      saved, field_flags.override(bf16, {'state_dtype': 'float32'}), (1, 1), 'OUT'
    )
  before = json.loads(json.dumps(saved))
  del before['config']['state_dtype']
  with pytest.raises(checkpoint.CheckpointError, match='made with --state-dtype float32'):
    resume.check_resumable(before, bf16, (1, 1), 'OUT')
  as_saved = field_flags.override(bf16, {'state_dtype': 'float32'})
  assert resume.check_resumable(before, as_saved, (1, 1), 'OUT') == []
