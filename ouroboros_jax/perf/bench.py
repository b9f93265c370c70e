"""`ouroboros bench`: steady-state speed of every schedule, next to its ideal.

For each setting `plan` would try at G = --stages (`settings.py`, the --try-* flags: by default
backprop, data_parallel and model_parallel, gpipe and the exact pipelines at M = 8, each keeping
every residual and keeping nothing; ouroboros locked and pipelined at M = 8 with the graph stash
keeping nothing or all and the replay stash; interleaved 1F1B and ZB-V where the model has 2G
layers for their 2G chunks; --only picks some by label) it
compiles the step (timed separately, not counted), runs `warmup` steps, then times `steps` more
one by one and reports the **median** step time and tokens/s. With `rounds` R > 1 (`--rounds`)
every setting is compiled and warmed up first and the timed steps are dealt out in R rounds,
setting after setting, so that a machine whose speed drifts over minutes slows every setting
alike; the simulator's calibration is then measured again at the start of each round and its
medians over the rounds used.

Beside the settings it measures the simulator's calibration (`calibration.py`: the pieces of a
step timed alone, the links, how much slower devices computing at once run, the wait for the
last process at a collective, and each stage setting's program on one device), from which the
discrete-event simulator (`simulate.py`) gives each setting's **ideal** step time (free links, no
overheads, devices that do not slow each other) and its **predicted** one. Outputs, in --out:

  bench.csv       one row per setting (the columns `experiments/simulate.py --measured` reads,
                  fwd_s_per_stage_micro / bwd_s_per_stage_micro, concurrent_slowdown,
                  one_device_s and program_scale included, plus tokens_per_s, compile_s,
                  ideal_s, predicted_s, and host_load:
                  the 1-minute load average after the setting, which above the process count
                  says something else shared the cores and the row is not to be trusted)
  bench.json      the rows and the run's settings
  bench.png       tokens/s of each setting, with its ideal marked
  bench.md        the table printed at the end

Real concurrency needs one process per device: on a CPU machine run it through the launcher,

    ouroboros launch --processes 2 --pin-cpus -- bench --stages 2

and on a GPU/TPU host (or cluster) run it as is (`--coordinator` for several hosts). With
simulated CPU devices (`--cpu-devices`) the numbers are correct but show no speedup: the devices
share the same cores.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
import statistics
from collections.abc import Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils

from ouroboros_jax import costs, placement
from ouroboros_jax.choices import MICROBATCHED
from ouroboros_jax.errors import ConfigError
from ouroboros_jax.models import model as transformer
from ouroboros_jax.models import partition
from ouroboros_jax.perf import calibration, timing
from ouroboros_jax.perf import settings as settings_lib
from ouroboros_jax.perf.settings import Tries
from ouroboros_jax.perf.timing import Workload, micro_size, num_devices
from ouroboros_jax.runtime import host
from ouroboros_jax.schedules import ScheduleConfig
from ouroboros_jax.schedules.compensation import Compensation
from ouroboros_jax.schedules.config import ResolvedSchedule


@dataclasses.dataclass(frozen=True)
class BenchConfig:
  """What `run` benchmarks (the `bench` flags): batches of `batch_size` rows, G = `stages`,
  `steps` timed steps per setting after `warmup` untimed ones, each setting a ResolvedSchedule
  (`bench_settings`: those `tries` gives, as `plan` tries them; a setting's `label` names it).
  `optimizer` and `compensation` (on the Ouroboros settings) time a training recipe's own costs:
  Muon's orthogonalisation, weight prediction's extra pass over the weights; by default the
  paper's method, AdamW without compensation."""

  batch_size: int
  stages: int
  out_dir: str
  steps: int = 20
  warmup: int = 3
  # 1: each setting timed in turn. R > 1: every setting is compiled and warmed up first, then
  # timed in R rounds of steps / R steps each, setting after setting, so that a machine whose
  # speed drifts over minutes slows every setting alike, and the pieces (with the concurrent
  # slowdown and the collective's wait) are re-timed in each round, their medians used, so that
  # the predictions drift too (docs/results/simulator_calibration.md).
  rounds: int = 1
  settings: Sequence[ResolvedSchedule] | None = None  # None: bench_settings of `tries`
  tries: Tries = Tries()
  layers_per_stage: Sequence[int] | None = None  # None: balanced by FLOPs
  optimizer: str = 'adamw'
  compensation: Compensation = Compensation()


def bench_settings(
  devices: int,
  tries: Tries = Tries(),
  base: ScheduleConfig = ScheduleConfig(compensation=Compensation()),  # the paper's method
  *,
  num_layers: int | None = None,
  batch_size: int | None = None,
  only: str | None = None,
) -> list[ResolvedSchedule]:
  """The settings `plan` would try on `devices` devices at G = devices (`settings.settings` of
  `tries` on `base`, the two-chunk pipelines only where the model has the 2G layers for their
  chunks), those --only names (`settings.select`), each resolved on this platform for batches of
  `batch_size` rows. `base`'s compensation applies to the Ouroboros settings (the replay stash
  without DC-ASGD, which it cannot take) and none elsewhere. A setting that cannot cut the
  batch (or, for Ouroboros, whose M does not divide a replica's rows: cut into gcd(M, rows), as
  `train` would, `resolved_for_batch`) is left out, or, named by --only, refused in one line."""
  tried = settings_lib.settings(devices, dataclasses.replace(tries, stages=(devices,)), base)
  tried = [
    _own_compensation(s) for s in tried if num_layers is None or s.stage_groups <= num_layers
  ]
  resolved = settings_lib.select(_resolvable(tried, batch_size), only)  # by the labels it prints
  if batch_size is not None:
    resolved = [resolved_for_batch(s, batch_size) for s in resolved]
  fits = lambda s: batch_size is None or batch_size % micro_size(s) == 0
  unfit = [s.label for s in resolved if not fits(s)]
  if only is not None and unfit:
    raise ConfigError(
      f'--batch-size {batch_size} cannot be cut into the micro-batches (or replicas) of '
      f'{", ".join(unfit)}; use a --batch-size that they divide, or leave them out of --only.'
    )
  return list(dict.fromkeys(s for s in resolved if fits(s)))


def _resolvable(tried: Sequence[ScheduleConfig], batch_size: int | None) -> list[ResolvedSchedule]:
  """Each setting of `tried` resolved on this platform, those that cannot be (an exact pipeline
  with fewer micro-batches than its table needs) left out."""
  platform, out = placement.platform(), []
  for setting in tried:
    try:
      out.append(setting.resolve(platform, batch_size))
    except ConfigError:
      continue
  return out


def _own_compensation(setting: ScheduleConfig) -> ScheduleConfig:
  """`setting` with its compensation where it applies: Ouroboros' (the replay stash without
  DC-ASGD, which needs the gradient at the forward's weights), none elsewhere."""
  comp = setting.compensation
  if setting.name != 'ouroboros':
    comp = Compensation()
  elif setting.stash == 'replay' and isinstance(comp, Compensation):
    comp = dataclasses.replace(comp, dc_lambda=0.0)
  return dataclasses.replace(setting, compensation=comp)


def resolved_for_batch(setting: ResolvedSchedule, batch_size: int) -> ResolvedSchedule:
  """An Ouroboros setting whose M does not divide a replica's rows cut into gcd(M, rows)
  micro-batches, as `train` resolves Ouroboros' micro-batches from its batch
  (`ScheduleConfig.resolve`); any other setting as it is (an exact pipeline's M is what it
  is measured at)."""
  rows = max(batch_size // setting.data_parallel, 1)
  if setting.name != 'ouroboros' or rows % setting.microbatches == 0:
    return setting
  return dataclasses.replace(setting, microbatches=math.gcd(setting.microbatches, rows))


def time_setting(setting: ScheduleConfig, work: Workload, bench: BenchConfig) -> dict | None:
  """Compile and time one setting; None on processes whose devices it does not use."""
  prepared = timing.prepare_setting(setting, work, bench.optimizer, bench.warmup)
  if prepared is None:
    return None
  timing.time_steps(prepared, bench.steps)
  return measurement(prepared, work)


def measurement(prepared: timing.Prepared, work: Workload) -> dict:
  """The median step of the timed steps, and the CPU seconds of the busiest process."""
  step_s = statistics.median(prepared.times)
  # CPU seconds this process spent per step: on a loaded machine wall time stretches, this does
  # not (much); the busiest process bounds the step from below.
  busy_s = statistics.median(prepared.busy)
  owners = {d.process_index for d in prepared.devices}
  if jax.process_count() > 1 and len(owners) == jax.process_count():
    busy_s = float(np.max(multihost_utils.process_allgather(np.float64(busy_s))))
  return {
    'step_time_s': step_s,
    'busy_s': busy_s,
    'compile_s': prepared.compile_s,
    'tokens_per_s': work.batch['inputs'].size / step_s,
    'idle_fraction': prepared.idle_fraction,
    'host_load': host_load(),
  }


def round_robin(settings, work: Workload, bench: BenchConfig, measure_pieces_now=None):
  """(setting, measurement or None) for every setting, timed in `BenchConfig.rounds` rounds: all of
  them compiled and warmed up first, then steps / rounds steps of each in turn per round. Every
  process runs the same settings in the same order (a setting waits for its devices' peers).

  With `measure_pieces_now` (a callable giving the pieces) each round also re-times the pieces
  first, and the second result is their median over the rounds (`calibration.median_pieces`):
  the pieces the predictions are built from then drift with the machine as the settings' steps
  do. Else None.
  What the pieces allocated and freed is then handed back to the kernel
  (`host.release_freed_memory`), and each setting runs one untimed step before its timed ones."""
  prepared = []
  for setting in settings:
    prepared.append(timing.prepare_setting(setting, work, bench.optimizer, bench.warmup))
    multihost_utils.sync_global_devices(f'bench prepare {setting.label}')
  per_round = [
    bench.steps // bench.rounds + (r < bench.steps % bench.rounds) for r in range(bench.rounds)
  ]
  pieces_by_round = []
  for r, steps in enumerate(per_round):
    if measure_pieces_now is not None:
      pieces_by_round.append(measure_pieces_now())
      host.release_freed_memory()
    for setting, ready in zip(settings, prepared):
      if ready is not None:
        if measure_pieces_now is not None:
          timing.step_untimed(ready)
        timing.time_steps(ready, steps)
      multihost_utils.sync_global_devices(f'bench round {r} {setting.label}')
  timed = [
    (setting, None if ready is None else measurement(ready, work))
    for setting, ready in zip(settings, prepared)
  ]
  return timed, calibration.median_pieces(pieces_by_round) if pieces_by_round else None


def host_load() -> float:
  """The host's 1-minute load average (nan where unknown). The benchmark's own processes count:
  with one pinned process per core, a load above the process count means something else shared
  the cores while the setting was timed, and its times (and the pieces') are not to be trusted."""
  try:
    return os.getloadavg()[0]
  except (AttributeError, OSError):
    return float('nan')


def run(cfg: transformer.ModelConfig, bench: BenchConfig, log=print) -> list[dict]:
  """Benchmarks every setting of `bench`; process 0 writes the outputs and returns the rows
  (an earlier bench's in the same directory moved aside first, `keep_earlier`)."""
  work = _workload(cfg, bench)
  if jax.process_index() == 0:
    keep_earlier(bench.out_dir, log)
  base = ScheduleConfig(compensation=bench.compensation)
  settings = bench.settings or bench_settings(
    bench.stages, bench.tries, base, num_layers=cfg.num_layers, batch_size=bench.batch_size
  )
  # Each stage setting's program on one device is timed here for one round, else in each round
  # beside the pieces.
  calib = calibration.start(work, settings, bench.optimizer, programs_now=bench.rounds == 1)
  _log_pieces(calib, log)
  timed, by_policy = _timed(settings, work, bench, calib, log)
  _log_one_device(by_policy['all'], log)
  rows = _rows(timed, by_policy, calib, work, bench, log)
  if jax.process_index() == 0:
    write_outputs(rows, bench.out_dir, _meta(work, bench), log)
  return rows


def _log_pieces(calib: calibration.Calibration, log) -> None:
  """The pieces measured at the start, and each stash policy's micro-batches."""
  pieces = calib.pieces['all']
  log(
    f'pieces: forward {np.round(pieces["fwd"], 4)} s, backward {np.round(pieces["bwd"], 4)} s, '
    f'update {np.round(pieces["update"], 4)} s, head+embed {pieces["head"]:.4f} s, '
    f'hop {calib.link_s:.4f} s, all-reduce {calib.allreduce_s:.4f} s, concurrent slowdown '
    f'{pieces["concurrent_slowdown"]:.3f}, collective wait {pieces["collective_wait"]:.4f} s, '
    f'host load {host_load():.2f}'
  )
  for policy, measured in calib.pieces.items():
    name = 'micro-batch' if policy == 'all' else f'stash-policy {policy} micro-batch'
    for m in measured['fwd_micro']:
      log(
        f'{name} pieces, M={m}: forward {np.round(measured["fwd_micro"][m], 4)} s, '
        f'backward {np.round(measured["bwd_micro"][m], 4)} s'
        + (
          f', split backward B / (B + W) {measured["input_grad_share"][m]:.3f}'
          if m in measured.get('input_grad_share', {})
          else ''
        )
      )


def _timed(settings, work: Workload, bench: BenchConfig, calib: calibration.Calibration, log):
  """(each setting with its measurement, or None on processes it does not use; {stash policy:
  the pieces its rows use}). One round: each setting timed in turn, as the rows are written,
  with the pieces of the start. Several: `round_robin`, the pieces measured again at the start
  of each round (fewer repeats each) and their medians used."""
  if bench.rounds == 1:
    return _one_by_one(settings, work, bench), calib.pieces
  timed, by_policy = round_robin(settings, work, bench, lambda: calib.again(bench.rounds))
  pieces = by_policy['all']
  log(
    f'pieces, the median of {bench.rounds} rounds: forward {np.round(pieces["fwd"], 4)} s, '
    f'backward {np.round(pieces["bwd"], 4)} s, update {np.round(pieces["update"], 4)} s, '
    f'head+embed {pieces["head"]:.4f} s, concurrent slowdown '
    f'{pieces["concurrent_slowdown"]:.3f}, collective wait {pieces["collective_wait"]:.4f} s'
  )
  return timed, by_policy


def _one_by_one(settings, work: Workload, bench: BenchConfig):
  """Each setting compiled, warmed up and timed in turn, yielded as soon as it is."""
  for setting in settings:
    measured = time_setting(setting, work, bench)
    multihost_utils.sync_global_devices(f'bench {setting.label}')
    yield setting, measured


def _log_one_device(pieces: dict, log) -> None:
  """Each stage setting's program on one device, and how much slower beside the others."""
  for label, seconds in pieces['one_device'].items():
    beside = pieces['program_slowdown'].get(label)
    log(
      f'{label} on one device: {seconds:.4f} s'
      + (f', {beside:.3f}x beside the other processes' if beside else '')
    )


def _rows(timed, by_policy, calib: calibration.Calibration, work, bench, log) -> list[dict]:
  """A row per setting this process measured, bench.csv written after each (process 0), so
  that a bench cut short keeps what it measured."""
  cfg, rows = work.cfg, []
  for setting, measured in timed:
    if measured is None:
      continue
    own = by_policy[calibration.policy(setting)]
    row = _row(setting, measured, own, calib.link_s, calib.allreduce_s)
    tokens = bench.batch_size * cfg.seq_len
    row['mfu'] = mfu(cfg, tokens, row['step_time_s'], num_devices(setting), jax.devices()[0])
    rows.append(row)
    if jax.process_index() == 0:  # row by row, so a bench cut short keeps what it measured
      write_csv(rows, bench.out_dir)
    log(
      f'{setting.label:28s} {row["step_time_s"] * 1e3:9.1f} ms/step  '
      f'{row["tokens_per_s"]:9.0f} tok/s  ideal {row["ideal_s"] * 1e3:8.1f} ms  '
      f'compile {row["compile_s"]:.1f} s'
    )
  return rows


def _workload(cfg: transformer.ModelConfig, bench: BenchConfig) -> Workload:
  """The checked model, its parameters and one random batch of token ids."""
  cfg.validate()
  if bench.steps < 1:
    raise ConfigError(f'--bench-steps must be >= 1 (timed steps per setting), got {bench.steps}.')
  if not 1 <= bench.rounds <= max(bench.steps, 1):
    raise ConfigError(
      f'--rounds must be between 1 and --bench-steps ({bench.steps}), got {bench.rounds}: each '
      'round times at least one step of every setting.'
    )
  if bench.warmup < 0:
    raise ConfigError(f'--warmup must be >= 0 (untimed steps before timing), got {bench.warmup}.')
  layers_per_stage = tuple(bench.layers_per_stage or partition.balance_layers(cfg, bench.stages))
  rng = np.random.default_rng(0)
  batch = {
    k: rng.integers(0, cfg.vocab_size, (bench.batch_size, cfg.seq_len)).astype(np.int32)
    for k in ('inputs', 'targets')
  }
  params = jax.device_get(transformer.init_params(cfg, jax.random.key(0)))
  return Workload(cfg, params, batch, layers_per_stage)


def _meta(work: Workload, bench: BenchConfig) -> dict:
  """What bench.json records of the run beside its rows."""
  return {
    'model': dataclasses.asdict(work.cfg),
    'batch_size': bench.batch_size,
    'stages': bench.stages,
    'layers_per_stage': work.layers_per_stage,
    'processes': jax.process_count(),
    'devices': [str(d) for d in jax.devices()],
    'steps': bench.steps,
    'warmup': bench.warmup,
    'rounds': bench.rounds,
    'tries': dataclasses.asdict(bench.tries),
    'optimizer': bench.optimizer,
    'compensation': ','.join(bench.compensation.names()) or 'none',
  }


# Dense bf16 peak FLOP/s of one device, by a name its `device_kind` contains (vendors' data
# sheets; sparsity not counted). MFU divides the model's FLOPs per second by the devices' sum.
PEAK_BF16_FLOPS = {
  'H200': 989e12,
  'H100': 989e12,
  'A100': 312e12,
  'L4': 121e12,
  'TPU v6 lite': 918e12,
  'TPU v5p': 459e12,
  'TPU v5 lite': 197e12,
  'TPU v4': 275e12,
}


def peak_flops(device) -> float | None:
  """The device's dense bf16 peak FLOP/s, None for one not in PEAK_BF16_FLOPS (a CPU)."""
  kind = getattr(device, 'device_kind', '')
  return next((peak for name, peak in PEAK_BF16_FLOPS.items() if name in kind), None)


def mfu(cfg: transformer.ModelConfig, tokens: int, step_s: float, devices: int, device) -> float:
  """Model FLOPs utilisation: the model's FLOPs per step (`costs.step_flops`) over step_s,
  as a fraction of `devices` devices' bf16 peak (nan where the peak is unknown)."""
  peak = peak_flops(device)
  return float('nan') if peak is None else costs.step_flops(cfg, tokens) / step_s / (devices * peak)


def _row(
  setting: ResolvedSchedule, measured: dict, own: dict, link_s: float, allreduce_s: float
) -> dict:
  """One setting's row: what was timed, its pieces, and the simulator's ideal and prediction
  (`calibration.columns`)."""
  ring = setting.name == 'ouroboros'
  return {
    'schedule': setting.name,
    'label': setting.label,
    'stages': num_devices(setting),
    'microbatches': setting.microbatches if setting.name in MICROBATCHED else '',
    'stash': setting.stash if ring else '-',
    'forward': setting.forward if ring else '-',
    'flow': setting.flow,
    **measured,
    **calibration.columns(setting, own, link_s, allreduce_s),
  }


def table(rows: list[dict]) -> str:
  base = next((r['step_time_s'] for r in rows if r['schedule'] == 'backprop'), None)
  mp = next((r['step_time_s'] for r in rows if r['schedule'] == 'model_parallel'), None)
  lines = [
    '| setting | devices | step ms | tokens/s | vs backprop | vs model_parallel | '
    'ideal ms | measured / ideal | simulator error | MFU |',
    '|---|---|---|---|---|---|---|---|---|---|',
  ]
  for r in rows:
    ratio = lambda ref: f'{ref / r["step_time_s"]:.2f}x' if ref else '-'
    error = (r['predicted_s'] - r['step_time_s']) / r['step_time_s']
    lines.append(
      f'| {r["label"]} | {r["stages"]} | {r["step_time_s"] * 1e3:.1f} | '
      f'{r["tokens_per_s"]:.0f} | {ratio(base)} | {ratio(mp)} | '
      f'{r["ideal_s"] * 1e3:.1f} | {r["step_time_s"] / r["ideal_s"]:.2f} | '
      f'{error:+.1%} | {_percent(r.get("mfu"))} |'
    )
  return '\n'.join(lines)


def _percent(value) -> str:
  return '-' if value is None or value != value else f'{value:.1%}'  # nan: unknown peak


OUTPUTS = ('bench.csv', 'bench.json', 'bench.md', 'bench.png')


def keep_earlier(out_dir: str, log=print) -> str | None:
  """Moves an earlier bench's outputs in `out_dir` into `out_dir/earlier-N` (the first free N)
  and says so: a bench never overwrites results silently. Returns where they went (None: there
  were none)."""
  found = [name for name in OUTPUTS if os.path.exists(os.path.join(out_dir, name))]
  if not found:
    return None
  n = 1
  while os.path.exists(os.path.join(out_dir, f'earlier-{n}')):
    n += 1
  where = os.path.join(out_dir, f'earlier-{n}')
  os.makedirs(where)
  for name in found:
    os.replace(os.path.join(out_dir, name), os.path.join(where, name))
  log(f"moved the earlier bench's {', '.join(found)} to {where} (nothing was deleted)")
  return where


def write_csv(rows: list[dict], out_dir: str) -> None:
  """bench.csv: one row per setting measured so far."""
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, 'bench.csv'), 'w', newline='') as f:
    writer = csv.DictWriter(f, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)


