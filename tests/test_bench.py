"""`ouroboros bench` end to end on 2 real processes (tiny model: a smoke run, not a timing)."""

from __future__ import annotations

import csv
import dataclasses
import io
import re
import statistics

from ouroboros_jax.runtime import launch

TINY = [
  '--d-model',
  '32',
  '--num-heads',
  '2',
  '--num-layers',
  '2',
  '--d-ff',
  '64',
  '--seq-len',
  '16',
  '--batch-size',
  '4',
]


def test_bench_names_its_own_flags_and_refuses_an_empty_only(tmp_path):
  import pytest

  from ouroboros_jax.errors import ConfigError
  from ouroboros_jax.models.model import ModelConfig
  from ouroboros_jax.perf import bench

  model = ModelConfig(d_model=32, num_heads=2, num_layers=2, d_ff=64, seq_len=16)
  with pytest.raises(
    ConfigError, match=r'^--bench-steps must be >= 1 \(timed steps per setting\), got 0'
  ):
    bench.run(model, bench.BenchConfig(batch_size=4, stages=2, out_dir=str(tmp_path), steps=0))
  with pytest.raises(ConfigError, match=r'^--warmup must be >= 0'):
    bench.run(model, bench.BenchConfig(batch_size=4, stages=2, out_dir=str(tmp_path), warmup=-1))
  from ouroboros_jax.perf.settings import Tries

  pick = lambda only, layers=2, batch=None, tries=Tries(): bench.bench_settings(
    2, tries, num_layers=layers, batch_size=batch, only=only
  )
  for only in ('', ' , '):
    with pytest.raises(ConfigError, match=r'names no setting; give comma-separated labels or '):
      pick(only)
  # A label picks that setting alone; a prefix of labels picks them all.
  assert [s.label for s in pick('backprop')] == ['backprop']
  assert [s.label for s in pick('gpipe')] == ['gpipe M=8', 'gpipe M=8 keep=nothing']
  # --only's own order (a bench cut short keeps the rows named first), and batch sizes that
  # cannot be cut refused before anything is measured: M = 4 does not divide 2 rows.
  chosen = pick('zb_v M=8,backprop', layers=4)
  assert [s.label for s in chosen] == ['zb_v M=8', 'backprop']
  four = Tries(microbatches=(4,), flows=('stream',))
  with pytest.raises(ConfigError, match=r'^--batch-size 2 cannot be cut .* gpipe M=4'):
    pick('backprop,gpipe M=4', batch=2, tries=four)
  # Ouroboros' M resolves from the batch, as train's does: M = 4 on 2 rows is 2
  chosen = pick('backprop,ouroboros M=4 stream pipelined/graph', batch=2, tries=four)
  assert [s.label for s in chosen] == ['backprop', 'ouroboros M=2 stream pipelined/graph']
  fitting = pick(None, batch=2, tries=four)
  assert fitting and all(2 % bench.micro_size(s) == 0 for s in fitting)
  assert len(fitting) < len(pick(None, tries=four))
  # A name that matches nothing is named, not ignored.
  with pytest.raises(ConfigError, match=r"^--only 'bogus' matches no setting; labels are: "):
    pick('backprop,bogus')


