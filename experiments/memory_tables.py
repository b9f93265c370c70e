"""Per-device memory of every schedule, from the TPU compiler (docs/results/memory.md's tables).

Every row is `ouroboros compile` (`perf.compile.compile_step`) of one run for a TPU topology,
on this CPU machine (libtpu: `pip install -e ".[tpu]"`): the compiler's own `memory_analysis()`,
or, where the step does not fit, the bytes its out-of-memory verdict names.

    python experiments/memory_tables.py                          # all three tables, ~10 min
    python experiments/memory_tables.py --tables schedules --batch-sizes 32

Tables (printed as markdown and written to --out as CSV):

  schedules   the GPT-2-small shape (d_model 768, 12 layers, 12 heads, seq 1024), G = 4, M = 8,
              every schedule, fp32 and bf16, at each --batch-sizes
  precision   bf16 against fp32 at d_model 512, 8 layers, seq 512, batch 8 (both fit a v5e)
  attention   the step's temporaries at seq L and 2L with xla and blockwise attention
  ring        what each piece of an Ouroboros that fits is worth: micro-batches, the stash
              policy, the stash in host memory (GPT-2-small shape, batch 32, G = 4, bf16)
"""

from __future__ import annotations

import argparse
import csv
import os
import sys

GIB = 2**30

WHOLE = dict(schedule='ouroboros', stages=4, microbatches=1)
# (label, flags): the schedule settings of every table; G and M as the issue states them. The
# Ouroboros settings that fit, with micro-batches, are `ouroboros plan`'s (docs/results/memory.md).
SCHEDULES = (
  ('backprop (1 chip)', dict(schedule='backprop', stages=1)),
  ('data_parallel R=4', dict(schedule='data_parallel', stages=1, data_parallel=4)),
  ('model_parallel', dict(schedule='model_parallel', stages=4)),
  ('gpipe M=8', dict(schedule='gpipe', stages=4, microbatches=8)),
  ('1f1b M=8', dict(schedule='1f1b', stages=4, microbatches=8)),
  ('interleaved M=8', dict(schedule='interleaved', stages=4, microbatches=8)),
  ('zb_h1 M=8', dict(schedule='zb_h1', stages=4, microbatches=8)),
  ('zb_v M=8', dict(schedule='zb_v', stages=4, microbatches=8)),
  # Ouroboros as it was before micro-batches: the whole batch at once (issue 25 added them).
  ('ouroboros graph/all', dict(WHOLE, stash_policy='all')),
  ('ouroboros graph/nothing', dict(WHOLE, stash_policy='nothing')),
  ('ouroboros replay', dict(WHOLE, stash='replay')),
  ('ouroboros pipelined graph/all', dict(WHOLE, forward='pipelined', stash_policy='all')),
  ('ouroboros pipelined replay', dict(WHOLE, forward='pipelined', stash='replay')),
)
MICRO = dict(schedule='ouroboros', stages=4, microbatches=8)
HOST = dict(stash_memory='pinned_host')
RING = (
  ('whole batch, graph/all (the old default)', dict(WHOLE, stash_policy='all')),
  ('whole batch, graph/nothing', dict(WHOLE, stash_policy='nothing')),
  ('M = 4, graph/nothing', dict(MICRO, microbatches=4, stash_policy='nothing')),
  ('M = 8, graph/nothing', dict(MICRO, stash_policy='nothing')),
  ('M = 8, graph/nothing, host', dict(MICRO, stash_policy='nothing', **HOST)),
  ('M = 8, graph/dots', dict(MICRO, stash_policy='dots')),
  ('M = 8, graph/all', dict(MICRO, stash_policy='all')),
  ('M = 8, replay', dict(MICRO, stash='replay')),
  ('M = 8, replay, host', dict(MICRO, stash='replay', **HOST)),
  ('pipelined, M = 8, graph/nothing', dict(MICRO, forward='pipelined', stash_policy='nothing')),
  (
    'pipelined, M = 8, graph/nothing, host',
    dict(MICRO, forward='pipelined', stash_policy='nothing', **HOST),
  ),
  ('pipelined, M = 8, graph/all', dict(MICRO, forward='pipelined', stash_policy='all')),
  ('1F1B, M = 8 (for scale)', dict(schedule='1f1b', stages=4, microbatches=8)),
)
GPT2_SMALL = dict(d_model=768, num_layers=12, num_heads=12, d_ff=3072, seq_len=1024)
PRECISION_SHAPE = dict(d_model=512, num_layers=8, num_heads=8, d_ff=2048, seq_len=512, batch_size=8)


