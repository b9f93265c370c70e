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
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil

import numpy as np

RUNS = ('tiny', 'txl-tiny')


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--out', default='experiments/results/txl_tiny')
  parser.add_argument('--eval-every', type=int, default=250)
  parser.add_argument('--eval-batches', type=int, default=None, help="default: the preset's")
  args = parser.parse_args(argv)

  from ouroboros_jax.runtime import host

  host.configure_cpu_runtime()
  from ouroboros_jax.training import config, loop

  rows, finals = [], {}
  for name in RUNS:
    out = os.path.join(args.out, name)
    shutil.rmtree(out, ignore_errors=True)
    values = {'out': out, 'eval_every': args.eval_every}
    if args.eval_batches:
      values['eval_batches'] = args.eval_batches
    cfg = config.override(config.get_preset(name), values)
    print(f'== {name}', flush=True)
    finals[name] = loop.train(cfg, quiet=True)
    with open(os.path.join(out, 'metrics.jsonl')) as f:
      for line in f:
        row = json.loads(line)
        if row['split'] == 'validation':
          rows.append({'run': name, 'step': row['step'], 'train_s': row['train_s'],
                       'val_bpb': row['bpb']})  # fmt: skip

  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, 'txl_tiny.csv'), 'w', newline='') as f:
    writer = csv.DictWriter(f, fieldnames=['run', 'step', 'train_s', 'val_bpb'])
    writer.writeheader()
    writer.writerows(rows)

  curve = lambda name: sorted((r['train_s'], r['val_bpb']) for r in rows if r['run'] == name)
  budget = curve('tiny')[-1][0]
  times, bpbs = zip(*curve('txl-tiny'))
  at_budget = float(np.interp(budget, times, bpbs)) if times[0] <= budget else float('nan')
  table = [
    '| run | steps | final val bpb | train s | tokens/s |',
    '|---|---|---|---|---|',
    *(
      f'| {n} | {s["step"]} | {s["val_bpb"]:.4f} | {s["train_s"] + s["compile_s"]:.0f} | '
      f'{s["tokens_per_s"]:,.0f} |'
      for n, s in finals.items()
    ),
    '',
    f"txl-tiny at tiny's {budget:.0f} s: val bpb {at_budget:.4f} against "
    f'{finals["tiny"]["val_bpb"]:.4f} ({at_budget - finals["tiny"]["val_bpb"]:+.4f}).',
  ]
  text = '\n'.join(table)
  with open(os.path.join(args.out, 'summary.md'), 'w') as f:
    f.write(text + '\n')
  print(text)

  import matplotlib

  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(7, 4.5))
  for name in RUNS:
    ax.plot(*zip(*curve(name)), marker='o', markersize=3, label=name)
  ax.set_xlabel('training time, s (compilation included)')
  ax.set_ylabel('validation bits per byte')
  ax.set_title('Transformer-XL against GPT, same corpus and machine')
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(os.path.join(args.out, 'txl_tiny.png'), dpi=120)
  print(f'wrote {args.out}/txl_tiny.csv, txl_tiny.png, summary.md')


if __name__ == '__main__':
  main()