def test_bench_times_the_settings_plan_tries():
  """One list of settings for `bench` and `plan` (`settings.settings` of one `Tries`, its defaults
  stated once): bench's at G = --stages are plan's at G = 2 on 2 devices (the two-chunk pipelines
  where the model has their 2G layers), each resolved, no compensation unless asked (the paper's
  method), the labels bench.csv and --only use from ScheduleConfig.label."""
  from ouroboros_jax.perf import bench
  from ouroboros_jax.perf import settings as settings_lib
  from ouroboros_jax.schedules.compensation import Compensation
  from ouroboros_jax.schedules.config import ResolvedSchedule, ScheduleConfig

  chosen = bench.bench_settings(2, num_layers=4)
  planned = settings_lib.settings(2, settings_lib.Tries(stages=(2,)))
  assert [s.label for s in chosen] == [s.label for s in planned]
  assert [s.label for s in chosen][:4] == [
    'backprop',
    'backprop keep=nothing',
    'data_parallel',
    'data_parallel keep=nothing',
  ]
  assert 'ouroboros M=8 pipelined/replay' in [s.label for s in chosen]
  short = [s.label for s in bench.bench_settings(2, num_layers=2)]
  assert 'zb_v M=8' not in short and 'zb_h1 M=8' in short  # 2 layers: no 2 x 2 chunks
  assert [bench.num_devices(s) for s in chosen[::2][:3]] == [1, 2, 2]
  for s in chosen:
    assert isinstance(s, ResolvedSchedule)
    assert s.compensation == Compensation(), s.label
  # The compensation reaches the Ouroboros settings (the replay stash without DC-ASGD).
  recipe = Compensation(predict=True, dc_lambda=1.0)
  base = ScheduleConfig(compensation=recipe)
  ring = {s.label: s for s in bench.bench_settings(2, base=base, num_layers=4)}
  assert ring['ouroboros M=8 stream locked/graph/all'].compensation == recipe
  assert ring['ouroboros M=8 stream locked/replay'].compensation == Compensation(predict=True)
  assert ring['gpipe M=8'].compensation == Compensation()
  assert ring['ouroboros M=8 stream locked/replay'].stash_label == 'replay'  # the input alone


def test_pieces_include_each_micro_batch_and_the_rows_carry_the_setting_s_own(tmp_path):
  """calibration.measure_pieces times every group on B / M rows for each M asked (an M that does
  not divide the batch is skipped); a row carries its own M's times and its ideal uses them."""
  import numpy as np
  import pytest

  from ouroboros_jax.models.model import ModelConfig
  from ouroboros_jax.perf import bench, calibration
  from ouroboros_jax.schedules import ScheduleConfig

  model = ModelConfig(d_model=32, num_heads=2, num_layers=2, d_ff=64, seq_len=16)
  config = bench.BenchConfig(batch_size=4, stages=2, out_dir=str(tmp_path))
  work = bench._workload(model, config)
  pieces = calibration.measure_pieces(work, repeats=1, microbatches=(2, 3, 4), micro_repeats=1)
  assert set(pieces['fwd_micro']) == set(pieces['bwd_micro']) == {'2', '4'}
  assert all(len(v) == 2 and min(v) > 0 for v in pieces['bwd_micro'].values())
  gpipe = ScheduleConfig(name='gpipe', num_stages=2, microbatches=4)
  assert bench.micro_size(gpipe) == 4
  assert bench.micro_size(ScheduleConfig(name='data_parallel', data_parallel=2)) == 2
  assert bench.micro_size(ScheduleConfig(name='ouroboros', num_stages=2)) == 1
  fake = {  # a micro-batch of a quarter of the batch costs 0.4 of it
    'fwd': [1.0, 1.0],
    'bwd': [2.0, 2.0],
    'fwd_micro': {'4': [0.4, 0.4]},
    'bwd_micro': {'4': [0.8, 0.8]},
    'head': 0.0,
    'update': [0.0, 0.0],
  }
  measured = {'step_time_s': 6.0, 'busy_s': 6.0, 'compile_s': 1.0, 'tokens_per_s': 1.0}
  row = bench._row(gpipe.resolve('cpu'), dict(measured, idle_fraction=0.2), fake, 0.0, 0.0)
  assert row['fwd_s_per_stage_micro'] == '0.4;0.4' and row['bwd_s_per_stage_micro'] == '0.8;0.8'
  # Sums of a few decimal constants: float64 rounding (pytest.approx rel 1e-6).
  assert row['ideal_s'] == pytest.approx(5 * 1.2)
  gpipe = ScheduleConfig(name='gpipe', num_stages=2, microbatches=2).resolve('cpu')
  row = bench._row(gpipe, dict(measured, idle_fraction=0.0), fake, 0, 0)
  assert row['fwd_s_per_stage_micro'] == '' and row['ideal_s'] == pytest.approx(3 * 1.5)
  assert np.isfinite(row['predicted_s'])


