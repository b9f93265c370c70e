"""The output directory of a run (OUT): checked before any work, and held by one run at a time.

    with rundir.claim(out_dir):      # creates OUT; raises ConfigError if it is unusable or busy
      ...train, writing into OUT...

Two runs writing into one OUT would interleave their metrics rows and replace each other's
checkpoints without a word, so a run holds an exclusive `fcntl` lock on OUT/.lock for its whole
life. The kernel drops the lock when the process ends, however it ends (a crash or `kill -9`
leaves no stale lock behind); the file keeps the holder's PID so the refusal can name it. In a
multi-process run only process 0 takes the lock (the processes of one run share OUT).

Stopping: a SIGTERM (a scheduler, `timeout`, the launcher) or Ctrl-C during training asks the
loop to stop at the next step boundary (`request_stop`); the loop then raises `Terminated` after
the in-flight checkpoint has landed, so a stopped run always leaves complete checkpoints. A
second signal stops at once.

In a multi-process run the processes must stop at one common step: JAX's distributed runtime
catches SIGTERM itself (its preemption notifier) and tells every process, and the loop asks
`stop_agreed` at every step, which is JAX's preemption sync point
(`multihost_utils.reached_preemption_sync_point`): true in every process at the same step, where
the loop saves a checkpoint and stops. A SIGINT or SIGHUP there is turned into that SIGTERM.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import signal
import tempfile
from typing import Iterator

from ouroboros_jax.errors import ConfigError

LOCK_NAME = '.lock'


def check_writable(out_dir: str) -> None:
  """Creates OUT if needed and proves a file can be written there; one-line ConfigError if not.

  Cheap and free of JAX, so the CLI calls it before the slow set-up (imports, data, compiling).
  """
  try:
    os.makedirs(out_dir, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=out_dir, prefix='.write-test-'):
      pass
  except OSError as e:
    reason = e.strerror or type(e).__name__
    if isinstance(e, FileExistsError) or (os.path.exists(out_dir) and not os.path.isdir(out_dir)):
      reason = 'it is a file, not a directory'
    elif isinstance(e, NotADirectoryError) or e.errno == errno.ENOTDIR:
      reason = 'a part of the path is a file'
    raise ConfigError(
      f'cannot write into --out {out_dir} ({reason}); choose a writable directory.'
    ) from None


def holder(out_dir: str) -> str:
  """The PID written by the run that holds OUT's lock ('unknown' if it cannot be read)."""
  try:
    with open(os.path.join(out_dir, LOCK_NAME)) as f:
      return f.read().strip() or 'unknown'
  except OSError:
    return 'unknown'


@contextlib.contextmanager
def claim(out_dir: str, *, lock: bool = True) -> Iterator[None]:
  """Checks OUT is writable and holds its lock until the block ends.

  lock=False only checks (the processes of a multi-process run other than process 0).
  Raises ConfigError when OUT cannot be written or another live run holds it.
  """
  check_writable(out_dir)
  if not lock:
    yield
    return
  path = os.path.join(out_dir, LOCK_NAME)
  fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
  try:
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      raise ConfigError(
        f'--out {out_dir} is in use by another run (process {holder(out_dir)} '
        f'holds {path}); wait for it to finish or choose another --out.'
      ) from None
    os.ftruncate(fd, 0)
    os.write(fd, f'{os.getpid()}\n'.encode())
    yield
  finally:
    os.close(fd)  # releases the lock; the file stays (removing it would race a waiting run)


class Terminated(KeyboardInterrupt):
  """The run was stopped by a signal (SIGTERM, SIGHUP or SIGINT), after its in-flight save."""

  def __init__(self, signum: int):
    super().__init__(signal.Signals(signum).name)
    self.signum = signum


_STOP = {'signum': None, 'loop_running': False, 'agreed': False}


def request_stop(signum: int) -> None:
  """From a signal handler: stop at the next step boundary if a training loop is running and
  this is the first request; otherwise stop now (raise Terminated). In a multi-process loop the
  request goes to JAX's preemption notifier as a SIGTERM, so that every process hears it."""
  first = _STOP['signum'] is None
  _STOP['signum'] = signum
  if first and _STOP['loop_running'] and _STOP['agreed']:
    os.kill(os.getpid(), signal.SIGTERM)
    return
  if not (first and _STOP['loop_running']):
    raise Terminated(signum)


def check_stop() -> None:
  """Called by a single-process loop between steps: raises Terminated once a stop was
  requested."""
  if _STOP['signum'] is not None and not _STOP['agreed']:
    raise Terminated(_STOP['signum'])


def stop_agreed(step: int) -> int | None:
  """Called by a multi-process loop at every step boundary, `step` the steps done: the signal to
  stop with when every process has agreed to stop here (they all get it at the same step), else
  None.

  The sync point is the step after the furthest step any process had reported when the notice
  came (Orbax's CheckpointManager reports the steps it saves to the same sync point, which is why
  these are training steps, not a count of calls). The loop reports its first step before it
  compiles anything; a notice that comes during the set-up before that (loading data, restoring)
  on a resumed run falls on step 1, which that run never reaches: the launcher's grace period
  then ends it."""
  if not _STOP['agreed']:
    return None
  from jax.experimental import multihost_utils

  if multihost_utils.reached_preemption_sync_point(step):
    return _STOP['signum'] or signal.SIGTERM
  return None


@contextlib.contextmanager
def stoppable(agreed: bool = False) -> Iterator[None]:
  """Marks a training loop as running: stop requests then wait for its next step boundary.
  agreed: the processes of a multi-process run stop together (`stop_agreed`)."""
  _STOP.update(signum=None, loop_running=True, agreed=agreed)
  try:
    yield
  finally:
    _STOP.update(loop_running=False, agreed=False)
