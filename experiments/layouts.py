"""The layout map (issue 61): for N chips and a global batch of B sequences, which layout the
simulator predicts fastest, FSDP over all N chips or a pipeline of G stages on N / G data
replicas, like with like (every layout keeps the same of its forward, --policy).

Per model and hardware, N in {8, 64, 512} chips (on v5e: one slice up to 256 chips, two slices
of 256 joined by the data-centre network at 512) and B in {N/4, N/2, N, 2N, 4N}, it tries

  data_parallel fsdp    D = N, B / N sequences a chip (B >= N: a sequence is not split)
  data_parallel         D = N replicated, as a reference line
  every G x R = N       G in `settings.factorisations` (G <= 16), R = N / G data replicas of
                        B / R sequences each, cut into M = B / R micro-batches of one sequence:
                        ouroboros pipelined and locked, zb_h1, zb_v, 1f1b, interleaved; each
                        also with --fsdp where R > 1 (its stages' parameters, gradients and
                        optimizer state sharded over the R replicas, and so its update)

and predicts each step with `plan.predicted_step_s` (the library's simulator: FSDP's gathers and
reductions overlapped with its compute, each stage's gradient all-reduced over its replicas,
collectives on a 2-link ring inside a slice and the data-centre network between slices,
`plan.TPU_V5E` / `plan.TPU_V5P`).

Memory (`--memory`): each cell's lines (FSDP, Ouroboros, the exact pipelines) are judged fastest
row first until one fits, by the per-chip peak of the TPU compiler (`plan`'s compile,
`compile.compile_step` on libtpu's compile-only devices: its memory analysis, or its
out-of-memory verdict) against the memory the compiler lets a program use (v5e: 15.75 GiB of
16; v5p: its own figure, `compile.device_capacity`). Nothing is compiled for 64 or 512 chips; a
chip's memory depends on the shapes it holds:

  pipelines   compiled at the per-chip shape: G stages x 1 replica (G chips: v5e:1x2, 2x2,
              2x4, 4x4; v5p:1x2x1, 2x2x1, 2x2x2, 2x2x4) of the replica's B / R sequences in the
              same M micro-batches; the R data replicas do not change what a chip holds;
              with --fsdp the same compile, its state shard extrapolated from 1 to 1 / R of
              a stage's, peak(R) = peak(1) - (params_bytes + opt_state_bytes) * (1 - 1 / R)
  FSDP        compiled at D = 8 (v5e:2x4, v5p:2x2x2) with the same B / N sequences a chip, so
              exact at N = 8 and extrapolated from D = 8 above it: a chip's shard of the
              parameters and optimizer state shrinks from 1 / 8 of the model's to 1 / N,
              peak(N) = peak(8) - (params_bytes + opt_state_bytes at D = 8) * (1 - 8 / N),
              its activations, gathered layers and gradient buffers kept as at D = 8

The compiles are cached by shape in docs/results/layouts/layouts_memory.csv (`MEMORY_COLUMNS`,
bytes a chip), which the map's verdict columns (peak_gib, fits, memory: how the peak was had)
are read from; the map names the fastest layout and the fastest that fits. Every cell of the
1B and 7B rows is judged (2026-12-04: 1B ~65 min and 7B ~105 min of compiles on 2 busy cores,
all told).

    python experiments/layouts.py                       # docs/results/layouts/layouts.csv (~10 min)
    python experiments/layouts.py --memory --models 1b  # judge the saved map's memory, compiling
                                                        # the shapes the cache lacks
    python experiments/layouts.py --render docs/results/layouts/layouts.csv
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import sys

from ouroboros_jax.errors import ConfigError
from ouroboros_jax.perf import compile as compile_lib
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
COLUMNS += ['fsdp', 'shard_update', 'policy', 'step_s', 'note', 'peak_gib', 'fits', 'memory']
MEMORY_CSV = 'docs/results/layouts/layouts_memory.csv'
MEMORY_KEY = ['model', 'line', 'G', 'batch', 'M', 'policy']  # a chip's shape: what it holds
MEMORY_COLUMNS = MEMORY_KEY + ['topology', 'peak_bytes', 'params_bytes', 'opt_state_bytes']
MEMORY_COLUMNS += ['ring_bytes', 'temp_bytes', 'hbm_bytes', 'fits', 'compile_s', 'error']
FSDP_COMPILED = 8  # FSDP is compiled at D = 8 with the same sequences a chip, then extrapolated
# The compile-only topology of G chips: a pipeline's G stages of one replica.
TOPOLOGIES = {
  plan.TPU_V5E.name: {2: 'v5e:1x2', 4: 'v5e:2x2', 8: 'v5e:2x4', 16: 'v5e:4x4'},
  plan.TPU_V5P.name: {2: 'v5p:1x2x1', 4: 'v5p:2x2x1', 8: 'v5p:2x2x2', 16: 'v5p:2x2x4'},
}
LINES = (('fsdp',), ('ouroboros pipelined', 'ouroboros locked'), PIPELINES)


def line_of(setting: ScheduleConfig) -> str:
  if setting.name == 'ouroboros':
    return f'ouroboros {setting.forward}'
  if setting.name == 'data_parallel':
    return 'fsdp' if setting.fsdp else 'data_parallel'
  return setting.name


def sharding_of(row: dict) -> str:
  """How a row's layout keeps its state over its replicas, one of `settings.SHARDINGS`."""
  if str(row.get('fsdp')) == 'True':
    return 'fsdp'
  return 'update' if str(row.get('shard_update')) == 'True' else 'replicated'


