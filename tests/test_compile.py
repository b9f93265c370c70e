"""`ouroboros compile`: a run's step compiled for a TPU topology (compile-only devices, no TPU) or
for the local devices, and its memory per device against the device's.

The TPU compiles run in subprocesses with a user's environment: this process's CPU backend and
XLA_FLAGS (conftest.py) are test settings, and libtpu loads where nothing else runs.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import forked_cli
import pytest

from ouroboros_jax import cli
from ouroboros_jax.choices import SPLIT_BACKWARD
from ouroboros_jax.perf import compile as compile_lib
from ouroboros_jax.schedules import SCHEDULES, tables

from helpers import REPO_ROOT, assert_one_line_error, run_cli

needs_libtpu = pytest.mark.skipif(
  importlib.util.find_spec('libtpu') is None, reason='needs libtpu: pip install -e ".[tpu]"'
)
TOPOLOGY = 'v5e:2x2'
# Sequences of 256 (512 before: each compile ~1.4x as long): at 128 the micro-batched ring's
# temporaries no longer fall below 0.75x the whole batch's (0.89x), the compiler's own floor.
SMALL = dict(d_model=64, num_heads=2, d_ff=256, num_layers=4, seq_len=256, batch_size=8)
# Schedules at SMALL on 2 stages (the data-parallel one on 2 replicas) in each dtype of argv[2]
# (comma-separated), one JSON report per line.
EVERY_SCHEDULE = """
import json, sys
from ouroboros_jax.choices import MICROBATCHED
from ouroboros_jax.perf import compile as compile_lib
from ouroboros_jax.training import config, field_flags, presets

small, dtypes, names = json.loads(sys.argv[1]), sys.argv[2].split(','), sys.argv[4].split(',')
for dtype, name in [(dtype, name) for dtype in dtypes for name in names]:
  spread = {'backprop': {}, 'data_parallel': {'data_parallel': 2}}.get(name, {'stages': 2})
  if name in MICROBATCHED:  # micro-batches of 4: activations larger than the chip's VMEM
    spread['microbatches'] = 2
  cfg = field_flags.override(
    presets.get_preset('tiny'),
    {**small, **spread, 'schedule': name, 'dtype': dtype},
  )
  print(json.dumps(compile_lib.compile_step(cfg, sys.argv[3])), flush=True)
"""


def _env(**changes) -> dict:
  """The environment a user's shell would give (no test XLA_FLAGS), with `changes`."""
  env = {k: v for k, v in os.environ.items() if k != 'XLA_FLAGS'}
  env.update(changes)
  return {k: v for k, v in env.items() if v is not None}


