"""`ouroboros bench` end to end on 2 real processes (tiny model: a smoke run, not a timing)."""

from __future__ import annotations

import csv
import io
import re

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


def test_two_process_bench_writes_every_row_with_its_ideal(tmp_path):
  out = io.StringIO()
  only = 'backprop,model_parallel,ouroboros pipelined/graph'
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
  with open(tmp_path / 'bench.csv') as f:
    rows = {row['label']: row for row in csv.DictReader(f)}
  assert set(rows) == set(only.split(','))
  for row in rows.values():
    assert float(row['step_time_s']) > 0 and float(row['ideal_s']) > 0
    assert float(row['predicted_s']) >= float(row['ideal_s'])
  assert rows['backprop']['stages'] == '1' and rows['model_parallel']['stages'] == '2'
  assert (tmp_path / 'bench.png').stat().st_size > 0
