"""The device check's dry run: experiments/device_check.sh as it runs on the lent GPU machine,
shortened (2 processes, a tiny shape, one setting; no GPU here, so its GPU steps are skipped), and
its summary of a bench that was cut short. The full check and its numbers: docs/device.md."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
import tarfile

from helpers import REPO_ROOT


def test_the_device_check_runs_its_cpu_part_on_two_processes_and_packs_a_summary(tmp_path):
  out, work = tmp_path / 'out', tmp_path / 'work'
  env = dict(
    os.environ,
    QUICK='1',
    PROCESSES='2',
    PARTS='cpu',
    ONLY='ouroboros M=4 stream pipelined',
    OUT=str(out),
    WORK=str(work),
  )
  done = subprocess.run(
    ['bash', 'experiments/device_check.sh'],
    cwd=REPO_ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=150,
  )
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  assert 'no GPU: the gpu steps are skipped' in done.stdout
  steps = list(csv.DictReader(open(work / 'steps.csv')))
  assert [(s['step'], s['status']) for s in steps] == [('cpu_g2', '0')]
  rows = list(csv.DictReader(open(work / 'cpu_g2' / 'bench.csv')))
  assert [r['label'] for r in rows] == ['ouroboros M=4 stream pipelined/graph']
  assert float(rows[0]['step_time_s']) > 0 and float(rows[0]['ideal_s']) > 0
  summary = (out / 'summary.md').read_text()
  assert '**2 pinned processes, one core each**' in summary
  assert '| ouroboros M=4 stream pipelined/graph |' in summary
  assert 'GPU correctness: not run' in summary
  with tarfile.open(out / 'device_check.tar.gz') as packed:
    assert './cpu_g2/bench.csv' in packed.getnames()


def _summary(run_dir):
  """experiments/device_summary.py on a check's work directory."""
  return subprocess.run(
    [sys.executable, 'experiments/device_summary.py', str(run_dir)],
    cwd=REPO_ROOT,
    capture_output=True,
    text=True,
  )


def test_the_summary_reads_a_bench_cut_short_from_process_0_s_log(tmp_path):
  (tmp_path / 'steps.csv').write_text('step,seconds,status\ncpu_g8,260,137\n')
  (tmp_path / 'cpu_g8.log').write_text(
    '[p1] zb_v M=8          900.0 ms/step   455 tok/s  ideal   500.0 ms  compile 9.0 s\n'
    '[p0] zb_v M=8         1000.0 ms/step   410 tok/s  ideal   500.0 ms  compile 9.0 s\n'
    '[p0] ouroboros M=8 stream locked/graph    800.0 ms/step   512 tok/s  ideal  400.0 ms  '
    'compile 9.0 s\n'
    '[launch] SIGTERM: passing it on to every process\n'
  )
  done = _summary(tmp_path)
  assert done.returncode == 0, done.stderr
  assert '| cpu_g8 | 260 | 137 |' in done.stdout
  assert '- zb_v M=8: 1000.0 ms' in done.stdout  # process 0's step, not process 1's
  assert '- ouroboros M=8 stream locked/graph: 1.25x the throughput of ZB-V' in done.stdout
  assert 'MFU: not measured' in done.stdout and 'versions: not recorded' in done.stdout


def test_the_summary_sets_the_unchunked_head_beside_the_default_one(tmp_path):
  """The mfu step runs the batch that fitted once more with --loss-chunk-tokens 0: the summary
  gives both, at that batch, and the default head's throughput over the unchunked one's."""
  header = 'schedule,label,step_time_s,tokens_per_s,mfu\n'
  for name, step, mfu in (('mfu_b32', 0.1, 0.3), ('mfu_unchunked_b32', 0.15, 0.2)):
    (tmp_path / name).mkdir()
    (tmp_path / name / 'bench.csv').write_text(
      header + f'backprop,backprop,{step},{32 * 1024 / step},{mfu}\n'
    )
  done = _summary(tmp_path)
  assert done.returncode == 0, done.stderr
  assert 'batch 32 x 1024: **MFU 30.0%**, 100.0 ms/step' in done.stdout
  assert 'MFU 20.0%, 150.0 ms/step; the default (chunked) head runs at 1.50x' in done.stdout


def test_the_summary_sets_each_mfu_lever_against_its_own_default(tmp_path):
  """The mfu_levers part times the batch-64 step once per lever: the summary gives each lever's
  step, its MFU, and the default's step over the lever's (above 1: the lever is faster)."""
  header = 'schedule,label,step_time_s,tokens_per_s,mfu\n'
  for name, step, mfu in (('default', 0.2, 0.25), ('adamw', 0.16, 0.3125)):
    (tmp_path / f'mfu_lever_{name}').mkdir()
    (tmp_path / f'mfu_lever_{name}' / 'bench.csv').write_text(
      header + f'backprop,backprop,{step},{64 * 1024 / step},{mfu}\n'
    )
  done = _summary(tmp_path)
  assert done.returncode == 0, done.stderr
  assert '| adamw | 160.0 | 31.2% | 1.25x |' in done.stdout
  assert '| default | 200.0 | 25.0% | 1.00x |' in done.stdout
