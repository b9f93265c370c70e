"""A discrete-event performance model of every schedule: predicted step time, idle time, speedup.

    costs = cost_model.transformer_costs(cost_model.GPT2_SMALL, cost_model.NVLINK, num_stages=4)
    run = ScheduleConfig(name='ouroboros', num_stages=4, forward='pipelined').resolve('gpu', 32)
    result = simulate(run, costs)
    result.step_time, result.speedup, result.idle_fraction, result.timeline  # a Gantt chart's rows

The costs of a step's pieces (`StageCosts`) and the Transformer cost model: `cost_model.py`.
What is and is not modelled, and each schedule's step: docs/algorithm.md ("Step time"). Needs
only the standard library at import: it reads a `ResolvedSchedule` by its fields, and imports
schedules.config (and so JAX) only when it is called.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import TYPE_CHECKING, Callable, Sequence

from ouroboros_jax.choices import EXACT_PIPELINES, SCHEDULES
from ouroboros_jax.perf.cost_model import StageCosts, backprop_time, first_stage
from ouroboros_jax.perf.task_graph import Graph, Span, execute
from ouroboros_jax.schedules import tables
from ouroboros_jax.schedules.delays import backward_batch, forward_batch, lags

if TYPE_CHECKING:  # read by duck typing: schedules.config imports JAX, this module must not
  from ouroboros_jax.schedules.config import ResolvedSchedule

# The pipelines the simulator runs from their tables, as the library's executor does: GPipe and
# the exact pipelines (the head per micro-batch on the last stage's device).
TABLE_PIPELINES = ('gpipe', *EXACT_PIPELINES)


# ----------------------------------------------------------------------------- schedules
# Each emitter appends the tasks of one training step `t` to the graph, in every resource's
# program order, and returns nothing; `state` carries what a later step needs (in-flight hops).


def _backward_s(costs: StageCosts, s: int, stash: str, microbatches: int = 1) -> float:
  """Stage s's backward of one of `microbatches` micro-batches. Replay keeps only the stage's
  input, so its backward first re-runs the forward; a graph stash re-runs what its policy left
  out (`StageCosts.recompute`)."""
  if stash == 'replay':
    return costs.backward_of(s, microbatches) + costs.forward_of(s, microbatches)
  return costs.backward_of(s, microbatches) + costs.recompute_of(s, microbatches)


def _whole_model(g: Graph, t: int, device: int, parts: int) -> int:
  """Backprop of the whole model on one device, on 1 / `parts` of the batch (the layer groups at
  their measured micro-batch times where given); returns the last task."""
  c = g.costs
  x = g.compute(device, 'embed_fwd', t, t, c.embed_forward_s / parts)
  for s in range(c.num_stages):
    x = g.compute(device, 'fwd', t, t, c.forward_of(s, parts), [x])
  x = g.compute(device, 'head', t, t, c.head_s / parts, [x])
  for s in reversed(range(c.num_stages)):
    x = g.compute(device, 'bwd', t, t, c.backward_of(s, parts) + c.recompute_of(s, parts), [x])
  return g.compute(device, 'embed_bwd', t, t, c.embed_backward_s / parts, [x])


def emit_backprop(g: Graph, t: int, state: dict, **_) -> None:
  _whole_model(g, t, device=0, parts=1)
  g.end_step(t)


def emit_data_parallel(g: Graph, t: int, state: dict, *, replicas: int, **_) -> None:
  last = [_whole_model(g, t, device=d, parts=replicas) for d in range(replicas)]
  if replicas > 1:  # every replica needs every replica's gradient before its update
    for d in range(replicas):
      g.collective(d, g.sync_kind(), t, g.whole_sync_s(replicas), last)
  g.end_step(t)


def emit_fsdp(g: Graph, t: int, state: dict, *, replicas: int, **_) -> None:
  """FSDP (ZeRO-3) on D = `replicas` chips, each backprop on B / D rows with 1 / D of the
  parameters: every layer group's weights gathered before its forward and again before its
  backward, its gradient reduced and scattered after. The chips are alike, so each runs the
  same program; the update (of 1 / D of the parameters) ends the step."""
  for d in range(replicas):
    _fsdp_replica(g, t, d, replicas)
  g.end_step(t)


def _fsdp_replica(g: Graph, t: int, d: int, replicas: int) -> None:
  """One chip's FSDP step. Its network runs the collectives in program order beside its
  compute: a group's gather may start once the compute two before it has ended (one group
  prefetched, as XLA's scheduler overlaps it), its reduction as soon as its backward ends."""
  c, G, parts = g.costs, g.costs.num_stages, replicas
  seconds = {'gather': c.collective_s, 'reduce_scatter': c.reduce_s}
  net = lambda kind, nbytes, after: g.collective(
    d, kind, t, seconds[kind](nbytes, replicas), [a for a in after if a is not None]
  )
  gathered = net('gather', c.embedding_bytes, [g.barrier])  # the tied embedding and the head
  done = [g.compute(d, 'embed_fwd', t, t, c.embed_forward_s / parts, [gathered])]
  before = lambda: done[-2] if len(done) > 1 else g.barrier  # two computes back
  for s in range(G):
    weights = net('gather', c.param_bytes[s], [before()])
    done.append(g.compute(d, 'fwd', t, t, c.forward_of(s, parts), [done[-1], weights]))
  done.append(g.compute(d, 'head', t, t, c.head_s / parts, [done[-1]]))
  reduce = lambda s, after: net('reduce_scatter', c.param_bytes[s], [after])
  for s in reversed(range(G)):
    weights = net('gather', c.param_bytes[s], [before()])
    if s < G - 1:  # the group after's gradient, reduced while this group computes
      reduce(s + 1, done[-1])
    backward = c.backward_of(s, parts) + c.recompute_of(s, parts)
    done.append(g.compute(d, 'bwd', t, t, backward, [done[-1], weights]))
  done.append(g.compute(d, 'embed_bwd', t, t, c.embed_backward_s / parts, [done[-1]]))
  reduce(0, done[-2])
  net('reduce_scatter', c.embedding_bytes, [done[-1]])