def test_a_zero_bubble_row_splits_its_backward_by_the_measured_input_grad_share(tmp_path):
  """measure_pieces times a split backward's B and W apart for each M asked; a zero-bubble row
  carries its M's share and is predicted with it (B longer than W: a longer lockstep step), a
  fused row carries none."""
  import pytest

  from ouroboros_jax.models.model import ModelConfig
  from ouroboros_jax.perf import bench, calibration
  from ouroboros_jax.schedules import ScheduleConfig

  model = ModelConfig(d_model=32, num_heads=2, num_layers=2, d_ff=64, seq_len=16)
  work = bench._workload(model, bench.BenchConfig(batch_size=4, stages=2, out_dir=str(tmp_path)))
  pieces = calibration.measure_pieces(
    work, repeats=1, microbatches=(4,), micro_repeats=1, split_microbatches=(4,)
  )
  assert set(pieces['input_grad_share']) == {'4'}
  assert 0 < pieces['input_grad_share']['4'] < 1
  fake = {
    'fwd': [1.0, 1.0],
    'bwd': [2.0, 2.0],
    'fwd_micro': {'4': [0.25, 0.25]},
    'bwd_micro': {'4': [0.5, 0.5]},
    'head': 0.0,
    'update': [0.0, 0.0],
  }
  measured = {'step_time_s': 1.0, 'busy_s': 1.0, 'compile_s': 1.0, 'tokens_per_s': 1.0}
  zb = ScheduleConfig(name='zb_h1', num_stages=2, microbatches=4).resolve('cpu')
  even = bench._row(zb, measured, fake, 0.0, 0.0)
  skewed = bench._row(zb, measured, dict(fake, input_grad_share={'4': 0.7}), 0.0, 0.0)
  assert (even['input_grad_share'], skewed['input_grad_share']) == ('', 0.7)
  assert (
    calibration.stage_costs(zb, dict(fake, input_grad_share={'4': 0.7}), 0, 0).input_grad_share
    == 0.7
  )
  assert skewed['predicted_s'] > even['predicted_s'] + 0.05
  one_f_one_b = ScheduleConfig(name='1f1b', num_stages=2, microbatches=4).resolve('cpu')
  fused = bench._row(one_f_one_b, measured, dict(fake, input_grad_share={'4': 0.7}), 0.0, 0.0)
  assert fused['input_grad_share'] == ''
  assert fused['predicted_s'] == pytest.approx(
    bench._row(one_f_one_b, measured, fake, 0, 0)['predicted_s']
  )


