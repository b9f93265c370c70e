"""`ouroboros plan`: every way to train one model on one topology, with the compiler's memory and
the simulator's step time, and the fastest way that fits.

For a run (`train`'s flags: model, batch, dtype, optimizer) and a topology (a TPU topology through
libtpu, compile-only, or the local devices), it builds every setting

  backprop (1 device), data_parallel (all devices), model_parallel,
  gpipe and the exact pipelines at each of --try-microbatches,
  ouroboros locked and pipelined (--try-forward), at each of --try-microbatches, --try-stash
  and --try-stash-memory (device by default; pinned_host: the stash in host memory; balanced:
  a deep group's older slots lent to a shallow one)

with G = the topology's device count, or, for a model with fewer layers than devices, the most
stages that divide the devices and that its layers fill (`default_stages`), the other devices
then data replicas (or each G of --try-stages). Settings the run cannot take (more stage groups
than layers, micro-batches that do not divide the batch, ...) are skipped before compiling and
listed with their reason, one line per reason (`applies`). It compiles each setting's training step
for the topology's devices (`compile.compile_step`: the per-device peak from the compiler's memory
analysis, or from its out-of-memory verdict) and predicts its step time with the discrete-event
simulator (`simulate.py`, the model's FLOPs at `hardware`'s effective rate and link bandwidth; a
graph stash that keeps nothing ('graph/nothing') re-runs the forward in its backward, so it is timed
as replay). The fastest setting that fits is marked.

    ouroboros plan --preset gpt2-small --batch-size 32 --dtype bfloat16 --topology v5e:2x2
    ouroboros plan ... --json        # one JSON object: the rows and the fastest that fits
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Callable

from ouroboros_jax import errors
from ouroboros_jax.errors import ConfigError
from ouroboros_jax.perf import compile as compile_lib
from ouroboros_jax.perf import cost_model, simulate
from ouroboros_jax.perf.settings import Tries, settings
from ouroboros_jax.schedules import ScheduleConfig
from ouroboros_jax.schedules.config import AUTO, ResolvedSchedule
from ouroboros_jax.training import field_flags
from ouroboros_jax.training.config import TrainConfig

# Effective rates (40% of the bf16 peak, as cost_model.NVLINK) and one ICI link per direction.
# A collective (FSDP's gathers, the all-reduce) runs on a bidirectional ring: two links a chip,
# which every slice of the shapes compiled here has (a full torus would drive 4 on v5e, 6 on
# v5p). Between slices, the data-centre network's rate a chip: v5e's host has 2 x 100 Gbps NICs
# for its 8 chips, 3.125 GB/s a chip; v5p's is 50 Gbps a chip, 6.25 GB/s. Sources: Cloud TPU's
# v5e and v5p system architecture pages (cloud.google.com/tpu/docs/v5e, /v5p): ICI 400 and
# 1200 GB/s a chip both ways over 4 and 6 ports, i.e. 50 and 100 GB/s a link per direction.
# A chip's HBM (the optimizer's elementwise pass), from the same pages and v4's and v6e's: 819,
# 1200, 2765 and 1640 GB/s on v5e, v4, v5p and v6e.
TPU_V5E = cost_model.Hardware(
  'tpu-v5e',
  flops_per_s=0.4 * 197e12,
  bandwidth=50e9,
  latency=5e-6,
  collective_bandwidth=2 * 50e9,
  dcn_bandwidth=2 * 100e9 / 8 / 8,
  memory_bandwidth=819e9,
)
TPU_V4 = cost_model.Hardware(
  'tpu-v4', flops_per_s=0.4 * 275e12, bandwidth=50e9, latency=5e-6, memory_bandwidth=1200e9
)
TPU_V5P = cost_model.Hardware(
  'tpu-v5p',
  flops_per_s=0.4 * 459e12,
  bandwidth=100e9,
  latency=5e-6,
  collective_bandwidth=2 * 100e9,
  dcn_bandwidth=50e9 / 8,
  memory_bandwidth=2765e9,
)
TPU_V6E = cost_model.Hardware(
  'tpu-v6e', flops_per_s=0.4 * 918e12, bandwidth=100e9, latency=5e-6, memory_bandwidth=1640e9
)
HARDWARE = {h.name: h for h in (TPU_V5E, TPU_V4, TPU_V5P, TPU_V6E, *cost_model.HARDWARE.values())}


def hardware_for(topology: str | None, name: str | None = None) -> cost_model.Hardware:
  """The simulator's rates: `name` if given, else the TPU generation the topology names, else
  cost_model.NVLINK (a GPU-class device)."""
  if name is not None:
    if name not in HARDWARE:
      raise ConfigError(f'unknown hardware {name!r}; choose --hardware from {", ".join(HARDWARE)}.')
    return HARDWARE[name]
  generation = (topology or '').split(':')[0].split('-')[0].lower()
  return HARDWARE.get(f'tpu-{generation}', cost_model.NVLINK)


def predicted_step_s(
  cfg: TrainConfig,
  setting: ResolvedSchedule,
  hardware: cost_model.Hardware,
  *,
  slices: int = 1,
  stash_item_bytes: float | None = None,
) -> float:
  """The simulator's steady-state step time of the resolved `setting` (as cfg's run resolves it
  on the target: `TrainConfig.schedule_config`) for cfg's model and batch. On a stage x
  data mesh, one replica's step on its share of the batch, each stage's gradient then
  all-reduced over the replicas. On `slices` slices joined by the data-centre network
  (`hardware.dcn_bandwidth`), the replicas spread evenly over them: a collective's chips in one
  slice are its replicas / slices (a stage schedule's stages stay inside a slice).
  `stash_item_bytes` (the compiled report's): what a balanced stash sends to a mirror and back,
  an item each way a round."""
  model = cfg.model
  # one replica's rows (data_parallel's costs are the whole batch's: it splits them itself)
  split = 1 if setting.name == 'data_parallel' else setting.data_parallel
  gathers_layers = setting.fsdp and setting.name == 'data_parallel'  # FSDP gathers each layer;
  stages = model.num_layers if gathers_layers else setting.num_stages  # a stage's, per step
  shape = cost_model.ModelShape(
    cfg.preset,
    num_layers=model.num_layers,
    d_model=model.d_model,
    d_ff=model.d_ff,
    seq_len=model.seq_len,
    vocab=model.padded_vocab,  # the rows the head computes
    batch=cfg.batch_size // split,
  )
  costs = cost_model.transformer_costs(
    shape,
    hardware,
    stages,
    bytes_per_value=model.compute_dtype.itemsize,
    param_bytes_per_value=model.weight_dtype.itemsize,
    optimizer=cfg.resolved_optimizer(),
  )
  # What the backward re-runs of the forward: the policy's share (the replay stash: all of it,
  # which the simulator adds itself).
  fraction = recompute_fraction(setting, model)
  replicas = setting.data_parallel
  if replicas % slices:
    raise ConfigError(
      f'{setting.label}: {replicas} data replicas do not spread over {slices} slices; the '
      'stages would cross the data-centre network, which the simulator does not model.'
    )
  costs = dataclasses.replace(
    costs,
    recompute=0.0 if setting.replays else fraction,
    slice_chips=replicas // slices if slices > 1 else 0,
    stash_item_bytes=stash_item_bytes or 0.0,
  )
  return simulate.simulate(setting, costs).step_time


def recompute_fraction(setting: ScheduleConfig, model) -> float:
  """The share of a layer group's forward that the setting's backward re-runs (1: all of it, the
  replay stash or --stash-policy nothing; 0: none), as the simulator charges it."""
  if setting.replays:
    return 1.0
  return cost_model.recompute_fraction(setting.resolved_stash_policy, model.seq_len, model.d_model)


def plan(
  cfg: TrainConfig,
  topology: str | None,
  tries: Tries = Tries(),
  *,
  hardware: str | None = None,
  log: Callable[[str], None] | None = None,
) -> dict:
  """{'rows': one dict per setting of `tries` the run can take (compile_step's report, the
  label and the predicted step time), 'skipped': the others, each {'label', 'reason'}, 'stages':
  the G tried, 'fastest': the label of the fastest setting that fits (None if none does)}."""
  import jax

  devices = compile_lib.topology_devices(topology) if topology else jax.devices()
  rates = hardware_for(topology, hardware)
  rows, skipped = [], []
  tried = settings(len(devices), tries, cfg.schedule, cfg.model.num_layers)
  for setting in tried:
    flags = field_flags.train_flags(setting)
    run = _run_on(cfg, flags)
    reason = applies(run)
    if reason is not None:
      skipped.append({'label': setting.label, 'reason': reason})
      continue
    row = {'label': setting.label, **flags, **_compiled(run, topology)}
    resolved = run.schedule_config(devices[0].platform) if 'error' not in row else None
    row['recompute'] = recompute_fraction(resolved or setting, cfg.model)
    item = row.get('stash_item_bytes')
    row['step_s'] = (
      predicted_step_s(cfg, resolved, rates, stash_item_bytes=item) if resolved else None
    )
    rows.append(row)
    if log:
      log(f'{setting.label:<44} {_peak(row):>9} GiB  {_verdict(row)}')
  fastest, by_schedule = mark_fastest(rows)
  return {
    'topology': topology,
    'devices': len(devices),
    'hardware': dataclasses.asdict(rates),
    'stages': sorted({s.num_stages for s in tried if s.num_stages > 1}),
    'rows': rows,
    'skipped': skipped,
    'fastest': fastest,
    'fastest_by_schedule': by_schedule,
  }


def _run_on(cfg: TrainConfig, flags: dict) -> TrainConfig:
  """`cfg` on the setting `flags` give (`field_flags.train_flags`'s); an exact schedule with no
  compensation (none there, the same optimizer)."""
  run = field_flags.override(cfg, flags)
  if run.schedule.name != 'ouroboros' and run.compensation not in (AUTO, 'none'):
    run = field_flags.override(run, {'compensation': AUTO})
  return run


def repredict(result: dict, cfg: TrainConfig) -> dict:
  """A saved plan of `cfg` with every row's step time predicted again by this simulator, at the
  rates it was made with, its compiled memory as it was, and its fastest marks derived again: a
  change to the simulator moves a saved plan without a compile."""
  rates = saved_rates(result['hardware'])
  keys = field_flags.train_flags(ScheduleConfig())
  for row in result['rows']:
    if row.get('step_s') is None:  # not predicted: an error, a setting it could not resolve
      continue
    flags = {k: row[k] for k in keys if row.get(k) is not None}  # None: the report's, unset
    flags['stash'] = 'replay' if row['stash'] == 'replay' else 'graph'  # the row's is the label
    run = _run_on(cfg, flags)
    resolved = run.schedule_config(row['platform'])
    item = row.get('stash_item_bytes')
    row['step_s'] = predicted_step_s(cfg, resolved, rates, stash_item_bytes=item)
  result['fastest'], result['fastest_by_schedule'] = mark_fastest(result['rows'])
  return result


def saved_rates(saved: dict) -> cost_model.Hardware:
  """The rates a plan was saved with; a rate added since (a field it lacks) from today's preset
  of the same name (`HARDWARE`), else the field's default."""
  preset = HARDWARE.get(saved.get('name'))
  return dataclasses.replace(preset, **saved) if preset else cost_model.Hardware(**saved)


def _compiled(run: TrainConfig, topology: str | None) -> dict:
  """compile_step's report of one setting's run, or its error as a row that does not fit."""
  try:
    return compile_lib.compile_step(run, topology)
  except (ConfigError, errors.CompilerError) as e:  # a setting this model cannot take, or XLA
    return {'error': str(e), 'fits': False, 'peak_bytes': None}
  except Exception as e:  # pylint: disable=broad-exception-caught
    # A compiler that fails on one setting says nothing about the others: report it, go on.
    reason = ' '.join(str(e).split())[:300]
    return {'error': f'the compiler failed: {reason}', 'fits': False, 'peak_bytes': None}


def mark_fastest(rows: list[dict]) -> tuple[str | None, dict[str, str]]:
  """The label of the fastest row that fits (None if none does) and each schedule's fastest that
  fits, {schedule: label}, fastest first: a plan's 'fastest' and 'fastest_by_schedule'."""
  fitting = [r for r in rows if r['fits'] is not False and r['step_s'] is not None]
  fastest = min(fitting, key=lambda r: r['step_s'])['label'] if fitting else None
  by_schedule = {}  # each schedule's fastest setting that fits, in the order met
  for r in sorted(fitting, key=lambda r: r['step_s']):
    by_schedule.setdefault(r['schedule'], r['label'])
  return fastest, by_schedule


def applies(run: TrainConfig) -> str | None:
  """None if `plan` can compile the setting `run`, else why not, in a few words (its layers cut
  into more groups than the model has, or any other setting the run cannot take)."""
  groups, layers = run.schedule.stage_groups, run.model.num_layers
  if groups > layers:
    chunks = groups // run.schedule.num_stages
    cut = f'{run.schedule.num_stages} stages' + (f' x {chunks} chunks' if chunks > 1 else '')
    return f"{cut} = {groups} groups, more than the model's {layers} layers"
  try:
    run.validate()
  except ConfigError as e:
    return errors.render(e.marked, field_flags.field_flag).rstrip('.')
  return None


def format_plan(result: dict) -> str:
  """The plan as a table: one row per setting, with the share of the forward its backward
  re-runs; the fastest that fits marked with *, each schedule's fastest that fits with +."""
  hbm = next((r.get('hbm_bytes') for r in result['rows'] if r.get('hbm_bytes')), None)
  where = result['topology'] or 'the local devices'
  width = max([40, *(len(r['label']) for r in result['rows'])])
  lines = [
    f'{len(result["rows"])} settings on {where} ({result["devices"]} devices, '
    f'{compile_lib.format_size(hbm)} each); step time from the simulator at '
    f'{result["hardware"]["name"]} rates.',
    *_stages_note(result),
    f'  {"setting":<{width}} {"peak GiB":>9} {"fits":>5} {"recompute":>9} {"step ms":>8} '
    f'{"speedup":>8}',
  ]
  backprop = next((r['step_s'] for r in result['rows'] if r['schedule'] == 'backprop'), None)
  best = set(result.get('fastest_by_schedule', {}).values())  # plans saved before have none
  for r in result['rows']:
    mark = '*' if r['label'] == result['fastest'] else '+' if r['label'] in best else ' '
    step = '-' if r['step_s'] is None else f'{r["step_s"] * 1e3:.3g}'
    speedup = '-' if not (r['step_s'] and backprop) else f'{backprop / r["step_s"]:.2f}x'
    recompute = '-' if r.get('recompute') is None else f'{r["recompute"]:.2f}'
    lines.append(
      f'{mark} {r["label"]:<{width}} {_peak(r):>9} {_verdict(r):>5} {recompute:>9} {step:>8} '
      f'{speedup:>8}'
    )
  lines += [f'  {r["label"]}: {r["error"]}' for r in result['rows'] if 'error' in r]
  reasons = {}  # one line per reason, in the order met
  for s in result.get('skipped', []):  # plans saved before skipping have none
    reasons.setdefault(s['reason'], []).append(s['label'])
  lines += [
    f'  skipped {", ".join(labels)}: {reason}; the run cannot take them.'
    for reason, labels in reasons.items()
  ]
  if result['fastest']:
    lines.append(f"* fastest that fits: {result['fastest']}; + each schedule's fastest that fits")
  else:
    lines.append('no setting fits; use more devices, a smaller batch or --dtype bfloat16.')
  return '\n'.join(lines)


def _stages_note(result: dict) -> list[str]:
  """One line when the stages tried are not every device in one ring."""
  stages, devices = result.get('stages'), result['devices']
  if not stages or stages == [devices]:
    return []
  cut = ', '.join(f'G = {g} stages x {devices // g} data replicas' for g in stages)
  return [f'  stage schedules at {cut} of the {devices} devices (--try-stages to choose).']


def load(path: str) -> dict:
  """A plan saved with --json (one-line ConfigError if it is not one)."""
  import json

  try:
    with open(path) as f:
      result = json.load(f)
    result['rows'], result['fastest']  # noqa: B018
    for i, row in enumerate(result['rows']):
      _check_row(row, i)
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise ConfigError(f'--render {path}: not a saved plan ({e}); save one with --json.') from e
  return result


def _check_row(row, i: int) -> None:
  """TypeError naming what is wrong with row i of a saved plan (a hand edit, another file)."""
  number = lambda v: v is None or (isinstance(v, (int, float)) and not isinstance(v, bool))
  if not isinstance(row, dict):
    raise TypeError(f'row {i} is {type(row).__name__}, not an object')
  if not isinstance(row.get('label'), str):
    raise TypeError(f'row {i} has no label')
  if row.get('fits') not in (True, False, None):
    raise TypeError(f'row {i} ({row["label"]}): fits is {row["fits"]!r}')
  for key in ('peak_bytes', 'step_s', 'recompute'):
    if not number(row.get(key)):
      raise TypeError(f'row {i} ({row["label"]}): {key} is {row[key]!r}')


def _peak(row: dict) -> str:
  return '-' if row.get('peak_bytes') is None else f'{row["peak_bytes"] / compile_lib.GIB:.2f}'


def _verdict(row: dict) -> str:
  if 'error' in row:
    return 'error'
  return {True: 'yes', False: 'no', None: '?'}[row['fits']]


def main_log(line: str) -> None:
  print(line, file=sys.stderr, flush=True)
