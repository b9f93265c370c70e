"""Checkpoints of a run: the whole TrainState, the data iterator's position and the run's meta.

Layout (Orbax `CheckpointManager`, one directory per step):

    OUT/checkpoints/<step>/state/   TrainState: step, params, opt_state (Orbax StandardSave); a
                                    run's in the per-layer form (training/relayout.py: no
                                    layout shapes it), its ring empty
    OUT/checkpoints/<step>/ring/    what an Ouroboros ring holds in flight, as its layout made it
                                    (none where the ring holds nothing; before the per-layer
                                    form the ring was part of state/)
    OUT/checkpoints/<step>/data/    {'iterator': Grain iterator state, 'crc32': fingerprint of
                                     every batch consumed so far}
    OUT/checkpoints/<step>/meta/    {'schedule', 'stages', 'layers_per_stage', 'config': {...}}

Saves are asynchronous: `save` returns once the arrays are copied off the devices and Orbax
writes them in the background. Orbax writes into `<step>.orbax-checkpoint-tmp*` and renames it to
`<step>` only when everything is on disk, so a save that was interrupted never looks like a
checkpoint and `latest_step` is always a complete one (tests/test_train.py checks this).

Arrays of zero size (a Transformer-XL stash with `mem_len 0`, an empty memory) are not written:
Orbax refuses them, and they hold no data. `save` leaves them out of the saved tree and `restore`
makes them again from the abstract state, so any state of any model and schedule round-trips.

Every save also records a checksum of the state's bits (`fingerprint`), checked on restore:
Orbax reads back some damaged files without complaint (a flipped byte in an array's data is
restored as a different number), and a resumed run must not continue from those.

A checkpoint that cannot be read back whole (unreadable files, missing manifests, an empty
`_METADATA`, a checksum that does not match) raises `CorruptCheckpointError`, naming the file
and the reason (`_why`: not the store specs the libraries add); `newest_readable` (for
`restore_newest` and sampling) then falls back to the newest readable one, with a warning on
stderr for each one skipped, and `set_aside` moves the newer ones out of the manager's way into
OUT/checkpoints-set-aside/ (nothing is ever deleted). When none reads, one error lists them.

A save that finds the disk full leaves `<step>.orbax-checkpoint-tmp`, never a checkpoint;
`remove_unfinished` removes it (training/loop.py, which reports the full disk in one line).

Restoring needs the abstract TrainState (shapes, dtypes and shardings) of the run being resumed;
`training/loop.py` gets it from the schedule's own `init`, so sharded multi-device states come back
onto the same devices with the same layout.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import logging
import math
import os
import re
import shutil
import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from ouroboros_jax.errors import CheckpointError, CorruptCheckpointError
from ouroboros_jax.placement import to_device
from ouroboros_jax.training import rundir

SUBDIR = 'checkpoints'
SET_ASIDE = 'checkpoints-set-aside'


_DRAIN_S = 1.0


@contextlib.contextmanager
def _quiet_reads():
  """Holds back what Orbax and TensorStore print while a damaged checkpoint fails to read
  (absl error logs, and a traceback per pending read that completes after Orbax closed its event
  loop); the failure is reported as one CorruptCheckpointError instead. A read that succeeds
  passes anything it printed on."""
  held, stderr = io.StringIO(), sys.stderr
  absl_logger = logging.getLogger('absl')
  level = absl_logger.level
  sys.stderr = held
  absl_logger.setLevel(logging.CRITICAL)
  try:
    yield
  except Exception:
    held = None
    time.sleep(_DRAIN_S)  # the reads still pending fail over the next moments: hold them too
    raise
  finally:
    sys.stderr = stderr
    absl_logger.setLevel(level)
    if held is not None and held.getvalue():
      stderr.write(held.getvalue())


def _first_line(exc: BaseException, limit: int | None = 300) -> str:
  lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
  text = next((line for line in lines if not line.startswith('Traceback')), type(exc).__name__)
  return ' '.join(text.split())[:limit]


# What TensorStore and Orbax add to a read error besides the file and the reason: the store's
# JSON spec, and Orbax's wrapper that prints the spec's Python binding.
_SPEC = re.compile(r'\s*\[tensorstore_spec.*$|\s*See full TensorStore details:.*$', re.S)
_LOCAL_FILE = re.compile(r'local file "([^"]+)"')
_VALUE_SIZE = re.compile(r'value of size (\d+)')
_JSON_FILES = ('metadata', '_METADATA', '_CHECKPOINT_METADATA', '_sharding')


def _why(exc: BaseException, step_dir: str) -> str:
  """Why a checkpoint did not read back, as `FILE: reason`: the innermost error the failure was
  raised from, without the store specs and bindings the libraries add. A JSON file that does not
  parse, and the data file of an array shorter than its index says (where one file has the size
  reported), are named themselves."""
  causes = [exc]
  while causes[-1].__cause__ is not None and len(causes) < 20:
    causes.append(causes[-1].__cause__)
  texts = [_first_line(_SPEC.sub('', str(e)), None) for e in causes]
  text = next((t for t in reversed(texts) if t and t != 'Exception'), texts[0])
  files = _LOCAL_FILE.findall(text)
  if not files:
    broken = _unparsable_json(step_dir)
    return (f'{broken}: {text}' if broken else text)[:400]
  reason = text.rsplit('": ', 1)[-1]  # after the last quoted path: the reason itself
  where = files[-1]
  size = _VALUE_SIZE.search(reason)
  if size and os.path.isdir(where):  # an OCDBT database: its data file of that size
    sized = [
      os.path.join(root, name)
      for root, _, names in os.walk(where)
      for name in names
      if os.path.basename(root) == 'd' and os.path.getsize(os.path.join(root, name)) == int(size[1])
    ]
    where = sized[0] if len(sized) == 1 else where
  return f'{where}: {reason}'[:400]


def _unparsable_json(step_dir: str) -> str | None:
  """The first of a checkpoint's JSON files that does not parse (empty or cut short), if any."""
  for root, _, names in sorted(os.walk(step_dir)):
    for name in sorted(names):
      if name in _JSON_FILES or os.path.basename(root) == 'array_metadatas':
        path = os.path.join(root, name)
        try:
          with open(path) as f:
            json.load(f)
        except ValueError:
          return path
        except OSError:
          continue
  return None