def test_two_process_bench_writes_every_row_with_its_ideal(tmp_path):
  out = io.StringIO()
  # A whole-batch setting and a stage setting (the ring's row on two processes is the device
  # check's, tests/test_device_check.py: here too it was 1/3 of a 44-s test).
  only = 'backprop,model_parallel'
  code = launch.launch(
    2,
    [
      'bench',
      '--stages',
      '2',
      *TINY,
      '--bench-steps',
      '3',
      '--warmup',
      '1',
      '--rounds',  # the settings interleaved, 2 steps then 1 each (the device check: one by one)
      '2',
      '--only',
      only,
      '--out',
      str(tmp_path),
    ],
    timeout_s=300,
    out=out,
  )
  log = out.getvalue()
  assert code == 0, log[-3000:]
  # The pieces are timed by process 0 alone and broadcast: both processes print the same ones
  # (the link times that follow them each process measures for itself).
  pieces = re.findall(r'\[p(\d)\] (pieces: .*), hop', log)
  assert sorted(p for p, _ in pieces) == ['0', '1'], log[-3000:]
  assert pieces[0][1] == pieces[1][1]
  # The collective's wait is one number for all: the largest any process measured, and the
  # rows use its median over the rounds.
  waits = dict(re.findall(r'\[p(\d)\] pieces, the median .*collective wait ([0-9.]+) s', log))
  assert sorted(waits) == ['0', '1'] and waits['0'] == waits['1'], log[-3000:]
  with open(tmp_path / 'bench.csv') as f:
    rows = {row['label']: row for row in csv.DictReader(f)}
  assert set(rows) == set(only.split(','))
  # Every hop pays it: the CSV's link_s holds it, and link_latency_s is it.
  wait = float(rows['model_parallel']['link_latency_s'])
  assert f'{wait:.4f}' == waits['0'] and float(rows['model_parallel']['link_s']) > wait >= 0
  # Each stage setting's own program ran beside a copy of itself on the other process: its
  # slowdown, the same number on both, is the row's; backprop's row keeps the rounds' median of
  # the whole-batch probe's.
  beside = re.findall(r'\[p(\d)\] (.*) on one device: [0-9.]+ s, ([0-9.]+)x beside', log)
  assert sorted(label for _, label, _ in beside) == sorted(2 * [*only.split(',')[1:]]), log[-3000:]
  for _, label, slowdown in beside:
    assert float(slowdown) >= 1.0
    assert f'{float(rows[label]["concurrent_slowdown"]):.3f}' == slowdown
  median = re.findall(r'\[p0\] pieces, the median .*concurrent slowdown ([0-9.]+),', log)
  assert f'{float(rows["backprop"]["concurrent_slowdown"]):.3f}' == median[0]
  for row in rows.values():
    assert float(row['step_time_s']) > 0 and float(row['ideal_s']) > 0
    assert float(row['predicted_s']) >= float(row['ideal_s'])
  assert rows['backprop']['stages'] == '1' and rows['model_parallel']['stages'] == '2'
  assert (tmp_path / 'bench.png').stat().st_size > 0


def test_every_tick_of_a_table_pays_the_collective_wait():
  """The wait `collective_wait_probe` finds is the latency of every hop: a table pipeline run
  tick by tick is one wait longer per tick, and the ideal step does not pay it."""
  import pytest

  from ouroboros_jax.perf import calibration
  from ouroboros_jax.schedules import ScheduleConfig, tables

  zb = ScheduleConfig(name='zb_h1', num_stages=2, microbatches=8).resolve('cpu')
  pieces = {
    'fwd': [1.0, 1.0],
    'bwd': [2.0, 2.0],
    'fwd_micro': {'8': [0.15, 0.15]},
    'bwd_micro': {'8': [0.3, 0.3]},
    'head': 0.05,
    'update': [0.01, 0.01],
  }
  assert calibration.tick_seconds(pieces) == 0.15
  assert calibration.tick_seconds({'fwd': [1.0, 2.0]}) == 2.0
  ticks = len(tables.place(tables.build('zb_h1', 2, 8, 1)).grid[0])
  without = calibration.simulated(zb, pieces, 0.004, 0.0)
  waited = calibration.simulated(zb, dict(pieces, collective_wait=0.02), 0.004, 0.0)
  assert waited - without == pytest.approx(ticks * 0.02)
  ideal = calibration.simulated(zb, dict(pieces, collective_wait=0.02), 0.0, 0.0, ideal=True)
  assert ideal == calibration.simulated(zb, pieces, 0.0, 0.0, ideal=True) < without


def test_the_ideal_and_the_prediction_of_fsdp_price_its_gathers():
  """bench's FSDP rows: the gathers and the reduce-scatter move the gradient's bytes once each,
  as the replicated all-reduce's two passes do (timed as `allreduce_s`), so the prediction pays
  about one all-reduce over the ideal, which has free links."""
  import pytest

  from ouroboros_jax.perf import calibration
  from ouroboros_jax.schedules import ScheduleConfig

  pieces = {'fwd': [1.0], 'bwd': [2.0], 'head': 0.05, 'update': [0.1]}
  fsdp, replicated = (
    ScheduleConfig(name='data_parallel', data_parallel=2, fsdp=sharded).resolve('cpu')
    for sharded in (True, False)
  )
  ideal = calibration.simulated(fsdp, pieces, 0.0, 0.0, ideal=True)
  predicted = calibration.simulated(fsdp, pieces, 0.01, 0.4)
  assert ideal < predicted <= ideal + 0.4 + 1e-9
  assert predicted == pytest.approx(calibration.simulated(replicated, pieces, 0.01, 0.4), abs=0.25)


