"""Progressive layer dropping: schedules, gate statistics, skipped compute, evaluation, and the
batch index the schedules hand the stages."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ouroboros_jax import staged
from ouroboros_jax.accelerators import pld
from ouroboros_jax.models import model as transformer
from ouroboros_jax.models import partition
from ouroboros_jax.models.model import ConfigError
from ouroboros_jax.schedules import ScheduleConfig, build_schedule
from ouroboros_jax.schedules.compensation import Compensation

from helpers import random_batches

SEQ, VOCAB = 8, 32
CFG = transformer.ModelConfig(
  vocab_size=VOCAB, d_model=16, num_heads=2, num_layers=4, d_ff=32, seq_len=SEQ
)
LAYERS_PER_STAGE = (1, 3)  # uneven on purpose: padding slots and global layer indices


def batch_of(seed=0, size=2):
  return random_batches(1, seed, batch=size, seq=SEQ, vocab=VOCAB)[0]


@pytest.fixture(scope='module')
def params():
  return transformer.init_params(CFG, jax.random.key(0))


def test_schedules_follow_the_formulas():
  assert float(pld.theta(0, 0.5, 0.01)) == 1.0
  # float32 closed forms of a few ops: rtol 1e-6 ~ 8 ulps.
  np.testing.assert_allclose(pld.theta(100, 0.5, 0.01), 0.5 * np.exp(-1.0) + 0.5, rtol=1e-6)
  np.testing.assert_allclose(pld.theta(1e6, 0.3, 0.01), 0.3, rtol=1e-6)
  p = pld.keep_probs(100, 4, 0.5, 0.01)
  theta = 0.5 * np.exp(-1.0) + 0.5
  np.testing.assert_allclose(p, 1 - np.arange(1, 5) / 4 * (1 - theta), rtol=1e-6)
  np.testing.assert_allclose(pld.keep_probs(0, 4, 0.5, 0.01), np.ones(4))
  np.testing.assert_allclose(
    pld.expected_layer_fraction(1e6, 4, 0.5, 0.01),
    np.mean(1 - np.arange(1, 5) / 4 * 0.5),
    rtol=1e-6,
  )


@pytest.mark.parametrize('t', [50, 400])
def test_empirical_keep_rate_matches_p(t):
  n = 4000
  p_L = pld.keep_probs(t, 4, 0.5, 0.005)
  keys = jax.random.split(jax.random.key(t), n)
  active_nL, scale_nL = jax.jit(jax.vmap(lambda k: pld.draw_gates(k, p_L)))(keys)
  rate_L = np.asarray(active_nL).mean(0)
  sigma_L = np.sqrt(np.asarray(p_L) * (1 - np.asarray(p_L)) / n)
  assert np.all(np.abs(rate_L - np.asarray(p_L)) <= 3 * sigma_L), (rate_L, p_L)
  assert np.all(np.diff(np.asarray(p_L)) < 0)  # lower layers are kept more often
  np.testing.assert_allclose(scale_nL[0], 1 / np.asarray(p_L), rtol=1e-6)


def test_stage_draws_the_gates_of_its_global_layers(params):
  """Stage 1 of (1, 3) holds global layers 2..4: its output is `model.layers` with the gates
  drawn for p_2..p_4 at the batch index it is given, and 1/p scaling."""
  t, theta_bar, gamma = 300, 0.5, 0.01
  model = pld.pld_stages(CFG, LAYERS_PER_STAGE, theta_bar, gamma)
  staged_params = partition.to_staged(params, LAYERS_PER_STAGE)
  stage1 = jax.tree.map(lambda a: a[1], staged_params['stages'])
  x_BxLxD = jax.random.normal(jax.random.key(1), (2, SEQ, CFG.d_model))

  @jax.jit
  def both(rng):
    got = model.stage(stage1, x_BxLxD, 1, rng, batch_index=t)
    p_N = pld.keep_probs(t, 4, theta_bar, gamma, jnp.arange(2, 5))
    active_N, scale_N = pld.draw_gates(pld.gate_key(rng), p_N)
    want = transformer.layers(CFG, stage1, x_BxLxD, rng, transformer.PerLayer(active_N, scale_N))
    return got, want, active_N

  dropped_any = False
  for seed in range(6):
    got, want, active_N = both(jax.random.key(seed))
    np.testing.assert_array_equal(got, want)
    dropped_any |= not bool(np.all(active_N))
  assert dropped_any


def _computations(hlo: str) -> dict[str, str]:
  """HLO module text -> {computation name: body}."""
  out, name = {}, None
  for line in hlo.splitlines():
    header = re.match(r'^(?:ENTRY )?%?([\w.\-]+) \(.*\) -> .* \{$', line)
    if header:
      name = header.group(1)
      out[name] = ''
    elif name is not None:
      out[name] += line + '\n'
  return out


def test_a_dropped_layer_costs_no_compute(params):
  """Every matmul of the compiled PLD stage sits in a computation reachable only through a
  `conditional` branch: a layer whose gate is off runs none of them."""
  model = pld.pld_stages(CFG, LAYERS_PER_STAGE, 0.5, 0.01)
  stage1 = jax.tree.map(lambda a: a[1], partition.to_staged(params, LAYERS_PER_STAGE)['stages'])
  x = jnp.zeros((2, SEQ, CFG.d_model))
  hlo = (
    jax.jit(lambda p, x, k, t: model.stage(p, x, 1, k, batch_index=t))
    .lower(stage1, x, jax.random.key(0), jnp.int32(0))
    .compile()
    .as_text()
  )
  comps = _computations(hlo)
  entry = next(n for n in comps if re.search(rf'^ENTRY %?{re.escape(n)} ', hlo, re.M))
  # Walk the call graph from ENTRY without entering conditional branches.
  reach, todo = set(), [entry]
  while todo:
    name = todo.pop()
    if name in reach:
      continue
    reach.add(name)
    for line in comps[name].splitlines():
      if ' conditional(' in line:
        continue
      todo += [
        c for c in re.findall(r'(?:calls|to_apply|body|condition)=%?([\w.\-]+)', line) if c in comps
      ]
  dots_outside = [n for n in reach if re.search(r' (dot|convolution)\(', comps[n])]
  dots_anywhere = [n for n in comps if re.search(r' (dot|convolution)\(', comps[n])]
  assert ' conditional(' in hlo and dots_anywhere
  assert not dots_outside, dots_outside


def test_dropped_layer_is_skipped_exactly(params):
  """With layer 4's gate off, its parameters do not matter at all: set to NaN they give the same
  loss, bit for bit, and exactly zero gradient for layer 4 (finite everywhere): the layer never
  entered the computation, forward or backward."""
  t, theta_bar, gamma = 10_000, 0.5, 0.01
  p_L = pld.keep_probs(t, 4, theta_bar, gamma)
  # A batch key whose draw keeps layers 1-3 and drops layer 4 (the loss draws from rng_layers).
  keys = jax.random.split(jax.random.key(7), 200)
  gates = jax.jit(jax.vmap(lambda k: pld.draw_gates(pld.gate_key(jax.random.split(k)[1]), p_L)[0]))(
    keys
  )
  wanted = np.flatnonzero(np.all(np.asarray(gates) == [True, True, True, False], axis=1))
  assert wanted.size, 'no key drops exactly layer 4'
  key, batch = keys[wanted[0]], batch_of()
  loss_and_grads = jax.jit(
    jax.value_and_grad(
      lambda p: pld.pld_loss_fn(CFG, p, batch, key, t, pld.Rates(theta_bar, gamma))[0]
    )
  )
  nan_params = {**params, 'layers': jax.tree.map(lambda a: a.at[3].set(jnp.nan), params['layers'])}
  value, grads = loss_and_grads(nan_params)
  clean_value, clean_grads = loss_and_grads(params)
  assert float(value) == float(clean_value) and np.isfinite(float(value))
  for g in jax.tree.leaves(jax.tree.map(lambda a: a[3], grads['layers'])):
    np.testing.assert_array_equal(g, 0.0)
  jax.tree.map(np.testing.assert_array_equal, grads, clean_grads)


def test_evaluation_is_the_plain_model(params):
  model = pld.pld_stages(CFG, LAYERS_PER_STAGE, 0.5, 0.01)
  staged_params = partition.to_staged(params, LAYERS_PER_STAGE)
  batch = batch_of()

  @jax.jit
  def losses(staged_params, params):
    return (
      model.forward_loss(staged_params, batch)[0],  # evaluation, no batch index
      model.forward_loss(staged_params, batch, None, 10_000)[0],  # evaluation, late batch
      model.forward_loss(staged_params, batch, jax.random.key(3), 10_000)[0],  # training
      transformer.loss_fn(CFG, params, batch)[0],
    )  # the plain model

  plain, late, train, want = map(float, losses(staged_params, params))
  assert plain == late
  # The same model with every layer kept: the same ops, a few ulps of a loss ~5.5.
  np.testing.assert_allclose(plain, want, rtol=1e-6)
  assert train != plain  # training at a late step draws gates and scales


def test_training_without_the_step_and_post_ln_are_errors(params):
  model = pld.pld_stages(CFG, LAYERS_PER_STAGE)
  with pytest.raises(ConfigError, match='no batch index'):
    model.forward_loss(partition.to_staged(params, LAYERS_PER_STAGE), batch_of(), jax.random.key(0))
  with pytest.raises(ConfigError, match='pre-LN'):
    pld.pld_stages(transformer.ModelConfig(pre_ln=False), (4,))


def test_runs_inside_a_ring_schedule(params):
  """A 2-device ring (`model_parallel`) hands each stage the index of its batch: the loss of
  step 1000 is the single-device PLD loss of that batch with the same draws, and those draws do
  drop layers."""
  model = pld.pld_stages(CFG, LAYERS_PER_STAGE, 0.5, 0.05)
  staged_params = partition.to_staged(params, LAYERS_PER_STAGE)
  batch = batch_of(0, 4)
  schedule = build_schedule(
    ScheduleConfig(name='model_parallel', num_stages=2), model, staged.adamw(1e-2)
  )
  state = schedule.init(staged_params, batch)
  state = state.replace(step=jax.device_put(jnp.int32(1000), state.step.sharding))
  state, metrics = schedule.step(state, batch)
  key = staged.batch_key(0, 1000)  # the schedule's dropout key of batch 1000
  want = jax.jit(lambda p: model.forward_loss(p, batch, key, 1000)[0])(staged_params)
  np.testing.assert_allclose(float(metrics['loss']), float(want), rtol=1e-6)
  assert all(np.all(np.isfinite(a)) for a in jax.tree.leaves(jax.device_get(state.params)))
  dropped = 0
  for s, first in enumerate((0, 1)):
    ids = jnp.arange(LAYERS_PER_STAGE[s]) + first + 1
    active, _ = pld.draw_gates(
      pld.gate_key(staged.piece_rng(key, s)), pld.keep_probs(1000, 4, 0.5, 0.05, ids)
    )
    dropped += int(np.sum(~np.asarray(active)))
  assert dropped > 0


def _gate_reading_params(cfg, layers_per_stage):
  """Staged params whose layer l (global, 0-based) adds exactly e_l to the residual stream:
  every weight zero except the MLP's output bias, one-hot in channel l. A kept layer then adds
  e_l / p_l (PLD's scaling), a dropped one nothing: the output minus the input reads the gates
  off the real stage code."""
  params = transformer.init_params(cfg, jax.random.key(0))
  params = jax.tree.map(jnp.zeros_like, params)
  bias = jnp.eye(cfg.num_layers, cfg.d_model)
  params['layers']['mlp_out']['bias'] = bias
  return partition.to_staged(params, layers_per_stage)


def test_stage_keep_rate_and_scale_match_p_l():
  """Through `pld_stages` itself (uneven stages, global layer indices): over 3000 batch keys
  the rate at which layer l ran matches p_l(t) within 3 sigma, a kept layer is scaled by exactly
  1/p_l, and `kept_layers` (the FLOP counter) agrees with the gates the stages drew."""
  t, theta_bar, gamma, n = 60, 0.3, 0.02, 3000
  model = pld.pld_stages(CFG, LAYERS_PER_STAGE, theta_bar, gamma)
  staged_params = _gate_reading_params(CFG, LAYERS_PER_STAGE)

  @jax.jit
  def read(batch_index):
    key = staged.batch_key(0, batch_index)
    h = jnp.zeros((1, 1, CFG.d_model))
    for s in range(2):
      stage_params = jax.tree.map(lambda a: a[s], staged_params['stages'])
      h = model.stage(stage_params, h, s, staged.piece_rng(key, s), batch_index=t)
    return h[0, 0, : CFG.num_layers]

  added_nL = np.asarray(jax.vmap(read)(jnp.arange(n)))
  p_L = np.asarray(pld.keep_probs(t, 4, theta_bar, gamma))
  kept_nL = added_nL > 0
  # 1/p in float32 times the gates: a few ulps; rtol 1e-5 is far above, a wrong scale far below.
  np.testing.assert_allclose(
    added_nL[kept_nL], np.broadcast_to(1 / p_L, added_nL.shape)[kept_nL], rtol=1e-5
  )
  assert np.all(added_nL[~kept_nL] == 0)
  rate_L = kept_nL.mean(0)
  assert np.all(np.abs(rate_L - p_L) <= 3 * np.sqrt(p_L * (1 - p_L) / n)), (rate_L, p_L)
  assert np.all(np.diff(p_L) < 0) and p_L[-1] < 0.8
  # The counter re-draws the gates of batch t at step t: the layers that batch ran.
  counted = pld.kept_layers(0, jnp.asarray([t]), LAYERS_PER_STAGE, 4, theta_bar, gamma)
  assert int(counted[0]) == int(np.sum(np.asarray(read(t)) > 0))


def test_ouroboros_with_pld_matches_the_slow_reference(params, stash='replay'):
  """PLD inside the stages of a 2-device Ouroboros ring (stages get the batch index): after 6
  steps the parameters equal the slow reference's (`reference.py`), which runs the same
  `pld_stages` model with Python deques; and layers were really dropped on the way. Replay mode:
  the delayed backward re-runs each stage, so it must draw the gates of the batch's own step
  (graph mode keeps the forward's VJP and cannot get them wrong)."""
  from ouroboros_jax.schedules import reference

  theta_bar, gamma = 0.5, 0.5
  model = pld.pld_stages(CFG, LAYERS_PER_STAGE, theta_bar, gamma)
  staged_params = partition.to_staged(params, LAYERS_PER_STAGE)
  batches = [batch_of(seed, 4) for seed in range(6)]
  tx = staged.adamw(1e-2, eps=1e-6)
  schedule = build_schedule(
    ScheduleConfig(name='ouroboros', compensation=Compensation(), num_stages=2, stash=stash),
    model,
    tx,
  )
  state = schedule.init(staged_params, batches[0])
  for batch in batches:
    state, metrics = schedule.step(state, batch)
  want, _, _ = reference.run(
    model, tx, staged_params, batches, stash=stash, compensation=Compensation()
  )
  diff = max(
    jax.tree.leaves(
      jax.tree.map(
        lambda a, b: float(np.max(np.abs(a - b))),
        jax.device_get(state.params),
        jax.device_get(want),
      )
    )
  )
  # float32, Adam at lr 1e-2: sums in another order move
  # parameters by <= ~5e-6 (Adam amplifies near-zero gradient coordinates; test_schedules.py's
  # docstring); 2e-5 is 4x that, a wrong or stale gradient moves them by > 1e-3.
  assert diff < 2e-5
  kept = np.asarray(pld.kept_layers(0, np.arange(6), LAYERS_PER_STAGE, 4, theta_bar, gamma))
  assert kept.min() < 4
