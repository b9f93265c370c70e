"""The Ouroboros schedule against its slow reference, against backprop, and against hand math."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from ouroboros_jax import staged
from ouroboros_jax.models import model as transformer
from ouroboros_jax.models import partition
from ouroboros_jax.models.model import ConfigError
from ouroboros_jax.schedules import ScheduleConfig, build_schedule, reference
from ouroboros_jax.schedules.compensation import Compensation
from ouroboros_jax.schedules.delays import staleness
from ouroboros_jax.staged import StagedModel
from ouroboros_jax.update import GroupedOptimizer

from helpers import (
  SEQ,
  adam,
  assert_trees_equal,
  max_abs_diff,
  raises_for_cli,
  random_batches,
  run_schedule,
  save_and_restore,
  tiny_transformer,
)


# The graph stash at every depth; the replay stash at the shallowest and the deepest; post-LN,
# which changes the model and not the ring, at one depth (12 cases before: 28 s of the suite).
@pytest.mark.parametrize(
  'num_stages, stash, pre_ln',
  [
    *((g, 'graph', True) for g in (2, 3, 4, 8)),
    *((g, 'replay', True) for g in (2, 8)),
    (3, 'graph', False),
  ],
)
def test_matches_slow_reference(num_stages, stash, pre_ln):
  model, params = tiny_transformer(num_stages, pre_ln=pre_ln)
  tx = adam(weight_decay=0.01)
  batches = random_batches(7)
  config = ScheduleConfig(
    name='ouroboros', compensation=Compensation(), num_stages=num_stages, stash=stash
  )
  state, losses = run_schedule(config, model, tx, params, batches)
  want, want_losses, _ = reference.run(
    model, tx, params, batches, stash=stash, compensation=Compensation()
  )
  # Losses ~5.5: rtol 1e-5, ~100 float32 ulps. Parameters: float32, Adam at lr 1e-2: sums in another
  # order move parameters by <= ~5e-6 (Adam amplifies near-zero gradient coordinates;
  # test_schedules.py's docstring); 2e-5 is 4x that, a wrong or stale gradient moves them by > 1e-3.
  np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
  assert max_abs_diff(params, want) > 1e-2  # training really moved the weights
  assert max_abs_diff(state.params, want) < 2e-5  # ... and to the reference's values


@pytest.mark.parametrize('stash', ['graph', 'replay'])
def test_uneven_split_dropout_warmup_and_mean_tie_match_reference(stash):
  """The less common paths together: uneven stages, dropout keys, sync warm-up, averaged tie."""
  model, params = tiny_transformer(3, num_layers=5, dropout=0.1, layers_per_stage=(1, 3, 1))
  tx = adam()
  batches = random_batches(7, seed=1)
  config = ScheduleConfig(
    name='ouroboros',
    compensation=Compensation(),
    num_stages=3,
    stash=stash,
    sync_warmup_steps=2,
    tied_grad='mean',
    seed=5,
  )
  state, losses = run_schedule(config, model, tx, params, batches)
  want, want_losses, _ = reference.run(
    model,
    tx,
    params,
    batches,
    stash=stash,
    sync_warmup_steps=2,
    tied_grad='mean',
    seed=5,
    compensation=Compensation(),
  )
  np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
  assert max_abs_diff(state.params, want) < 2e-5


# The graph stash at every depth, the replay stash at the shallowest and the deepest (as
# test_matches_slow_reference; replay at G = 3 too before: 3 s of a 15-minute suite).
@pytest.mark.parametrize(
  'num_stages, stash', [(2, 'graph'), (3, 'graph'), (4, 'graph'), (2, 'replay'), (4, 'replay')]
)
def test_pipelined_forward_matches_slow_reference(num_stages, stash):
  model, params = tiny_transformer(num_stages, dropout=0.1)
  tx = adam()
  steps = 2 * num_stages + 4  # past the pipe fill of 2G steps
  batches = random_batches(steps, seed=2)
  config = ScheduleConfig(
    name='ouroboros',
    compensation=Compensation(),
    num_stages=num_stages,
    stash=stash,
    forward='pipelined',
  )
  schedule = build_schedule(config, model, tx)
  state = schedule.init(params, batches[0])
  losses, loss_batches = [], []
  for batch in batches:
    state, metrics = schedule.step(state, batch)
    losses.append(float(metrics['loss']))
    loss_batches.append(int(metrics['loss_batch']))
  want, want_losses, updated = reference.run(
    model, tx, params, batches, stash=stash, forward='pipelined', compensation=Compensation()
  )
  assert loss_batches == [t - num_stages for t in range(steps)]  # the head lags G steps
  np.testing.assert_allclose(losses[num_stages:], want_losses[num_stages:], rtol=1e-5)
  assert max_abs_diff(state.params, want) < 2e-5
  for t, groups in enumerate(updated):  # group s starts at 2G - s, the head at G
    assert groups == (
      (['embed'] if t >= num_stages else [])
      + [s for s in range(num_stages) if t >= 2 * num_stages - s]
      + (['head'] if t >= num_stages else [])
    )


def test_one_stage_is_plain_backprop():
  model, params = tiny_transformer(1)
  tx = adam()
  batches = random_batches(6)
  ouro, _ = run_schedule(ScheduleConfig(name='ouroboros', num_stages=1), model, tx, params, batches)
  plain, _ = run_schedule(ScheduleConfig(name='backprop'), model, tx, params, batches)
  print('G=1 vs backprop', max_abs_diff(ouro.params, plain.params))
  assert max_abs_diff(ouro.params, plain.params) < 2e-5


# A model whose gradients name their batch: stage s adds a bias b_s, the loss is sum(x * c_t)
# with c_t drawn per batch, so d loss / d b_s = sum(c_t) of the batch it was computed on. With
# SGD at learning rate 1, b_s after step t is b_s(0) - sum of c over the batches it back-propagated.
WIDTH = 3


def probe_model():
  embed = lambda p, inputs, rng: p['scale'] * jnp.ones(inputs.shape + (WIDTH,))
  stage = lambda p, x, stage_index, rng: x + p['bias']
  loss = lambda head, embed_p, x, targets: (
    jnp.sum(x * (targets[..., None].astype(jnp.float32) - 127.5)) * head['w'][0],
    {},
  )
  return StagedModel(embed=embed, stage=stage, loss=loss, tied_embedding=False)


def test_delays_are_exactly_K_minus_k_and_no_early_updates():
  num_stages, steps = 3, 7
  params = {
    'embed': {'scale': jnp.ones(())},
    'stages': {'bias': jnp.zeros((num_stages, WIDTH))},
    'head': {'w': jnp.ones((1,))},
  }
  batches = random_batches(steps, seed=3)
  per_batch_c = [float(jnp.sum(b['targets'].astype(jnp.float32) - 127.5)) for b in batches]
  # The head's weight moves (fresh gradient), which must not leak into the stages' gradient:
  # the stages see delta = c_t * w_head(t), so use w fixed by a zero learning rate on the head.
  tx = optax.multi_transform(
    {'sgd': optax.sgd(1.0), 'frozen': optax.set_to_zero()},
    lambda tree: jax.tree.map(lambda _: 'frozen' if 'w' in tree else 'sgd', tree),
  )
  schedule = build_schedule(
    ScheduleConfig(
      name='ouroboros', compensation=Compensation(), num_stages=num_stages, clip_norm=None
    ),
    probe_model(),
    tx,
  )
  state = schedule.init(params, batches[0])
  for t, batch in enumerate(batches):
    state, _ = schedule.step(state, batch)
    bias_G = np.asarray(state.params['stages']['bias'][:, 0])
    for s, delay in enumerate(staleness(num_stages)):
      seen = range(0, t - delay + 1)  # batches stage s has back-propagated
      expected = -sum(per_batch_c[b] for b in seen)
      # Sums of a few O(1) float32 constants: rtol 1e-5 ~ 100 ulps; a wrong delay moves a whole c.
      np.testing.assert_allclose(bias_G[s], expected, rtol=1e-5)
      if t < delay:
        assert bias_G[s] == 0.0  # no update before its first gradient
      for wrong in (delay - 1, delay + 1):  # a delay off by one gives other numbers
        other = -sum(per_batch_c[b] for b in range(0, t - wrong + 1))
        if t >= min(delay, wrong):
          assert abs(other - expected) > 1.0
  assert staleness(num_stages) == [3, 2, 1]  # K - k for modules k = 1, 2, 3 (K = 4)


@pytest.mark.parametrize(
  'stash, forward, micro',
  [('graph', 'locked', 1), ('replay', 'locked', 1), ('graph', 'pipelined', 2)],
)
def test_checkpoint_resume_is_bitwise_identical(tmp_path, stash, forward, micro):
  """Cut after step 4 and resumed: the stash slots, the micro-batched buffers and the error
  gradients in flight are all in the checkpoint, so the run ends bit for bit where it would."""
  model, params = tiny_transformer(3, dropout=0.1)
  tx = adam()
  batches = random_batches(8)
  config = ScheduleConfig(
    name='ouroboros',
    compensation=Compensation(),
    num_stages=3,
    stash=stash,
    forward=forward,
    microbatches=micro,
  )
  schedule = build_schedule(config, model, tx)  # one schedule: its step traced once for both
  straight = schedule.init(params, batches[0])
  for batch in batches:
    straight, _ = schedule.step(straight, batch)
  state = schedule.init(params, batches[0])
  for batch in batches[:4]:
    state, _ = schedule.step(state, batch)
  restored, data_state = save_and_restore(
    schedule, state, params, batches[0], tmp_path, {'position': 4}
  )
  assert int(restored.step) == 4 and data_state == {'position': 4}
  assert jax.tree.leaves(restored.ring)  # the in-flight buffers were saved
  for batch in batches[4:]:
    restored, _ = schedule.step(restored, batch)
  assert_trees_equal(straight, restored)


def test_impossible_layouts_are_clear_errors():
  cfg = transformer.ModelConfig(d_model=16, num_heads=2, num_layers=2, d_ff=32, seq_len=SEQ)
  with pytest.raises(ConfigError, match='only 2 layers'):
    partition.balance_layers(cfg, 3)
  with pytest.raises(ConfigError, match='devices'):
    build_schedule(
      ScheduleConfig(name='ouroboros', num_stages=16), *tiny_transformer(2)[:1], staged.adamw(1e-3)
    )
  model, params = tiny_transformer(2)
  schedule = build_schedule(
    ScheduleConfig(name='ouroboros', num_stages=2, data_parallel=2), model, staged.adamw(1e-3)
  )
  with pytest.raises(ConfigError, match='divisible'):
    schedule.init(params, random_batches(1, batch=3)[0])
  with pytest.raises(ConfigError, match='sums to'):
    partition.parse_layers_per_stage('1,2', num_layers=4)
  with pytest.raises(ConfigError, match='stash'):
    build_schedule(
      ScheduleConfig(name='ouroboros', num_stages=2, stash='nope'), model, staged.adamw(1e-3)
    )


def test_cost_model_gives_device_zero_fewer_layers():
  cfg = transformer.ModelConfig(
    d_model=64, num_heads=2, num_layers=13, d_ff=128, seq_len=64, vocab_size=50000
  )
  counts = partition.balance_layers(cfg, 4)
  assert sum(counts) == 13 and counts[0] < max(counts[1:])


@pytest.mark.parametrize('forward', ['locked', 'pipelined'])
def test_graph_stash_policies_keep_the_forward_time_gradient(forward):
  """Keeping fewer residuals (a jax.checkpoint policy) recomputes the rest from what was kept at
  forward time, so every policy gives the reference's graph-mode (DDG) parameters."""
  model, params = tiny_transformer(2, dropout=0.1)
  tx = adam()
  batches = random_batches(6, seed=2)
  want, _, _ = reference.run(
    model, tx, params, batches, stash='graph', forward=forward, compensation=Compensation()
  )
  for policy in ('dots', 'nothing'):
    config = ScheduleConfig(
      name='ouroboros',
      compensation=Compensation(),
      num_stages=2,
      stash='graph',
      forward=forward,
      stash_policy=policy,
    )
    state, _ = run_schedule(config, model, tx, params, batches)
    assert max_abs_diff(state.params, want) < 2e-5, policy


