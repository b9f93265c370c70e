"""`ouroboros plan`: every setting's compiled memory and predicted step time, the fastest that
fits marked (here on simulated CPU devices; the TPU topologies compile as in test_compile.py)."""

from __future__ import annotations

import dataclasses
import json
import math

import forked_cli
import pytest

from ouroboros_jax.errors import ConfigError
from ouroboros_jax.perf import plan
from ouroboros_jax.perf import settings as settings_lib
from ouroboros_jax.schedules import ResolvedSchedule, ScheduleConfig
from ouroboros_jax.schedules.compensation import Compensation

from helpers import assert_one_line_error, run_cli

SMALL = ('--d-model', 32, '--num-layers', 2, '--seq-len', 32, '--batch-size', 8)


def _plan(*flags):
  """`ouroboros plan` of SMALL on 2 simulated CPU devices with M = 2: (the run, its JSON)."""
  result = run_cli(
    'plan', *SMALL, '--cpu-devices', 2, '--try-microbatches', '2', *flags, '--json', timeout=300
  )
  assert result.returncode == 0, result.stderr[-2000:]
  out = json.loads(result.stdout)
  for r in out['rows']:
    assert r['peak_bytes'] > 0 and r['step_s'] > 0, r
    assert r['devices'] == (1 if r['schedule'] == 'backprop' else 2)
  return result, out


def test_plan_lists_every_setting_with_memory_and_step_time(tmp_path):
  """Every schedule x policy x stash, and (--try-stash-memory) each Ouroboros setting twice, the
  second with its stash out of the device's ring, in the host's memory. One forward
  (--try-forward): the other's rows compile the same way (4 compiles fewer for the suite)."""
  result, out = _plan(
    '--try-schedules', 'backprop,1f1b,ouroboros', '--try-stash', 'graph/nothing,graph/all',
    '--try-stash-memory', 'device,pinned_host', '--try-forward', 'locked',
  )  # fmt: skip
  labels = [r['label'] for r in out['rows']]
  assert labels == [
    'backprop',
    'backprop keep=nothing',  # --try-policy all,nothing: every schedule may recompute
    '1f1b M=2',
    '1f1b M=2 keep=nothing',
    *[
      f'ouroboros M=2 {forward}/{stash}{host}'
      for forward in ('locked',)
      for stash in ('graph', 'graph/all')  # the default policy (nothing) goes unnamed
      for host in ('', ' host')
    ],
  ]
  rows = {r['label']: r for r in out['rows']}
  assert rows['ouroboros M=2 locked/graph/all']['stash'] == 'graph/all'  # compile's report
  assert rows['ouroboros M=2 locked/graph/all']['stash_policy'] == 'all'  # train's flag
  assert rows['ouroboros M=2 locked/graph/all']['microbatches'] == 2
  # Keeping nothing of the forward holds less than keeping all of it.
  nothing, everything = (rows[f'ouroboros M=2 locked/{s}'] for s in ('graph', 'graph/all'))
  assert nothing['ring_bytes'] < everything['ring_bytes']
  in_host = rows['ouroboros M=2 locked/graph/all host']
  assert in_host['host_ring_bytes'] > 0 and in_host['ring_bytes'] < everything['ring_bytes']
  # Recomputing costs one more forward in the simulator and keeps less in the compiler.
  assert [rows[f'1f1b M=2{k}']['recompute'] for k in ('', ' keep=nothing')] == [0.0, 1.0]
  assert rows['1f1b M=2 keep=nothing']['step_s'] > rows['1f1b M=2']['step_s']
  assert rows['backprop keep=nothing']['temp_bytes'] < rows['backprop']['temp_bytes']
  # CPU devices do not say how much memory they have: the fastest is the fastest overall.
  assert out['fastest'] == min(out['rows'], key=lambda r: r['step_s'])['label']
  best = out['fastest_by_schedule']
  assert set(best) == {'backprop', '1f1b', 'ouroboros'}
  assert best['1f1b'] == '1f1b M=2'  # nothing to fit on CPU devices: no recompute is faster

  table = plan.format_plan(out)
  assert f'* fastest that fits: {out["fastest"]}' in table
  assert sum(line.startswith('* ') for line in table.splitlines()) == 2  # the row and the line
  assert sum(line.startswith('+ ') for line in table.splitlines()) == 2  # the other two
  saved = tmp_path / 'plan.json'
  saved.write_text(result.stdout)
  rendered = run_cli('plan', '--render', saved)
  assert rendered.returncode == 0 and rendered.stdout.strip() == table, rendered.stderr


