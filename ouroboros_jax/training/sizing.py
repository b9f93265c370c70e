"""Whether a run's state can fit the devices at all, decided before anything is built.

A model far beyond the machine (`--d-model 100000000`) does not fail cleanly inside XLA: its
initialisation sits in constant folding or in the allocator for minutes, in C++, and prints
nothing. `check_fits(cfg)` refuses such a run first, in one line, from sizes alone:

  parameters       counted with `jax.eval_shape` of the model's own initialiser (no memory is
                   spent, whatever the size), at --param-dtype;
  optimizer state  `jax.eval_shape` of the run's optimizer `init` on those parameters, wrapped
                   in the staleness compensation Ouroboros applies with G > 1: Muon keeps
                   one momentum per kernel and Adam's two moments elsewhere (about 1x the
                   parameters), AdamW two moments (2x); weight prediction adds the latest
                   update (1x), DC-ASGD a mean square and the weights of the last G steps
                   (1 + G x; more with the pipelined forward, whose gaps reach 2G).

Their sum is a lower bound of what the run holds: activations, Ouroboros' ring of stashes and
XLA's temporaries come on top. It is compared with the memory of the devices the run uses, against
`memory_stats()`' bytes_limit on a GPU or TPU, and the host's RAM on the CPU (the physical memory,
or a smaller cgroup limit), where every local device shares it. Each device holds at least 1 / G of
the state (cut over G stages, copied to every data replica). A run the bound refuses can never fit;
a run it lets through may still run out of memory later, which the command reports in one line too.
"""

from __future__ import annotations

import os

import jax

from ouroboros_jax.errors import ConfigError, field_ref
from ouroboros_jax.models import model as transformer
from ouroboros_jax.schedules import compensation
from ouroboros_jax.training.config import TrainConfig
from ouroboros_jax.training.optimizer_setup import make_optimizer


def _bytes(tree) -> int:
  return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(tree))


def state_size(cfg: TrainConfig) -> tuple[int, int, int]:
  """(parameter count, parameter bytes, optimizer state bytes) of cfg's run, from shapes alone."""
  params = jax.eval_shape(lambda: transformer.init_params(cfg.model, jax.random.key(cfg.seed)))
  run = cfg.schedule
  comp = (
    cfg.resolved_compensation()
    if run.name == 'ouroboros' and run.num_stages > 1
    else compensation.Compensation()
  )
  tx = compensation.wrap(comp, make_optimizer(cfg), max_gap=max(run.num_stages, 1))
  opt_state = jax.eval_shape(tx.init, params)
  count = sum(leaf.size for leaf in jax.tree.leaves(params))
  return count, _bytes(params), _bytes(opt_state)


def host_memory() -> int | None:
  """The RAM this process may use: the physical memory, or the cgroup's limit when smaller
  (a container); None where neither can be read."""
  try:
    physical = os.sysconf('SC_PHYS_PAGES') * os.sysconf('SC_PAGE_SIZE')
  except (ValueError, OSError, AttributeError):
    physical = None
  limits = [physical] if physical else []
  for path in ('/sys/fs/cgroup/memory.max', '/sys/fs/cgroup/memory/memory.limit_in_bytes'):
    try:
      with open(path) as f:
        text = f.read().strip()
    except OSError:
      continue
    if text.isdigit() and int(text) < 2**60:  # 'max' / a huge number: no limit
      limits.append(int(text))
  return min(limits) if limits else None


def device_memory(device) -> int | None:
  """What a GPU or TPU device says it can hold (`memory_stats()`' bytes_limit); None where it
  does not say (the CPU, compile-only devices)."""
  try:
    return (device.memory_stats() or {}).get('bytes_limit') or None
  except Exception:  # pylint: disable=broad-exception-caught  (a backend without memory stats)
    return None


def check_fits(cfg: TrainConfig, devices=None) -> None:
  """A one-line ConfigError when cfg's parameters and optimizer state alone exceed the memory
  of the devices the run uses (`devices`: default JAX's); nothing is allocated or compiled."""
  devices = jax.devices() if devices is None else devices
  run = cfg.schedule
  used = devices[: max(run.num_stages * run.data_parallel, 1)]
  count, param_bytes, opt_bytes = state_size(cfg)
  total = param_bytes + opt_bytes
  # The state is cut over the stages and copied to every data replica: no device can hold less
  # than 1 / num_stages of it.
  share = total // max(run.num_stages, 1)
  if used[0].platform == 'cpu':  # this process's devices share the host's RAM
    wanted = max(run.num_stages * run.data_parallel, 1)
    local = (
      wanted
      if jax.process_count() == 1
      else sum(d.process_index == jax.process_index() for d in used)
    )
    capacity, need = host_memory(), share * local
    where = f'on this host ({local} devices)' if local > 1 else 'on this host'
    against = 'of host RAM'
  else:
    capacity, need = min((device_memory(d) or 0) for d in used) or None, share
    where = f'per device ({len(used)} devices)' if len(used) > 1 else 'on its device'
    against = f'per {used[0].device_kind}'
  if capacity is None or need <= capacity:
    return
  model = cfg.model
  spread = (
    f'more {field_ref("num_stages")} (now {run.num_stages}) on more devices'
    if run.name not in ('backprop', 'data_parallel')
    else f'{field_ref("name", "ouroboros")} or gpipe with N {field_ref("num_stages")} on N devices'
  )
  raise ConfigError(
    f'the model does not fit: {count:,} parameters ({_size(param_bytes)}) and their optimizer '
    f'state ({_size(opt_bytes)}) alone need {_size(need)} {where}, against {_size(capacity)} '
    f'{against}; lower {field_ref("d_model", model.d_model)}, '
    f'{field_ref("num_layers", model.num_layers)} or {field_ref("d_ff", model.d_ff)}, or use '
    f'{spread}.'
  )


def _size(num_bytes: int) -> str:
  for unit, scale in (('EiB', 2**60), ('PiB', 2**50), ('TiB', 2**40), ('GiB', 2**30)):
    if num_bytes >= scale:
      return f'{num_bytes / scale:.1f} {unit}'
  return f'{num_bytes / 2**20:.1f} MiB'