def test_collective_wait_is_nothing_on_one_device_and_never_negative():
  from ouroboros_jax.perf import calibration

  assert calibration.collective_wait_probe(0.01, 32)(3) >= 0.0  # the suite's 8 simulated devices
  assert calibration.collective_wait_probe(0.0, 32)(3) == 0.0


def test_mfu_is_model_flops_over_the_devices_bf16_peak():
  import math
  import types

  from ouroboros_jax import costs
  from ouroboros_jax.models import model as transformer
  from ouroboros_jax.perf import bench

  cfg = transformer.ModelConfig(d_model=768, num_heads=12, num_layers=12, d_ff=3072, seq_len=1024)
  h100 = types.SimpleNamespace(device_kind='NVIDIA H100 80GB HBM3')
  got = bench.mfu(cfg, 32 * 1024, 0.025, 4, h100)
  assert got == costs.step_flops(cfg, 32 * 1024) / 0.025 / (4 * 989e12)
  assert 0.1 < got < 0.3  # GPT-2 small at 1.3M tokens/s on 4 H100s: 19%
  assert bench.peak_flops(types.SimpleNamespace(device_kind='TPU v5 lite')) == 197e12
  assert math.isnan(bench.mfu(cfg, 1024, 1.0, 1, types.SimpleNamespace(device_kind='cpu')))


def test_the_stash_policy_has_one_default():
  """The policy is 'auto' wherever a schedule is chosen (ScheduleConfig, the bench), resolved by
  one rule (`resolved_stash_policy`) to the graph stash's default on Ouroboros; the stashes and
  the bench's pieces default to that one constant, and the callers that keep every residual say
  'all' themselves."""
  import inspect

  from ouroboros_jax import choices
  from ouroboros_jax.perf import calibration
  from ouroboros_jax.schedules import ScheduleConfig, stash

  default = choices.DEFAULT_STASH_POLICY
  assert ScheduleConfig().stash_policy == 'auto'
  assert ScheduleConfig(name='ouroboros').resolved_stash_policy == default == 'nothing'
  for fn, name in (
    (stash.make_stash, 'policy'),
    (stash.GraphStash, 'policy'),
    (calibration.measure_pieces, 'stash_policy'),
  ):
    assert inspect.signature(fn).parameters[name].default == default, fn
  assert stash.GraphStash(None).policy is stash.STASH_POLICIES[default]


def test_a_bench_cut_short_keeps_the_rows_it_measured(tmp_path):
  """bench.csv is written after each setting, predictions included, so a bench stopped by a
  time limit (the device check's 8-process bench was) keeps the settings it measured."""
  import pytest

  from ouroboros_jax.models.model import ModelConfig
  from ouroboros_jax.perf import bench

  class Stop(Exception):
    pass

  def log(line):
    if 'ms/step' in line:  # the first setting's line: stop as a time limit would
      raise Stop

  model = ModelConfig(d_model=32, num_heads=2, num_layers=2, d_ff=64, seq_len=16)
  config = bench.BenchConfig(
    batch_size=4,
    stages=2,
    out_dir=str(tmp_path),
    steps=1,
    warmup=0,
    settings=bench.bench_settings(2, only='backprop,model_parallel'),
  )
  with pytest.raises(Stop):
    bench.run(model, config, log=log)
  rows = list(csv.DictReader(open(tmp_path / 'bench.csv')))
  assert [r['label'] for r in rows] == ['backprop']
  assert float(rows[0]['predicted_s']) > 0 and float(rows[0]['step_time_s']) > 0


