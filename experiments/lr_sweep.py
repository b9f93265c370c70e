"""Best versus best: each schedule and recipe at its own best learning rate, on the same batches.

Two phases, both on the tiny preset made 4 layers deep (so G = 4 has a layer per stage):

    grid    every recipe over a coarse grid of peak rates around its optimizer's known best, in
            short runs (--grid-steps, default 200; the cosine schedule spans the short run);
    final   every recipe at the rate that won its grid, for --final-steps (default 1000),
            evaluated every --eval-every steps.

A recipe is a schedule (backprop; Ouroboros G=2 / G=4 locked; G=2 pipelined) with an optimizer
(AdamW, NAdamW b1 0.99, Muon) and a staleness compensation (compensation.py). The rate swept is
--learning-rate for AdamW/NAdamW and --muon-learning-rate for Muon (whose Adam part, on
embeddings, norms and biases, stays at the preset's 5e-3). Every run starts from the same
initialisation and reads the same batches (seed 0); stage devices are simulated on the CPU: this
measures what is learned per step, not speed (`ouroboros bench` measures that).

Writes, under --out (default experiments/results/lr_sweep):

    grid.csv, final.csv   recipe, rate, step, split, bpb for every evaluation
    summary.md            the best rate of each recipe and its final validation bpb, the gap to
                          the best synchronous run, and the steps each needs to reach backprop's
                          final bpb (time to quality: see --bench)
    lr_sweep.png          final bpb against rate (grid) and bpb against step (final)

    python experiments/lr_sweep.py                     # ~1.5 hours on 2 cores
    python experiments/lr_sweep.py --recipes backprop-adamw,g2-muon-predict --phases grid
    python experiments/lr_sweep.py --reuse             # finish an interrupted sweep
    python experiments/lr_sweep.py --render docs/results/stream_ring_1000.csv  # a CSV's table
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from sweep_tables import render  # noqa: E402  (--render's table; lr_sweep.render as before)

OUROBOROS = dict(schedule='ouroboros', stages=2)
G4 = dict(schedule='ouroboros', stages=4)
PIPELINED = dict(schedule='ouroboros', stages=2, forward='pipelined')
G8 = dict(schedule='ouroboros', stages=8, num_layers=8)
PIPELINED_G4 = dict(schedule='ouroboros', stages=4, forward='pipelined')


def stream(microbatches):
  """The streamed ring (--flow stream): M micro-batches per update flow across updates, so
  every group's gradient is ceil(lag / M) updates old: 1 once M reaches the ring's lag."""
  return dict(microbatches=microbatches, flow='stream')


STREAM4 = stream(4)  # G = 4 locked and pipelined G = 2: every gradient one update old
# The library's default recipe for Ouroboros (Muon + weight prediction + DC-ASGD).
DEFAULT_RECIPE = dict(optimizer='muon', compensation='predict,dc')
ADAMW_RATES = (2.5e-3, 5e-3, 1e-2)
MUON_RATES = (0.01, 0.02, 0.04, 0.08)

# name -> (config overrides, grid of rates). One rate: the grid is skipped, that rate is final.
RECIPES = {
  'backprop-adamw': (dict(schedule='backprop'), ADAMW_RATES),
  'backprop-muon': (dict(schedule='backprop', optimizer='muon'), MUON_RATES),
  'g2-adamw': (dict(OUROBOROS), (5e-4, 1e-3, 2.5e-3, 5e-3)),
  'g2-adamw-predict': (dict(OUROBOROS, compensation='predict'), (2.5e-3,)),
  'g2-nadamw': (dict(OUROBOROS, optimizer='nadamw'), (2.5e-3,)),
  'g2-adamw-warmup100': (dict(OUROBOROS, sync_warmup_steps=100), (5e-3,)),
  'g2-muon': (dict(OUROBOROS, optimizer='muon'), MUON_RATES),
  'g2-muon-predict': (dict(OUROBOROS, optimizer='muon', compensation='predict'), MUON_RATES),
  'g2-muon-pipemare': (dict(OUROBOROS, optimizer='muon', compensation='pipemare'), (0.02,)),
  'g2-muon-dc': (dict(OUROBOROS, optimizer='muon', compensation='dc'), (0.02,)),
  'g2-muon-shrink': (dict(OUROBOROS, optimizer='muon', compensation='shrink'), (0.02,)),
  'g2-muon-predict-pipemare': (
    dict(OUROBOROS, optimizer='muon', compensation='predict,pipemare'),
    (0.02,),
  ),
  'g2-muon-predict-dc': (dict(OUROBOROS, optimizer='muon', compensation='predict,dc'), (0.02,)),
  'g2-muon-predict-beta0.98': (
    dict(OUROBOROS, optimizer='muon', compensation='predict', momentum=0.98),
    (0.02,),
  ),
  'g4-muon-predict': (dict(G4, optimizer='muon', compensation='predict'), (0.02,)),
  'pipelined-g2-muon-predict': (dict(PIPELINED, optimizer='muon', compensation='predict'), (0.02,)),
  # The deeper delays (G = 4: module 1 four steps behind; pipelined: twice the locked gaps)
  # with the default recipe and its own grid, and the levers that could matter more there:
  # less momentum (asynchrony acts as momentum: Mitliagkas et al. 2016), PipeMare's rate
  # rescheduling, a synchronous warm-up through the early steps where staleness hurts most.
  'g4-muon-predict-dc': (
    dict(G4, optimizer='muon', compensation='predict,dc'),
    (0.005, 0.01, 0.02),
  ),
  'g4-muon-predict-dc-beta0.9': (
    dict(G4, optimizer='muon', compensation='predict,dc', momentum=0.9),
    (0.01,),
  ),
  'g4-muon-predict-dc-pipemare': (
    dict(G4, optimizer='muon', compensation='predict,dc,pipemare'),
    (0.01,),
  ),
  'g4-muon-predict-dc-warmup50': (
    dict(G4, optimizer='muon', compensation='predict,dc', sync_warmup_steps=50),
    (0.01,),
  ),
  'pipelined-g2-muon-predict-dc': (
    dict(PIPELINED, optimizer='muon', compensation='predict,dc'),
    (0.005, 0.01, 0.02),
  ),
  'pipelined-g2-muon-predict-dc-beta0.9': (
    dict(PIPELINED, optimizer='muon', compensation='predict,dc', momentum=0.9),
    (0.01,),
  ),
  'pipelined-g2-muon-predict-dc-pipemare': (
    dict(PIPELINED, optimizer='muon', compensation='predict,dc,pipemare'),
    (0.01,),
  ),
  'pipelined-g2-muon-predict-dc-warmup50': (
    dict(PIPELINED, optimizer='muon', compensation='predict,dc', sync_warmup_steps=50),
    (0.01,),
  ),
  # Muon leaves embeddings, norms and biases to Adam, the staleness-fragile optimizer: a lower
  # Adam rate there; and a longer rate warm-up through the early steps where delay hurts most.
  'g4-muon-predict-dc-adam2.5e-3': (
    dict(G4, optimizer='muon', compensation='predict,dc', learning_rate=2.5e-3),
    (0.01,),
  ),
  'g4-muon-predict-dc-lrwarmup200': (
    dict(G4, optimizer='muon', compensation='predict,dc', warmup_steps=200),
    (0.01,),
  ),
  'pipelined-g2-muon-predict-dc-adam2.5e-3': (
    dict(PIPELINED, optimizer='muon', compensation='predict,dc', learning_rate=2.5e-3),
    (0.01,),
  ),
  'pipelined-g2-muon-predict-dc-lrwarmup200': (
    dict(PIPELINED, optimizer='muon', compensation='predict,dc', warmup_steps=200),
    (0.01,),
  ),
  'g4-stream4-muon-predict-dc': (
    dict(G4, **STREAM4, optimizer='muon', compensation='predict,dc'),
    (0.02,),
  ),
  # The same, its per-weight optimizer and compensation state stored in bfloat16 (--state-dtype,
  # the default under --dtype bfloat16); this preset computes in float32, so only the state's
  # precision differs from the recipe above (docs/results/precision.md).
  'g4-stream4-muon-predict-dc-state-bf16': (
    dict(G4, **STREAM4, optimizer='muon', compensation='predict,dc', state_dtype='bfloat16'),
    (0.02,),
  ),
  # G = 2 locked (the default stage count) streamed with M = 2: both gaps 1 (as one batch: 2, 1).
  'g2-stream2-muon-predict-dc': (
    dict(OUROBOROS, microbatches=2, flow='stream', optimizer='muon', compensation='predict,dc'),
    (0.02,),
  ),
  'pipelined-g2-stream4-muon-predict-dc': (
    dict(PIPELINED, **STREAM4, optimizer='muon', compensation='predict,dc'),
    (0.02,),
  ),
  # Levers on the streamed ring (every gap one update): AsyncPP's look-ahead (Ajanthan et al.,
  # ICML 2025: Nesterov momentum with a long memory, 0.99, so the look-ahead reaches past the
  # delay) applied to Muon's Nesterov momentum; and less momentum, since asynchrony itself acts
  # as momentum (Mitliagkas et al. 2016).
  'g4-stream4-muon-predict-dc-beta0.99': (
    dict(G4, **STREAM4, optimizer='muon', compensation='predict,dc', momentum=0.99),
    (0.02,),
  ),
  'g4-stream4-muon-predict-dc-beta0.9': (
    dict(G4, **STREAM4, optimizer='muon', compensation='predict,dc', momentum=0.9),
    (0.02,),
  ),
  # Pipelined G = 4 (gaps 8, 6, 4, 2 as one batch; streamed with M = 8: every gap 1).
  'pipelined-g4-muon-predict-dc': (
    dict(PIPELINED_G4, optimizer='muon', compensation='predict,dc'),
    (0.01,),
  ),
  'pipelined-g4-stream8-muon-predict-dc': (
    dict(PIPELINED_G4, microbatches=8, flow='stream', optimizer='muon', compensation='predict,dc'),
    (0.02,),
  ),
  # Exact gradients with the same lower momentum, to keep the comparison like with like, and
  # every streamed setting at it.
  'backprop-muon-beta0.9': (dict(schedule='backprop', optimizer='muon', momentum=0.9), (0.04,)),
  'pipelined-g4-stream8-muon-predict-dc-beta0.9': (
    dict(PIPELINED_G4, **stream(8), **DEFAULT_RECIPE, momentum=0.9),
    (0.01,),
  ),
  'g2-stream2-muon-predict-dc-beta0.9': (
    dict(OUROBOROS, **stream(2), **DEFAULT_RECIPE, momentum=0.9),
    (0.02,),
  ),
  'pipelined-g2-stream4-muon-predict-dc-beta0.9': (
    dict(PIPELINED, **stream(4), **DEFAULT_RECIPE, momentum=0.9),
    (0.02,),
  ),
  # backprop at half its 1000-step rate, for the 5000-step pairs (a longer run may want less)
  'backprop-muon-0.02': (dict(schedule='backprop', optimizer='muon'), (0.02,)),
  # G = 8 needs 8 layers: its own best synchronous run at that depth.
  'backprop-muon-8l': (dict(schedule='backprop', optimizer='muon', num_layers=8), (0.04,)),
  'backprop-muon-8l-beta0.9': (
    dict(schedule='backprop', optimizer='muon', num_layers=8, momentum=0.9),
    (0.04,),
  ),
  'g8-stream8-muon-predict-dc': (
    dict(G8, microbatches=8, flow='stream', optimizer='muon', compensation='predict,dc'),
    (0.02,),
  ),
}
SYNCHRONOUS = (
  'backprop-adamw',
  'backprop-muon',
  'backprop-muon-0.02',
)  # (backprop-muon-8l: G = 8's, 8 layers)
# Recipes without a grid of their own take the best rate of another's (G = 4 and pipelined: the
# G = 2 locked recipe's), to keep the sweep short; their own best may differ.
INHERIT = {'g4-muon-predict': 'g2-muon-predict', 'pipelined-g2-muon-predict': 'g2-muon-predict'}
# Recipes trained for --final-steps at their best rate; the others are ablations at grid length.
# A finalist with one rate skips the grid (G=4 and pipelined take the G=2 recipe's best rate).
FINALISTS = (
  'backprop-adamw',
  'backprop-muon',
  'g2-adamw',
  'g2-muon-predict',
  'g2-muon-predict-dc',
  'g4-muon-predict',
  'pipelined-g2-muon-predict',
  'g4-muon-predict-dc',
  'pipelined-g2-muon-predict-dc',
  'g4-stream4-muon-predict-dc',
  'g4-stream4-muon-predict-dc-state-bf16',
  'g2-stream2-muon-predict-dc',
  'pipelined-g2-stream4-muon-predict-dc',
  'pipelined-g4-muon-predict-dc',
  'pipelined-g4-stream8-muon-predict-dc',
  'backprop-muon-8l',
  'backprop-muon-0.02',
  'g8-stream8-muon-predict-dc',
)


for _overrides, _ in RECIPES.values():  # explicit, so the library's 'auto' defaults do not leak in
  _overrides.setdefault('optimizer', 'adamw')
  _overrides.setdefault('compensation', 'none')
  if _overrides['schedule'] == 'ouroboros':
    _overrides.setdefault('flow', 'batch')


def rate_field(overrides: dict) -> str:
  return 'muon_learning_rate' if overrides.get('optimizer') == 'muon' else 'learning_rate'


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument(
    '--recipes',
    default=None,
    help='comma-separated subset of (default: all): '
    + ', '.join(RECIPES)
    + '; with --render, each may be recipe@rate and picks the rows in that order',
  )
  parser.add_argument('--phases', default='grid,final', help='grid, final, or both')
  parser.add_argument('--grid-steps', type=int, default=200)
  parser.add_argument(
    '--grid-eval-every',
    type=int,
    default=None,
    help='grid runs: evaluate every N steps as well (default: only at the end)',
  )
  parser.add_argument(
    '--rates',
    type=lambda text: tuple(float(r) for r in text.split(',')),
    help="comma-separated rates for the grid in place of each recipe's own (e.g. 0.01,0.02,0.04)",
  )
  parser.add_argument('--final-steps', type=int, default=1000)
  parser.add_argument('--eval-every', type=int, default=100, help='final runs')
  parser.add_argument('--eval-batches', type=int, default=40)
  parser.add_argument('--out', default='experiments/results/lr_sweep')
  parser.add_argument(
    '--reuse', action='store_true', help='keep runs whose summary.json exists under --out'
  )
  parser.add_argument(
    '--seed',
    type=int,
    default=0,
    help='initialisation and batch order of every run (a second seed checks a small margin)',
  )
  parser.add_argument(
    '--bench',
    default='docs/results/bench_2proc_cpu.csv',
    help='measured step times (ouroboros bench CSV, AdamW) for time to quality',
  )
  parser.add_argument(
    '--render',
    metavar='CSV',
    help="print the markdown table of a written CSV (this script's grid.csv / final.csv, or "
    "docs/results' CSVs of its runs) and stop; trains nothing",
  )
  parser.add_argument(
    '--versus',
    metavar='RECIPE[@RATE][/COLUMN=VALUE]',
    help="with --render: a column of each run's last bpb against this run's (same seed)",
  )
  parser.add_argument(
    '--at',
    type=lambda text: tuple(int(s) for s in text.split(',')),
    default=(),
    help='with --render: validation bpb columns at these steps too (e.g. 500,1000,2000)',
  )
  return parser.parse_args(argv)


def train_one(base, overrides, rate, steps, eval_every, eval_batches, out, reuse, seed=0):
  from ouroboros_jax.training import field_flags, loop

  done = os.path.join(out, 'summary.json')
  if not (reuse and os.path.exists(done)):
    if os.path.isdir(out):
      shutil.rmtree(out)
    values = dict(
      {'num_layers': 4, **overrides},
      out=out,
      steps=steps,
      eval_every=eval_every,
      eval_batches=eval_batches,
      checkpoint_every=10 * steps,
      seed=seed,
    )
    values[rate_field(overrides)] = rate
    loop.train(field_flags.override(base, values), quiet=True)
  rows = []
  with open(os.path.join(out, 'metrics.jsonl')) as f:
    for line in f:
      row = json.loads(line)
      if row['split'] == 'validation':
        rows.append((row['step'], row['bpb']))
  return rows


def run_phase(phase, names, args, base, best=None):
  rows = []
  for name in names:
    overrides, grid = RECIPES[name]
    grid = args.rates or grid
    rates = grid if phase == 'grid' else (best[name],)
    if (phase == 'grid' and len(grid) == 1 and name in FINALISTS) or (
      phase == 'final' and name not in FINALISTS
    ):
      continue
    for rate in rates:
      steps = args.grid_steps if phase == 'grid' else args.final_steps
      every = (args.grid_eval_every or steps) if phase == 'grid' else args.eval_every
      out = os.path.join(args.out, phase, f'{name}@{rate:g}')
      print(f'== {phase} {name} rate {rate:g}', flush=True)
      for step, bpb in train_one(
        base, overrides, rate, steps, every, args.eval_batches, out, args.reuse, args.seed
      ):
        rows.append({'recipe': name, 'rate': rate, 'step': step, 'bpb': bpb})
  with open(os.path.join(args.out, f'{phase}.csv'), 'w', newline='') as f:
    writer = csv.DictWriter(f, fieldnames=['recipe', 'rate', 'step', 'bpb'])
    writer.writeheader()
    writer.writerows(rows)
  return rows


def read_csv(path):
  with open(path) as f:
    return [
      dict(r, rate=float(r['rate']), step=int(r['step']), bpb=float(r['bpb']))
      for r in csv.DictReader(f)
    ]


def best_rates(grid_rows, names):
  """Each recipe's rate with the lowest final validation bpb in the grid (its only rate if the
  grid has one)."""
  best = {}
  for name in names:
    grid = RECIPES[name][1]
    finals = {}
    for r in grid_rows:
      if r['recipe'] == name:
        finals[r['rate']] = (r['step'], r['bpb'])  # rows are in step order: the last one wins
    best[name] = min(finals, key=lambda rate: finals[rate][1]) if finals else grid[0]
  for name, source in INHERIT.items():
    if name in best and source in best:
      best[name] = best[source]
  return best


def steps_to_reach(curve, target):
  """First step at which the validation curve reaches target, linearly interpolated between
  evaluations (None if it never does)."""
  prev = None
  for step, bpb in curve:
    if bpb <= target:
      if prev is None:
        return step
      (s0, b0) = prev
      return s0 + (step - s0) * (b0 - target) / (b0 - bpb)
    prev = (step, bpb)
  return None


def step_times(bench_csv):
  """Measured seconds per step by (schedule, stages, forward) from an `ouroboros bench` CSV."""
  if not bench_csv or not os.path.exists(bench_csv):
    return {}
  times = {}
  with open(bench_csv) as f:
    for r in csv.DictReader(f):
      if r['schedule'] == 'backprop':
        times['backprop'] = float(r['step_time_s'])
      elif r['schedule'] == 'ouroboros' and r['stash'] == 'graph':
        micro = int(r['microbatches'] or 1)
        times[(int(r['stages']), r['forward'], micro, r.get('flow', 'batch'))] = float(
          r['step_time_s']
        )
      elif r['schedule'] == 'zb_h1' and r['microbatches'] == '8':
        times['zb_h1'] = float(r['step_time_s'])  # the best exact pipeline measured
  return times


def report(args, names, grid_rows, final_rows, best):
  curves = {n: [(r['step'], r['bpb']) for r in final_rows if r['recipe'] == n] for n in names}
  finals = {n: c[-1][1] for n, c in curves.items() if c}
  sync = [n for n in SYNCHRONOUS if n in finals]
  best_sync = min(sync, key=finals.get) if sync else None  # at the 4-layer depth
  # The schedule's step time from the bench (timed with AdamW, whose update is ~3% of a step
  # there). Muon's orthogonalisation is not in it: see docs/results/quality.md for its cost.
  times = step_times(args.bench)
  lines = final_lines(args, names, curves, finals, best, best_sync, times)
  lines += grid_lines(args, names, grid_rows, best)
  text = '\n'.join(lines)
  with open(os.path.join(args.out, 'summary.md'), 'w') as f:
    f.write(text + '\n')
  print(text)
  plot(args, names, grid_rows, curves)
  print(f'wrote {args.out}/grid.csv, final.csv, summary.md, lr_sweep.png')


def seconds(name, times):
  """The measured step time of recipe `name`'s schedule in `times` (step_times'), nan where
  unknown."""
  overrides = RECIPES[name][0]
  key = (
    'backprop'
    if overrides['schedule'] == 'backprop'
    else (
      overrides['stages'],
      overrides.get('forward', 'locked'),
      overrides.get('microbatches', 1),
      overrides.get('flow', 'batch'),
    )
  )
  return times.get(key, math.nan)


def time_to(name, reference, curves, finals, times):
  """(steps for `name` to reach `reference`'s final bpb, its wall-clock relative to
  `reference`'s own steps to it, and relative to those steps on the best exact pipeline; '-'
  where unknown)."""
  steps = steps_to_reach(curves[name], finals[reference])
  own = steps_to_reach(curves[reference], finals[reference])
  ratio = seconds(name, times) / seconds(reference, times)
  if steps is None:
    return 'not reached', '-', '-'
  # The best exact pipeline trains as backprop does (tested), at its own step time.
  exact = seconds(name, times) / times.get('zb_h1', math.nan)
  show = lambda r: '-' if math.isnan(r) else f'{steps * r / own:.2f}x'
  return f'{steps:.0f}', show(ratio), show(exact)


def final_lines(args, names, curves, finals, best, best_sync, times) -> list[str]:
  """summary.md's first part: what it measures, and the table of the final runs (best rate,
  final bpb, gap to the best synchronous run, time to quality)."""
  lines = [
    f"Final validation bpb after {args.final_steps} steps at each recipe's best rate "
    f'(grid: {args.grid_steps}-step runs). Best synchronous run: {best_sync} '
    f'({finals.get(best_sync, math.nan):.4f}). Time to quality = the steps a recipe needs '
    "to reach a reference's final bpb (interpolated between evaluations) x its step time, "
    "over the reference's; step times of each schedule measured by `ouroboros bench` on 2 "
    f"pinned processes ({args.bench}, AdamW; Muon's own cost is not included).",
    '',
    '| recipe | best rate | final val bpb | vs best sync | step time vs backprop-adamw | '
    "steps to backprop-adamw's bpb | time vs backprop-adamw | steps to best sync's bpb "
    '| time vs best sync | time vs best sync on zb_h1 M=8 |',
    '|---|---|---|---|---|---|---|---|---|---|',
  ]
  for name in names:
    if name not in finals:
      continue
    gap = finals[name] / finals[best_sync] - 1 if best_sync else math.nan
    ratio = (
      seconds(name, times) / seconds('backprop-adamw', times)
      if 'backprop-adamw' in finals
      else math.nan
    )
    to_adamw = (
      time_to(name, 'backprop-adamw', curves, finals, times)
      if 'backprop-adamw' in finals
      else ('-',) * 3
    )
    to_best = time_to(name, best_sync, curves, finals, times) if best_sync else ('-',) * 3
    lines.append(
      f'| {name} | {best[name]:g} | {finals[name]:.4f} | {gap:+.1%} | '
      f'{"-" if math.isnan(ratio) else f"{ratio:.2f}x"} | {to_adamw[0]} | '
      f'{to_adamw[1]} | {to_best[0]} | {to_best[1]} | {to_best[2]} |'
    )
  return lines


def grid_lines(args, names, grid_rows, best) -> list[str]:
  """summary.md's second part: every recipe at grid length, at its best rate (the ablation of
  each compensation)."""
  at_grid = {}
  for r in grid_rows:
    if r['rate'] == best.get(r['recipe']):
      at_grid[r['recipe']] = r['bpb']
  grid_sync = min((at_grid[n] for n in SYNCHRONOUS if n in at_grid), default=math.nan)
  lines = [
    '',
    f'Grid ({args.grid_steps} steps, each recipe at its best rate of the grid; '
    'one rate where the grid lists one):',
    '',
    '| recipe | rates tried | best rate | val bpb | vs best sync |',
    '|---|---|---|---|---|',
  ]
  for name in names:
    if name in at_grid:
      rates = ', '.join(f'{r:g}' for r in RECIPES[name][1])
      lines.append(
        f'| {name} | {rates} | {best[name]:g} | {at_grid[name]:.4f} | '
        f'{at_grid[name] / grid_sync - 1:+.1%} |'
      )
  return lines


def plot(args, names, grid_rows, curves) -> None:
  """Writes lr_sweep.png under --out: final bpb against rate (grid), bpb against step (final)."""
  import matplotlib

  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
  for name in names:
    pts = sorted((r['rate'], r['bpb']) for r in grid_rows if r['recipe'] == name)
    if len(pts) > 1:
      left.plot(*zip(*pts), marker='o', label=name)
    if curves.get(name):
      right.plot(*zip(*curves[name]), marker='.', label=name)
  left.set_xscale('log')
  left.set_xlabel('peak rate (AdamW/NAdamW: --learning-rate; Muon: --muon-learning-rate)')
  left.set_ylabel(f'validation bpb after {args.grid_steps} steps')
  right.set_xlabel('step (same batches for every run)')
  right.set_ylabel('validation bits per byte')
  right.set_ylim(top=min(5.0, right.get_ylim()[1]))
  for ax in (left, right):
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
  left.set_title('grid: final bpb against rate')
  right.set_title('each recipe at its best rate')
  fig.tight_layout()
  fig.savefig(os.path.join(args.out, 'lr_sweep.png'), dpi=120)


def main(argv=None):
  args = parse_args(argv)
  if args.render:
    names = args.recipes.split(',') if args.recipes else None
    print(render(args.render, names, args.versus, args.at))
    return
  import jax

  from ouroboros_jax.runtime import host
  from ouroboros_jax.training import presets

  host.configure_cpu_runtime()
  jax.config.update('jax_num_cpu_devices', 8)  # G = 8 has a device per stage
  names = [n for n in (args.recipes or ','.join(RECIPES)).split(',') if n]
  unknown = [n for n in names if n not in RECIPES]
  if unknown:
    sys.exit(f'error: unknown recipe(s) {unknown}; choose from {", ".join(RECIPES)}.')
  os.makedirs(args.out, exist_ok=True)
  base = presets.get_preset('tiny')
  phases = args.phases.split(',')
  grid_path = os.path.join(args.out, 'grid.csv')
  grid_rows = (
    run_phase('grid', names, args, base)
    if 'grid' in phases
    else read_csv(grid_path)
    if os.path.exists(grid_path)
    else []
  )
  best = best_rates(grid_rows, names)
  final_path = os.path.join(args.out, 'final.csv')
  final_rows = (
    run_phase('final', names, args, base, best)
    if 'final' in phases
    else read_csv(final_path)
    if os.path.exists(final_path)
    else []
  )
  report(args, names, grid_rows, final_rows, best)


if __name__ == '__main__':
  main()