def _unreadable(manager: ocp.CheckpointManager, step: int, exc: Exception):
  where = os.path.join(str(manager.directory), str(step))
  return CorruptCheckpointError(
    f'checkpoint step {step} in {manager.directory} is unreadable ({_why(exc, where)})'
  )


def checkpoint_dir(out_dir: str) -> str:
  """OUT/checkpoints as an absolute path (Orbax wants one); OUT/checkpoints itself also works."""
  out_dir = os.path.abspath(os.path.expanduser(out_dir))
  if os.path.basename(out_dir) == SUBDIR:
    return out_dir
  return os.path.join(out_dir, SUBDIR)


def _handlers():
  return {
    'state': ocp.StandardCheckpointHandler(),
    'ring': ocp.StandardCheckpointHandler(),
    'data': ocp.JsonCheckpointHandler(),
    'meta': ocp.JsonCheckpointHandler(),
  }


DELETED = 'deleted'  # OUT/checkpoints/deleted: old checkpoints, renamed there whole, then removed


def make_manager(out_dir: str, *, keep: int = 3, read_only: bool = False) -> ocp.CheckpointManager:
  """The run's CheckpointManager: asynchronous saves, the newest `keep` checkpoints kept.

  read_only: for readers (sampling, inspection): creates and deletes nothing. (Orbax's own
  `read_only` option logs warnings on every use, so a reader is simply a manager that never saves.)
  """
  options = ocp.CheckpointManagerOptions(
    max_to_keep=keep,
    enable_async_checkpointing=not read_only,
    create=not read_only,
    # A writer removes what an interrupted save left behind (it never counted as a checkpoint).
    cleanup_tmp_directories=not read_only,
    # An old checkpoint is renamed away whole before it is deleted (`sweep`): a process ended
    # while Orbax deletes it never leaves half a checkpoint behind.
    todelete_subdir=None if read_only else DELETED,
  )
  return ocp.CheckpointManager(checkpoint_dir(out_dir), options=options, item_handlers=_handlers())


def latest_step(out_dir: str) -> int | None:
  """The newest complete checkpoint's step in OUT, or None (no manager is left open)."""
  if not os.path.isdir(checkpoint_dir(out_dir)):
    return None
  with _quiet_reads():  # a damaged step directory is reported when it is read, not here
    manager = make_manager(out_dir, read_only=True)
    try:
      return manager.latest_step()
    finally:
      manager.close()