def _locked_forward(g: Graph, t: int) -> int:
  """Batch t round the ring, one device computing per round: device s waits for s-1, and the
  last output goes back to device 0. Returns that arrival."""
  c, G = g.costs, g.costs.num_stages
  x = g.compute(0, 'embed_fwd', t, t, c.embed_forward_s)
  for s in range(G):
    x = g.compute(s, 'fwd', t, t, c.forward_s[s], [x])
    x = g.send(x, (s + 1) % G, 'act', t, t, c.activation_bytes)
  return x


def emit_model_parallel(g: Graph, t: int, state: dict, **_) -> None:
  c, G = g.costs, g.costs.num_stages
  nbytes = c.activation_bytes
  x = g.compute(0, 'head', t, t, c.head_s, [_locked_forward(g, t)])
  # Locked backward: the head's delta goes to G-1, then each device hands dx to s-1.
  delta = g.send(x, G - 1, 'grad', t, t, nbytes)
  for s in reversed(range(G)):
    y = g.compute(s, 'bwd', t, t, c.backward_s[s] + c.recompute_of(s), [delta])
    delta = g.send(y, s - 1, 'grad', t, t, nbytes) if s > 0 else y
  g.compute(0, 'embed_bwd', t, t, c.embed_backward_s, [delta])
  g.end_step(t)


