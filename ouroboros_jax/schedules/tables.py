"""Exact pipeline schedules as data: the operations each device runs, and the tick table they make.

A pipeline schedule (GPipe, 1F1B, interleaved 1F1B, the zero-bubble ZB-H1) is written as one
ordered list of operations per device. An operation `Op(kind, microbatch, chunk)` is

    F   the forward of one micro-batch through one model chunk
    B   the input-gradient part of its backward (what the previous chunk waits for)
    W   the weight-gradient part (which nothing downstream waits for)

The model is cut into p * v chunks on p devices (virtual stage k = chunk * p + device, Megatron's
interleaved layout; v = 1 is the plain pipeline). `place` turns the lists into a table, grid
[device][tick] -> Op or None, by running every device's next operation at the first tick its
input exists, one operation per device per tick (F = B = W = one tick, the zero-bubble paper's
unit). A *fused* schedule (GPipe, 1F1B, interleaved) computes a chunk's backward as one VJP, so
the input gradient leaves only after the W; a *split* one (ZB-H1) sends it after the B and runs
the W where the device would idle.

From a table: `bubble` (idle ticks over busy ticks on a device: the published ratios (p-1)/m for
GPipe and 1F1B, (p-1)/(v m) interleaved, (p-1)/(3m) ZB-H1) and `peak_stash` (per device, the
most micro-batches held at once between their F and their W). `check` rejects a table in which an
operation reads a value before it is produced. Standard library only, so the simulator reads the
same tables.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from ouroboros_jax.errors import ConfigError

KINDS = ('F', 'B', 'W')
PIPELINES = ('gpipe', '1f1b', 'interleaved', 'zb_h1')


class Op(NamedTuple):
  kind: str  # F, B or W
  microbatch: int
  chunk: int = 0  # which of the device's v model chunks


@dataclasses.dataclass(frozen=True)
class Pipeline:
  """A schedule as data: per device, the operations in the order it runs them."""

  name: str
  num_stages: int  # p devices
  microbatches: int  # m
  chunks: int  # v model chunks per device
  fused: bool  # the input gradient leaves after the W (one VJP), not after the B
  orders: tuple[tuple[Op, ...], ...]


class Table(NamedTuple):
  pipeline: Pipeline
  grid: tuple[tuple[Op | None, ...], ...]  # [device][tick]


# ----------------------------------------------------------------------------- the schedules


def build(name: str, num_stages: int, microbatches: int, chunks: int = 1) -> Pipeline:
  """The named schedule for p = num_stages devices and m = microbatches (one-line errors)."""
  if name not in PIPELINES:
    raise ConfigError(f'unknown pipeline {name!r}; choose --schedule from {", ".join(PIPELINES)}.')
  if num_stages < 1 or microbatches < 1 or chunks < 1:
    raise ConfigError(
      f'a pipeline needs --stages, --microbatches and chunks >= 1, got {num_stages}, '
      f'{microbatches} and {chunks}.'
    )
  if name != 'interleaved' and chunks != 1:
    raise ConfigError(f'{name} runs one chunk per device; chunks > 1 is the interleaved schedule.')
  if name == 'interleaved' and microbatches % num_stages:
    raise ConfigError(
      f'interleaved 1F1B sends micro-batches round the devices in groups of --stages: '
      f'--microbatches {microbatches} is not a multiple of --stages {num_stages}; use '
      f'{-(-microbatches // num_stages) * num_stages}.'
    )
  order = {'gpipe': _gpipe, '1f1b': _one_f_one_b, 'interleaved': _interleaved, 'zb_h1': _zb_h1}
  orders = tuple(tuple(order[name](s, num_stages, microbatches, chunks)) for s in range(num_stages))
  return Pipeline(name, num_stages, microbatches, chunks, name != 'zb_h1', orders)


def _full_backward(microbatch: int, chunk: int = 0) -> list[Op]:
  return [Op('B', microbatch, chunk), Op('W', microbatch, chunk)]


def _gpipe(s: int, p: int, m: int, v: int) -> list[Op]:
  """Every forward, then every backward (GPipe, Huang et al. 2019)."""
  del s, p, v
  return [Op('F', i) for i in range(m)] + [op for i in range(m) for op in _full_backward(i)]


def _one_f_one_b(s: int, p: int, m: int, v: int) -> list[Op]:
  """p - s - 1 warm-up forwards, then one forward and one backward in turn (PipeDream-Flush)."""
  del v
  warmup = min(p - s - 1, m)
  ops = [Op('F', i) for i in range(warmup)]
  for i in range(m):
    if warmup + i < m:
      ops.append(Op('F', warmup + i))
    ops += _full_backward(i)
  return ops


def _interleaved(s: int, p: int, m: int, v: int) -> list[Op]:
  """Megatron's interleaved 1F1B: micro-batches in groups of p go through chunk 0, then chunk 1,
  ...; backwards in the mirrored order; (p - s - 1) * 2 + (v - 1) * p warm-up forwards."""
  forwards = [(g * p + i, c) for g in range(m // p) for c in range(v) for i in range(p)]
  backwards = [(g * p + i, c) for g in range(m // p) for c in reversed(range(v)) for i in range(p)]
  warmup = min((p - s - 1) * 2 + (v - 1) * p, m * v)
  ops = [Op('F', i, c) for i, c in forwards[:warmup]]
  for n, (i, c) in enumerate(backwards):
    if warmup + n < m * v:
      ops.append(Op('F', *forwards[warmup + n]))
    ops += _full_backward(i, c)
  return ops


def _zb_h1(s: int, p: int, m: int, v: int) -> list[Op]:
  """ZB-H1 (Qi et al., ICLR 2024): 1F1B's order and memory, with each W deferred by s
  micro-batches (device s runs its W's s backwards late, the last s at the end), which fills the
  cool-down bubble: (p - 1) ticks instead of 3 (p - 1)."""
  del v
  warmup = min(p - s - 1, m)
  ops, waiting = [Op('F', i) for i in range(warmup)], []
  for i in range(m):
    if warmup + i < m:
      ops.append(Op('F', warmup + i))
    ops.append(Op('B', i))
    waiting.append(i)
    if len(waiting) > s:
      ops.append(Op('W', waiting.pop(0)))
  return ops + [Op('W', i) for i in waiting]


# ----------------------------------------------------------------------------- the table


def needs(pipeline: Pipeline, op: Op, device: int) -> tuple[str, int, int] | None:
  """(kind, microbatch, virtual stage) of the value `op` reads from another operation."""
  p, stages = pipeline.num_stages, pipeline.num_stages * pipeline.chunks
  k = op.chunk * p + device
  if op.kind == 'F':
    return None if k == 0 else ('F', op.microbatch, k - 1)
  if op.kind == 'B':  # the output gradient: from the loss, or from the next stage's backward
    if k == stages - 1:
      return ('F', op.microbatch, k)
    return ('W' if pipeline.fused else 'B', op.microbatch, k + 1)
  return ('B', op.microbatch, k)


def place(pipeline: Pipeline) -> Table:
  """Each device runs its next operation at the first tick its input exists (produced on an
  earlier tick; a transfer between devices fits in the tick boundary)."""
  p = pipeline.num_stages
  done: dict[tuple[str, int, int], int] = {}  # (kind, micro-batch, virtual stage) -> its tick
  position, grid = [0] * p, [[] for _ in range(p)]
  remaining, tick = sum(len(order) for order in pipeline.orders), 0
  while remaining:
    ran = []
    for d, order in enumerate(pipeline.orders):
      op = order[position[d]] if position[d] < len(order) else None
      needed = op and needs(pipeline, op, d)
      ready = op is not None and (needed is None or done.get(needed, tick) < tick)
      grid[d].append(op if ready else None)
      if ready:
        ran.append((d, op))
    if not ran:
      raise ConfigError(
        f'the {pipeline.name} schedule deadlocks at tick {tick}: no device can run its next '
        'operation.'
      )
    for d, op in ran:
      done[(op.kind, op.microbatch, op.chunk * p + d)] = tick
      position[d] += 1
      remaining -= 1
    tick += 1
  return Table(pipeline, tuple(tuple(row) for row in grid))


def check(table: Table) -> None:
  """Every (micro-batch, virtual stage) runs F, B and W once, each after the value it reads;
  otherwise a one-line ConfigError naming the device, the tick and the operation."""
  pipeline, p = table.pipeline, table.pipeline.num_stages
  produced = {}
  for d, row in enumerate(table.grid):
    for tick, op in enumerate(row):
      if op is not None:
        key = (op.kind, op.microbatch, op.chunk * p + d)
        if key in produced:
          raise ConfigError(
            f'{pipeline.name}: device {d} runs {op} twice (ticks {produced[key]} and {tick}).'
          )
        produced[key] = tick
  stages = p * pipeline.chunks
  for kind in KINDS:
    for i in range(pipeline.microbatches):
      for k in range(stages):
        if (kind, i, k) not in produced:
          raise ConfigError(
            f'{pipeline.name}: {kind} of micro-batch {i} on virtual stage {k} never runs.'
          )
  for d, row in enumerate(table.grid):
    for tick, op in enumerate(row):
      needed = op and needs(pipeline, op, d)
      if needed and produced[needed] >= tick:
        raise ConfigError(
          f'{pipeline.name}: device {d} runs {op.kind} of micro-batch {op.microbatch} at tick '
          f'{tick}, before {needed[0]} of virtual stage {needed[2]} produces its input (tick '
          f'{produced[needed]}).'
        )


def ticks(table: Table) -> int:
  """Ticks until the last operation ends."""
  last = [max((t for t, op in enumerate(row) if op is not None), default=-1) for row in table.grid]
  return max(last) + 1


def bubble(table: Table) -> float:
  """Idle ticks over busy ticks, on the busiest device (they are equal here): 3 m v busy."""
  busy = max(sum(op is not None for op in row) for row in table.grid)
  return (ticks(table) - busy) / busy


def peak_stash(table: Table) -> list[int]:
  """Per device, the most micro-batch chunks held at once between their F and their W."""
  peaks = []
  for row in table.grid:
    held = peak = 0
    for op in row:
      held += {None: 0, 'F': 1, 'B': 0, 'W': -1}[op and op.kind]
      peak = max(peak, held)
    peaks.append(peak)
  return peaks
