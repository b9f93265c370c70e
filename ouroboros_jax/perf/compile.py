"""Compile a run's training step for an accelerator without having one, and read its memory.

`compile_step(cfg, topology)` builds the run as `ouroboros train` does (the same staged model,
optimizer, schedule and batch shape) but with abstract parameters (`jax.eval_shape`: no memory
is spent on weights, whatever the model's size), compiles its step for the devices of a TPU
topology libtpu knows ('v5e:2x2', 'v5e:2x4', 'v4:2x2x1', 'v5p:2x2x1', 'v6e:2x2', ...: compile-only
devices, no TPU needed) or, without one, for the local backend's devices, and returns what one
device of the mesh holds (every device runs the same SPMD program):

  params_bytes, opt_state_bytes, ring_bytes   its shard of the state (ring: Ouroboros' stashes
                                              and error gradients; 0 for the exact schedules)
  stash_item_bytes  Ouroboros: one micro-batch's slot of its stash (None elsewhere)
  batch_bytes                                 its shard of the batch
  argument_bytes, output_bytes, alias_bytes, temp_bytes, code_bytes   XLA's `memory_analysis()`
                   of the step (as laid out on the device: TPU tiles pad small dimensions)
  peak_bytes       argument + output + temp - alias (the donated state is aliased to the new one)
  compiler_peak_bytes   XLA's own peak of live buffers (`peak_memory_in_bytes`); it can be
                   below temp_bytes, and the TPU compiler has accepted a step whose temporaries
                   alone exceeded the device, so a step it accepts may still not fit by
                   peak_bytes (the table says so)
  hbm_bytes        the device's memory (None: unknown, e.g. the CPU), `fits` and `over_bytes`
  compile_s        seconds to trace and compile the step

The TPU compiler refuses a program that does not fit its device; its message names the bytes
needed and the capacity, and `compile_step` reports those (`compiler_oom`, fits False) instead
of raising. Compile-only devices have no `memory_stats()`, so their capacity is read from the
compiler itself: its out-of-memory message for a probe program far too large for any device
(`device_capacity`; to its two decimals of a GiB, e.g. 15.75 GiB of a v5e's 16).
"""

from __future__ import annotations

import functools
import math
import os
import re
import time

import jax
import jax.numpy as jnp
import numpy as np

from ouroboros_jax import errors, placement
from ouroboros_jax.errors import ConfigError
from ouroboros_jax.models import model as transformer
from ouroboros_jax.models import partition
from ouroboros_jax.runtime import host
from ouroboros_jax.schedules import build_schedule
from ouroboros_jax.training import assemble, field_flags
from ouroboros_jax.training.config import TrainConfig
from ouroboros_jax.training.optimizer_setup import make_optimizer

GIB = 2**30
TOPOLOGY_EXAMPLES = 'v5e:2x2, v5e:2x4, v4:2x2x1, v5p:2x2x1, v6e:2x2'
INSTALL_TPU = 'pip install "ouroboros-jax[tpu]"'

# libtpu asks the machine it runs on for its TPU type and worker host names and logs a warning
# (or an E-line) for each it cannot find. Compiling for a topology needs neither, so on a machine
# without TPU chips these quiet it. Any valid accelerator type does (it only names a local
# host's bounds; the compiled numbers are the same whichever is set). ALLOW_MULTIPLE_LIBTPU_LOAD:
# compile-only clients share no chip, so two processes may load libtpu at once (otherwise the
# second one fails on /tmp/libtpu_lockfile).
_QUIET_LIBTPU = {
  'TPU_ACCELERATOR_TYPE': 'v5litepod-4',
  'TPU_WORKER_HOSTNAMES': 'localhost',
  'ALLOW_MULTIPLE_LIBTPU_LOAD': '1',
}


def quiet_libtpu() -> None:
  """Sets `_QUIET_LIBTPU` where the user has not, on a machine without TPU chips only (on a TPU
  VM libtpu finds the real values). Takes effect before JAX first loads libtpu."""
  if not host.tpu_chips_visible():
    for name, value in _QUIET_LIBTPU.items():
      os.environ.setdefault(name, value)


