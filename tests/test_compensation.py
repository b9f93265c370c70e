"""Staleness compensation (compensation.py) against slow restatements of its formulas."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ouroboros_jax import optimizers
from ouroboros_jax.models.model import ConfigError
from ouroboros_jax.schedules import ScheduleConfig, build_schedule, compensation, reference
from ouroboros_jax.schedules.compensation import Compensation
from ouroboros_jax.schedules.config import RECIPE_COMPENSATION
from ouroboros_jax.update import GroupedOptimizer

from helpers import (
  adam,
  cli_message,
  max_abs_diff,
  raises_for_cli,
  random_batches,
  run_schedule,
  tiny_transformer,
)

EVERY = Compensation(predict=True, pipemare_steps=4, dc_lambda=0.5, shrink=0.7)
CASES = {
  'predict': Compensation(predict=True, predict_horizon=2.0),  # beyond the gap (issue 62)
  'pipemare': Compensation(pipemare_steps=4),
  'dc': Compensation(dc_lambda=0.5),
  'shrink': Compensation(shrink=0.7),
  'all': EVERY,
}


@functools.cache
def _uncompensated(num_stages, forward, steps):
  """The reference's parameters without compensation (shared by the cases it is the same for)."""
  model, params = tiny_transformer(num_stages)
  batches = random_batches(steps, seed=3)
  return reference.run(
    model, adam(), params, batches, forward=forward, compensation=Compensation()
  )[0]


# Every compensation together at both depths and in both forwards; each alone at one of them, in
# turn (20 cases before, 68 s of a 15-minute suite: an error of one alone also shows together).
RESTATED = [
  *(('all', g, f) for g in (2, 3) for f in ('locked', 'pipelined')),
  ('predict', 3, 'pipelined'),
  ('pipemare', 2, 'pipelined'),
  ('dc', 3, 'locked'),
  ('shrink', 2, 'locked'),
]


def test_the_restatement_checks_each_compensation_alone():
  assert {name for name, _, _ in RESTATED} == set(CASES)


@pytest.mark.parametrize('name, num_stages, forward', RESTATED)
def test_matches_slow_restatement(name, num_stages, forward):
  """Module k applies the compensated gradient of batch t - tau_k, as the formulas say."""
  comp = CASES[name]
  model, params = tiny_transformer(num_stages)
  tx = adam()
  steps = 2 * num_stages + 4 if forward == 'pipelined' else 7
  batches = random_batches(steps, seed=3)
  config = ScheduleConfig(  # one micro-batch, as the reference's
    name='ouroboros', num_stages=num_stages, forward=forward, compensation=comp, microbatches=1
  )
  state, losses = run_schedule(config, model, tx, params, batches)
  want, want_losses, _ = reference.run(model, tx, params, batches, config)
  plain = _uncompensated(num_stages, forward, len(batches))
  skip = num_stages if forward == 'pipelined' else 0
  # Losses ~5.5: rtol 1e-5 is ~100 float32 ulps; parameters below: float32, Adam at lr 1e-2: sums in
  # another order move parameters by <= ~5e-6 (Adam amplifies near-zero gradient coordinates;
  # test_schedules.py's docstring); 2e-5 is 4x that, a wrong or stale gradient moves them by > 1e-3.
  np.testing.assert_allclose(losses[skip:], want_losses[skip:], rtol=1e-5)
  assert max_abs_diff(want, plain) > 1e-4  # the compensation changed the trajectory
  assert max_abs_diff(state.params, want) < 2e-5  # ... exactly as the formulas say


