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

A full disk: every file a run writes besides its checkpoints is written whole or not at all
(`append_whole` for the rows of metrics.jsonl and TensorBoard, `write_whole` for config.json and
summary.json, which replace the old file by a rename), so a write that finds no space leaves what
was there as it was. `is_disk_full` recognises such a failure however a library wrapped it, and
`quiet_disk_full` drops what Orbax, TensorStore and asyncio log about it from their threads: the
run reports it as one `DiskFullError` (training/loop.py).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import shutil
import signal
import sys
import tempfile
from typing import Iterator

from ouroboros_jax.errors import ConfigError

LOCK_NAME = '.lock'


# The outermost directory each `check_writable` made (a refused run takes them away again).
_MADE: list[str] = []


def check_writable(out_dir: str) -> None:
  """Creates OUT if needed and proves a file can be written there; one-line ConfigError if not.

  Cheap and free of JAX, so the CLI calls it before the slow set-up (imports, data, compiling).
  """
  try:
    missing = os.path.abspath(out_dir)
    while not os.path.lexists(os.path.dirname(missing) or '/') and missing != '/':
      missing = os.path.dirname(missing)
    made = not os.path.lexists(missing)
    os.makedirs(out_dir, exist_ok=True)
    if made:
      _MADE.append(missing)
    with tempfile.NamedTemporaryFile(dir=out_dir, prefix='.write-test-'):
      pass
  except OSError as e:
    reason = e.strerror or type(e).__name__
    if os.path.islink(out_dir) and not os.path.exists(out_dir):
      reason = f'it is a symbolic link to {os.readlink(out_dir)}, which does not exist'
    elif isinstance(e, FileExistsError) or (os.path.exists(out_dir) and not os.path.isdir(out_dir)):
      reason = 'it is a file, not a directory'
    elif isinstance(e, NotADirectoryError) or e.errno == errno.ENOTDIR:
      reason = 'a part of the path is a file'
    raise ConfigError(
      f'cannot write into --out {out_dir} ({reason}); choose a writable directory.'
    ) from None


def remove_unused() -> None:
  """Takes away the directories `check_writable` made for a run that was refused before it wrote
  anything into them (they hold nothing but directories and OUT's lock): a refused run leaves
  no trace."""
  while _MADE:
    root = _MADE.pop()
    files = {name for _, _, names in os.walk(root) for name in names}
    if files <= {LOCK_NAME}:
      shutil.rmtree(root, ignore_errors=True)


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


_STOP = {'signum': None, 'loop_running': False, 'agreed': False, 'shielded': False, 'due': False}


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
    if _STOP['shielded']:  # a save or its wait: the stop waits for the block's end
      _STOP['due'] = True
      return
    raise Terminated(signum)


@contextlib.contextmanager
def shielded(then_stop: bool = True) -> Iterator[None]:
  """A block a signal must not cut (a checkpoint's save, the wait for it to land): a request
  that would stop the run at once (a second signal) stops it when the block ends instead (with
  `then_stop`; without, the run is stopping already and goes on doing so). The
  watchdog still ends a process the block holds too long (`runtime/watchdog.py`); what a save
  cut short leaves is never a checkpoint (`checkpoint.remove_unfinished`)."""
  outer = _STOP['shielded']
  _STOP['shielded'] = True
  try:
    yield
  finally:
    _STOP['shielded'] = outer
  if not outer and _STOP['due'] and then_stop:
    _STOP['due'] = False
    raise Terminated(_STOP['signum'])


def requested_stop() -> int | None:
  """The signal a single-process loop was asked to stop with (None: none, or a multi-process
  loop, which stops where its processes agree: `stop_agreed`)."""
  return None if _STOP['agreed'] else _STOP['signum']


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
  _STOP.update(signum=None, loop_running=True, agreed=agreed, due=False)
  try:
    yield
  finally:
    _STOP.update(loop_running=False, agreed=False)


# ----------------------------------------------------------------------------- a full disk

_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_FULL_TEXTS = tuple(os.strerror(code) for code in _FULL_ERRNOS)  # 'No space left on device', ...


