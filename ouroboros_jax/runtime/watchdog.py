"""A stop signal ends the process within seconds, even while JAX blocks in C++.

Python runs a signal handler only on the main thread, between two bytecodes: while that thread
sits in XLA (compiling a large program, constant folding, allocating, waiting for a step) a
SIGTERM or Ctrl-C is recorded and nothing more, for minutes. The command's handlers
(`cli._terminate`: a training loop stops at its next step boundary and saves, anything else
raises at once) keep their meaning; this watchdog only adds a deadline:

    watchdog.install(message)   # the main thread, before the set-up; message(signum, steady,
                                # signals received)
    watchdog.steady()           # the training loop has run its first step (compiled)
    watchdog.acknowledge()      # from the handler: the loop took the stop, it will save and stop
    watchdog.said()             # the command is printing its own last line and exiting

Python's C-level handler writes each signal's number to a wakeup file descriptor
(`signal.set_wakeup_fd`) from whatever thread it runs on, and a helper thread reads it (XLA
releases the GIL while it works). A signal during the set-up (before the first step has run)
ends the process SETUP_GRACE_S seconds later unless it has ended by itself: the handler usually
raises in time and the command prints its own line; otherwise the watchdog prints `error:
message(signum)` and exits with 128 + signum (`os._exit`: nothing else can run while the main
thread is in C++). Once training is steady, a stop the loop takes (`acknowledge`) is left to
the loop: it finishes its step and its checkpoint. A stop the handler has not even seen within
STEADY_GRACE_S (the main thread stuck in XLA) ends the process the same way, and so does a
second signal, SETUP_GRACE_S after it.

Only where Python's own handlers see the signal: a handler set with `signal.signal` or the
default SIGINT handler (JAX's preemption notifier takes SIGTERM itself in a multi-process run,
and stops the processes together, `rundir.stop_agreed`).
"""

from __future__ import annotations

import os
import select
import signal
import sys
import threading
import time
from typing import Callable

SETUP_GRACE_S = 3.0  # a handler that can run raises in well under a second
# A steady loop's main thread waits in XLA at most for the steps dispatched since its last sync
# (--log-every of them) or a checkpoint; it then sees the stop, saves and stops. Below the 45 s
# `ouroboros launch` gives its children before killing them.
STEADY_GRACE_S = 30.0

_STOP_WATCH = 0  # the byte `uninstall` writes; no signal has number 0

_lock = threading.Lock()  # held by whoever prints the process's last line


class _Watch:
  """One installation's state, shared by the main thread and the watchdog's."""

  def __init__(
    self, message: Callable[[int, bool], str], read_fd: int, write_fd: int, previous: int
  ):
    self.message, self.read_fd, self.write_fd, self.previous = message, read_fd, write_fd, previous
    self.steady = False  # the training loop has run its first step
    self.taken = False  # the loop has taken a stop (it saves, then stops)
    self.said = False  # the command prints its own last line
    self.deadlines: list[tuple[float, int, bool]] = []  # (time, signum, waived once taken)

  def receive(self, signum: int) -> None:
    now = time.monotonic()
    if self.steady and not self.deadlines:  # the first stop of a steady loop is the loop's
      self.deadlines.append((now + STEADY_GRACE_S, signum, True))
    else:
      self.deadlines.append((now + SETUP_GRACE_S, signum, False))

  def due(self) -> tuple[float | None, int | None]:
    """(seconds to the next deadline that counts or None, the signal whose deadline has come)."""
    live = [(t, s) for t, s, waived in self.deadlines if not (waived and self.taken)]
    if not live:
      return None, None
    at, signum = min(live)
    left = at - time.monotonic()
    return (max(left, 0.0), signum if left <= 0 else None)


_current: _Watch | None = None


def install(message: Callable[[int, bool], str]) -> bool:
  """Starts watching (from the main thread; elsewhere, and when installed already, it does
  nothing and returns False). message(signum, steady, signals): the line the watchdog prints
  when it ends the process (steady: the training loop had run its first step; signals: how many
  came); it runs on the watchdog's thread while the main thread may hold any lock, so it must
  not import or block."""
  global _current
  if _current is not None or threading.current_thread() is not threading.main_thread():
    return False
  read_fd, write_fd = os.pipe()
  os.set_blocking(write_fd, False)  # set_wakeup_fd requires it
  try:
    previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
  except ValueError:  # not the main thread of the main interpreter
    os.close(read_fd)
    os.close(write_fd)
    return False
  _current = _Watch(message, read_fd, write_fd, previous)
  threading.Thread(target=_watch, args=(_current,), name='ouroboros-watchdog', daemon=True).start()
  return True


def uninstall() -> None:
  """Gives the wakeup descriptor back and stops watching, unless a signal is pending: then the
  watch goes on to its deadline (the process is on its way out, and must get there)."""
  global _current
  watch, _current = _current, None
  if watch is None:
    return
  try:
    signal.set_wakeup_fd(watch.previous)
  except ValueError:
    pass
  if not watch.deadlines:
    os.write(watch.write_fd, bytes([_STOP_WATCH]))


def steady() -> None:
  """The training loop has run its first step: from now on a stop it takes is its own."""
  if _current is not None:
    _current.steady = True


def acknowledge() -> None:
  """From a signal handler, on the main thread: the training loop has taken the stop and will
  stop at its next step boundary, after saving; once steady, the watchdog leaves it that time."""
  if _current is not None:
    _current.taken = True


def said() -> None:
  """The command prints its own last line now: if the watchdog must still end the process, it
  does so without a line of its own."""
  with _lock:
    if _current is not None:
      _current.said = True


def _watch(watch: _Watch) -> None:
  while True:
    timeout, signum = watch.due()
    if signum is not None:
      _end(watch, signum)
    ready, _, _ = select.select([watch.read_fd], [], [], timeout)
    if not ready:
      continue
    for number in os.read(watch.read_fd, 64):
      if number == _STOP_WATCH:
        os.close(watch.read_fd)
        os.close(watch.write_fd)
        return
      watch.receive(number)


def _end(watch: _Watch, signum: int) -> None:
  _lock.acquire()  # never released: the process ends here
  if not watch.said:
    try:
      line = watch.message(signum, watch.steady, len(watch.deadlines))
    except Exception:  # pylint: disable=broad-exception-caught
      line = f'stopped by {signal.Signals(signum).name}.'
    print(f'error: {line}', file=sys.stderr, flush=True)
  sys.stdout.flush()
  os._exit(128 + signum)  # pylint: disable=protected-access
