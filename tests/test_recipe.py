"""`ouroboros_jax.recipe`: the library's default recipe in one Python call, equal to what the CLI
resolves for the same flags (issue 39, item 2)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ouroboros_jax
from ouroboros_jax import Compensation, ConfigError, ResolvedSchedule, ScheduleConfig, recipe
from ouroboros_jax.training import config, field_flags, optimizer_setup, presets

BATCH, STEPS = 32, 100


def cli_config(**flags):
  """The TrainConfig `ouroboros train` builds for these flags (cli.config_from_args)."""
  return field_flags.override(presets.get_preset('tiny'), flags)


@pytest.mark.parametrize('platform', ['cpu', 'gpu'])
@pytest.mark.parametrize('forward', ['locked', 'pipelined'])
@pytest.mark.parametrize('stages', [2, 4])
def test_the_schedule_is_the_clis_field_by_field_and_not_the_papers(stages, forward, platform):
  run = recipe(
    'ouroboros', stages, batch_size=BATCH, platform=platform, steps=STEPS, forward=forward
  ).schedule
  cli = cli_config(
    schedule='ouroboros', stages=stages, batch_size=BATCH, steps=STEPS, forward=forward
  ).schedule_config(platform)
  assert dataclasses.asdict(run) == dataclasses.asdict(cli)
  # the library's recipe, not the paper's method
  assert run.compensation.active and run.compensation != Compensation()
  assert set(run.compensation.names()) == {'predict', 'dc'}
  assert run.resolved_flow == cli.resolved_flow == 'stream'
  assert run.num_microbatches > 1  # every gradient one update old
  assert dataclasses.asdict(run) != dataclasses.asdict(
    ScheduleConfig(name='ouroboros', num_stages=stages, forward=forward)
  )


def _grads_and_params():
  k = jax.random.split(jax.random.key(0), 3)
  params = {
    'layers': {
      'mlp_in': {'kernel': jax.random.normal(k[0], (2, 8, 16)), 'bias': jnp.zeros((2, 16))}
    },
    'embedding': jax.random.normal(k[1], (32, 8)),
  }
  grads = jax.tree.map(lambda p: jax.random.normal(k[2], p.shape), params)
  return params, grads


def _first_updates(tx, params, grads):
  state = tx.init(params)
  for _ in range(3):  # past the first warmup step, whose rate is 0
    updates, state = tx.update(grads, state, params)
  return updates


@pytest.mark.parametrize('flags', [{}, {'compensation': 'none'}, {'stages': 1}])
def test_the_optimizer_takes_the_clis_update(flags):
  flags = {'schedule': 'ouroboros', 'stages': 2, **flags}
  stages = flags.pop('stages')
  params, grads = _grads_and_params()
  got = recipe(
    flags.pop('schedule'), stages, BATCH, platform='cpu', steps=STEPS, warmup_steps=1, **flags
  ).optimizer
  cfg = cli_config(
    schedule='ouroboros', stages=stages, batch_size=BATCH, steps=STEPS, warmup_steps=1, **flags
  )
  want = optimizer_setup.make_optimizer(cfg)
  ours, theirs = _first_updates(got, params, grads), _first_updates(want, params, grads)
  jax.tree.map(np.testing.assert_array_equal, ours, theirs)
  # and it is the recipe's optimizer, not the paper's AdamW, unless the paper is asked for
  adam = optimizer_setup.make_optimizer(dataclasses.replace(cfg, optimizer='adamw'))
  differs = jax.tree.leaves(
    jax.tree.map(
      lambda a, b: not np.allclose(a, b),
      ours['layers'],
      _first_updates(adam, params, grads)['layers'],
    )
  )
  assert any(differs) == (flags.get('compensation') != 'none')


def test_the_papers_method_is_explicit():
  run = recipe('ouroboros', 2, BATCH, platform='cpu', compensation='none', optimizer='adamw')
  assert run.config.resolved_optimizer() == 'adamw'
  assert run.schedule.compensation == Compensation() and not run.schedule.compensation.active
  assert run.schedule.resolved_flow == 'batch' and run.schedule.num_microbatches == 1
  assert run.schedule == ResolvedSchedule(
    name='ouroboros',
    num_stages=2,
    compensation=Compensation(),
    microbatches=1,
    chunks=1,
    flow='batch',
    stash_policy='nothing',
  )


@pytest.mark.parametrize('platform', ['cpu', 'gpu', 'tpu'])
@pytest.mark.parametrize(
  'stages, fields',
  [
    (2, {}),
    (4, {'forward': 'pipelined'}),
    (2, {'stash': 'replay'}),
    (2, {'data_parallel': 2}),
    (1, {}),
    (2, {'flow': 'batch'}),
  ],
)
def test_a_bare_config_resolves_to_the_recipes_schedule_field_by_field(stages, fields, platform):
  """ScheduleConfig's `auto`s (compensation, flow, micro-batches) resolve as the CLI resolves
  them: `resolve`, which `build_schedule` calls with the batch it is given."""
  bare = ScheduleConfig(name='ouroboros', num_stages=stages, **fields)
  want = recipe('ouroboros', stages, BATCH, platform=platform, **fields).schedule
  assert bare.resolve(platform, BATCH) == want
  if stages > 1:  # never the paper's method by accident
    assert bare.resolved_compensation.active and want.compensation != Compensation()


@pytest.mark.parametrize(
  'name, stages, fields',
  [
    ('ouroboros', 2, {}),
    ('ouroboros', 2, {'forward': 'pipelined', 'stash': 'replay', 'data_parallel': 2}),
    ('ouroboros', 2, {'compensation': 'none', 'clip_norm': 0.0}),
    ('interleaved', 2, {}),
    ('zb_h1', 2, {'microbatches': 8, 'stash_policy': 'dots'}),
    ('data_parallel', 1, {'data_parallel': 2}),
  ],
)
def test_one_resolution_leaves_no_auto_and_the_cli_recipe_and_builder_agree(name, stages, fields):
  """`ScheduleConfig.resolve` writes out every default (no 'auto', no None), resolves a resolved
  record to itself, and the CLI (`TrainConfig.schedule_config`), `recipe` and `build_schedule`
  (`Schedule.settings`) give equal resolved records for the same settings."""
  from ouroboros_jax import build_schedule

  from helpers import adam, tiny_transformer

  flags = {'schedule': name, 'stages': stages, 'batch_size': BATCH, **fields}
  cli = field_flags.override(presets.get_preset('tiny'), {**flags, 'num_layers': 4})
  cli.validate()
  run = cli.schedule_config('cpu')
  values = {f.name: getattr(run, f.name) for f in dataclasses.fields(run)}
  assert isinstance(run, ResolvedSchedule) and isinstance(run.compensation, Compensation)
  assert not [k for k, v in values.items() if v is None or v == 'auto'], values
  assert run.resolve('tpu', 3) is run  # idempotent: resolved once
  assert ScheduleConfig(**values).resolve('cpu', BATCH) == run  # its own spelling: the same
  del flags['batch_size']
  given = {k: v for k, v in flags.items() if k not in ('schedule', 'stages')}
  assert recipe(name, stages, BATCH, platform='cpu', **given).schedule == run
  # build_schedule resolves the bare config (the flags' spelling) the same way
  bare = dataclasses.replace(cli.schedule, seed=cli.seed, compensation=cli.resolved_compensation())
  assert bare != run and not isinstance(bare, ResolvedSchedule)
  model, _ = tiny_transformer(run.stage_groups)
  assert build_schedule(bare, model, adam()).settings(BATCH) == run


def test_building_a_bare_config_runs_the_recipes_schedule():
  """build_schedule on `ScheduleConfig(name='ouroboros', num_stages=2)` takes the micro-batches
  from the batch `init` sees: the same ring, step for step, as the recipe's resolved settings
  (compensations, streamed flow, M = 2 on the CPU), and not the paper's method."""
  from ouroboros_jax import build_schedule

  from helpers import adam, assert_trees_equal, random_batches, run_schedule, tiny_transformer

  model, params = tiny_transformer(2)
  batches = random_batches(5, seed=7)
  want = recipe('ouroboros', 2, len(batches[0]['inputs']), platform='cpu').schedule
  assert want.num_microbatches == 2 and want.resolved_flow == 'stream'
  bare, _ = run_schedule(
    ScheduleConfig(name='ouroboros', num_stages=2), model, adam(), params, batches
  )
  resolved, _ = run_schedule(want, model, adam(), params, batches)
  assert_trees_equal(bare, resolved)  # parameters, optimizer state and ring buffers alike
  paper = ScheduleConfig(name='ouroboros', num_stages=2, compensation=Compensation())
  ring = build_schedule(paper, model, adam()).init(params, batches[0]).ring
  assert jax.tree.structure(ring) == jax.tree.structure(bare.ring)
  assert jax.tree.leaves(ring['stash'])[0].shape != jax.tree.leaves(bare.ring['stash'])[0].shape


