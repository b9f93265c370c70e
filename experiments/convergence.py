"""Convergence of Ouroboros against backprop on the embedded corpus, same steps and tokens.

Trains the same model from the same initialisation on the same batches with

    backprop                     (exact gradients, one device; AdamW, and Muon: backprop-muon)
    ouroboros G=2 graph/replay   (delayed gradients on a ring of 2 devices)
    ouroboros G=4 graph/replay   (ring of 4 devices)
    pipelined G=2/4 graph/replay (the pipelined forward, docs/algorithm.md)

and writes, under --out (default experiments/results/convergence):

    convergence.csv   run, step, split, loss, bpb, wall_s  (every evaluation of every run)
    convergence.png   validation bits per byte against step
    summary.md        the final validation / test bpb of each run, as a table

On a CPU machine the stage devices are simulated (--cpu-devices, default 4): this measures how
delayed gradients change *what is learned per step*, not speed (see `ouroboros bench` for that).

    python experiments/convergence.py                      # tiny preset, ~30 min on 2 CPU cores
    python experiments/convergence.py --steps 300 --runs backprop,ouroboros-g2-graph
    python experiments/convergence.py --reuse     # finish an interrupted experiment
    python experiments/convergence.py --render docs/results/archive/convergence_recipe.csv  # table
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys

# Every Ouroboros run uses the library's defaults ('auto'): the measured recipe (Muon + weight
# prediction + DC-ASGD; Muon + prediction with replay) for G > 1. Add `--set compensation=none
# --set optimizer=adamw` for the paper's method. 'backprop' is backprop with AdamW (the default
# before every schedule trained with Muon); backprop-muon, today's default for backprop, is the
# best synchronous run of experiments/lr_sweep.py (Muon at its best rate there, 0.04).
RUNS = {
  'backprop': dict(schedule='backprop', stages=1, optimizer='adamw'),
  'backprop-muon': dict(schedule='backprop', stages=1, optimizer='muon', muon_learning_rate=0.04),
  'ouroboros-g2-graph': dict(schedule='ouroboros', stages=2, stash='graph'),
  'ouroboros-g2-replay': dict(schedule='ouroboros', stages=2, stash='replay'),
  'ouroboros-g4-graph': dict(schedule='ouroboros', stages=4, stash='graph'),
  'ouroboros-g4-replay': dict(schedule='ouroboros', stages=4, stash='replay'),
  'pipelined-g2-graph': dict(schedule='ouroboros', stages=2, stash='graph', forward='pipelined'),
  'pipelined-g2-replay': dict(schedule='ouroboros', stages=2, stash='replay', forward='pipelined'),
  'pipelined-g4-graph': dict(schedule='ouroboros', stages=4, stash='graph', forward='pipelined'),
  'pipelined-g4-replay': dict(schedule='ouroboros', stages=4, stash='replay', forward='pipelined'),
}


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--preset', default='tiny')
  parser.add_argument('--steps', type=int, default=None, help="override the preset's steps")
  parser.add_argument('--eval-every', type=int, default=100)
  parser.add_argument(
    '--runs', default=','.join(RUNS), help='comma-separated subset of: ' + ', '.join(RUNS)
  )
  parser.add_argument('--out', default='experiments/results/convergence')
  parser.add_argument('--cpu-devices', type=int, default=4)
  parser.add_argument(
    '--reuse',
    action='store_true',
    help='keep a run whose summary.json exists under --out instead of training '
    'it again (to finish an interrupted experiment)',
  )
  parser.add_argument(
    '--set',
    action='append',
    default=[],
    metavar='FIELD=VALUE',
    help='any other TrainConfig/ModelConfig override, e.g. --set d_model=64',
  )
  parser.add_argument(
    '--render',
    metavar='CSV',
    help='print the markdown table of a written convergence.csv (final validation and test bpb '
    'of each run) and stop; trains nothing',
  )
  parser.add_argument('--versus', metavar='RUN', help='with --render: a column against this run')
  parser.add_argument(
    '--at',
    type=lambda text: tuple(int(s) for s in text.split(',')),
    default=(),
    help='with --render: validation bpb columns at these steps too',
  )
  return parser.parse_args(argv)


def render(path, runs=None, versus=None, at=()):
  """The table of a convergence.csv: lr_sweep.py's --render, whose columns these are (`run`
  for `recipe`)."""
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  import lr_sweep

  return lr_sweep.render(path, runs, versus, at)


def validation_rows(name: str, out: str) -> list[dict]:
  """convergence.csv's rows of run `name`: every validation and test evaluation in its
  metrics.jsonl under `out`."""
  rows = []
  with open(os.path.join(out, 'metrics.jsonl')) as f:
    for line in f:
      row = json.loads(line)
      if row['split'] in ('validation', 'test'):
        rows.append(
          {
            'run': name,
            'step': row['step'],
            'split': row['split'],
            'loss': row['loss'],
            'bpb': row['bpb'],
            'wall_s': row['wall_s'],
          }
        )
  return rows


def write_csv(out: str, rows: list[dict]) -> None:
  """Writes convergence.csv under `out` (creating the directory)."""
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, 'convergence.csv'), 'w', newline='') as f:
    writer = csv.DictWriter(f, fieldnames=['run', 'step', 'split', 'loss', 'bpb', 'wall_s'])
    writer.writeheader()
    writer.writerows(rows)


def write_summary(out: str, finals: list[tuple]) -> str:
  """The markdown table of each run's final summary, also written to summary.md under `out`."""
  table = [
    '| run | final val bpb | test bpb | steps | tokens/s (simulated devices) |',
    '|---|---|---|---|---|',
  ]
  for name, s in finals:
    table.append(
      f'| {name} | {s["val_bpb"]:.4f} | {s["test_bpb"]:.4f} | {s["step"]} | '
      f'{s["tokens_per_s"]:.0f} |'
    )
  text = '\n'.join(table)
  with open(os.path.join(out, 'summary.md'), 'w') as f:
    f.write(text + '\n')
  return text


