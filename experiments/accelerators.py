"""Plain training against every other training accelerator, same data, same token budget.

    python experiments/accelerators.py                    # ~20 min on 2 shared CPU cores
    python experiments/accelerators.py --steps 60 --methods plain,pld   # a quick look

Trains the `tiny` preset made 4 layers deep (d_model 128, 4 heads, d_ff 512, seq 64, batch 32,
lr 5e-3, layers unrolled) for --steps steps with each method of
`ouroboros_jax.training.compare.methods` (plain, PLD, MSLT, progressive stacking, V-cycle,
standardization loss), one after the other in this process, and writes under --out (default
experiments/results/accelerators):

    compare.csv   method, step, val_bpb, wall_s, cpu_s, flops at every evaluation
    compare.md    the table: wall-clock, CPU time, FLOPs, final val / test bpb, savings
    compare.png   validation bpb against training wall-clock, CPU time and FLOPs spent
    <method>/          each run's metrics.jsonl, config.json, summary.json

See `ouroboros_jax/accelerators.py` for how time and FLOPs are counted.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--steps', type=int, default=300)
  parser.add_argument('--num-layers', type=int, default=4)
  parser.add_argument('--eval-every', type=int, default=50)
  parser.add_argument('--eval-batches', type=int, default=40)
  parser.add_argument('--methods', default=None, help='comma-separated subset (default all)')
  parser.add_argument('--out', default='experiments/results/accelerators')
  parser.add_argument(
    '--copy-png',
    default=None,
    metavar='PATH',
    help='also copy the plot here (docs/results/accelerators.md shows its copy in docs/results/)',
  )
  parser.add_argument(
    '--replot', action='store_true', help='only rebuild the table and plot from --out/results.json'
  )
  parser.add_argument(
    '--set',
    action='append',
    default=[],
    metavar='FIELD=VALUE',
    help='any other TrainConfig/ModelConfig override, e.g. --set d_model=64',
  )
  return parser.parse_args(argv)


def main(argv=None):
  args = parse_args(argv)
  from ouroboros_jax.training import compare, config, field_flags, presets

  overrides = {
    'num_layers': args.num_layers,
    'steps': args.steps,
    'layer_unroll': 0,
    'eval_every': args.eval_every,
    'eval_batches': args.eval_batches,
    'log_every': 25,
  }
  for item in args.set:
    key, _, value = item.partition('=')
    kind = config.fields()[key][0]
    overrides[key] = (value.lower() in ('1', 'true')) if kind is bool else kind(value)
  base = field_flags.override(presets.get_preset('tiny'), overrides)
  os.makedirs(args.out, exist_ok=True)
  names = args.methods.split(',') if args.methods else None
  if args.replot:
    with open(os.path.join(args.out, 'results.json')) as f:
      results = compare.add_savings(json.load(f))
  else:
    results = compare.compare(base, args.out, names, log=lambda text: print(text, flush=True))
  compare.write_csv(results, os.path.join(args.out, 'accelerators.csv'))
  table = compare.markdown_table(results)
  shape = (
    f'{base.model.num_layers} layers, d_model {base.model.d_model}, seq '
    f'{base.model.seq_len}, batch {base.batch_size}, {base.steps} steps '
    f'({base.steps * base.tokens_per_step:,} tokens) per method'
  )
  with open(os.path.join(args.out, 'accelerators.md'), 'w') as f:
    f.write(f'{shape}\n\n{table}\n')
  with open(os.path.join(args.out, 'results.json'), 'w') as f:
    json.dump(results, f, indent=1)
  png = os.path.join(args.out, 'accelerators.png')
  compare.plot(results, png, title=shape)
  if args.copy_png:
    shutil.copy(png, args.copy_png)
  print(shape)
  print(table)
  return 0


if __name__ == '__main__':
  sys.exit(main())