def test_plan_marks_the_fastest_setting_that_fits():
  row = lambda label, fits, step: {'label': label, 'schedule': 'x', 'fits': fits, 'step_s': step}
  rows = [row('a', True, 3.0), row('b', False, 1.0), row('c', True, 2.0)]
  result = {'topology': 'v5e:2x2', 'devices': 4, 'hardware': {'name': 'tpu-v5e'}, 'rows': rows}
  fitting = [r for r in rows if r['fits']]
  assert min(fitting, key=lambda r: r['step_s'])['label'] == 'c'
  assert 'fastest that fits: c' in plan.format_plan({**result, 'fastest': 'c'})
  assert 'no setting fits' in plan.format_plan({**result, 'fastest': None})


# Each line in a process of its own, forked from one that has imported the command (seven
# subprocesses before: 10 s of a 15-minute suite, most of it seven imports of JAX).
BAD_INPUT = [
  (('--try-stash', 'graph/most'), ('unknown stash setting', "'graph/most'", '--try-stash')),
  (('--try-schedules', 'pipedream'), ('unknown schedule', "'pipedream'", '--try-schedules')),
  (('--try-microbatches', '0'), ('--try-microbatches', 'positive integers')),
  (('--hardware', 'abacus'), ('unknown hardware', "'abacus'", '--hardware')),
  (('--try-stages', '3'), ('--try-stages 3', 'does not divide', 'choose divisors of')),
  (('--try-stash-memory', 'disk'), ('unknown stash memory', "'disk'", '--try-stash-memory')),
  (('--try-forward', 'sideways'), ('unknown forward', "'sideways'", '--try-forward')),
  (('--render', 'missing.json'), ('--render missing.json', 'not a saved plan', '--json')),
]


def test_plan_bad_input_is_one_line():
  runs = forked_cli.run_each(*(['plan', *SMALL, *flags] for flags, _ in BAD_INPUT))
  for result, (_, words) in zip(runs, BAD_INPUT, strict=True):
    assert_one_line_error(result, 2, *words)


def test_ouroboros_cuts_the_batch_on_accelerators_only():
  run = ScheduleConfig(name='ouroboros', compensation=Compensation(), num_stages=4, data_parallel=2)
  assert run.resolve('cpu', 32).num_microbatches == 1
  assert run.resolve('tpu', 32).num_microbatches == 8  # 16 rows per replica
  assert run.resolve('gpu', 12).num_microbatches == 2  # 6 rows: the largest divisor <= 8
  explicit = ScheduleConfig(name='ouroboros', num_stages=4, microbatches=2)
  assert explicit.resolve('tpu', 32).num_microbatches == 2
  pipeline = ScheduleConfig(name='1f1b', num_stages=4)
  assert pipeline.resolve('tpu', 32) == ResolvedSchedule(
    name='1f1b',
    num_stages=4,
    microbatches=4,
    chunks=1,
    stash_policy='all',
    flow='batch',
    compensation=Compensation(),
  )
  assert pipeline.resolve('cpu', 32) == pipeline.resolve('tpu', 32)  # any platform
  with pytest.raises(ConfigError, match='unknown stash setting'):
    settings_lib.settings(4, settings_lib.Tries(stashes=('everything',)))
  with pytest.raises(ConfigError, match="unknown stash policy 'some'; choose --try-policy from"):
    settings_lib.settings(4, settings_lib.Tries(policies=('some',)))


def test_the_recipe_streams_with_enough_micro_batches_for_gaps_of_one_update():
  from ouroboros_jax import cli_parsers
  from ouroboros_jax.schedules import delays

  def run(*flags, platform='cpu'):
    cfg = cli_parsers.config_from_args(cli_parsers.make_parser().parse_args(['train', *flags]))
    cfg.validate()
    got = cfg.schedule_config(platform)
    return got.resolved_flow, got.num_microbatches

  g2 = ('--schedule', 'ouroboros', '--stages', '2')
  assert run(*g2) == ('stream', 2)  # the recipe: lags 2, 1 micro-batches
  assert run(*g2, '--forward', 'pipelined') == ('stream', 4)  # 2G
  assert run(*g2, platform='tpu') == ('stream', 8)  # the accelerator's own default reaches it
  assert run(*g2, '--forward', 'pipelined', '--batch-size', '6') == ('stream', 6)  # no 4 in 6
  assert run(*g2, '--microbatches', '1') == ('stream', 1)  # as asked (M = 1: one batch, bitwise)
  assert run(*g2, '--compensation', 'none') == ('batch', 1)  # the paper's method, unchanged
  assert run(*g2, '--compensation', 'none', platform='tpu') == ('batch', 8)
  assert run(*g2, '--flow', 'batch') == ('batch', 1)
  g4 = ScheduleConfig(name='ouroboros', num_stages=4, flow='stream').resolve('cpu', 32)
  assert delays.version_gaps(4, 'locked', g4.num_microbatches, 'stream') == (1, [1, 1, 1, 1])
  assert delays.version_gaps(4, 'locked', 1, 'stream') == (4, [4, 3, 2, 1])
  assert ScheduleConfig(name='1f1b', num_stages=4).resolved_flow == 'batch'


