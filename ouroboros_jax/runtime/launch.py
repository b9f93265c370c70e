"""`ouroboros launch`: N local processes on 127.0.0.1, as a multi-host run on one machine.

    ouroboros launch --processes 2 --pin-cpus -- train --schedule ouroboros --stages 2

starts `python -m ouroboros_jax <args>` N times with OUROBOROS_COORDINATOR /
OUROBOROS_NUM_PROCESSES / OUROBOROS_PROCESS_ID set (see `distributed.py`), each process on the CPU
backend with one device, single-threaded (so one process is one core's worth of work) and, with
--pin-cpus, pinned to its own core with `taskset` (the i-th of the launcher's own cores). Their
output is forwarded line by line with a `[pI]` prefix (up to a child's `error:` line, its last word;
see `_forward`). The launcher returns the exit code of the first process to fail, in time, and names
it; when one process fails, the others end by themselves (a failing `train` posts its error for its
peers, see `distributed.fail_every_process`) or are killed `failure_grace_s` seconds later (a
process killed by a signal tells no one), so a launch never hangs.

The children never outlive the launcher: a SIGTERM, SIGHUP or Ctrl-C to it is passed on to every
child (a `train` then finishes its in-flight checkpoint and stops), the children are killed if
they have not stopped `grace_s` seconds later, and on Linux each child also asks the kernel to
kill it when the launcher dies without a chance to clean up (SIGKILL, a crash): PR_SET_PDEATHSIG.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Sequence

from ouroboros_jax.errors import ConfigError, UserError
from ouroboros_jax.runtime import distributed, host

_DEVICE_COUNT_FLAG = '--xla_force_host_platform_device_count'
SINGLE_THREADED_XLA = f'--xla_cpu_multi_thread_eigen=false {_DEVICE_COUNT_FLAG}=1'


LAUNCHABLE = ('train', 'bench')
# Set by the launcher for every child: a child's own value would contradict them.
_LAUNCHER_FLAGS = ('--coordinator', '--num-processes', '--process-id')


def check_command(args: list[str]) -> None:
  """A one-line ConfigError unless args is a `train` or `bench` command the launcher can run."""
  if args[0] not in LAUNCHABLE:
    raise ConfigError(
      f'launch runs `train` or `bench` in every process, not {args[0]!r}; e.g. '
      '`ouroboros launch --processes 2 -- train --stages 2`.'
    )
  given = [a.split('=')[0] for a in args if a.split('=')[0] in _LAUNCHER_FLAGS]
  if given:
    raise ConfigError(
      f'launch sets {", ".join(given)} for each process itself; drop '
      f'{"them" if len(given) > 1 else "it"} from the command after --.'
    )


def usable_cpus() -> list[int]:
  """The cores this process may run on (its affinity: `taskset -c 8-15 ouroboros launch` pins
  the children to 8, 9, ...), in order."""
  if hasattr(os, 'sched_getaffinity'):
    return sorted(os.sched_getaffinity(0))
  return list(range(os.cpu_count() or 1))


def free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def child_env(process_id: int, num_processes: int, port: int) -> dict:
  """The launcher's environment for process `process_id`: its place in the group (the
  coordination service at `port`), one single-threaded CPU device, and the caller's own XLA
  flags other than a device count."""
  env = dict(os.environ)
  env.pop(distributed.ENV_SERVICE_BIND, None)  # `_Children.start` sets it, hosting the service
  own_flags = [f for f in env.get('XLA_FLAGS', '').split() if not f.startswith(_DEVICE_COUNT_FLAG)]
  env.update(
    {
      distributed.ENV_COORDINATOR: f'127.0.0.1:{port}',
      distributed.ENV_NUM_PROCESSES: str(num_processes),
      distributed.ENV_PROCESS_ID: str(process_id),
      'JAX_PLATFORMS': 'cpu',
      'XLA_FLAGS': ' '.join((*own_flags, SINGLE_THREADED_XLA, *host.supported_cpu_xla_flags())),
      'OMP_NUM_THREADS': '1',
      'OPENBLAS_NUM_THREADS': '1',
      'MKL_NUM_THREADS': '1',
      'PYTHONUNBUFFERED': '1',
    }
  )
  return env


_PR_SET_PDEATHSIG = 1  # prctl(2)


def _die_with_parent() -> None:
  """Runs in the child between fork and exec: the kernel sends it SIGKILL when the launcher's
  thread that started it dies, whatever kills the launcher (the setting survives exec)."""
  libc = ctypes.CDLL(ctypes.util.find_library('c') or 'libc.so.6', use_errno=True)
  libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


class LaunchFailed(UserError):
  """A launched process failed; the message is its `error:` line (or its exit status), the exit
  code the first failure's."""

  def __init__(self, exit_code: int, message: str):
    super().__init__(message)
    self.exit_code = exit_code


