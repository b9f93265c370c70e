"""The regime table (issue 40 item 4): every schedule at its fastest setting that fits, for
G in {4, 8, 16} stages and M in {G/2, G, 2G, 4G} micro-batches, like with like.

The shape: a 32-layer model (d_model 2048, 16 heads, d_ff 8192, seq 2048, the library's
byte-level vocabulary of 256, tied embeddings: 1.61B parameters), bf16 compute, float32
parameters, a global batch of 64 sequences per pipeline (a micro-batch is 64 / M rows: 1 row at
G = 16, M = 64). Per (hardware, G, M) it tries, each at M (as `ouroboros plan` builds them,
`settings.settings`):

  gpipe, 1f1b, interleaved (2 chunks), zb_h1, zb_v, model_parallel   --stash-policy all, dots,
                                     nothing
  ouroboros locked and pipelined     --stash graph/nothing, replay, graph/dots, graph/all
  data_parallel (G replicas of 64 / G rows), as a reference line; backprop (1 device) as the base

Time: the library's simulator through `plan.predicted_step_s` (the step `ouroboros plan`
predicts; the recomputed forward charged by `plan.recompute_fraction`: 1 for keep=nothing and
replay, its share for dots, 0 for all), at two rates: 'nvlink-300GBps' (120 TFLOP/s effective,
300 GB/s links, the issue's) and 'tpu-v5e' (78.8 TFLOP/s effective, 50 GB/s ICI). Parallel
efficiency = backprop's step on one device (keeping everything) / (G x step).

Memory, per chip, against a v5e chip's 15.75 GiB at both rates (`HBM_BYTES`):
  state    parameters, optimizer state, Ouroboros' ring and the batch shard: exact, the sizes of
           the abstract step state that `ouroboros compile` builds (`compile._abstract_step`, no
           compile) on the topology's compile-only v5e devices (v5e:2x2, 2x4, 4x4);
  temps    the compiled step's temporaries: extrapolated from the TPU compiler's numbers at the
           1B shape (24 layers, batch 32, G = 8 on v5e:2x4; --reference, saved `ouroboros plan
           --json` files, the first that has the setting), as temps = a x params + c x units
           (`temps_model`): units = L x b x n where the setting keeps every residual or the
           matmul outputs (dots; L the layers a device holds, b the rows of one micro-batch, n
           the micro-batch stage-equivalents a device holds at once,
           `tables.program(...).stash_slots` / chunks; the line of dots its own)
           and (L / chunks) x b where it recomputes (one micro-batch's recompute of one layer
           group); a and c through the reference rows of the same schedule, forward and policy
           (a table pipeline that recomputes without a row of its own: GPipe's, else
           model_parallel's), a = 1 (one float32 gradient per parameter) with one row.
  Rows compiled at the 32-layer shape (--compile, saved to --compiled) use the compiler's own
  peak; the CSV keeps the extrapolated one beside it, and --render prints the error.

    python experiments/regime.py                                  # docs/results/regime.csv
    python experiments/regime.py --render docs/results/regime.csv # the markdown tables
    python experiments/regime.py --times docs/results/regime.csv \
        --compile 'G=8 M=8 1f1b M=8 keep=nothing' ...   # 1-15 min each; the times kept
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import os
import sys

from ouroboros_jax.perf import plan
from ouroboros_jax.perf import settings as settings_lib
from ouroboros_jax.schedules import ScheduleConfig, tables
from ouroboros_jax.training import field_flags, presets

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from regime_tables import EXACT, HARDWARE, render  # noqa: E402  (the tables' order, --render)

GIB = 2**30
HBM_BYTES = round(15.75 * GIB)  # one v5e chip, as its compiler reports it
MODEL_FLAGS = dict(
  d_model=2048,
  num_layers=32,
  num_heads=16,
  d_ff=8192,
  seq_len=2048,
  batch_size=64,
  dtype='bfloat16',
)
STAGES = (4, 8, 16)
RATIOS = (0.5, 1, 2, 4)  # M / G
STASHES = ('graph/nothing', 'replay', 'graph/dots', 'graph/all')  # Ouroboros' own
POLICIES = ('all', 'dots', 'nothing')  # every other schedule's
TOPOLOGY = {4: 'v5e:2x2', 8: 'v5e:2x4', 16: 'v5e:4x4'}
# The TPU compiler's rows at the 1B shape: with recomputation, and (for what it lacks) the plan
# before recomputation existed (its exact-pipeline rows at 9d22bd8, the others at 98d491d).
REFERENCE = 'docs/results/plan_1b_v5e_2x4_remat.json,docs/results/archive/plan_1b_v5e_2x4.json'
COMPILED = 'docs/results/regime_compiled.json'
ZERO_BUBBLE = ('zb_h1', 'zb_v')
COLUMNS = [
  'hardware',
  'G',
  'M',
  'line',
  'setting',
  'policy',
  'microbatch_rows',
  'recompute',
  'step_s',
  'efficiency',
  'state_gib',
  'ring_gib',
  'temp_gib',
  'peak_gib',
  'peak_extrapolated_gib',
  'fits',
  'memory',
  'memory_from',
  'best',
  'note',
]


def base_config():
  """The 32-layer run, as `ouroboros train --preset gpt2-small --d-model 2048 ...` builds it."""
  return field_flags.override(presets.get_preset('gpt2-small'), MODEL_FLAGS)


def line_of(setting: ScheduleConfig) -> str:
  return f'ouroboros {setting.forward}' if setting.name == 'ouroboros' else setting.name


def policy_of(setting: ScheduleConfig) -> str:
  """What the setting's forward keeps: the policy, or Ouroboros' stash ('graph/nothing')."""
  if setting.name == 'ouroboros':
    return 'replay' if setting.stash == 'replay' else f'graph/{setting.resolved_stash_policy}'
  return setting.resolved_stash_policy


def settings_at(G: int, M: int) -> list[ScheduleConfig]:
  """Every setting `ouroboros plan` would try on G devices at M micro-batches, but backprop and
  FSDP (its temporaries have no reference rows to extrapolate from; the layouts' own map has it)."""
  tries = settings_lib.Tries(
    microbatches=(M,), stashes=STASHES, policies=POLICIES, shardings=('replicated',)
  )
  return [
    s
    for s in settings_lib.settings(G, tries, num_layers=MODEL_FLAGS['num_layers'])
    if s.name != 'backprop'
  ]


# ----------------------------------------------------------------------------- time


def time_rows(cfg, hardware=HARDWARE, stages=STAGES, ratios=RATIOS) -> list[dict]:
  """One row per (hardware, G, M, setting): predicted step, efficiency, recompute; plus the
  backprop base (G = 1) per hardware and policy. Settings the run cannot take carry the reason
  in 'note' and no step."""
  rows = []
  for name in hardware:
    rates = plan.hardware_for(None, name)
    base = _predicted(cfg, ScheduleConfig(), rates)  # keeps everything
    for policy in POLICIES:
      setting = ScheduleConfig(stash_policy=policy)
      step = _predicted(cfg, setting, rates)
      rows.append(_time_row(name, 1, '', setting, cfg, step, base / step, ''))
    for G in stages:
      for M in [max(1, round(r * G)) for r in ratios]:
        for setting in settings_at(G, M):
          reason = plan.applies(field_flags.override(cfg, field_flags.train_flags(setting)))
          if reason is not None:
            rows.append(_time_row(name, G, M, setting, cfg, None, None, reason))
            continue
          step = _predicted(cfg, setting, rates)
          rows.append(_time_row(name, G, M, setting, cfg, step, base / (G * step), ''))
  return rows


def _predicted(cfg, setting: ScheduleConfig, rates) -> float:
  """`plan`'s predicted step of `setting`, resolved as the run resolves it on a TPU."""
  return plan.predicted_step_s(cfg, setting.resolve('tpu', cfg.batch_size), rates)


def _time_row(hardware, G, M, setting, cfg, step, efficiency, note) -> dict:
  return {
    'hardware': hardware,
    'G': G,
    'M': M,
    'line': 'backprop' if G == 1 else line_of(setting),
    'setting': setting.label,
    'policy': policy_of(setting),
    'microbatch_rows': microbatch_rows(setting, cfg.batch_size),
    'recompute': plan.recompute_fraction(setting, cfg.model),
    'step_s': step,
    'efficiency': efficiency,
    'note': note,
  }


def microbatch_rows(setting: ScheduleConfig, batch: int) -> float:
  """Rows of one micro-batch: B / M on the pipelines and Ouroboros, B / R on data_parallel."""
  if setting.name == 'data_parallel':
    return batch / setting.data_parallel
  if setting.name in ('backprop', 'model_parallel'):
    return batch
  return batch / setting.num_microbatches


# ----------------------------------------------------------------------------- memory


def layers_per_device(setting: ScheduleConfig, num_layers: int) -> float:
  if setting.name in ('backprop', 'data_parallel'):
    return num_layers
  return num_layers / setting.num_stages


def in_flight(setting: ScheduleConfig) -> float:
  """Micro-batch stage-equivalents a device of a table pipeline keeps at once: its stash slots
  (`tables.program`), each one chunk of 1 / chunks of the device's layers; 1 elsewhere."""
  if setting.name not in EXACT:
    return 1.0
  pipeline = tables.build(
    setting.name, setting.num_stages, setting.num_microbatches, setting.chunks
  )
  return tables.program(tables.place(pipeline)).stash_slots / pipeline.chunks


def key_of(schedule: str, forward, policy: str) -> tuple:
  return (schedule, forward if schedule == 'ouroboros' else '', policy)


def reference_rows(path: str) -> dict[tuple, list[dict]]:
  """The compiled rows of a saved plan (device-memory stash only), by (schedule, forward,
  policy); each row with its ScheduleConfig ('setting') and the file ('source')."""
  with open(path) as f:
    saved = json.load(f)
  out = {}
  for row in saved['rows']:
    if row.get('peak_bytes') is None or (row.get('stash_memory') or 'device') != 'device':
      continue
    if row.get('temp_bytes') is None or row['label'].endswith(' host'):
      continue
    setting = _setting_of_row(row)
    out.setdefault(key_of(setting.name, setting.forward, policy_of(setting)), []).append(
      {**row, 'setting': setting, 'source': os.path.basename(path)}
    )
  return out


def _setting_of_row(row: dict) -> ScheduleConfig:
  """A saved plan row's ScheduleConfig: its flags, the stash as `compile` reports it ('graph/P',
  'replay'; the policy itself for the other schedules)."""
  fields = {f.name for f in dataclasses.fields(ScheduleConfig)} - {'compensation', 'stash'}
  names = {'schedule': 'name', 'stages': 'num_stages'}
  values = {names.get(k, k): v for k, v in row.items() if names.get(k, k) in fields}
  if row['schedule'] == 'ouroboros':
    mode, _, policy = row['stash'].partition('/')
    values.update(stash=mode, stash_policy=policy or 'auto')
  else:
    values['stash_policy'] = row.get('stash_policy') or row.get('stash') or 'all'
  return ScheduleConfig(**values)


def reference_for(setting: ScheduleConfig, references: dict) -> list[dict]:
  """The reference rows of the same schedule, forward and policy (every M compiled); for a
  table pipeline that recomputes with no row of its own, GPipe's that recomputes (the same table
  executor), else model_parallel's (the same working set: one micro-batch's recompute of one
  layer group)."""
  policy = policy_of(setting)
  candidates = references.get(key_of(setting.name, setting.forward, policy), [])
  for proxy in ('gpipe', 'model_parallel'):
    if not candidates and setting.name in EXACT and policy != 'all':
      candidates = references.get(key_of(proxy, None, policy), [])
  return candidates


def chunks_of(setting: ScheduleConfig) -> int:
  """The layer groups a device holds: a table pipeline's chunks, 1 elsewhere."""
  if setting.name not in EXACT:
    return 1
  return setting.chunks or tables.DEFAULT_CHUNKS.get(setting.name, 1)


def activation_units(setting: ScheduleConfig, num_layers: int, batch: int) -> float:
  """What a device's activations scale with, in layer x rows: keeping every residual or every
  matmul output (dots), L x b x n (n micro-batch stage-equivalents in flight; each policy its
  own line through its own rows); recomputing all of it, the working set of one chunk's
  recompute of one micro-batch, (L / chunks) x b, but for the zero-bubble split, whose W keeps
  the sub-layer inputs B recorded for every micro-batch between its B and its W: L x b x n
  again (the 1B compiles: ZB-H1 keeping nothing 21.4 GiB of temporaries, 1F1B 7.4)."""
  layers, rows = layers_per_device(setting, num_layers), microbatch_rows(setting, batch)
  if policy_of(setting) in ('all', 'dots') or setting.name in ZERO_BUBBLE:
    return layers * rows * in_flight(setting)
  return layers / chunks_of(setting) * rows


def temps_model(candidates: list[dict], ref_layers: int, ref_batch: int) -> tuple[float, float]:
  """(a, c) of temps = a x params + c x activation_units, from the reference rows: a least-
  squares line through them where they differ in activation units, else a = 1 (one float32
  gradient per parameter) and c through the one point."""
  points = [
    (activation_units(r['setting'], ref_layers, ref_batch), r['temp_bytes'], r['params_bytes'])
    for r in candidates
  ]
  params = points[0][2]
  xs = sorted({x for x, _, _ in points})
  if len(xs) >= 2:
    mx = sum(x for x, _, _ in points) / len(points)
    my = sum(y for _, y, _ in points) / len(points)
    sxx = sum((x - mx) ** 2 for x, _, _ in points)
    c = sum((x - mx) * (y - my) for x, y, _ in points) / sxx
    a = (my - c * mx) / params
    if c > 0 and a >= 0:
      return a, c
  x, y, _ = min(points, key=lambda p: p[0])
  return 1.0, max(y - params, 0) / x


def extrapolated_temps(setting, state: dict, candidates: list[dict], cfg, ref_layers, ref_batch):
  """The temporaries of `setting` at cfg's shape (module docstring)."""
  a, c = temps_model(candidates, ref_layers, ref_batch)
  units = activation_units(setting, cfg.model.num_layers, cfg.batch_size)
  return a * state['params_bytes'] + c * units


def abstract_state(setting: ScheduleConfig, cfg, devices) -> dict:
  """The bytes one device holds of the step's state and batch at cfg's shape, exactly: the
  abstract state `ouroboros compile` builds, without compiling."""
  from ouroboros_jax import placement
  from ouroboros_jax.perf import compile as compile_lib

  run_cfg = field_flags.override(cfg, field_flags.train_flags(setting))
  run_cfg = field_flags.override(run_cfg, {'attention': run_cfg.model.attention_kind('tpu')})
  run = run_cfg.schedule_config(devices[0].platform)
  _, state, batch = compile_lib._abstract_step(run_cfg, run, devices)  # noqa: SLF001
  ring = {k: v for k, v in state.ring.items() if k != placement.HOST}
  return {
    'params_bytes': compile_lib.shard_bytes(state.params),
    'opt_state_bytes': compile_lib.shard_bytes(state.opt_state),
    'ring_bytes': compile_lib.shard_bytes(ring),
    'batch_bytes': compile_lib.shard_bytes(batch),
  }


def memory_rows(
  rows: list[dict], cfg, reference: str | None, compiled: dict, cache: str | None = None
) -> None:
  """Fills each row's memory columns in place (once per setting: memory does not depend on the
  hardware's rates). `cache`: a JSON file of the abstract states already sized."""
  from ouroboros_jax.perf import compile as compile_lib

  references = {}
  for path in reversed([p for p in (reference or '').split(',') if os.path.exists(p)]):
    references.update(reference_rows(path))  # the first file's rows win
  ref_meta = (24, 32)  # the 1B shape's layers and batch
  devices_of, done, states = {}, {}, _load(cache)
  for row in rows:
    if row['step_s'] is None or row['G'] == 1:
      continue
    key = (row['G'], row['M'], row['setting'])
    if key not in done:
      setting = _setting_from_label(row)
      G = setting.num_stages if setting.name != 'data_parallel' else setting.data_parallel
      sized = f'G={row["G"]} M={row["M"]} {row["setting"]}'
      if sized not in states:
        if G not in devices_of:
          devices_of[G] = compile_lib.topology_devices(TOPOLOGY[G])[:G]
        states[sized] = abstract_state(setting, cfg, devices_of[G])
      done[key] = _memory_of(setting, states[sized], references, compiled.get(sized), cfg, ref_meta)
    row.update(done[key])
  if cache:
    with open(cache, 'w') as f:
      json.dump(states, f)
  _mark_fits(rows)


def _memory_of(setting, state: dict, references: dict, measured, cfg, ref_meta) -> dict:
  """The memory columns of `setting`: its state's, its temporaries extrapolated from the
  reference rows (or the state alone, a floor, without one), and the compiler's peak where
  `measured` (its compiled report) is given."""
  fixed = sum(state.values())
  memo = {
    'state_gib': (state['params_bytes'] + state['opt_state_bytes']) / GIB,
    'ring_gib': state['ring_bytes'] / GIB,
    'memory': 'extrapolated',
  }
  ref = reference_for(setting, references)
  if ref:
    temps = extrapolated_temps(setting, state, ref, cfg, *ref_meta)
    memo.update(
      temp_gib=temps / GIB,
      peak_extrapolated_gib=(fixed + temps) / GIB,
      peak_gib=(fixed + temps) / GIB,
      memory_from=f'{"; ".join(r["label"] for r in ref)} ({ref[0]["source"]})',
    )
  else:  # no reference row: the state alone, a floor (too large: does not fit)
    memo.update(peak_gib=None, memory='state only', memory_from='', floor=fixed)
  if measured is not None:
    memo.update(
      peak_gib=measured['peak_bytes'] / GIB,
      temp_gib=(measured.get('temp_bytes') or 0) / GIB,
      memory='compiled',
    )
  return memo


def _mark_fits(rows: list[dict]) -> None:
  """Sets each row's 'fits' against HBM_BYTES in place (unknown: None, but False where the
  state's floor alone exceeds it); the backprop base rows' memory is not estimated."""
  for row in rows:
    peak = row.get('peak_gib')
    row['fits'] = None if peak is None else peak * GIB <= HBM_BYTES
    if peak is None and row.get('floor', 0) > HBM_BYTES:
      row['fits'] = False
    if row['G'] == 1:
      row['memory'] = 'not estimated (reference)'


def _setting_from_label(row: dict) -> ScheduleConfig:
  """The row's ScheduleConfig again (settings_at is deterministic; match its label)."""
  for setting in settings_at(row['G'], row['M']):
    if setting.label == row['setting']:
      return setting
  raise ValueError(f'no setting {row["setting"]!r} at G={row["G"]}, M={row["M"]}')


# ----------------------------------------------------------------------------- best


def mark_best(rows: list[dict]) -> None:
  """'+' on each line's fastest setting that fits at (hardware, G, M), '*' on the fastest of
  all (fits unknown counts as fitting, marked '?' in the tables)."""
  groups = {}
  for row in rows:
    row['best'] = ''
    if row['step_s'] is not None and row['G'] != 1 and row['fits'] is not False:
      groups.setdefault((row['hardware'], row['G'], row['M']), []).append(row)
  for group in groups.values():
    by_line = {}
    for row in sorted(group, key=lambda r: r['step_s']):
      by_line.setdefault(row['line'], row)
    for row in by_line.values():
      row['best'] = '+'
    min(group, key=lambda r: r['step_s'])['best'] = '*'


# ----------------------------------------------------------------------------- csv


def write_csv(path: str, rows: list[dict]) -> None:
  with open(path, 'w', newline='') as f:
    writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction='ignore')
    writer.writeheader()
    for row in rows:
      writer.writerow({k: _text(row.get(k)) for k in COLUMNS})


