"""Multi-process / multi-host start-up: `jax.distributed.initialize` from flags or environment.

One process per host (or, on a CPU box, per core) joins a coordinator; afterwards `jax.devices()`
lists every device of every process and a schedule's mesh spans them all, exactly as on a GPU or
TPU cluster. Settings, first found wins:

  flags        --coordinator HOST:PORT --num-processes N --process-id I
  environment  OUROBOROS_COORDINATOR, OUROBOROS_NUM_PROCESSES, OUROBOROS_PROCESS_ID
               (set by `ouroboros launch` for its children)
  auto         --coordinator auto: JAX's own cluster detection (SLURM, Open MPI, Cloud TPU, ...)

Nothing is initialised when none is given: a plain `ouroboros train` stays single-process.
On CPU the collectives go through gloo. A process that dies makes the others fail within
`heartbeat_timeout_s` instead of hanging: the coordinator notices the missing heartbeat.

A process that fails ends the whole run within seconds (`fail_every_process`): it prints
its error, posts it in the coordination service's key-value store and exits at once, without the
shutdown barrier its peers would never reach; every process watches that key (`watch_peers`) and
exits with its exit status and one line naming the failed process. Without this, a peer waits in a
collective until the heartbeat time-out and then aborts with a C++ stack.

Under `ouroboros launch` the launcher hosts the coordination service (`host_service`), not
process 0: a killed process 0 then takes no service with it, and its peers end with their own
line (`watch_peers`) where XLA's client would abort them with a C++ stack within milliseconds.
Process 0's own service, which `jax.distributed.initialize` always starts, is bound to a spare
port nothing connects to (ENV_SERVICE_BIND).

A process other than 0 first waits up to `init_timeout_s` (--init-timeout) for the coordinator's
port to accept a connection, and stops with a one-line error if it never does: XLA's own client
would abort the process with a C++ stack after its time-out instead.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import os
import select
import socket
import sys
import threading
import time
import traceback

from ouroboros_jax.errors import ConfigError, PeerLostError

ENV_COORDINATOR = 'OUROBOROS_COORDINATOR'
ENV_NUM_PROCESSES = 'OUROBOROS_NUM_PROCESSES'
ENV_PROCESS_ID = 'OUROBOROS_PROCESS_ID'
# Where process 0 binds the service it starts when another process (the launcher) hosts the one
# every process connects to.
ENV_SERVICE_BIND = 'OUROBOROS_SERVICE_BIND'
FAILED_KEY = 'ouroboros_jax/failed'  # where a failing process posts its error for its peers


@dataclasses.dataclass(frozen=True)
class ProcessConfig:
  coordinator: str | None = None  # 'host:port', 'auto', or None (single process)
  num_processes: int | None = None
  process_id: int | None = None
  init_timeout_s: int = 120
  heartbeat_timeout_s: int = 30


def from_env(config: ProcessConfig) -> ProcessConfig:
  """Fills what the flags left empty from the OUROBOROS_* environment variables."""
  env = os.environ
  pick = lambda value, name, kind: (
    value if value is not None else (kind(env[name]) if env.get(name) else None)
  )
  try:
    return dataclasses.replace(
      config,
      coordinator=pick(config.coordinator, ENV_COORDINATOR, str),
      num_processes=pick(config.num_processes, ENV_NUM_PROCESSES, int),
      process_id=pick(config.process_id, ENV_PROCESS_ID, int),
    )
  except ValueError as e:
    raise ConfigError(
      f'bad {ENV_NUM_PROCESSES}/{ENV_PROCESS_ID} in the environment ({e}); they must be integers.'
    ) from None


def leave_signals_to_python() -> None:
  """Keeps JAX's preemption notifier from taking SIGTERM when the process group is joined: the
  command's own handler then stops each process at once (`bench`: with the rows it has), where
  the notifier would only record it for a training loop's agreed stop (`rundir.stop_agreed`)
  that a command without one never reaches."""
  import jax

  jax.config.update('jax_enable_preemption_service', False)


def initialize(config: ProcessConfig) -> bool:
  """Joins the process group if one is configured; returns whether it did."""
  config = from_env(config)
  if config.coordinator is None:
    if config.num_processes not in (None, 1) or config.process_id not in (None, 0):
      raise ConfigError(
        '--num-processes/--process-id need --coordinator HOST:PORT (or '
        '--coordinator auto on a cluster JAX can detect).'
      )
    return False
  if config.init_timeout_s < 1:
    raise ConfigError(f'--init-timeout must be >= 1 second, got {config.init_timeout_s}.')
  import jax

  if config.coordinator != 'auto':
    if config.num_processes is None or config.process_id is None:
      raise ConfigError(
        f'--coordinator {config.coordinator} also needs --num-processes and '
        '--process-id (or their OUROBOROS_* environment variables).'
      )
    if config.num_processes < 1:
      raise ConfigError(f'--num-processes must be >= 1, got {config.num_processes}.')
    if not 0 <= config.process_id < config.num_processes:
      raise ConfigError(
        f'--process-id {config.process_id} is outside 0..'
        f'{config.num_processes - 1}; give each process its own id.'
      )
  if (jax.config.jax_platforms or 'cpu').startswith('cpu') or os.environ.get(
    'JAX_PLATFORMS', ''
  ).startswith('cpu'):
    jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  if config.coordinator != 'auto' and config.process_id != 0:
    wait_for_coordinator(config.coordinator, config.init_timeout_s)
  kwargs = dict(
    initialization_timeout=config.init_timeout_s,
    heartbeat_timeout_seconds=config.heartbeat_timeout_s,
  )
  if config.coordinator == 'auto':
    jax.distributed.initialize(**kwargs)
  else:
    jax.distributed.initialize(
      coordinator_address=config.coordinator,
      num_processes=config.num_processes,
      process_id=config.process_id,
      coordinator_bind_address=os.environ.get(ENV_SERVICE_BIND) or None,
      **kwargs,
    )
  return True


def host_service(address: str, num_processes: int):
  """Starts the coordination service for `num_processes` processes at `address` in this process
  (the launcher's), as `jax.distributed.initialize` does in process 0; returns it, to
  `.shutdown()` once every process has ended. JAX has no public call for a service alone."""
  from jax._src.lib import _jax  # pylint: disable=import-outside-toplevel

  return _jax.get_distributed_runtime_service(
    address, num_processes, heartbeat_timeout=ProcessConfig.heartbeat_timeout_s
  )


def wait_for_coordinator(address: str, timeout_s: float) -> None:
  """Returns once HOST:PORT accepts a TCP connection; ConfigError after timeout_s seconds."""
  host, _, port = address.rpartition(':')
  if not host or not port.isdigit():
    raise ConfigError(f'--coordinator {address!r} is not HOST:PORT (e.g. 10.0.0.1:1234).')
  deadline, reason = time.monotonic() + timeout_s, 'no answer'
  while True:
    try:
      with socket.create_connection((host.strip('[]'), int(port)), timeout=2.0):
        return
    except OSError as e:
      reason = e.strerror or type(e).__name__
    if time.monotonic() >= deadline:
      raise ConfigError(
        f'cannot reach the coordinator {address} within {timeout_s:g} s '
        f'({reason}); start process 0 there first, fix --coordinator, or wait '
        'longer with --init-timeout.'
      )
    time.sleep(0.5)


def _client():
  """JAX's coordination-service client, or None in a single-process run."""
  from jax._src import distributed as jax_distributed  # the client is not public API

  return jax_distributed.global_state.client


def is_multi_process() -> bool:
  return 'jax' in sys.modules and _client() is not None


_FAILING = threading.Event()  # this process is ending with its own error: its watch stands down
PEER_FAILED = 'stops too.'  # how the line of a process ended by a peer's failure ends


def announce_failure(message: str, code: int) -> None:
  """Posts `message` and the exit status under FAILED_KEY for every peer's `watch_peers` (the
  first one posted wins). Not where the coordination service is gone (process 0 lost): a call
  to it would wait for it, and XLA's client would end the process meanwhile."""
  import jax

  if _service_gone():
    return
  client, posted = _client(), f'{jax.process_index()}\t{code}\t{message}'
  _bounded(lambda: client.key_value_set(FAILED_KEY, posted))  # a peer posted first: it raises


def end_stopped(message: str, code: int) -> None:
  """Ends a process of a multi-process run that a signal stopped (every process got it): its
  `error: message` line, then exits with `code` without the shutdown barrier, which peers that
  are ending too would leave to crash. It says first that it ends as planned, so that a peer
  whose own stop comes a moment later does not take it for a lost process (`_watch_pids`)."""
  _claim_failure()  # this process's own watches stand down
  _say_done()
  _last_words(f'error: {message}', code)
  _end_now(code)


def _say_done() -> None:
  """Posts that this process ends as planned, for its peers' `_watch_pids` (`_ended_by_plan`)."""
  import jax

  if _service_gone():
    return
  client, me = _client(), jax.process_index()
  _bounded(lambda: client.key_value_set(f'{_DONE_KEY}/{me}', '1'))


def _end_now(code: int) -> None:
  """Exits at once, skipping the shutdown barrier peers never reach. Process 0 hosts the
  coordination service: it stays a moment longer, so that the peers' watches read the failure
  and end cleanly before the service goes (they would abort with a C++ stack instead)."""
  import jax

  _last_words(None, code)
  if jax.process_index() == 0:
    time.sleep(1.5)
  os._exit(code)  # pylint: disable=protected-access


def _last_words(line: str | None, code: int) -> None:
  """Writes `line` to stderr as this process's last output, which must end with `code` within
  LAST_WORDS_S seconds (it ends sooner: `_end_now`).

  XLA's client sees a lost coordination service (process 0 killed) at the same moment as this
  process or sooner, and logs its fatal error and a C++ stack to stderr, then aborts (status
  134). From here on stdout and stderr are a pipe that is full and never read: a thread that
  writes to them waits, so XLA neither adds to this line nor aborts before `os._exit(code)`.
  Process 0's go to /dev/null instead: the coordination service it hosts must go on answering
  its peers (`_end_now`), whatever it logs."""
  import jax

  sys.stdout.flush()
  sys.stderr.flush()
  if _MUTED:
    return
  real = 2
  with contextlib.suppress(OSError):
    real = os.dup(2)
    if jax.process_index() == 0:
      _MUTED.append(os.open(os.devnull, os.O_WRONLY))
    else:
      _MUTED.extend(_full_pipe())
    os.dup2(_MUTED[-1], 1)
    os.dup2(_MUTED[-1], 2)
  _MUTED.append(real)
  if line is not None:
    with contextlib.suppress(OSError):
      os.write(real, f'{line}\n'.encode())
  # A safety net: should the thread ending the process block (on a write to the blocked
  # stderr), the timer ends it, with its status.
  timer = threading.Timer(LAST_WORDS_S, os._exit, (code,))  # pylint: disable=protected-access
  timer.daemon = True
  timer.start()


LAST_WORDS_S = 10.0
_MUTED: list = []  # what stdout and stderr now write to (and the real stderr), once silenced


def _full_pipe() -> tuple[int, int]:
  """A pipe whose buffer is full: writing to its write end blocks for good."""
  read, write = os.pipe()
  os.set_blocking(write, False)
  chunk = b'\0' * 65536
  while True:
    try:
      os.write(write, chunk if len(chunk) > 1 else b'\0')
    except BlockingIOError:
      if len(chunk) == 1:
        break
      chunk = chunk[: len(chunk) // 2]
  os.set_blocking(write, True)
  return read, write


def _service_gone() -> bool:
  """Whether the coordination service (process 0's) is gone: its port refuses connections, or
  does not answer within a second. False in process 0, which hosts it."""
  import jax
  from jax._src import distributed as jax_distributed  # where JAX keeps the address

  address = jax_distributed.global_state.coordinator_address
  if jax.process_index() == 0 or not address:
    return False
  host, _, port = address.rpartition(':')
  try:
    with socket.create_connection((host.strip('[]'), int(port)), timeout=1.0):
      return False
  except (OSError, ValueError):
    return True


def _bounded(call, timeout_s: float = 2.0):
  """call() on a helper thread; its result, or None if it raised or took over timeout_s (a call
  to a coordination service that went away waits for it: the thread is left behind)."""
  result = []

  def run():
    with contextlib.suppress(Exception):
      result.append(call())

  thread = threading.Thread(target=run, name='ouroboros-bounded-call', daemon=True)
  thread.start()
  thread.join(timeout_s)
  return result[0] if result else None


def watch_peers(poll_s: float = 0.5) -> threading.Event:
  """Starts a daemon thread that ends this process, with the failed peer's exit status and one
  `error:` line, as soon as a peer posts a failure; returns the event that stops the watch (also
  set at exit, before JAX shuts the client down)."""
  import jax

  client, me, stop = _client(), jax.process_index(), threading.Event()

  def watch():
    while not stop.is_set():
      try:
        posted = client.blocking_key_value_get(FAILED_KEY, int(poll_s * 1000))
      except Exception:  # pylint: disable=broad-exception-caught  (nothing posted yet)
        continue
      process, code, message = posted.split('\t', 2)
      if stop.is_set() or process == str(me) or not _claim_failure():
        return
      _last_words(
        f'error: process {process} failed ({message}); process {me} {PEER_FAILED}', int(code)
      )
      _end_now(int(code))

  thread = threading.Thread(target=watch, name='ouroboros-watch-peers', daemon=True)
  thread.start()
  with contextlib.suppress(Exception):  # for the peers' `_watch_pids`
    client.key_value_set(f'{_PROCESS_KEY}/{me}', _identity(os.getpid()))
  pids = threading.Thread(
    target=_watch_pids, args=(client, me, stop), name='ouroboros-watch-pids', daemon=True
  )
  pids.start()

  def end_watch():
    # Before JAX's own exit handler shuts the client down (atexit runs the later one first),
    # and before the interpreter ends: a daemon thread that comes back from C++ then aborts the
    # process ("FATAL: exception not rethrown").
    with contextlib.suppress(Exception):  # an ending process is not a lost one
      client.key_value_set(f'{_DONE_KEY}/{me}', '1')
    stop.set()
    thread.join(timeout=2 * poll_s + 1)
    pids.join(timeout=1)

  atexit.register(end_watch)
  return stop


def fail_every_process(message: str | None, code: int) -> None:
  """Ends a failed process of a multi-process run now: prints `error: message` (None: the
  traceback of the exception being handled), posts it for the peers' `watch_peers`, and exits
  with `code` without waiting for peers that will never arrive. Call it from an except block."""
  if not _claim_failure():  # a lost peer's watch is ending this process with its own line
    time.sleep(5)
  _FAILING.set()
  if message is None:
    traceback.print_exc()
    exc = sys.exc_info()[1]
    message = f'{type(exc).__name__}: {exc}' if exc is not None else 'it failed'
    _last_words(None, code)
  else:
    _last_words(f'error: {message}', code)
  announce_failure(' '.join(message.split())[:300], code)
  _end_now(code)


# ----------------------------------------------------------------------------- a lost peer

# What the loop has reached, for the line of a lost peer (`note_progress`).
_PROGRESS: dict = {'step': None, 'out': None}
# The texts of a collective whose peer went away: gloo's (the CPU's collectives) own, and the
# socket errors it passes on.
_LOST_TEXTS = ('Gloo', 'Connection closed by peer', 'Connection reset by peer', 'Broken pipe')


def note_progress(step: int | None, out_dir: str | None = None) -> None:
  """The training loop's step (None: not training yet) and OUT, for `peer_lost_message`."""
  _PROGRESS['step'] = step
  if out_dir is not None:
    _PROGRESS['out'] = out_dir


def is_peer_lost(exc: BaseException) -> bool:
  """Whether `exc` is a collective of a multi-process run that failed because a peer went away
  (killed, crashed, its host gone): XLA's runtime error with gloo's or the socket's text."""
  import jax

  # XLA's runtime error, or the ValueError a collective inside a jitted call raises (Orbax's
  # save barrier: `multihost_utils.sync_global_devices`, seen under load on 2 cores).
  errors = (jax.errors.JaxRuntimeError, RuntimeError, ValueError)
  chain = []  # the error and what it was raised from (a save thread's error, re-raised)
  while exc is not None and exc not in chain and len(chain) < 8:
    chain.append(exc)
    exc = exc.__cause__ or exc.__context__
  return is_multi_process() and any(
    isinstance(e, errors) and any(text in str(e) for text in _LOST_TEXTS) for e in chain
  )


def peer_lost_message(how: str, peer: int | None = None) -> str:
  """One line: which process was lost (`peer`; with two processes, the other one), at which
  step of the loop, and how to resume."""
  import jax

  me, count = jax.process_index(), jax.process_count()
  if peer is None and count == 2:
    peer = 1 - me
  who = f'process {peer}' if peer is not None else 'a peer process'
  step = _PROGRESS['step']
  at = f'at step {step}' if step is not None else 'before training began'
  out = _PROGRESS['out']
  if out is None:
    then = 'start it again'
  else:
    where = os.path.join(os.path.abspath(out), 'checkpoints')  # checkpoint.SUBDIR
    latest = _latest_checkpoint(where)
    then = (
      f'the latest checkpoint is step {latest} in {where}: start every process again with --resume'
      if latest is not None
      else f'no checkpoint was saved in {where}: start again with another --out'
    )
  return f'{who} was lost {at} ({how}); process {me} stops too; {then}.'


def _latest_checkpoint(where: str) -> int | None:
  """The newest finished checkpoint's step: Orbax renames a step's directory to its number once
  every process has written its part (a save cut short keeps its temporary name). Read from the
  directory, not through Orbax, whose manager would wait for the lost peer."""
  try:
    steps = [int(name) for name in os.listdir(where) if name.isdigit()]
  except OSError:
    return None
  return max(steps, default=None)


_PROCESS_KEY = 'ouroboros_jax/process'  # each process's `_identity`, for its peers
_DONE_KEY = 'ouroboros_jax/done'  # a process that ends as planned says so first
_FAILURE_LOCK = threading.Lock()


def _claim_failure() -> bool:
  """True for the first caller only: the one thread that prints this process's last line."""
  with _FAILURE_LOCK:
    if _FAILING.is_set():
      return False
    _FAILING.set()
    return True


def _identity(pid: int) -> str | None:
  """The host (its boot), the PID namespace, the PID and its start time: what tells whether a
  process seen from another one of the same machine is still the same, alive process. None
  where /proc cannot say (not Linux)."""
  try:
    with open('/proc/sys/kernel/random/boot_id') as f:
      boot = f.read().strip()
    namespace = os.stat(f'/proc/{pid}/ns/pid').st_ino
    with open(f'/proc/{pid}/stat') as f:
      fields = f.read().rsplit(')', 1)[1].split()
  except OSError:
    return None
  if fields[0] in ('Z', 'X'):  # a zombie has ended: it waits only to be reaped
    return None
  return f'{boot} {namespace} {pid} {fields[19]}'  # field 22 of stat: the start time


def _watch_pids(client, me: int, stop: threading.Event, poll_s: float = 0.1) -> None:
  """Ends this process with one line as soon as a peer on this machine is gone without a word
  (kill -9, a crash): its collectives would otherwise fail with a traceback, or wait for the
  heartbeat time-out and abort with a C++ stack (a save waits on the peer in a barrier). Linux
  wakes it the moment a peer ends (a pidfd per peer); elsewhere it looks every poll_s. Peers
  on other machines are not watched here: their loss ends the collectives (`is_peer_lost`), or
  the heartbeat time-out."""
  import jax

  mine, known, pidfds = _identity(os.getpid()), {}, {}  # pidfds: peer -> its pidfd
  if mine is None:
    return
  peers = [p for p in range(jax.process_count()) if p != me]
  while not stop.is_set():
    if pidfds:
      select.select(list(pidfds.values()), [], [], poll_s)  # readable: that process has ended
    else:
      stop.wait(poll_s)
    for peer in peers:
      if peer not in known:
        try:
          known[peer] = client.key_value_try_get(f'{_PROCESS_KEY}/{peer}')
        except Exception:  # pylint: disable=broad-exception-caught  (not posted yet)
          continue
        pidfds.update({peer: fd for fd in _pidfd(known[peer], mine)})
      boot, namespace, pid, _ = known[peer].split()
      if f'{boot} {namespace}' != ' '.join(mine.split()[:2]):
        continue  # another machine, or another PID namespace
      if _identity(int(pid)) == known[peer] or stop.is_set():
        continue
      if _ended_by_plan(client, peer):
        peers.remove(peer)
        if peer in pidfds:
          os.close(pidfds.pop(peer))
        break
      if not _claim_failure():
        return
      _last_words(
        f'error: {peer_lost_message("it ended without a word: killed or crashed", peer)}',
        PeerLostError.exit_code,
      )
      _end_now(PeerLostError.exit_code)


def _pidfd(identity: str, mine: str) -> list[int]:
  """[a pidfd] of the process `identity` names if it runs on this machine and is still that
  process (Linux 5.3+), else []."""
  boot, namespace, pid, _ = identity.split()
  if f'{boot} {namespace}' != ' '.join(mine.split()[:2]) or not hasattr(os, 'pidfd_open'):
    return []
  try:
    fd = os.pidfd_open(int(pid))
  except OSError:  # gone already, or a kernel without pidfds: the /proc check finds it
    return []
  if _identity(int(pid)) != identity:  # the PID went to another process before it was opened
    os.close(fd)
    return []
  return [fd]


def _ended_by_plan(client, peer: int) -> bool:
  """Whether the peer ended as planned, or posted its own failure (which `watch_peers` reports).
  A lost process 0 took the coordination service with it: nothing to ask, and a question would
  wait for it."""
  if peer == 0 and _service_gone():
    return False
  for key in (f'{_DONE_KEY}/{peer}', FAILED_KEY):
    if _bounded(lambda key=key: client.key_value_try_get(key) or True):
      return True
  return False
