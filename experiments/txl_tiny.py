"""Transformer-XL against the GPT model at the same wall-clock, on the embedded corpus.

Trains the `tiny` preset (GPT, random windows) and the `txl-tiny` preset (Transformer-XL with a
memory, contiguous segments) with plain backprop on this machine, one after the other, evaluating
every --eval-every steps, and compares validation bits per byte against training time
(`train_s`: compilation included, evaluation and checkpoints excluded). Writes, under --out
(default experiments/results/txl_tiny):

    txl_tiny.csv   run, step, train_s, val_bpb
    txl_tiny.png   validation bpb against training time
    summary.md     each run's final bpb and time, and txl-tiny's bpb at tiny's final time

    python experiments/txl_tiny.py            # ~10 min on 2 quiet CPU cores
    python experiments/txl_tiny.py --run tiny-muon=tiny,optimizer=muon \
        --run txl-mem-muon=txl-tiny,mem_len=64,steps=1400,optimizer=muon

`--run LABEL=PRESET[,FIELD=VALUE...]` (repeated) chooses the runs; the first one sets the time
budget every other run is read at (default: tiny, then txl-tiny).

    python experiments/txl_tiny.py --render docs/results/transformer_xl/txl_tiny.csv

prints the table of a written txl_tiny.csv (each run's last evaluation, and its validation bpb at
the first run's final time) and trains nothing; docs/results/transformer_xl.md's tables are its.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil

import numpy as np

DEFAULT_RUNS = ('tiny=tiny', 'txl-tiny=txl-tiny')


def parse_run(text: str, fields: dict) -> tuple[str, str, dict]:
  """'LABEL=PRESET[,FIELD=VALUE...]' -> (label, preset, typed overrides)."""
  label, _, spec = text.partition('=')
  preset, *pairs = spec.split(',')
  values = dict(pair.split('=', 1) for pair in pairs)
  unknown = sorted(set(values) - set(fields))
  if not label or not preset or unknown:
    raise SystemExit(
      f'error: bad --run {text!r}; write LABEL=PRESET[,FIELD=VALUE...] with known fields'
    )
  typed = lambda kind, v: v.lower() in ('1', 'true', 'yes') if kind is bool else kind(v)
  return label, preset, {k: typed(fields[k][0], v) for k, v in values.items()}


def read_rows(path: str) -> list[dict]:
  with open(path, newline='') as f:
    return [
      {'run': r['run'], 'step': int(r['step']), 'train_s': float(r['train_s']),
       'val_bpb': float(r['val_bpb'])}
      for r in csv.DictReader(f)
    ]  # fmt: skip


def render(rows: list[dict]) -> str:
  """The markdown table of txl_tiny.csv's rows: per run (in the CSV's order) its last
  evaluation's step, training time and validation bpb, and its validation bpb at the first run's
  final time, interpolated between evaluations (a run that ended sooner: its last one)."""
  runs = list(dict.fromkeys(r['run'] for r in rows))
  curve = lambda name: sorted(
    (r['train_s'], r['val_bpb'], r['step']) for r in rows if r['run'] == name
  )
  budget, reference = curve(runs[0])[-1][:2]
  lines = [
    f"| run | steps | train s | val bpb | val bpb at {runs[0]}'s {budget:.0f} s |",
    '|---|---|---|---|---|',
  ]
  for name in runs:
    times, bpbs, steps = zip(*curve(name))
    if times[0] > budget:
      at = '-'
    else:
      value = float(np.interp(budget, times, bpbs))
      at = f'{value:.4f}' if name == runs[0] else f'{value:.4f} ({value - reference:+.3f}'
      if name != runs[0]:
        at += f', its end at {times[-1]:.0f} s)' if times[-1] < budget else ')'
    lines.append(f'| {name} | {steps[-1]} | {times[-1]:.0f} | {bpbs[-1]:.4f} | {at} |')
  return '\n'.join(lines)


def validation_rows(name: str, out: str) -> list[dict]:
  """txl_tiny.csv's rows of run `name`: every validation evaluation in its metrics.jsonl under
  `out`."""
  rows = []
  with open(os.path.join(out, 'metrics.jsonl')) as f:
    for line in f:
      row = json.loads(line)
      if row['split'] == 'validation':
        rows.append({'run': name, 'step': row['step'], 'train_s': row['train_s'],
                     'val_bpb': row['bpb']})  # fmt: skip
  return rows


def write_csv(out: str, rows: list[dict]) -> None:
  """Writes txl_tiny.csv under `out` (creating the directory)."""
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, 'txl_tiny.csv'), 'w', newline='') as f:
    writer = csv.DictWriter(f, fieldnames=['run', 'step', 'train_s', 'val_bpb'])
    writer.writeheader()
    writer.writerows(rows)


def time_curve(rows: list[dict], name: str) -> list[tuple]:
  """Run `name`'s (train_s, val_bpb) points, in time order."""
  return sorted((r['train_s'], r['val_bpb']) for r in rows if r['run'] == name)