def emit_table(g: Graph, t: int, state: dict, *, table, lockstep: bool = False, **_) -> None:
  """An exact pipeline from its table (`schedules.tables`), tick by tick: the operation each
  device runs, after the value it reads has arrived. F of a chunk costs the stage's forward of
  one micro-batch (`StageCosts.forward_of`) / v; a split schedule's (ZB) B its backward's
  `input_grad_share` and W the rest, a fused schedule's B all of it (one VJP; its W ticks compute
  nothing). The
  embedding runs before the first chunk's F and after its B; the head after the last chunk's F,
  on the same device.

  `lockstep` (`simulate`'s): as the library's executor runs a table, every tick ends with one
  `ppermute` per channel the table uses (idle ticks too), so a device starts tick k + 1 once its
  own tick k, what it sent and what it received at the end of tick k are done; a value read at a
  later tick has already arrived. Without it a device waits only for the values it reads."""
  del state
  c, pipeline = g.costs, table.pipeline
  m, last = pipeline.microbatches, pipeline.last_stage
  nbytes = c.activation_bytes / m
  cost = _table_op_costs(c, pipeline)
  p = len(table.grid)
  channels = [o for o in _channels(table) if o] if lockstep else []
  after_tick = [[] for _ in range(p)]  # lockstep: what device d's next tick waits for
  done = {}  # (kind, micro-batch, virtual stage) -> the task that produced it
  for tick in range(len(table.grid[0])):
    ends = []  # per device: its last task of this tick
    for d, row in enumerate(table.grid):
      op, deps = row[tick], list(after_tick[d])
      if op is None:
        ends.append(g.compute(d, 'idle', t, -1, 0.0, deps) if lockstep else None)
        continue
      k, needed = pipeline.stage_of(d, op.chunk), tables.needs(pipeline, op, d)
      if needed is not None and not lockstep:
        kind = 'act' if op.kind == 'F' else 'grad'
        deps.append(g.send(done[needed], d, kind, t, op.microbatch, nbytes))
      if op.kind == 'F' and k == 0:
        deps.append(g.compute(d, 'embed_fwd', t, op.microbatch, c.embed_forward_s / m, deps))
      task = g.compute(
        d, {'F': 'fwd', 'B': 'bwd', 'W': 'wgrad'}[op.kind], t, op.microbatch, cost[op.kind](d), deps
      )
      if op.kind == 'F' and k == last:
        task = g.compute(d, 'head', t, op.microbatch, c.head_s / m, [task])
      done[(op.kind, op.microbatch, k)] = task
      if op.kind == 'B' and k == 0:
        task = g.compute(d, 'embed_bwd', t, op.microbatch, c.embed_backward_s / m, [task])
      ends.append(task)
    if lockstep:
      after_tick = _tick_hops(g, t, tick, ends, channels, nbytes)
  if lockstep:  # the last tick's ppermute ends inside the step
    for d in range(p):
      g.compute(d, 'idle', t, -1, 0.0, after_tick[d])
  g.end_step(t)


def _table_op_costs(c: StageCosts, pipeline) -> dict[str, Callable[[int], float]]:
  """Device d's seconds for one table operation (F, B or W) of one micro-batch's chunk."""
  m, v, fused = pipeline.microbatches, pipeline.chunks, pipeline.fused
  extra = c.microbatch_overhead_s
  b_share = 1.0 if fused else c.input_grad_share
  return {
    'F': lambda d: c.forward_of(d, m) / v + extra,
    # B re-runs what the stash policy left out (the zero-bubble split's W does not)
    'B': lambda d: (c.backward_of(d, m) * b_share + c.recompute_of(d, m)) / v + extra,
    'W': lambda d: 0.0 if fused else c.backward_of(d, m) * (1 - b_share) / v + extra,
  }


def _tick_hops(
  g: Graph, t: int, tick: int, ends: list, channels: Sequence[int], nbytes: float
) -> list[list[int]]:
  """Lockstep: the tick's ppermutes, device d sending to d + o on every channel o after `ends[d]`
  (its last task of the tick); returns what each device's next tick waits for."""
  p = len(ends)
  after_tick = [[end] for end in ends]
  for d in range(p):
    for o in channels:
      hop = g.send(ends[d], (d + o) % p, 'tick', t, tick, nbytes)
      after_tick[d].append(hop)
      after_tick[(d + o) % p].append(hop)
  return after_tick


def _channels(table) -> tuple[int, ...]:
  """The offsets o of the table's sends (device d to d + o mod p), as `tables.program`."""
  return tables.program(table).channels