def _text(value) -> str:
  if value is None:
    return ''
  if isinstance(value, float):
    return f'{value:.6g}'
  return str(value)


def read_csv(path: str) -> list[dict]:
  """The rows as written, numbers as numbers (None where empty)."""
  numbers = {
    'step_s',
    'efficiency',
    'recompute',
    'microbatch_rows',
    'state_gib',
    'ring_gib',
    'temp_gib',
    'peak_gib',
    'peak_extrapolated_gib',
  }
  rows = []
  with open(path, newline='') as f:
    for row in csv.DictReader(f):
      for k in numbers:
        row[k] = float(row[k]) if row[k] != '' else None
      row['G'] = int(row['G'])
      row['M'] = int(row['M']) if row['M'] != '' else ''
      row['fits'] = {'True': True, 'False': False, '': None}[row['fits']]
      rows.append(row)
  return rows


# ----------------------------------------------------------------------------- compile


def compile_settings(labels: list[str], cfg, path: str) -> dict:
  """Compiles each 'G=g M=m LABEL' for its v5e topology and saves the reports to `path`."""
  from ouroboros_jax.perf import compile as compile_lib

  saved = _load(path)
  for text in labels:
    g_part, m_part, label = text.split(' ', 2)
    G, M = int(g_part.split('=')[1]), int(m_part.split('=')[1])
    setting = _setting_from_label({'G': G, 'M': M, 'setting': label})
    run = field_flags.override(cfg, field_flags.train_flags(setting))
    report = compile_lib.compile_step(run, TOPOLOGY[G])
    report['peak_gib'] = report['peak_bytes'] / GIB
    saved[text] = report
    print(f'{text}: {report["peak_gib"]:.2f} GiB, {report["compile_s"]:.0f} s', flush=True)
    with open(path, 'w') as f:
      json.dump(saved, f, indent=1, default=str)
  return saved