def test_unknown_stash_policy_is_a_clear_error():
  model, params = tiny_transformer(2)
  with raises_for_cli('unknown --stash-policy most'):
    build_schedule(
      ScheduleConfig(name='ouroboros', num_stages=2, stash_policy='most'), model, adam()
    )


def delayed_exact_gradients(model, tx, params, batches, num_stages):
  """Graph-mode Ouroboros restated without a ring, stash or deque: every batch's exact gradient
  at the weights of the step that drew it, and module k applies the one of batch t - (K - k)
  (the head: batch t; stage s: t - (G - s); the input side of the tied embedding: t - G)."""

  def split_loss(p, batch):  # the embedding's input side and head side as separate arguments
    x = model.embed(p['embed'], batch['inputs'], None)
    for s in range(num_stages):
      x = model.stage(jax.tree.map(lambda a: a[s], p['stages']), x, s, None)
    return model.loss(p['head'], p['embed_out'], x, batch['targets'])[0]

  grad_of = jax.jit(jax.grad(split_loss))
  optimizer = GroupedOptimizer(tx)
  opt_state, history = optimizer.init(params), []
  for t, batch in enumerate(batches):
    history.append(grad_of({**params, 'embed_out': params['embed']}, batch))
    at = lambda lag: history[t - lag] if t >= lag else None
    zeros = jax.tree.map(jnp.zeros_like, history[-1])
    stage_grads = [
      jax.tree.map(lambda a: a[s], (at(num_stages - s) or zeros)['stages'])
      for s in range(num_stages)
    ]
    grads = {
      'embed': jax.tree.map(jnp.add, history[t]['embed_out'], (at(num_stages) or zeros)['embed']),
      'stages': jax.tree.map(lambda *g: jnp.stack(g), *stage_grads),
      'head': history[t]['head'],
    }
    ready = jnp.asarray([t >= num_stages - s for s in range(num_stages)])
    ready = {'embed': True, 'stages': ready, 'head': True}
    params, opt_state, _ = optimizer.apply(params, opt_state, grads, ready)
  return params


