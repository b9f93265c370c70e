"""A user's model meets the schedules' checks with one line each (issue 39, items 4 and 5): the
ring's mesh axes are the library's own, a sharding annotation in the model that meets them is
one ConfigError naming both, and parameters stacked for the wrong number of stages are one
ConfigError naming the expected and the actual leading axes, before anything is traced."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ouroboros_jax import choices, placement, staged
from ouroboros_jax.errors import ConfigError
from ouroboros_jax.schedules import ScheduleConfig, build_schedule

from helpers import tiny_transformer

VOCAB, WIDTH = 16, 8
BATCH = {'inputs': jnp.zeros((4, 3), jnp.int32), 'targets': jnp.ones((4, 3), jnp.int32)}


def mlp_model(annotate=lambda x: x) -> staged.StagedModel:
  """The guide's residual MLP, its stage passing x through `annotate` (a user's constraint)."""

  def embed(p, tokens, rng):
    return p['table'][tokens]

  def stage(p, x, stage_index, rng):
    x = annotate(x)
    return x + jnp.tanh(x @ p['w_in']) @ p['w_out']

  def loss(head, embed_p, x, targets):
    logp = jax.nn.log_softmax(x @ embed_p['table'].T + head['bias'])
    return -jnp.take_along_axis(logp, targets[..., None], -1).mean(), {}

  return staged.StagedModel(embed=embed, stage=stage, loss=loss)


def mlp_params(groups: int) -> dict:
  k_embed, k_in, k_out = jax.random.split(jax.random.key(0), 3)
  return {
    'embed': {'table': 0.1 * jax.random.normal(k_embed, (VOCAB, WIDTH))},
    'stages': {
      'w_in': 0.1 * jax.random.normal(k_in, (groups, WIDTH, WIDTH)),
      'w_out': 0.1 * jax.random.normal(k_out, (groups, WIDTH, WIDTH)),
    },
    'head': {'bias': jnp.zeros(VOCAB)},
  }


# ----------------------------------------------------------------------------- mesh axes


def test_the_ring_axes_are_the_librarys_own():
  assert (staged.STAGE, staged.DATA) == ('ouroboros_stage', 'ouroboros_data')
  schedule = build_schedule(
    ScheduleConfig(name='ouroboros', num_stages=2), mlp_model(), optax.sgd(0.1)
  )
  assert schedule.mesh.axis_names == (staged.STAGE, staged.DATA)
  assert not {'stage', 'data', 'model', 'fsdp'} & set(schedule.mesh.axis_names)


def test_a_users_mesh_named_data_and_stage_lives_beside_the_ring():
  """A user's own mesh with axes 'stage' and 'data' (their data loader's, their evaluation's,
  their FSDP constraint's) shares no axis name with the ring: the ring's state moves onto it, a
  constraint on its 'data' applies there, and the ring trains on."""
  schedule = build_schedule(
    ScheduleConfig(name='model_parallel', num_stages=2), mlp_model(), optax.sgd(0.1)
  )
  state = schedule.init(mlp_params(2), BATCH)
  state, _ = schedule.step(state, BATCH)
  user = Mesh(np.asarray(jax.devices()[:4]).reshape(2, 2), ('stage', 'data'))
  mine = jax.device_put(state.params['stages'], NamedSharding(user, P('stage', 'data')))
  fsdp = jax.jit(
    lambda w: jax.lax.with_sharding_constraint(w * 1.0, NamedSharding(user, P('data')))
  )
  np.testing.assert_array_equal(fsdp(mine['w_in']), state.params['stages']['w_in'])
  state, metrics = schedule.step(state, BATCH)
  assert np.isfinite(float(metrics['loss']))


# One line, naming the user's annotation and the library's axes, and saying what to do.
ONE_LINE = (
  r'^the model carries its own sharding annotation, (?P<user>.+), but a schedule runs embed, '
  r"stage and loss on its own mesh, axes \('ouroboros_stage', 'ouroboros_data'\), manual inside "
  r'the ring: .* remove it from the model .*\.$'
)


def first_step(name, annotate):
  schedule = build_schedule(
    ScheduleConfig(name=name, num_stages=2), mlp_model(annotate), optax.sgd(0.1)
  )
  schedule.step(schedule.init(mlp_params(2), BATCH), BATCH)


@pytest.mark.parametrize('name', ['model_parallel', 'gpipe', 'ouroboros'])
@pytest.mark.parametrize(
  'axis,shown',
  [
    ('data', r"P\('data',?\)"),  # a user's FSDP axis: not one of the ring's (the old collision)
    ('stage', r"P\('stage',?\)"),
    (staged.DATA, r"P\('ouroboros_data',?\)"),  # the ring's own manual axis
  ],
)
def test_a_sharding_annotation_in_the_model_is_one_line(name, axis, shown):
  with pytest.raises(ConfigError) as caught:
    first_step(name, lambda x: jax.lax.with_sharding_constraint(x, P(axis)))
  message = str(caught.value)
  assert '\n' not in message
  match = re.match(ONE_LINE, message)
  assert match, message
  assert re.search(shown, match['user']), message
  cause = str(caught.value.__cause__)
  # The old collision: JAX read a user's 'data' as the ring's manual axis. Now only the ring's own
  # name is one of its axes; a user's is simply not on the ring's mesh.
  assert ('can only refer to Auto axes' in cause) == (axis == staged.DATA), cause


@pytest.mark.parametrize('name', ['model_parallel', 'ouroboros'])
def test_a_sharding_on_the_users_own_mesh_is_one_line(name):
  """Flax's nn.with_partitioning style: a NamedSharding on the user's mesh with axis 'data'."""
  user = Mesh(np.asarray(jax.devices()[:2]), ('data',))
  with pytest.raises(ConfigError, match=ONE_LINE):
    first_step(name, lambda x: jax.lax.with_sharding_constraint(x, NamedSharding(user, P('data'))))


def test_other_errors_keep_their_own_text():
  assert placement.sharding_error(ValueError('vmap got inconsistent sizes')) is None


# ----------------------------------------------------------------------------- stage counts


def config_for(name: str) -> ScheduleConfig:
  """2 stages; the pipelines that cut the batch get 2 micro-batches."""
  micro = {'microbatches': 2} if name in choices.MICROBATCHED and name != 'ouroboros' else {}
  return ScheduleConfig(name=name, num_stages=2, **micro)


@pytest.mark.parametrize('name', choices.SCHEDULES)
def test_params_for_the_wrong_stage_count_are_one_line(name):
  config = config_for(name)
  model, params = tiny_transformer(3)  # stacked for 3 stage groups
  needs = config.stage_groups  # 2, or 4 for the two-chunk pipelines
  first = jax.tree_util.keystr(jax.tree_util.tree_leaves_with_path(params['stages'])[0][0])
  chunks = f' x {needs // 2} chunks' if needs != 2 else ''
  want = (
    f"params['stages']{first} has leading axis 3, but {name} with num_stages=2{chunks} needs "
    f'{needs} (one slice per stage group): stage the layers with '
    f'ouroboros_jax.from_layers(..., num_stages={needs}).'
  )
  schedule = build_schedule(config, model, optax.sgd(0.1))
  with pytest.raises(ConfigError) as caught:
    schedule.init(params, BATCH)
  assert str(caught.value) == want


@pytest.mark.parametrize('name', ['backprop', 'data_parallel'])
def test_one_device_schedules_take_any_count_but_one_per_leaf(name):
  params = mlp_params(3)
  params['stages']['w_out'] = params['stages']['w_out'][:2]
  schedule = build_schedule(ScheduleConfig(name=name), mlp_model(), optax.sgd(0.1))
  with pytest.raises(ConfigError) as caught:
    schedule.init(params, BATCH)
  assert str(caught.value) == (
    f"params['stages']['w_out'] has leading axis 2, but {name}, as params['stages']['w_in'] "
    'has, needs 3 (one slice per stage group): stage the layers with '
    'ouroboros_jax.from_layers(..., num_stages=3).'
  )
  schedule.init(mlp_params(3), BATCH)  # any count, the same on every leaf


def test_the_check_runs_before_any_tracing():
  """The stage is never called: the check reads the shapes alone."""
  calls = []

  def stage(p, x, s, rng):
    calls.append(1)
    return x

  model = mlp_model()
  model = staged.StagedModel(embed=model.embed, stage=stage, loss=model.loss)
  schedule = build_schedule(ScheduleConfig(name='ouroboros', num_stages=2), model, optax.sgd(0.1))
  with pytest.raises(ConfigError, match='has leading axis 3, but ouroboros'):
    schedule.init(mlp_params(3), BATCH)
  assert not calls


def test_the_python_api_names_what_is_wrong_in_one_line():
  """From Python as from the command line: a number given as text, no stages, a layer that
  changes the activation's shape, a batch of another size than init's."""
  import jax.numpy as jnp
  import optax

  from ouroboros_jax import ConfigError, ScheduleConfig, build_schedule, from_layers
  from ouroboros_jax.training.recipe import recipe

  with pytest.raises(ConfigError, match=r"^learning_rate must be a number, got 'fast'\.$"):
    recipe('ouroboros', 2, learning_rate='fast')
  embed = lambda p, x, rng: p['e'][x]
  head = lambda p, x: x @ p['o']
  pieces = dict(embed_params={'e': jnp.ones((16, 8))}, head_params={'o': jnp.ones((8, 16))})
  layers = [{'w': jnp.eye(8)} for _ in range(4)]
  with pytest.raises(ConfigError, match=r'^num_stages=0 must be at least 1\.$'):
    from_layers(embed, lambda p, x, rng: x @ p['w'], head, layers=layers, num_stages=0, **pieces)
  narrowing = from_layers(
    embed, lambda p, x, rng: (x @ p['w'])[..., :4], head, layers=layers, num_stages=2, **pieces
  )
  batch = {'inputs': jnp.zeros((8, 4), jnp.int32), 'targets': jnp.zeros((8, 4), jnp.int32)}
  ring = ScheduleConfig(name='ouroboros', num_stages=2)
  with pytest.raises(
    ConfigError,
    match=r'^a layer must give back an activation of the shape .*'
    r'float32\[4,4,8\] .* float32\[4,4,4\]',
  ):
    schedule = build_schedule(ring, narrowing.model, optax.sgd(0.1))
    schedule.step(schedule.init(narrowing.params, batch), batch)
  staged = from_layers(
    embed, lambda p, x, rng: x @ p['w'], head, layers=layers, num_stages=2, **pieces
  )
  schedule = build_schedule(ring, staged.model, optax.sgd(0.1))
  state = schedule.init(staged.params, batch)
  small = {k: v[:6] for k, v in batch.items()}
  with pytest.raises(
    ConfigError,
    match=r'^batch of 6 rows, but this Ouroboros state was made for '
    r'batches of 8',
  ):
    schedule.step(state, small)