def emit_ouroboros_locked(
  g: Graph, t: int, state: dict, *, stash: str, microbatches: int, lenders=None, **_
):
  c, G, M = g.costs, g.costs.num_stages, microbatches
  nbytes, extra = c.activation_bytes / M, (c.microbatch_overhead_s if M > 1 else 0.0)
  # 1. Forward, locked, as a wave of micro-batches: device s forwards micro-batch m once s-1
  #    has sent it (M = 1: batch t round the ring, one device computing per round).
  # 2. Head on device 0, micro-batch by micro-batch as they come back: fresh loss and
  #    delta_{G-1}^t, which reaches G-1 for step t+1.
  arrivals = []

  def head(m):  # in the round micro-batch m arrives, after device 0's forward of that round
    task = g.compute(0, 'head', t, t, c.head_s / M + extra, [arrivals[m]])
    state[('delta', t, G - 1, m)] = g.send(task, G - 1, 'grad', t, t, nbytes)

  for m in range(M):
    x = g.compute(0, 'embed_fwd', t, t, c.embed_forward_s / M)
    for s in range(G):
      x = g.compute(s, 'fwd', t, t, c.forward_of(s, M) + extra, [x])
      _lend(g, t, t, {}, s, x, lenders or {})  # a balanced stash's item to the mirror
      x = g.send(x, (s + 1) % G, 'act', t, t, nbytes)
    arrivals.append(x)
    if m >= G - 1:
      head(m - G + 1)
  for m in range(max(M - G + 1, 0), M):
    head(m)
  forward_done = arrivals[-1]  # every device takes part in every round's hand-off
  # 3. Backward on every device at once: stage s finishes batch t - (G - s) with the error
  #    gradient received during step t-1 (one hop per step, overlapping with this step).
  for s in range(G):
    batch = backward_batch(t, s, G, 'locked')
    if batch < 0:  # the pipe has not filled yet
      continue
    for m in range(M):
      delta = state.pop(('delta', t - 1, s, m))
      back = _lend(g, t, batch, state, s, None, lenders or {})  # its item back from the mirror
      deps = [forward_done, delta, *back]
      y = g.compute(s, 'bwd', t, batch, _backward_s(c, s, stash, M) + extra, deps)
      state[('last', s)] = y
      if s > 0:
        state[('delta', t, s - 1, m)] = g.send(y, s - 1, 'grad', t, batch, nbytes)
      else:
        g.compute(0, 'embed_bwd', t, batch, c.embed_backward_s / M, [y])
  g.end_step(t)


def emit_ouroboros_pipelined(
  g: Graph, t: int, state: dict, *, stash: str, microbatches: int, lenders=None, **_
) -> None:
  """Device s forwards batch t - s (its input arrived during step t-1) and back-propagates batch
  t - 2G + s (its error gradient arrived during step t-1); the head sees batch t - G. With M
  micro-batches every device does this for micro-batch 0, 1, ..., M - 1 in turn."""
  c, G, M = g.costs, g.costs.num_stages, microbatches
  nbytes, extra = c.activation_bytes / M, (c.microbatch_overhead_s if M > 1 else 0.0)
  for m in range(M):
    for s in range(G):
      # Forward of batch t - s on what s-1 sent during step t-1 (device 0 embeds a fresh batch).
      batch, y = forward_batch(t, s, G, 'pipelined'), None
      if batch >= 0:
        x = (
          g.compute(0, 'embed_fwd', t, batch, c.embed_forward_s / M)
          if s == 0
          else state.pop(('act', t - 1, s - 1, m))
        )
        y = g.compute(s, 'fwd', t, batch, c.forward_of(s, M) + extra, [x])
        state[('act', t, s, m)] = g.send(y, (s + 1) % G, 'act', t, batch, nbytes)
      head_batch = t - lags(G, 'pipelined')[0]
      if s == 0 and head_batch >= 0:
        # Head of batch t - G, whose last-stage output arrived during step t-1.
        arrived = state.pop(('act', t - 1, G - 1, m))
        head = g.compute(0, 'head', t, head_batch, c.head_s / M + extra, [arrived])
        state[('delta', t, G - 1, m)] = g.send(head, G - 1, 'grad', t, head_batch, nbytes)
      # Backward of batch t - 2G + s with the error gradient s+1 (or the head) sent at step t-1.
      batch = backward_batch(t, s, G, 'pipelined')
      lent = _lend(g, t, batch, state, s, y, lenders or {})  # a balanced stash's
      if batch >= 0:
        delta = state.pop(('delta', t - 1, s, m))
        y = g.compute(s, 'bwd', t, batch, _backward_s(c, s, stash, M) + extra, [delta, *lent])
        state[('last', s)] = y
        if s > 0:
          state[('delta', t, s - 1, m)] = g.send(y, s - 1, 'grad', t, batch, nbytes)
        else:
          g.compute(0, 'embed_bwd', t, batch, c.embed_backward_s / M, [y])
  g.end_step(t)


