"""The simulator's engine: a step's tasks as a graph, and when each runs (`simulate.py` emits
every schedule's tasks; `execute` times them).

A task runs on one resource (a device, a link between two, a device's network port) for its
duration once its dependencies have ended, each resource one task at a time in emission order.
Standard library only at import, as `simulate.py`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple, Sequence

from ouroboros_jax.perf.cost_model import StageCosts


@dataclasses.dataclass
class Task:
  resource: tuple | None  # ('device', s), ('link', src, dst), ('net', d); None: a barrier
  kind: str  # fwd, bwd, head, embed_fwd, embed_bwd, act, grad, allreduce, barrier
  step: int  # the training step whose program runs it
  batch: int  # the batch (or micro-batch index, for gpipe) it works on
  duration: float
  deps: tuple[int, ...]  # tasks that must have ended first (indices into the graph)
  sync: bool  # the end-of-step barrier waits for it (compute and all-reduce)


class Span(NamedTuple):
  """One row of a Gantt chart. `device` is an int for compute, 'src->dst' for a link."""

  device: int | str
  kind: str
  batch: int
  start: float
  end: float


class Graph:
  """The tasks of a schedule in emission order, which is each resource's program order."""

  def __init__(self, costs: StageCosts):
    self.costs, self.tasks = costs, []
    self.barrier: int | None = None  # the previous step's barrier, a dep of every compute task
    self.step_tasks: list[int] = []  # sync tasks of the step being emitted
    self.step_end: dict[int, int] = {}
    self.update_s: Sequence[float] = ()  # per device: its optimizer update, ending every step
    self.updated_bytes: Sequence[float] = ()  # --shard-update: per device, the weights (at the
    # width `param_bytes` counts) gathered over its R replicas after its update; () without
    self.update_replicas = 1  # ... the R they are gathered over (data_parallel's D too)
    self.scatter_grads = False  # --shard-update: the stage gradients reduce-scattered, not
    # all-reduced (`grad_sync_s`)
    self.data_replicas = 1  # a stage schedule's R: each device's gradient all-reduced over R
    self.fsdp = False  # ... or (--fsdp) each layer gathered over R as an operation runs it
    self.chunks = 1  # (`_layer_collectives`); v chunks a device: an operation runs 1/v of its
    self.split = False  # layers; split (zero-bubble): B gathers, W reduce-scatters
    self._gathered: dict[int, int] = {}  # the embedding's gather, once a step
    self._computed: dict[int, list[int]] = {}  # per device: its compute tasks of the step
    self._reducing: dict[int, tuple[int, int]] = {}  # per device: (step, task) to reduce after

  def _add(self, task: Task) -> int:
    self.tasks.append(task)
    return len(self.tasks) - 1

  def compute(
    self,
    device: int,
    kind: str,
    step: int,
    batch: int,
    duration: float,
    deps: Sequence[int | None] = (),
  ) -> int:
    gathered = (self._gather(device, step), self._layer_gather(device, kind, step))
    self._flush_reduce(device)  # after this operation's gather on the device's network
    deps = tuple(d for d in (*deps, self.barrier, *gathered) if d is not None)
    index = self._add(Task(('device', device), kind, step, batch, duration, deps, sync=True))
    self.step_tasks.append(index)
    self._computed.setdefault(device, []).append(index)
    if self._layering() and kind == ('wgrad' if self.split else 'bwd'):
      self._reducing[device] = (step, index)
    return index

  def send(self, after: int, dst: int, kind: str, step: int, batch: int, nbytes: float) -> int:
    """A transfer of `after`'s output from the device that computed it to `dst`; a device
    sending to itself costs nothing."""
    src = self.tasks[after].resource[1]  # ('device', src)
    if src == dst:
      return after
    return self._add(
      Task(
        ('link', src, dst), kind, step, batch, self.costs.transfer_s(nbytes), (after,), sync=False
      )
    )

  def collective(
    self, device: int, kind: str, step: int, duration: float, deps: Sequence[int]
  ) -> int:
    index = self._add(Task(('net', device), kind, step, step, duration, tuple(deps), sync=True))
    self.step_tasks.append(index)
    return index

  def _layering(self) -> bool:
    return self.fsdp and self.data_replicas > 1

  def _gather(self, device: int, step: int) -> int | None:
    """FSDP in a stage schedule: device 0's embedding and head gathered over its R replicas,
    once a step, after the previous step's update (the schedule's shard_map takes them whole)."""
    if not self._layering() or device != 0:
      return None
    if device not in self._gathered:
      seconds = self.costs.collective_s(self.costs.embedding_bytes, self.data_replicas)
      deps = () if self.barrier is None else (self.barrier,)
      self._gathered[device] = self.collective(device, 'gather', step, seconds, deps)
    return self._gathered[device]

  def _chunk_s(self, device: int, reduce: bool = False) -> float:
    """One collective over R of the layers one operation of `device` runs: their gather, or
    (`reduce`) their gradients' reduce-scatter."""
    nbytes = self.costs.param_bytes[device] / self.chunks
    collective = self.costs.reduce_s if reduce else self.costs.collective_s
    return collective(nbytes, self.data_replicas)

  def _layer_gather(self, device: int, kind: str, step: int) -> int | None:
    """FSDP in a stage schedule (`layer_shards`): a forward or input-gradient operation gathers
    its layers' weights first, again each time (never kept). The device's network prefetches
    one operation ahead: the gather starts once the compute two back has ended."""
    if not self._layering() or kind not in ('fwd', 'bwd'):
      return None
    computed = self._computed.get(device, [])
    after = computed[-2] if len(computed) > 1 else self.barrier
    deps = () if after is None else (after,)
    return self.collective(device, 'gather', step, self._chunk_s(device), deps)

  def _flush_reduce(self, device: int) -> None:
    """... and the operation that ends a weight gradient (B, or a split schedule's W)
    reduce-scatters it over R once it has ended: on the network after the next operation's
    gather, which it does not hold up."""
    if device in self._reducing:
      step, after = self._reducing.pop(device)
      seconds = self._chunk_s(device, reduce=True)
      self.collective(device, 'reduce_scatter', step, seconds, [after])

  def end_step(self, step: int) -> None:
    """Each device's optimizer update (after the step's global-norm clip, i.e. after every sync
    task of the step), then: nobody starts step + 1 before every sync task has ended."""
    for device in sorted(self._reducing):
      self._flush_reduce(device)
    if self.data_replicas > 1:
      self._allreduce_stages(step)
    clipped = tuple(self.step_tasks)
    for device, seconds in enumerate(self.update_s):
      if seconds:
        updated = self.compute(device, 'update', step, step, seconds, clipped)
        self._gather_updated(device, step, updated)
    self.barrier = self._add(
      Task(None, 'barrier', step, step, 0.0, tuple(self.step_tasks), sync=False)
    )
    self.step_end[step], self.step_tasks = self.barrier, []
    self._gathered, self._computed = {}, {}

  def _gather_updated(self, device: int, step: int, updated: int) -> None:
    """--shard-update: each replica updated 1 / R of the device's weights; their new values,
    stored (`reduce_s`: at the stored width), are gathered over the R replicas once a step,
    before the next step starts."""
    if self.updated_bytes and self.update_replicas > 1:
      seconds = self.costs.reduce_s(self.updated_bytes[device], self.update_replicas)
      self.collective(device, 'gather', step, seconds, [updated])

  def _allreduce_stages(self, step: int) -> None:
    """A stage schedule on R data replicas: each device's gradient (its stage's parameters; device
    0's with the embedding) all-reduced over the R devices of its stage once the device's last
    compute of the step has ended, while the other devices compute on (`grad_sync_s`: the
    stage's reduce-scattered under --shard-update). FSDP: only device 0's embedding and head
    (its layers were reduce-scattered as each operation ended)."""
    last = {}
    for i in self.step_tasks:
      kind, *where = self.tasks[i].resource
      if kind == 'device':
        last[where[0]] = i
    for d, i in sorted(last.items()):
      stage = 0.0 if self._layering() else self.costs.param_bytes[d]
      embedding = self.costs.embedding_bytes if d == 0 else 0.0
      if stage or embedding:
        seconds = self.grad_sync_s(stage, embedding, self.data_replicas)
        self.collective(d, self.sync_kind(), step, seconds, [i])

  def sync_kind(self) -> str:
    """The kind of a gradient sync task (`grad_sync_s`)."""
    return 'reduce_scatter' if self.scatter_grads else 'allreduce'

  def grad_sync_s(self, stage_bytes: float, other_bytes: float, replicas: int) -> float:
    """One device's gradient sync over `replicas` of its layer groups' `stage_bytes` and the
    rest (`other_bytes`: embedding, head): an all-reduce (two reduce-scatter passes), or under
    --shard-update one pass, each leaf reduce-scattered onto the share its replica updates."""
    passes = 1 if self.scatter_grads else 2
    nbytes = stage_bytes + other_bytes
    return passes * self.costs.reduce_s(nbytes, replicas) if nbytes else 0.0

  def whole_sync_s(self, replicas: int) -> float:
    """data_parallel's gradient sync over its `replicas`: `allreduce_time`, or under
    --shard-update every gradient reduce-scattered: half of it."""
    if not self.scatter_grads:
      return self.costs.allreduce_time(replicas)
    if self.costs.allreduce_s is not None:
      return self.costs.allreduce_s / 2
    return self.grad_sync_s(self.costs.grad_bytes, 0.0, replicas)