# G = 3 alone (G = 2 too before: 6 s of a 15-minute suite): it has a first, a middle and a
# last stage, each with its own delay; at G = 2 the ring meets the reference in
# test_matches_slow_reference.
@pytest.mark.parametrize('num_stages', [3])
def test_graph_mode_is_backprop_with_per_module_delays(num_stages):
  """An independent check of the ring and the slow reference alike: graph-mode Ouroboros is
  exactly 'module k applies the exact gradient of batch t - (K - k)'."""
  model, params = tiny_transformer(num_stages)
  tx = adam()
  batches = random_batches(7, seed=3)
  config = ScheduleConfig(
    name='ouroboros',
    compensation=Compensation(),
    num_stages=num_stages,
    stash='graph',
    clip_norm=None,
  )
  state, _ = run_schedule(config, model, tx, params, batches)
  want = delayed_exact_gradients(model, tx, params, batches, num_stages)
  assert max_abs_diff(params, want) > 1e-2
  assert max_abs_diff(state.params, want) < 2e-5


def test_the_reference_resolves_a_bare_config_as_the_schedule_does():
  """One record, one resolution: with no settings at all, the schedule and the slow reference
  both run the library's recipe (prediction + DC, streamed, M = G on the CPU), the same way."""
  model, params = tiny_transformer(2)
  batches = random_batches(6, seed=7)
  config = ScheduleConfig(name='ouroboros', num_stages=2)
  state, _ = run_schedule(config, model, adam(), params, batches)
  want, _, _ = reference.run(model, adam(), params, batches)
  paper, _, _ = reference.run(model, adam(), params, batches, compensation=Compensation())
  assert max_abs_diff(state.params, want) < 2e-5
  assert max_abs_diff(paper, want) > 1e-3  # ... which is not the paper's method
  with pytest.raises(ConfigError, match='one replica'):
    reference.run(model, adam(), params, batches, data_parallel=2)