def compile_row(topology: str, **flags) -> dict:
  from ouroboros_jax.perf.compile import compile_step
  from ouroboros_jax.training import field_flags, presets

  # The paper's AdamW for every schedule: the memory compared is the schedule's, not Muon's.
  values = dict(optimizer='adamw', compensation='none', **flags)
  return compile_step(field_flags.override(presets.get_preset('gpt2-small'), values), topology)


def gib(value) -> str:
  return '-' if value is None else f'{value / GIB:.2f}'


def schedules_table(topology: str, batch_sizes, log=print) -> list[dict]:
  rows = []
  for batch_size in batch_sizes:
    for label, flags in SCHEDULES:
      for dtype in ('float32', 'bfloat16'):
        r = compile_row(topology, batch_size=batch_size, dtype=dtype, **GPT2_SMALL, **flags)
        rows.append(dict(r, table='schedules', label=label, batch_size=batch_size))
        log(f'{label:32s} b{batch_size:<3d} {dtype:9s} peak {gib(r["peak_bytes"])} GiB')
  return rows


def precision_table(topology: str, log=print) -> list[dict]:
  rows = []
  for label, flags in SCHEDULES:
    for dtype in ('float32', 'bfloat16'):
      r = compile_row(topology, dtype=dtype, **PRECISION_SHAPE, **flags)
      rows.append(dict(r, table='precision', label=label, batch_size=8))
      log(f'{label:32s} {dtype:9s} peak {gib(r["peak_bytes"])} GiB')
  return rows


def attention_table(topology: str, log=print) -> list[dict]:
  rows = []
  for label, flags in (SCHEDULES[0], SCHEDULES[4], SCHEDULES[8]):
    for attention in ('xla', 'blockwise'):
      for seq_len in (1024, 2048):
        shape = dict(PRECISION_SHAPE, seq_len=seq_len, dtype='bfloat16', attention=attention)
        r = compile_row(topology, **shape, **flags)
        rows.append(dict(r, table='attention', label=label, attention=attention, seq_len=seq_len))
        log(f'{label:32s} {attention:9s} L={seq_len} temp {gib(r["temp_bytes"])} GiB')
  return rows


def ring_table(topology: str, log=print) -> list[dict]:
  rows = []
  for label, flags in RING:
    r = compile_row(topology, batch_size=32, dtype='bfloat16', **GPT2_SMALL, **flags)
    rows.append(dict(r, table='ring', label=label, batch_size=32))
    log(f'{label:40s} peak {gib(r["peak_bytes"])} GiB')
  return rows


def _schedules_lines(rows: list[dict]) -> list[str]:
  """The lines of the schedules tables (one per batch size, largest first)."""
  lines = []
  schedules = [r for r in rows if r['table'] == 'schedules']
  for batch_size in sorted({r['batch_size'] for r in schedules}, reverse=True):
    lines += [
      f'\nGPT-2-small shape, batch {batch_size}: GiB per chip (state: parameters and optimizer '
      "state, float32 in both; ring: the bf16 run's):",
      '',
      '| schedule | fp32 peak | bf16 peak | bf16 / fp32 | fp32 state | bf16 ring | bf16 fits |',
      '|---|---|---|---|---|---|---|',
    ]
    by = {(r['label'], r['dtype']): r for r in schedules if r['batch_size'] == batch_size}
    for label, _ in SCHEDULES:
      if (label, 'bfloat16') not in by or (label, 'float32') not in by:
        continue  # a table still being computed
      f32, b16 = by[label, 'float32'], by[label, 'bfloat16']
      lines.append(
        f'| {label} | {gib(f32["peak_bytes"])} | {gib(b16["peak_bytes"])} | '
        f'{b16["peak_bytes"] / f32["peak_bytes"]:.2f} | '
        f'{gib(f32["params_bytes"] + f32["opt_state_bytes"])} | {gib(b16["ring_bytes"])} | '
        f'{"yes" if b16["fits"] else "no"} |'
      )
  return lines


