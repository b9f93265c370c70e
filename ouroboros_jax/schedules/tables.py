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
import functools
from typing import NamedTuple

from ouroboros_jax.choices import EXACT_PIPELINES, SPLIT_BACKWARD
from ouroboros_jax.errors import ConfigError, field_ref

KINDS = ('F', 'B', 'W')
PIPELINES = ('gpipe', *EXACT_PIPELINES)
DEFAULT_CHUNKS = {'interleaved': 2, 'zb_v': 2}  # model chunks per device; the others: 1


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

  def stage_of(self, device: int, chunk: int) -> int:
    """The virtual stage k a device's chunk holds: Megatron's interleaving k = chunk p + device,
    or ZB-V's V shape (chunk 1 runs back down: k = 2p - 1 - device)."""
    if self.name == 'zb_v' and chunk == 1:
      return 2 * self.num_stages - 1 - device
    return chunk * self.num_stages + device

  def place_of(self, stage: int) -> tuple[int, int]:
    """(device, chunk) of virtual stage k."""
    p = self.num_stages
    if self.name == 'zb_v' and stage >= p:
      return 2 * p - 1 - stage, 1
    return stage % p, stage // p

  @property
  def last_stage(self) -> int:
    return self.num_stages * self.chunks - 1


class Table(NamedTuple):
  pipeline: Pipeline
  grid: tuple[tuple[Op | None, ...], ...]  # [device][tick]


# ----------------------------------------------------------------------------- the schedules


@functools.lru_cache(maxsize=64)
def build(name: str, num_stages: int, microbatches: int, chunks: int | None = None) -> Pipeline:
  """The named schedule for p = num_stages devices and m = microbatches, with `chunks` model
  chunks per device (None: the schedule's own, DEFAULT_CHUNKS); one-line errors. Built once per
  setting (validation, the step and the simulator ask for the same immutable table)."""
  if name not in PIPELINES:
    raise ConfigError(
      f'unknown pipeline {field_ref("name", name)}; choose one of {", ".join(PIPELINES)}.'
    )
  chunks = DEFAULT_CHUNKS.get(name, 1) if chunks is None else chunks
  if num_stages < 1 or microbatches < 1 or chunks < 1:
    raise ConfigError(
      f'a pipeline needs {field_ref("num_stages")}, {field_ref("microbatches")} and '
      f'{field_ref("chunks")} >= 1, got {num_stages}, {microbatches} and {chunks}.'
    )
  if name == 'interleaved' and chunks < 2:
    raise ConfigError(
      f'interleaved 1F1B needs {field_ref("chunks")} >= 2 model chunks per device (one chunk '
      f'is plain 1F1B), got {chunks}; use {field_ref("chunks", 2)} or more, or '
      f'{field_ref("name", "1f1b")}.'
    )
  if name == 'zb_v' and chunks != 2:
    raise ConfigError(
      f'zb_v runs two chunks per device (its V); drop {field_ref("chunks", chunks)}.'
    )
  if name not in DEFAULT_CHUNKS and chunks != 1:
    raise ConfigError(
      f'{name} runs one chunk per device; {field_ref("chunks", chunks)} needs '
      f'{field_ref("name", "interleaved")}.'
    )
  if name == 'interleaved' and microbatches % num_stages:
    raise ConfigError(
      f'interleaved 1F1B sends micro-batches round the devices in groups of '
      f'{field_ref("num_stages")}: {field_ref("microbatches", microbatches)} is not a multiple '
      f'of {field_ref("num_stages", num_stages)}; use '
      f'{field_ref("microbatches", -(-microbatches // num_stages) * num_stages)}.'
    )
  fused = name not in SPLIT_BACKWARD
  if name == 'zb_v':
    return _zb_v(Pipeline(name, num_stages, microbatches, chunks, fused, ()))
  order = {'gpipe': _gpipe, '1f1b': _one_f_one_b, 'interleaved': _interleaved, 'zb_h1': _zb_h1}
  orders = tuple(tuple(order[name](s, num_stages, microbatches, chunks)) for s in range(num_stages))
  return Pipeline(name, num_stages, microbatches, chunks, fused, orders)


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