def plot(out: str, names: list[str], rows: list[dict], preset: str) -> None:
  """Writes convergence.png under `out`: each run's validation bpb against step."""
  import matplotlib

  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(7, 4.5))
  for name in names:
    pts = [(r['step'], r['bpb']) for r in rows if r['run'] == name and r['split'] == 'validation']
    ax.plot(*zip(*sorted(pts)), marker='o', markersize=3, label=name)
  ax.set_xlabel('step (same batches for every run)')
  ax.set_ylabel('validation bits per byte')
  ax.set_title(f'Ouroboros vs backprop, preset {preset}')
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(os.path.join(out, 'convergence.png'), dpi=120)


def main(argv=None):
  args = parse_args(argv)
  if args.render:
    explicit = args.runs != ','.join(RUNS)
    print(render(args.render, args.runs.split(',') if explicit else None, args.versus, args.at))
    return
  import jax

  from ouroboros_jax.runtime import host
  from ouroboros_jax.training import config, field_flags, loop, presets

  host.configure_cpu_runtime()  # before any device is touched
  jax.config.update('jax_num_cpu_devices', args.cpu_devices)

  names = [n for n in args.runs.split(',') if n]
  unknown = [n for n in names if n not in RUNS]
  if unknown:
    sys.exit(f'error: unknown run(s) {unknown}; choose from {", ".join(RUNS)}.')
  base = presets.get_preset(args.preset)
  extra = dict(kv.split('=', 1) for kv in args.set)
  typed = {k: config.fields()[k][0](v) if k in config.fields() else v for k, v in extra.items()}
  rows, finals = [], []
  for name in names:
    out = os.path.join(args.out, name)
    done = os.path.join(out, 'summary.json')
    if args.reuse and os.path.exists(done):
      print(f'== {name} (reused)', flush=True)
      with open(done) as f:
        summary = json.load(f)
    else:
      if os.path.isdir(out):  # a fresh run: an earlier one would be resumed otherwise
        import shutil

        shutil.rmtree(out)
      values = dict(out=out, eval_every=args.eval_every, **RUNS[name], **typed)
      if args.steps:
        values['steps'] = args.steps
      cfg = field_flags.override(base, values)
      print(f'== {name}', flush=True)
      summary = loop.train(cfg, quiet=True)
    rows.extend(validation_rows(name, out))
    finals.append((name, summary))

  write_csv(args.out, rows)
  print(write_summary(args.out, finals))
  plot(args.out, names, rows, args.preset)
  print(f'wrote {args.out}/convergence.csv, convergence.png, summary.md')


if __name__ == '__main__':
  main()