def execute(tasks: Sequence[Task], slowdown: float = 1.0) -> list[tuple[float, float]]:
  """(start, end) of every task: as early as its dependencies and its resource allow.

  `slowdown` (`StageCosts.concurrent_slowdown`) > 1: a compute task runs that many times slower
  for as long as another device computes (`_execute_shared`); 1: every task takes its duration.

  This is the whole event loop. Every resource runs its tasks in a fixed order (a device's
  compiled program, a link's send order) and never pre-empts, so a task starts when both its
  dependencies and its resource's previous task have ended. Dependencies always point to tasks
  emitted earlier, so one pass in emission order settles every start time: the same answer as a
  time-ordered event queue, without the queue.
  """
  if slowdown != 1.0:
    return _execute_shared(tasks, slowdown)
  times: list[tuple[float, float]] = []
  free_at: dict[tuple, float] = {}
  for task in tasks:
    start = max((times[d][1] for d in task.deps), default=0.0)
    if task.resource is not None:
      start = max(start, free_at.get(task.resource, 0.0))
      free_at[task.resource] = start + task.duration
    times.append((start, start + task.duration))
  return times


def _execute_shared(tasks: Sequence[Task], slowdown: float) -> list[tuple[float, float]]:
  """`execute` where devices share something (a CPU's memory bus and caches): a compute task
  does `duration` seconds of work, at rate 1 while it is the only device computing and at rate
  1 / slowdown while another device computes too. Links, the network and barriers are not
  slowed. An event loop: each resource still runs its tasks in program order, a task starts when
  its dependencies have ended, and the rates change whenever a compute task starts or ends."""
  queues: dict[tuple, list[int]] = {}
  for index, task in enumerate(tasks):
    if task.resource is not None:
      queues.setdefault(task.resource, []).append(index)
  heads = {resource: 0 for resource in queues}  # position of each resource's next task
  barriers = [i for i, task in enumerate(tasks) if task.resource is None]
  start, end = [math.nan] * len(tasks), [math.nan] * len(tasks)
  running: dict[int, float] = {}  # task -> work left (seconds at rate 1)
  ended = lambda i: not math.isnan(end[i])
  now, left = 0.0, len(tasks)
  while left:
    changed = True
    while changed:  # start all that can start now (zero-length tasks end at once)
      changed = False
      for i in [b for b in barriers if not ended(b) and all(ended(d) for d in tasks[b].deps)]:
        start[i] = end[i] = max((end[d] for d in tasks[i].deps), default=0.0)
        left, changed = left - 1, True
      barriers = [b for b in barriers if not ended(b)]
      for resource, queue in queues.items():
        position = heads[resource]
        if position == len(queue) or queue[position] in running:
          continue
        i = queue[position]
        if all(ended(d) for d in tasks[i].deps):
          start[i] = now
          if tasks[i].duration > 0:
            running[i] = tasks[i].duration
          else:
            end[i], heads[resource], left = now, position + 1, left - 1
          changed = True
    if not running:
      if left:
        raise RuntimeError('the task graph deadlocks (a dependency never ends).')
      break
    computing = {tasks[i].resource[1] for i in running if tasks[i].resource[0] == 'device'}

    def rate(i):
      kind, *where = tasks[i].resource
      return 1.0 / slowdown if kind == 'device' and len(computing - {where[0]}) else 1.0

    rates = {i: rate(i) for i in running}
    step = min(work / rates[i] for i, work in running.items())
    now += step
    for i in list(running):
      running[i] -= step * rates[i]
      if running[i] <= 1e-12 * max(1.0, tasks[i].duration):
        del running[i]
        end[i], left = now, left - 1
        heads[tasks[i].resource] += 1
  return list(zip(start, end))