def _load(path: str) -> dict:
  if path and os.path.exists(path):
    with open(path) as f:
      return json.load(f)
  return {}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--out', default='docs/results/regime.csv')
  parser.add_argument('--render', metavar='CSV', help='print the tables of a written CSV')
  parser.add_argument('--reference', default=REFERENCE, help='a saved 1B plan (--json)')
  parser.add_argument('--compiled', default=COMPILED, help='compiled 32-layer rows (JSON)')
  parser.add_argument('--compile', nargs='*', metavar='"G=g M=m LABEL"', default=[])
  parser.add_argument('--hardware', default=','.join(HARDWARE))
  parser.add_argument('--no-memory', action='store_true', help='times only (no libtpu needed)')
  parser.add_argument('--state-cache', metavar='JSON', help='keep the sized states here')
  parser.add_argument(
    '--times', metavar='CSV', help="take the times from a written CSV (the simulator's ~10 min)"
  )
  args = parser.parse_args(argv)
  if args.render:
    print(render(read_csv(args.render)), end='')
    return None
  cfg = base_config()
  if args.compile:
    compile_settings(args.compile, cfg, args.compiled)
  if args.times:
    rows = [{k: r[k] for k in (*COLUMNS[:10], 'note')} for r in read_csv(args.times)]
  else:
    rows = time_rows(cfg, [h for h in args.hardware.split(',') if h])
  if args.no_memory:
    for row in rows:
      row.update(fits=None, memory='not estimated')
  else:
    memory_rows(rows, cfg, args.reference, _load(args.compiled), args.state_cache)
  mark_best(rows)
  write_csv(args.out, rows)
  print(render(read_csv(args.out)), end='')
  print(f'\nwrote {args.out} ({len(rows)} rows)')
  return rows


if __name__ == '__main__':
  main()