def emit_ring_one_device(g: Graph, t: int, state: dict, *, stash: str, microbatches: int, **_):
  """Ouroboros on one device (G = 1, no delay) cutting the batch into M micro-batches: each
  micro-batch's forward, head and backward in turn, the gradients summed, then the update."""
  del state
  c, M = g.costs, microbatches
  extra = c.microbatch_overhead_s
  for _m in range(M):
    x = g.compute(0, 'embed_fwd', t, t, c.embed_forward_s / M)
    x = g.compute(0, 'fwd', t, t, c.forward_of(0, M) + extra, [x])
    x = g.compute(0, 'head', t, t, c.head_s / M + extra, [x])
    x = g.compute(0, 'bwd', t, t, _backward_s(c, 0, stash, M) + extra, [x])
    g.compute(0, 'embed_bwd', t, t, c.embed_backward_s / M, [x])
  g.end_step(t)


# ----------------------------------------------------------------------------- simulate


@dataclasses.dataclass
class SimResult:
  schedule: str
  num_devices: int
  step_time: float  # steady-state seconds per training step (one batch per step)
  idle_fraction: float  # mean over devices of 1 - busy / step_time
  per_device_busy: list[float]  # compute seconds per step, per device
  timeline: list[Span]  # every task of every simulated step, for a Gantt chart
  backprop_time: float  # the one-device reference step
  step_ends: list[float]  # when each simulated step's barrier fell

  @property
  def speedup(self) -> float:
    """Throughput relative to backprop on one device (same batch per step)."""
    return self.backprop_time / self.step_time

  @property
  def per_device_idle(self) -> list[float]:
    return [1.0 - busy / self.step_time for busy in self.per_device_busy]


def simulate(
  run: ResolvedSchedule | str,
  costs: StageCosts,
  steps: int | None = None,
  *,
  lockstep: bool = False,
) -> SimResult:
  """Run the schedule `run` (a `ResolvedSchedule`, or a schedule's name with ScheduleConfig's
  defaults) on `costs` for `steps` steps (default 3G + 10; 13 for a whole-model step) and
  measure its steady state.

  G is costs.num_stages (a config's num_stages, where it is not 1, must equal it). The config
  gives the name, M (its micro-batches), the replica count R (data_parallel's devices; a stage
  schedule's data replicas: `costs` are then one replica's, on its B / R rows, and each device's
  gradient is all-reduced over the R replicas after its last compute of the step), Ouroboros'
  `stash` and `forward` (the other schedules keep no stash and ignore them) and the interleaved
  pipeline's `chunks`; what else it says (the flow, the compensation) does not change the step's
  tasks.
  The exact pipelines of `schedules.tables` ('1f1b', 'interleaved', 'zb_h1', 'zb_v') run from the
  same tables the executor runs, with M micro-batches. `lockstep` runs them tick by tick as the
  library's executor does (every tick ends with a `ppermute`; see `emit_table`); False: each
  operation waits only for its input (the tables' idealised timing, whose bubble has a closed
  form).
  """
  run = _config(run)
  G = costs.num_stages
  devices = {'backprop': 1, 'data_parallel': run.data_parallel}.get(run.name, G)
  # The pipelined forward fills in 2G steps; a whole-model step (backprop, data_parallel, FSDP)
  # ends at its barrier, so its second step is already the steady state.
  fill = 1 if run.name in ('backprop', 'data_parallel') else max(G, devices)
  warmup = 2 * fill + 2
  steps = steps if steps is not None else 3 * fill + 10
  if steps < warmup + 3:
    raise ValueError(f'steps={steps} leaves no steady state; use at least {warmup + 3}.')
  graph = task_graph(run, costs, steps, lockstep=lockstep)
  times = execute(graph.tasks, costs.concurrent_slowdown)
  return _steady_state(run.name, graph, times, warmup, devices)