def topology_devices(name: str) -> list:
  """The compile-only devices of a TPU topology ('v5e:2x2', 'v4:2x2x1', 'v5e-4', ...).

  A topology smaller than one host ('v5e:1x1') is given its own host bounds, which libtpu
  otherwise assumes to be 2x2x1."""
  if not name.strip():
    raise ConfigError(f'--topology is empty; name a TPU topology, e.g. {TOPOLOGY_EXAMPLES}.')
  if not _libtpu_installed():
    raise ConfigError(f'--topology needs libtpu (the TPU compiler); install it: {INSTALL_TPU}.')
  quiet_libtpu()
  import jax
  from jax.experimental import topologies

  # Executables of compile-only devices cannot be read back from JAX's persistent cache.
  jax.config.update('jax_enable_compilation_cache', False)
  try:
    return topologies.get_topology_desc(name, 'tpu').devices
  except Exception as e:  # pylint: disable=broad-exception-caught
    reason = _one_line(e)
    dims = re.search(r'[:_=]((?:\d+x)*\d+)$', name)
    if 'chips_per_host_bounds' in reason and dims:
      bounds = [int(d) for d in dims.group(1).split('x')] + [1] * 3
      try:
        return topologies.get_topology_desc(name, 'tpu', chips_per_host_bounds=bounds[:3]).devices
      except Exception as e2:  # pylint: disable=broad-exception-caught
        reason = _one_line(e2)
  raise ConfigError(
    f'unknown TPU topology {name!r} (libtpu: {reason[:200]}); name one as '
    f'GENERATION:CHIPS, e.g. {TOPOLOGY_EXAMPLES}.'
  )


def _libtpu_installed() -> bool:
  """JAX's own test: $TPU_LIBRARY_PATH, else the libtpu package."""
  if os.path.isfile(os.environ.get('TPU_LIBRARY_PATH', '')):
    return True
  try:
    import libtpu  # noqa: F401
  except ImportError:
    return False
  return True


def compile_step(cfg: TrainConfig, topology: str | None = None) -> dict:
  """Compiles cfg's training step for `topology`'s devices (None: the local backend's) and
  returns its per-device memory (see the module docstring). User errors raise ConfigError;
  a step too large for the device is a result (fits False), not an error."""
  quiet_libtpu()
  devices = _target_devices(cfg, topology)
  # The step is traced here, maybe for another platform: pin the attention kernel the target's
  # run would pick ('auto' would look at this machine's backend).
  cfg = field_flags.override(cfg, {'attention': cfg.attention_kind(devices[0].platform)})
  run = cfg.schedule_config(devices[0].platform)
  schedule, state, batch = _abstract_step(cfg, run, devices)

  device = devices[0]
  report = _run_report(cfg, run, topology, device)
  report.update(
    params_bytes=shard_bytes(state.params),
    opt_state_bytes=shard_bytes(state.opt_state),
    ring_bytes=shard_bytes({k: v for k, v in state.ring.items() if k != placement.HOST}),
    host_ring_bytes=shard_bytes(state.ring.get(placement.HOST, {})),
    stash_item_bytes=_stash_item_bytes(state.ring),
    batch_bytes=shard_bytes(batch),
  )
  tokens = cfg.batch_size * cfg.model.seq_len
  if tokens > MAX_TOKENS:
    return _beyond_index_report(report, shard_bytes(state) + report['batch_bytes'], tokens, device)
  start = time.perf_counter()
  try:
    stats = schedule.step.lower(state, batch).compile().memory_analysis()
  except Exception as e:  # pylint: disable=broad-exception-caught
    oom = parse_out_of_memory(str(e))
    if oom is None:
      raise errors.CompilerError(
        f'the compiler failed on {cfg.schedule.label}: {_one_line(e)} (other settings may '
        'compile: `ouroboros plan` tries them; with --stash-memory pinned_host, try device)'
      ) from e
    report['compile_s'] = time.perf_counter() - start
    return _out_of_memory_report(report, shard_bytes(state) + report['batch_bytes'], *oom, e)
  report['compile_s'] = time.perf_counter() - start
  report['compiler_oom'] = None
  report.update(_memory_analysis(stats))
  return _verdict(report, device_capacity(device))


