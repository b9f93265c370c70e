"""Per-layer costs of the simulator's model shapes, measured on this machine's first device.

For each model shape of `perf.cost_model.MODELS` (GPT-2-small: d 768, seq 1024; 1B: d 2048, seq
2048; vocabulary 50257, batch 32) it times, on one device, in the simulator's form
(`cost_model.StageCosts`: every time is for the rows given, a layer's backward from its kept
graph):

    fwd_s_per_layer      one Transformer layer's forward (the graph stash's, keeping residuals)
    bwd_s_per_layer      its backward from the kept graph
    head_s               device 0's extra work: embedding, final norm, tied output projection and
                         loss, forward + backward
    update_s_per_layer_<opt>   the optimizer update (clip + <opt>) of one layer's parameters
    update_s_embed_head_<opt>  the same for the embedding and the head

for the whole batch (`rows` = batch) and for one micro-batch of it (`rows` = batch / M for each
--microbatches M), so a prediction need not assume that a micro-batch costs 1/M of the batch.
It writes layer_costs.csv (one row per model and rows) and prints it; `achieved_tflops` is the
layer's forward + backward FLOPs (`costs.layer_flops`, x3) over its measured time.

    python experiments/layer_costs.py --out runs/layer_costs               # on a GPU, bf16
    python experiments/layer_costs.py --models gpt2-small --dtype float32  # anywhere

Run by experiments/device_check.sh on the lent GPU; `--quick` shrinks every shape for its dry run.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from ouroboros_jax import costs
from ouroboros_jax.models import model as transformer
from ouroboros_jax.models import partition
from ouroboros_jax.perf import calibration, cost_model, timing
from ouroboros_jax.schedules.stash import GraphStash
from ouroboros_jax.update import GroupedOptimizer

COLUMNS = [
  'model',
  'device',
  'dtype',
  'attention',
  'rows',
  'seq_len',
  'd_model',
  'd_ff',
  'vocab',
  'fwd_s_per_layer',
  'bwd_s_per_layer',
  'head_s',
  'achieved_tflops',
]


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--out', default='experiments/results/layer_costs')
  parser.add_argument('--models', default=','.join(cost_model.MODELS))
  parser.add_argument('--dtype', default='bfloat16')
  parser.add_argument('--attention', default='auto', help='auto: cuDNN on a GPU in bf16')
  parser.add_argument('--microbatches', default='8', help='comma list of M (rows = batch / M)')
  parser.add_argument('--optimizers', default='adamw,muon')
  parser.add_argument('--repeats', type=int, default=5)
  parser.add_argument('--quick', action='store_true', help='tiny shapes (the dry run)')
  return parser.parse_args(argv)


def model_config(shape: cost_model.ModelShape, args) -> transformer.ModelConfig:
  """One layer of `shape` as the library's Transformer (64-wide heads, no dropout)."""
  return transformer.ModelConfig(
    vocab_size=shape.vocab,
    d_model=shape.d_model,
    num_heads=max(1, shape.d_model // 64),
    num_layers=1,
    d_ff=shape.d_ff,
    seq_len=shape.seq_len,
    dropout=0.0,
    dtype=args.dtype,
    attention=args.attention,
  )


def time_layer(cfg: transformer.ModelConfig, params, rows: int, repeats: int) -> dict:
  """Seconds of one layer's forward and backward, and of device 0's extra work, on `rows` rows."""
  model = partition.transformer_stages(cfg, (1,))
  device = jax.local_devices()[0]
  rng = np.random.default_rng(0)
  batch = {
    k: rng.integers(0, cfg.vocab_size, (rows, cfg.seq_len)).astype(np.int32)
    for k in ('inputs', 'targets')
  }
  params, batch = jax.device_put((params, batch), device)
  stash, key = GraphStash(model, 'all'), jax.random.key(0)  # the whole VJP, as bench's pieces
  x = jax.jit(model.embed)(params['embed'], batch['inputs'], None)
  (fwd, bwd), _ = calibration.time_group(
    stash, params, 0, key, x, repeats
  )  # as `ouroboros bench` times

  def device0_extra(embed_p, head_p):
    h = model.embed(embed_p, batch['inputs'], None)
    loss_of = lambda hp, ep, h: model.loss(hp, ep, h, batch['targets'])[0]
    return jax.grad(loss_of, argnums=(0, 1, 2))(head_p, embed_p, h)

  head = timing.median_time(
    jax.jit(device0_extra), params['embed'], params['head'], repeats=repeats
  )
  flops = 3 * costs.layer_flops(cfg.d_model, cfg.d_ff, cfg.seq_len) * rows * cfg.seq_len
  return {
    'fwd_s_per_layer': fwd,
    'bwd_s_per_layer': bwd,
    'head_s': head,
    'achieved_tflops': flops / (fwd + bwd) / 1e12,
  }


def time_updates(params, optimizer: str, repeats: int) -> dict:
  """Seconds of the optimizer update (clip + optimizer) of one layer, and of embedding + head."""
  grouped = GroupedOptimizer(timing.bench_optimizer(optimizer), clip_norm=1.0)
  apply = jax.jit(grouped.apply)
  parts = {
    'per_layer': {'embed': {}, 'head': {}, 'stages': params['stages']},
    'with_embed_head': {
      'embed': params['embed'],
      'head': params['head'],
      'stages': params['stages'],
    },
  }
  seconds = {}
  for name, own in parts.items():
    own = jax.device_put(own, jax.local_devices()[0])
    grads = jax.tree.map(jnp.ones_like, own)
    seconds[name] = timing.median_time(apply, own, grouped.init(own), grads, repeats=repeats)
  out = {
    f'update_s_per_layer_{optimizer}': seconds['per_layer'],
    f'update_s_embed_head_{optimizer}': max(0.0, seconds['with_embed_head'] - seconds['per_layer']),
  }
  return out


def measure(shape: cost_model.ModelShape, args) -> list[dict]:
  cfg = model_config(shape, args)
  params = partition.to_staged(transformer.init_params(cfg, jax.random.key(0)), (1,))
  updates = {}
  for optimizer in args.optimizers.split(','):
    updates.update(time_updates(params, optimizer, args.repeats))
  rows = []
  for m in [1, *(int(m) for m in args.microbatches.split(',') if m)]:
    if shape.batch % m:
      raise SystemExit(f'error: --microbatches {m} does not divide batch {shape.batch}.')
    row = {
      'model': shape.name,
      'device': jax.local_devices()[0].device_kind,
      'dtype': args.dtype,
      'attention': args.attention,
      'rows': shape.batch // m,
      'seq_len': shape.seq_len,
      'd_model': shape.d_model,
      'd_ff': shape.d_ff,
      'vocab': shape.vocab,
      **time_layer(cfg, params, shape.batch // m, args.repeats),
      **updates,
    }
    print(
      f'{shape.name:10s} rows {row["rows"]:3d}: forward {row["fwd_s_per_layer"] * 1e3:8.3f} ms, '
      f'backward {row["bwd_s_per_layer"] * 1e3:8.3f} ms, head {row["head_s"] * 1e3:8.3f} ms, '
      f'{row["achieved_tflops"]:.1f} TFLOP/s',
      flush=True,
    )
    rows.append(row)
  return rows


def main(argv=None) -> None:
  args = parse_args(argv)
  shapes = [cost_model.MODELS[name] for name in args.models.split(',')]
  if args.quick:
    shapes = [
      dataclasses.replace(s, d_model=64, d_ff=256, seq_len=32, vocab=256, batch=8) for s in shapes
    ]
  rows = [row for shape in shapes for row in measure(shape, args)]
  os.makedirs(args.out, exist_ok=True)
  path = os.path.join(args.out, 'layer_costs.csv')
  columns = COLUMNS + [c for c in rows[0] if c not in COLUMNS]
  with open(path, 'w', newline='') as f:
    writer = csv.DictWriter(f, fieldnames=columns)
    writer.writeheader()
    writer.writerows(rows)
  print(f'wrote {path}', file=sys.stderr)


if __name__ == '__main__':
  main()
