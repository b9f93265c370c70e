"""The markdown table of a results CSV (`python experiments/lr_sweep.py --render CSV`): a row per
run of lr_sweep.py's grid.csv / final.csv, or of one of docs/results' CSVs with the same columns
(plus seed, steps, beta, ...), with its validation bpb at chosen steps and at its last evaluation,
its test bpb, and how far it ends from a reference run. It reads the CSV and computes nothing but
that ratio.

lr_sweep.py imports `render` from here, so `lr_sweep.render` and its `--render` are as they were;
convergence.py's `--render` calls `lr_sweep.render`, and experiments/render_results.py runs both
commands for docs/results' pages. This module imports nothing from lr_sweep.py.
"""

from __future__ import annotations

import csv
import math

# A results CSV's columns that are measurements; every other column names the run.
MEASURED = ('step', 'split', 'bpb', 'loss', 'wall_s')


def _number(text):
  try:
    return float(text)
  except ValueError:
    return math.inf


def _select(name: str, run: dict) -> bool:
  """`recipe`, `recipe@rate` (as the run directories are named), either with `/column=value`
  parts for the CSV's other columns (`/beta=0`), matches this run. The recipe is the run's first
  column (`recipe`; convergence.py's `run`)."""
  name, *more = name.split('/')
  recipe, _, rate = name.partition('@')
  wanted = dict(part.split('=', 1) for part in more)
  if rate:
    wanted['rate'] = rate
  return next(iter(run.values())) == recipe and all(
    _number(run.get(k, '')) == _number(v) if _number(v) != math.inf else run.get(k) == v
    for k, v in wanted.items()
  )


def render(path: str, names=None, versus=None, at=()) -> str:
  """The markdown table of a results CSV (grid.csv, final.csv, or one of docs/results' CSVs with
  the same columns plus seed, steps or beta): a row per run, its validation bpb at each step of
  `at` and at its last evaluation, its test bpb where the CSV has one, and how far that last bpb
  is from the run `versus` (`recipe` or `recipe@rate`) of the same seed. Seeds are columns.
  `names` (each `recipe` or `recipe@rate`) picks the rows and their order; by default every run
  in the CSV, sorted. Nothing is computed but that ratio: the bpbs are the CSV's, rounded."""
  with open(path) as f:
    rows = list(csv.DictReader(f))
  if not rows:
    raise SystemExit(f'{path}: no rows')
  keys = [k for k in rows[0] if k not in MEASURED and k != 'seed']
  # the run's name first (recipe; convergence.py's run), then the other columns that tell runs apart
  keys.sort(key=lambda k: k not in ('recipe', 'run'))
  runs = _runs_of(rows, keys)  # run key -> seed -> split -> [(step, bpb)]
  seeds = sorted({seed for by_seed in runs.values() for seed in by_seed}, key=_number)
  described = [dict(zip(keys, run)) for run in runs]
  order = _ordered(path, names, described, keys)

  def curve(run, seed, split='validation'):
    return sorted(runs[tuple(run[k] for k in keys)].get(seed, {}).get(split, []))

  reference = _reference_bpbs(path, versus, described, seeds, curve)
  last_steps = {curve(run, seed)[-1][0] for run in order for seed in seeds if curve(run, seed)}
  # one last step for every run, or each run's own `steps` column: no column of last steps
  same_end = len(last_steps) == 1
  own_end = 'steps' in keys and all(
    curve(run, seed)[-1][0] == int(run['steps'])
    for run in order
    for seed in seeds
    if curve(run, seed)
  )
  tested = any(curve(run, seed, 'test') for run in order for seed in seeds)
  head = list(keys)
  for seed in seeds:
    tag = f'seed {seed}: ' if len(seeds) > 1 else ''
    head += _seed_head(tag, at, last_steps, same_end, own_end, tested, versus)
  one_end = same_end or own_end
  cells = [
    _row_cells(run, keys, seeds, at, curve, one_end, tested, versus, reference) for run in order
  ]
  lines = ['| ' + ' | '.join(head) + ' |', '|' + '---|' * len(head)]
  return '\n'.join(lines + ['| ' + ' | '.join(row) + ' |' for row in cells])


def _runs_of(rows: list[dict], keys: list[str]) -> dict:
  """The CSV's curves: run key (its `keys` columns) -> seed -> split -> [(step, bpb)]."""
  runs = {}
  for r in rows:
    run = tuple(r[k] for k in keys)
    split = r.get('split') or 'validation'
    curve = runs.setdefault(run, {}).setdefault(r.get('seed', ''), {}).setdefault(split, [])
    curve.append((int(r['step']), float(r['bpb'])))
  return runs


def _ordered(path: str, names, described: list[dict], keys: list[str]) -> list[dict]:
  """The runs of the table in order: those `names` picks, in its order, or every run sorted."""
  if not names:
    return sorted(described, key=lambda run: [run[keys[0]]] + [_number(run[k]) for k in keys[1:]])
  order = []
  for name in names:
    hits = [run for run in described if _select(name, run)]
    if not hits:
      raise SystemExit(f'{path}: no run {name}')
    order += [run for run in hits if run not in order]
  return order


def _reference_bpbs(path: str, versus, described: list[dict], seeds: list, curve) -> dict:
  """seed -> the last validation bpb of the one run `versus` names ({} without `versus`)."""
  if not versus:
    return {}
  hits = [run for run in described if _select(versus, run)]
  if len(hits) != 1:
    raise SystemExit(
      f'{path}: {len(hits)} runs match {versus}: name one (recipe@rate/column=value)'
    )
  (ref,) = hits
  return {seed: curve(ref, seed)[-1][1] for seed in seeds if curve(ref, seed)}


def _seed_head(tag: str, at, last_steps, same_end, own_end, tested, versus) -> list[str]:
  """The header cells of one seed's columns (`tag` names the seed where there are several)."""
  head = [f'{tag}val bpb, step {step}' for step in at]
  head += [
    f'{tag}val bpb, step {min(last_steps)}'
    if same_end
    else f'{tag}val bpb, last step' + (' (steps)' if own_end else '')
  ]
  head += [] if same_end or own_end else [f'{tag}last step']
  head += [f'{tag}test bpb'] if tested else []
  head += [f'{tag}vs {versus}'] if versus else []
  return head


def _row_cells(run, keys, seeds, at, curve, one_end, tested, versus, reference) -> list[str]:
  """The cells of one run's row: its key columns, then per seed its bpbs (blank where it has no
  curve of that seed)."""
  row = [run[k] if k != 'rate' else f'{float(run[k]):g}' for k in keys]
  for seed in seeds:
    val = curve(run, seed)
    width = len(at) + (1 if one_end else 2) + tested + bool(versus)
    if not val:
      row += [''] * width
      continue
    at_step = dict(val)
    row += [f'{at_step[step]:.4f}' if step in at_step else '' for step in at]
    row += [f'{val[-1][1]:.4f}'] + ([] if one_end else [str(val[-1][0])])
    if tested:
      test = curve(run, seed, 'test')
      row += [f'{test[-1][1]:.4f}' if test else '']
    if versus:
      row += [f'{val[-1][1] / reference[seed] - 1:+.2%}' if seed in reference else '']
  return row