# Each stash with one forward, each forward with one stash (every pair before: 24 s of a
# 15-minute suite): the stash and the forward are the ring's own (test_matches_slow_restatement,
# tests/test_ouroboros.py); what this adds, replicas and the warm-up under compensation, is
# checked with each of both.
@pytest.mark.parametrize('stash, forward', [('graph', 'locked'), ('replay', 'pipelined')])
def test_with_data_parallel_warmup_and_replay(stash, forward):
  comp = Compensation(
    predict=True, pipemare_steps=5, shrink=0.8, dc_lambda=0.5 if stash == 'graph' else 0.0
  )
  model, params = tiny_transformer(2)
  tx = adam()
  batches = random_batches(9, seed=4)
  config = ScheduleConfig(
    name='ouroboros',
    num_stages=2,
    data_parallel=2,
    stash=stash,
    forward=forward,
    sync_warmup_steps=2,
    compensation=comp,
    microbatches=1,  # as the reference's
  )
  state, _ = run_schedule(config, model, tx, params, batches)
  want, _, _ = reference.run(
    model,
    tx,
    params,
    batches,
    stash=stash,
    forward=forward,
    sync_warmup_steps=2,
    compensation=comp,
    microbatches=1,
  )
  assert max_abs_diff(state.params, want) < 2e-5


def test_none_is_the_paper_exact_method_bit_for_bit():
  """Compensation() is the paper's method: flow 'auto' gives the whole batch at once, bit for
  bit, and the reference's numbers. A bare config is not it: 'auto' is the recipe."""
  model, params = tiny_transformer(2)
  batches = random_batches(6, seed=5)
  config = ScheduleConfig(name='ouroboros', num_stages=2, compensation=Compensation())
  a, _ = run_schedule(config, model, adam(), params, batches)
  b, _ = run_schedule(
    ScheduleConfig(
      name='ouroboros', num_stages=2, compensation=Compensation(), flow='batch', microbatches=1
    ),
    model,
    adam(),
    params,
    batches,
  )
  want, _, _ = reference.run(model, adam(), params, batches, compensation=Compensation())
  assert max_abs_diff(a.params, b.params) == 0.0
  assert max_abs_diff(a.params, want) < 2e-5
  recipe, _ = run_schedule(
    ScheduleConfig(name='ouroboros', num_stages=2), model, adam(), params, batches
  )
  assert max_abs_diff(recipe.params, want) > 1e-4


def test_auto_is_resolved_once_for_the_python_api_and_the_cli():
  """ScheduleConfig's default compensation is 'auto', resolved by the one rule
  (`ScheduleConfig.resolve_compensation`) that TrainConfig's --compensation auto uses too."""
  from ouroboros_jax.schedules import config as schedule_config
  from ouroboros_jax.training import field_flags, presets

  recipe = compensation.parse(schedule_config.RECIPE_COMPENSATION, steps=0)
  replay = compensation.parse(schedule_config.RECIPE_COMPENSATION_REPLAY, steps=0)
  for fields, want in (
    ({'num_stages': 2}, recipe),
    ({'num_stages': 4, 'forward': 'pipelined'}, recipe),
    ({'num_stages': 2, 'stash': 'replay'}, replay),
    ({'num_stages': 1}, Compensation()),
    ({'num_stages': 2, 'compensation': Compensation()}, Compensation()),
  ):
    run = ScheduleConfig(name='ouroboros', **fields)
    assert ScheduleConfig().compensation == schedule_config.AUTO
    assert run.resolved_compensation == want, fields
    assert run.resolved_flow == ('stream' if want.active else 'batch')
    if 'compensation' not in fields:
      flags = {'schedule': 'ouroboros', 'stages': fields.pop('num_stages'), **fields}
      cli = field_flags.override(presets.get_preset('tiny'), flags)
      assert cli.resolved_compensation() == want
      assert cli.schedule_config('cpu').compensation == run.resolve('cpu', 32).compensation
  assert ScheduleConfig(name='gpipe', num_stages=2).resolved_compensation == Compensation()
  with raises_for_cli(r"--compensation predict,dc takes 'auto' \(the recipe\) or a Compensation"):
    ScheduleConfig(name='ouroboros', num_stages=2, compensation='predict,dc').validate()