def _target_devices(cfg: TrainConfig, topology: str | None) -> list:
  """The devices cfg's step is compiled for, once cfg is checked against them."""
  cfg.validate()
  if cfg.growth or cfg.vcycle:
    raise ConfigError(
      '--growth and --vcycle change the model mid-run, so there is no one step to compile; '
      'compile each phase as its own model (--num-layers, --d-model) instead.'
    )
  devices = topology_devices(topology) if topology is not None else jax.devices()
  run = cfg.schedule
  needed = run.num_stages * run.data_parallel
  if topology is not None and needed > len(devices):
    raise ConfigError(
      f'{run.num_stages} stages x {run.data_parallel} data replicas need {needed} devices but '
      f'topology {topology} has {len(devices)}; use a larger topology or fewer '
      '--stages/--data-parallel.'
    )
  for flag, dtype in (('--dtype', cfg.model.dtype), ('--param-dtype', cfg.model.param_dtype)):
    _check_dtype(flag, dtype, devices[0])
  return devices


def _abstract_step(cfg: TrainConfig, run, devices: list) -> tuple:
  """(schedule, state, batch) of cfg's run on `devices`: the state and batch abstract (no memory
  spent), each leaf with its sharding."""
  layers_per_stage = cfg.plans.layers_per_stage
  params = jax.eval_shape(
    lambda: partition.to_staged(
      transformer.init_params(cfg.model, jax.random.key(cfg.seed)), layers_per_stage
    )
  )
  model = assemble.staged_model(cfg, layers_per_stage)
  schedule = build_schedule(run, model, make_optimizer(cfg), devices=devices)
  example = assemble.example_batch_shapes(cfg)  # a huge batch is a verdict, not an allocation
  batch = _placed(example, placement.named(placement.batch_spec(example), schedule.mesh))
  state = jax.eval_shape(schedule.init, params, batch)
  state = _placed(state, schedule.layout(state))
  return schedule, state, batch


def _stash_item_bytes(ring: dict) -> float | None:
  """One micro-batch slot of an Ouroboros stash on one device: its buffers [G, R, slots, ...]
  over their slots (None: no stash)."""
  stash = ring.get(placement.HOST, ring).get('stash')
  if not stash:
    return None
  return shard_bytes(stash) / jax.tree.leaves(stash)[0].shape[2]


def _run_report(cfg: TrainConfig, run, topology: str | None, device) -> dict:
  """What was compiled, for what: the report's first fields."""
  return {
    'preset': cfg.preset,
    'schedule': run.name,
    'stages': run.num_stages,
    'data_parallel': run.data_parallel,
    'microbatches': run.microbatches,
    'stash': run.stash_label,
    'forward': run.forward if run.name == 'ouroboros' else None,
    'flow': run.flow if run.name == 'ouroboros' else None,
    'dtype': cfg.model.dtype,
    'param_dtype': cfg.model.param_dtype,
    'topology': topology,
    'platform': device.platform,
    'device_kind': device.device_kind,
    'devices': cfg.schedule.num_stages * cfg.schedule.data_parallel,
  }


def _memory_analysis(stats) -> dict:
  """The compiled step's memory, from XLA's `memory_analysis()` (None: not reported)."""
  if stats is None:  # a backend that does not report
    return dict.fromkeys(_COMPILED_FIELDS)
  return dict(
    code_bytes=stats.generated_code_size_in_bytes,
    argument_bytes=stats.argument_size_in_bytes,
    output_bytes=stats.output_size_in_bytes,
    alias_bytes=stats.alias_size_in_bytes,
    temp_bytes=stats.temp_size_in_bytes,
    compiler_peak_bytes=getattr(stats, 'peak_memory_in_bytes', None),
    peak_bytes=stats.argument_size_in_bytes
    + stats.output_size_in_bytes
    + stats.temp_size_in_bytes
    - stats.alias_size_in_bytes,
  )


_COMPILED_FIELDS = (
  'code_bytes',
  'argument_bytes',
  'output_bytes',
  'alias_bytes',
  'temp_bytes',
  'compiler_peak_bytes',
  'peak_bytes',
)


def _out_of_memory_report(report, argument_bytes, required, capacity, error) -> dict:
  """The compiler ran out of memory: its figure is the peak. It counts every buffer, the
  arguments included (a 10 GiB argument and 64 GiB of temporaries read "HLO temporaries
  (74.00G)"), so the temporaries are that less the state and batch (unpadded: an estimate)."""
  report.update(dict.fromkeys(_COMPILED_FIELDS))
  report.update(
    temp_bytes=max(required - argument_bytes, 0),
    peak_bytes=required,
    compiler_oom=_one_line(error)[:300],
  )
  return _verdict(report, capacity)