class _Stop(Exception):
  """A signal asked the launcher to stop (SIGTERM, SIGHUP)."""

  def __init__(self, signum: int):
    super().__init__(signal.Signals(signum).name)
    self.signum = signum


def _raise_stop(signum, _frame):
  raise _Stop(signum)


_CPP_FRAME = re.compile(r'^\s*@\s+0x[0-9a-f]+\s')  # a line of a C++ stack dump (absl)


# A line of XLA's C++ log (absl): severity and date, time, thread, file:line.
_XLA_LOG = re.compile(r'^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+\s+\d+ \S+:\d+\] ')


def _forward(stream, prefix: str, out, errors: list, peer_failed) -> None:
  """Copies a child's lines with its prefix, and keeps its `error:` lines (`errors`).

  A child's `error:` line is its last word: what it prints after it is dropped. Once a peer has
  failed (peer_failed(): one ended with a non-zero status), the child's own line about it is on
  its way, and XLA's lines say nothing more: its client's log about the lost peer or the lost
  coordination service (process 0 hosts it), the C++ stack of the abort that follows. From the
  first XLA log line or stack frame after a peer's failure, only the child's `error:` line is
  forwarded."""
  said = quiet = False
  for line in iter(stream.readline, ''):
    own = line.startswith('error: ')
    if said or (quiet and not own):
      continue
    if not own and (_XLA_LOG.match(line) or _CPP_FRAME.match(line)) and _soon(peer_failed):
      quiet = True
      continue
    if own:
      errors.append(line[len('error: ') :].strip())
      said = True
    out.write(f'{prefix} {line}')
    out.flush()


def _soon(happened, within_s: float = 0.5) -> bool:
  """Whether happened() is true now or within within_s seconds. A killed peer's sockets close
  (and the survivor's XLA logs about it) a moment before its exit can be seen."""
  deadline = time.monotonic() + within_s
  while not happened():
    if time.monotonic() > deadline:
      return False
    time.sleep(0.01)
  return True


def _exit_status(code: int) -> int:
  """A child killed by signal N reports -N; a shell would say 128 + N."""
  return code if code > 0 else 128 - code


@dataclasses.dataclass(frozen=True)
class LaunchOptions:
  """How `launch` starts its children and how long it gives them to stop.

  program: what each child runs before the launch's args (default `python -m ouroboros_jax`;
    tests and experiments pass their own script).
  pin_cpus: pin child i to the i-th core the launcher may use (`taskset`; `usable_cpus`).
  grace_s: after a stop signal, the seconds the children have to stop (a `train` saves its
    checkpoint) before they are killed.
  failure_grace_s: after the first failure, the seconds the others have to stop.
  """

  program: Sequence[str] | None = None
  pin_cpus: bool = False
  grace_s: float = 45.0
  failure_grace_s: float = 10.0


def launch(
  num_processes: int,
  args: list[str],
  *,
  options: LaunchOptions | None = None,
  timeout_s: float | None = None,
  out=None,
  reasons: list | None = None,
) -> int:
  """Runs the N children to completion; returns 0 or the first non-zero exit code.

  options: how the children run and stop (default `LaunchOptions()`).
  timeout_s: if given, every process is stopped after this many seconds (then 124 is returned
  unless a process failed before).
  reasons: if given, a failed launch appends one line saying why (the first `error:` line a
  child printed, or the first failure's exit status).
  """
  out = out or sys.stdout
  options = options or LaunchOptions()
  _check_launch(num_processes, args, options, timeout_s)
  handlers = {}
  if threading.current_thread() is threading.main_thread():
    handlers = {sig: signal.signal(sig, _raise_stop) for sig in (signal.SIGTERM, signal.SIGHUP)}
  children = _Children(out)
  try:
    command = [*(options.program or [sys.executable, '-m', 'ouroboros_jax']), *args]
    try:
      children.start(num_processes, command, options.pin_cpus)
    except (KeyboardInterrupt, _Stop) as stop:  # a stop while they start: the same stop
      first_failure = children.stop(stop, options.grace_s)
    else:
      first_failure = children.supervise(options, timeout_s)
  finally:
    children.end()
    for sig, handler in handlers.items():
      signal.signal(sig, handler)
  codes = [p.returncode for p in children.procs]
  first_failure = first_failure or next((_exit_status(c) for c in codes if c), 0)
  if first_failure:
    out.write(f'[launch] exit codes {codes}; returning {first_failure}\n')
    if reasons is not None:
      reasons.append(children.reason(first_failure))
  return first_failure


