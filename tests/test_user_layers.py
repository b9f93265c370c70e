"""A user's layers as they are (issue 57): layers that take more than x (a mask, positions) through
`from_layers(..., context=)`, NNX dropout keyed by the schedule, and `Staging.check`.

The user's model is written as a user writes it: an NNX embedding of a dict of inputs
({'tokens', 'positions', 'segment_ids'}), layers that take `mask=` and `positions=` by keyword,
and a head of a norm and a dense. The reference is the user's own forward and `jax.grad`, no
library code involved.
"""

from __future__ import annotations

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx

from ouroboros_jax import (
  ScheduleConfig,
  build_schedule,
  from_layers,
  kernel_dims,
  make_optimizer,
  recipe,
  staged,
)
from ouroboros_jax.errors import ConfigError
from ouroboros_jax.optimizers import MuonDimsWarning
from ouroboros_jax.schedules import reference
from ouroboros_jax.schedules.compensation import Compensation
from ouroboros_jax.staging import token_cross_entropy
from ouroboros_jax.update import GroupedOptimizer

from helpers import EXACT_ON_TWO_DEVICES, guide_block, max_abs_diff, run_schedule

VOCAB, WIDTH, HEADS, SEQ, BATCH, LAYERS = 32, 8, 2, 6, 8, 3


def batches(num=3, seed=0):
  """Packed rows: tokens, each token's position in its segment, and the segment ids."""
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(num):
    cut = rng.integers(1, SEQ, BATCH)  # each row: two segments, the second from `cut` on
    segment_BxL = 1 + (np.arange(SEQ)[None] >= cut[:, None])
    start_BxL = np.where(segment_BxL == 1, 0, cut[:, None])
    inputs = {
      'tokens': jnp.asarray(rng.integers(1, VOCAB, (BATCH, SEQ)), jnp.int32),
      'positions': jnp.asarray(np.arange(SEQ)[None] - start_BxL, jnp.int32),
      'segment_ids': jnp.asarray(segment_BxL, jnp.int32),
    }
    out.append({'inputs': inputs, 'targets': jnp.asarray(rng.integers(0, VOCAB, (BATCH, SEQ)))})
  return out


def context(inputs):
  """What every layer takes besides x: a causal mask within each segment, and the positions."""
  same_BxLxL = inputs['segment_ids'][:, :, None] == inputs['segment_ids'][:, None, :]
  causal_LxL = jnp.tril(jnp.ones((SEQ, SEQ), bool))
  return {'mask': (same_BxLxL & causal_LxL)[:, None], 'positions': inputs['positions']}


def sinusoid(positions_BxL):
  freqs_D = 1.0 / (100.0 ** (jnp.arange(WIDTH) / WIDTH))
  return jnp.sin(positions_BxL[..., None] * freqs_D)


# ----------------------------------------------------------------------------- the user's model


class Embed(nnx.Module):
  def __init__(self, rngs):
    self.table = nnx.Embed(VOCAB, WIDTH, rngs=rngs)

  def __call__(self, inputs):  # the batch's dict of inputs
    return self.table(inputs['tokens'])


