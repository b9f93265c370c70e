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
exits with its exit status and one line naming the failed process. Without this, a peer waits in a collective until the
heartbeat time-out and then aborts with a C++ stack.

A process other than 0 first waits up to `init_timeout_s` (--init-timeout) for the coordinator's
port to accept a connection, and stops with a one-line error if it never does: XLA's own client
would abort the process with a C++ stack after its time-out instead.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import socket
import sys
import threading
import time
import traceback

from ouroboros_jax.errors import ConfigError

ENV_COORDINATOR = 'OUROBOROS_COORDINATOR'
ENV_NUM_PROCESSES = 'OUROBOROS_NUM_PROCESSES'
ENV_PROCESS_ID = 'OUROBOROS_PROCESS_ID'
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
      **kwargs,
    )
  return True


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
  first one posted wins)."""
  import jax

  try:
    _client().key_value_set(FAILED_KEY, f'{jax.process_index()}\t{code}\t{message}')
  except Exception:  # pylint: disable=broad-exception-caught  (a peer posted first, or no service)
    pass


def _end_now(code: int) -> None:
  """Exits at once, skipping the shutdown barrier peers never reach. Process 0 hosts the
  coordination service: it stays a moment longer, so that the peers' watches read the failure
  and end cleanly before the service goes (they would abort with a C++ stack instead)."""
  import jax

  sys.stdout.flush()
  sys.stderr.flush()
  if jax.process_index() == 0:
    time.sleep(1.5)
  os._exit(code)  # pylint: disable=protected-access


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
      if stop.is_set() or _FAILING.is_set() or process == str(me):
        return
      print(
        f'error: process {process} failed ({message}); process {me} {PEER_FAILED}', file=sys.stderr
      )
      _end_now(int(code))

  thread = threading.Thread(target=watch, name='ouroboros-watch-peers', daemon=True)
  thread.start()

  def end_watch():
    # Before JAX's own exit handler shuts the client down (atexit runs the later one first),
    # and before the interpreter ends: a daemon thread that comes back from C++ then aborts the
    # process ("FATAL: exception not rethrown").
    stop.set()
    thread.join(timeout=2 * poll_s + 1)

  atexit.register(end_watch)
  return stop


def fail_every_process(message: str | None, code: int) -> None:
  """Ends a failed process of a multi-process run now: prints `error: message` (None: the
  traceback of the exception being handled), posts it for the peers' `watch_peers`, and exits
  with `code` without waiting for peers that will never arrive. Call it from an except block."""
  _FAILING.set()
  if message is None:
    traceback.print_exc()
    exc = sys.exc_info()[1]
    message = f'{type(exc).__name__}: {exc}' if exc is not None else 'it failed'
  else:
    print(f'error: {message}', file=sys.stderr)
  announce_failure(' '.join(message.split())[:300], code)
  _end_now(code)