def test_one_stage_with_every_compensation_is_uncompensated_bit_for_bit():
  """G = 1 has no delay: every compensation is the identity, so the default Ouroboros with one
  stage is the paper's, which equals backprop (test_ouroboros.test_one_stage_is_plain_backprop)."""
  model, params = tiny_transformer(1)
  batches = random_batches(5, seed=6)
  ours, _ = run_schedule(
    ScheduleConfig(name='ouroboros', num_stages=1, compensation=EVERY),
    model,
    adam(),
    params,
    batches,
  )
  plain, _ = run_schedule(
    ScheduleConfig(name='ouroboros', num_stages=1), model, adam(), params, batches
  )
  assert max_abs_diff(ours.params, plain.params) == 0.0


def test_prediction_with_zero_update_is_the_identity():
  model, params = tiny_transformer(2)
  tx = compensation.remember_update(adam())
  opt_state = GroupedOptimizer(tx).init(params)
  gaps = {'embed': 2, 'stages': jnp.asarray([2, 1]), 'head': 0}
  predicted = compensation.predict_weights(params, opt_state, gaps)
  assert max_abs_diff(predicted, params) == 0.0


def test_prediction_moves_each_group_by_its_gap():
  model, params = tiny_transformer(2)
  tx = compensation.remember_update(adam())
  opt_state = GroupedOptimizer(tx).init(params)
  ones = jax.tree.map(jnp.ones_like, params)
  opt_state = {k: v._replace(last_update=ones[k]) for k, v in opt_state.items()}
  gaps = {'embed': 3, 'stages': jnp.asarray([2, 1]), 'head': 0}
  out = compensation.predict_weights(params, opt_state, gaps)
  # The library's float32 add of small integers, done again here: exact (default rtol 1e-7).
  np.testing.assert_allclose(
    out['embed']['token']['embedding'], params['embed']['token']['embedding'] + 3
  )
  kernel = out['stages']['qkv']['kernel']
  np.testing.assert_allclose(kernel[0], params['stages']['qkv']['kernel'][0] + 2)
  np.testing.assert_allclose(kernel[1], params['stages']['qkv']['kernel'][1] + 1)
  assert max_abs_diff(out['head'], params['head']) == 0.0
  # A horizon of 1.5 extrapolates over 1.5 gaps: 3, 1.5 updates (exact in float32).
  far = compensation.predict_weights(params, opt_state, gaps, horizon=1.5)
  kernel = far['stages']['qkv']['kernel']
  np.testing.assert_allclose(kernel[0], params['stages']['qkv']['kernel'][0] + 3)
  np.testing.assert_allclose(kernel[1], params['stages']['qkv']['kernel'][1] + 1.5)


def test_prediction_moves_a_shared_parameter_by_each_stages_gap():
  """Transformer-XL's global u: its own latest update, times the gap of the stage whose slots
  hold the copy (its per-stage optimizer states see no gradient of it)."""
  model, params = tiny_transformer(2, arch='transformer-xl')
  tx = compensation.remember_update(adam())
  opt_state = GroupedOptimizer(tx, shared=model.shared).init(params)
  u_step = jax.tree.map(lambda a: jnp.full_like(a, 0.5), opt_state['shared'].last_update)
  opt_state['shared'] = opt_state['shared']._replace(last_update=u_step)
  gaps = {'embed': 0, 'stages': jnp.asarray([2, 0]), 'head': 0}
  out = compensation.predict_weights(params, opt_state, gaps)
  for name in model.shared:
    np.testing.assert_allclose(out['stages'][name][0], params['stages'][name][0] + 1.0)
    np.testing.assert_array_equal(out['stages'][name][1], params['stages'][name][1])
  assert max_abs_diff(out['stages']['qkv'], params['stages']['qkv']) == 0.0


def test_update_side_pieces_are_the_identity_without_delay():
  params = {'kernel': jnp.arange(6.0).reshape(2, 3)}
  grads = {'kernel': jnp.linspace(-1, 1, 6).reshape(2, 3)}
  for piece in (
    compensation.shrink_delayed(0.3),
    compensation.delay_compensation(2.0, 3),
    compensation.scale_by_delay(10),
  ):
    state = piece.init(params)
    for _ in range(3):  # w_then == w_now at delay 0, however much the weights have moved
      out, state = piece.update(grads, state, params, delay=0)
      assert max_abs_diff(out, grads) == 0.0
      params = jax.tree.map(lambda w: w + 0.1, params)


