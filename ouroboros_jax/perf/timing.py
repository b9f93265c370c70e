"""A setting's step program compiled and timed: what `bench` times setting after setting, and
what `calibration` times on one device (`calibration.one_device_probe`).

`Workload` is what every program runs (the model, its parameters, one batch, the G-stage split);
`prepare_setting` compiles a setting's step and runs its warm-up steps, `time_steps` times more
of them one by one, `step_untimed` runs one that is not timed; `median_time` is the median of a
jitted function's calls (how `calibration` times a piece).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax

from ouroboros_jax import placement
from ouroboros_jax.errors import ConfigError
from ouroboros_jax.models import model as transformer
from ouroboros_jax.models import partition
from ouroboros_jax.optimizers import LIBRARY_DIMS, make_optimizer
from ouroboros_jax.schedules import ScheduleConfig, build_schedule
from ouroboros_jax.schedules.config import ResolvedSchedule, require_resolved


@dataclasses.dataclass(frozen=True)
class Workload:
  """What every setting runs: the model, its (whole, host) parameters, one batch, and the
  G-stage split the pieces are measured on."""

  cfg: transformer.ModelConfig
  params: dict
  batch: dict
  layers_per_stage: tuple[int, ...]


def bench_optimizer(name: str = 'adamw'):
  """The optimizer every setting is timed with (its rate does not change the time)."""
  return make_optimizer(
    name, 1e-4, weight_decay=0.1, muon_learning_rate=1e-3, muon_dims=LIBRARY_DIMS
  )


def num_devices(setting: ScheduleConfig) -> int:
  """The devices a setting runs on: G for a stage schedule, D for data_parallel, 1 for backprop
  (G x R on a stage x data mesh)."""
  return setting.num_stages * setting.data_parallel


def micro_size(setting: ScheduleConfig) -> int:
  """The M whose micro-batch (B / M rows) the setting computes: its micro-batches, data_parallel's
  D replicas (each on B / D rows); 1 for a setting that computes the whole batch at once. The
  batch must be a multiple of it."""
  if setting.name == 'data_parallel':
    return setting.data_parallel
  return setting.num_microbatches


def median_time(fn, *args, repeats: int, warm: bool = True) -> float:
  """The median seconds of `repeats` calls of fn(*args), each waited for; `warm`: after one
  untimed call (its compile)."""
  if warm:
    jax.block_until_ready(fn(*args))  # compile / warm
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


@dataclasses.dataclass
class Prepared:
  """One setting compiled and warmed up, ready to be timed (`prepare_setting`). `fresh()` builds
  a new state (its initial one), for a program whose state is dropped between uses."""

  setting: ScheduleConfig
  compiled: Any
  state: Any
  placed: dict
  devices: list
  compile_s: float
  idle_fraction: float
  fresh: Callable[[], Any]
  times: list = dataclasses.field(default_factory=list)
  busy: list = dataclasses.field(default_factory=list)


def prepare_setting(
  setting: ResolvedSchedule,
  work: Workload,
  optimizer: str,
  warmup: int,
  devices: Sequence | None = None,
) -> Prepared | None:
  """Compile one resolved setting with `optimizer` and run `warmup` steps on `devices` (None: the
  first ones it needs of all processes'); None on processes whose devices it does not use."""
  setting = require_resolved(setting, 'bench')
  needed = num_devices(setting)
  if needed > jax.device_count():
    raise ConfigError(
      f'{setting.label} needs {needed} devices but {jax.device_count()} exist; '
      'use fewer --stages or launch more processes.'
    )
  devices = list(devices or jax.devices())[:needed]
  if not any(d.process_index == jax.process_index() for d in devices):
    return None
  split = (
    (work.cfg.num_layers,)
    if setting.name in ('backprop', 'data_parallel')
    else partition.balance_layers(work.cfg, setting.stage_groups)
    if setting.stage_groups != setting.num_stages
    else work.layers_per_stage
  )
  model = partition.transformer_stages(work.cfg, split)
  schedule = build_schedule(setting, model, bench_optimizer(optimizer), devices=devices)
  fresh = lambda: schedule.init(partition.to_staged(work.params, split), work.batch)
  state = fresh()
  placed = placement.place_batch(work.batch, schedule.mesh)
  start = time.perf_counter()
  compiled = schedule.step.lower(state, placed).compile()
  compile_s = time.perf_counter() - start
  for _ in range(warmup):
    state, _ = compiled(state, placed)
  jax.block_until_ready(state)
  return Prepared(
    setting, compiled, state, placed, devices, compile_s, schedule.idle_fraction, fresh
  )


def time_steps(prepared: Prepared, steps: int) -> None:
  """Times `steps` more steps of a prepared setting, one by one (wall and CPU seconds)."""
  for _ in range(steps):
    start, start_cpu = time.perf_counter(), time.process_time()
    prepared.state, metrics = prepared.compiled(prepared.state, prepared.placed)
    jax.block_until_ready((prepared.state, metrics))
    prepared.times.append(time.perf_counter() - start)
    prepared.busy.append(time.process_time() - start_cpu)


def step_untimed(prepared: Prepared) -> None:
  """One step of a prepared setting, not timed: its first on a new state, or after
  `host.release_freed_memory`, pays for faulting its scratch memory in."""
  prepared.state, metrics = prepared.compiled(prepared.state, prepared.placed)
  jax.block_until_ready((prepared.state, metrics))