# The most tokens one step may hold: XLA indexes an array's elements with 32-bit integers.
MAX_TOKENS = 2**31 - 1


def _beyond_index_report(report, argument_bytes, tokens, device) -> dict:
  """A step of more tokens than an XLA program indexes (MAX_TOKENS) cannot be built, let alone
  fit: it does not fit, its peak at least the arguments (a lower bound)."""
  report.update(dict.fromkeys(_COMPILED_FIELDS))
  report.update(
    compile_s=0.0,
    compiler_oom=None,
    argument_bytes=argument_bytes,
    peak_bytes=argument_bytes,
    beyond_index=f'a step of {tokens:,} tokens is more than one XLA program indexes '
    f'({MAX_TOKENS:,}): nothing was compiled; the peak is the arguments alone, a lower bound',
  )
  report = _verdict(report, device_capacity(device))
  report['fits'] = False
  return report


def _verdict(report: dict, capacity: int | None) -> dict:
  peak = report['peak_bytes']
  known = capacity is not None and peak is not None
  report['hbm_bytes'] = capacity
  report['fits'] = (peak <= capacity and not report['compiler_oom']) if known else None
  report['over_bytes'] = max(peak - capacity, 0) if known else None
  return report


# "... HLO temporaries (134.50G) exceeds available HBM (15.75G)." and "Used 17.2G of 15.75G hbm.
# Exceeded hbm capacity by 1.45G."; XLA writes sizes with binary prefixes (G = GiB).
_TEMPORARIES = re.compile(
  r'HLO temporaries \(([\d.]+\s*[KMGTP]?i?B?)\) exceeds available HBM \(([\d.]+\s*[KMGTP]?i?B?)\)'
)
_USED = re.compile(r'Used ([\d.]+\s*[KMGTP]?i?B?) of ([\d.]+\s*[KMGTP]?i?B?) hbm')


def parse_out_of_memory(message: str) -> tuple[int, int] | None:
  """(bytes the program needs, bytes the device has) from the TPU compiler's out-of-memory
  message; None for any other error."""
  if 'RESOURCE_EXHAUSTED' not in message and 'Ran out of memory' not in message:
    return None
  match = _TEMPORARIES.search(message) or _USED.search(message)
  return (parse_size(match.group(1)), parse_size(match.group(2))) if match else None


def parse_size(text: str) -> int:
  """'15.75G' (XLA's HumanReadableNumBytes: binary prefixes) -> bytes."""
  match = re.fullmatch(r'([\d.]+)\s*([KMGTP]?)i?B?', text.strip())
  return round(float(match.group(1)) * 1024 ** ' KMGTP'.index(match.group(2) or ' '))


@functools.lru_cache(maxsize=None)
def device_capacity(device) -> int | None:
  """The memory a program may use on `device`, in bytes; None where unknown (the CPU).

  A device with `memory_stats()` (a local GPU or TPU) says it; a compile-only TPU device has
  none, and the compiler's own figure is read from the message it gives for a probe needing
  2**42 bytes (4 TiB, beyond any device) of temporaries."""
  try:
    limit = (device.memory_stats() or {}).get('bytes_limit')
  except Exception:  # pylint: disable=broad-exception-caught  (compile-only devices)
    limit = None
  if limit or device.platform != 'tpu':
    return limit or None
  sharding = jax.sharding.SingleDeviceSharding(device)

  def probe(x_N):
    big_MxN = jax.lax.optimization_barrier(jnp.broadcast_to(x_N, (2**22, x_N.shape[0])) * 2)
    return big_MxN.sum(0)

  try:
    jax.jit(probe).lower(jax.ShapeDtypeStruct((2**18,), jnp.float32, sharding=sharding)).compile()
  except Exception as e:  # pylint: disable=broad-exception-caught
    oom = parse_out_of_memory(str(e))
    return oom[1] if oom else None
  return None


