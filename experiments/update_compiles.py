"""The optimizer update as the TPU compiler builds it (issue 61): Muon's work a chip, compiled,
against what the simulator prices, for the layouts of the layout map where the replicas do not
divide the layers they update.

The simulator (`cost_model._update_s`, `simulate._updates`) charges a chip the Newton-Schulz
matmuls of the layers it updates: L/D layers under FSDP, L/(G R) for a stage split over its R
replicas (--shard-update), as if each replica orthogonalised whole matrices of its own. That is
what the library does where the replicas divide the layers (`layer_shards.by_whole_layers`,
`layer_shards.update_axis`). Where they do not, the layers go over gcd(replicas, layers) groups
of replicas and each matrix is split over the replicas of its group on one of its own axes: XLA's
SPMD partitioner splits the products that contract over it, but repeats on each replica of the
group the products of the small Gram matrix (m x m for an m x n matrix, m <= n), and gathers and
all-reduces what they need. (Before the gcd groups, each matrix was split over all the replicas:
7.76x the price for FSDP on 64 chips, docs/results/regime.md.)

This compiles the update alone (`GroupedOptimizer.apply` on the step's layouts of the parameters,
optimizer state and gradients) for compile-only TPU chips and records the compiler's operations
a chip (`cost_analysis`; no loop in it) and the bytes its collectives produce, beside the
simulator's price in the same operations. libtpu, 2 CPU cores: ~6 min for 1B.

    python experiments/update_compiles.py     # docs/results/layouts/update_compiles.csv
    python experiments/update_compiles.py --render docs/results/layouts/update_compiles.csv
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import csv_table  # noqa: E402  (experiments/ is not a package)

# model, topology, schedule, G, R, sharding ('fsdp', 'update' or 'replicated')
CASES = (
  ('1b', 'v5e:2x4', 'data_parallel', 1, 8, 'fsdp'),  # D = 8 divides L = 24: whole layers
  ('1b', 'v5e:8x8', 'data_parallel', 1, 64, 'fsdp'),  # D = 64 does not
  ('1b', 'v5e:2x4', '1f1b', 8, 1, 'replicated'),  # a stage of 3 layers, whole on its chip
  ('1b', 'v5e:8x8', '1f1b', 8, 8, 'update'),  # its update over R = 8, which 3 does not divide
  ('1b', 'v5e:8x8', '1f1b', 2, 32, 'update'),  # 12 layers over R = 32
  ('7b', 'v5p:2x2x2', 'data_parallel', 1, 8, 'fsdp'),  # D = 8 divides L = 32
  ('7b', 'v5p:4x4x4', 'data_parallel', 1, 64, 'fsdp'),  # D = 64 does not
  ('7b', 'v5p:4x4x4', '1f1b', 16, 4, 'update'),  # the map's Ouroboros: 2 layers over R = 4
)
MODELS = {
  '1b': dict(d_model=2048, num_layers=24, num_heads=16, d_ff=8192, seq_len=2048, dtype='bfloat16'),
  '7b': dict(d_model=4096, num_layers=32, num_heads=32, d_ff=16384, seq_len=2048, dtype='bfloat16'),
}
COLUMNS = ['model', 'topology', 'setting', 'layers_a_chip', 'priced_gflops', 'compiled_gflops']
COLUMNS += ['all_gather_mb', 'all_reduce_mb', 'all_to_all_mb', 'compile_s']


def priced_layers(num_layers: int, G: int, R: int, sharding: str) -> float:
  """The layers whose update the simulator charges a chip: its stage's, split over the
  replicas where the state is (FSDP: the whole model's over D = R)."""
  return num_layers / G / (R if sharding in ('fsdp', 'update') else 1)


def compiled_update(model: str, topology: str, schedule: str, G: int, R: int, sharding: str):
  """(the run's label, the compiled update of its step's layouts)."""
  import jax
  from jax.sharding import NamedSharding

  from ouroboros_jax import placement
  from ouroboros_jax.perf import compile as compile_lib
  from ouroboros_jax.schedules import synchronous
  from ouroboros_jax.training import assemble, field_flags, presets
  from ouroboros_jax.training.optimizer_setup import make_optimizer

  flags = dict(
    MODELS[model], schedule=schedule, data_parallel=R, stash_policy='dots', optimizer='muon',
    fsdp=sharding == 'fsdp', shard_update=sharding == 'update', batch_size=8 * R,
  )  # fmt: skip
  if schedule != 'data_parallel':
    flags.update(stages=G, microbatches=8)
  cfg = field_flags.override(presets.get_preset('gpt2-small'), flags)
  devices = compile_lib._target_devices(cfg, topology)
  run = cfg.schedule_config(devices[0].platform)
  schedule_, state, _ = compile_lib._abstract_step(cfg, run, devices)
  model_ = assemble.staged_model(cfg, cfg.plans.layers_per_stage)
  optimizer = synchronous.grouped(run, model_, make_optimizer(cfg), schedule_.mesh)
  on_mesh = lambda spec: NamedSharding(schedule_.mesh, spec)
  grads = jax.tree.map(
    lambda a, spec: jax.ShapeDtypeStruct(a.shape, jax.numpy.float32, sharding=on_mesh(spec)),
    state.params,
    placement.step_grad_specs(state.params, run),
  )
  kept = jax.tree.map(lambda a: a.sharding, (state.params, state.opt_state))
  update = jax.jit(lambda p, s, g: optimizer.apply(p, s, g)[:2], out_shardings=kept)
  return run.label, update.lower(state.params, state.opt_state, grads).compile()


def case_row(case) -> dict:
  from ouroboros_jax import costs
  from ouroboros_jax.perf import compile as compile_lib

  model, topology, schedule, G, R, sharding = case
  start = time.perf_counter()
  label, compiled = compiled_update(*case)
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  hlo = compiled.as_text()
  shape = MODELS[model]
  layers = priced_layers(shape['num_layers'], G, R, sharding)
  per_layer = costs.layer_update_flops('muon', shape['d_model'], shape['d_ff'])
  mb = lambda op: compile_lib.collective_bytes(hlo, op) / 2**20
  return dict(
    model=model, topology=topology, setting=label, layers_a_chip=layers,
    priced_gflops=layers * per_layer / 1e9, compiled_gflops=cost['flops'] / 1e9,
    all_gather_mb=mb('all-gather'), all_reduce_mb=mb('all-reduce'),
    all_to_all_mb=mb('all-to-all'), compile_s=time.perf_counter() - start,
  )  # fmt: skip


def render(rows: list[dict]) -> str:
  header = ['model', 'chips', 'layout', 'layers a chip (priced)', 'priced GFLOP', 'compiled GFLOP']
  header += ['compiled / priced', 'all-gather MB', 'all-reduce MB', 'all-to-all MB']

  def cells(r):
    f = lambda k: float(r[k])
    ratio = f('compiled_gflops') / f('priced_gflops')
    numbers = [f'{f(k):.0f}' for k in ('priced_gflops', 'compiled_gflops')]
    moved = [f'{f(k):.0f}' for k in ('all_gather_mb', 'all_reduce_mb', 'all_to_all_mb')]
    return [r['model'], r['topology'], r['setting'], f'{f("layers_a_chip"):.3f}', *numbers,
            f'{ratio:.2f}x', *moved]  # fmt: skip

  return csv_table.table(header, [cells(r) for r in rows])


def main(argv=None) -> int:
  p = csv_table.parser(__doc__, 'docs/results/layouts/update_compiles.csv')
  p.add_argument(
    '--models', default=','.join(MODELS), help="compile these models' cases, keep the rest of --out"
  )
  args = p.parse_args(argv)
  if args.render:
    print(render(csv_table.read(args.render)))
    return 0
  from ouroboros_jax.perf import compile as compile_lib

  compile_lib.quiet_libtpu()
  models = args.models.split(',')
  keep = set(models) != set(MODELS) and os.path.exists(args.out)
  rows = [r for r in csv_table.read(args.out) if r['model'] not in models] if keep else []
  for case in (c for c in CASES if c[0] in models):
    rows.append(case_row(case))
    print(render(rows[-1:]).splitlines()[-1], flush=True)
  csv_table.write(args.out, COLUMNS, rows)
  print(render(rows))
  return 0


if __name__ == '__main__':
  sys.exit(main())
