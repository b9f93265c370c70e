"""What separates Ouroboros from FSDP where both run (issue 61): the layout map's cells with a
sequence a chip or more (B >= N) on 64 and 512 chips, the fastest Ouroboros of the saved map
(docs/results/layouts/layouts.csv) simulated again three ways:

  as is            its predicted step (the map's)
  gather free      the same, but the gather of the updated weights over the replicas after a
                   --shard-update step costs nothing (as if overlapped with the next step)
  update free      the update costs nothing too (its 1/R of the optimizer's work)

beside FSDP's step from the map. A what-if of the simulator (`simulate._updates` zeroed for the
run), not a layout the library runs: it says which term a lever would have to remove.

And both FSDP and that Ouroboros again with a collective's latency counted over the hops of a
torus (`torus_latency`): the simulator runs a collective of D chips in one slice on a ring of
all D, D - 1 hops of `Hardware.latency` each (511 for FSDP on 512 chips, 31 for a stage's 32
replicas); an all-gather done dimension by dimension on a d-dimensional torus (v5e 2, v5p 3)
takes about d (D^(1/d) - 1) (21 on v5p's 8 x 8 x 8). Its bytes and bandwidth stay as they are.

    python experiments/layout_gap.py                 # docs/results/layouts/layout_gap.csv (~15 min)
    python experiments/layout_gap.py --render docs/results/layouts/layout_gap.csv
"""

from __future__ import annotations

import contextlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import csv_table  # noqa: E402  (experiments/ is not a package)
import layouts  # noqa: E402

from ouroboros_jax.perf import cost_model, plan, simulate  # noqa: E402
from ouroboros_jax.schedules import ScheduleConfig  # noqa: E402
from ouroboros_jax.training import field_flags, presets  # noqa: E402

COLUMNS = ['model', 'chips', 'batch', 'setting', 'fsdp_s', 'ouroboros_s', 'gather_free_s']
COLUMNS += ['update_free_s', 'fsdp_torus_s', 'ouroboros_torus_s']
TORUS_DIMS = {'tpu-v5e': 2, 'tpu-v5p': 3}  # the slice's torus: v5e 16 x 16, v5p up to 3-D


@contextlib.contextmanager
def free(gather: bool, update: bool):
  """The simulator with the post-update gather (and the update) of every step costing nothing."""
  updates = simulate._updates

  def zeroed(graph, run, costs, devices):
    updates(graph, run, costs, devices)
    if gather and graph.updated_bytes:
      graph.updated_bytes = [0.0] * len(graph.updated_bytes)
    if update:
      graph.update_s = [0.0] * len(graph.update_s)

  simulate._updates = zeroed
  try:
    yield
  finally:
    simulate._updates = updates


@contextlib.contextmanager
def torus_latency(dims: int):
  """The simulator with a collective's latency over D chips of one slice counted as
  dims (D^(1/dims) - 1) hops (a torus, dimension by dimension), not D - 1 (a ring of all D)."""
  ring = cost_model.StageCosts.collective_s

  def on_torus(costs, nbytes: float, replicas: int) -> float:
    inside = min(costs.slice_chips or replicas, replicas)
    hops = dims * (inside ** (1 / dims) - 1)
    return ring(costs, nbytes, replicas) - (inside - 1 - hops) * costs.latency

  cost_model.StageCosts.collective_s = on_torus
  try:
    yield
  finally:
    cost_model.StageCosts.collective_s = ring


