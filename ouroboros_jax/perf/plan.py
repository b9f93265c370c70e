"""`ouroboros plan`: every way to train one model on one topology, with the compiler's memory and
the simulator's step time, and the fastest way that fits.

For a run (`train`'s flags: model, batch, dtype, optimizer) and a topology (a TPU topology through
libtpu, compile-only, or the local devices), it builds every setting

  backprop (1 device), data_parallel (all devices), model_parallel,
  gpipe and the exact pipelines at each of --try-microbatches,
  ouroboros locked and pipelined, at each of --try-microbatches, --try-stash and
  --try-stash-memory (device by default; pinned_host: the stash in host memory)

with G = the topology's device count (or each of --try-stages, the other devices then data
replicas), compiles each setting's training step for the topology's devices
(`compile.compile_step`: the per-device peak from the compiler's memory analysis, or from its
out-of-memory verdict) and predicts its step time with the discrete-event simulator
(`simulate.py`, the model's FLOPs at `hardware`'s effective rate and link bandwidth; a graph
stash that keeps nothing ('graph/nothing') re-runs the forward in its backward, so it is timed
as replay). The fastest setting that fits is marked.

    ouroboros plan --preset gpt2-small --batch-size 32 --dtype bfloat16 --topology v5e:2x2
    ouroboros plan ... --json        # one JSON object: the rows and the fastest that fits
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Callable

from ouroboros_jax.choices import DEFAULT_STASH_POLICY, EXACT_PIPELINES, SCHEDULES, STASH_MEMORIES
from ouroboros_jax.errors import ConfigError
from ouroboros_jax.perf import compile as compile_lib
from ouroboros_jax.perf import simulate
from ouroboros_jax.schedules import ScheduleConfig
from ouroboros_jax.training import config
from ouroboros_jax.training.config import TrainConfig

STASH_SETTINGS = ('graph/nothing', 'graph/dots', 'graph/all', 'replay')
DEFAULT_STASH = ('graph/nothing', 'replay', 'graph/all')
DEFAULT_MICROBATCHES = (8,)

# Effective rates (40% of the bf16 peak, as simulate.NVLINK) and one ICI link per direction.
TPU_V5E = simulate.Hardware('tpu-v5e', flops_per_s=0.4 * 197e12, bandwidth=50e9, latency=5e-6)
TPU_V4 = simulate.Hardware('tpu-v4', flops_per_s=0.4 * 275e12, bandwidth=50e9, latency=5e-6)
TPU_V5P = simulate.Hardware('tpu-v5p', flops_per_s=0.4 * 459e12, bandwidth=100e9, latency=5e-6)
TPU_V6E = simulate.Hardware('tpu-v6e', flops_per_s=0.4 * 918e12, bandwidth=100e9, latency=5e-6)
HARDWARE = {h.name: h for h in (TPU_V5E, TPU_V4, TPU_V5P, TPU_V6E, *simulate.HARDWARE.values())}


def _stash_fields(stash: str) -> dict[str, str]:
  """A --try-stash setting ('graph/POLICY' or 'replay') as ScheduleConfig's stash fields."""
  mode, _, policy = stash.partition('/')
  return dict(stash=mode, stash_policy=policy or DEFAULT_STASH_POLICY)


@dataclasses.dataclass(frozen=True)
class Tries:
  """The settings to try (the --try-* flags): each count of `microbatches`, each of `stashes`
  (STASH_SETTINGS), the `schedules` (None: all), each of `memories` (where Ouroboros' stash
  waits) and each G of `stages` (None: G = every device)."""

  microbatches: tuple[int, ...] = DEFAULT_MICROBATCHES
  stashes: tuple[str, ...] = DEFAULT_STASH
  schedules: tuple[str, ...] | None = None
  memories: tuple[str, ...] = ('device',)
  stages: tuple[int, ...] | None = None


