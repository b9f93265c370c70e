"""`from_layers` (issue 39): a user's own Flax model, staged by one call, trains under every
schedule as it trains alone.

Two models the tests write as a user would, one in Linen and one in NNX: attention with
multi-dimensional `DenseGeneral` / `LinearGeneral` kernels, a head that is not tied to the
embedding, and 3 layers on 2 stage groups (uneven: 1 + 2, the pad slot skipped by the stage index)
or 5 on 4 (interleaved and zb_v). The reference is the user's whole model trained with
`jax.grad` and the same Optax optimizer, no library code involved: every exact schedule ends at its
parameters, as does Ouroboros with one stage; Ouroboros with 2 stages ends at the slow reference
written from the paper's equations (`schedules/reference.py`), with the library's recipe
(weight prediction, DC-ASGD, micro-batches streamed round the ring).
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx

from ouroboros_jax import ScheduleConfig, from_layers, kernel_dims, make_optimizer
from ouroboros_jax.errors import ConfigError
from ouroboros_jax.optimizers import MuonDimsWarning
from ouroboros_jax.schedules import reference
from ouroboros_jax.schedules.compensation import Compensation
from ouroboros_jax.staging import token_cross_entropy

from helpers import guide_block, max_abs_diff, random_batches, run_schedule

VOCAB, WIDTH, HEADS, SEQ, BATCH, STEPS = 32, 8, 2, 6, 8, 3
HEAD_DIM = WIDTH // HEADS
ATOL = 2e-5  # float32: a schedule only reorders sums (measured below 1e-6)
CAUSAL = jnp.tril(jnp.ones((SEQ, SEQ), bool))


def attend(q, k, v):
  """Causal attention of [B, L, H, K] queries, keys and values."""
  return jax.nn.dot_product_attention(q, k, v, mask=CAUSAL[None, None])


# ----------------------------------------------------------------------------- a Linen model


class LinenBlock(nn.Module):
  """Pre-LN attention with DenseGeneral kernels [D, 3, H, K] and [H, K, D], then an MLP."""

  @nn.compact
  def __call__(self, x):
    qkv = nn.DenseGeneral((3, HEADS, HEAD_DIM), name='qkv')(nn.LayerNorm()(x))
    mixed = attend(qkv[..., 0, :, :], qkv[..., 1, :, :], qkv[..., 2, :, :])
    x = x + nn.DenseGeneral(WIDTH, axis=(-2, -1), name='out')(mixed)
    return x + nn.Dense(WIDTH)(jax.nn.gelu(nn.Dense(2 * WIDTH)(nn.LayerNorm()(x))))


class LinenLM(nn.Module):
  """The whole model as its author wrote it: embed, `num_layers` blocks, an untied head."""

  num_layers: int

  def setup(self):
    self.embed = nn.Embed(VOCAB, WIDTH)
    self.blocks = [LinenBlock() for _ in range(self.num_layers)]
    self.head = nn.Dense(VOCAB)

  def __call__(self, tokens):
    x = self.embed(tokens)
    for block in self.blocks:
      x = block(x)
    return self.head(x)


def linen_model(num_layers: int):
  """(the user's whole-model loss of params, its params, the from_layers call's arguments)."""
  lm = LinenLM(num_layers)
  params = lm.init(jax.random.key(0), jnp.zeros((1, SEQ), jnp.int32))['params']
  loss = lambda p, batch: token_cross_entropy(
    lm.apply({'params': p}, batch['inputs']), batch['targets']
  )[0]
  pieces = dict(
    embed=nn.Embed(VOCAB, WIDTH).apply,
    layer=LinenBlock(),
    head=nn.Dense(VOCAB),
    layers=[params['blocks_' + str(i)] for i in range(num_layers)],
    embed_params=params['embed'],
    head_params=params['head'],
  )
  to_mine = lambda back: {
    'embed': back['embed'],
    'head': back['head'],
    **{f'blocks_{i}': layer for i, layer in enumerate(back['layers'])},
  }
  return loss, params, pieces, to_mine


# ----------------------------------------------------------------------------- an NNX model


class NnxBlock(nnx.Module):
  """The same block in NNX, with LinearGeneral kernels [D, 3, H, K] and [H, K, D]."""

  def __init__(self, rngs: nnx.Rngs):
    self.ln1, self.ln2 = nnx.LayerNorm(WIDTH, rngs=rngs), nnx.LayerNorm(WIDTH, rngs=rngs)
    self.qkv = nnx.LinearGeneral(WIDTH, (3, HEADS, HEAD_DIM), rngs=rngs)
    self.out = nnx.LinearGeneral((HEADS, HEAD_DIM), WIDTH, axis=(-2, -1), rngs=rngs)
    self.up, self.down = (
      nnx.Linear(WIDTH, 2 * WIDTH, rngs=rngs),
      nnx.Linear(2 * WIDTH, WIDTH, rngs=rngs),
    )

  def __call__(self, x):
    qkv = self.qkv(self.ln1(x))
    x = x + self.out(attend(qkv[..., 0, :, :], qkv[..., 1, :, :], qkv[..., 2, :, :]))
    return x + self.down(jax.nn.gelu(self.up(self.ln2(x))))


class NnxLM(nnx.Module):
  def __init__(self, num_layers: int, rngs: nnx.Rngs):
    self.embed = nnx.Embed(VOCAB, WIDTH, rngs=rngs)
    self.blocks = nnx.List([NnxBlock(rngs) for _ in range(num_layers)])
    self.head = nnx.Linear(WIDTH, VOCAB, rngs=rngs)

  def __call__(self, tokens):
    x = self.embed(tokens)
    for block in self.blocks:
      x = block(x)
    return self.head(x)


def nnx_model(num_layers: int):
  lm = NnxLM(num_layers, nnx.Rngs(0))
  graphdef, state = nnx.split(lm, nnx.Param)
  params = state.to_pure_dict()
  loss = lambda p, batch: token_cross_entropy(
    nnx.merge(graphdef, p)(batch['inputs']), batch['targets']
  )[0]
  pieces = dict(embed=lm.embed, layer=lm.blocks[0], head=lm.head, layers=lm.blocks)  # nnx.List
  to_mine = lambda back: {
    'embed': back['embed'],
    'head': back['head'],
    'blocks': {i: layer for i, layer in enumerate(back['layers'])},
  }
  return loss, params, pieces, to_mine


MODELS = {'linen': linen_model, 'nnx': nnx_model}


# ----------------------------------------------------------------------------- the reference


def sgd():
  return optax.sgd(0.5)


def batches():
  return random_batches(STEPS, batch=BATCH, seq=SEQ, vocab=VOCAB)


@functools.cache
def trained_alone(framework: str, num_layers: int):
  """The user's whole model after STEPS steps of `jax.grad` and SGD with the schedules' clip."""
  loss, params, _, _ = MODELS[framework](num_layers)
  tx = optax.chain(optax.clip_by_global_norm(1.0), sgd())
  opt_state = tx.init(params)
  for batch in batches():
    grads = jax.grad(loss)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
  return params


def staged(framework: str, num_layers: int, num_stages: int):
  _, params, pieces, to_mine = MODELS[framework](num_layers)
  return from_layers(**pieces, num_stages=num_stages), params, to_mine


# (schedule, its fields, layers, stage groups): every exact schedule on 2 devices; interleaved
# and zb_v hold two chunks per device, 4 groups, so they take 5 layers (1 + 1 + 1 + 2).
EXACT = [
  ('backprop', {}, 3, 2),
  ('data_parallel', {'data_parallel': 2}, 3, 2),
  ('model_parallel', {'num_stages': 2}, 3, 2),
  ('gpipe', {'num_stages': 2, 'microbatches': 2}, 3, 2),
  ('1f1b', {'num_stages': 2, 'microbatches': 2}, 3, 2),
  ('zb_h1', {'num_stages': 2, 'microbatches': 2}, 3, 2),
  ('interleaved', {'num_stages': 2, 'microbatches': 2}, 5, 4),
  ('zb_v', {'num_stages': 2, 'microbatches': 2}, 5, 4),
]


# Each schedule with one framework, in turn (linen and nnx four schedules each, one of the
# two-chunk pipelines each): the pieces are the frameworks', the staging is the same (16 cases
# before, 60 s of a 15-minute suite).
@pytest.mark.parametrize(
  'framework, name, fields, num_layers, groups',
  [(list(MODELS)[i % 2], *e) for i, e in enumerate(EXACT)],
  ids=[f'{e[0]}-{list(MODELS)[i % 2]}' for i, e in enumerate(EXACT)],
)
def test_every_exact_schedule_trains_a_users_model_as_jax_grad_does(
  framework, name, fields, num_layers, groups
):
  staging, initial, to_mine = staged(framework, num_layers, groups)
  assert len(set(staging.layers_per_stage)) > 1  # uneven: a pad slot is skipped
  config = ScheduleConfig(name=name, **fields)
  state, _ = run_schedule(config, staging.model, sgd(), staging.params, batches())
  want = trained_alone(framework, num_layers)
  got = to_mine(staging.to_layers(state.params))
  diff = max_abs_diff(got, want)
  print(f'{framework} {name}: max |params - jax.grad| = {diff:.2e}')
  assert max_abs_diff(initial, want) > 1e-2  # training moved them
  assert diff < ATOL, (name, diff)


@pytest.mark.parametrize('framework', MODELS)
def test_ouroboros_with_one_stage_trains_a_users_model_as_jax_grad_does(framework):
  staging, _, to_mine = staged(framework, 3, 1)
  config = ScheduleConfig(name='ouroboros', num_stages=1)
  state, _ = run_schedule(config, staging.model, sgd(), staging.params, batches())
  assert max_abs_diff(to_mine(staging.to_layers(state.params)), trained_alone(framework, 3)) < ATOL


@pytest.mark.parametrize('framework', MODELS)
def test_ouroboros_on_two_stages_matches_the_slow_reference_on_a_users_model(framework):
  staging, _, _ = staged(framework, 3, 2)
  comp = Compensation(predict=True, dc_lambda=1.0)  # the library's recipe, streamed
  options = dict(microbatches=2, flow='stream')
  config = ScheduleConfig(name='ouroboros', num_stages=2, compensation=comp, **options)
  state, losses = run_schedule(config, staging.model, sgd(), staging.params, batches())
  want, want_losses, _ = reference.run(
    staging.model, sgd(), staging.params, batches(), compensation=comp, **options
  )
  assert max_abs_diff(staging.params, want) > 1e-2
  assert max_abs_diff(state.params, want) < ATOL
  # Losses ~3.5: rtol 1e-5, ~150 float32 ulps; a stale gradient moves them by > 1e-3 relative.
  np.testing.assert_allclose(
    [x for x in losses if x], [x for x in want_losses if x is not None], rtol=1e-5
  )


# ----------------------------------------------------------------------------- the layout


def test_layers_come_back_in_the_layout_they_were_given_in():
  staging, params, to_mine = staged('linen', 3, 2)
  assert staging.layers_per_stage == (1, 2)  # device 0 also holds the embedding and the head
  assert jax.tree.leaves(staging.params['stages'])[0].shape[:2] == (2, 2)
  assert max_abs_diff(to_mine(staging.to_layers(staging.params)), params) == 0
  # Stacked in, stacked out; the pad slot of stage 0 is zeros.
  _, _, pieces, _ = linen_model(3)
  stacked = jax.tree.map(lambda *a: jnp.stack(a), *pieces['layers'])
  again = from_layers(**{**pieces, 'layers': stacked}, layers_per_stage=(2, 1))
  assert max_abs_diff(again.to_layers(again.params)['layers'], stacked) == 0
  pad = jax.tree.map(lambda a: a[1, 1], again.params['stages'])
  assert all(float(jnp.abs(a).max()) == 0 for a in jax.tree.leaves(pad))


def test_linen_partitioned_boxes_are_unboxed():
  class Sharded(nn.Module):
    @nn.compact
    def __call__(self, x):
      init = nn.with_partitioning(nn.initializers.lecun_normal(), ('data', None))
      return x + nn.Dense(WIDTH, kernel_init=init)(x)

  block = Sharded()
  layers = [block.init(jax.random.key(i), jnp.zeros((1, WIDTH)))['params'] for i in range(2)]
  assert isinstance(layers[0]['Dense_0']['kernel'], nn.Partitioned)
  embed = lambda p, tokens, rng: p['table'][tokens]
  head = lambda p, x: x @ p['w']
  staging = from_layers(
    embed,
    block,
    head,
    layers=layers,
    embed_params={'table': jnp.ones((VOCAB, WIDTH))},
    head_params={'w': jnp.ones((WIDTH, VOCAB))},
    num_stages=2,
  )
  kernel = staging.params['stages']['Dense_0']['kernel']
  assert isinstance(kernel, jax.Array) and kernel.shape == (2, 1, WIDTH, WIDTH)


@pytest.mark.parametrize(
  'change, message',
  [
    (dict(num_stages=4), r'3 layers cannot fill num_stages=4'),
    (dict(num_stages=None), r'needs num_stages or layers_per_stage'),
    (dict(num_stages=None, layers_per_stage=(1, 1)), r'sums to 2 but the model has 3 layers'),
    (dict(layers_per_stage=(1, 1, 1)), r'gives 3 stages but num_stages is 2'),
    (dict(embed_params=None), r'pass embed_params='),
    (dict(tied_embedding=True), r'needs a pure head'),
    (dict(layers=[]), r'`layers` is empty'),
  ],
)
def test_bad_staging_is_one_clear_line(change, message):
  _, _, pieces, _ = linen_model(3)
  with pytest.raises(ConfigError, match=message) as error:
    from_layers(**{**pieces, 'num_stages': 2, **change})
  assert '\n' not in str(error.value)


def test_layers_of_another_kind_are_one_clear_line():
  _, _, pieces, _ = linen_model(3)
  odd = dict(pieces['layers'][2])
  odd['extra'] = {'kernel': jnp.ones((2, 2))}
  with pytest.raises(ConfigError, match=r'layer 2 has other parameters than layer 0'):
    from_layers(**{**pieces, 'layers': [*pieces['layers'][:2], odd]}, num_stages=2)


# ----------------------------------------------------------------------------- Muon's view


@pytest.mark.parametrize('framework', MODELS)
def test_the_modules_tell_muon_how_to_read_their_kernels(framework):
  """NNX modules are read directly, Linen ones while they run on example inputs: q/k/v
  [D, 3, H, K] is one D x 3HK matrix, the output projection [H, K, D] one HK x D matrix."""
  _, _, pieces, _ = MODELS[framework](3)
  example = batches()[0]['inputs']
  staging = from_layers(**pieces, num_stages=2, example_inputs=example)
  mlp = ('Dense_0', 'Dense_1') if framework == 'linen' else ('up', 'down')
  want = {
    'qkv/kernel': kernel_dims(1, 3),
    'out/kernel': kernel_dims(2, 1),
    f'{mlp[0]}/kernel': kernel_dims(),
    f'{mlp[1]}/kernel': kernel_dims(),
    'kernel': kernel_dims(),  # the head
  }
  assert staging.muon_dims == want
  with warnings.catch_warnings():
    warnings.simplefilter('error', MuonDimsWarning)  # every kernel placed: nothing guessed
    make_optimizer('muon', 0.01, muon_dims=staging.muon_dims).init(staging.params['stages'])
  with pytest.warns(MuonDimsWarning, match='out/kernel'):  # the rule alone would guess
    make_optimizer('muon', 0.01).init(staging.params['stages'])
  if framework == 'linen':  # without example inputs, Linen modules say nothing
    assert from_layers(**pieces, num_stages=2).muon_dims == {}


def test_the_guides_linen_example_runs_and_learns():
  """docs/guides/own_model.md's Linen block, as written: staged, trained, written back."""
  scope: dict = {}
  exec(compile(guide_block('linen'), 'own_model.md', 'exec'), scope)
  assert float(scope['metrics']['loss']) < 4.0  # from log 256 = 5.55 on 16 symbols
  trained, start = scope['params'], scope['staging'].to_layers(scope['staging'].params)
  assert set(trained) == {'embed', 'head', 'blocks_0', 'blocks_1', 'blocks_2'}
  assert max_abs_diff(trained['blocks_2'], start['layers'][2]) > 1e-3


def test_nnx_modules_take_their_layers_back():
  _, _, pieces, _ = nnx_model(3)
  staging = from_layers(**pieces, num_stages=2)
  moved = jax.tree.map(lambda a: a + 1.0, staging.params)  # as if trained
  for block, layer in zip(pieces['layers'], staging.to_layers(moved)['layers']):
    nnx.update(block, layer)
  for i, block in enumerate(pieces['layers']):
    want = staging.to_layers(moved)['layers'][i]
    assert max_abs_diff(nnx.to_pure_dict(nnx.state(block, nnx.Param)), want) == 0
  assert (
    max_abs_diff(
      staging.to_layers(moved)['layers'][0], staging.to_layers(staging.params)['layers'][0]
    )
    == 1.0
  )
