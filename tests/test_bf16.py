"""Mixed precision (`--dtype bfloat16`): what stays float32, and every schedule against its exact
counterpart under the same precision.

bf16 keeps 8 bits of mantissa, so two exact schedules that cut the batch differently (micro-
batches, replicas) round their activations and matmul outputs differently: relative differences
of ~2^-8 per operation, where float32 gives ~1e-7. The tolerance here is therefore stated against
how far training moves the parameters: after STEPS steps of SGD the parameters have moved by
~0.1, a bf16 schedule stays within 0.005 of bf16 backprop (observed <= 0.0022) and bf16 backprop
within 0.005 of float32 backprop (observed 0.0016), while a wrong gradient (a missing micro-batch,
a stale stage) moves them by more than 0.02. Ouroboros is checked against its slow reference run
in bf16, which performs the same operations on the same shapes: equal to float32 rounding.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from ouroboros_jax.accelerators import pld, stdloss
from ouroboros_jax.models import model as transformer
from ouroboros_jax.models import partition
from ouroboros_jax.schedules import ScheduleConfig, build_schedule, reference
from ouroboros_jax.schedules.compensation import Compensation
from ouroboros_jax.training import field_flags, presets

from helpers import (
  assert_trees_equal,
  host_tree,
  max_abs_diff,
  random_batches,
  run_schedule,
  save_and_restore,
  tiny_transformer,
)

STEPS, BATCH = 4, 8
BF16_ATOL = 5e-3  # parameters after STEPS steps; see the module docstring
SGD = optax.sgd(0.5)  # plain SGD: Adam would blow rounding noise of tiny gradients up to its lr


def train(name, num_stages, dtype, *, model=None, **fields):
  """(unstaged params after STEPS steps, losses) of one schedule on the tiny Transformer."""
  config = ScheduleConfig(name=name, num_stages=num_stages, **fields)
  layers = (4 // config.stage_groups,) * config.stage_groups
  staged_model, params = tiny_transformer(
    config.stage_groups, num_layers=4, layers_per_stage=layers, dtype=dtype, **(model or {})
  )
  state, losses = run_schedule(
    config, staged_model, SGD, params, random_batches(STEPS, batch=BATCH)
  )
  return partition.from_staged(jax.device_get(state.params), layers), losses


def test_parameters_gradients_and_loss_stay_float32():
  cfg = transformer.ModelConfig(d_model=16, num_heads=2, num_layers=2, d_ff=32, seq_len=8)
  bf16 = dataclasses.replace(cfg, dtype='bfloat16')
  params = transformer.init_params(bf16, jax.random.key(0))
  assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype('float32')}
  # The same draw as float32's: switching precision does not change the initial model.
  assert max_abs_diff(params, transformer.init_params(cfg, jax.random.key(0))) == 0
  batch = random_batches(1)[0]
  x_BxLxD = transformer.embed(bf16, params['embed'], batch['inputs'])
  assert x_BxLxD.dtype == jnp.bfloat16
  assert transformer.layers(bf16, params['layers'], x_BxLxD).dtype == jnp.bfloat16
  logits = transformer.logits(bf16, params['head'], params['embed'], x_BxLxD)
  assert logits.dtype == jnp.float32
  (loss, _), grads = jax.value_and_grad(
    lambda p: transformer.loss_fn(bf16, p, batch), has_aux=True
  )(params)
  assert loss.dtype == jnp.float32
  assert {g.dtype for g in jax.tree.leaves(grads)} == {jnp.dtype('float32')}
  (want, _), want_grads = jax.value_and_grad(
    lambda p: transformer.loss_fn(cfg, p, batch), has_aux=True
  )(params)
  # bf16 forward against float32 on the same parameters: 2^-8 relative per op on a loss of ~5.5,
  # averaged over 64 tokens, ~1e-4 relative seen; 1e-3 catches a float32 path gone to bf16 logits.
  np.testing.assert_allclose(loss, want, rtol=1e-3)
  for got, exact in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
    assert np.linalg.norm(got - exact) <= 0.1 * np.linalg.norm(exact) + 1e-6


def test_param_dtype_bfloat16_keeps_weights_and_gradients_in_bf16():
  cfg = transformer.ModelConfig(
    d_model=16, num_heads=2, num_layers=2, d_ff=32, seq_len=8, param_dtype='bfloat16'
  )
  params = transformer.init_params(cfg, jax.random.key(0))
  grads = jax.grad(lambda p: transformer.loss_fn(cfg, p, random_batches(1)[0])[0])(params)
  assert {x.dtype for x in jax.tree.leaves((params, grads))} == {jnp.dtype('bfloat16')}


@pytest.fixture(scope='module')
def backprop_bf16():
  return train('backprop', 1, 'bfloat16')


def test_bf16_backprop_trains_like_float32(backprop_bf16):
  params, losses = backprop_bf16
  want, want_losses = train('backprop', 1, 'float32')
  _, initial = tiny_transformer(1, num_layers=4)
  # losses rtol 1e-3: bf16 activations (2^-8) averaged over 64 tokens; see the module docstring.
  assert max_abs_diff(want, partition.from_staged(initial, (4,))) > 0.05  # training moved them
  assert max_abs_diff(params, want) < BF16_ATOL
  np.testing.assert_allclose(losses, want_losses, rtol=1e-3)


# Each step builder: of the exact pipelines, which share one executor (pipeline.py), 1F1B (a chunk
# a device, a fused backward) and ZB-V (two chunks, a split backward) take every path a table does
# (GPipe, interleaved and ZB-H1 too before: 10 s of a 15-minute suite).
@pytest.mark.parametrize(
  'name,num_stages,fields',
  [
    ('data_parallel', 1, {'data_parallel': 2}),
    ('model_parallel', 2, {}),
    ('1f1b', 2, {}),
    ('zb_v', 2, {}),
  ],
)
def test_each_step_builder_in_bf16_equals_backprop_in_bf16(backprop_bf16, name, num_stages, fields):
  want, want_losses = backprop_bf16
  params, losses = train(name, num_stages, 'bfloat16', **fields)
  assert max_abs_diff(params, want) < BF16_ATOL
  np.testing.assert_allclose(losses, want_losses, rtol=1e-3)


@pytest.mark.parametrize('stash,forward', [('graph', 'locked'), ('replay', 'pipelined')])
def test_ouroboros_in_bf16_equals_its_reference_and_sends_bf16(stash, forward):
  """Against the slow reference in bf16; its buffers and every ppermute payload are bf16."""
  model, params = tiny_transformer(3, num_layers=4, dtype='bfloat16')
  batches = random_batches(9, batch=BATCH)
  config = ScheduleConfig(
    name='ouroboros', compensation=Compensation(), num_stages=3, stash=stash, forward=forward
  )
  schedule = build_schedule(config, model, SGD)
  state, losses = run_schedule(config, model, SGD, params, batches, schedule)
  want, want_losses, _ = reference.run(
    model, SGD, params, batches, stash=stash, forward=forward, compensation=Compensation()
  )
  # The same operations on the same shapes, but two programs: where XLA:CPU fuses a bf16
  # intermediate differently the parameters part (1.2e-6 seen in the PLD / std-loss test below on
  # the CI's machine; 7e-9 and 0 here): 1e-5, not 1e-6; parameters move by > 0.05 and a wrong or
  # stale gradient moves them by > 1e-3. The losses (~5.5): rtol 1e-5 (~100 float32
  # ulps), not 1e-6 (~10; 0 seen here).
  assert max_abs_diff(state.params, params) > 0.05
  assert max_abs_diff(state.params, want) < 1e-5
  np.testing.assert_allclose(losses[3:], want_losses[3:], rtol=1e-5)
  for name in ('delta', 'act') if forward == 'pipelined' else ('delta',):
    assert state.ring[name].dtype == jnp.bfloat16, name
  if stash == 'replay':
    assert {x.dtype for x in jax.tree.leaves(state.ring['stash'])} == {jnp.dtype('bfloat16')}
  hlo = schedule.step.lower(schedule.init(params, batches[0]), batches[0]).as_text()
  sent = [
    re.findall(r'tensor<([^>]*)>', line)[-1]
    for line in hlo.splitlines()
    if 'collective_permute' in line
  ]
  assert sent and all(t.endswith('bf16') for t in sent), sent


def test_transformer_xl_memory_is_bf16_and_ring_matches_backprop():
  txl = {'arch': 'transformer-xl', 'mem_len': 8}
  config = ScheduleConfig(name='model_parallel', num_stages=2)
  model, params = tiny_transformer(2, num_layers=4, dtype='bfloat16', **txl)
  schedule = build_schedule(config, model, SGD)
  batches = random_batches(STEPS, batch=BATCH)
  state = schedule.init(params, batches[0])
  assert state.ring['memory']['hidden'].dtype == jnp.bfloat16
  got, losses = train('model_parallel', 2, 'bfloat16', model=txl)
  want, want_losses = train('backprop', 1, 'bfloat16', model=txl)
  assert max_abs_diff(got, want) < BF16_ATOL
  np.testing.assert_allclose(losses, want_losses, rtol=1e-3)


def test_bf16_ouroboros_checkpoint_round_trips(tmp_path):
  model, params = tiny_transformer(2, num_layers=4, dtype='bfloat16')
  batches = random_batches(3, batch=BATCH)
  schedule = build_schedule(
    ScheduleConfig(name='ouroboros', compensation=Compensation(), num_stages=2), model, SGD
  )
  state = schedule.init(params, batches[0])
  for batch in batches:
    state, _ = schedule.step(state, batch)
  restored, _ = save_and_restore(schedule, state, params, batches[0], tmp_path, {'step': 3})
  assert restored.ring['delta'].dtype == jnp.bfloat16
  assert_trees_equal(host_tree(restored), host_tree(state))


@pytest.mark.parametrize('flag', ['pld', 'std_loss'])
def test_pld_and_stdloss_train_in_bf16_as_their_reference(flag):
  """PLD (stages given the batch index) and the standardization loss (activations
  {'h', 'aux'} with a float32 'aux') pass the config check in bf16, and a 2-device replay
  Ouroboros ring with their stages equals the slow reference in bf16; 'aux' stays float32 in
  the ring's buffers while the hidden states are bf16."""
  value = {'pld': '0.5,0.3', 'std_loss': 0.1}[flag]
  cfg = field_flags.override(
    presets.get_preset('tiny'), {'dtype': 'bfloat16', 'num_layers': 4, flag: value}
  )
  cfg.check_accelerators()
  model_cfg = transformer.ModelConfig(
    d_model=16, num_heads=2, num_layers=4, d_ff=32, seq_len=8, dtype='bfloat16'
  )
  layers = (2, 2)
  params = partition.to_staged(transformer.init_params(model_cfg, jax.random.key(0)), layers)
  if flag == 'pld':
    model = pld.pld_stages(model_cfg, layers, 0.5, 0.3)
  else:
    model = stdloss.stdloss_stages(model_cfg, layers, 0.1, 1)
  # Four steps: at SGD 0.5 the fifth jumps the loss to 15.8, and from there one bf16 rounding
  # flip of the head's cotangent (its softmax summed in another order by the other program, a
  # float32 ulp apart before the cast to bf16) grows to 9e-4 in the stages' biases by step 6
  # (seen 2026-11-27 under the tests' XLA flags), as large as a wrong gradient's trace.
  batches = random_batches(4, batch=BATCH)
  config = ScheduleConfig(
    name='ouroboros', compensation=Compensation(), num_stages=2, stash='replay'
  )
  state, losses = run_schedule(config, model, SGD, params, batches)
  want, want_losses, _ = reference.run(
    model, SGD, params, batches, stash='replay', compensation=Compensation()
  )
  assert max_abs_diff(state.params, params) > 0.01
  # The same operations on the same shapes, but two programs: where XLA:CPU fuses a bf16
  # intermediate differently the parameters part by up to 1.2e-6 (the standardization loss's
  # embedding and mlp_out kernel, seen on 2026-11-27 on the CI's kind of machine, 0.0 before);
  # a wrong or stale gradient moves them by more than 1e-3.
  # Losses (5.5 to 15.8): rtol 1e-5 (~100 float32 ulps), not 1e-6 (~10), for the same two-program
  # reason (0 seen here); one SGD step at 0.5 moves them by > 4e-3 relative.
  assert max_abs_diff(state.params, want) < 1e-5
  np.testing.assert_allclose(losses[2:], want_losses[2:], rtol=1e-5)
  dtypes = {x.dtype for x in jax.tree.leaves(state.ring['delta'])}
  want_dtypes = {jnp.dtype('bfloat16')} | ({jnp.dtype('float32')} if flag == 'std_loss' else set())
  assert dtypes == want_dtypes


