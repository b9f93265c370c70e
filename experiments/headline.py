"""The README's headline figure, drawn from the sweep's saved curves (no training).

Validation bpb against step for the best synchronous run and Ouroboros: the paper's method, the
recipe as one batch (the default before --flow auto) and the default (the recipe, streamed), each
at its best rate, seed 0, on the same initialisation and batches (experiments/lr_sweep.py; the
commands are in docs/results/quality.md).

    python experiments/headline.py        # writes docs/results/headline.png, prints the finals
"""

from __future__ import annotations

import argparse
import csv
import os

RESULTS = os.path.join(os.path.dirname(__file__), '..', 'docs', 'results')
# (label, CSV under docs/results, recipe): the curves drawn, in legend order.
CURVES = (
  ('backprop, AdamW (best rate)', 'lr_sweep_final.csv', 'backprop-adamw'),
  ('backprop, Muon (best synchronous)', 'lr_sweep_final.csv', 'backprop-muon'),
  ("Ouroboros G=2, the paper's AdamW", 'lr_sweep_final.csv', 'g2-adamw'),
  ('Ouroboros G=2, recipe as one batch', 'lr_sweep_final.csv', 'g2-muon-predict-dc'),
  (
    'Ouroboros G=2, default (recipe, streamed M=2)',
    'stream_ring_1000.csv',
    'g2-stream2-muon-predict-dc',
  ),
  ('Ouroboros G=4, recipe streamed M=4', 'stream_ring_1000.csv', 'g4-stream4-muon-predict-dc'),
)


def curve(path: str, recipe: str) -> list[tuple[int, float]]:
  """Seed 0's validation curve of `recipe` at the one rate saved for it (step, bpb)."""
  with open(path) as f:
    rows = [
      r
      for r in csv.DictReader(f)
      if r['recipe'] == recipe
      and r.get('seed', '0') == '0'
      and r.get('split', 'validation') == 'validation'
    ]
  if not rows:
    raise SystemExit(f'error: {path} has no curve for {recipe}; run experiments/lr_sweep.py.')
  return [(int(r['step']), float(r['bpb'])) for r in rows]


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--out', default=os.path.join(RESULTS, 'headline.png'))
  args = parser.parse_args(argv)
  import matplotlib

  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(7, 4.5))
  for label, name, recipe in CURVES:
    points = curve(os.path.join(RESULTS, name), recipe)
    ax.plot(*zip(*points), marker='.', label=label)
    print(f'{label:48s} {points[-1][1]:.4f}')
  ax.set_xlabel('step (the same batches for every run)')
  ax.set_ylabel('validation bits per byte')
  ax.set_ylim(2.3, 3.6)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  ax.set_title('tiny preset, 4 layers, 1000 steps, each at its best rate')
  fig.tight_layout()
  fig.savefig(args.out, dpi=120)
  print(f'wrote {args.out}')


if __name__ == '__main__':
  main()