class Layer(nnx.Module):
  """Attention under a mask, the positions added to its queries and keys, then an MLP; dropout
  (attention's and an `nnx.Dropout` built without rngs) when `rate` > 0."""

  def __init__(self, rngs, rate=0.0):
    self.ln1, self.ln2 = nnx.LayerNorm(WIDTH, rngs=rngs), nnx.LayerNorm(WIDTH, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(
      HEADS, WIDTH, dropout_rate=rate, deterministic=False, decode=False, rngs=rngs
    )
    self.up, self.down = (
      nnx.Linear(WIDTH, 2 * WIDTH, rngs=rngs),
      nnx.Linear(2 * WIDTH, WIDTH, rngs=rngs),
    )
    self.drop = nnx.Dropout(rate)  # no rngs: the schedule's key gives it one

  def __call__(self, x_BxLxD, *, mask, positions):
    x_BxLxD = x_BxLxD + self.attn(self.ln1(x_BxLxD) + sinusoid(positions), mask=mask)
    return x_BxLxD + self.drop(self.down(jax.nn.gelu(self.up(self.ln2(x_BxLxD)))))


class Model(nnx.Module):
  def __init__(self, rngs, rate=0.0):
    self.embed = Embed(rngs)
    self.layers = nnx.List([Layer(rngs, rate) for _ in range(LAYERS)])
    self.head = nnx.Sequential(nnx.LayerNorm(WIDTH, rngs=rngs), nnx.Linear(WIDTH, VOCAB, rngs=rngs))

  def __call__(self, inputs):
    x = self.embed(inputs)
    for layer in self.layers:
      x = layer(x, **context(inputs))
    return self.head(x)


def model_and_loss(rate=0.0):
  """(the model, its loss of (params, batch) without dropout, its params)."""
  model = Model(nnx.Rngs(0), rate)
  graphdef, params, rest = nnx.split(nnx.view(model, deterministic=True), nnx.Param, ...)
  loss = lambda p, batch: token_cross_entropy(
    nnx.merge(graphdef, p, rest)(batch['inputs']), batch['targets']
  )[0]
  return model, loss, nnx.to_pure_dict(params)


def staging_of(model, num_stages=2):
  return from_layers(
    model.embed,
    model.layers[0],
    model.head,
    layers=model.layers,
    num_stages=num_stages,
    context=context,
  )


def as_mine(back):
  """`to_layers`'s {'embed', 'layers', 'head'} in the model's own layout."""
  return {**back, 'layers': {i: layer for i, layer in enumerate(back['layers'])}}


# ----------------------------------------------------------------------------- layers with context


def test_a_layer_with_a_mask_and_positions_equals_the_users_forward_and_gradient():
  model, loss, params = model_and_loss()
  staging = staging_of(model)
  batch = batches(1)[0]
  # Jitted: op by op, the staged model's forward and gradient took 10-25 s.
  staged_loss = jax.jit(lambda p: staging.model.forward_loss(p, batch)[0])
  got = staged_loss(staging.params)
  assert abs(float(got) - float(jax.jit(loss)(params, batch))) < 1e-6
  grads = jax.jit(jax.grad(staged_loss))(staging.params)
  want = jax.jit(jax.grad(loss))(params, batch)
  assert max_abs_diff(as_mine(staging.to_layers(grads)), want) < 1e-6
  assert max(float(jnp.abs(g).max()) for g in jax.tree.leaves(want)) > 1e-3
  # What travels between stages: x, the bool mask and the int positions, each batch-leading.
  act = staging.model.embed(staging.params['embed'], batch['inputs'], None)
  assert act['mask'].dtype == jnp.bool_ and act['positions'].dtype == jnp.int32
  assert {a.shape[0] for a in jax.tree.leaves(act)} == {BATCH}
  # The layers read the mask: without it the loss is another.
  free = lambda inputs: {**context(inputs), 'mask': jnp.ones((BATCH, 1, SEQ, SEQ), bool)}
  unmasked = from_layers(
    model.embed, model.layers[0], model.head, layers=model.layers, num_stages=2, context=free
  )
  unmasked_loss = jax.jit(lambda p: unmasked.model.forward_loss(p, batch)[0])
  assert abs(float(unmasked_loss(unmasked.params)) - float(got)) > 1e-4


def test_backprop_trains_a_layer_with_context_as_jax_grad_does():
  model, loss, params = model_and_loss()
  staging = staging_of(model)
  tx = optax.sgd(0.5)
  state, losses = run_schedule(
    ScheduleConfig(name='backprop'), staging.model, tx, staging.params, batches()
  )
  mine, opt_state, want_losses = params, None, []
  tx_alone = optax.chain(optax.clip_by_global_norm(1.0), tx)  # the schedules' clip
  opt_state = tx_alone.init(mine)
  for batch in batches():
    value, grads = jax.value_and_grad(loss)(mine, batch)
    want_losses.append(float(value))
    updates, opt_state = tx_alone.update(grads, opt_state, mine)
    mine = optax.apply_updates(mine, updates)
  np.testing.assert_allclose(losses, want_losses, rtol=0, atol=1e-6)
  assert max_abs_diff(as_mine(staging.to_layers(state.params)), mine) < 2e-5
  assert max_abs_diff(mine, params) > 1e-2


def test_linen_and_pure_layers_take_the_context_by_keyword():
  class Block(nn.Module):
    @nn.compact
    def __call__(self, x, *, mask, positions):
      q = nn.Dense(WIDTH)(x + sinusoid(positions))
      return (
        x
        + jax.nn.dot_product_attention(q[:, :, None], x[:, :, None], x[:, :, None], mask=mask)[
          :, :, 0
        ]
      )

  block, batch = Block(), batches(1)[0]
  ctx = context(batch['inputs'])
  layers = [
    block.init(jax.random.key(i), jnp.zeros((BATCH, SEQ, WIDTH)), **ctx)['params'] for i in range(2)
  ]
  embed = lambda p, inputs, rng: p['table'][inputs['tokens']]
  head = lambda p, x: x @ p['w']
  table, w = jnp.ones((VOCAB, WIDTH)) * 0.1, jnp.ones((WIDTH, VOCAB)) * 0.1
  kw = dict(embed_params={'table': table}, head_params={'w': w}, num_stages=2, context=context)
  linen = from_layers(embed, block, head, layers=layers, example_inputs=batch['inputs'], **kw)
  assert linen.muon_dims == {'Dense_0/kernel': kernel_dims()}  # traced with the context
  pure_layer = lambda p, x, rng, **c: block.apply({'params': p}, x, **c)
  pure = from_layers(embed, pure_layer, head, layers=layers, **kw)
  x = table[batch['inputs']['tokens']]
  for layer in layers:
    x = block.apply({'params': layer}, x, **ctx)
  want = float(token_cross_entropy(x @ w, batch['targets'])[0])
  for staging in (linen, pure):
    assert abs(float(staging.model.forward_loss(staging.params, batch)[0]) - want) < 1e-6


@pytest.mark.parametrize(
  'bad, message',
  [
    (lambda inputs: {'mask': jnp.ones((1, 1, SEQ, SEQ), bool)}, r"context\['mask'\] has shape"),
    (lambda inputs: {'x': inputs['positions']}, r"not the key 'x'"),
    (lambda inputs: inputs['positions'], r'not Array'),
  ],
)
def test_a_context_that_cannot_travel_is_one_clear_line(bad, message):
  model, _, _ = model_and_loss()
  staging = from_layers(
    model.embed, model.layers[0], model.head, layers=model.layers, num_stages=2, context=bad
  )
  with pytest.raises(ConfigError, match=message) as error:
    staging.model.forward_loss(staging.params, batches(1)[0])
  assert '\n' not in str(error.value)


# ----------------------------------------------------------------------------- Staging.check


def test_check_compares_the_staged_loss_with_the_users():
  model, loss, params = model_and_loss()
  staging, batch = staging_of(model), batches(1)[0]
  staged_loss, mine = staging.check(lambda b: loss(params, b), batch)
  assert abs(staged_loss - mine) < 1e-6 and mine > 1.0
  with pytest.raises(ConfigError, match=r'Staging.check: .* is not your loss') as error:
    staging.check(lambda b: (loss(params, b) + 0.01, {}), batch)
  numbers = re.findall(r'\d+\.\d+', str(error.value))
  assert f'{staged_loss:.7g}' in numbers and f'{mine + 0.01:.7g}' in numbers
  assert '\n' not in str(error.value)


# ----------------------------------------------------------------------------- NNX dropout


def counts(module):
  """Every RNG stream's count: what drawing a mask from the module's own streams moves."""
  return [
    int(n.count.get_value()) for _, n in nnx.iter_graph(module) if isinstance(n, nnx.RngStream)
  ]


def test_nnx_dropout_is_keyed_by_the_schedules_key_alone():
  model, loss, params = model_and_loss(rate=0.3)
  before = counts(model)
  staging, batch = staging_of(model), batches(1)[0]
  run = lambda key: float(staging.model.forward_loss(staging.params, batch, key)[0])
  key = jax.random.key(7)
  assert run(key) == run(key)  # the same item, the same masks
  assert run(key) != run(jax.random.key(8))
  assert abs(run(None) - float(loss(params, batch))) < 1e-6  # no key: no dropout
  assert counts(model) == before and model.layers[0].drop.rngs is None  # the user's, untouched
  assert model.layers[0].drop.deterministic is False


@pytest.mark.parametrize(
  'name, fields', [('backprop', {}), ('data_parallel', {'data_parallel': 2})]
)
def test_an_nnx_model_with_dropout_trains_under_the_recipe(name, fields):
  model, _, _ = model_and_loss(rate=0.3)
  staging, data = staging_of(model, 1), batches(4)
  run = recipe(name, batch_size=BATCH, steps=4, muon_dims=staging.muon_dims, **fields)
  schedule = build_schedule(run.schedule, staging.model, run.optimizer)
  state = schedule.init(staging.params, data[0])
  first, metrics = None, None
  for t, batch in enumerate(data):
    state, metrics = schedule.step(state, batch)
    if t == 0:
      first = float(metrics['loss'])
  # The step's loss is its batch's under the key the schedule draws: batch_key(seed, t), and
  # on data replica r its fold_in by r over that replica's rows.
  key, replicas = staged.batch_key(run.schedule.seed, 0), fields.get('data_parallel', 1)
  rows = BATCH // replicas
  want = np.mean(
    [
      staging.model.forward_loss(
        staging.params,
        jax.tree.map(lambda a: a[r * rows : (r + 1) * rows], data[0]),
        key if replicas == 1 else jax.random.fold_in(key, r),
      )[0]
      for r in range(replicas)
    ]
  )
  assert abs(first - float(want)) < 1e-5
  assert np.isfinite(float(metrics['loss']))
  assert max_abs_diff(state.params, staging.params) > 1e-3


# ----------------------------------------------------------------------------- Muon and the recipe


def muon_warnings(tree, **kw) -> set[str]:
  """The leaves Muon's rule warns about on `tree`."""
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter('always')
    make_optimizer('muon', 0.01, **kw).init(tree)
  said = [str(w.message) for w in caught if issubclass(w.category, MuonDimsWarning)]
  return {re.match(r"[^']*'([^']+)'", message).group(1) for message in said}


def test_muon_warns_only_where_it_guesses():
  """Without muon_dims, a stacked NNX Linear kernel [G, N, in, out] is read without a warning
  (its bias [G, N, out] shows one input and one output axis); attention's LinearGeneral kernels
  [G, N, D, H, K] and [G, N, H, K, D], and a kernel without a bias, are still warned about."""
  model, _, _ = model_and_loss()
  stages = staging_of(model).params['stages']
  attention = {f'attn/{name}/kernel' for name in ('query', 'key', 'value', 'out')}
  assert muon_warnings(stages) == attention
  assert muon_warnings({'w': {'kernel': jnp.ones((2, 2, 8, 16))}}) == {'w/kernel'}
  assert muon_warnings(stages, muon_dims=staging_of(model).muon_dims) == set()


def test_the_recipes_optimizer_reads_the_whole_tree_as_the_schedules_do():
  """`run.optimizer` on the whole {'embed', 'stages', 'head'} tree: muon_dims's paths within a
  group still place every kernel, and the updates are the schedules' per-group ones."""
  model, _, _ = model_and_loss()
  staging = staging_of(model)
  run = recipe('backprop', batch_size=BATCH, steps=10, muon_dims=staging.muon_dims)
  keys = iter(jax.random.split(jax.random.key(3), 100))
  grads = jax.tree.map(lambda p: jax.random.normal(next(keys), p.shape), staging.params)
  grouped = GroupedOptimizer(run.optimizer)
  with warnings.catch_warnings():
    warnings.simplefilter('error', MuonDimsWarning)  # every kernel placed, nothing guessed
    whole, whole_state = staging.params, run.optimizer.init(staging.params)
    by_group, group_state = staging.params, grouped.init(staging.params)
    for _ in range(3):  # past the warmup's first step, whose rate is 0
      updates, whole_state = run.optimizer.update(grads, whole_state, whole)
      whole = optax.apply_updates(whole, updates)
      by_group, group_state, _ = grouped.apply(by_group, group_state, grads)
  assert max_abs_diff(whole, staging.params) > 1e-3
  assert max_abs_diff(whole, by_group) < 1e-6


def test_a_stage_count_for_a_schedule_without_stages_says_what_to_pass():
  with pytest.raises(ConfigError, match=r'pass data_parallel=2 .*data_parallel=2\)') as error:
    recipe('data_parallel', 2)
  assert '\n' not in str(error.value)
  with pytest.raises(ConfigError, match=r"recipe\('backprop', 2\): the second argument is num"):
    recipe('backprop', 2)
  assert recipe('data_parallel', data_parallel=2, batch_size=BATCH).schedule.data_parallel == 2


# ----------------------------------------------------------------------------- the pipelines

# The schedules that pass activations from stage to stage: (name, fields, stage groups). Of the
# exact pipelines, which share one executor (pipeline.py), 1F1B (a chunk a device, a fused
# backward) and ZB-V (two chunks, a split backward) take every path a table does (all six before,
# 28 s of a 15-minute suite).
PIPELINED = [p for p in EXACT_ON_TWO_DEVICES[1:] if p[0] in ('model_parallel', '1f1b', 'zb_v')]


def four_layers(groups):
  """A 4-layer model (4 groups for interleaved and zb_v) staged on `groups`, and 2 batches."""
  model = Model(nnx.Rngs(0))
  model.layers.append(Layer(nnx.Rngs(1)))
  return staging_of(model, groups), batches(2)


@pytest.mark.parametrize('name, fields, groups', PIPELINED, ids=[p[0] for p in PIPELINED])
def test_the_exact_pipelines_carry_the_context_between_stages(name, fields, groups):
  """The mask (bool), the positions (int) and the dict of inputs travel in the exact pipelines,
  which train as backprop does."""
  staging, data = four_layers(groups)
  tx = optax.sgd(0.5)
  want, _ = run_schedule(ScheduleConfig(name='backprop'), staging.model, tx, staging.params, data)
  config = ScheduleConfig(name=name, **fields)
  got, _ = run_schedule(config, staging.model, tx, staging.params, data)
  assert max_abs_diff(want.params, staging.params) > 1e-2
  assert max_abs_diff(got.params, want.params) < 2e-5


def test_ouroboros_carries_the_context_between_stages():
  """The same through the ring, against the slow reference (the library's recipe, streamed).
  Fails today: the ring reads the batch's 'inputs' as one array (schedules/ouroboros.py,
  `inputs_M[0]`: KeyError 0 on a dict of inputs); with array inputs and a context it already
  matches the reference (1e-7)."""
  staging, data = four_layers(2)
  tx, comp = optax.sgd(0.5), Compensation(predict=True, dc_lambda=1.0)
  options = dict(microbatches=2, flow='stream')
  config = ScheduleConfig(name='ouroboros', num_stages=2, compensation=comp, **options)
  got, _ = run_schedule(config, staging.model, tx, staging.params, data)
  want, _, _ = reference.run(staging.model, tx, staging.params, data, compensation=comp, **options)
  assert max_abs_diff(want, staging.params) > 1e-2
  assert max_abs_diff(got.params, want) < 2e-5


# ----------------------------------------------------------------------------- the guide


def test_the_guides_lm1b_example_runs_and_learns():
  """docs/guides/own_model.md's lm1b-style NNX pieces, as written: staged, checked, trained."""
  scope: dict = {}
  exec(compile(guide_block('lm1b'), 'own_model.md', 'exec'), scope)
  staged_loss, mine = scope['losses']
  assert abs(staged_loss - mine) < 1e-5
  assert float(scope['metrics']['loss']) < mine - 0.3  # it learned