def program_scale(run: ResolvedSchedule, costs: StageCosts, one_device_step_s: float) -> float:
  """How many times longer a setting's compute takes inside its own step program than its
  pieces timed alone: its step measured on one device (`run` with one stage, over stage 0's
  layer group; `calibration.one_device_probe`) over this simulator's step of the same from stage 0's
  pieces (`first_stage`). On a CPU GPipe and 1F1B at M = 4 cost 1.07-1.26x their pieces inside their
  programs (docs/results/simulator_calibration.md); `cost_model.scaled` charges that."""
  one = dataclasses.replace(_config(run), num_stages=1)
  return one_device_step_s / simulate(one, first_stage(costs), lockstep=True).step_time


def _config(run: ResolvedSchedule | str) -> ResolvedSchedule:
  """`run` (resolved: `ScheduleConfig.resolve`), or a schedule's name with ScheduleConfig's
  defaults resolved (on 'cpu': Ouroboros takes the batch whole; imported here: it imports JAX)."""
  from ouroboros_jax.schedules.config import ScheduleConfig, require_resolved

  if isinstance(run, str):
    if run not in SCHEDULES:
      raise ValueError(f'unknown schedule {run!r}; choose one of {", ".join(SCHEDULES)}.')
    return ScheduleConfig(name=run).resolve('cpu')
  return require_resolved(run, 'simulate')


def task_graph(
  run: ResolvedSchedule | str, costs: StageCosts, steps: int, *, lockstep: bool = False
) -> Graph:
  """The tasks of `steps` training steps of `run` on `costs`, in emission order."""
  run = _config(run)
  G = costs.num_stages
  emit, table = _emitter(run, costs)
  devices = {'backprop': 1, 'data_parallel': run.data_parallel}.get(run.name, G)
  graph, state = Graph(costs), {}
  if run.name not in ('backprop', 'data_parallel'):
    graph.data_replicas, graph.fsdp = run.data_parallel, run.fsdp
  if table is not None:  # an operation runs one chunk's layers; a split one's W ends its grad
    graph.chunks, graph.split = table.pipeline.chunks, not table.pipeline.fused
  if costs.update_s:
    _updates(graph, run, costs, devices)
  options = dict(
    microbatches=run.microbatches,
    replicas=run.data_parallel,
    stash=run.stash,
    lenders=_lenders(run, G),
    table=table,
    lockstep=lockstep,
  )
  for t in range(steps):
    emit(graph, t, state, **options)
  return graph


def _updates(graph: Graph, run: ResolvedSchedule, costs: StageCosts, devices: int) -> None:
  """Each device's optimizer update: one device updates every parameter, a stage device its
  own stage's; --fsdp and --shard-update split it over the D replicas, and --shard-update
  reduce-scatters the gradients onto those shares (`Graph.grad_sync_s`), then gathers the
  updated weights over them (the graph's updated_bytes)."""
  whole = run.name in ('backprop', 'data_parallel') or costs.num_stages == 1
  share = run.data_parallel if run.fsdp or run.shard_update else 1
  if whole:
    graph.update_s = [sum(costs.update_s) / share] * devices
  else:
    graph.update_s = [seconds / share for seconds in costs.update_s]
  if not run.shard_update:
    return
  if not whole and not costs.param_bytes:
    raise ValueError("--shard-update gathers each stage's weights: give the costs' param_bytes.")
  graph.update_replicas, graph.scatter_grads = run.data_parallel, True
  stage = lambda d: costs.param_bytes[d] + (costs.embedding_bytes if d == 0 else 0.0)
  graph.updated_bytes = [costs.grad_bytes if whole else stage(d) for d in range(devices)]


def _lenders(run: ResolvedSchedule, G: int) -> dict[int, int]:
  """Ouroboros' balanced stash: each deep group s -> the mirror that holds its lent slots
  (`stash_layout.SlotLayout.lenders`); {} for every other setting."""
  if run.name != 'ouroboros' or run.stash_memory != 'balanced' or G == 1:
    return {}
  from ouroboros_jax.schedules import stash_layout
  from ouroboros_jax.schedules.delays import Timing

  timing = Timing(G, run.forward, run.microbatches, run.flow)
  return dict(stash_layout.layout(timing, 'balanced').lenders)


