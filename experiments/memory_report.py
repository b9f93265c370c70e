"""Per-device memory of backprop and of Ouroboros' two stash modes, from the compiled step.

    python experiments/memory_report.py                       # tiny-like model, G = 2 and 4
    python experiments/memory_report.py --d-model 512 --num-layers 8 --seq-len 512 --batch 8

Prints one markdown table per stage count and writes them to --out (memory.md). The numbers are
XLA's `memory_analysis()` of the per-device SPMD program (CPU here; run it on a GPU host for GPU
numbers): params = this device's parameters, ring = Ouroboros' carried stashes and in-flight
error gradient, argument/temp = what the compiled step reads / needs as scratch.
"""

from __future__ import annotations

import argparse
import os


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--d-model', type=int, default=128)
  parser.add_argument('--num-heads', type=int, default=4)
  parser.add_argument('--num-layers', type=int, default=4)
  parser.add_argument('--d-ff', type=int, default=512)
  parser.add_argument('--seq-len', type=int, default=128)
  parser.add_argument('--batch', type=int, default=32)
  parser.add_argument('--stages', default='2,4')
  parser.add_argument(
    '--policies',
    default='all,dots,nothing',
    help='graph stash policies to report (see --stash-policy)',
  )
  parser.add_argument('--out', default='experiments/results/memory')
  args = parser.parse_args(argv)
  stages = [int(g) for g in args.stages.split(',')]
  import jax

  from ouroboros_jax.models import model
  from ouroboros_jax.perf import memory
  from ouroboros_jax.runtime import host

  host.configure_cpu_runtime()  # before any device is touched
  jax.config.update('jax_num_cpu_devices', max(stages))

  cfg = model.ModelConfig(
    d_model=args.d_model,
    num_heads=args.num_heads,
    num_layers=args.num_layers,
    d_ff=args.d_ff,
    seq_len=args.seq_len,
  )
  sections = []
  for g in stages:
    table = memory.format_table(
      memory.stash_comparison(cfg, g, args.batch, args.policies.split(','))
    )
    sections.append(
      f'### G = {g}, {cfg.num_layers} layers, d_model {cfg.d_model}, '
      f'batch {args.batch} x {cfg.seq_len}\n\n{table}\n'
    )
    print(sections[-1], flush=True)
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, 'memory.md'), 'w') as f:
    f.write('\n'.join(sections))


if __name__ == '__main__':
  main()