def test_embedding_gradient_accumulates_in_float32():
  """The embedding's gradient sums every token's into its row (a scatter-add). Summed in bf16,
  65536 tokens over 256 rows come out 4% off; the lookup reads the float32 table, so the sum runs
  in float32 and equals an exact float32 sum of the same bf16 cotangents."""
  cfg = transformer.ModelConfig(
    d_model=8, num_heads=2, num_layers=1, d_ff=8, seq_len=256, dtype='bfloat16'
  )
  params = transformer.init_params(cfg, jax.random.key(0))['embed']
  tokens_BxL = jax.random.randint(jax.random.key(1), (256, 256), 0, 256)
  cotangent_BxLxD = (jax.random.normal(jax.random.key(2), (256, 256, 8)) + 0.3).astype(jnp.bfloat16)
  _, vjp = jax.vjp(lambda p: transformer.embed(cfg, p, tokens_BxL), params)
  (grads,) = vjp(cotangent_BxLxD)
  exact_f32 = cotangent_BxLxD.astype(jnp.float32)
  want = jnp.zeros((256, 8)).at[tokens_BxL].add(exact_f32)
  got = grads['token']['embedding']
  assert got.dtype == jnp.float32
  # float32 sums of 256 bf16 values (|x| < 5) per entry in another order: 256 * 2^-24 * 5 ~ 1e-4;
  # atol 1e-3 is 10x that; a bf16 accumulation is 4% off, ~1 absolute.
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-3)
  np.testing.assert_allclose(grads['position']['embedding'], exact_f32.sum(0), rtol=1e-5, atol=1e-3)