def test_rounds_time_every_setting_in_turn_after_compiling_them_all(tmp_path, monkeypatch):
  """--rounds R: every setting compiled and warmed up first, then steps / R steps of each in
  turn, R times (the remainder in the first rounds); each row the median of all its steps."""
  import pytest

  from ouroboros_jax.errors import ConfigError
  from ouroboros_jax.models.model import ModelConfig
  from ouroboros_jax.perf import bench, calibration, timing

  events = []
  prepare, time_steps = timing.prepare_setting, timing.time_steps

  def prepare_logged(setting, work, optimizer, warmup, devices=None):
    events.append(('prepare', setting.label, setting.num_stages))
    return prepare(setting, work, optimizer, warmup, devices)

  one_device_alone = []  # each round's seconds of model_parallel's one-device program, alone

  def time_logged(prepared, steps):
    stages = prepared.setting.num_stages
    events.append(('time', prepared.setting.label, stages, steps))
    time_steps(prepared, steps)
    if stages == 1 and prepared.setting.name == 'model_parallel':
      one_device_alone.append(prepared.times[-steps:])

  pieces_measured = calibration.measure_pieces
  forward_s = iter([0.5, 0.125, 0.25])  # the start's pieces, then those of rounds 1 and 2

  def pieces_logged(work, **kw):
    events.append(('pieces', kw.get('repeats', 10), kw.get('micro_repeats', 3)))
    measured = pieces_measured(work, **kw)
    return dict(measured, fwd=[next(forward_s)] * len(measured['fwd']))

  step_untimed = timing.step_untimed

  def untimed_logged(prepared):
    events.append(('untimed', prepared.setting.label, prepared.setting.num_stages))
    step_untimed(prepared)

  monkeypatch.setattr(timing, 'prepare_setting', prepare_logged)
  monkeypatch.setattr(timing, 'time_steps', time_logged)
  monkeypatch.setattr(timing, 'step_untimed', untimed_logged)
  monkeypatch.setattr(bench.host, 'release_freed_memory', lambda: events.append(('release',)))
  monkeypatch.setattr(calibration, 'measure_pieces', pieces_logged)
  # The probes re-run in each round too. Their own tests time them; here the wait's tick would
  # be the 0.5 s faked forward (~40 s of probing), and one process has no slowdown to find.
  waits, slowdowns = iter([0.05, 0.01, 0.03]), iter([1.3, 1.1, 1.2])  # the start, rounds 1, 2

  def probe_logged(name, values):
    def probe(repeats):
      events.append((name, repeats))
      return next(values)

    return probe

  monkeypatch.setattr(
    calibration, 'collective_wait_probe', lambda tick_s, width: probe_logged('wait', waits)
  )
  monkeypatch.setattr(
    calibration, 'concurrent_slowdown_probe', lambda work: probe_logged('slowdown', slowdowns)
  )
  model = ModelConfig(d_model=32, num_heads=2, num_layers=2, d_ff=64, seq_len=16)
  config = bench.BenchConfig(
    batch_size=4,
    stages=2,
    out_dir=str(tmp_path),
    steps=5,
    warmup=0,
    rounds=2,
    settings=bench.bench_settings(2, only='backprop,model_parallel'),
  )
  rows = bench.run(model, config, log=lambda line: None)

  # The pieces are timed at the start, then again at the start of each round with 10 // R
  # repeats (at least 3) and one per micro-batch, and the rows use their median over the rounds.
  # The slowdown and the wait likewise: once at the start, then once more in each round. Every
  # stage setting's program on one device is compiled at the start, before anything else, and
  # timed in each round after the pieces: one untimed step of a fresh state, then one step
  # alone, one beside the other processes (none here) and one alone again (backprop's program
  # is one device's already). The memory the pieces, each one-device program and then the
  # round's measurements freed goes back to the kernel, so the next program runs one untimed
  # step first: each setting too, before its timed ones.
  def round_of(steps):
    return [
      ('slowdown', 1),
      ('wait', 2),
      ('pieces', 5, 1),
      ('release',),
      ('untimed', 'model_parallel', 1),
      ('time', 'model_parallel', 1, 1),
      ('time', 'model_parallel', 1, 1),
      ('release',),
      ('release',),
      ('untimed', 'backprop', 1),
      ('time', 'backprop', 1, steps),
      ('untimed', 'model_parallel', 2),
      ('time', 'model_parallel', 2, steps),
    ]

  assert events == [
    ('pieces', 10, 3),
    ('slowdown', 3),
    ('wait', 3),
    ('prepare', 'model_parallel', 1),
    ('prepare', 'backprop', 1),
    ('prepare', 'model_parallel', 2),
    *round_of(3),
    *round_of(2),
  ]
  # the one-device seconds: the median over the rounds of each round's median alone
  alone = [statistics.median(a + b) for a, b in zip(one_device_alone[::2], one_device_alone[1::2])]
  assert len(alone) == 2
  assert rows[1]['one_device_s'] == pytest.approx(statistics.median(alone))
  # the rows use the rounds' medians of both, not the start's 1.3 and 0.05
  for row in rows:
    assert row['concurrent_slowdown'] == pytest.approx(1.15)
  assert rows[1]['link_latency_s'] == pytest.approx(0.02)
  assert [r['label'] for r in rows] == ['backprop', 'model_parallel']
  assert all(float(r['step_time_s']) > 0 for r in rows)
  assert rows[0]['one_device_s'] == rows[0]['program_scale'] == ''
  # model_parallel's one-device step, set against the rounds' median pieces (forward 0.1875 s, more
  # than this tiny model's real one), scales its pieces down; the prediction uses the scale
  assert rows[1]['one_device_s'] > 0 and 0 < rows[1]['program_scale'] < 1
  assert rows[1]['predicted_s'] < calibration.simulated(
    config.settings[1],
    dict(
      fwd=[0.1875] * 2,
      bwd=[float(b) for b in rows[1]['bwd_s_per_stage'].split(';')],
      head=rows[1]['head_s'],
      update=[float(u) for u in rows[1]['update_s_per_stage'].split(';')],
      concurrent_slowdown=1.15,
      collective_wait=0.02,
    ),
    rows[1]['link_s'] - rows[1]['link_latency_s'],
    rows[1]['allreduce_s'],
  )
  # median(0.125, 0.25): the rounds' forwards, not the start's 0.5
  assert rows[0]['fwd_s_per_stage'].split(';')[0] == '0.1875'
  assert calibration.median_pieces(
    [
      {'a': [1.0, 4.0], 'b': {'2': [3.0]}, 'x_bytes': 7},
      {'a': [3.0, 2.0], 'b': {'2': [5.0]}, 'x_bytes': 7},
    ]
  ) == {'a': [2.0, 3.0], 'b': {'2': [4.0]}, 'x_bytes': 7}
  with pytest.raises(ConfigError, match='--rounds'):
    bench.run(model, dataclasses.replace(config, rounds=6), log=lambda line: None)