def write_outputs(rows: list[dict], out_dir: str, meta: dict, log=print) -> None:
  write_csv(rows, out_dir)
  with open(os.path.join(out_dir, 'bench.json'), 'w') as f:
    json.dump({'meta': meta, 'rows': rows}, f, indent=2, default=str)
  text = table(rows)
  with open(os.path.join(out_dir, 'bench.md'), 'w') as f:
    f.write(text + '\n')
  log(text)

  import matplotlib

  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(9, 4.5))
  labels = [r['label'] for r in rows]
  xs = np.arange(len(rows))
  ax.bar(xs, [r['tokens_per_s'] for r in rows], color='tab:blue', label='measured')
  ax.scatter(
    xs,
    [r['tokens_per_s'] * r['step_time_s'] / r['ideal_s'] for r in rows],
    color='tab:red',
    marker='_',
    s=400,
    label='ideal (simulator, free links)',
  )
  ax.set_xticks(xs, labels, rotation=30, ha='right')
  ax.set_ylabel('tokens / s')
  ax.set_title(
    f'{meta["processes"]} process(es), {meta["stages"]} stages, '
    f'batch {meta["batch_size"]} x {meta["model"]["seq_len"]}'
  )
  ax.legend()
  ax.grid(axis='y', alpha=0.3)
  fig.tight_layout()
  fig.savefig(os.path.join(out_dir, 'bench.png'), dpi=120)
  log(f'wrote {out_dir}/bench.csv, bench.md, bench.png')
