"""A run whose reader goes away (`train ... | head -1`, `sample ... | head -c 20`) and an OUT
that holds a user's own config.json (issue 59): the run goes on, sample stops quietly, and
nothing the run did not write is overwritten."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from helpers import REPO_ROOT, SMALL_CLI, assert_one_line_error, run_cli

LOUD = [flag for flag in SMALL_CLI if flag != '--quiet']  # status lines on stdout, as a job's


def _train(out, steps: int, *extra) -> list[str]:
  return [
    sys.executable,
    '-m',
    'ouroboros_jax',
    'train',
    *LOUD,
    '--steps',
    str(steps),
    '--log-every',
    '1',
    '--eval-every',
    '1000',
    '--checkpoint-every',
    str(steps // 2),
    '--out',
    os.fspath(out),
    *extra,
  ]


def test_train_piped_into_head_trains_to_its_end(tmp_path, prepared_data_dir):
  """The reader reads one line and goes: the run finishes, with its checkpoints, rows and
  summary, says once on stderr that stdout lost its reader, and prints no traceback."""
  out = tmp_path / 'run'
  run = subprocess.Popen(
    _train(out, 12), cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
  )
  try:
    first = run.stdout.readline()
    run.stdout.close()  # `| head -1`
    stderr = run.stderr.read()
    run.wait(timeout=120)
  finally:
    run.kill()
  assert first.strip(), stderr
  assert run.returncode == 0, stderr
  assert 'Traceback' not in stderr and 'lost its reader' in stderr, stderr
  summary = json.loads((out / 'summary.json').read_text())
  assert summary['step'] == 12
  assert sorted(os.listdir(out / 'checkpoints')) == ['12', '6']
  rows = [json.loads(line) for line in (out / 'metrics.jsonl').read_text().splitlines()]
  assert [row['step'] for row in rows if 'loss' in row][-1] == 12


def test_sample_piped_into_head_stops_quietly(tmp_path, prepared_data_dir):
  out = tmp_path / 'run'
  subprocess.run(_train(out, 2), cwd=REPO_ROOT, check=True, capture_output=True, timeout=120)
  sample = subprocess.Popen(
    [sys.executable, '-m', 'ouroboros_jax', 'sample', '--ckpt', os.fspath(out), '--length', '2000'],
    cwd=REPO_ROOT,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
  )
  try:
    head = sample.stdout.read(20)  # `| head -c 20`
    sample.stdout.close()
    stderr = sample.stderr.read().decode()
    sample.wait(timeout=120)
  finally:
    sample.kill()
  assert len(head) == 20
  assert sample.returncode == 0, stderr
  assert 'Traceback' not in stderr and 'Error' not in stderr, stderr


def test_a_users_own_config_json_is_refused_not_overwritten(tmp_path):
  out = tmp_path / 'run'
  out.mkdir()
  mine = '{"hidden_size": 768, "note": "my own model config"}\n'
  (out / 'config.json').write_text(mine)
  result = run_cli('train', *SMALL_CLI, '--steps', '2', '--out', out)
  assert_one_line_error(result, 2, 'config.json', 'not a config an ouroboros run wrote')
  assert (out / 'config.json').read_text() == mine
  assert not (out / 'metrics.jsonl').exists()