def settings(
  num_devices: int, tries: Tries = Tries(), base: ScheduleConfig = ScheduleConfig()
) -> list[ScheduleConfig]:
  """Every setting of `tries` on `num_devices` devices, each the ScheduleConfig `base` (`plan`'s:
  the run's own) with what the tries choose: the stage schedules at each G of tries.stages with
  num_devices / G data replicas, gpipe and the exact pipelines at each M, Ouroboros' at each M,
  forward, stash (and its policy) and each of tries.memories."""
  microbatches, stashes, memories = tries.microbatches, tries.stashes, tries.memories
  schedules, stages = tries.schedules, tries.stages or (num_devices,)
  for g in stages:
    if g < 1 or num_devices % g:
      raise ConfigError(
        f'--try-stages {g} does not divide the {num_devices} devices into data replicas; '
        f'choose divisors of {num_devices}.'
      )
  for memory in memories:
    if memory not in STASH_MEMORIES:
      raise ConfigError(
        f'unknown stash memory {memory!r}; choose --try-stash-memory from '
        f'{", ".join(STASH_MEMORIES)}.'
      )
  unknown = sorted(set(schedules or ()) - set(SCHEDULES))
  if unknown:
    raise ConfigError(
      f'unknown schedule {unknown[0]!r}; choose --try-schedules from {", ".join(SCHEDULES)}.'
    )
  for stash in stashes:
    if stash not in STASH_SETTINGS:
      raise ConfigError(
        f'unknown stash setting {stash!r}; choose --try-stash from {", ".join(STASH_SETTINGS)}.'
      )

  def setting(name, stages=1, data_parallel=1, microbatches=None, **ring) -> ScheduleConfig:
    return dataclasses.replace(
      base,
      name=name,
      num_stages=stages,
      data_parallel=data_parallel,
      microbatches=microbatches,
      **ring,
    )

  out = [setting('backprop')]
  if num_devices > 1:
    out.append(setting('data_parallel', data_parallel=num_devices))
  for g in (g for g in stages if g > 1):
    on = dict(stages=g, data_parallel=num_devices // g)
    out.append(setting('model_parallel', **on))
    for name in ('gpipe', *EXACT_PIPELINES):
      out += [setting(name, **on, microbatches=m) for m in microbatches]
    for forward in ('locked', 'pipelined'):
      for stash in stashes:
        for memory in memories:
          out += [
            setting(
              'ouroboros',
              **on,
              microbatches=m,
              forward=forward,
              stash_memory=memory,
              **_stash_fields(stash),
            )
            for m in microbatches
          ]
  return [s for s in out if schedules is None or s.name in schedules]


def hardware_for(topology: str | None, name: str | None = None) -> simulate.Hardware:
  """The simulator's rates: `name` if given, else the TPU generation the topology names, else
  simulate.NVLINK (a GPU-class device)."""
  if name is not None:
    if name not in HARDWARE:
      raise ConfigError(f'unknown hardware {name!r}; choose --hardware from {", ".join(HARDWARE)}.')
    return HARDWARE[name]
  generation = (topology or '').split(':')[0].split('-')[0].lower()
  return HARDWARE.get(f'tpu-{generation}', simulate.NVLINK)


def predicted_step_s(
  cfg: TrainConfig, setting: ScheduleConfig, hardware: simulate.Hardware
) -> float:
  """The simulator's steady-state step time of `setting` for cfg's model and batch. On a stage x
  data mesh, one replica's step on its share of the batch (the gradient all-reduce between the
  replicas is not modelled)."""
  model = cfg.model
  data = setting.name == 'data_parallel'
  replicas = 1 if data else setting.data_parallel
  stages = setting.num_stages
  shape = simulate.ModelShape(
    cfg.preset,
    num_layers=model.num_layers,
    d_model=model.d_model,
    d_ff=model.d_ff,
    seq_len=model.seq_len,
    vocab=model.vocab_size,
    batch=cfg.batch_size // replicas,
  )
  costs = simulate.transformer_costs(
    shape, hardware, stages, bytes_per_value=2 if model.dtype == 'bfloat16' else 4
  )
  # A graph stash that keeps nothing re-runs the group's forward in its backward, as replay does.
  recomputes = setting.stash == 'replay' or setting.stash_policy == 'nothing'
  run = dataclasses.replace(
    setting,
    data_parallel=setting.data_parallel if data else 1,
    stash='replay' if setting.name == 'ouroboros' and recomputes else setting.stash,
  )
  return simulate.simulate(run, costs).step_time


def plan(
  cfg: TrainConfig,
  topology: str | None,
  tries: Tries = Tries(),
  *,
  hardware: str | None = None,
  log: Callable[[str], None] | None = None,
) -> dict:
  """{'rows': one dict per setting of `tries` (compile_step's report, the label and the
  predicted step time), 'fastest': the label of the fastest setting that fits (None if none
  does)}."""
  import jax

  devices = compile_lib.topology_devices(topology) if topology else jax.devices()
  rates = hardware_for(topology, hardware)
  rows = []
  for setting in settings(len(devices), tries, cfg.schedule):
    flags = config.train_flags(setting)
    run = config.override(cfg, flags)
    try:
      report = compile_lib.compile_step(run, topology)
    except ConfigError as e:  # a setting this model cannot take (e.g. more stages than layers)
      report = {'error': str(e), 'fits': False, 'peak_bytes': None}
    except Exception as e:  # pylint: disable=broad-exception-caught
      # A compiler that fails on one setting says nothing about the others: report it, go on.
      reason = ' '.join(str(e).split())[:300]
      report = {'error': f'the compiler failed: {reason}', 'fits': False, 'peak_bytes': None}
    row = {'label': setting.label, **flags, **report}
    row['step_s'] = predicted_step_s(cfg, setting, rates) if 'error' not in row else None
    rows.append(row)
    if log:
      log(f'{setting.label:<44} {_peak(row):>9} GiB  {_verdict(row)}')
  fitting = [r for r in rows if r['fits'] is not False and r['step_s'] is not None]
  fastest = min(fitting, key=lambda r: r['step_s'])['label'] if fitting else None
  return {
    'topology': topology,
    'devices': len(devices),
    'hardware': dataclasses.asdict(rates),
    'rows': rows,
    'fastest': fastest,
  }


def format_plan(result: dict) -> str:
  """The plan as a table: one row per setting, the fastest that fits marked with *."""
  hbm = next((r.get('hbm_bytes') for r in result['rows'] if r.get('hbm_bytes')), None)
  where = result['topology'] or 'the local devices'
  width = max([40, *(len(r['label']) for r in result['rows'])])
  lines = [
    f'{len(result["rows"])} settings on {where} ({result["devices"]} devices, '
    f'{compile_lib.format_size(hbm)} each); step time from the simulator at '
    f'{result["hardware"]["name"]} rates.',
    f'  {"setting":<{width}} {"peak GiB":>9} {"fits":>5} {"step ms":>8} {"speedup":>8}',
  ]
  backprop = next((r['step_s'] for r in result['rows'] if r['schedule'] == 'backprop'), None)
  for r in result['rows']:
    mark = '*' if r['label'] == result['fastest'] else ' '
    step = '-' if r['step_s'] is None else f'{r["step_s"] * 1e3:.3g}'
    speedup = '-' if not (r['step_s'] and backprop) else f'{backprop / r["step_s"]:.2f}x'
    lines.append(
      f'{mark} {r["label"]:<{width}} {_peak(r):>9} {_verdict(r):>5} {step:>8} {speedup:>8}'
    )
  lines += [f'  {r["label"]}: {r["error"]}' for r in result['rows'] if 'error' in r]
  if result['fastest']:
    lines.append(f'* fastest that fits: {result["fastest"]}')
  else:
    lines.append('no setting fits; use more devices, a smaller batch or --dtype bfloat16.')
  return '\n'.join(lines)


def load(path: str) -> dict:
  """A plan saved with --json (one-line ConfigError if it is not one)."""
  import json

  try:
    with open(path) as f:
      result = json.load(f)
    result['rows'], result['fastest']  # noqa: B018
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise ConfigError(f'--render {path}: not a saved plan ({e}); save one with --json.') from e
  return result


def _peak(row: dict) -> str:
  return '-' if row.get('peak_bytes') is None else f'{row["peak_bytes"] / compile_lib.GIB:.2f}'


def _verdict(row: dict) -> str:
  if 'error' in row:
    return 'error'
  return {True: 'yes', False: 'no', None: '?'}[row['fits']]


def main_log(line: str) -> None:
  print(line, file=sys.stderr, flush=True)