def step_s(model: str, chips: int, batch: int, setting: ScheduleConfig) -> float:
  """`layouts.cell_rows`' prediction of one layout."""
  flags, hardware, slice_chips = layouts.MODELS[model]
  cfg = field_flags.override(presets.get_preset('gpt2-small'), {**flags, 'batch_size': batch})
  resolved = setting.resolve('tpu', batch)
  return plan.predicted_step_s(cfg, resolved, hardware, slices=max(1, chips // slice_chips))


def fastest(rows: list[dict], line_prefix: str) -> dict:
  timed = [r for r in rows if r['line'].startswith(line_prefix) and r['step_s']]
  return min(timed, key=lambda r: float(r['step_s']))


def setting_of(ring: dict) -> ScheduleConfig:
  """The ScheduleConfig of a map's Ouroboros row."""
  return ScheduleConfig(
    name='ouroboros', forward=ring['line'].split()[1], num_stages=int(ring['G']),
    data_parallel=int(ring['R']), microbatches=int(ring['M']), stash_policy=ring['policy'],
    shard_update=ring['shard_update'] == 'True', fsdp=ring['fsdp'] == 'True',
  )  # fmt: skip


def gap_row(cell: list[dict]) -> dict:
  """One cell's row: FSDP's step and its fastest Ouroboros' three ways."""
  ring = fastest(cell, 'ouroboros')
  model, chips, batch = ring['model'], int(ring['chips']), int(ring['batch'])
  setting = setting_of(ring)
  times = {}
  for name, gather, update in (('gather_free_s', True, False), ('update_free_s', True, True)):
    with free(gather, update):
      times[name] = step_s(model, chips, batch, setting)
  fsdp_row = fastest(cell, 'fsdp')
  fsdp = ScheduleConfig(
    name='data_parallel', data_parallel=chips, fsdp=True, stash_policy=fsdp_row['policy']
  )
  with torus_latency(TORUS_DIMS[layouts.MODELS[model][1].name]):
    times['fsdp_torus_s'] = step_s(model, chips, batch, fsdp)
    times['ouroboros_torus_s'] = step_s(model, chips, batch, setting)
  return dict(
    model=model, chips=chips, batch=batch, setting=ring['setting'],
    fsdp_s=float(fsdp_row['step_s']), ouroboros_s=float(ring['step_s']), **times,
  )  # fmt: skip


def main_rows(map_csv: str) -> list[dict]:
  rows = csv_table.read(map_csv)
  cells: dict[tuple, list[dict]] = {}
  for r in rows:
    if int(r['chips']) > 8 and int(r['batch']) >= int(r['chips']):
      cells.setdefault((r['model'], int(r['chips']), int(r['batch'])), []).append(r)
  return [gap_row(cells[key]) for key in sorted(cells)]


def render(rows: list[dict]) -> str:
  header = ['model', 'N', 'B', 'fastest Ouroboros', 'FSDP (ms)', 'Ouroboros (ms)', 'gather free']
  header += ['update free too', 'FSDP / Ouroboros: as is', 'gather free']
  header += ['torus latency: FSDP (ms)', 'Ouroboros (ms)', 'FSDP / Ouroboros']

  def cells(r):
    keys = ('fsdp_s', 'ouroboros_s', 'gather_free_s', 'update_free_s')
    fsdp, ring, no_gather, no_update = (float(r[k]) * 1e3 for k in keys)
    times = [f'{t:.1f}' for t in (fsdp, ring, no_gather, no_update)]
    torus = [float(r[k]) * 1e3 for k in ('fsdp_torus_s', 'ouroboros_torus_s')]
    return [r['model'], str(r['chips']), str(r['batch']), r['setting'], *times,
            f'{fsdp / ring:.3f}x', f'{fsdp / no_gather:.3f}x', *(f'{t:.1f}' for t in torus),
            f'{torus[0] / torus[1]:.3f}x']  # fmt: skip

  return csv_table.table(header, [cells(r) for r in rows])


def main(argv=None) -> int:
  p = csv_table.parser(__doc__, 'docs/results/layouts/layout_gap.csv')
  p.add_argument('--map', default='docs/results/layouts/layouts.csv')
  args = p.parse_args(argv)
  if args.render:
    print(render(csv_table.read(args.render)))
    return 0
  rows = main_rows(args.map)
  csv_table.write(args.out, COLUMNS, rows)
  print(render(rows))
  return 0


if __name__ == '__main__':
  sys.exit(main())