def test_one_device_keeps_the_setting_but_its_stages():
  """The program a stage setting's devices each run, alone: one stage, everything else kept."""
  from ouroboros_jax.perf import bench, calibration

  for setting in bench.bench_settings(2, num_layers=4):
    one = calibration.one_device(setting)
    if setting.name in ('backprop', 'data_parallel'):
      assert one is None
      continue
    assert one.num_stages == 1 and one.label == setting.label
    assert dataclasses.replace(one, num_stages=2) == setting


def test_a_bench_moves_an_earlier_benchs_results_aside(tmp_path):
  """Never overwritten silently: the earlier outputs go to earlier-1, earlier-2, ... with a line."""
  from ouroboros_jax.perf import bench

  said = []
  assert bench.keep_earlier(str(tmp_path), said.append) is None and said == []
  for n in (1, 2):
    (tmp_path / 'bench.csv').write_text(f'run {n}\n')
    (tmp_path / 'bench.md').write_text(f'table {n}\n')
    where = bench.keep_earlier(str(tmp_path), said.append)
    assert where == str(tmp_path / f'earlier-{n}')
    assert (tmp_path / f'earlier-{n}' / 'bench.csv').read_text() == f'run {n}\n'
    assert not (tmp_path / 'bench.csv').exists()
  assert said[-1] == (
    f"moved the earlier bench's bench.csv, bench.md to {tmp_path}/earlier-2 (nothing was deleted)"
  )