def _words(x: jax.Array) -> jax.Array:
  """The bits of an array as uint32 words (one per element), whatever its dtype."""
  if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint32)
  unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]
  return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)


@jax.jit
def _fingerprint(tree):
  sums = []
  for x in jax.tree.leaves(to_device(tree)):  # a stash in host memory is summed on the device
    words = _words(x).ravel()
    index = jnp.arange(1, words.size + 1, dtype=jnp.uint32)
    # Fletcher-style: the plain sum catches any changed bit, the weighted one moved values.
    sums.append(jnp.stack([jnp.sum(words), jnp.sum(words * index)]))
  return jnp.stack(sums) if sums else jnp.zeros((0, 2), jnp.uint32)


def fingerprint(tree) -> list[int]:
  """A checksum of every bit of a tree of arrays (two uint32 sums per leaf, wrapping)."""
  sums = _fingerprint(tree)
  return [int(v) for v in np.asarray(sums.addressable_data(0)).ravel()]


def _is_empty(x) -> bool:
  return math.prod(x.shape) == 0


def without_empty(tree):
  """The tree with every zero-size leaf replaced by None (what is saved; Orbax refuses them)."""
  return jax.tree.map(lambda x: None if _is_empty(x) else x, tree)


def _with_empty(restored, abstract_state):
  """`restored` (saved `without_empty`) with the zero-size leaves of abstract_state made again,
  each with its dtype and sharding."""
  leaves, treedef = jax.tree.flatten(abstract_state)
  saved = iter(jax.tree.leaves(restored))
  # From the host, shard by shard: jit places zero-size outputs with wrong shard shapes (JAX
  # 0.10), and a callback makes only this process's shards, as a multi-process run needs.
  make = lambda a: jax.make_array_from_callback(
    a.shape, a.sharding, lambda index: np.zeros(a.shape, a.dtype)[index]
  )
  return jax.tree.unflatten(treedef, [make(a) if _is_empty(a) else next(saved) for a in leaves])