def _check_dtype(flag: str, dtype: str, device) -> None:
  """The device's compiler takes a matrix product in `dtype` (one line naming the flag if
  not); float32 every backend has."""
  if dtype == 'float32':
    return
  x_NxN = jax.ShapeDtypeStruct((128, 128), jnp.dtype(dtype), sharding=_single(device))
  try:
    jax.jit(lambda x: x @ x).lower(x_NxN).compile()
  except Exception as e:  # pylint: disable=broad-exception-caught
    raise ConfigError(
      f'{flag} {dtype}: the {device.device_kind} compiler does not take it '
      f'({_one_line(e)[:160]}); use {flag} float32.'
    ) from None


def _single(device):
  return jax.sharding.SingleDeviceSharding(device)


def _placed(tree, shardings):
  """Abstract leaves (ShapeDtypeStruct) of tree, each with its sharding."""
  return jax.tree.map(
    lambda a, s: jax.ShapeDtypeStruct(np.shape(a), a.dtype, sharding=s), tree, shardings
  )


def collective_bytes(hlo: str, op: str) -> int:
  """The bytes the `op` collectives ('all-gather', 'reduce-scatter', 'all-reduce', ...) of
  compiled HLO text (`Compiled.as_text()`) produce: their result shapes, once each as written
  (a collective inside a loop's body counts once)."""
  total = 0
  for line in hlo.splitlines():
    found = re.search(r'= (.*?) ' + op + r'(-start)?\(', line)
    if found:
      for dtype, dims in re.findall(r'([a-z]+\d+)\[([\d,]*)\]', found.group(1)):
        size = math.prod(int(d) for d in dims.split(',') if d)
        total += size * int(re.sub(r'\D', '', dtype)) // 8
  return total


def shard_bytes(tree) -> int:
  """Bytes one device holds of an abstract, sharded tree: each leaf's shard shape x item size."""
  return sum(
    math.prod(leaf.sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize
    for leaf in jax.tree.leaves(tree)
  )


def _one_line(exc: BaseException) -> str:
  return ' '.join(str(exc).split())


def format_report(report: dict) -> str:
  """The human table of one report: one device's share, the capacity and the verdict."""
  run = report['schedule'] + ''.join(
    f', {v}'
    for v in (report['stash'], report['forward'], report.get('flow'), report['dtype'])
    if v and v != 'batch'
  )
  where = report['topology'] or f'the local {report["platform"]}'
  plural = 's' if report['devices'] > 1 else ''
  lines = [
    f'{report["preset"]} / {run} on {where} ({report["device_kind"]}, {report["devices"]} '
    f'device{plural}), compiled in {report["compile_s"]:.1f} s; per device:'
  ]
  rows = [
    ('parameters', 'params_bytes'),
    ('optimizer state', 'opt_state_bytes'),
    ('ring / stash', 'ring_bytes'),
    ('temporaries', 'temp_bytes'),
    ('peak', 'peak_bytes'),
    ('device memory', 'hbm_bytes'),
  ]
  lines += [f'  {name:<16}{format_size(report[key]):>12}' for name, key in rows]
  if report['fits'] is False and report['compiler_peak_bytes'] and report['platform'] == 'tpu':
    lines.append(
      f'  (the compiler accepted the step: its own peak of live buffers is '
      f'{format_size(report["compiler_peak_bytes"])}, but its temporaries block and the '
      'arguments exceed the device)'
    )
  if report['compiler_oom']:
    lines.append(
      '  (the compiler ran out of memory: the peak is its figure, '
      'the temporaries it less the state)'
    )
  if report.get('beyond_index'):
    lines.append(f'  ({report["beyond_index"]})')
  lines.append(verdict_line(report))
  return '\n'.join(lines)


def verdict_line(report: dict) -> str:
  """One line: fits, does not fit by how much, or unknown."""
  if report['fits'] is None:
    return 'fits: unknown (the device does not say how much memory it has)'
  if report['fits']:
    spare = report['hbm_bytes'] - report['peak_bytes']
    return f'fits, {format_size(spare)} to spare per device'
  return (
    f'does not fit by {format_size(report["over_bytes"])} per device (peak '
    f'{format_size(report["peak_bytes"])} of {format_size(report["hbm_bytes"])})'
  )


def format_size(size: int | None) -> str:
  if size is None:
    return '?'
  return f'{size / GIB:.2f} GiB' if size >= GIB else f'{size / 2**20:.1f} MiB'