def _check_launch(num_processes, args, options: LaunchOptions, timeout_s) -> None:
  if num_processes < 1:
    raise ConfigError(f'--processes must be >= 1, got {num_processes}.')
  if not args and options.program is None:
    raise ConfigError(
      'nothing to launch: give the command after --, e.g. '
      '`ouroboros launch --processes 2 -- train --schedule ouroboros --stages 2`.'
    )
  if options.program is None:
    check_command(args)
  if timeout_s is not None and not timeout_s > 0:
    raise ConfigError(f'--timeout must be a positive number of seconds, got {timeout_s}.')
  if options.pin_cpus and shutil.which('taskset') is None:
    raise ConfigError('--pin-cpus needs `taskset` (util-linux); install it or drop --pin-cpus.')


class _Children:
  """The launched processes, the threads that forward their output, and the error lines they
  printed."""

  def __init__(self, out):
    self.out, self.procs, self.threads, self.errors = out, [], [], []
    self.failed = threading.Event()
    self.failures = []  # (process index, exit code) of the failed processes, first failed first
    self.service = None  # the coordination service, hosted here (`distributed.host_service`)

  def start(self, num_processes: int, command: list[str], pin_cpus: bool) -> None:
    port, cores = free_port(), usable_cpus()
    self.service = distributed.host_service(f'127.0.0.1:{port}', num_processes)
    for i in range(num_processes):
      # Process 0's own service (JAX starts one there) on a spare port nothing connects to.
      spare = {distributed.ENV_SERVICE_BIND: f'127.0.0.1:{free_port()}'} if i == 0 else {}
      cmd = ['taskset', '-c', str(cores[i % len(cores)]), *command] if pin_cpus else command
      # Its own session, so a Ctrl-C in the terminal reaches the launcher only, which passes it
      # on; and it dies with the launcher, however the launcher dies.
      p = subprocess.Popen(
        cmd,
        env={**child_env(i, num_processes, port), **spare},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        preexec_fn=_die_with_parent if sys.platform.startswith('linux') else None,
      )
      self.procs.append(p)
      self.errors.append([])
      th = threading.Thread(
        target=_forward,
        args=(p.stdout, f'[p{i}]', self.out, self.errors[i], lambda i=i: self._peer_failed(i)),
        daemon=True,
      )
      th.start()
      self.threads.append(th)

  def supervise(self, options: LaunchOptions, timeout_s: float | None) -> int:
    """Waits for every child; after the first failure the others get options.failure_grace_s
    to stop (a `train` that fails tells its peers, which end within a second), after a stop
    signal options.grace_s (to save their checkpoint). Returns the first failure's exit status
    (0: none so far)."""
    out, failure_grace_s = self.out, options.failure_grace_s
    first_failure, failed_at, started = 0, None, time.monotonic()
    try:
      while True:
        now, running = time.monotonic(), any(p.poll() is None for p in self.procs)
        for i, code in self._new_failures():  # also those that ended since the last look
          self.failures.append((i, code))
          if not first_failure:
            first_failure, failed_at = _exit_status(code), now
            self.failed.set()
            then = (
              f'; the others stop when they next need it (killed after {failure_grace_s:g} s)'
              if running
              else ''
            )
            out.write(f'[launch] process {i} {_how_it_ended(code)}{then}\n')
            out.flush()
        if not running:
          break
        if failed_at is not None and now - failed_at > failure_grace_s:
          break
        if timeout_s is not None and now - started > timeout_s:
          out.write(f'[launch] timed out after {timeout_s:.0f} s; stopping all processes\n')
          return first_failure or 124
        time.sleep(0.1)
    except (KeyboardInterrupt, _Stop) as stop:
      stopped = self.stop(stop, options.grace_s)
      return first_failure or stopped
    return first_failure

  def stop(self, stop: KeyboardInterrupt | _Stop, grace_s: float) -> int:
    """Passes a stop signal on to every child (`grace_s` to end, then killed); 128 + signal."""
    signum = stop.signum if isinstance(stop, _Stop) else signal.SIGINT
    self.out.write(f'[launch] {signal.Signals(signum).name}: passing it on to every process\n')
    self.out.flush()
    _stop_children(self.procs, signum, grace_s)
    return 128 + signum

  def _peer_failed(self, me: int) -> bool:
    """Whether a process other than `me` has failed (for the thread forwarding me's output: it
    looks without reaping, so that Popen still sees the status)."""
    if self.failed.is_set():
      return True
    for i, p in enumerate(self.procs):
      if i == me:
        continue
      try:
        ended = os.waitid(os.P_PID, p.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
      except (ChildProcessError, AttributeError):  # reaped already; no waitid (not POSIX)
        if p.returncode not in (None, 0):
          return True
        continue
      if ended is not None and not (ended.si_code == os.CLD_EXITED and ended.si_status == 0):
        return True
    return False

  def _new_failures(self) -> list[tuple[int, int]]:
    """The processes seen failed since the last call, as (index, exit code), in the order they
    most likely failed: one killed by a signal before one that exited by itself (a survivor
    ends some milliseconds after its killed peer: both can end within one poll)."""
    seen = {i for i, _ in self.failures}
    new = [(i, p.poll()) for i, p in enumerate(self.procs) if i not in seen]
    return sorted(((i, c) for i, c in new if c not in (None, 0)), key=lambda f: (f[1] > 0, f[0]))

  def end(self) -> None:
    """Kills what still runs and waits for every child and its output."""
    for p in self.procs:
      if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
    for p in self.procs:
      p.wait()
    for th in self.threads:
      th.join(timeout=5)
    if self.service is not None:
      self.service.shutdown()

  def reason(self, first_failure: int) -> str:
    """One line: the first process to fail (in time) and how, with the `error:` line it printed,
    or for one killed by a signal (which says nothing) the line of a peer that saw it go; else
    the first `error:` line of any process (not a peer's echo of it), else an exit status."""
    codes = [p.returncode for p in self.procs]
    # Failures the supervising loop saw; else (a time-out, a stop signal: the launcher killed
    # them) the first non-zero status.
    first, code = (self.failures or [(i, c) for i, c in enumerate(codes) if c] or [(0, 0)])[0]
    if not self.failures and code < 0:
      code = _exit_status(code)  # killed by the launcher itself: no signal of its own to name
    own = [(i, line) for i, e in enumerate(self.errors) for line in e]
    own = [o for o in own if not o[1].endswith(distributed.PEER_FAILED)] or own  # not an echo
    if code is not None and code < 0:  # killed: its peers' lines say what it left behind
      said = next((f'; process {i}: {line}' for i, line in own if i != first), '')
      return f'process {first} {_how_it_ended(code)}{said}'
    own.sort(key=lambda o: o[0] != first)  # the first to fail, if it said why
    return next((f'process {i}: {line}' for i, line in own), None) or (
      f'process {first} exited with status {_exit_status(code) if code else first_failure}; '
      'see its output above.'
    )


def _how_it_ended(code: int) -> str:
  """A child's Popen return code in words (-N: killed by signal N)."""
  if code >= 0:
    return f'exited with status {code}'
  try:
    return f'was killed by {signal.Signals(-code).name}'
  except ValueError:
    return f'was killed by signal {-code}'


def _stop_children(procs, signum: int, grace_s: float) -> None:
  """Sends signum to every running child's process group and waits up to grace_s for them all
  (a `train` saves or abandons its checkpoint and exits); the caller kills what is left."""
  for p in procs:
    if p.poll() is None:
      try:
        os.killpg(p.pid, signum)
      except ProcessLookupError:
        pass
  deadline = time.monotonic() + grace_s
  for p in procs:
    try:
      p.wait(timeout=max(deadline - time.monotonic(), 0.0))
    except subprocess.TimeoutExpired:
      pass
