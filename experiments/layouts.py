"""The layout map (issue 61): for N chips and a global batch of B sequences, which layout the
simulator predicts fastest, FSDP over all N chips or a pipeline of G stages on N / G data
replicas, like with like (every layout keeps the same of its forward, --policy).

Per model and hardware, N in {8, 64, 512} chips (on v5e: one slice up to 256 chips, two slices
of 256 joined by the data-centre network at 512) and B in {N/4, N/2, N, 2N, 4N}, it tries

  data_parallel fsdp    D = N, B / N sequences a chip (B >= N: a sequence is not split)
  data_parallel         D = N replicated, as a reference line
  every G x R = N       G in `settings.factorisations` (G <= 16), R = N / G data replicas of
                        B / R sequences each, cut into M = B / R micro-batches of one sequence:
                        ouroboros pipelined and locked, zb_h1, zb_v, 1f1b, interleaved

and predicts each step with `plan.predicted_step_s` (the library's simulator: FSDP's gathers and
reductions overlapped with its compute, each stage's gradient all-reduced over its replicas,
collectives on a 2-link ring inside a slice and the data-centre network between slices,
`plan.TPU_V5E` / `plan.TPU_V5P`). Memory is not judged here: a layout's per-chip peak is the
compiler's, and only the N = 8 cells are compiled (docs/results/memory.md, `m-fsdp-1b`,
`m-stash-slots`).

    python experiments/layouts.py                       # docs/results/layouts/layouts.csv (~10 min)
    python experiments/layouts.py --render docs/results/layouts/layouts.csv
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import sys

from ouroboros_jax.errors import ConfigError
from ouroboros_jax.perf import plan
from ouroboros_jax.perf import settings as settings_lib
from ouroboros_jax.schedules import ScheduleConfig, delays
from ouroboros_jax.training import field_flags, presets

# name: (the model's flags, the hardware, chips in one slice)
MODELS = {
  '1b': (
    dict(d_model=2048, num_layers=24, num_heads=16, d_ff=8192, seq_len=2048, dtype='bfloat16'),
    plan.TPU_V5E,
    256,  # v5e's largest slice, 16 x 16
  ),
  '7b': (
    dict(d_model=4096, num_layers=32, num_heads=32, d_ff=16384, seq_len=2048, dtype='bfloat16'),
    plan.TPU_V5P,
    6144,  # v5p's largest slice
  ),
}
CHIPS = (8, 64, 512)
BATCH_PER_CHIP = (0.25, 0.5, 1, 2, 4)
MAX_STAGES = 16
PIPELINES = ('1f1b', 'interleaved', 'zb_h1', 'zb_v')
COLUMNS = ['model', 'hardware', 'chips', 'slices', 'batch', 'line', 'setting', 'G', 'R', 'M']
COLUMNS += ['policy', 'step_s', 'note']


def line_of(setting: ScheduleConfig) -> str:
  if setting.name == 'ouroboros':
    return f'ouroboros {setting.forward}'
  if setting.name == 'data_parallel':
    return 'fsdp' if setting.fsdp else 'data_parallel'
  return setting.name


def layouts(chips: int, batch: int, num_layers: int, policy: str) -> list[ScheduleConfig]:
  """Every layout of `chips` chips for a batch of `batch` sequences (see the module's doc)."""
  out = []
  if batch % chips == 0:
    for fsdp in (True, False):
      out.append(ScheduleConfig(name='data_parallel', data_parallel=chips, fsdp=fsdp))
  for G in settings_lib.factorisations(chips, num_layers):
    R = chips // G
    if G > MAX_STAGES or batch % R:
      continue
    on = dict(num_stages=G, data_parallel=R, microbatches=batch // R)
    out += [ScheduleConfig(name='ouroboros', forward=f, **on) for f in ('pipelined', 'locked')]
    out += [ScheduleConfig(name=name, **on) for name in PIPELINES]
  return [dataclasses.replace(s, stash_policy=policy) for s in out]  # Ouroboros': its graph's


def cell_rows(model: str, chips: int, batch: int, policy: str) -> list[dict]:
  """One row per layout of one (model, N, B) cell: its predicted step, or why none."""
  flags, hardware, slice_chips = MODELS[model]
  cfg = field_flags.override(presets.get_preset('gpt2-small'), {**flags, 'batch_size': batch})
  slices = max(1, chips // slice_chips)
  rows = []
  for setting in layouts(chips, batch, cfg.model.num_layers, policy):
    row = dict(model=model, hardware=hardware.name, chips=chips, slices=slices, batch=batch)
    row.update(line=line_of(setting), G=setting.num_stages, R=setting.data_parallel)
    row.update(M=setting.num_microbatches, policy=policy, step_s=None, note='')
    try:
      resolved = setting.resolve('tpu', batch)
      row['setting'] = resolved.label
      row['step_s'] = plan.predicted_step_s(cfg, resolved, hardware, slices=slices)
    except (ConfigError, ValueError) as e:  # a table its M cannot build, replicas over slices
      row['setting'], row['note'] = setting.label, ' '.join(str(e).split())[:160]
    rows.append(row)
  return rows


def main_rows(policy: str, models=tuple(MODELS)) -> list[dict]:
  rows = []
  for model in models:
    for chips in CHIPS:
      for per_chip in BATCH_PER_CHIP:
        rows += cell_rows(model, chips, int(chips * per_chip), policy)
        print(f'{model} N={chips} B={int(chips * per_chip)}: {len(rows)} rows', flush=True)
  return rows


def best(rows: list[dict], lines) -> dict | None:
  """The fastest row of `lines` (None: none of them applies)."""
  timed = [r for r in rows if r['line'] in lines and r['step_s'] not in (None, '')]
  return min(timed, key=lambda r: float(r['step_s'])) if timed else None


def render(rows: list[dict]) -> str:
  """Per model: a row per (N, B), the fastest FSDP, Ouroboros and exact pipeline, and who wins."""
  out = []
  cells = {}
  for r in rows:
    cells.setdefault((r['model'], int(r['chips']), int(r['batch'])), []).append(r)
  for model in dict.fromkeys(r['model'] for r in rows):
    first = next(r for r in rows if r['model'] == model)
    out += [
      f'\n**{model}** ({first["hardware"]}, keeping `{first["policy"]}`; step ms, the fastest '
      'setting of each line, Ouroboros\' with its oldest gradient\'s age in updates; "-": the '
      'line cannot take the batch):\n',
      '| chips | slices | batch | FSDP | Ouroboros | best exact pipeline | fastest | Ouroboros '
      'vs the best other |',
      '|---|---|---|---|---|---|---|---|',
    ]
    for (m, chips, batch), cell in sorted(cells.items()):
      if m == model:
        out.append(_cell_line(chips, batch, cell))
  return '\n'.join(out).strip()


def _cell_line(chips: int, batch: int, cell: list[dict]) -> str:
  fsdp = best(cell, ('fsdp',))
  ring = best(cell, ('ouroboros pipelined', 'ouroboros locked'))
  exact = best(cell, PIPELINES)
  show = lambda r: '-' if r is None else f'{float(r["step_s"]) * 1e3:.1f} ({_short(r)})'
  every = [r for r in (fsdp, ring, exact) if r is not None]
  winner = min(every, key=lambda r: float(r['step_s'])) if every else None
  others = [r for r in (fsdp, exact) if r is not None]
  ratio = '-'
  if ring is not None and others:
    other = min(float(r['step_s']) for r in others)
    ratio = f'{other / float(ring["step_s"]):.2f}x'
  name = '-' if winner is None else winner['line'].split()[0]
  slices = cell[0]['slices']
  return f'| {chips} | {slices} | {batch} | {show(fsdp)} | {show(ring)} | {show(exact)} | {name} | {ratio} |'


def _short(row: dict) -> str:
  """The setting in a few words; Ouroboros' with the age of its oldest gradient in updates."""
  if row['line'] == 'fsdp':
    return f'D={row["chips"]}'
  head = row['line'].replace('ouroboros ', '')
  if not row['line'].startswith('ouroboros'):
    return f'{head} G={row["G"]} M={row["M"]}'
  age, _ = delays.version_gaps(int(row['G']), head, int(row['M']), 'stream')
  return f'{head} G={row["G"]} M={row["M"]}, {age} old'


def write_csv(path: str, rows: list[dict]) -> None:
  with open(path, 'w', newline='') as f:
    writer = csv.DictWriter(f, COLUMNS, extrasaction='ignore')
    writer.writeheader()
    for r in rows:
      writer.writerow({k: ('' if r.get(k) is None else r[k]) for k in COLUMNS})


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  p.add_argument('--out', default='docs/results/layouts/layouts.csv')
  p.add_argument('--policy', default='dots', help='what every layout keeps (default dots)')
  p.add_argument('--models', default=','.join(MODELS))
  p.add_argument('--render', metavar='CSV', help='print the markdown tables of a saved CSV')
  args = p.parse_args(argv)
  if args.render:
    with open(args.render) as f:
      print(render(list(csv.DictReader(f))))
    return 0
  rows = main_rows(args.policy, tuple(args.models.split(',')))
  write_csv(args.out, rows)
  print(render(rows))
  return 0


if __name__ == '__main__':
  sys.exit(main())