def summary(rows: list[dict], runs: list[tuple], finals: dict) -> str:
  """summary.md's text: each run's final bpb and time, and every other run's validation bpb at
  the first run's final time."""
  first = runs[0][0]
  budget = time_curve(rows, first)[-1][0]

  def at_budget(name):
    times, bpbs = zip(*time_curve(rows, name))
    return float(np.interp(budget, times, bpbs)) if times[0] <= budget else float('nan')

  table = [
    '| run | steps | final val bpb | test bpb | train s | tokens/s |',
    '|---|---|---|---|---|---|',
    *(
      f'| {n} | {s["step"]} | {s["val_bpb"]:.4f} | {s["test_bpb"]:.4f} | '
      f'{s["train_s"] + s["compile_s"]:.0f} | {s["tokens_per_s"]:,.0f} |'
      for n, s in finals.items()
    ),
    '',
    *(
      f"{name} at {first}'s {budget:.0f} s: val bpb {at_budget(name):.4f} against "
      f'{finals[first]["val_bpb"]:.4f} ({at_budget(name) - finals[first]["val_bpb"]:+.4f}).'
      for name, _, _ in runs[1:]
    ),
  ]
  return '\n'.join(table)


def plot(out: str, rows: list[dict], runs: list[tuple]) -> None:
  """Writes txl_tiny.png under `out`: each run's validation bpb against training time."""
  import matplotlib

  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(7, 4.5))
  for name, _, _ in runs:
    ax.plot(*zip(*time_curve(rows, name)), marker='o', markersize=3, label=name)
  ax.set_xlabel('training time, s (compilation included)')
  ax.set_ylabel('validation bits per byte')
  ax.set_title('Transformer-XL against GPT, same corpus and machine')
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(os.path.join(out, 'txl_tiny.png'), dpi=120)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument(
    '--render', metavar='CSV', help='print the table of a written txl_tiny.csv; train nothing'
  )
  parser.add_argument('--out', default='experiments/results/txl_tiny')
  parser.add_argument('--eval-every', type=int, default=250)
  parser.add_argument('--eval-batches', type=int, default=None, help="default: the preset's")
  parser.add_argument('--run', action='append', metavar='LABEL=PRESET[,FIELD=VALUE...]')
  args = parser.parse_args(argv)
  if args.render:
    print(render(read_rows(args.render)))
    return

  from ouroboros_jax.runtime import host

  host.configure_cpu_runtime()
  from ouroboros_jax.training import config, field_flags, loop, presets

  runs = [parse_run(text, config.fields()) for text in args.run or DEFAULT_RUNS]
  rows, finals = [], {}
  for name, preset, overrides in runs:
    out = os.path.join(args.out, name)
    shutil.rmtree(out, ignore_errors=True)
    values = {'out': out, 'eval_every': args.eval_every, **overrides}
    if args.eval_batches:
      values['eval_batches'] = args.eval_batches
    cfg = field_flags.override(presets.get_preset(preset), values)
    print(f'== {name}', flush=True)
    finals[name] = loop.train(cfg, quiet=True)
    rows.extend(validation_rows(name, out))

  write_csv(args.out, rows)
  text = summary(rows, runs, finals)
  with open(os.path.join(args.out, 'summary.md'), 'w') as f:
    f.write(text + '\n')
  print(text)
  plot(args.out, rows, runs)
  print(f'wrote {args.out}/txl_tiny.csv, txl_tiny.png, summary.md')


if __name__ == '__main__':
  main()
