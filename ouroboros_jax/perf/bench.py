"""`ouroboros bench`: steady-state speed of every schedule, next to its ideal.

For each setting (backprop on one device; data_parallel; model_parallel; gpipe with M in
{2, 4, 8}; 1F1B and ZB-H1 with M in {4, 8}; interleaved 1F1B and ZB-V with M = 8 when the model
has 2G layers for their 2G chunks; ouroboros locked and pipelined, graph and replay stashes) it
compiles the step (timed
separately, not counted), runs `warmup` steps, then times `steps` more one by one and reports the
**median** step time and tokens/s. With `rounds` R > 1 (`--rounds`) every setting is compiled and
warmed up first and the timed steps are dealt out in R rounds, setting after setting, so that a
machine whose speed drifts over minutes slows every setting alike; the pieces below, the
concurrent slowdown, the collective's wait and the one-device programs included, are then timed
again at the start of each round and their medians over the rounds used. It also measures, on process 0's device while every other
process waits, each layer group's forward and backward (on the whole batch, and on one
micro-batch of B / M rows for every M the settings use: a micro-batch rarely costs 1 / M of the
batch), the head and each device's optimizer update; then one activation hop and one gradient
all-reduce between devices, and how much slower a group's forward + backward runs while every
process computes at once (`measure_concurrent_slowdown`), and each stage setting's own step
program on one device over the first layer group (`time_one_device`: what one device's work
costs inside its program, which its pieces timed alone miss, and how much slower that program
runs beside copies of itself on the other processes), and what one collective inside a
step adds to a tick of compute beyond its data, the wait for the last process to reach it
(`measure_collective_wait`, column link_latency_s). From those the discrete-event
simulator (`simulate.py`) gives each schedule's **ideal** step time (free links, no overheads,
devices that do not slow each other) and its **predicted** one (measured links, the measured
slowdown of devices computing at once, the table pipelines run tick by tick, the pieces scaled to
the one-device program, `simulate.program_scale`, every hop paying the collective's wait).
Outputs, in --out:

  bench.csv       one row per setting (the columns `experiments/simulate.py --measured` reads,
                  fwd_s_per_stage_micro / bwd_s_per_stage_micro, concurrent_slowdown,
                  one_device_s and program_scale included, plus tokens_per_s, compile_s,
                  ideal_s, predicted_s, and host_load:
                  the 1-minute load average after the setting, which above the process count
                  says something else shared the cores and the row is not to be trusted)
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
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ouroboros_jax import costs, placement
from ouroboros_jax.choices import (
  DEFAULT_STASH_POLICY,
  FORWARD_MODES,
  MICROBATCHED,
  SPLIT_BACKWARD,
  STASH_MODES,
)
from ouroboros_jax.errors import ConfigError
from ouroboros_jax.models import model as transformer
from ouroboros_jax.models import partition
from ouroboros_jax.optimizers import LIBRARY_DIMS, make_optimizer
from ouroboros_jax.perf import simulate
from ouroboros_jax.runtime import host
from ouroboros_jax.schedules import ScheduleConfig, build_schedule
from ouroboros_jax.schedules.compensation import Compensation
from ouroboros_jax.schedules.config import AUTO
from ouroboros_jax.schedules.stash import GraphStash, TappedStash
from ouroboros_jax.update import GroupedOptimizer


@dataclasses.dataclass(frozen=True)
class BenchConfig:
  """What `run` benchmarks (the `bench` flags): batches of `batch_size` rows, G = `stages`,
  `steps` timed steps per setting after `warmup` untimed ones, each setting a ScheduleConfig
  (`default_settings`, with `stash_policy` on every setting and `compensation` on its Ouroboros
  settings; a setting's `label` names it). `stash_policy`, `optimizer` and `compensation` time a training
  recipe's own costs: Muon's orthogonalisation, weight prediction's extra pass over the weights."""

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
  settings: Sequence[ScheduleConfig] | None = None  # None: default_settings
  layers_per_stage: Sequence[int] | None = None  # None: balanced by FLOPs
  stash_policy: str = AUTO  # every setting's ('auto': each schedule's own), replay's none
  optimizer: str = 'adamw'
  compensation: Compensation = Compensation()


@dataclasses.dataclass(frozen=True)
class Workload:
  """What every setting runs: the model, its (whole, host) parameters, one batch, and the
  G-stage split the pieces are measured on."""

  cfg: transformer.ModelConfig
  params: dict
  batch: dict
  layers_per_stage: tuple[int, ...]


def default_settings(
  devices: int,
  num_layers: int | None = None,
  stash_policy: str = AUTO,
  compensation: Compensation = Compensation(),
) -> list[ScheduleConfig]:
  """Every setting on `devices` devices, each a ScheduleConfig with every `auto` explicit (its
  own micro-batches and flow; `compensation`, by default none: the paper's method, on the
  Ouroboros settings and none elsewhere; `stash_policy` on every setting but the replay stash,
  by default each schedule's own, `ScheduleConfig.resolved_stash_policy`); the two-chunk
  pipelines (interleaved, ZB-V) only when the model has `num_layers` >= 2 x devices layers to
  cut into their chunks."""
  g, none = devices, Compensation()
  policy = lambda name: ScheduleConfig(name=name, stash_policy=stash_policy).resolved_stash_policy
  stage = lambda name, **fields: ScheduleConfig(
    name=name, num_stages=g, compensation=none, stash_policy=policy(name), **fields
  )

  def ring(microbatches: int, stash: str, forward: str, flow: str = 'batch') -> ScheduleConfig:
    return ScheduleConfig(
      name='ouroboros',
      num_stages=g,
      microbatches=microbatches,
      stash=stash,
      stash_policy=policy('ouroboros') if stash == 'graph' else AUTO,
      forward=forward,
      flow=flow,
      compensation=compensation,
    )

  out = [
    ScheduleConfig(name='backprop', compensation=none, stash_policy=policy('backprop')),
    ScheduleConfig(
      name='data_parallel', data_parallel=g, compensation=none, stash_policy=policy('backprop')
    ),
    stage('model_parallel'),
  ]
  out += [stage('gpipe', microbatches=m) for m in (2, 4, 8)]
  out += [stage(name, microbatches=m) for name in ('1f1b', 'zb_h1') for m in (4, 8)]
  if num_layers is None or num_layers >= 2 * g:
    out += [stage(name, microbatches=8) for name in ('interleaved', 'zb_v')]
  out += [ring(1, s, f) for f in FORWARD_MODES for s in STASH_MODES]
  out += [ring(8, 'graph', f) for f in FORWARD_MODES]
  # Streamed micro-batches at the smallest M that makes every gap one update (G locked, 2G
  # pipelined)
  out += [ring(g * (1 + (f == 'pipelined')), 'graph', f, flow='stream') for f in FORWARD_MODES]
  return out


def num_devices(setting: ScheduleConfig) -> int:
  """The devices a setting runs on: G for a stage schedule, D for data_parallel, 1 for backprop
  (G x R on a stage x data mesh)."""
  return setting.num_stages * setting.data_parallel


def select_settings(
  devices: int,
  only: str | None,
  num_layers: int | None = None,
  batch_size: int | None = None,
  stash_policy: str = AUTO,
  compensation: Compensation = Compensation(),
) -> list[ScheduleConfig]:
  """The default settings whose label starts with one of the comma-separated prefixes in `only`,
  in the order `only` names them; a prefix that matches none is a ConfigError. With
  `batch_size`, an Ouroboros setting whose micro-batches do not divide a replica's batch cuts it
  as `train` would, into the largest count that divides both (`resolved_for_batch`); another
  setting that cannot cut the batch is a ConfigError before anything is measured (without
  `only`, such settings are left out)."""
  settings = default_settings(devices, num_layers, stash_policy, compensation)
  fits = lambda s: batch_size is None or batch_size % micro_size(s) == 0
  resolved = lambda chosen: list(
    dict.fromkeys(s if batch_size is None else resolved_for_batch(s, batch_size) for s in chosen)
  )
  if only is None:
    return [s for s in resolved(settings) if fits(s)]
  labels = ', '.join(s.label for s in settings)
  prefixes = [p.strip() for p in only.split(',') if p.strip()]
  if not prefixes:
    raise ConfigError(
      f'--only {only!r} names no setting; give comma-separated label prefixes from: {labels} '
      '(or drop --only to run them all).'
    )
  unknown = [p for p in prefixes if not any(s.label.startswith(p) for s in settings)]
  if unknown:
    names = ', '.join(map(repr, unknown))
    raise ConfigError(f'--only {names} matches no setting; labels are: {labels}.')
  # In the order --only names them: a run cut short has measured the settings named first.
  chosen = resolved(s for p in prefixes for s in settings if s.label.startswith(p))
  unfit = [s.label for s in chosen if not fits(s)]
  if unfit:
    raise ConfigError(
      f'--batch-size {batch_size} cannot be cut into the micro-batches (or replicas) of '
      f'{", ".join(unfit)}; use a --batch-size that they divide, or leave them out of --only.'
    )
  return chosen


def resolved_for_batch(setting: ScheduleConfig, batch_size: int) -> ScheduleConfig:
  """An Ouroboros setting whose M does not divide a replica's rows cut into gcd(M, rows)
  micro-batches, as `train` resolves Ouroboros' micro-batches from its batch
  (`ScheduleConfig.for_platform`); any other setting as it is (an exact pipeline's M is what it
  is measured at)."""
  rows = max(batch_size // setting.data_parallel, 1)
  if setting.name != 'ouroboros' or rows % setting.num_microbatches == 0:
    return setting
  return dataclasses.replace(setting, microbatches=math.gcd(setting.num_microbatches, rows))


def _median_time(fn, *args, repeats: int, warm: bool = True) -> float:
  if warm:
    jax.block_until_ready(fn(*args))  # compile / warm
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def bench_optimizer(name: str = 'adamw'):
  """The optimizer every setting is timed with (its rate does not change the time)."""
  return make_optimizer(
    name, 1e-4, weight_decay=0.1, muon_learning_rate=1e-3, muon_dims=LIBRARY_DIMS
  )


def time_group(stash, params, s, key, x, repeats, sizes=(), micro_repeats=3):
  """((forward, backward) seconds of group s on x, {str(M): the same on its first B / M rows})."""
  params_s = jax.tree.map(lambda a: a[s], params['stages'])
  forward = jax.jit(lambda p, h: stash.forward(p, h, s, key))
  backward = jax.jit(lambda p, k, d: stash.backward(p, k, d, s, key))

  def time_on(h, times):
    f = _median_time(lambda p, h: forward(p, h)[0], params_s, h, repeats=times)
    y, kept, _ = forward(params_s, h)
    return f, _median_time(backward, params_s, kept, jnp.ones_like(y), repeats=times)

  rows = x.shape[0]
  return time_on(x, repeats), {str(m): time_on(x[: rows // m], micro_repeats) for m in sizes}


def input_grad_share(split, params_s, s, key, x, sizes, repeats=3) -> dict[str, float]:
  """{str(M): B / (B + W)} of group s's split backward (`TappedStash`: B the input gradient
  through the taps, W the weight gradient from them) on the first B / M rows of x, for each M in
  `sizes`: how a zero-bubble table divides a backward between its B and W ticks
  (`simulate.StageCosts.input_grad_share`)."""
  stash = TappedStash(split)
  forward = jax.jit(lambda p, h: stash.forward(p, h, s, key))
  b = jax.jit(lambda p, kept, d: stash.input_grad(p, kept, d, s, key))
  w = jax.jit(stash.weight_grad)
  shares = {}
  for m in sizes:
    y, kept, _ = forward(params_s, x[: x.shape[0] // m])
    delta = jnp.ones_like(y)
    for_w = b(params_s, kept, delta)[1]
    b_s = _median_time(b, params_s, kept, delta, repeats=repeats)
    w_s = _median_time(w, params_s, kept, for_w, repeats=repeats)
    shares[str(m)] = b_s / (b_s + w_s)
  return shares


def measure_pieces(
  work: Workload,
  repeats: int = 10,
  stash_policy: str = DEFAULT_STASH_POLICY,
  optimizer: str = 'adamw',
  microbatches: Sequence[int] = (),
  micro_repeats: int = 3,
  split_microbatches: Sequence[int] = (),
) -> dict:
  """Seconds of each piece alone on this process's first device: per-group forward and backward
  (from a kept graph), and device 0's extra work (embedding and head, forward + backward).

  For every M in `microbatches` (M >= 2 dividing the batch) it also times each group's forward
  and backward on B / M rows (`micro_repeats` times each), under 'fwd_micro' / 'bwd_micro'
  keyed by str(M): what a micro-batch costs, which on a CPU (and a GPU at small micro-batches)
  is more than 1 / M of the whole batch's time.

  For every M in `split_microbatches` (the zero-bubble settings' micro-batches) it also times
  group 0's split backward, B and W apart, under 'input_grad_share' keyed by str(M)
  (`input_grad_share`; the model's layers all have the same split)."""
  layers_per_stage = work.layers_per_stage
  model = partition.transformer_stages(work.cfg, layers_per_stage)
  params = partition.to_staged(work.params, layers_per_stage)
  device = jax.local_devices()[0]
  params, batch = jax.device_put((params, work.batch), device)
  stash = GraphStash(model, stash_policy)
  key = jax.random.key(0)
  x = jax.jit(model.embed)(params['embed'], batch['inputs'], None)
  rows = x.shape[0]
  sizes = sorted({int(m) for m in microbatches if 1 < m <= rows and rows % m == 0})
  fwd, bwd = [], []
  fwd_micro, bwd_micro = {str(m): [] for m in sizes}, {str(m): [] for m in sizes}
  # Groups of the same layer count run the same program on the same shapes: each is compiled
  # and timed once (compiling every group apart cost minutes at G = 8 on one CPU core).
  timed = {}
  for s, layers in enumerate(layers_per_stage):
    if layers not in timed:
      timed[layers] = time_group(stash, params, s, key, x, repeats, sizes, micro_repeats)
    (f_s, b_s), micro = timed[layers]
    fwd.append(f_s)
    bwd.append(b_s)
    for m, (f_s, b_s) in micro.items():
      fwd_micro[m].append(f_s)
      bwd_micro[m].append(b_s)

  def device0_extra(embed_p, head_p):
    h = model.embed(embed_p, batch['inputs'], None)
    loss_of = lambda hp, ep, h: model.loss(hp, ep, h, batch['targets'])[0]
    return jax.grad(loss_of, argnums=(0, 1, 2))(head_p, embed_p, h)

  head_s = _median_time(jax.jit(device0_extra), params['embed'], params['head'], repeats=repeats)
  split_sizes = sorted({int(m) for m in split_microbatches if rows % int(m) == 0})
  shares = (
    input_grad_share(
      model.weight_split,
      jax.tree.map(lambda a: a[0], params['stages']),
      0,
      key,
      x,
      split_sizes,
      micro_repeats,
    )
    if split_sizes and model.weight_split is not None
    else {}
  )

  # The optimizer update (clip + the optimizer) of each device's own parameters: stage s, and on
  # device 0 also the embedding and the head.
  grouped = GroupedOptimizer(bench_optimizer(optimizer), clip_norm=1.0)
  apply = jax.jit(grouped.apply)
  update = []
  for s in range(len(layers_per_stage)):
    own = {
      'embed': params['embed'] if s == 0 else {},
      'head': params['head'] if s == 0 else {},
      'stages': jax.tree.map(lambda a: a[s : s + 1], params['stages']),
    }
    grads = jax.tree.map(jnp.ones_like, own)
    update.append(_median_time(apply, own, grouped.init(own), grads, repeats=repeats))
  return {
    'fwd': fwd,
    'bwd': bwd,
    'fwd_micro': fwd_micro,
    'bwd_micro': bwd_micro,
    'input_grad_share': shares,
    'head': head_s,
    'update': update,
    'activation_bytes': x.nbytes,
    'grad_bytes': sum(a.nbytes for a in jax.tree.leaves(params)),
  }


def on_process0_alone(measure: Callable[[], dict], max_bytes: int = 1 << 16) -> dict:
  """measure() run by process 0 while the others wait, its (JSON-able) result on every process.

  The ideal step time is built from pieces timed alone: a process computing beside another
  competes with it for memory bandwidth, and that contention is part of what the schedules'
  measured times show against their ideal, not part of the ideal.
  """
  if jax.process_count() == 1:
    return measure()
  # The first collective sets up the CPU collectives' context and gives up after 30 s: enter it
  # together, so that the wait below happens in a collective that is already set up.
  multihost_utils.sync_global_devices('bench: before measuring alone')
  encoded = np.zeros(max_bytes, np.uint8)
  if jax.process_index() == 0:
    text = json.dumps(measure()).encode()
    if len(text) > max_bytes:
      raise ValueError(f'measured result of {len(text)} bytes does not fit max_bytes={max_bytes}')
    encoded[: len(text)] = np.frombuffer(text, np.uint8)
  encoded = np.asarray(multihost_utils.broadcast_one_to_all(encoded))
  return json.loads(encoded[encoded != 0].tobytes())


def measure_concurrent_slowdown(work: Workload, repeats: int = 3) -> float:
  """How many times longer a layer group's forward + backward takes while every other process
  runs its own at the same time than alone (`concurrent_slowdown_probe`, measured once)."""
  return concurrent_slowdown_probe(work)(repeats)


def concurrent_slowdown_probe(work: Workload) -> Callable[[int], float]:
  """A compiled and warmed probe, `probe(repeats)`: how many times longer a layer group's forward
  + backward takes while every other process runs its own at the same time than alone.
  Processes 0..G-1 each time stage p's forward and backward on the whole batch, first one process
  at a time, then all at once (each for about the same wall time), and the ratio of the sums (at
  least 1) is the same number on every process. Always 1.0 with one process (devices of one
  process are not timed against each other). Every process calls the probe at once; a bench of
  several rounds calls it in each (`run`), and uses the median.

  Processes on one CPU share its memory bus and caches, so a schedule that computes on every
  device at once (the pipelined ring, data parallelism, a full pipeline) runs each piece slower
  than the pieces timed alone; `simulate.StageCosts.concurrent_slowdown` models that."""
  stages = len(work.layers_per_stage)
  if jax.process_count() == 1 or jax.process_count() < stages:
    return lambda repeats=3: 1.0
  me = jax.process_index()
  if me < stages:
    model = partition.transformer_stages(work.cfg, work.layers_per_stage)
    params = partition.to_staged(work.params, work.layers_per_stage)
    params, batch = jax.device_put((params, work.batch), jax.local_devices()[0])
    stash, key = GraphStash(model, 'all'), jax.random.key(0)
    x = jax.jit(model.embed)(params['embed'], batch['inputs'], None)
    params_s = jax.tree.map(lambda a: a[me], params['stages'])
    forward = jax.jit(lambda p, h: stash.forward(p, h, me, key))
    backward = jax.jit(lambda p, k, d: stash.backward(p, k, d, me, key))

    def piece():
      y, kept, _ = forward(params_s, x)
      return backward(params_s, kept, jnp.ones_like(y))

    jax.block_until_ready(piece())  # compile and warm

  def probe(repeats: int = 3) -> float:
    alone = np.zeros(jax.process_count())
    together = np.zeros(jax.process_count())
    for turn in range(stages):  # alone: one process at a time
      multihost_utils.sync_global_devices(f'bench: concurrent, alone {turn}')
      if me == turn:
        alone[me] = _median_time(piece, repeats=repeats, warm=False)
    alone = np.asarray(multihost_utils.process_allgather(alone)).max(axis=0)
    multihost_utils.sync_global_devices('bench: concurrent, together')
    if me < stages:  # together: each about as long as the slowest stage's `repeats` runs
      runs = max(repeats, round(repeats * alone[:stages].max() / alone[me]))
      together[me] = _median_time(piece, repeats=runs, warm=False)
    together = np.asarray(multihost_utils.process_allgather(together)).max(axis=0)
    # Computing beside another process never helps: a ratio under 1 is timing noise.
    return max(1.0, float(together[:stages].sum() / alone[:stages].sum()))

  return probe


def measure_links(activation_shape, grad_elems: int, repeats: int = 10) -> tuple[float, float]:
  """(one activation hop from device 0 to device 1 and back, one all-reduce of every gradient
  over all devices), in seconds. Every process takes part, each with its own devices, as in the
  schedules' steps: a collective over a subset of processes is not what they run."""
  if jax.device_count() < 2:
    return 0.0, 0.0
  n = jax.device_count()
  mesh = jax.sharding.Mesh(np.asarray(jax.devices()), ('x',))
  hop = jax.jit(
    jax.shard_map(
      lambda a: jax.lax.ppermute(a, 'x', [(0, 1), (1, 0)]),
      mesh=mesh,
      in_specs=P('x'),
      out_specs=P('x'),
    )
  )
  allreduce = jax.jit(
    jax.shard_map(lambda a: jax.lax.psum(a, 'x'), mesh=mesh, in_specs=P('x'), out_specs=P('x'))
  )
  put = lambda shape: jax.make_array_from_callback(
    shape,
    NamedSharding(mesh, P('x')),
    lambda idx: np.ones(shape, np.float32)[idx],
    dtype=np.float32,
  )
  link = _median_time(hop, put((n, *activation_shape)), repeats=repeats)
  reduce = _median_time(allreduce, put((n, grad_elems)), repeats=repeats)
  return link, reduce


def measure_collective_wait(tick_s: float, width: int, ticks: int = 10, repeats: int = 3) -> float:
  """The mean seconds one collective inside a compiled step adds to a tick of about `tick_s`
  seconds of compute (`collective_wait_probe`, measured once)."""
  return collective_wait_probe(tick_s, width, ticks)(repeats)


def collective_wait_probe(tick_s: float, width: int, ticks: int = 10) -> Callable[[int], float]:
  """A compiled and warmed probe, `probe(repeats)`: the mean seconds one collective inside a
  compiled step adds to a tick of about `tick_s` seconds of compute on every device, beyond the
  data it moves: the wait for the process that reaches it last. Every process runs the same
  program, `ticks` ticks of a chain of `tanh(h @ w)` (`width` wide, as many links as make
  `tick_s`) each followed by a `ppermute` of `h` round the devices, and the same program without
  the `ppermute`; the two are timed in turn, `repeats` times each, and the wait is their mean
  difference per tick (at least 0), the largest any process saw. The mean, not the median: a
  step sums its ticks, and the waits come in bursts (on the 2-core CPU machine of
  docs/results/simulator_calibration.md, runs of ticks each ~100 ms late), so one short sample
  misses them or catches too many; a bench of several rounds calls the probe in each (`run`) and
  uses the median of the rounds. Always 0.0 on one device.

  A table pipeline ends every tick with such a collective and the ring every round, so the
  simulator charges it on every hop as the link's latency (`stage_costs`)."""
  if jax.device_count() < 2 or tick_s <= 0:
    return lambda repeats=3: 0.0
  n = jax.device_count()
  mesh = jax.sharding.Mesh(np.asarray(jax.devices()), ('x',))
  shift = [(i, (i + 1) % n) for i in range(n)]

  def program(links: int, collective: bool):
    def ticks_of(h, w):
      def tick(_, h):  # a loop of links, not an unrolled chain: a small width needs thousands
        h = jax.lax.fori_loop(0, links, lambda _, h: jnp.tanh(h @ w), h)
        return jax.lax.ppermute(h, 'x', shift) if collective else h

      return jax.lax.fori_loop(0, ticks, tick, h)

    return jax.jit(jax.shard_map(ticks_of, mesh=mesh, in_specs=(P('x'), P()), out_specs=P('x')))

  put = lambda shape, spec, value: jax.make_array_from_callback(
    shape, NamedSharding(mesh, spec), lambda idx: np.full(shape, value, np.float32)[idx]
  )
  h, w = put((n * 64, width), P('x'), 0.5), put((width, width), P(), 1.0 / width)
  probe_links = 4  # links per tick of a first, short program: the seconds one link takes
  link_s = _median_time(program(probe_links, False), h, w, repeats=2) / (ticks * probe_links)
  # the same number of links on every process (the longest estimate), so that no process waits
  # for another by design
  links = max(1, round(tick_s / float(multihost_utils.process_allgather(link_s).min())))
  alone, together = program(links, False), program(links, True)
  jax.block_until_ready((alone(h, w), together(h, w)))  # compile and warm both

  def probe(repeats: int = 3) -> float:
    spent = {alone: [], together: []}
    for _ in range(repeats):
      for fn in (alone, together):
        start = time.perf_counter()
        jax.block_until_ready(fn(h, w))
        spent[fn].append(time.perf_counter() - start)
    wait = (np.mean(spent[together]) - np.mean(spent[alone])) / ticks
    # the same number on every process: the largest wait any of them saw
    return max(0.0, float(multihost_utils.process_allgather(np.float64(wait)).max()))

  return probe


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


def time_setting(setting: ScheduleConfig, work: Workload, bench: BenchConfig) -> dict | None:
  """Compile and time one setting; None on processes whose devices it does not use."""
  prepared = prepare_setting(setting, work, bench)
  if prepared is None:
    return None
  time_steps(prepared, bench.steps)
  return measurement(prepared, work)


def prepare_setting(
  setting: ScheduleConfig, work: Workload, bench: BenchConfig, devices: Sequence | None = None
) -> Prepared | None:
  """Compile one setting and run its warmup steps on `devices` (None: the first ones it needs of
  all processes'); None on processes whose devices it does not use."""
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
  schedule = build_schedule(setting, model, bench_optimizer(bench.optimizer), devices=devices)
  fresh = lambda: schedule.init(partition.to_staged(work.params, split), work.batch)
  state = fresh()
  placed = placement.place_batch(work.batch, schedule.mesh)
  start = time.perf_counter()
  compiled = schedule.step.lower(state, placed).compile()
  compile_s = time.perf_counter() - start
  for _ in range(bench.warmup):
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


def measurement(prepared: Prepared, work: Workload) -> dict:
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


def one_device(setting: ScheduleConfig) -> ScheduleConfig | None:
  """`setting` on one device: the same schedule, micro-batches, chunks, stash and flow with one
  stage, the program each of its G devices runs less the others. None for backprop and
  data_parallel, whose devices run the whole model's one-device program already."""
  if setting.name in ('backprop', 'data_parallel'):
    return None
  return dataclasses.replace(setting, num_stages=1)


def time_one_device(
  settings: Sequence[ScheduleConfig], work: Workload, bench: BenchConfig, steps: int = 3
) -> tuple[dict[str, float], dict[str, float]]:
  """`one_device_probe`'s ({label: seconds}, {label: slowdown}), measured once."""
  return one_device_probe(settings, work, bench)(steps)


def one_device_probe(
  settings: Sequence[ScheduleConfig], work: Workload, bench: BenchConfig
) -> Callable[[int], tuple[dict[str, float], dict[str, float]]]:
  """A compiled probe, `probe(steps)`: ({label: seconds}, {label: slowdown}) of every stage
  setting's own step program on one device over the first layer group (with the embedding and
  the head; `one_device`). Every process calls the probe at once; a bench of several rounds calls
  it in each (`run`) and uses the medians: on the 2-core CPU machine of
  docs/results/simulator_calibration.md the same program timed once, at the start, ran 16-20%
  slower in one run than in the next, and predicted its setting 14-26% too slow.

  The seconds: the median of 2 x `steps` steps on process 0 alone, half before and half after
  the steps together below. What one device's work costs inside its program, which its pieces
  timed alone miss (on a CPU GPipe and 1F1B at M = 4 cost 1.07-1.26x their pieces;
  docs/results/simulator_calibration.md).

  The slowdown (several processes only): every process that owns one of the setting's devices
  runs the same program on its own device at once, `steps` steps, and the mean of their medians
  over the seconds alone (at least 1) is how much slower this program runs while the others run
  theirs: `StageCosts.concurrent_slowdown` for this setting. A table pipeline's split backward
  reads its stash again in W, and on a CPU its program slowed 1.09-1.13x beside a copy of itself
  where 1F1B's slowed 1.00-1.01x and the whole-batch forward and backward of
  `concurrent_slowdown_probe` 1.00-1.08x (docs/results/simulator_calibration.md).

  Each program is compiled once and only its executable kept: a probe builds its state afresh,
  runs one untimed step, times, and drops it (ten states kept beside the settings of a
  round-robin run filled a 24 GiB machine)."""
  layers = work.layers_per_stage[0]
  cfg = dataclasses.replace(work.cfg, num_layers=layers)
  group = Workload(
    cfg, jax.device_get(transformer.init_params(cfg, jax.random.key(0))), work.batch, (layers,)
  )
  unwarmed = dataclasses.replace(bench, warmup=0)
  me, several = jax.process_index(), jax.process_count() > 1
  programs = {}  # label: (its owner processes, the prepared program or None where not run here)
  for setting in settings:
    if one_device(setting) is None:
      continue
    owners = {d.process_index for d in jax.devices()[: num_devices(setting)]}
    runs = me == 0 or (several and me in owners)
    local = jax.local_devices()[:1]
    ready = prepare_setting(one_device(setting), group, unwarmed, devices=local) if runs else None
    if ready is not None:
      ready.state = None  # kept: the executable only
    programs[setting.label] = owners, ready
    multihost_utils.sync_global_devices(f'bench one device {setting.label} compiled')

  def probe(steps: int = 3) -> tuple[dict[str, float], dict[str, float]]:
    seconds, slowdowns = {}, {}
    for label, (owners, ready) in programs.items():
      if ready is not None:
        ready.state = ready.fresh()
        step_untimed(ready)
      alone, together = [], 0.0
      for phase in ('alone', 'together', 'alone again'):
        multihost_utils.sync_global_devices(f'bench one device {label} {phase}')
        if ready is not None and (me == 0 if phase != 'together' else several):
          ready.times.clear()
          time_steps(ready, steps)
          if phase == 'together':
            together = statistics.median(ready.times)
          else:
            alone += ready.times
      alone_s = float(
        multihost_utils.broadcast_one_to_all(np.float64(statistics.median(alone or [0.0])))
      )
      seconds[label] = alone_s
      if several:
        spent = np.asarray(multihost_utils.process_allgather(np.float64(together)))
        slowdowns[label] = max(1.0, float(spent[sorted(owners)].mean() / alone_s))
      if ready is not None:
        ready.state = None
        host.release_freed_memory()  # its state and scratch: the next program faults its own in
    return seconds, slowdowns

  return probe


def round_robin(settings, work: Workload, bench: BenchConfig, measure_pieces_now=None):
  """(setting, measurement or None) for every setting, timed in `BenchConfig.rounds` rounds: all of
  them compiled and warmed up first, then steps / rounds steps of each in turn per round. Every
  process runs the same settings in the same order (a setting waits for its devices' peers).

  With `measure_pieces_now` (a callable giving the pieces) each round also re-times the pieces
  first, and the second result is their median over the rounds (`median_pieces`): the pieces the
  predictions are built from then drift with the machine as the settings' steps do. Else None.
  What the pieces allocated and freed is then handed back to the kernel
  (`host.release_freed_memory`), and each setting runs one untimed step before its timed ones."""
  prepared = []
  for setting in settings:
    prepared.append(prepare_setting(setting, work, bench))
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
          step_untimed(ready)
        time_steps(ready, steps)
      multihost_utils.sync_global_devices(f'bench round {r} {setting.label}')
  timed = [
    (setting, None if ready is None else measurement(ready, work))
    for setting, ready in zip(settings, prepared)
  ]
  return timed, median_pieces(pieces_by_round) if pieces_by_round else None


def median_pieces(samples: Sequence[Any]) -> Any:
  """The element-wise median of several measurements of the same pieces (numbers, lists and
  dicts of them, nested alike); sizes in bytes (`*_bytes`) are the same in each and kept."""
  first = samples[0]
  if isinstance(first, dict):
    return {
      k: v if k.endswith('_bytes') else median_pieces([s[k] for s in samples])
      for k, v in first.items()
    }
  if isinstance(first, (list, tuple)):
    return [median_pieces(list(column)) for column in zip(*samples)]
  return float(statistics.median(samples))


def host_load() -> float:
  """The host's 1-minute load average (nan where unknown). The benchmark's own processes count:
  with one pinned process per core, a load above the process count means something else shared
  the cores while the setting was timed, and its times (and the pieces') are not to be trusted."""
  try:
    return os.getloadavg()[0]
  except (AttributeError, OSError):
    return float('nan')


def micro_size(setting: ScheduleConfig) -> int:
  """The M whose micro-batch (B / M rows) the setting computes: its micro-batches, data_parallel's
  D replicas (each on B / D rows); 1 for a setting that computes the whole batch at once. The
  batch must be a multiple of it."""
  if setting.name == 'data_parallel':
    return setting.data_parallel
  return setting.num_microbatches


def tick_seconds(pieces: dict) -> float:
  """A table pipeline's tick: the slowest group's forward of the smallest micro-batch timed
  (the whole batch where none was)."""
  micro = pieces.get('fwd_micro', {})
  smallest = micro[max(micro, key=int)] if micro else pieces['fwd']
  return max(smallest)


def micro_pieces(pieces: dict, setting: ScheduleConfig) -> tuple[list[float], list[float]] | None:
  """(forward, backward) per stage of one micro-batch of `setting`, None where not measured."""
  m = str(micro_size(setting))
  fwd, bwd = pieces.get('fwd_micro', {}).get(m), pieces.get('bwd_micro', {}).get(m)
  return (fwd, bwd) if fwd and bwd else None


def simulated(
  setting: ScheduleConfig, pieces: dict, link_s: float, allreduce_s: float, ideal: bool = False
) -> float:
  """The simulator's step time of `setting` from the measured pieces and links. `ideal`: free of
  what the schedule's own execution adds (no slowdown of devices computing at once, each table
  operation waiting only for its input); else as measured (the pieces' `concurrent_slowdown`,
  the table executor's tick-by-tick lockstep, the pieces' `program_scale` where measured)."""
  costs = stage_costs(setting, pieces, link_s, allreduce_s, ideal)
  scale = program_scale(setting, pieces)
  if scale and not ideal:  # as measured: the pieces cost more inside the step program
    costs = simulate.scaled(costs, scale)
  # as measured: the library's table executor, every tick ends with a ppermute
  return simulate.simulate(setting, costs, lockstep=not ideal).step_time


def program_scale(setting: ScheduleConfig, pieces: dict) -> float | None:
  """The setting's one-device program (`time_one_device`) over the simulator's one-device step
  from these pieces (`simulate.program_scale`); None where it was not timed."""
  one_device_s = pieces.get('one_device', {}).get(setting.label)
  if not one_device_s:
    return None
  costs = stage_costs(setting, pieces, 0.0, 0.0, ideal=True)
  return simulate.program_scale(setting, costs, one_device_s)


def concurrent_slowdown(setting: ScheduleConfig, pieces: dict) -> float:
  """How much slower `setting`'s compute runs while the other devices compute: its own one-device
  program beside copies of itself (`time_one_device`) where timed, else the whole-batch forward
  and backward's (`concurrent_slowdown_probe`), else 1."""
  own = pieces.get('program_slowdown', {}).get(setting.label)
  return own or pieces.get('concurrent_slowdown', 1.0)


def stage_costs(
  setting: ScheduleConfig, pieces: dict, link_s: float, allreduce_s: float, ideal: bool = False
) -> simulate.StageCosts:
  """The simulator's costs of `setting` from the measured pieces and links (see `simulated`)."""
  stages = setting.num_stages
  fwd, bwd, update = pieces['fwd'], pieces['bwd'], pieces['update']
  micro = micro_pieces(pieces, setting)
  if len(fwd) != stages:  # pieces were measured on the G-stage split: merge for one device
    fwd, bwd, update = [sum(fwd)], [sum(bwd)], [sum(update)]
    micro = micro and ([sum(micro[0])], [sum(micro[1])])
  m = micro_size(setting)
  return simulate.StageCosts(
    forward_s=fwd,
    backward_s=bwd,
    head_s=pieces['head'],
    update_s=update,
    # a hop of B / k rows costs the collective's wait (0 where not measured) + link_s / k
    activation_bytes=1.0 if link_s else 0.0,
    bandwidth=1.0 / link_s if link_s else np.inf,
    latency=pieces.get('collective_wait', 0.0) if link_s else 0.0,
    allreduce_s=allreduce_s,
    microbatch_forward_s={m: micro[0]} if micro else {},
    microbatch_backward_s={m: micro[1]} if micro else {},
    concurrent_slowdown=1.0 if ideal else concurrent_slowdown(setting, pieces),
    input_grad_share=pieces.get('input_grad_share', {}).get(
      str(m), simulate.StageCosts.input_grad_share
    ),
  )


def run(cfg: transformer.ModelConfig, bench: BenchConfig, log=print) -> list[dict]:
  """Benchmarks every setting of `bench`; process 0 writes the outputs and returns the rows
  (an earlier bench's in the same directory moved aside first, `keep_earlier`)."""
  work = _workload(cfg, bench)
  if jax.process_index() == 0:
    keep_earlier(bench.out_dir, log)
  settings = bench.settings or default_settings(
    bench.stages, cfg.num_layers, bench.stash_policy, bench.compensation
  )
  by_policy = _measure_pieces(work, bench, settings)
  pieces = by_policy['all']
  activation_shape = (bench.batch_size, cfg.seq_len, cfg.d_model)
  link_s, allreduce_s = measure_links(activation_shape, pieces['grad_bytes'] // 4)
  slowdown_probe = concurrent_slowdown_probe(work)
  wait_probe = collective_wait_probe(tick_seconds(pieces), work.cfg.d_model)
  slowdown, wait = slowdown_probe(3), wait_probe(3)
  # Each stage setting's program on one device: set against the pieces the rows use (these, or
  # the rounds' medians; `simulate.program_scale`), it scales them. Timed here for one round,
  # else in each round beside the pieces.
  one_device_now = one_device_probe(settings, work, bench)
  one, program_slowdown = one_device_now(3) if bench.rounds == 1 else ({}, {})
  measured_once = dict(
    concurrent_slowdown=slowdown,
    one_device=one,
    program_slowdown=program_slowdown,
    collective_wait=wait,
  )
  by_policy = {p: dict(measured, **measured_once) for p, measured in by_policy.items()}
  pieces = by_policy['all']
  log(
    f'pieces: forward {np.round(pieces["fwd"], 4)} s, backward {np.round(pieces["bwd"], 4)} s, '
    f'update {np.round(pieces["update"], 4)} s, head+embed {pieces["head"]:.4f} s, '
    f'hop {link_s:.4f} s, all-reduce {allreduce_s:.4f} s, concurrent slowdown {slowdown:.3f}, '
    f'collective wait {wait:.4f} s, '
    f'host load {host_load():.2f}'
  )
  for policy, measured in by_policy.items():
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
  rows = []

  def one_by_one():
    for setting in settings:
      measured = time_setting(setting, work, bench)
      multihost_utils.sync_global_devices(f'bench {setting.label}')
      yield setting, measured

  if bench.rounds == 1:
    timed = one_by_one()
  else:  # the pieces re-timed at the start of each round, fewer repeats each, their medians used
    repeats = dict(repeats=max(3, 10 // bench.rounds), micro_repeats=1)

    def pieces_now():  # the slowdown, the wait and the programs drift (and burst) too
      drift = dict(concurrent_slowdown=slowdown_probe(1), collective_wait=wait_probe(2))
      measured = _measure_pieces(work, bench, settings, **repeats)
      host.release_freed_memory()  # the pieces' (each program below first runs one step untimed)
      drift['one_device'], drift['program_slowdown'] = one_device_now(1)
      return {p: dict(m, **drift) for p, m in measured.items()}

    timed, by_policy = round_robin(settings, work, bench, pieces_now)
    pieces = by_policy['all']
    log(
      f'pieces, the median of {bench.rounds} rounds: forward {np.round(pieces["fwd"], 4)} s, '
      f'backward {np.round(pieces["bwd"], 4)} s, update {np.round(pieces["update"], 4)} s, '
      f'head+embed {pieces["head"]:.4f} s, concurrent slowdown '
      f'{pieces["concurrent_slowdown"]:.3f}, collective wait {pieces["collective_wait"]:.4f} s'
    )
  for label, seconds in pieces['one_device'].items():
    beside = pieces['program_slowdown'].get(label)
    log(
      f'{label} on one device: {seconds:.4f} s'
      + (f', {beside:.3f}x beside the other processes' if beside else '')
    )
  for setting, measured in timed:
    if measured is None:
      continue
    row = _row(setting, measured, by_policy[_policy(setting)], link_s, allreduce_s)
    row['mfu'] = mfu(
      cfg,
      bench.batch_size * cfg.seq_len,
      row['step_time_s'],
      num_devices(setting),
      jax.devices()[0],
    )
    rows.append(row)
    if jax.process_index() == 0:  # row by row, so a bench cut short keeps what it measured
      write_csv(rows, bench.out_dir)
    log(
      f'{setting.label:28s} {row["step_time_s"] * 1e3:9.1f} ms/step  '
      f'{row["tokens_per_s"]:9.0f} tok/s  ideal {row["ideal_s"] * 1e3:8.1f} ms  '
      f'compile {row["compile_s"]:.1f} s'
    )
  if jax.process_index() == 0:
    write_outputs(rows, bench.out_dir, _meta(work, bench), log)
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
    'stash_policy': bench.stash_policy,
    'optimizer': bench.optimizer,
    'compensation': ','.join(bench.compensation.names()) or 'none',
  }


def _policy(setting: ScheduleConfig) -> str:
  """The stash policy a setting's backward runs with (`resolved_stash_policy`); the replay
  stash's backward keeps the whole VJP of the forward it re-runs ('all')."""
  replay = setting.name == 'ouroboros' and setting.stash == 'replay'
  return 'all' if replay else setting.resolved_stash_policy


def _measure_pieces(
  work: Workload, bench: BenchConfig, settings: Sequence[ScheduleConfig], **repeats
) -> dict[str, dict]:
  """{stash policy: the pieces measured with it}, 'all' first and always: a policy that keeps
  less has its own, slower, backward, measured apart for the settings that use it (`_policy`).
  Each is also timed on the micro-batches of those settings, and the zero-bubble ones' split
  backward on theirs."""
  measure = lambda micro, split, **kw: on_process0_alone(
    lambda: measure_pieces(
      work,
      optimizer=bench.optimizer,
      microbatches=sorted(micro),
      split_microbatches=sorted(split),
      **repeats,
      **kw,
    )
  )
  policies = ['all', *sorted({_policy(s) for s in settings} - {'all'})]
  own = lambda policy: [s for s in settings if _policy(s) == policy]
  return {
    policy: measure(
      {micro_size(s) for s in own(policy)} - {1},
      {micro_size(s) for s in own(policy) if s.name in SPLIT_BACKWARD},
      stash_policy=policy,
    )
    for policy in policies
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
  setting: ScheduleConfig, measured: dict, own: dict, link_s: float, allreduce_s: float
) -> dict:
  """One setting's row: what was timed, its pieces, and the simulator's ideal and prediction."""
  per_stage = lambda values: ';'.join(f'{v:.6g}' for v in values)
  micro, ring = micro_pieces(own, setting), setting.name == 'ouroboros'
  return {
    'schedule': setting.name,
    'label': setting.label,
    'stages': num_devices(setting),
    'microbatches': setting.num_microbatches if setting.name in MICROBATCHED else '',
    'stash': setting.stash if ring else '-',
    'forward': setting.forward if ring else '-',
    'flow': setting.resolved_flow,
    **measured,
    'fwd_s_per_stage': per_stage(own['fwd']),
    'bwd_s_per_stage': per_stage(own['bwd']),
    # one micro-batch (B / M rows, M = micro_size) of each group, '' where the setting has none
    'fwd_s_per_stage_micro': per_stage(micro[0]) if micro else '',
    'bwd_s_per_stage_micro': per_stage(micro[1]) if micro else '',
    # a zero-bubble setting's B over B + W of one micro-batch ('': not measured, an even split)
    'input_grad_share': (
      own.get('input_grad_share', {}).get(str(micro_size(setting)), '')
      if setting.name in SPLIT_BACKWARD
      else ''
    ),
    'head_s': own['head'],
    'update_s_per_stage': per_stage(own['update']),
    # one whole-batch hop inside a step: the hop timed alone plus the collective's wait (its
    # fixed part, which every micro-batch hop pays in full)
    'link_s': link_s + own.get('collective_wait', 0.0) if link_s else 0.0,
    'link_latency_s': own.get('collective_wait', 0.0) if link_s else 0.0,
    'allreduce_s': allreduce_s,
    'concurrent_slowdown': concurrent_slowdown(setting, own),
    # the setting's step program on one device over the first group, and that over its pieces'
    # one-device step ('': not measured), by which its predicted_s scales the pieces
    'one_device_s': own.get('one_device', {}).get(setting.label, ''),
    'program_scale': program_scale(setting, own) or '',
    'ideal_s': simulated(setting, own, 0.0, 0.0, ideal=True),
    'predicted_s': simulated(setting, own, link_s, allreduce_s),
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
