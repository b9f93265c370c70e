"""Per-device memory of a schedule's step, read from the compiled program.

`memory_report` builds a schedule, compiles its step for one batch shape and returns, per device:

  params_bytes     this device's share of the parameters,
  ring_bytes       the schedule's carried in-flight buffers (Ouroboros: stashes + error gradient),
  argument_bytes   everything the compiled step reads (state and batch),
  temp_bytes       the step's scratch memory (activations, VJP residuals of the current batch),
  peak_estimate    argument + output + temp - aliased (donated) bytes.

The compiled numbers come from XLA's `memory_analysis()` of the per-device SPMD program, so they
are exact for the backend they were compiled on (CPU here; run it on a GPU for GPU numbers).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from ouroboros_jax import placement, staged
from ouroboros_jax.models import model as transformer
from ouroboros_jax.models import partition
from ouroboros_jax.schedules import ScheduleConfig, build_schedule
from ouroboros_jax.schedules.compensation import Compensation
from ouroboros_jax.schedules.config import ResolvedSchedule, require_resolved


def per_device_bytes(tree) -> int:
  """Bytes one device holds of a (possibly sharded) tree: the largest shard of every leaf."""
  total = 0
  for leaf in jax.tree.leaves(tree):
    shards = getattr(leaf, 'addressable_shards', None)
    total += shards[0].data.nbytes if shards else np.asarray(leaf).nbytes
  return total


def memory_report(
  cfg: transformer.ModelConfig,
  schedule_config: ResolvedSchedule,
  batch_size: int,
  layers_per_stage=None,
) -> dict:
  """The compiled step's per-device memory of the resolved setting `schedule_config` for a model
  `cfg` on batches of `batch_size` rows (arguments, temporaries, the compiler's peak)."""
  schedule_config = require_resolved(schedule_config, 'memory_report')
  layers_per_stage = layers_per_stage or partition.balance_layers(cfg, schedule_config.stage_groups)
  model = partition.transformer_stages(cfg, layers_per_stage)
  params = partition.to_staged(transformer.init_params(cfg, jax.random.key(0)), layers_per_stage)
  schedule = build_schedule(schedule_config, model, staged.adamw(1e-3))
  batch = {
    'inputs': jnp.zeros((batch_size, cfg.seq_len), jnp.int32),
    'targets': jnp.zeros((batch_size, cfg.seq_len), jnp.int32),
  }
  state = schedule.init(params, batch)
  stats = schedule.step.lower(state, batch).compile().memory_analysis()
  report = {
    'schedule': schedule_config.name,
    'stages': schedule_config.num_stages,
    'stash': schedule_config.stash_label if schedule_config.name == 'ouroboros' else '-',
    'params_bytes': per_device_bytes(state.params),
    'ring_bytes': per_device_bytes(state.ring),
  }
  if stats is not None:  # some backends do not report
    report.update(
      argument_bytes=stats.argument_size_in_bytes,
      temp_bytes=stats.temp_size_in_bytes,
      peak_estimate=(
        stats.argument_size_in_bytes
        + stats.output_size_in_bytes
        + stats.temp_size_in_bytes
        - stats.alias_size_in_bytes
      ),
    )
  return report


def format_table(rows: list[dict]) -> str:
  columns = [
    'schedule',
    'stages',
    'stash',
    'params_bytes',
    'ring_bytes',
    'argument_bytes',
    'temp_bytes',
    'peak_estimate',
  ]
  mib = lambda v: (
    f'{v / 2**20:.2f}' if isinstance(v, (int, np.integer)) and not isinstance(v, bool) else str(v)
  )
  header = ' | '.join(c.replace('_bytes', ' MiB') for c in columns)
  lines = [header, ' | '.join('---' for _ in columns)]
  for row in rows:
    lines.append(
      ' | '.join(
        str(row.get(c, '')) if c in ('schedule', 'stages', 'stash') else mib(row.get(c, ''))
        for c in columns
      )
    )
  return '\n'.join(lines)


def stash_comparison(
  cfg: transformer.ModelConfig, num_stages: int, batch_size: int, policies=('all',)
) -> list[dict]:
  """Backprop and Ouroboros with each stash mode (and each graph stash policy), for the same
  model and batch: the paper's ring (no compensation, the whole batch at once), on any platform."""
  ring = ScheduleConfig(
    name='ouroboros', num_stages=num_stages, microbatches=1, compensation=Compensation()
  )
  modes = [dataclasses.replace(ring, stash_policy=policy) for policy in policies]
  runs = [ScheduleConfig(name='backprop'), *modes, dataclasses.replace(ring, stash='replay')]
  platform = placement.platform()
  return [memory_report(cfg, run.resolve(platform, batch_size), batch_size) for run in runs]