def test_pipemare_scale_follows_its_formula():
  piece = compensation.scale_by_delay(4)
  state = piece.init({'w': jnp.zeros(())})
  got = []
  for _ in range(6):
    out, state = piece.update({'w': jnp.ones(())}, state, delay=3)
    got.append(float(out['w']))
  want = [3.0 ** -(1 - min(n / 4, 1)) for n in range(6)]
  # float32 powers of 3: a few ulps (rtol 1e-6 ~ 8 ulps).
  np.testing.assert_allclose(got, want, rtol=1e-6)


def test_muon_treats_the_layer_axis_as_a_batch_axis():
  """Muon on a [layers, in, out] kernel equals Muon on each layer's matrix on its own."""
  rng = np.random.default_rng(0)
  kernels = jnp.asarray(rng.normal(size=(3, 8, 16)), jnp.float32)
  grads = jnp.asarray(rng.normal(size=(3, 8, 16)), jnp.float32)
  tx = optimizers.make_optimizer('muon', 1e-3, muon_learning_rate=0.02)
  stacked, _ = tx.update({'kernel': grads}, tx.init({'kernel': kernels}), {'kernel': kernels})
  for layer in range(3):
    p, g = {'kernel': kernels[layer]}, {'kernel': grads[layer]}
    alone, _ = tx.update(g, tx.init(p), p)
    # Newton-Schulz: 5 iterations of 8x16 float32 matmuls, batched vs single (another summation
    # order), amplified by the quintic's coefficients (~3.4): ~1e-5 relative; a layer mixed with
    # another changes the update by O(1) relative.
    np.testing.assert_allclose(stacked['kernel'][layer], alone['kernel'], rtol=1e-4, atol=1e-6)
  # Orthogonalised: Newton-Schulz pulls the singular values close together (5 steps leave them
  # within a factor of ~1.6), where the gradient's own spread far more.
  spread = lambda m: (lambda sv: sv.max() / sv.min())(
    np.linalg.svd(np.asarray(m), compute_uv=False)
  )
  assert spread(stacked['kernel'][0]) < 2.0 < 4.0 < spread(grads[0])


def test_bad_settings_are_one_line_errors():
  with raises_for_cli('unknown --compensation'):
    compensation.parse('predict,magic', steps=100)
  with raises_for_cli('--shrink'):
    compensation.parse('shrink', steps=100, shrink=1.5)
  with raises_for_cli('--dc-lambda'):
    compensation.parse('dc', steps=100, dc_lambda=-1)
  with raises_for_cli('--predict-horizon must be > 0'):
    compensation.parse('predict', steps=100, predict_horizon=0)
  with pytest.raises(ConfigError, match='unknown optimizer'):
    optimizers.make_optimizer('sgd', 1e-3)
  model, _ = tiny_transformer(2)
  with raises_for_cli('--stash graph'):
    build_schedule(
      ScheduleConfig(
        name='ouroboros', num_stages=2, stash='replay', compensation=Compensation(dc_lambda=1.0)
      ),
      model,
      adam(),
    )
  assert compensation.parse('none', steps=100) == Compensation()
  assert compensation.parse('predict,pipemare', steps=100) == Compensation(
    predict=True, pipemare_steps=25
  )
  # A horizon without prediction is no compensation: 'none' stays the paper's method.
  assert compensation.parse('none', steps=100, predict_horizon=2.0) == Compensation()
  assert compensation.parse('dc', steps=100, predict_horizon=2.0).predict_horizon == 1.0