def _dot_operand_dtypes(fn, *args) -> list[tuple[str, ...]]:
  """The operand dtypes of every dot_general in fn's jaxpr (nested jaxprs included)."""
  found = []

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == 'dot_general':
        found.append(tuple(str(v.aval.dtype) for v in eqn.invars))
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        walk(sub)

  walk(jax.make_jaxpr(fn)(*args).jaxpr)
  return found


@pytest.mark.parametrize('tied', [True, False])
def test_output_projection_backward_runs_in_the_compute_dtype(tied):
  """The logits come out in float32 (the loss needs them there), but their cotangent goes back
  through the two backward matmuls in bf16, as every other layer's does: a float32 cotangent
  made the head's backward run at float32 rate (141 against 325 TFLOP/s on an H200). The
  gradients equal the equations' bf16 products; in float32 they equal jax.grad of the plain
  einsum."""
  cfg = transformer.ModelConfig(
    d_model=16,
    num_heads=2,
    num_layers=1,
    d_ff=16,
    seq_len=8,
    vocab_size=64,
    vocab_multiple=1,  # the equations below use the whole table (test_vocab_padding: padded)
    dtype='bfloat16',
    tie_embeddings=tied,
    loss_chunk_tokens=0,  # the unchunked head (test_chunked_loss.py has the chunked one)
  )
  params = transformer.init_params(cfg, jax.random.key(0))
  x_BxLxD = jax.random.normal(jax.random.key(1), (4, 8, 16)).astype(jnp.bfloat16)
  targets_BxL = jax.random.randint(jax.random.key(2), (4, 8), 0, 64)

  def loss(head, embed, x_BxLxD):
    return transformer.head_loss(cfg, head, embed, x_BxLxD, targets_BxL)[0]

  grad = jax.grad(loss, argnums=(0, 1, 2))
  backward_dots = _dot_operand_dtypes(grad, params['head'], params['embed'], x_BxLxD)[1:]
  assert len(backward_dots) == 2 and all(d == ('bfloat16', 'bfloat16') for d in backward_dots)

  # The equations: g = (softmax - onehot) / tokens in float32, rounded to bf16 for both products.
  head_grads, embed_grads, dx_BxLxD = grad(params['head'], params['embed'], x_BxLxD)
  normed_BxLxD = transformer._merge(transformer._graphdefs(cfg)[2], params['head']).ln_final(
    x_BxLxD
  )
  weight_VxD = (
    params['embed']['token']['embedding'] if tied else params['head']['unembed']['kernel'].T
  )
  logits_BxLxV = jnp.einsum(
    'bld,vd->blv', normed_BxLxD, weight_VxD.astype(jnp.bfloat16), preferred_element_type=jnp.float32
  )
  g_BxLxV = (jax.nn.softmax(logits_BxLxV) - jax.nn.one_hot(targets_BxL, 64)) / targets_BxL.size
  g_BxLxV = g_BxLxV.astype(jnp.bfloat16)
  want_dw_VxD = jnp.einsum('blv,bld->vd', g_BxLxV, normed_BxLxD, preferred_element_type=jnp.float32)
  got_dw_VxD = embed_grads['token']['embedding'] if tied else head_grads['unembed']['kernel'].T
  # The same bf16 products summed in float32 over 32 tokens of values < 1/32: float32 rounding,
  # ~32 * 2^-24 relative; a float32 cotangent would differ by bf16 rounding, 2^-8 relative.
  np.testing.assert_allclose(got_dw_VxD, want_dw_VxD, rtol=1e-5, atol=1e-7)
  assert dx_BxLxD.dtype == jnp.bfloat16

  # float32: the custom backward is the plain einsum's, to float32 rounding.
  f32 = dataclasses.replace(cfg, dtype='float32')
  x32_BxLxD = x_BxLxD.astype(jnp.float32)

  def plain(head, embed, x_BxLxD):
    normed = transformer._merge(transformer._graphdefs(f32)[2], head).ln_final(x_BxLxD)
    w = embed['token']['embedding'] if tied else head['unembed']['kernel'].T
    logp = jax.nn.log_softmax(jnp.einsum('bld,vd->blv', normed, w))
    return -jnp.take_along_axis(logp, targets_BxL[..., None], axis=-1).mean()

  got = jax.grad(
    lambda h, e, x: transformer.head_loss(f32, h, e, x, targets_BxL)[0], argnums=(0, 1, 2)
  )(params['head'], params['embed'], x32_BxLxD)
  want = jax.grad(plain, argnums=(0, 1, 2))(params['head'], params['embed'], x32_BxLxD)
  # float32, the same einsum written twice: a few float32 ulps of gradients that are O(0.1).
  assert max_abs_diff(got, want) < 1e-6