def _zb_v(shape: Pipeline) -> Pipeline:
  """ZB-V (Qi et al. 2024, section 6): two chunks per device in a V (device d holds stages d and
  2p - 1 - d, so the first and the last stage share device 0), B and W split. The order comes
  from running the ops tick by tick, each device taking, of what is ready: a B (it unblocks the
  stage before; oldest micro-batch, deeper chunk first), else an F while it holds fewer than 2p
  chunks (1F1B's activation memory: p micro-batches of a whole stage; deeper chunk first), else
  its oldest W. This reaches the least bubble a per-step barrier allows, (p - 1) / (6m): the last
  device's p - 1 half-stage ticks of waiting for its first input."""
  p, m = shape.num_stages, shape.microbatches
  priority = {
    'B': lambda op: (op.microbatch, -op.chunk),
    'F': lambda op: (-op.chunk, op.microbatch),
    'W': lambda op: (op.microbatch, op.chunk),
  }
  done, tick = {}, 0
  orders = [[] for _ in range(p)]
  todo = [{Op(kind, i, c) for kind in KINDS for i in range(m) for c in range(2)} for _ in range(p)]
  while any(todo):
    ran = []
    for d in range(p):
      held = sum(op.kind == 'F' for op in orders[d]) - sum(op.kind == 'W' for op in orders[d])
      for kind in ('B', 'F', 'W'):
        ready = [op for op in todo[d] if op.kind == kind and _is_ready(shape, op, d, done, tick)]
        if ready and not (kind == 'F' and held >= 2 * p):
          ran.append((d, min(ready, key=priority[kind])))
          break
    for d, op in ran:
      orders[d].append(op)
      todo[d].remove(op)
      done[(op.kind, op.microbatch, shape.stage_of(d, op.chunk))] = tick
    tick += 1
  return dataclasses.replace(shape, orders=tuple(tuple(order) for order in orders))


def _is_ready(pipeline: Pipeline, op: Op, device: int, done: dict, tick: int) -> bool:
  """Whether `op` can run at `tick`: its input was produced earlier, and a W follows its B."""
  needed = needs(pipeline, op, device)
  if op.kind == 'W' and ('B', op.microbatch, pipeline.stage_of(device, op.chunk)) not in done:
    return False
  return needed is None or done.get(needed, tick) < tick


# ----------------------------------------------------------------------------- the table


def needs(pipeline: Pipeline, op: Op, device: int) -> tuple[str, int, int] | None:
  """(kind, microbatch, virtual stage) of the value `op` reads from another operation."""
  k = pipeline.stage_of(device, op.chunk)
  if op.kind == 'F':
    return None if k == 0 else ('F', op.microbatch, k - 1)
  if op.kind == 'B':  # the output gradient: from the loss, or from the next stage's backward
    if k == pipeline.last_stage:
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
      done[(op.kind, op.microbatch, pipeline.stage_of(d, op.chunk))] = tick
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
        key = (op.kind, op.microbatch, pipeline.stage_of(d, op.chunk))
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


# ----------------------------------------------------------------------------- the program

KIND_CODES = {None: 0, 'F': 1, 'B': 2, 'W': 3}  # the executor's lax.switch index
NOWHERE, ACTIVATIONS, GRADIENTS = 0, 1, 2  # where a received value is kept


class Program(NamedTuple):
  """A table as the integer arrays an executor indexes: fields[name][device][tick].

  kind, microbatch, chunk, stage   the operation (KIND_CODES; virtual stage k)
  stash_slot                       F writes its residuals there; B and W read them (W frees it)
  inbox_slot                       F reads its input activation there (k > 0); B and W their
                                   output gradient
  store_<o>, slot_<o>              for each channel o in `channels`: where the value received
                                   from device d - o at the end of the tick is kept (NOWHERE,
                                   ACTIVATIONS or GRADIENTS) and in which slot

  Every operation sends at most one value: F its output (to the next stage, or, on the last
  stage, the head's gradient to its own B), B its input gradient (to the previous stage). Channel
  o carries values from device d to d + o (mod p); 0 is the device itself. Slots are reused as
  soon as their value is read for the last time, so the slot counts are the most values a device
  holds at once (the stash count is `max(peak_stash(table))`).
  """

  ticks: int
  fields: dict[str, tuple[tuple[int, ...], ...]]
  channels: tuple[int, ...]
  stash_slots: int
  activation_slots: int
  gradient_slots: int


