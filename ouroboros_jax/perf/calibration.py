"""The simulator's calibration: what `ouroboros bench` measures beside the settings' steps, and
each setting's ideal and predicted step time built from it (`simulate.py`).

On process 0's device while every other process waits (`on_process0_alone`) it times each layer
group's forward and backward (on the whole batch, and on one micro-batch of B / M rows for every
M the settings use: a micro-batch rarely costs 1 / M of the batch), a zero-bubble backward's B
and W apart, the head and each device's optimizer update (`measure_pieces`), once for each stash
policy the settings use (`measure_by_policy`); then one activation hop and one gradient
all-reduce between devices (`measure_links`). Three probes are compiled once and run again in
each round of a bench of several rounds: how much slower a group's forward + backward runs while
every process computes at once (`concurrent_slowdown_probe`); what one collective inside a step
adds to a tick of compute beyond its data, the wait for the last process to reach it
(`collective_wait_probe`, column link_latency_s); and each stage setting's own step program on
one device over the first layer group (`one_device_probe`: what one device's work costs inside
its program, which its pieces timed alone miss, and how much slower that program runs beside
copies of itself on the other processes). `start` measures all of it at the start of a bench,
`Calibration.again` in each round, and `median_pieces` gives the rounds' medians.

From those the discrete-event simulator gives each setting's ideal step time (free links, no
overheads, devices that do not slow each other) and its predicted one (measured links, the
measured slowdown of devices computing at once, the table pipelines run tick by tick, the pieces
scaled to the one-device program, `simulate.program_scale`, every hop paying the collective's
wait): `simulated`; `columns` is a bench row's pieces with both.
"""

from __future__ import annotations

import dataclasses
import json
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

from ouroboros_jax.choices import DEFAULT_STASH_POLICY, SPLIT_BACKWARD
from ouroboros_jax.models import model as transformer
from ouroboros_jax.models import partition
from ouroboros_jax.perf import cost_model, simulate, timing
from ouroboros_jax.perf.timing import Workload, median_time, micro_size, num_devices
from ouroboros_jax.runtime import host
from ouroboros_jax.schedules import ScheduleConfig
from ouroboros_jax.schedules.stash import GraphStash, TappedStash
from ouroboros_jax.update import GroupedOptimizer

# ----------------------------------------------------------------------------- the pieces


