"""FSDP's Muon update where the chips outnumber the layers, laid out three ways (issue 61):
compiled for compile-only v5e:8x8 (64 chips) at the 1B shape (24 layers), a chip's operations
and collective bytes.

  on shards     the optimizer state's layout, what the library did before `by_whole_layers`
                cut the layers over gcd(D, L) groups: each matrix split over all D chips on its
                largest axis D divides
  gcd           the layers over gcd(D, L) = 8 groups of chips, each matrix over the 8 chips of
                its group on its larger axis: what the library builds (`layer_shards.
                by_whole_layers`), and what a stage of 3 layers on 8 replicas has (zero1)
  whole layers  the layers over the 8 groups, each matrix whole on every chip of its group

The update is a Newton-Schulz orthogonalisation written out (optax.contrib.muon's: 5 steps of
A = X X^T, B = b A + c A A, X = a X + B X, on the smaller side), vmapped over the layers: the
library's update compiled (experiments/update_compiles.py) does the same operations: 6999 GFLOP a
chip on the shards before the gcd layout, 1581 with it. libtpu, 2 CPU cores: ~2 min.

    python experiments/fsdp_update_layouts.py  # docs/results/layouts/fsdp_update_layouts.csv
    python experiments/fsdp_update_layouts.py --render docs/results/layouts/fsdp_update_layouts.csv
"""

from __future__ import annotations

import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import csv_table  # noqa: E402  (experiments/ is not a package)

LAYERS, D_MODEL, D_FF, CHIPS, TOPOLOGY = 24, 2048, 8192, 64, 'v5e:8x8'
GROUPS = math.gcd(CHIPS, LAYERS)  # 8
MATRICES = {  # one layer's kernels, [L, in, out]
  'qkv': (LAYERS, D_MODEL, 3 * D_MODEL),
  'out': (LAYERS, D_MODEL, D_MODEL),
  'up': (LAYERS, D_MODEL, D_FF),
  'down': (LAYERS, D_FF, D_MODEL),
}
COLUMNS = ['layout', 'gflops', 'all_gather_mb', 'all_reduce_mb', 'all_to_all_mb']


def newton_schulz(g):
  import jax.numpy as jnp

  transpose = g.shape[0] > g.shape[1]
  x = g.T if transpose else g
  x = x / (jnp.linalg.norm(x) + 1e-7)
  a, b, c = 3.4445, -4.7750, 2.0315
  for _ in range(5):
    gram = x @ x.T
    x = a * x + (b * gram + c * gram @ gram) @ x
  return x.T if transpose else x


def spec(layout: str, shape: tuple[int, ...]):
  """The PartitionSpec of a [L, in, out] kernel on the ('group', 'chip') mesh of 8 x 8."""
  from jax.sharding import PartitionSpec as P

  if layout == 'on shards':
    axis = max((a for a in (1, 2) if shape[a] % CHIPS == 0), key=lambda a: shape[a])
    return P(*(('group', 'chip') if i == axis else None for i in range(3)))
  if layout == 'gcd':
    axis = 1 if shape[1] >= shape[2] else 2
    return P('group', *('chip' if i == axis else None for i in (1, 2)))
  return P('group', None, None)


def compiled_row(layout: str, mesh) -> dict:
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding

  from ouroboros_jax.perf import compile as compile_lib

  placed = {k: NamedSharding(mesh, spec(layout, s)) for k, s in MATRICES.items()}
  args = {k: jax.ShapeDtypeStruct(s, jnp.float32, sharding=placed[k]) for k, s in MATRICES.items()}
  update = jax.jit(lambda tree: jax.tree.map(jax.vmap(newton_schulz), tree), out_shardings=placed)
  compiled = update.lower(args).compile()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  mb = lambda op: compile_lib.collective_bytes(compiled.as_text(), op) / 2**20
  return dict(
    layout=layout, gflops=cost['flops'] / 1e9, all_gather_mb=mb('all-gather'),
    all_reduce_mb=mb('all-reduce'), all_to_all_mb=mb('all-to-all'),
  )  # fmt: skip


def render(rows: list[dict]) -> str:
  header = [f'FSDP update, 1B on {CHIPS} chips ({TOPOLOGY})', 'GFLOP a chip', 'all-gather MB']
  cells = lambda r: [r['layout'], *(f'{float(r[k]):.0f}' for k in COLUMNS[1:])]
  return csv_table.table(header + ['all-reduce MB', 'all-to-all MB'], [cells(r) for r in rows])


def main(argv=None) -> int:
  args = csv_table.parser(__doc__, 'docs/results/layouts/fsdp_update_layouts.csv').parse_args(argv)
  if args.render:
    print(render(csv_table.read(args.render)))
    return 0
  import numpy as np
  from jax.sharding import Mesh

  from ouroboros_jax.perf import compile as compile_lib

  compile_lib.quiet_libtpu()
  devices = np.array(compile_lib.topology_devices(TOPOLOGY)).reshape(GROUPS, CHIPS // GROUPS)
  mesh = Mesh(devices, ('group', 'chip'))
  rows = [compiled_row(layout, mesh) for layout in ('on shards', 'gcd', 'whole layers')]
  csv_table.write(args.out, COLUMNS, rows)
  print(render(rows))
  return 0


if __name__ == '__main__':
  sys.exit(main())