def _lend(g: Graph, t: int, batch: int, state: dict, s: int, forwarded: int, lenders) -> list:
  """A balanced stash's transfers in a round of device s: the item it forwarded goes to its
  mirror, and the item its backward needs comes back from the mirror, read there before the
  round (after the mirror's last task). Returns what s's backward waits for."""
  if s not in lenders or not g.costs.stash_item_bytes:
    return []
  mirror, nbytes = lenders[s], g.costs.stash_item_bytes
  if forwarded is not None:
    g.send(forwarded, mirror, 'lend', t, batch, nbytes)
  last = state.get(('last', mirror))
  return [] if last is None else [g.send(last, s, 'lend', t, batch, nbytes)]


def _emitter(
  run: ResolvedSchedule, costs: StageCosts
) -> tuple[Callable[..., None], tables.Table | None]:
  """The function that emits one step of `run` (checked), and an exact pipeline's table."""
  G = costs.num_stages
  _check(run, costs)
  if run.name in TABLE_PIPELINES:
    return emit_table, tables.place(tables.build(run.name, G, run.microbatches, run.chunks))
  if run.name == 'ouroboros':  # G = 1 has no delay: Ouroboros is backprop there
    if G == 1:
      return (emit_backprop if run.microbatches == 1 else emit_ring_one_device), None
    return (emit_ouroboros_locked if run.forward == 'locked' else emit_ouroboros_pipelined), None
  if run.fsdp and run.name == 'data_parallel':
    if not costs.param_bytes:
      raise ValueError("FSDP gathers each group's weights: give the costs' param_bytes.")
    return emit_fsdp, None
  emit = {
    'backprop': emit_backprop,
    'data_parallel': emit_data_parallel,
    'model_parallel': emit_model_parallel,
  }[run.name]
  return emit, None


def _steady_state(
  schedule: str, graph: Graph, times: list[tuple[float, float]], warmup: int, devices: int
) -> SimResult:
  """The result of the simulated steps: step time, busy and idle time over the steps after
  `warmup`, and the timeline of every step."""
  steps = len(graph.step_end)
  step_ends = [times[graph.step_end[t]][1] for t in range(steps)]
  window = range(warmup, steps)
  step_time = statistics.median(step_ends[t] - step_ends[t - 1] for t in window)
  busy = [0.0] * devices
  timeline = []
  for task, (start, end) in zip(graph.tasks, times):
    if task.resource is None:
      continue
    kind, *where = task.resource
    if kind == 'device' and task.step in window:
      busy[where[0]] += task.duration / len(window)
    lane = (
      where[0]
      if kind == 'device'
      else f'{where[0]}->{where[-1]}'
      if kind == 'link'
      else (f'net{where[0]}')
    )
    timeline.append(Span(lane, task.kind, task.batch, start, end))
  idle = [1.0 - b / step_time for b in busy] if step_time > 0 else [0.0] * devices
  return SimResult(
    schedule,
    devices,
    step_time,
    sum(idle) / devices,
    busy,
    timeline,
    backprop_time(graph.costs),
    step_ends,
  )


def _check(run: ResolvedSchedule, costs: StageCosts) -> None:
  """What the simulator cannot model of a setting `resolve` has checked."""
  schedule, microbatches, data_parallel = run.name, run.microbatches, run.data_parallel
  if run.num_stages not in (1, costs.num_stages):
    raise ValueError(
      f'num_stages={run.num_stages} but the costs have {costs.num_stages} stages; give the '
      'costs of one layer group per stage.'
    )
  if data_parallel > 1 and schedule not in ('backprop', 'data_parallel') and not costs.param_bytes:
    raise ValueError(
      f"{schedule} on {data_parallel} data replicas all-reduces each stage's gradient: give the "
      "costs' param_bytes (one replica's costs, its B / R rows)."
    )
  batch = costs.batch_size
  for name, parts, applies in (
    ('data_parallel', data_parallel, schedule == 'data_parallel'),
    ('microbatches', microbatches, schedule in ('ouroboros', *TABLE_PIPELINES)),
  ):
    if applies and batch is not None and batch % parts:
      raise ValueError(f'batch {batch} cannot be cut into {name}={parts} equal parts.')