def test_compensation_spec_refuses_repeats_and_none_or_auto_with_others():
  """One check of the --compensation spelling (`spec_names`), in `parse` and in
  `TrainConfig.validate` alike; the order of the names does not matter."""
  from ouroboros_jax.training import field_flags, presets

  ring = field_flags.override(presets.get_preset('tiny'), {'schedule': 'ouroboros', 'stages': 2})
  for spec, words in (
    ('predict,predict', '--compensation predict,predict lists predict more than once'),
    ('predict,dc,predict', '(--compensation predict,dc)'),
    ('none,dc', 'none (means no compensation) cannot be combined with other compensations'),
    ('dc,none', 'use --compensation none or --compensation dc'),
    ('auto,dc', 'auto (picks the recipe itself) cannot be combined'),
    ('none,magic', 'unknown --compensation magic; use auto, none, or a comma list'),
  ):
    with pytest.raises(ConfigError) as error:
      field_flags.override(ring, {'compensation': spec}).validate()
    message = cli_message(error.value)
    assert words in message and 'unknown --compensation none' not in message
    with raises_for_cli(r'--compensation|unknown'):
      compensation.parse(spec, steps=100)
  assert compensation.spec_names('dc,predict') == ('dc', 'predict')
  assert compensation.spec_names('none') == () and compensation.spec_names('auto') == ('auto',)
  assert compensation.parse('dc,predict', steps=100) == compensation.parse('predict,dc', steps=100)


def test_checkpoints_carry_the_compensation_state_and_resume_bitwise(tmp_path, prepared_data_dir):
  """Muon with every compensation on a ring of 2 with 2 micro-batches: a run cut after its
  step-6 checkpoint and resumed ends bit for bit where the uninterrupted run ends (last updates,
  weight history, PipeMare's count, the optimizer state and the micro-batched ring buffers are
  all in the checkpoint)."""
  from ouroboros_jax.training import checkpoint, field_flags, loop

  from helpers import assert_trees_equal, straight_and_resumed, tiny_config

  recipe = dict(
    schedule='ouroboros',
    stages=2,
    microbatches=2,
    optimizer='muon',
    compensation='predict,pipemare,dc,shrink',
    steps=12,
    checkpoint_every=6,
    eval_every=6,
  )
  straight = tiny_config(tmp_path / 'a', prepared_data_dir, **recipe)
  cut, a, b = straight_and_resumed(straight, tmp_path / 'b', resume_at=6)
  assert_trees_equal(a, b)
  # The compensation state is really in the checkpoint (a plain run has no last_update).
  assert 'last_update' in str(jax.tree_util.tree_structure(a['opt_state']))
  with pytest.raises(checkpoint.CheckpointError, match='--compensation'):
    loop.train(
      field_flags.override(cut, {'compensation': 'predict', 'steps': 14}), resume=True, quiet=True
    )


def test_auto_gives_every_schedule_muon_and_ouroboros_the_recipe():
  """--optimizer auto: Muon for every schedule, at the kernel rate measured best for exact (0.04)
  or delayed (0.02) gradients; Ouroboros with G > 1 also gets the recipe's compensations;
  --compensation none is the paper's AdamW."""
  from ouroboros_jax.training import config, field_flags, presets

  tiny = presets.get_preset('tiny')
  ring = field_flags.override(tiny, {'schedule': 'ouroboros', 'stages': 2})
  assert ring.resolved_optimizer() == config.RECIPE_OPTIMIZER == 'muon'
  assert ring.resolved_muon_learning_rate() == 0.02
  assert ring.resolved_compensation() == compensation.parse(RECIPE_COMPENSATION, steps=ring.steps)
  assert field_flags.override(ring, {'stash': 'replay'}).resolved_compensation().dc_lambda == 0
  for exact in (
    tiny,
    field_flags.override(ring, {'stages': 1}),
    field_flags.override(tiny, {'schedule': 'zb_h1', 'stages': 2}),
  ):
    assert exact.resolved_optimizer() == 'muon'
    assert exact.resolved_muon_learning_rate() == 0.04
    assert exact.resolved_compensation() == Compensation()
  paper = field_flags.override(ring, {'compensation': 'none'})
  assert paper.resolved_optimizer() == 'adamw'
  assert paper.resolved_compensation() == Compensation()
  assert (
    field_flags.override(tiny, {'muon_learning_rate': 0.01}).resolved_muon_learning_rate() == 0.01
  )
