"""The results pages' generated tables (issue 43 item 2): lr_sweep.py's, convergence.py's and
simulate.py's `--render` print a CSV's values, and every table marked in docs/results/*.md is
what its command prints from the committed CSV (experiments/render_results.py --check). Seconds;
trains nothing."""

from __future__ import annotations

import csv
import pathlib

import pytest

from helpers import experiment

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _rows(table: str):
  """A markdown table's rows as dicts by header."""
  lines = [line for line in table.splitlines() if line.startswith('|')]
  cells = [[c.strip() for c in line.strip('|').split('|')] for line in lines]
  return [dict(zip(cells[0], row)) for row in cells[2:]]


@pytest.fixture
def fixture_csv(tmp_path):
  path = tmp_path / 'runs.csv'
  rows = [
    ('backprop-muon', 0.04, 0, 100, 3.0),
    ('backprop-muon', 0.04, 0, 200, 2.5),
    ('backprop-muon', 0.04, 1, 100, 3.1),
    ('backprop-muon', 0.04, 1, 200, 2.4),
    ('g4-stream4-muon-predict-dc', 0.02, 0, 100, 3.2),
    ('g4-stream4-muon-predict-dc', 0.02, 0, 200, 2.55),
    ('g4-stream4-muon-predict-dc', 0.01, 0, 200, 2.75),
  ]
  with open(path, 'w', newline='') as f:
    writer = csv.writer(f)
    writer.writerow(['recipe', 'rate', 'seed', 'step', 'bpb'])
    writer.writerows(rows)
  return path


def test_lr_sweep_render_a_fixture(fixture_csv, capsys):
  experiment('lr_sweep').main(
    ['--render', str(fixture_csv), '--versus', 'backprop-muon', '--at', '100']
  )
  rows = _rows(capsys.readouterr().out)
  by = {(r['recipe'], r['rate']): r for r in rows}
  assert list(by) == [
    ('backprop-muon', '0.04'),
    ('g4-stream4-muon-predict-dc', '0.01'),
    ('g4-stream4-muon-predict-dc', '0.02'),
  ]
  ring = by['g4-stream4-muon-predict-dc', '0.02']
  assert ring['seed 0: val bpb, step 100'] == '3.2000'
  assert ring['seed 0: val bpb, step 200'] == '2.5500'  # the last evaluation, not the first
  assert ring['seed 0: vs backprop-muon'] == '+2.00%'  # 2.55 / 2.5 - 1, against the same seed
  assert ring['seed 1: val bpb, step 200'] == ''  # no seed-1 run
  assert by['backprop-muon', '0.04']['seed 1: val bpb, step 200'] == '2.4000'
  assert by['backprop-muon', '0.04']['seed 1: vs backprop-muon'] == '+0.00%'
  assert by['g4-stream4-muon-predict-dc', '0.01']['seed 0: val bpb, step 100'] == ''


def test_lr_sweep_render_picks_rows_in_order(fixture_csv):
  text = experiment('lr_sweep').render(
    str(fixture_csv), ['g4-stream4-muon-predict-dc@0.02', 'backprop-muon'], 'backprop-muon'
  )
  assert [(r['recipe'], r['rate']) for r in _rows(text)] == [
    ('g4-stream4-muon-predict-dc', '0.02'),
    ('backprop-muon', '0.04'),
  ]
  with pytest.raises(SystemExit, match='2 runs match'):
    experiment('lr_sweep').render(str(fixture_csv), None, 'g4-stream4-muon-predict-dc')


@pytest.mark.parametrize(
  'script, name, csv_name',
  [
    ('lr_sweep', 'recipe', 'stream_ring_1000.csv'),
    ('lr_sweep', 'recipe', 'long_pair_stream.csv'),
    ('lr_sweep', 'recipe', 'equal_time.csv'),
    ('convergence', 'run', 'archive/convergence_recipe.csv'),
  ],
)
def test_render_of_a_committed_csv_gives_its_last_evaluations(script, name, csv_name, capsys):
  path = ROOT / 'docs' / 'results' / csv_name
  experiment(script).main(['--render', str(path)])
  table = _rows(capsys.readouterr().out)
  last = {}
  with open(path) as f:
    for r in csv.DictReader(f):
      if r.get('split', 'validation') == 'validation':
        key = (r[name], f'{float(r["rate"]):g}' if 'rate' in r else '', r.get('seed', ''))
        last[key] = (int(r['step']), float(r['bpb']))  # the CSV's rows are in step order
  seeds = {key[2] for key in last}
  seen = 0
  for row in table:
    for header, cell in row.items():
      if 'val bpb' in header and cell:
        # one column per seed where the CSV has several, else the one seed (or none)
        seed = header.split(':')[0].removeprefix('seed ') if ':' in header else min(seeds)
        step, bpb = last[row[name], row.get('rate', ''), seed]
        if header.endswith('(steps)'):  # each run's own length (equal_time.csv)
          assert step == int(row['steps'])
        else:
          assert header.endswith(f'step {step}')
        assert cell == f'{bpb:.4f}'
        seen += 1
  assert seen == len(last)


def test_simulate_render_gives_a_bench_csvs_own_columns(capsys):
  path = ROOT / 'docs' / 'results' / 'archive' / 'bench_2proc_cpu_pipelines.csv'
  experiment('simulate').main(['--render', str(path), '--versus', 'backprop,gpipe M=4'])
  table = {r['setting']: r for r in _rows(capsys.readouterr().out)}
  with open(path) as f:
    rows = list(csv.DictReader(f))
  assert list(table) == [r['label'] for r in rows]
  step = {r['label']: float(r['step_time_s']) for r in rows}
  for r in rows:
    out = table[r['label']]
    assert out['step ms'] == f'{step[r["label"]] * 1e3:.0f}'
    assert out['ideal ms'] == f'{float(r["ideal_s"]) * 1e3:.0f}'
    assert out['vs gpipe M=4'] == f'{step["gpipe M=4"] / step[r["label"]]:.2f}x'
    error = float(r['predicted_s']) / step[r['label']] - 1
    assert out['simulator error'] == f'{error:+.1%}'
  assert table['gpipe M=4']['vs gpipe M=4'] == '1.00x'
  with pytest.raises(SystemExit, match='no row labelled'):
    experiment('simulate').render_bench(str(path), ['zb_v M=8'])


def test_every_page_table_is_what_its_csv_gives():
  """Nothing in a generated table of docs/results was edited by hand (or its CSV changed since):
  `python experiments/render_results.py` rewrites them."""
  render_results = experiment('render_results')
  blocks = 0
  for page in render_results.pages():
    text = page.read_text()
    blocks += len(render_results.BLOCK.findall(text))
    assert render_results.rendered(text) == text, (
      f'{page.relative_to(ROOT)}: a generated table differs from its CSV; '
      'run python experiments/render_results.py'
    )
  assert blocks >= 5, f'only {blocks} generated tables in docs/results: are the markers right?'