def program(table: Table) -> Program:
  p, num_ticks = table.pipeline.num_stages, ticks(table)
  slots = _slots(table)
  fields, sends = _tick_fields(table, slots, num_ticks)
  channels = tuple(sorted({(to - d) % p for _, d, to, _, _ in sends}))
  for o in channels:
    fields[f'store_{o}'] = [[NOWHERE] * num_ticks for _ in range(p)]
    fields[f'slot_{o}'] = [[0] * num_ticks for _ in range(p)]
  for t, d, to, keep, slot in sends:
    o = (to - d) % p
    fields[f'store_{o}'][to][t], fields[f'slot_{o}'][to][t] = keep, slot
  count = lambda what: max(1, max((max(s.values(), default=-1) + 1) for s in slots[what]))
  return Program(
    num_ticks,
    {name: tuple(map(tuple, rows)) for name, rows in fields.items()},
    channels,
    count('stash'),
    count(ACTIVATIONS),
    count(GRADIENTS),
  )


def _slots(table: Table) -> dict[str, list[dict[tuple[int, int], int]]]:
  """Per store ('stash', ACTIVATIONS, GRADIENTS) and device: the slot of each (micro-batch,
  virtual stage) value it keeps, reused once the value's last reader has run."""
  pipeline, p = table.pipeline, table.pipeline.num_stages
  last = pipeline.last_stage
  tick_of = {
    (op.kind, op.microbatch, pipeline.stage_of(d, op.chunk)): t
    for d, row in enumerate(table.grid)
    for t, op in enumerate(row)
    if op is not None
  }
  # Per device, the ticks each kept value lives: [first tick it is there, last tick it is read].
  held = {what: [[] for _ in range(p)] for what in ('stash', ACTIVATIONS, GRADIENTS)}
  for (kind, i, k), t in tick_of.items():
    d, w = pipeline.place_of(k)[0], tick_of[('W', i, k)]
    if kind == 'F':
      held['stash'][d].append(((i, k), t, w))
      if k > 0:
        held[ACTIVATIONS][d].append(((i, k), tick_of[('F', i, k - 1)] + 1, t))
      gradient_from = tick_of[('F', i, k)] if k == last else tick_of[('B', i, k + 1)]
      held[GRADIENTS][d].append(((i, k), gradient_from + 1, w))
  return {what: [_allocate(lives) for lives in per_device] for what, per_device in held.items()}


def _tick_fields(table: Table, slots: dict, num_ticks: int) -> tuple[dict, list]:
  """`Program.fields` of each device's operation per tick (all but the channels' store_<o> and
  slot_<o>), and the sends: (tick, from device, to device, where it is kept, slot)."""
  pipeline, p = table.pipeline, table.pipeline.num_stages
  last = pipeline.last_stage
  names = ('kind', 'microbatch', 'chunk', 'stage', 'stash_slot', 'inbox_slot')
  fields = {name: [[0] * num_ticks for _ in range(p)] for name in names}
  sends = []  # (tick, from device, to device, where it is kept, slot)
  for d, row in enumerate(table.grid):
    for t, op in enumerate(row):
      if op is None:
        continue
      k = pipeline.stage_of(d, op.chunk)
      inbox = ACTIVATIONS if op.kind == 'F' else GRADIENTS
      values = {
        'kind': KIND_CODES[op.kind],
        'microbatch': op.microbatch,
        'chunk': op.chunk,
        'stage': k,
        'stash_slot': slots['stash'][d][(op.microbatch, k)],
        'inbox_slot': slots[inbox][d].get((op.microbatch, k), 0),
      }
      for name, value in values.items():
        fields[name][d][t] = value
      if op.kind == 'F':
        to = k + 1 if k < last else k  # the last stage keeps the head's gradient for its own B
        keep = ACTIVATIONS if k < last else GRADIENTS
        dest = pipeline.place_of(to)[0]
        sends.append((t, d, dest, keep, slots[keep][dest][(op.microbatch, to)]))
      elif op.kind == 'B' and k > 0:
        to = pipeline.place_of(k - 1)[0]
        sends.append((t, d, to, GRADIENTS, slots[GRADIENTS][to][(op.microbatch, k - 1)]))
  return fields, sends


def _allocate(lives: list[tuple[object, int, int]]) -> dict[object, int]:
  """Slots for values living [first, last] ticks: the lowest slot free since before `first`
  (interval colouring in order of first tick, which uses the fewest slots)."""
  free_after, slot_of = [], {}  # per slot, the last tick its value is read
  for key, first, last in sorted(lives, key=lambda life: life[1]):
    slot = next((s for s, end in enumerate(free_after) if end < first), len(free_after))
    if slot == len(free_after):
      free_after.append(last)
    free_after[slot] = last
    slot_of[key] = slot
  return slot_of