class _OwnWaitRecords(logging.Filter):
  """Drops Orbax's 'Waiting for previous save to complete took N seconds ... consider
  checkpointing less frequently'. Orbax counts every `wait_until_finished()` since the last save
  as the next save's wait, so the loop's own wait for a save to land (to report it, and before a
  SIGTERM stop) reads as advice to checkpoint less. It is not: a stop saves one more step
  whatever the interval. Anything else passes."""

  def filter(self, record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith('Waiting for previous save to complete took')


_OWN_WAIT_RECORDS = _OwnWaitRecords()


def quiet_own_wait() -> None:
  """From now on, Orbax's warning about the wait for the previous save is dropped
  (`_OwnWaitRecords`); `save` calls it."""
  absl_logger = logging.getLogger('absl')
  if _OWN_WAIT_RECORDS not in absl_logger.filters:
    absl_logger.addFilter(_OWN_WAIT_RECORDS)


def _ring_of(state):
  """A TrainState's ring when it holds anything (else None): saved as its own item."""
  ring = getattr(state, 'ring', None)
  return ring if jax.tree.leaves(without_empty(ring)) else None


def save(manager: ocp.CheckpointManager, state, data_state: dict, meta: dict) -> None:
  """Starts an asynchronous save of step int(state.step); `manager.wait_until_finished()` joins.
  What a ring holds in flight is its own item, 'ring'. The fingerprints of both are saved with
  the data state and checked by `restore`."""
  quiet_own_wait()
  step = int(jax.device_get(state.step))
  ring = _ring_of(state)
  items = {}
  if ring is not None:
    state, ring = state.replace(ring={}), without_empty(ring)
    items['ring'] = ocp.args.StandardSave(ring)
    data_state = dict(data_state, ring_fingerprint=fingerprint(ring))
  state = without_empty(state)
  data_state = dict(data_state, fingerprint=fingerprint(state))
  manager.save(
    step,
    args=ocp.args.Composite(
      state=ocp.args.StandardSave(state),
      **items,
      data=ocp.args.JsonSave(data_state),
      meta=ocp.args.JsonSave(meta),
    ),
    force=True,
  )


def _has_ring_item(manager: ocp.CheckpointManager, step: int) -> bool:
  return os.path.isdir(os.path.join(str(manager.directory), str(step), 'ring'))


def restore(manager: ocp.CheckpointManager, abstract_state, step: int | None = None):
  """(state, data_state, meta) of `step` (default: the latest), placed as abstract_state says.
  A ring saved as its own item is read where abstract_state's ring holds anything (else the
  state comes back with the ring it asked for, empty).

  Raises CorruptCheckpointError when Orbax cannot read it or its bits do not match the
  fingerprint saved with it.
  """
  step = manager.latest_step() if step is None else step
  if step is None:
    raise CheckpointError(f'no checkpoint in {manager.directory}.')
  split = _has_ring_item(manager, step)  # else the ring, if any, is inside the state item
  abstract_ring = _ring_of(abstract_state) if split else None
  whole = abstract_state.replace(ring={}) if split else abstract_state
  items = {'ring': ocp.args.StandardRestore(without_empty(abstract_ring))} if abstract_ring else {}
  try:
    with _quiet_reads():
      restored = manager.restore(
        step,
        args=ocp.args.Composite(
          state=ocp.args.StandardRestore(without_empty(whole)),
          **items,
          data=ocp.args.JsonRestore(),
          meta=ocp.args.JsonRestore(),
        ),
      )
  except Exception as e:  # pylint: disable=broad-exception-caught
    raise _unreadable(manager, step, e) from e
  data_state = dict(restored['data'])
  _check(manager, step, restored['state'], data_state.pop('fingerprint', None))
  state = _with_empty(restored['state'], whole)
  ring_fingerprint = data_state.pop('ring_fingerprint', None)
  if abstract_ring is not None:
    _check(manager, step, restored['ring'], ring_fingerprint)
    state = state.replace(ring=_with_empty(restored['ring'], abstract_ring))
  return state, data_state, restored['meta']


def _check(manager, step: int, tree, saved: list[int] | None) -> None:
  """A CorruptCheckpointError where a restored tree's bits do not match its saved fingerprint
  (checkpoints from before checksums have none)."""
  if saved is not None and fingerprint(tree) != saved:
    raise CorruptCheckpointError(
      f'checkpoint step {step} in {manager.directory} is damaged (its '
      'arrays do not match the checksum saved with them)'
    )


def saved_tree(manager: ocp.CheckpointManager, step: int, item: str = 'state') -> Any:
  """An item's tree of array metadata (shapes, dtypes) as the checkpoint holds it."""
  try:
    with _quiet_reads():
      return manager.item_metadata(step)[item].tree
  except Exception as e:  # pylint: disable=broad-exception-caught
    raise _unreadable(manager, step, e) from e


def read_meta(manager: ocp.CheckpointManager, step: int | None = None) -> dict:
  step = manager.latest_step() if step is None else step
  try:
    with _quiet_reads():
      return manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))['meta']
  except Exception as e:  # pylint: disable=broad-exception-caught
    raise _unreadable(manager, step, e) from e


def warn(text: str) -> None:
  """A warning about a checkpoint: on stderr, in every command (`train`, `sample`)."""
  print(text, file=sys.stderr, flush=True)


def newest_readable(
  manager: ocp.CheckpointManager,
  read: Callable[[int], Any],
  *,
  step: int | None = None,
  step_flag: str = '--resume-from',
  say: Callable[[str], None] = warn,
) -> tuple[Any, int, list[int]]:
  """(read(s), s, the newer steps that did not read) for the newest checkpoint s that `read`
  reads back whole, or for `step` alone.

  `read(s)` raises CorruptCheckpointError for a checkpoint that does not read back whole, and
  the one before it is tried; once one reads, each skipped one is reported with `say` (a
  warning on stderr). Any other error (a checkpoint that does not fit the run) passes. No
  readable one: one CorruptCheckpointError that lists them, and nothing else is said
  (`train --resume` and `sample` say the same); for `step` alone, its error with `step_flag`,
  the flag that picks another."""
  steps = sorted(manager.all_steps(), reverse=True)
  if step is not None:
    if step not in steps:
      raise CheckpointError(
        f'{step_flag} {step}: no checkpoint for that step in '
        f'{manager.directory} (it has {sorted(steps)}).'
      )
    steps = [step]
  unreadable, warnings = [], []
  for candidate in steps:
    try:
      found = read(candidate)
    except CorruptCheckpointError as e:
      rundir.quiet_disk_full()  # its abandoned reads log late; this error reports them all
      if step is not None:  # the one asked for: its error says it all
        raise CorruptCheckpointError(f'{e}; pick another with {step_flag} STEP.') from e
      unreadable.append(candidate)
      warnings.append(f'warning: {e}.')
      continue
    for warning in warnings:
      say(warning)
    return found, candidate, unreadable
  raise CorruptCheckpointError(
    f'no readable checkpoint in {manager.directory} (unreadable: steps {sorted(unreadable)}); '
    'start a new run with another --out.'
  )