def test_stages_that_leave_devices_over_run_data_replicas():
  from ouroboros_jax.training import field_flags, presets

  tries = settings_lib.Tries((8,), ('graph/nothing',), ('all',), stages=(2, 4))
  labels = [s.label for s in settings_lib.settings(4, tries)]
  assert labels[:4] == [
    'backprop',
    'data_parallel',
    'data_parallel shard_update',
    'data_parallel fsdp',
  ]
  assert 'model_parallel G=2xR=2 shard_update' in labels
  assert 'ouroboros G=2xR=2 M=8 locked/graph' in labels
  assert 'ouroboros M=8 locked/graph' in labels  # G = 4: one ring of every device
  hybrid = ScheduleConfig(name='1f1b', num_stages=2, data_parallel=2, microbatches=4)
  flags = field_flags.train_flags(hybrid)
  assert {k: flags[k] for k in ('schedule', 'stages', 'data_parallel', 'microbatches')} == dict(
    schedule='1f1b', stages=2, data_parallel=2, microbatches=4
  )
  cfg = presets.get_preset('gpt2-small')
  ring = ScheduleConfig(name='1f1b', num_stages=2, microbatches=4)
  # Two replicas each step on half the batch: faster than one ring on all of it.
  assert (
    0
    < plan.predicted_step_s(cfg, hybrid.resolve('tpu'), plan.TPU_V5E)
    < plan.predicted_step_s(cfg, ring.resolve('tpu'), plan.TPU_V5E)
  )


def test_the_prediction_prices_muons_update_on_the_layers_a_chip_updates():
  """Muon's orthogonalisation (the step with Muon less the step with AdamW, whose update is
  elementwise) costs a replicated data-parallel chip every layer's, an FSDP or --shard-update
  chip 1/D of them, and a pipeline stage its own layers'."""
  from ouroboros_jax import costs
  from ouroboros_jax.training import field_flags, presets

  muon = presets.get_preset('gpt2-small')
  adamw = field_flags.override(muon, {'optimizer': 'adamw'})
  assert muon.resolved_optimizer() == 'muon'
  m = muon.model
  layer_s = costs.layer_update_flops('muon', m.d_model, m.d_ff) / plan.TPU_V5E.flops_per_s
  extra = lambda s: (
    plan.predicted_step_s(muon, s, plan.TPU_V5E) - plan.predicted_step_s(adamw, s, plan.TPU_V5E)
  )
  replicated = ScheduleConfig(name='data_parallel', data_parallel=4).resolve('tpu')
  assert extra(replicated) == pytest.approx(m.num_layers * layer_s, rel=1e-6)
  for sharded in ({'fsdp': True}, {'shard_update': True}):
    assert extra(dataclasses.replace(replicated, **sharded)) == pytest.approx(
      m.num_layers / 4 * layer_s, rel=1e-6
    )
  ring = ScheduleConfig(name='ouroboros', num_stages=4, flow='stream').resolve('tpu', 32)
  assert m.num_layers / 4 * layer_s <= extra(ring) <= m.num_layers / 2 * layer_s