def is_disk_full(exc: BaseException | None) -> bool:
  """Whether `exc`, or an exception it came from, is a write that found no space (ENOSPC or a
  full quota), also as TensorStore reports it ('RESOURCE_EXHAUSTED: ... No space left on
  device')."""
  seen = set()
  while exc is not None and id(exc) not in seen:
    seen.add(id(exc))
    if isinstance(exc, OSError) and exc.errno in _FULL_ERRNOS:
      return True
    if any(text in str(exc) for text in _FULL_TEXTS):
      return True
    exc = exc.__cause__ or exc.__context__
  return False


def free_bytes(path: str) -> int | None:
  """Bytes an unprivileged writer may still use on the file system of `path` (None: unknown)."""
  try:
    stat = os.statvfs(path)
  except OSError:
    return None
  return stat.f_bavail * stat.f_frsize


def append_whole(fd: int, data: bytes) -> None:
  """Appends `data` to the file open as `fd` (O_APPEND) entirely or not at all: a write that
  fails part-way (a full disk) is cut off again, so the file keeps exactly what it had."""
  size = os.fstat(fd).st_size
  view = memoryview(data)
  try:
    while view:
      view = view[os.write(fd, view) :]
  except BaseException:
    os.ftruncate(fd, size)
    raise


def write_whole(path: str, text: str) -> None:
  """Writes `path` through a temporary file renamed over it: a write that fails (a full disk)
  leaves the old file, or none, never a part of the new one."""
  fd, temporary = tempfile.mkstemp(
    dir=os.path.dirname(path) or '.', prefix=f'.{os.path.basename(path)}.', suffix='.tmp'
  )
  try:
    try:
      os.fchmod(fd, 0o644)
      append_whole(fd, text.encode())
    finally:
      os.close(fd)
    os.replace(temporary, path)
  except BaseException:
    with contextlib.suppress(OSError):
      os.remove(temporary)
    raise


# asyncio's 'Task (or Future) exception was never retrieved' for Orbax's TensorStore reads of a
# checkpoint that did not read back whole: the read's other pending parts, abandoned once one
# failed (and reported).
_NEVER_RETRIEVED = 'exception was never retrieved'
_READ_FAILED = ('coro=<async_deserialize()', 'Error reading')


class _DiskFullRecords(logging.Filter):
  """Drops the log records about a write that found no space, and about the abandoned reads of
  an unreadable checkpoint: failures the run has reported itself, in one line."""

  def filter(self, record: logging.LogRecord) -> bool:
    exc = record.exc_info[1] if record.exc_info else None
    message = record.getMessage()
    if _NEVER_RETRIEVED in message and any(text in message for text in _READ_FAILED):
      return False
    return not (is_disk_full(exc) or any(text in message for text in _FULL_TEXTS))


_DISK_FULL_RECORDS = _DiskFullRecords()


def _late(exc: BaseException | None) -> bool:
  """The 'Event loop is closed' of a TensorStore write or read still pending when Orbax gave up
  on it (a full disk, a damaged checkpoint) and closed its event loop: TensorStore's thread calls
  `call_soon_threadsafe` on that loop and prints the error (as an unraisable or an uncaught
  one). Nothing is lost with it: the operation had failed already, and was reported."""
  if not (isinstance(exc, RuntimeError) and str(exc) == 'Event loop is closed'):
    return False
  first = exc.__traceback__
  return first is not None and first.tb_frame.f_code.co_name == 'call_soon_threadsafe'


def _without_late_unraisable(hook):
  def unraisable(info):
    if not _late(info.exc_value):
      hook(info)

  unraisable.drops_late = True
  return unraisable


def _without_late_excepthook(hook):
  def excepthook(kind, value, traceback):
    if not _late(value):
      hook(kind, value, traceback)

  excepthook.drops_late = True
  return excepthook


def quiet_disk_full() -> None:
  """From now on, what Orbax (absl) and asyncio log about a write that found no space is
  dropped (a traceback from each of Orbax's save threads, one per pending TensorStore write,
  some of them only when the process ends), and so is the late 'Event loop is closed' of the
  writes still pending (`_late`). The run reports the failure itself, in one line. Anything
  else passes."""
  for name in ('absl', 'asyncio'):
    logger = logging.getLogger(name)
    if _DISK_FULL_RECORDS not in logger.filters:
      logger.addFilter(_DISK_FULL_RECORDS)
  if not getattr(sys.unraisablehook, 'drops_late', False):
    sys.unraisablehook = _without_late_unraisable(sys.unraisablehook)
  if not getattr(sys.excepthook, 'drops_late', False):
    sys.excepthook = _without_late_excepthook(sys.excepthook)