def _reports(script: str, **env) -> list[dict]:
  """The JSON reports `script` prints, a line each, run on SMALL and TOPOLOGY in a subprocess
  (its environment `_env(**env)`), which writes nothing else."""
  run = subprocess.run(
    [sys.executable, '-c', script, json.dumps(SMALL), TOPOLOGY],
    cwd=REPO_ROOT,
    env=_env(**env),
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert run.returncode == 0, run.stderr[-3000:]
  assert not run.stderr.strip(), run.stderr[-3000:]  # libtpu's start-up warnings are quieted
  return [json.loads(line) for line in run.stdout.splitlines()]


def _compile(runs) -> dict:
  """{(dtype, schedule): report} of each (dtypes, schedules) in `runs`: one subprocess each, side
  by side, that compiles every schedule in every dtype (one libtpu start-up for them all)."""
  procs = {
    (dtypes, names): subprocess.Popen(
      [
        sys.executable,
        '-c',
        EVERY_SCHEDULE,
        json.dumps(SMALL),
        ','.join(dtypes),
        TOPOLOGY,
        ','.join(names),
      ],
      cwd=REPO_ROOT,
      env=_env(),
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
    )
    for dtypes, names in runs
  }
  reports = {}
  for (dtypes, names), run in procs.items():
    out, err = run.communicate(timeout=300)
    assert run.returncode == 0, err[-3000:]
    assert not err.strip(), err[-3000:]  # libtpu's start-up warnings are quieted
    got = [json.loads(line) for line in out.splitlines()]
    assert [(r['dtype'], r['schedule']) for r in got] == [(d, n) for d in dtypes for n in names]
    reports.update({(r['dtype'], r['schedule']): r for r in got})
  for (dtype, name), r in reports.items():
    assert r['dtype'] == dtype
    assert (r['topology'], r['platform'], r['device_kind']) == (TOPOLOGY, 'tpu', 'TPU v5 lite')
    assert r['devices'] == (1 if name == 'backprop' else 2)
    assert r['compiler_oom'] is None and r['fits'] is True, (dtype, name, r)
    # A v5e chip has 16 GiB; the compiler keeps a little of it to itself.
    assert 15 * 2**30 < r['hbm_bytes'] <= 16 * 2**30
    assert r['peak_bytes'] == (
      r['argument_bytes'] + r['output_bytes'] + r['temp_bytes'] - r['alias_bytes']
    )
    assert r['argument_bytes'] >= r['params_bytes'] + r['opt_state_bytes'] + r['ring_bytes']
    assert (r['ring_bytes'] > 0) == (name == 'ouroboros'), (name, r['ring_bytes'])
  return reports


# Each TPU compile of a step takes 5-60 s on 2 cores, so each of the three step builders compiles
# once, in bfloat16 (the TPU's compute dtype), in one subprocess (a libtpu start-up and import
# cost ~5 s): backprop's step (data_parallel's, on replicas), model parallelism's `shard_map`, and
# the exact pipelines' executor (`pipeline.py`) through ZB-V, whose table has the most a table can
# have (two chunks a device, the backward split into B and W); GPipe, 1F1B, interleaved and ZB-H1
# run the same executor from their own tables. The ring (ouroboros), whose stash and compensation
# state are its own, compiles in both dtypes, compared. (Before: every schedule in bfloat16, in
# three subprocesses of 27-48 s in a 15-minute suite; before that both dtypes, 18 compiles.)
COMPARED = ('ouroboros',)
BFLOAT16_ONLY = (('backprop', 'model_parallel', 'zb_v'),)


def _builder(name: str) -> str:
  """The step builder a schedule compiles through (schedules.build_schedule's dispatch)."""
  if name in tables.PIPELINES:
    return 'pipeline'
  return {'data_parallel': 'backprop'}.get(name, name)


def test_the_tpu_compiles_cover_every_step_builder():
  compiled = [*COMPARED, *(name for group in BFLOAT16_ONLY for name in group)]
  assert {_builder(n) for n in compiled} == {_builder(n) for n in SCHEDULES}
  assert 'zb_v' in SPLIT_BACKWARD and tables.DEFAULT_CHUNKS['zb_v'] == 2


@needs_libtpu
@pytest.mark.parametrize('names', BFLOAT16_ONLY, ids='+'.join)
def test_every_step_builder_compiles_for_a_tpu_in_bfloat16(names):
  reports = _compile([(('bfloat16',), names)])
  assert sorted(name for _, name in reports) == sorted(names)


@needs_libtpu
@pytest.mark.parametrize('name', COMPARED)
def test_bfloat16_needs_less_than_float32_on_a_tpu(name):
  reports = _compile([(('float32', 'bfloat16'), (name,))])
  fp32, bf16 = reports['float32', name], reports['bfloat16', name]
  # Master weights stay float32; the per-weight first moments (and Ouroboros' compensation
  # state) are stored in bf16 (`--state-dtype auto`), the rest of the optimizer state in float32;
  # activations and temporaries halve.
  assert bf16['params_bytes'] == fp32['params_bytes']
  assert fp32['opt_state_bytes'] / 2 < bf16['opt_state_bytes'] < fp32['opt_state_bytes']
  assert bf16['peak_bytes'] < fp32['peak_bytes'], (bf16, fp32)


@needs_libtpu
def test_a_step_that_does_not_fit_is_one_line_and_exit_status_1():
  too_big = ('compile', '--seq-len', 2048, '--batch-size', 1024, '--topology', TOPOLOGY)
  table = run_cli(*too_big, env=_env())
  assert table.returncode == 1, table.stderr
  assert 'Traceback' not in table.stderr and not table.stderr.strip(), table.stderr
  verdicts = [line for line in table.stdout.splitlines() if 'fit' in line]
  assert len(verdicts) == 1 and verdicts[0].startswith('does not fit by '), table.stdout

  as_json = run_cli(*too_big, '--json', env=_env())
  assert as_json.returncode == 1, as_json.stderr
  report = json.loads(as_json.stdout)
  assert report['fits'] is False and report['compiler_oom']
  assert report['peak_bytes'] > report['hbm_bytes'] > 0
  assert report['over_bytes'] == report['peak_bytes'] - report['hbm_bytes']
  # The compiler's figure counts every buffer; here nearly all of it is activations.
  assert 0.9 * report['peak_bytes'] < report['temp_bytes'] < report['peak_bytes']


BAD_INPUT = [
  (('--topology', 'bogus'), ('unknown TPU topology', "'bogus'", 'v5e:2x2')),
  (('--topology', 'v9:2x2'), ('unknown TPU topology', 'v9:2x2')),
  (
    ('--topology', TOPOLOGY, '--schedule', 'gpipe', '--stages', 8, '--num-layers', 8),
    ('need 8 devices', 'has 4'),
  ),
]


@needs_libtpu
def test_bad_input_is_one_line_and_exit_status_2():
  # Each command line in a process of its own, forked after one interpreter start-up.
  lines = (['compile', *flags] for flags, _ in BAD_INPUT)
  results = forked_cli.run_each(*lines, env=_env())
  for (_, words), result in zip(BAD_INPUT, results, strict=True):
    assert_one_line_error(result, 2, *words)


def test_topology_without_libtpu_names_the_tpu_extra():
  hide_libtpu = (
    "import sys; sys.modules['libtpu'] = None; from ouroboros_jax.cli import main; "
    f"sys.exit(main(['compile', '--topology', '{TOPOLOGY}']))"
  )
  result = subprocess.run(
    [sys.executable, '-c', hide_libtpu],
    cwd=REPO_ROOT,
    env=_env(TPU_LIBRARY_PATH=None),
    capture_output=True,
    text=True,
    timeout=90,
  )
  assert_one_line_error(result, 2, '--topology needs libtpu', 'pip install "ouroboros-jax[tpu]"')


def test_the_local_cpu_has_no_known_capacity_and_exits_0(capsys, monkeypatch):
  # This process's JAX is up already (8 CPU devices); its environment stays as it is.
  monkeypatch.setattr(compile_lib, 'quiet_libtpu', lambda: None)
  flags = [f'--{k.replace("_", "-")}={v}' for k, v in SMALL.items()]
  code = cli.main(['compile', *flags, '--schedule', 'gpipe', '--stages', '2', '--json'])
  report = json.loads(capsys.readouterr().out)
  assert code == 0
  assert (report['platform'], report['hbm_bytes'], report['fits']) == ('cpu', None, None)
  assert report['devices'] == 2 and report['peak_bytes'] > report['params_bytes'] > 0


@pytest.mark.parametrize(
  'message, expected',
  [
    (
      'RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO '
      'temporaries (134.50G) exceeds available HBM (15.75G).',
      (round(134.5 * 2**30), round(15.75 * 2**30)),
    ),
    (
      'RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space '
      'hbm. Used 17.25G of 15.75G hbm. Exceeded hbm capacity by 1.50G.',
      (round(17.25 * 2**30), round(15.75 * 2**30)),
    ),
    ('INVALID_ARGUMENT: something else', None),
  ],
)
def test_the_compilers_out_of_memory_messages_are_read(message, expected):
  assert compile_lib.parse_out_of_memory(message) == expected


MICROBATCHED_RING = """
import json, sys
from ouroboros_jax.perf import compile as compile_lib
from ouroboros_jax.training import config, field_flags, presets

small = json.loads(sys.argv[1])
# None: the accelerator's default micro-batches; pinned_host: the stash in host memory. As one
# batch, whose ring keeps G + 1 steps: streamed it keeps 2, too little at this size to outweigh
# the temporaries that stage a host slot through the chip.
for micro, memory in ((1, 'device'), (None, 'device'), (None, 'pinned_host')):
  ring = {'schedule': 'ouroboros', 'stages': 2, 'microbatches': micro, 'stash_memory': memory}
  ring['flow'] = 'batch'
  cfg = field_flags.override(presets.get_preset('tiny'), {**small, **ring, 'dtype': 'bfloat16'})
  print(json.dumps(compile_lib.compile_step(cfg, sys.argv[2])), flush=True)
"""

# One subprocess of its own, beside MICROBATCHED_RING's: together they took 45-90 s.
STREAMED_RING = """
import json, sys
from ouroboros_jax.perf import compile as compile_lib
from ouroboros_jax.training import config, field_flags, presets

small = json.loads(sys.argv[1])
# streamed and pipelined, the stash in host memory (bf16 weights' versions there did not compile)
ring = {'schedule': 'ouroboros', 'stages': 2, 'microbatches': 4, 'stash_memory': 'pinned_host'}
ring.update(forward='pipelined', flow='stream', dtype='bfloat16')
cfg = field_flags.override(presets.get_preset('tiny'), {**small, **ring})
print(json.dumps(compile_lib.compile_step(cfg, sys.argv[2])), flush=True)
# G = 4 pipelined, streamed, keeping every residual, at M = G and 2G (16 rows)
for micro in (4, 8):
  ring = {'schedule': 'ouroboros', 'stages': 4, 'microbatches': micro, 'forward': 'pipelined'}
  ring.update(flow='stream', stash_policy='all', batch_size=16, dtype='bfloat16')
  cfg = field_flags.override(presets.get_preset('tiny'), {**small, **ring})
  print(json.dumps(compile_lib.compile_step(cfg, sys.argv[2])), flush=True)
"""


@needs_libtpu
def test_the_microbatched_ring_and_a_host_stash_need_less_memory_on_a_tpu(tmp_path):
  """Ouroboros without --microbatches on a TPU cuts the batch in 8; the compiler's peak per chip
  falls below the un-chunked step's (the stash keeps the same bytes; the step's temporaries are
  those of one micro-batch). With --stash-memory pinned_host the stash leaves the chip. (One
  libtpu start-up and one run of the script for the three compiles.)

  And topology compiles keep out of a user's compilation cache: with $JAX_COMPILATION_CACHE_DIR
  set, a later compile of the same step would read back an executable of compile-only devices,
  which JAX cannot load (it warns and compiles again). The script's three compiles write nothing
  there, so nothing can be read back. (Its own test before, 13 s of a 15-minute suite: one step
  compiled twice in a libtpu start-up of its own.)"""
  cache = tmp_path / 'cache'
  whole, chunked, in_host = _reports(
    MICROBATCHED_RING,
    JAX_COMPILATION_CACHE_DIR=str(cache),
    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS='0',
    JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES='0',
  )
  assert not (cache.exists() and any(cache.iterdir()))  # nothing was written to it
  assert (whole['microbatches'], chunked['microbatches']) == (1, 8)
  assert whole['stash'] == chunked['stash'] == 'graph/nothing'  # the default stash
  assert chunked['temp_bytes'] < 0.75 * whole['temp_bytes'], (chunked, whole)
  assert chunked['peak_bytes'] < whole['peak_bytes'], (chunked, whole)
  # The stash waits in host memory (the forward's weights' versions stay on the chip: XLA's TPU
  # compiler could not squeeze them there in bf16, 'Bitcast changes dimensionality', which the
  # streamed pipelined ring below hit): the chip's arguments lose it, and what it holds besides
  # its temporaries falls. (Whether its peak falls depends on the shape:
  # XLA stages each round's slot through device temporaries, more than the stash at this tiny
  # size since the stash holds micro-batch slots.)
  assert in_host['host_ring_bytes'] > 0 and chunked['host_ring_bytes'] == 0
  assert in_host['ring_bytes'] + in_host['host_ring_bytes'] == chunked['ring_bytes']
  moved = chunked['argument_bytes'] - in_host['argument_bytes']  # the chip's bytes, laid out
  assert moved >= 0.9 * in_host['host_ring_bytes'], (in_host, chunked)  # in tiles: not exact
  held = lambda report: report['peak_bytes'] - report['temp_bytes']
  assert held(in_host) < held(chunked), (in_host, chunked)


@needs_libtpu
def test_more_microbatches_shrink_the_streamed_ring_on_a_tpu():
  """The streamed pipelined ring compiles with its stash in host memory. And at G = 4 pipelined
  keeping every residual, M = 2G holds the same 2G + 1 micro-batches in flight as M = G, each
  half the rows: the ring's bytes halve (with the stash in whole steps they fell to 0.67x: two
  steps of 8 items against three of 4) and the chip's peak falls."""
  streamed_in_host, at_g, at_2g = _reports(STREAMED_RING)
  assert streamed_in_host['host_ring_bytes'] > 0 and streamed_in_host['fits']
  assert at_2g['ring_bytes'] < 0.55 * at_g['ring_bytes'], (at_2g, at_g)
  assert at_2g['peak_bytes'] < 0.75 * at_g['peak_bytes'], (at_2g, at_g)


def test_a_step_beyond_what_xla_indexes_does_not_fit_in_one_report():
  """A billion sequences: no allocation, no traceback; the report says it does not fit (exit
  status 1 from the command), its peak the arguments alone."""
  from ouroboros_jax.training import field_flags, presets

  cfg = field_flags.override(presets.get_preset('tiny'), {'batch_size': 10**9})
  report = compile_lib.compile_step(cfg)
  assert report['fits'] is False
  assert report['peak_bytes'] >= 10**9 * cfg.model.seq_len * 4 * 2  # inputs and targets
  assert 'more than one XLA program indexes' in compile_lib.format_report(report)


def test_collective_bytes_sums_the_result_shapes_of_one_kind():
  hlo = '\n'.join([
    '  %ag = f32[4,256]{1,0} all-gather(f32[1,256]{1,0} %p), dimensions={0}',
    '  %ags = (bf16[8]{0}, bf16[64]{0}) all-gather-start(bf16[8]{0} %q), dimensions={0}',
    '  %ar = f32[10]{0} all-reduce(f32[10]{0} %r), to_apply=%add',
  ])  # fmt: skip
  assert compile_lib.collective_bytes(hlo, 'all-gather') == 4 * 256 * 4 + (8 + 64) * 2
  assert compile_lib.collective_bytes(hlo, 'all-reduce') == 40
  assert compile_lib.collective_bytes(hlo, 'reduce-scatter') == 0