def test_fsdp_is_predicted_as_data_parallel_plus_what_its_gathers_leave_exposed():
  """On free links and memory FSDP's step is data_parallel's (both compute B / D rows, the
  all-reduce costs nothing, and so does AdamW's elementwise update; Muon's, which FSDP shards,
  is the test above); on v5e's links it pays what its gathers and reductions do not hide, more
  than nothing and less than all of them and its share of the update."""
  from ouroboros_jax import costs
  from ouroboros_jax.perf import cost_model
  from ouroboros_jax.training import field_flags, presets

  cfg = field_flags.override(presets.get_preset('gpt2-small'), {'optimizer': 'adamw'})
  plain = ScheduleConfig(name='data_parallel', data_parallel=4).resolve('tpu')
  fsdp = dataclasses.replace(plain, fsdp=True)
  free = cost_model.Hardware(
    'free', flops_per_s=plan.TPU_V5E.flops_per_s, bandwidth=math.inf, latency=0.0
  )
  assert plan.predicted_step_s(cfg, fsdp, free) == pytest.approx(
    plan.predicted_step_s(cfg, plain, free), rel=1e-9
  )
  compute = plan.predicted_step_s(cfg, fsdp, free)
  m = cfg.model
  params = m.num_layers * (4 * m.d_model**2 + 2 * m.d_model * m.d_ff) + m.padded_vocab * m.d_model
  params *= 2 if m.dtype == 'bfloat16' else 4
  # every weight gathered twice and its gradient reduced once, 3/4 of it each time, none hidden
  latencies = 3 * (m.num_layers + 1) * 3 * plan.TPU_V5E.latency
  every_collective = latencies + 3 * 3 / 4 * params / plan.TPU_V5E.collective_bandwidth
  weights = params / (2 if m.dtype == 'bfloat16' else 4)  # float32 weights and state, 1/4 a chip
  update = costs.UPDATE_VALUES_PER_PARAM * 4 * weights / 4 / plan.TPU_V5E.memory_bandwidth
  step = plan.predicted_step_s(cfg, fsdp, plan.TPU_V5E)
  assert compute < step < compute + every_collective + update


def test_a_setting_is_the_schedule_config_its_train_flags_give():
  """plan's settings are ScheduleConfigs built on the run's own: what the tries choose replaces
  its fields (--try-stash graph/POLICY is the stash and its policy), the rest (the clip) stays;
  `train_flags` is `field_flags.override`'s inverse for a schedule."""
  from ouroboros_jax.training import field_flags, presets

  cfg = field_flags.override(presets.get_preset('tiny'), {'clip_norm': 0.5})
  tries = settings_lib.Tries((4,), ('graph/all', 'replay'), schedules=('ouroboros',))
  for setting in settings_lib.settings(2, tries, cfg.schedule):
    assert setting.clip_norm == 0.5 and setting.num_stages == 2 and setting.microbatches == 4
    assert (setting.stash, setting.stash_policy) in (('graph', 'all'), ('replay', 'auto'))
    run = field_flags.override(cfg, field_flags.train_flags(setting))
    assert run.schedule == setting
    run.validate()


def test_a_model_with_fewer_layers_than_devices_plans_fewer_stages_with_data_replicas():
  """Issue 42, item 10: on 4 devices a 2-layer model gets G = 2 stages x 2 replicas, not 4
  stages (each of them an error); the settings its layers still cannot take (interleaved and
  zb_v cut 2 x 2 chunks = 4 groups) are skipped before compiling, for one reason, said once."""
  from ouroboros_jax.training import field_flags, presets

  assert [settings_lib.default_stages(4, n) for n in (1, 2, 3, 4, 12)] == [1, 2, 2, 4, 4]
  assert settings_lib.default_stages(6, 4) == 3 and settings_lib.default_stages(8, None) == 8
  cfg = presets.get_preset('tiny')  # 2 layers
  assert cfg.model.num_layers == 2
  tried = settings_lib.settings(4, settings_lib.Tries(), cfg.schedule, cfg.model.num_layers)
  # every schedule at each policy (data_parallel at each sharding), Ouroboros at each stash:
  # 10 x 2 + 2 x 3, now at G = 2; and twice again with each stage's optimizer state, then all
  # its state, split over its 2 replicas (--shard-update, --fsdp): 2 x (6 x 2 + 2 x 3)
  assert len(tried) == 26 + 2 * 18
  staged = [s for s in tried if s.name not in ('backprop', 'data_parallel')]
  assert sum(s.fsdp for s in staged) == sum(s.shard_update for s in staged) == 18
  staged = [s for s in tried if s.name not in ('backprop', 'data_parallel')]
  assert {(s.num_stages, s.data_parallel) for s in staged} == {(2, 2)}
  reasons = {}
  for s in tried:
    reason = plan.applies(field_flags.override(cfg, field_flags.train_flags(s)))
    if reason is not None:
      reasons.setdefault(reason, []).append(s.name)
  assert reasons == {
    "2 stages x 2 chunks = 4 groups, more than the model's 2 layers": (
      ['interleaved'] * 2 + ['zb_v'] * 2
    )
    * 3
  }
  # --try-stages 4 asks for the ring of every device: each stage setting is skipped, saying why.
  four = settings_lib.settings(
    4, settings_lib.Tries(stages=(4,)), cfg.schedule, cfg.model.num_layers
  )
  skipped = [
    s.name
    for s in four
    if plan.applies(field_flags.override(cfg, field_flags.train_flags(s))) is not None
  ]
  assert len(skipped) == 18 and 'backprop' not in skipped