def test_platform_none_is_jaxs_backend_and_the_names_are_exported():
  assert ouroboros_jax.recipe is recipe and 'recipe' in ouroboros_jax.__all__
  run = recipe('ouroboros', 2, BATCH, steps=STEPS)
  assert (
    run.schedule
    == recipe('ouroboros', 2, BATCH, steps=STEPS, platform=jax.default_backend()).schedule
  )


def test_flags_outside_the_schedule_and_optimizer_are_refused_in_one_line():
  with pytest.raises(ConfigError, match='microbatches'):
    recipe('ouroboros', 2, microbatch=4)
  with pytest.raises(ConfigError, match='d_model'):
    recipe('ouroboros', 2, d_model=64)
  with pytest.raises(ConfigError, match='compensation'):
    recipe('ouroboros', 2, compensation='nonsense')
  with pytest.raises(ConfigError, match='compensat'):
    recipe('gpipe', 2, compensation='predict')


def test_a_deep_ring_needs_no_deep_preset():
  """The preset's model (2 layers) is not the user's: 8 stages resolve."""
  run = recipe('ouroboros', 8, 64, platform='gpu')
  assert run.schedule.num_stages == 8 and run.schedule.num_microbatches == 8


RESOLVED_CASES = [
  dict(schedule='ouroboros', stages=2),
  dict(schedule='ouroboros', stages=2, stash='replay', forward='pipelined'),
  dict(schedule='ouroboros', stages=2, compensation='none'),
  dict(schedule='gpipe', stages=2),
  dict(schedule='backprop'),
  dict(schedule='backprop', layer_unroll=2),
  dict(preset='gpt2-small', schedule='ouroboros', stages=4, dtype='bfloat16'),
]