def restore_newest(
  manager: ocp.CheckpointManager,
  abstract_state,
  check_meta: Callable[[dict], None],
  *,
  step: int | None = None,
  say: Callable[[str], None] = warn,
):
  """(state, data_state, step, the newer steps that did not read) of the newest checkpoint that
  reads back whole, or of `step` (`newest_readable`).

  check_meta(meta) raises for a checkpoint that does not fit the run (a user error: no
  fallback), or returns a `relayout.Move` (the state restored in the form the checkpoint holds,
  then re-staged and placed as abstract_state says; None: restored as it is). Each unreadable
  checkpoint is reported with `say` and the one before it is tried.
  """

  def read(candidate):
    move = check_meta(read_meta(manager, candidate))
    if move is None:
      state, data_state, _ = restore(manager, abstract_state, candidate)
      return state, data_state
    saved = saved_tree(manager, candidate)  # the saved shapes (a ring inside the state's)
    state, data_state, _ = restore(manager, move.abstract(abstract_state, saved), candidate)
    return move.apply(state, abstract_state, saved), data_state

  (state, data_state), step, unreadable = newest_readable(manager, read, step=step, say=say)
  return state, data_state, step, unreadable


def set_aside(out_dir: str, steps) -> str | None:
  """Moves the checkpoints of `steps` from OUT/checkpoints to OUT/checkpoints-set-aside (a
  resumed run must be free to write those steps again); returns where, None if nothing moved.
  Only process 0 moves; every process then waits for it."""
  steps = sorted(steps)
  if not steps:
    return None
  where = os.path.join(os.path.dirname(checkpoint_dir(out_dir)), SET_ASIDE)
  if jax.process_index() == 0:
    os.makedirs(where, exist_ok=True)
    for step in steps:
      target = os.path.join(where, str(step))
      suffix = 1
      while os.path.exists(target):  # set aside before: keep both
        target, suffix = os.path.join(where, f'{step}.{suffix}'), suffix + 1
      shutil.move(os.path.join(checkpoint_dir(out_dir), str(step)), target)
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices('ouroboros_jax.training.checkpoint.set_aside')
  return where


def remove_unfinished(out_dir: str) -> None:
  """Removes what saves cut short left in OUT/checkpoints (`<step>.orbax-checkpoint-tmp*`: never
  a checkpoint) and the old checkpoints set aside for deletion (DELETED). Only process 0
  removes; call it when no save is in flight."""
  where = checkpoint_dir(out_dir)
  if jax.process_index() != 0 or not os.path.isdir(where):
    return
  for name in os.listdir(where):
    if '.orbax-checkpoint-tmp' in name or name == DELETED:
      shutil.rmtree(os.path.join(where, name), ignore_errors=True)


# The deepest file a save writes below its temporary directory: an OCDBT data file of process 0.
_DEEPEST_FILE = ('state', 'ocdbt.process_0', 'd', '0' * 32)


def check_writable(out_dir: str, step: int, need_bytes: int | None = None) -> None:
  """Raises the OSError a save of `step` would meet in its first writes (a read-only or
  forbidden checkpoints directory, a path too long), before Orbax's threads start: a save that
  fails there leaves threads waiting for it until the process is killed. Writes and removes the
  save's own temporary directory with a file as deep as its deepest. With `need_bytes` (the
  size of a checkpoint), ENOSPC where less is free: a save that fills the disk half-way leaves
  Orbax's writers racing the clean-up. Process 0 probes (the others write into the same
  directory) and every process raises what it found; call it when no save is in flight."""
  probe = os.path.join(checkpoint_dir(out_dir), f'{step}.orbax-checkpoint-tmp')
  failure = _probe(probe, out_dir, need_bytes) if jax.process_index() == 0 else None
  if jax.process_count() > 1:  # all of them stop here, or none: the save is collective
    from jax.experimental import multihost_utils

    code = int(multihost_utils.broadcast_one_to_all(np.int32(failure.errno if failure else 0)))
    if failure is None and code:
      failure = OSError(code, os.strerror(code), probe)
  if failure is not None:
    raise failure