def test_the_runs_ouroboros_settings_go_to_the_ouroboros_rows_alone():
  base = ScheduleConfig(flow='stream', tied_grad='mean', sync_warmup_steps=5, chunks=3)
  tries = settings_lib.Tries(
    (4,), ('graph/nothing',), schedules=('1f1b', 'interleaved', 'ouroboros')
  )
  for s in settings_lib.settings(4, tries, base):
    ring = s.name == 'ouroboros'
    assert (s.flow, s.tied_grad, s.sync_warmup_steps) == (
      ('stream', 'mean', 5) if ring else ('auto', 'sum', 0)
    ), s
    assert s.chunks == (3 if s.name == 'interleaved' else None), s


def test_skipped_settings_are_one_line_per_reason_and_no_error_rows():
  row = lambda label, step: {'label': label, 'schedule': label, 'fits': None, 'step_s': step}
  result = {
    'topology': 'v5e:2x2',
    'devices': 4,
    'hardware': {'name': 'tpu-v5e'},
    'stages': [2],
    'rows': [row('backprop', 2.0), row('1f1b G=2xR=2 M=8', 1.0)],
    'skipped': [
      {'label': 'interleaved G=2xR=2 M=8', 'reason': 'too many groups'},
      {'label': 'zb_v G=2xR=2 M=8', 'reason': 'too many groups'},
    ],
    'fastest': '1f1b G=2xR=2 M=8',
  }
  table = plan.format_plan(result).splitlines()
  assert not [line for line in table if 'error' in line]
  skipped = [line for line in table if 'skipped' in line]
  assert skipped == [
    '  skipped interleaved G=2xR=2 M=8, zb_v G=2xR=2 M=8: too many groups; the run cannot take '
    'them.'
  ]
  assert '  stage schedules at G = 2 stages x 2 data replicas of the 4 devices' in '\n'.join(table)
  # A plan saved before settings were skipped renders as it did.
  old = {k: v for k, v in result.items() if k not in ('stages', 'skipped')}
  assert not [line for line in plan.format_plan(old).splitlines() if 'skipped' in line]


def test_plan_compiles_only_the_settings_the_model_can_take():
  """In-process on the test session's CPU devices (conftest): a 2-layer model, so G = 2."""
  import jax

  from ouroboros_jax.training import field_flags, presets

  cfg = field_flags.override(
    presets.get_preset('tiny'), dict(zip(('d_model', 'seq_len', 'batch_size'), (32, 32, 8)))
  )
  tries = settings_lib.Tries(
    (2,),
    policies=('all',),
    schedules=('backprop', 'interleaved', 'zb_v'),
    shardings=('replicated',),
  )
  out = plan.plan(cfg, None, tries)
  assert [r['label'] for r in out['rows']] == ['backprop']
  assert not [r for r in out['rows'] if 'error' in r]
  assert [s['label'].split()[0] for s in out['skipped']] == ['interleaved', 'zb_v']
  assert out['stages'] == [2] and out['devices'] == len(jax.devices())


@pytest.mark.parametrize(
  'row, words',
  [
    ({'label': None, 'fits': True}, 'row 0 has no label'),
    (7, 'row 0 is int, not an object'),
    ({'label': 'a', 'fits': 'yes'}, "row 0 \\(a\\): fits is 'yes'"),
    ({'label': 'a', 'fits': True, 'peak_bytes': 'big'}, "row 0 \\(a\\): peak_bytes is 'big'"),
  ],
)
def test_a_hand_edited_plan_is_refused_in_one_line(tmp_path, row, words):
  path = tmp_path / 'plan.json'
  path.write_text(json.dumps({'rows': [row], 'fastest': None}))
  with pytest.raises(ConfigError, match=rf'^--render {path}: not a saved plan \({words}\)'):
    plan.load(str(path))