@pytest.mark.parametrize('platform', ['cpu', 'gpu', 'tpu'])
@pytest.mark.parametrize('flags', RESOLVED_CASES, ids=lambda f: '-'.join(map(str, f.values())))
def test_the_resolved_run_spells_out_every_auto_once(flags, platform):
  """`TrainConfig.resolved` (what config.json stores and a resume compares) has no `auto` left,
  runs the same schedule and optimizer as the config it came from, and is its own resolution."""
  flags = dict(flags)
  cfg = field_flags.override(presets.get_preset(flags.pop('preset', 'tiny')), flags)
  run = cfg.resolved(platform)
  run.validate()
  assert run.resolved(platform) == run
  assert run.schedule_config(platform) == cfg.schedule_config(platform)
  assert run.resolved_optimizer() == cfg.resolved_optimizer()
  assert run.resolved_muon_learning_rate() == cfg.resolved_muon_learning_rate()
  assert run.resolved_compensation() == cfg.resolved_compensation()
  autos = {name: v for name, v in config.flat(run).items() if v == 'auto'}
  if cfg.schedule.name != 'ouroboros':
    assert autos.pop('flow') == 'auto'  # no flow outside Ouroboros: the field stays unset
  if cfg.schedule.stash == 'replay':
    assert autos.pop('stash_policy') == 'auto'  # replay keeps the input: no policy, unset
  assert autos == {}, autos
  assert run.model.attention == cfg.model.attention_kind(platform)
  # The layer scan: unrolled on GPU, one layer an iteration elsewhere, unless the flag says.
  assert run.model.layer_unroll == (
    cfg.model.layer_unroll if cfg.model.layer_unroll is not None else 0 if platform == 'gpu' else 1
  )


def test_the_recipes_config_is_the_run_the_cli_stores():
  """recipe(...).config is what `ouroboros train` writes to config.json for the same flags."""
  run = recipe('ouroboros', 2, batch_size=BATCH, steps=STEPS, platform='gpu')
  cli = cli_config(schedule='ouroboros', stages=2, batch_size=BATCH, steps=STEPS)
  assert run.config == cli.resolved('gpu')
  assert run.schedule == run.config.schedule_config('gpu')