def _precision_lines(rows: list[dict]) -> list[str]:
  """The lines of the precision table (none without its rows)."""
  precision = [r for r in rows if r['table'] == 'precision']
  if not precision:
    return []
  lines = [
    '\nd_model 512, 8 layers, seq 512, batch 8: bf16 against fp32',
    '',
    '| schedule | fp32 peak GiB | bf16 peak GiB | bf16 / fp32 |',
    '|---|---|---|---|',
  ]
  by = {(r['label'], r['dtype']): r for r in precision}
  for label, _ in SCHEDULES:
    if (label, 'bfloat16') not in by or (label, 'float32') not in by:
      continue
    f32, b16 = by[label, 'float32'], by[label, 'bfloat16']
    lines.append(
      f'| {label} | {gib(f32["peak_bytes"])} | {gib(b16["peak_bytes"])} | '
      f'{b16["peak_bytes"] / f32["peak_bytes"]:.2f} |'
    )
  return lines


def _attention_lines(rows: list[dict]) -> list[str]:
  """The lines of the attention table (none without its rows)."""
  attention = [r for r in rows if r['table'] == 'attention']
  if not attention:
    return []
  lines = [
    '\nbf16, d_model 512, 8 layers, batch 8: temporaries GiB at seq 1024 and 2048',
    '',
    '| schedule | attention | L=1024 | L=2048 | ratio |',
    '|---|---|---|---|---|',
  ]
  by = {(r['label'], r['attention'], r['seq_len']): r for r in attention}
  for label, kind in dict.fromkeys((r['label'], r['attention']) for r in attention):
    if (label, kind, 2048) not in by:
      continue
    a, b = by[label, kind, 1024], by[label, kind, 2048]
    lines.append(
      f'| {label} | {kind} | {gib(a["temp_bytes"])} | {gib(b["temp_bytes"])} | '
      f'{b["temp_bytes"] / a["temp_bytes"]:.2f} |'
    )
  return lines


def _ring_lines(rows: list[dict]) -> list[str]:
  """The lines of the ring table (none without its rows)."""
  ring = [r for r in rows if r['table'] == 'ring']
  if not ring:
    return []
  lines = [
    '\nOuroboros, GPT-2-small shape, batch 32, G = 4, bf16, AdamW: GiB per chip',
    '',
    '| Ouroboros setting | peak | fits | ring on the chip | ring in host memory | temporaries |',
    '|---|---|---|---|---|---|',
  ]
  for r in ring:
    lines.append(
      f'| {r["label"]} | {gib(r["peak_bytes"])} | {"yes" if r["fits"] else "no"} | '
      f'{gib(r["ring_bytes"])} | {gib(r.get("host_ring_bytes"))} | {gib(r["temp_bytes"])} |'
    )
  return lines


def markdown(rows: list[dict]) -> str:
  """The markdown of every table that `rows` has: schedules, precision, attention, ring."""
  lines = [
    *_schedules_lines(rows),
    *_precision_lines(rows),
    *_attention_lines(rows),
    *_ring_lines(rows),
  ]
  return '\n'.join(lines)


def _typed(row: dict) -> dict:
  """A CSV row back as compile_step wrote it: numbers as numbers, fits as a bool."""
  out = {}
  for key, value in row.items():
    if key == 'fits':
      out[key] = {'True': True, 'False': False}.get(value)
    elif key.endswith(('_bytes', 'batch_size', 'seq_len')) and value not in ('', None):
      out[key] = int(float(value))
    else:
      out[key] = value
  return out


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--topology', default='v5e:2x2')
  parser.add_argument('--tables', default='precision,attention,schedules,ring')
  parser.add_argument('--batch-sizes', default='32,8')
  parser.add_argument('--out', default='docs/results/memory_tpu.csv')
  parser.add_argument('--render', metavar='CSV', help='print the tables of a written CSV and stop')
  args = parser.parse_args(argv)
  if args.render:
    with open(args.render) as f:
      print(markdown([_typed(r) for r in csv.DictReader(f)]))
    return
  from ouroboros_jax.runtime import host

  host.configure_cpu_runtime()
  rows = []

  def save():  # after every table: a long run's finished tables are kept
    os.makedirs(os.path.dirname(args.out) or '.', exist_ok=True)
    with open(args.out, 'w', newline='') as f:
      writer = csv.DictWriter(f, fieldnames=sorted({k for r in rows for k in r}))
      writer.writeheader()
      writer.writerows(rows)

  for table in args.tables.split(','):
    if table == 'schedules':
      for batch_size in args.batch_sizes.split(','):
        rows.extend(schedules_table(args.topology, [int(batch_size)]))
        save()
    else:
      rows.extend(
        {'precision': precision_table, 'attention': attention_table, 'ring': ring_table}[table](
          args.topology
        )
      )
      save()
  print(markdown(rows))
  print(f'\nwrote {args.out}', file=sys.stderr)


if __name__ == '__main__':
  main()