def test_every_factorisation_is_tried_and_a_count_with_none_is_refused_in_one_line():
  """--try-stages all: every G >= 2 dividing the devices that the layers fill, each with the
  other devices as data replicas; none (one device, or a one-layer model on a prime count) is
  one ConfigError naming the way out."""
  assert settings_lib.factorisations(8) == (2, 4, 8)
  assert settings_lib.factorisations(12, num_layers=4) == (2, 3, 4)
  tries = settings_lib.Tries(
    (4,), ('graph/nothing',), ('all',), ('ouroboros',), stages='all', shardings=('replicated',)
  )
  labels = [s.label for s in settings_lib.settings(8, tries, num_layers=24)]
  assert [label.split(' M=')[0] for label in labels[::2]] == [
    'ouroboros G=2xR=4',
    'ouroboros G=4xR=2',
    'ouroboros',
  ]
  with pytest.raises(ConfigError, match='7 devices cannot be cut into stages') as e:
    settings_lib.factorisations(7, num_layers=6)
  assert '\n' not in str(e.value)


def test_replicas_across_slices_pay_the_data_centre_network():
  """The same layout on 2 slices of v5e: FSDP's gathers and a hybrid's all-reduce cross the
  data-centre network (3.125 GB/s a chip against the ring's 100), so its step is slower; a
  hybrid whose replicas cannot spread over the slices is refused."""
  from ouroboros_jax.training import presets

  cfg = field_flags_override(presets.get_preset('gpt2-small'), batch_size=64)
  for setting in (
    ScheduleConfig(name='data_parallel', data_parallel=16, fsdp=True),
    ScheduleConfig(name='1f1b', num_stages=4, data_parallel=4, microbatches=4),
  ):
    resolved = setting.resolve('tpu', 64)
    one = plan.predicted_step_s(cfg, resolved, plan.TPU_V5E)
    two = plan.predicted_step_s(cfg, resolved, plan.TPU_V5E, slices=2)
    assert two > one * 1.01
  hybrid = ScheduleConfig(name='1f1b', num_stages=4, data_parallel=2, microbatches=4)
  with pytest.raises(ConfigError, match='do not spread over 4 slices'):
    plan.predicted_step_s(cfg, hybrid.resolve('tpu', 64), plan.TPU_V5E, slices=4)


def field_flags_override(cfg, **fields):
  from ouroboros_jax.training import field_flags

  return field_flags.override(cfg, fields)


def test_every_saved_plan_steps_as_todays_simulator_predicts():
  """The saved plans of docs/results (experiments/plan_tables.py `saved_plans`) hold the step
  times this simulator predicts for their rows: a change to the simulator is followed by
  `plan_tables.py --repredict`, which moves them without a compile. Checked on every row of the
  smallest plan and the rows with data replicas of all (the deep pipelines take ~50 s to
  simulate again). And the prediction reads the run: with bfloat16 master weights the replicas
  reduce half the gradient bytes, so replicated data parallelism steps faster (FSDP's and the
  stages' reductions may hide behind compute), and every optimizer update moves half the bytes,
  so no row steps slower."""
  import copy

  from ouroboros_jax import cli_parsers
  from ouroboros_jax.training import field_flags

  from helpers import experiment

  steps = lambda result: {r['label']: r['step_s'] for r in result['rows']}
  tables = experiment('plan_tables')
  for path, flags in tables.saved_plans().items():
    saved = plan.load(path)
    if path != tables.SHAPES['gpt2-small'][1]:
      saved['rows'] = [r for r in saved['rows'] if r['data_parallel'] > 1]
    args = cli_parsers.make_parser().parse_args(['plan', *flags.split()])
    cfg = cli_parsers.config_from_args(args)
    again = plan.repredict(copy.deepcopy(saved), cfg)
    assert steps(again) == pytest.approx(steps(saved), rel=1e-9), path
    narrow = field_flags.override(cfg, {'param_dtype': 'bfloat16'})
    for row, was in zip(plan.repredict(copy.deepcopy(saved), narrow)['rows'], saved['rows']):
      if was['step_s'] is None:
        assert row['step_s'] is None, (path, row['label'])
      elif was['data_parallel'] == 1 or was.get('fsdp') or was['schedule'] != 'data_parallel':
        # the update's elementwise pass moves half the bytes; the reductions may hide
        assert row['step_s'] <= was['step_s'], (path, row['label'])
      else:  # the all-reduce after the backward
        assert row['step_s'] < was['step_s'], (path, row['label'])