def _probe(probe: str, out_dir: str, need_bytes: int | None) -> OSError | None:
  """What `check_writable` finds on this process: the OSError, or None."""
  free = rundir.free_bytes(out_dir)
  if need_bytes is not None and free is not None and free < need_bytes:
    return OSError(
      errno.ENOSPC,
      f'{os.strerror(errno.ENOSPC)}: {need_bytes} bytes needed, {free} free',
      checkpoint_dir(out_dir),
    )
  path = os.path.join(probe, *_DEEPEST_FILE)
  try:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, 'wb') as f:
      f.write(b'\0')
  except OSError as e:
    return e
  finally:
    shutil.rmtree(probe, ignore_errors=True)
  return None


def write_failure(exc: BaseException | None, out_dir: str) -> OSError | None:
  """The OSError on a path in `out_dir` that `exc` is, or came from (None: another error)."""
  seen, root = set(), os.path.abspath(out_dir)
  while exc is not None and id(exc) not in seen:
    seen.add(id(exc))
    if isinstance(exc, OSError) and exc.filename is not None:
      if os.path.abspath(os.fsdecode(exc.filename)).startswith(root):
        return exc
    exc = exc.__cause__ or exc.__context__
  return None


def state_bytes(state) -> int:
  """Bytes of a state's arrays (the bulk of one checkpoint of it)."""
  return sum(x.nbytes for x in jax.tree.leaves(state) if hasattr(x, 'nbytes'))


def checkpoint_size(out_dir: str, step: int) -> int:
  """Bytes on disk of one checkpoint."""
  total = 0
  for root, _, files in os.walk(os.path.join(checkpoint_dir(out_dir), str(step))):
    total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
  return total


def abstract_like(tree) -> Any:
  """ShapeDtypeStructs with the shardings of a concrete tree: a restore target."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def restore_params_single_device(
  manager: ocp.CheckpointManager, step: int | None = None, device=None
) -> dict:
  """Only `state.params` of a checkpoint, all on one device, whatever mesh it was saved from.

  Used by sampling: the target tree is rebuilt from the checkpoint's own metadata, so the schedule
  (and the device count it needed) does not have to be rebuilt.
  """
  return restore_single_device(manager, step, device)['params']


def restore_single_device(
  manager: ocp.CheckpointManager, step: int | None = None, device=None
) -> dict:
  """The whole saved TrainState as a dict tree on one device (for inspection and tests), as the
  checkpoint holds it (the per-layer form: training/relayout.py), its ring under 'ring'.
  Raises CorruptCheckpointError like `restore`."""
  step = manager.latest_step() if step is None else step
  sharding = jax.sharding.SingleDeviceSharding(device or jax.devices()[0])
  names = ['state'] + (['ring'] if _has_ring_item(manager, step) else [])
  try:
    with _quiet_reads():
      metadata = manager.item_metadata(step)
      targets = {
        name: jax.tree.map(
          lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=sharding),
          metadata[name].tree,
          is_leaf=lambda m: hasattr(m, 'shape'),
        )
        for name in names
      }
      args = {name: ocp.args.StandardRestore(target) for name, target in targets.items()}
      restored = manager.restore(step, args=ocp.args.Composite(**args, data=ocp.args.JsonRestore()))
  except Exception as e:  # pylint: disable=broad-exception-caught
    raise _unreadable(manager, step, e) from e
  # The dict's leaves come in another order than the TrainState's: compare the per-leaf sums.
  for name, key in (('state', 'fingerprint'), ('ring', 'ring_fingerprint')):
    saved = restored['data'].get(key)
    pairs = lambda flat: sorted(zip(flat[::2], flat[1::2]))
    if name in names and saved is not None and pairs(fingerprint(restored[name])) != pairs(saved):
      raise CorruptCheckpointError(
        f'checkpoint step {step} in {manager.directory} is damaged (its '
        'arrays do not match the checksum saved with them)'
      )
  state = dict(restored['state'])
  if 'ring' in names:
    state['ring'] = restored['ring']
  return state
