"""Checkpoints of a run: the whole TrainState, the data iterator's position and the run's meta.

Layout (Orbax `CheckpointManager`, one directory per step):

    OUT/checkpoints/<step>/state/   TrainState: step, params, opt_state, ring (Orbax StandardSave)
    OUT/checkpoints/<step>/data/    {'iterator': Grain iterator state, 'crc32': fingerprint of
                                     every batch consumed so far}
    OUT/checkpoints/<step>/meta/    {'schedule', 'stages', 'layers_per_stage', 'config': {...}}

Saves are asynchronous: `save` returns once the arrays are copied off the devices and Orbax
writes them in the background. Orbax writes into `<step>.orbax-checkpoint-tmp*` and renames it to
`<step>` only when everything is on disk, so a save that was interrupted never looks like a
checkpoint and `latest_step` is always a complete one (tests/test_train.py checks this).

Restoring needs the abstract TrainState (shapes, dtypes and shardings) of the run being resumed;
`train.py` gets it from the schedule's own `init`, so sharded multi-device states come back onto
the same devices with the same layout.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp

from ouroboros_jax.model import ConfigError

SUBDIR = 'checkpoints'


class CheckpointError(ConfigError):
  """No checkpoint where one is needed, or one that does not fit the flags (a user error)."""


def checkpoint_dir(out_dir: str) -> str:
  """OUT/checkpoints as an absolute path (Orbax wants one); OUT/checkpoints itself also works."""
  out_dir = os.path.abspath(os.path.expanduser(out_dir))
  if os.path.basename(out_dir) == SUBDIR:
    return out_dir
  return os.path.join(out_dir, SUBDIR)


def _handlers():
  return {'state': ocp.StandardCheckpointHandler(), 'data': ocp.JsonCheckpointHandler(),
          'meta': ocp.JsonCheckpointHandler()}


def make_manager(out_dir: str, *, keep: int = 3, read_only: bool = False) -> ocp.CheckpointManager:
  """The run's CheckpointManager: asynchronous saves, the newest `keep` checkpoints kept.

  read_only: for readers (sampling, inspection): creates and deletes nothing. (Orbax's own
  `read_only` option logs warnings on every use, so a reader is simply a manager that never saves.)
  """
  options = ocp.CheckpointManagerOptions(
      max_to_keep=keep, enable_async_checkpointing=not read_only, create=not read_only,
      # A writer removes what an interrupted save left behind (it never counted as a checkpoint).
      cleanup_tmp_directories=not read_only)
  return ocp.CheckpointManager(checkpoint_dir(out_dir), options=options,
                               item_handlers=_handlers())


def latest_step(out_dir: str) -> int | None:
  """The newest complete checkpoint's step in OUT, or None (no manager is left open)."""
  if not os.path.isdir(checkpoint_dir(out_dir)):
    return None
  manager = make_manager(out_dir, read_only=True)
  try:
    return manager.latest_step()
  finally:
    manager.close()


def save(manager: ocp.CheckpointManager, state, data_state: dict, meta: dict) -> None:
  """Starts an asynchronous save of step int(state.step); `manager.wait_until_finished()` joins."""
  step = int(jax.device_get(state.step))
  manager.save(step, args=ocp.args.Composite(
      state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state),
      meta=ocp.args.JsonSave(meta)), force=True)


def restore(manager: ocp.CheckpointManager, abstract_state, step: int | None = None):
  """(state, data_state, meta) of `step` (default: the latest), placed as abstract_state says."""
  step = manager.latest_step() if step is None else step
  if step is None:
    raise CheckpointError(f'no checkpoint in {manager.directory}.')
  restored = manager.restore(step, args=ocp.args.Composite(
      state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore(),
      meta=ocp.args.JsonRestore()))
  return restored['state'], restored['data'], restored['meta']


def read_meta(manager: ocp.CheckpointManager, step: int | None = None) -> dict:
  step = manager.latest_step() if step is None else step
  return manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))['meta']


def abstract_like(tree) -> Any:
  """ShapeDtypeStructs with the shardings of a concrete tree: a restore target."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                      tree)


def restore_params_single_device(manager: ocp.CheckpointManager, step: int | None = None,
                                 device=None) -> dict:
  """Only `state.params` of a checkpoint, all on one device, whatever mesh it was saved from.

  Used by sampling: the target tree is rebuilt from the checkpoint's own metadata, so the schedule
  (and the device count it needed) does not have to be rebuilt.
  """
  return restore_single_device(manager, step, device)['params']


def restore_single_device(manager: ocp.CheckpointManager, step: int | None = None,
                          device=None) -> dict:
  """The whole saved TrainState as a dict tree on one device (for inspection and tests)."""
  step = manager.latest_step() if step is None else step
  sharding = jax.sharding.SingleDeviceSharding(device or jax.devices()[0])
  tree = manager.item_metadata(step)['state'].tree
  target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=sharding),
                        tree, is_leaf=lambda m: hasattr(m, 'shape'))
  return manager.restore(step, args=ocp.args.Composite(
      state=ocp.args.StandardRestore(target)))['state']