def time_group(stash, params, s, key, x, repeats, sizes=(), micro_repeats=3):
  """((forward, backward) seconds of group s on x, {str(M): the same on its first B / M rows})."""
  params_s = jax.tree.map(lambda a: a[s], params['stages'])
  forward = jax.jit(lambda p, h: stash.forward(p, h, s, key))
  backward = jax.jit(lambda p, k, d: stash.backward(p, k, d, s, key))

  def time_on(h, times):
    f = median_time(lambda p, h: forward(p, h)[0], params_s, h, repeats=times)
    y, kept, _ = forward(params_s, h)
    return f, median_time(backward, params_s, kept, jnp.ones_like(y), repeats=times)

  rows = x.shape[0]
  return time_on(x, repeats), {str(m): time_on(x[: rows // m], micro_repeats) for m in sizes}


def input_grad_share(split, params_s, s, key, x, sizes, repeats=3) -> dict[str, float]:
  """{str(M): B / (B + W)} of group s's split backward (`TappedStash`: B the input gradient
  through the taps, W the weight gradient from them) on the first B / M rows of x, for each M in
  `sizes`: how a zero-bubble table divides a backward between its B and W ticks
  (`cost_model.StageCosts.input_grad_share`)."""
  stash = TappedStash(split)
  forward = jax.jit(lambda p, h: stash.forward(p, h, s, key))
  b = jax.jit(lambda p, kept, d: stash.input_grad(p, kept, d, s, key))
  w = jax.jit(stash.weight_grad)
  shares = {}
  for m in sizes:
    y, kept, _ = forward(params_s, x[: x.shape[0] // m])
    delta = jnp.ones_like(y)
    for_w = b(params_s, kept, delta)[1]
    b_s = median_time(b, params_s, kept, delta, repeats=repeats)
    w_s = median_time(w, params_s, kept, for_w, repeats=repeats)
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
  model = partition.transformer_stages(work.cfg, work.layers_per_stage)
  params = partition.to_staged(work.params, work.layers_per_stage)
  params, batch = jax.device_put((params, work.batch), jax.local_devices()[0])
  key = jax.random.key(0)
  x = jax.jit(model.embed)(params['embed'], batch['inputs'], None)
  rows = x.shape[0]
  sizes = sorted({int(m) for m in microbatches if 1 < m <= rows and rows % m == 0})
  stash = GraphStash(model, stash_policy)
  groups = _group_pieces(
    stash, params, work.layers_per_stage, key, x, repeats, sizes, micro_repeats
  )
  head_s = _head_seconds(model, params, batch, repeats)
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
  return {
    **groups,
    'input_grad_share': shares,
    'head': head_s,
    'update': _update_seconds(params, len(work.layers_per_stage), optimizer, repeats),
    'activation_bytes': x.nbytes,
    'grad_bytes': sum(a.nbytes for a in jax.tree.leaves(params)),
  }


def _group_pieces(stash, params, layers_per_stage, key, x, repeats, sizes, micro_repeats) -> dict:
  """Each group's forward and backward on the whole batch ('fwd', 'bwd') and on one micro-batch
  of each size ('fwd_micro', 'bwd_micro': {str(M): per group})."""
  fwd, bwd = [], []
  fwd_micro, bwd_micro = {str(m): [] for m in sizes}, {str(m): [] for m in sizes}
  # Groups of the same layer count run the same program on the same shapes: each is compiled
  # and timed once.
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
  return {'fwd': fwd, 'bwd': bwd, 'fwd_micro': fwd_micro, 'bwd_micro': bwd_micro}


def _head_seconds(model, params, batch, repeats: int) -> float:
  """Device 0's extra work: the embedding and the head, forward + backward."""

  def device0_extra(embed_p, head_p):
    h = model.embed(embed_p, batch['inputs'], None)
    loss_of = lambda hp, ep, h: model.loss(hp, ep, h, batch['targets'])[0]
    return jax.grad(loss_of, argnums=(0, 1, 2))(head_p, embed_p, h)

  return median_time(jax.jit(device0_extra), params['embed'], params['head'], repeats=repeats)


def _update_seconds(params, stages: int, optimizer: str, repeats: int) -> list[float]:
  """The optimizer update (clip + the optimizer) of each device's own parameters: stage s, and on
  device 0 also the embedding and the head."""
  grouped = GroupedOptimizer(timing.bench_optimizer(optimizer), clip_norm=1.0)
  apply = jax.jit(grouped.apply)
  update = []
  for s in range(stages):
    own = {
      'embed': params['embed'] if s == 0 else {},
      'head': params['head'] if s == 0 else {},
      'stages': jax.tree.map(lambda a: a[s : s + 1], params['stages']),
    }
    grads = jax.tree.map(jnp.ones_like, own)
    update.append(median_time(apply, own, grouped.init(own), grads, repeats=repeats))
  return update


def policy(setting: ScheduleConfig) -> str:
  """The stash policy a setting's backward runs with (`resolved_stash_policy`); the replay
  stash's backward keeps the whole VJP of the forward it re-runs ('all')."""
  return 'all' if setting.replays else setting.resolved_stash_policy


def measure_by_policy(
  work: Workload, settings: Sequence[ScheduleConfig], optimizer: str, **repeats
) -> dict[str, dict]:
  """{stash policy: the pieces measured with it}, 'all' first and always: a policy that keeps
  less has its own, slower, backward, measured apart for the settings that use it (`policy`).
  Each is also timed on the micro-batches of those settings, and the zero-bubble ones' split
  backward on theirs."""
  measure = lambda micro, split, **kw: on_process0_alone(
    lambda: measure_pieces(
      work,
      optimizer=optimizer,
      microbatches=sorted(micro),
      split_microbatches=sorted(split),
      **repeats,
      **kw,
    )
  )
  policies = ['all', *sorted({policy(s) for s in settings} - {'all'})]
  own = lambda name: [s for s in settings if policy(s) == name]
  return {
    name: measure(
      {micro_size(s) for s in own(name)} - {1},
      {micro_size(s) for s in own(name) if s.name in SPLIT_BACKWARD},
      stash_policy=name,
    )
    for name in policies
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
  link = median_time(hop, put((n, *activation_shape)), repeats=repeats)
  reduce = median_time(allreduce, put((n, grad_elems)), repeats=repeats)
  return link, reduce


# ----------------------------------------------------------------------------- the probes


def concurrent_slowdown_probe(work: Workload) -> Callable[[int], float]:
  """A compiled and warmed probe, `probe(repeats)`: how many times longer a layer group's forward
  + backward takes while every other process runs its own at the same time than alone.
  Processes 0..G-1 each time stage p's forward and backward on the whole batch, first one process
  at a time, then all at once (each for about the same wall time), and the ratio of the sums (at
  least 1) is the same number on every process. Always 1.0 with one process (devices of one
  process are not timed against each other). Every process calls the probe at once; a bench of
  several rounds calls it in each (`Calibration.again`), and uses the median.

  Processes on one CPU share its memory bus and caches, so a schedule that computes on every
  device at once (the pipelined ring, data parallelism, a full pipeline) runs each piece slower
  than the pieces timed alone; `cost_model.StageCosts.concurrent_slowdown` models that."""
  stages = len(work.layers_per_stage)
  if jax.process_count() == 1 or jax.process_count() < stages:
    return lambda repeats=3: 1.0
  me = jax.process_index()
  piece = _own_group_step(work, me) if me < stages else None

  def probe(repeats: int = 3) -> float:
    alone = np.zeros(jax.process_count())
    together = np.zeros(jax.process_count())
    for turn in range(stages):  # alone: one process at a time
      multihost_utils.sync_global_devices(f'bench: concurrent, alone {turn}')
      if me == turn:
        alone[me] = median_time(piece, repeats=repeats, warm=False)
    alone = np.asarray(multihost_utils.process_allgather(alone)).max(axis=0)
    multihost_utils.sync_global_devices('bench: concurrent, together')
    if me < stages:  # together: each about as long as the slowest stage's `repeats` runs
      runs = max(repeats, round(repeats * alone[:stages].max() / alone[me]))
      together[me] = median_time(piece, repeats=runs, warm=False)
    together = np.asarray(multihost_utils.process_allgather(together)).max(axis=0)
    # Computing beside another process never helps: a ratio under 1 is timing noise.
    return max(1.0, float(together[:stages].sum() / alone[:stages].sum()))

  return probe


def _own_group_step(work: Workload, me: int) -> Callable[[], Any]:
  """Group `me`'s forward and backward on the whole batch, on this process's first device,
  compiled and warmed."""
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
  return piece


def collective_wait_probe(tick_s: float, width: int, ticks: int = 10) -> Callable[[int], float]:
  """A compiled and warmed probe, `probe(repeats)`: the mean seconds one collective inside a
  compiled step adds to a tick of about `tick_s` seconds of compute on every device, beyond the
  data it moves: the wait for the process that reaches it last. Every process runs the same
  program, `ticks` ticks of a chain of `tanh(h @ w)` (`width` wide, as many links as make
  `tick_s`) each followed by a `ppermute` of `h` round the devices, and the same program without
  the `ppermute`; the two are timed in turn, `repeats` times each, and the wait is their mean
  difference per tick (at least 0), the largest any process saw. The mean, not the median: a
  step sums its ticks, and the waits come in bursts, so one short sample misses them or catches
  too many; a bench of several rounds calls the probe in each (`Calibration.again`) and uses the
  median of the rounds. Always 0.0 on one device.

  A table pipeline ends every tick with such a collective and the ring every round, so the
  simulator charges it on every hop as the link's latency (`stage_costs`)."""
  if jax.device_count() < 2 or tick_s <= 0:
    return lambda repeats=3: 0.0
  alone, together, h, w = _tick_programs(tick_s, width, ticks)

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


def _tick_programs(tick_s: float, width: int, ticks: int):
  """(`ticks` ticks of about `tick_s` seconds of compute each without a collective, the same
  each followed by a `ppermute` round the devices, h, w), both compiled and warmed."""
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
  link_s = median_time(program(probe_links, False), h, w, repeats=2) / (ticks * probe_links)
  # the same number of links on every process (the longest estimate), so that no process waits
  # for another by design
  links = max(1, round(tick_s / float(multihost_utils.process_allgather(link_s).min())))
  alone, together = program(links, False), program(links, True)
  jax.block_until_ready((alone(h, w), together(h, w)))  # compile and warm both
  return alone, together, h, w


def one_device(setting: ScheduleConfig) -> ScheduleConfig | None:
  """`setting` on one device: the same schedule, micro-batches, chunks, stash and flow with one
  stage, the program each of its G devices runs less the others. None for backprop and
  data_parallel, whose devices run the whole model's one-device program already."""
  if setting.name in ('backprop', 'data_parallel'):
    return None
  return dataclasses.replace(setting, num_stages=1)


def one_device_probe(
  settings: Sequence[ScheduleConfig], work: Workload, optimizer: str
) -> Callable[[int], tuple[dict[str, float], dict[str, float]]]:
  """A compiled probe, `probe(steps)`: ({label: seconds}, {label: slowdown}) of every stage
  setting's own step program on one device over the first layer group (with the embedding and
  the head; `one_device`). Every process calls the probe at once; a bench of several rounds calls
  it in each (`Calibration.again`) and uses the medians.

  The seconds: the median of 2 x `steps` steps on process 0 alone, half before and half after
  the steps together below. What one device's work costs inside its program, which its pieces
  timed alone miss.

  The slowdown (several processes only): every process that owns one of the setting's devices
  runs the same program on its own device at once, `steps` steps, and the mean of their medians
  over the seconds alone (at least 1) is how much slower this program runs while the others run
  theirs: `StageCosts.concurrent_slowdown` for this setting.

  Each program is compiled once and only its executable kept: a probe builds its state afresh,
  runs one untimed step, times, and drops it (`_one_device_programs`)."""
  programs = _one_device_programs(settings, work, optimizer)
  several = jax.process_count() > 1

  def probe(steps: int = 3) -> tuple[dict[str, float], dict[str, float]]:
    seconds, slowdowns = {}, {}
    for label, (owners, ready) in programs.items():
      alone_s, together = _time_program(label, ready, steps)
      seconds[label] = alone_s
      if several:
        spent = np.asarray(multihost_utils.process_allgather(np.float64(together)))
        slowdowns[label] = max(1.0, float(spent[sorted(owners)].mean() / alone_s))
      if ready is not None:
        ready.state = None
        host.release_freed_memory()  # its state and scratch: the next program faults its own in
    return seconds, slowdowns

  return probe


def _one_device_programs(
  settings: Sequence[ScheduleConfig], work: Workload, optimizer: str
) -> dict[str, tuple[set[int], timing.Prepared | None]]:
  """{label: (the setting's owner processes, its one-device program over the first layer group,
  compiled, or None where it does not run here)} of every stage setting. Only the executables
  are kept, not their states: states kept beside the settings of a round-robin run fill the
  memory."""
  layers = work.layers_per_stage[0]
  cfg = dataclasses.replace(work.cfg, num_layers=layers)
  group = Workload(
    cfg, jax.device_get(transformer.init_params(cfg, jax.random.key(0))), work.batch, (layers,)
  )
  me, several = jax.process_index(), jax.process_count() > 1
  programs = {}
  for setting in settings:
    if one_device(setting) is None:
      continue
    owners = {d.process_index for d in jax.devices()[: num_devices(setting)]}
    runs = me == 0 or (several and me in owners)
    local = jax.local_devices()[:1]
    ready = (
      timing.prepare_setting(one_device(setting), group, optimizer, 0, devices=local)
      if runs
      else None
    )
    if ready is not None:
      ready.state = None  # kept: the executable only
    programs[setting.label] = owners, ready
    multihost_utils.sync_global_devices(f'bench one device {setting.label} compiled')
  return programs


def _time_program(label: str, ready: timing.Prepared | None, steps: int) -> tuple[float, float]:
  """(the median seconds of a one-device program alone on process 0, before and after the steps
  together; this process's median together, 0 where it did not run it)."""
  me, several = jax.process_index(), jax.process_count() > 1
  if ready is not None:
    ready.state = ready.fresh()
    timing.step_untimed(ready)
  alone, together = [], 0.0
  for phase in ('alone', 'together', 'alone again'):
    multihost_utils.sync_global_devices(f'bench one device {label} {phase}')
    if ready is not None and (me == 0 if phase != 'together' else several):
      ready.times.clear()
      timing.time_steps(ready, steps)
      if phase == 'together':
        together = statistics.median(ready.times)
      else:
        alone += ready.times
  alone_s = float(
    multihost_utils.broadcast_one_to_all(np.float64(statistics.median(alone or [0.0])))
  )
  return alone_s, together


# ----------------------------------------------------------------------------- one bench's


@dataclasses.dataclass
class Calibration:
  """One bench's calibration (`start`): `pieces` ({stash policy: pieces}, each with the probes'
  results), the links' seconds, and the compiled probes that `again` runs in each round."""

  work: Workload
  settings: Sequence[ScheduleConfig]
  optimizer: str
  pieces: dict[str, dict]
  link_s: float
  allreduce_s: float
  slowdown: Callable[[int], float]
  wait: Callable[[int], float]
  one_device: Callable[[int], tuple[dict[str, float], dict[str, float]]]

  def again(self, rounds: int) -> dict[str, dict]:
    """The pieces of one of `rounds` rounds, fewer repeats each (their medians are used), the
    probes' results with them: the slowdown, the wait and the programs drift (and burst) too."""
    drift = dict(concurrent_slowdown=self.slowdown(1), collective_wait=self.wait(2))
    repeats = dict(repeats=max(3, 10 // rounds), micro_repeats=1)
    measured = measure_by_policy(self.work, self.settings, self.optimizer, **repeats)
    host.release_freed_memory()  # the pieces' (each program below first runs one step untimed)
    drift['one_device'], drift['program_slowdown'] = self.one_device(1)
    return {p: dict(m, **drift) for p, m in measured.items()}


def start(
  work: Workload, settings: Sequence[ScheduleConfig], optimizer: str, programs_now: bool = True
) -> Calibration:
  """Every setting's pieces (`measure_by_policy`), the links, and the probes compiled and run
  once; `programs_now`: the one-device programs timed too (else only compiled, for `again`)."""
  by_policy = measure_by_policy(work, settings, optimizer)
  pieces = by_policy['all']
  activation_shape = (*work.batch['inputs'].shape, work.cfg.d_model)
  link_s, allreduce_s = measure_links(activation_shape, pieces['grad_bytes'] // 4)
  slowdown = concurrent_slowdown_probe(work)
  wait = collective_wait_probe(tick_seconds(pieces), work.cfg.d_model)
  slowdown_s, wait_s = slowdown(3), wait(3)
  one_device_now = one_device_probe(settings, work, optimizer)
  one, program_slowdown = one_device_now(3) if programs_now else ({}, {})
  measured_once = dict(
    concurrent_slowdown=slowdown_s,
    one_device=one,
    program_slowdown=program_slowdown,
    collective_wait=wait_s,
  )
  by_policy = {p: dict(measured, **measured_once) for p, measured in by_policy.items()}
  return Calibration(
    work, settings, optimizer, by_policy, link_s, allreduce_s, slowdown, wait, one_device_now
  )


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


# ----------------------------------------------------------------------------- predictions


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


def columns(setting: ScheduleConfig, own: dict, link_s: float, allreduce_s: float) -> dict:
  """A bench row's calibration columns: the pieces `setting` is predicted from (`own`, measured
  with its stash policy), the links, and the simulator's ideal and predicted step times."""
  per_stage = lambda values: ';'.join(f'{v:.6g}' for v in values)
  micro, wait = micro_pieces(own, setting), own.get('collective_wait', 0.0)
  return {
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
    'link_s': link_s + wait if link_s else 0.0,
    'link_latency_s': wait if link_s else 0.0,
    'allreduce_s': allreduce_s,
    'concurrent_slowdown': concurrent_slowdown(setting, own),
    # the setting's step program on one device over the first group, and that over its pieces'
    # one-device step ('': not measured), by which its predicted_s scales the pieces
    'one_device_s': own.get('one_device', {}).get(setting.label, ''),
    'program_scale': program_scale(setting, own) or '',
    'ideal_s': simulated(setting, own, 0.0, 0.0, ideal=True),
    'predicted_s': simulated(setting, own, link_s, allreduce_s),
  }


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
    costs = cost_model.scaled(costs, scale)
  # as measured: the library's table executor, every tick ends with a ppermute
  return simulate.simulate(setting, costs, lockstep=not ideal).step_time


def program_scale(setting: ScheduleConfig, pieces: dict) -> float | None:
  """The setting's one-device program (`one_device_probe`) over the simulator's one-device step
  from these pieces (`simulate.program_scale`); None where it was not timed."""
  one_device_s = pieces.get('one_device', {}).get(setting.label)
  if not one_device_s:
    return None
  costs = stage_costs(setting, pieces, 0.0, 0.0, ideal=True)
  return simulate.program_scale(setting, costs, one_device_s)


def concurrent_slowdown(setting: ScheduleConfig, pieces: dict) -> float:
  """How much slower `setting`'s compute runs while the other devices compute: its own one-device
  program beside copies of itself (`one_device_probe`) where timed, else the whole-batch forward
  and backward's (`concurrent_slowdown_probe`), else 1."""
  own = pieces.get('program_slowdown', {}).get(setting.label)
  return own or pieces.get('concurrent_slowdown', 1.0)


def stage_costs(
  setting: ScheduleConfig, pieces: dict, link_s: float, allreduce_s: float, ideal: bool = False
) -> cost_model.StageCosts:
  """The simulator's costs of `setting` from the measured pieces and links (see `simulated`)."""
  stages = setting.num_stages
  fwd, bwd, update = pieces['fwd'], pieces['bwd'], pieces['update']
  micro = micro_pieces(pieces, setting)
  if len(fwd) != stages:  # pieces were measured on the G-stage split: merge for one device
    fwd, bwd, update = [sum(fwd)], [sum(bwd)], [sum(update)]
    micro = micro and ([sum(micro[0])], [sum(micro[1])])
  m = micro_size(setting)
  gathers = setting.fsdp or setting.shard_update  # the weights, each layer or once a step
  return cost_model.StageCosts(
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
      str(m), cost_model.StageCosts.input_grad_share
    ),
    param_bytes=_gathered(update, link_s, allreduce_s) if gathers else (),
  )


def _gathered(update_s, link_s: float, allreduce_s: float) -> list[float]:
  """FSDP's weights gathered per stage, in the links' timed units (one hop of the whole batch's
  activation is 1, `link_s` seconds): the all-reduce moves every gradient twice, so a stage's
  gather moves its share of them once, allreduce_s / 2 times that share (by its update's time,
  which is its parameters'). Free links (the ideal): any size, which costs nothing."""
  if not link_s:
    return [1.0] * len(update_s)
  total = sum(update_s) or 1.0
  return [allreduce_s / 2 * u / total / link_s for u in update_s]