def layouts(
  chips: int, batch: int, num_layers: int, policy: str, shardings=settings_lib.SHARDINGS
) -> list[ScheduleConfig]:
  """Every layout of `chips` chips for a batch of `batch` sequences (see the module's doc), of
  the `shardings` asked for."""
  out = []
  if batch % chips == 0:
    for fsdp in (True, False):
      out.append(ScheduleConfig(name='data_parallel', data_parallel=chips, fsdp=fsdp))
  for G in settings_lib.factorisations(chips, num_layers):
    R = chips // G
    if G > MAX_STAGES or batch % R:
      continue
    on = dict(num_stages=G, data_parallel=R, microbatches=batch // R)
    pipes = [ScheduleConfig(name='ouroboros', forward=f, **on) for f in ('pipelined', 'locked')]
    pipes += [ScheduleConfig(name=name, **on) for name in PIPELINES]
    out += pipes  # and each with its optimizer state, or all its state, split over the R
    for sharded in ('update', 'fsdp') if R > 1 else ():  # replicas (--shard-update, --fsdp)
      out += [dataclasses.replace(s, **settings_lib.sharding_fields(sharded)) for s in pipes]
  out = [dataclasses.replace(s, stash_policy=policy) for s in out]  # Ouroboros': its graph's
  return [s for s in out if sharding_of(dataclasses.asdict(s)) in shardings]


def cell_rows(
  model: str, chips: int, batch: int, policy: str, shardings=settings_lib.SHARDINGS
) -> list[dict]:
  """One row per layout of one (model, N, B) cell: its predicted step, or why none."""
  flags, hardware, slice_chips = MODELS[model]
  cfg = field_flags.override(presets.get_preset('gpt2-small'), {**flags, 'batch_size': batch})
  slices = max(1, chips // slice_chips)
  rows = []
  for setting in layouts(chips, batch, cfg.model.num_layers, policy, shardings):
    row = dict(model=model, hardware=hardware.name, chips=chips, slices=slices, batch=batch)
    row.update(line=line_of(setting), G=setting.num_stages, R=setting.data_parallel)
    row.update(M=setting.num_microbatches, fsdp=setting.fsdp, shard_update=setting.shard_update)
    row.update(policy=policy, step_s=None, note='')
    try:
      resolved = setting.resolve('tpu', batch)
      row['setting'] = resolved.label
      row['step_s'] = plan.predicted_step_s(cfg, resolved, hardware, slices=slices)
    except (ConfigError, ValueError) as e:  # a table its M cannot build, replicas over slices
      row['setting'], row['note'] = setting.label, ' '.join(str(e).split())[:160]
    rows.append(row)
  return rows


def main_rows(policy: str, models=tuple(MODELS), shardings=settings_lib.SHARDINGS) -> list[dict]:
  rows = []
  for model in models:
    for chips in CHIPS:
      for per_chip in BATCH_PER_CHIP:
        rows += cell_rows(model, chips, int(chips * per_chip), policy, shardings)
        print(f'{model} N={chips} B={int(chips * per_chip)}: {len(rows)} rows', flush=True)
  return rows


def best(rows: list[dict], lines) -> dict | None:
  """The fastest row of `lines` (None: none of them applies)."""
  timed = [r for r in rows if r['line'] in lines and r['step_s'] not in (None, '')]
  return min(timed, key=lambda r: float(r['step_s'])) if timed else None


def sharded_over_replicas(row: dict) -> str | None:
  """How a pipeline splits its stages' state over its R > 1 data replicas: 'fsdp' (all of it),
  'update' (its optimizer state, --shard-update) or None (FSDP alone is the line 'fsdp')."""
  sharding = sharding_of(row)
  if row['line'] == 'fsdp' or int(row['R']) == 1 or sharding == 'replicated':
    return None
  return sharding


def per_chip(row: dict) -> dict:
  """The shape one chip of `row`'s layout holds, as compiled (`MEMORY_KEY`): a pipeline's G
  stages of one replica with its B / R sequences in the same M micro-batches (the replicas do
  not change what a chip holds; with --fsdp the same compile, its state then extrapolated);
  FSDP at D = 8 with the same B / N sequences a chip."""
  chips, batch = int(row['chips']), int(row['batch'])
  key = dict(model=row['model'], line=row['line'], policy=row['policy'])
  if row['line'] == 'fsdp':
    return dict(key, G=FSDP_COMPILED, batch=FSDP_COMPILED * batch // chips, M=1)
  return dict(key, G=int(row['G']), batch=batch // int(row['R']), M=int(row['M']))


def memory_key(shape: dict) -> tuple:
  return tuple(str(shape[k]) for k in MEMORY_KEY)


def compile_memory(shape: dict) -> dict:
  """`plan`'s compile of one per-chip shape (`per_chip`) for its G chips' compile-only topology:
  the per-chip peak, state and verdict of `compile.compile_step` (the row a cache keeps)."""
  flags, hardware, _ = MODELS[shape['model']]
  line, G = shape['line'], int(shape['G'])
  on = dict(num_stages=G, data_parallel=1, microbatches=int(shape['M']))
  if line == 'fsdp':
    setting = ScheduleConfig(name='data_parallel', data_parallel=G, fsdp=True)
  elif line.startswith('ouroboros'):
    setting = ScheduleConfig(name='ouroboros', forward=line.split()[1], **on)
  else:
    setting = ScheduleConfig(name=line, **on)
  setting = dataclasses.replace(setting, stash_policy=shape['policy'])
  on = {**flags, 'batch_size': int(shape['batch']), **field_flags.train_flags(setting)}
  cfg = field_flags.override(presets.get_preset('gpt2-small'), on)
  topology = TOPOLOGIES[hardware.name][G]
  reason = plan.applies(cfg)
  report = plan._compiled(cfg, topology) if reason is None else {'error': reason, 'fits': False}
  if report.get('compiler_oom'):
    report['error'] = report['compiler_oom']
  return {**shape, **report, 'topology': topology}


def extrapolated_peak(peak: float, state: float, chips: int, compiled: int = FSDP_COMPILED):
  """FSDP's per-chip peak on `chips` chips from its compile on `compiled` with the same
  sequences a chip: a chip's shard of the parameters and optimizer state (`state`, the
  compiled chip's params_bytes + opt_state_bytes, 1 / compiled of the model's) shrinks to
  1 / chips of the model's, its activations stay. A pipeline's stage sharded over its R replicas:
  compiled = 1, chips = R."""
  return peak - state * (1 - compiled / chips)


def verdict(row: dict, memory: dict) -> dict | None:
  """{'peak_gib', 'fits', 'memory'} of `row` from the compiled shapes (None: not compiled)."""
  got = memory.get(memory_key(per_chip(row)))
  if got is None:
    return None
  hbm = float(got['hbm_bytes']) if got.get('hbm_bytes') not in (None, '') else None
  if got.get('peak_bytes') in (None, '') or hbm is None:
    return dict(peak_gib=None, fits=False, memory=f'error: {str(got.get("error"))[:80]}')
  peak, chips = float(got['peak_bytes']), int(row['chips'])
  how = 'compiled' if int(per_chip(row)['G']) == chips else 'compiled at the per-chip shape'
  state = float(got['params_bytes'] or 0) + float(got['opt_state_bytes'] or 0)
  if row['line'] == 'fsdp' and chips != FSDP_COMPILED:
    peak, how = extrapolated_peak(peak, state, chips), f'extrapolated from D = {FSDP_COMPILED}'
  elif sharded_over_replicas(row):  # --shard-update: the optimizer state alone
    state -= float(got['params_bytes'] or 0) if sharded_over_replicas(row) == 'update' else 0.0
    peak, how = extrapolated_peak(peak, state, int(row['R']), 1), 'extrapolated from R = 1'
  oom = bool(got.get('error')) and not how.startswith('extrapolated')
  return dict(peak_gib=round(peak / compile_lib.GIB, 3), fits=peak <= hbm and not oom, memory=how)


def judge(rows: list[dict], memory: dict, compile_fn=None, tries: int = 8) -> None:
  """Marks each cell's rows with their `verdict`: each line's rows fastest first until one fits
  (at most `tries`), compiling with `compile_fn` the shapes `memory` lacks (None: none). Breadth
  first: every line's fastest row, then the next of those that do not fit, ... (a stopped run
  has judged the winners first)."""
  queues = {}  # (cell, line group): its timed rows, fastest first
  for r in rows:
    r.update(peak_gib=None, fits=None, memory='')
  for r in rows:
    for lines in LINES:
      if r['line'] in lines and r['step_s'] not in (None, ''):
        cell = (r['model'], int(r['chips']), int(r['batch']), lines)
        queues.setdefault(cell, []).append(r)
  queues = {k: sorted(q, key=lambda r: float(r['step_s']))[:tries] for k, q in queues.items()}
  for depth in range(tries):
    for queue in queues.values():
      if depth >= len(queue) or any(fits_of(r) is not False for r in queue[:depth]):
        continue  # a faster row fits, or was not judged
      r = queue[depth]
      key = memory_key(per_chip(r))
      if key not in memory and compile_fn is not None:
        memory[key] = compile_fn(per_chip(r))
      got = verdict(r, memory)
      if got is not None:
        r.update(got)


def read_memory(path: str) -> dict:
  try:
    with open(path) as f:
      return {memory_key(r): r for r in csv.DictReader(f)}
  except FileNotFoundError:
    return {}


def write_memory(path: str, memory: dict) -> None:
  with open(path, 'w', newline='') as f:
    writer = csv.DictWriter(f, MEMORY_COLUMNS, extrasaction='ignore')
    writer.writeheader()
    for r in memory.values():
      writer.writerow({k: ('' if r.get(k) is None else r[k]) for k in MEMORY_COLUMNS})


def render(rows: list[dict]) -> str:
  """Per model: a row per (N, B), the fastest FSDP, Ouroboros and exact pipeline that fit, and
  who wins, before and after memory is judged."""
  out = []
  cells = {}
  for r in rows:
    cells.setdefault((r['model'], int(r['chips']), int(r['batch'])), []).append(r)
  for model in dict.fromkeys(r['model'] for r in rows):
    first = next(r for r in rows if r['model'] == model)
    out += [
      f'\n**{model}** ({first["hardware"]}, keeping `{first["policy"]}`; step ms and per-chip '
      "peak GiB of the fastest setting of each line that fits, Ouroboros' with its oldest "
      "gradient's age in updates; fsdp: its stages' state sharded over its R replicas; zero1: "
      'its optimizer state and update alone (--shard-update); a faster setting of the line that '
      'does not fit after it; "~": extrapolated, FSDP from D = 8 and a pipeline with fsdp or '
      'zero1 from its compile without, the other peaks compiled at the per-chip '
      'shape; no GiB: not compiled; "-": the line cannot take the batch):\n',
      '| chips | slices | batch | FSDP | Ouroboros | best exact pipeline | fastest | fastest '
      'that fits | Ouroboros vs the best other that fits |',
      '|---|---|---|---|---|---|---|---|---|',
    ]
    for (m, chips, batch), cell in sorted(cells.items()):
      if m == model:
        out.append(_cell_line(chips, batch, cell))
  return '\n'.join(out).strip()


def fits_of(row: dict) -> bool | None:
  """The row's memory verdict, from a judged row or a saved CSV (None: not judged)."""
  return {True: True, False: False, 'True': True, 'False': False}.get(row.get('fits'))


def fastest_that_fits(cell: list[dict], lines) -> tuple[dict | None, dict | None]:
  """(the fastest row of `lines` known to fit, None if none is; the fastest row of `lines` not
  judged before it, None if every faster row was judged)."""
  timed = [r for r in cell if r['line'] in lines and r['step_s'] not in (None, '')]
  for r in sorted(timed, key=lambda r: float(r['step_s'])):
    if fits_of(r) is None:
      return None, r
    if fits_of(r):
      return r, None
  return None, None


def _cell_line(chips: int, batch: int, cell: list[dict]) -> str:
  fastest = [best(cell, lines) for lines in LINES]  # fsdp, ouroboros, exact
  fitting = [fastest_that_fits(cell, lines) for lines in LINES]
  shown = [_show(f, fit) for f, (fit, _) in zip(fastest, fitting)]
  step = lambda r: float(r['step_s'])
  every = [r for r in fastest if r is not None]
  winner = min(every, key=step) if every else None
  known = [fit for fit, _ in fitting if fit is not None]
  fit_winner = min(known, key=step) if known else None
  # Certain when no row left unjudged could be faster than the fastest known to fit.
  sure = all(u is None or (fit_winner and step(u) > step(fit_winner)) for _, u in fitting)
  judged = any(fits_of(r) is not None for r in cell)  # else: time alone, the fastest rows
  pick = [fit for fit, _ in fitting] if judged else fastest
  ring, others = pick[1], [r for r in (pick[0], pick[2]) if r is not None]
  ratio = '-'
  if judged and any(u is not None for _, u in fitting):
    ratio = '?'  # a line's fastest that fits is not known yet
  elif ring is not None and others:
    ratio = f'{min(step(r) for r in others) / step(ring):.2f}x'
    ratio += '' if judged else ' (time alone)'
  name = lambda r: '-' if r is None else r['line'].split()[0]
  fit_name = name(fit_winner) if sure else '?'
  head = f'| {chips} | {cell[0]["slices"]} | {batch} | '
  return head + ' | '.join([*shown, name(winner), fit_name, ratio]) + ' |'


def _show(fastest: dict | None, fit: dict | None) -> str:
  """A line's cell: its fastest setting that fits, and after it a faster one that does not."""
  if fastest is None:
    return '-'
  one = lambda r: f'{float(r["step_s"]) * 1e3:.1f} ({_short(r)}{_gib(r)})'
  if fit is fastest or fits_of(fastest) is None:
    return one(fastest)
  too_big = f'{one(fastest)} does not fit'
  return too_big if fit is None else f'{one(fit)}; {too_big}'


def _gib(row: dict) -> str:
  if row.get('peak_gib') in (None, ''):
    return ''
  mark = '~' if str(row.get('memory', '')).startswith('extrapolated') else ''
  return f'; {mark}{float(row["peak_gib"]):.1f} GiB'


def _short(row: dict) -> str:
  """The setting in a few words; Ouroboros' with the age of its oldest gradient in updates."""
  if row['line'] == 'fsdp':
    return f'D={row["chips"]}'
  head = row['line'].replace('ouroboros ', '')
  sharded = {'fsdp': ' fsdp', 'update': ' zero1', None: ''}[sharded_over_replicas(row)]
  words = f'{head} G={row["G"]} M={row["M"]}{sharded}'
  if not row['line'].startswith('ouroboros'):
    return words
  age, _ = delays.version_gaps(int(row['G']), head, int(row['M']), 'stream')
  return f'{words}, {age} old'


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
  p.add_argument(
    '--memory',
    action='store_true',
    help=f'judge the memory of the saved --out map, compiling the shapes {MEMORY_CSV} lacks',
  )
  p.add_argument('--memory-csv', default=MEMORY_CSV, help='the cache of compiled shapes')
  p.add_argument(
    '--shardings',
    default=','.join(settings_lib.SHARDINGS),
    help='predict only the layouts keeping their state so (of replicated, update, fsdp), and '
    "keep the saved --out map's other rows (the simulator unchanged for them)",
  )
  args = p.parse_args(argv)
  if args.render:
    with open(args.render) as f:
      print(render(list(csv.DictReader(f))))
    return 0
  memory = read_memory(args.memory_csv)
  models = tuple(args.models.split(','))
  if args.memory:
    with open(args.out) as f:
      rows = list(csv.DictReader(f))
    judge([r for r in rows if r['model'] in models], memory, _compiler(args.memory_csv, memory))
    judge(rows, memory)  # every model's, from the cache
  else:
    shardings = tuple(args.shardings.split(','))
    rows = main_rows(args.policy, models, shardings)
    if set(shardings) != set(settings_lib.SHARDINGS):
      rows = _merged(args.out, rows, models, shardings)
    judge(rows, memory)
  write_csv(args.out, rows)
  print(render(rows))
  return 0


def _merged(path: str, rows: list[dict], models, shardings) -> list[dict]:
  """`rows` (the layouts of `shardings` on `models`) with the saved map's other rows, in the
  map's order: cell by cell."""
  with open(path) as f:
    kept = [
      r for r in csv.DictReader(f) if r['model'] not in models or sharding_of(r) not in shardings
    ]
  order = lambda r: (list(MODELS).index(r['model']), int(r['chips']), int(r['batch']))
  return sorted(kept + rows, key=order)


def _compiler(path: str, memory: dict):
  """compile_memory, the cache saved after each compile (a stopped run keeps what it did)."""

  def compile_fn(shape: dict) -> dict:
    got = compile_memory(shape)
    memory[memory_key(shape)] = got
    write_memory(path, memory)
    peak = '-' if got.get('peak_bytes') is None else f'{got["peak_bytes"] / compile_lib.GIB:.2f}'
    seconds = f'{got.get("compile_s") or 0:.0f}'
    print(
      f'compiled {memory_key(shape)}: {peak} GiB fits={got.get("fits")} {seconds} s', flush=True
    )
    return got

  return compile_fn


if __name__ == '__main__':
  sys.exit(main())
