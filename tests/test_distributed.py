"""Real multi-process runs on 127.0.0.1: the multi-host code path, on one machine."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from ouroboros_jax.models.model import ConfigError
from ouroboros_jax.runtime import distributed, launch

# The same 5 Ouroboros steps with each stash of argv[1] (comma-separated; 'fsdp': FSDP over the
# two devices instead), run either as 2 processes (1 CPU device each) or as 1 process with 2
# simulated devices; the script writes the final parameters of process 0 to argv[2] with the
# stash's name in place of STASH.
SCRIPT = textwrap.dedent("""
    import sys
    import jax
    from ouroboros_jax.runtime import distributed
    if not distributed.initialize(distributed.ProcessConfig()):
      jax.config.update('jax_num_cpu_devices', 2)
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding, PartitionSpec as P
    from ouroboros_jax import staged
    from ouroboros_jax.models import model as M, partition
    from ouroboros_jax.schedules import ScheduleConfig, build_schedule
    from ouroboros_jax.schedules.compensation import Compensation
    cfg = M.ModelConfig(d_model=16, num_heads=2, num_layers=4, d_ff=32, seq_len=8)
    params = jax.device_get(partition.to_staged(M.init_params(cfg, jax.random.key(0)), (2, 2)))
    for stash in sys.argv[1].split(','):
      config = ScheduleConfig(name='ouroboros', num_stages=2, stash=stash,
                              compensation=Compensation())  # the paper's ring
      if stash == 'fsdp':
        config = ScheduleConfig(name='data_parallel', data_parallel=2, fsdp=True)
      schedule = build_schedule(config, partition.transformer_stages(cfg, (2, 2)),
                                staged.adamw(1e-2))
      rng = np.random.default_rng(0)
      batches = [{k: rng.integers(0, 256, (4, 8)).astype(np.int32) for k in ('inputs', 'targets')}
                 for _ in range(5)]
      place = lambda b: jax.tree.map(lambda a: jax.make_array_from_process_local_data(
          NamedSharding(schedule.mesh, P(staged.DATA)), a), b)
      state = schedule.init(params, batches[0])
      for batch in batches:
        state, metrics = schedule.step(state, place(batch))
      gathered = multihost_utils.process_allgather(state.params, tiled=True)
      if jax.process_index() == 0:
        np.save(sys.argv[2].replace('STASH', stash),
                np.concatenate([np.ravel(x) for x in jax.tree.leaves(gathered)]))
      print(stash, 'processes', jax.process_count(), 'loss', float(metrics['loss']))
""")


def test_two_processes_equal_two_simulated_devices(tmp_path):
  """The ring and FSDP, one after the other in each run (one start-up of each run for both). The
  replay stash went for the suite's 15 minutes (~15 s): what crosses the processes, the ring's
  ppermutes and the state's shardings, is the graph stash's too."""
  stashes = ('graph', 'fsdp')
  script = tmp_path / 'run.py'
  script.write_text(SCRIPT)
  out = io.StringIO()
  code = launch.launch(
    2,
    [','.join(stashes), str(tmp_path / 'multi_STASH.npy')],
    options=launch.LaunchOptions(program=[sys.executable, str(script)]),
    timeout_s=240,
    out=out,
  )
  assert code == 0, out.getvalue()[-3000:]
  single = subprocess.run(
    [sys.executable, str(script), ','.join(stashes), str(tmp_path / 'single_STASH.npy')],
    capture_output=True,
    text=True,
    timeout=240,
    env={**launch.child_env(0, 1, 0), 'OUROBOROS_COORDINATOR': '', 'XLA_FLAGS': ''},
  )
  assert single.returncode == 0, single.stderr[-3000:]
  for stash in stashes:
    assert out.getvalue().count(f'{stash} processes 2 loss') == 2
    assert f'{stash} processes 1 loss' in single.stdout
    multi = np.load(tmp_path / f'multi_{stash}.npy')
    one = np.load(tmp_path / f'single_{stash}.npy')
    # 5 AdamW steps at lr 1e-2 in float32, sums in another order (one vs two partitions): Adam
    # amplifies a reordered sum on near-zero gradient coordinates, ~1e-5 seen, so 1e-4 (was
    # 2e-5, within 2x of what was seen); a missing all-reduce or a wrong shard moves parameters
    # by > 1e-3.
    np.testing.assert_allclose(multi, one, rtol=0, atol=1e-4, err_msg=stash)


def test_a_killed_process_makes_launch_fail_fast(tmp_path):
  # Process 1 dies at once; process 0 would wait forever in a collective without the timeouts.
  script = tmp_path / 'die.py'
  script.write_text(
    textwrap.dedent("""
      import os, sys
      from ouroboros_jax.runtime import distributed
      distributed.initialize(distributed.ProcessConfig(heartbeat_timeout_s=10))
      import jax, jax.numpy as jnp
      from jax.experimental import multihost_utils
      if jax.process_index() == 1:
        os._exit(17)
      multihost_utils.sync_global_devices('never reached by process 1')
  """)
  )
  out = io.StringIO()
  start = time.monotonic()
  code = launch.launch(
    2,
    [],
    options=launch.LaunchOptions(program=[sys.executable, str(script)], grace_s=60),
    timeout_s=180,
    out=out,
  )
  assert code == 17, out.getvalue()[-2000:]
  assert time.monotonic() - start < 120
  assert '[launch] process 1 exited with status 17;' in out.getvalue()  # the dead peer, named
  assert not any(
    launch._CPP_FRAME.match(line.split(' ', 1)[-1])  # pylint: disable=protected-access
    for line in out.getvalue().splitlines()
  )


# Process 1 fails at once (killed by SIGKILL, or exits with 5); process 0 exits with 7 half a
# second after it, without a word: the launcher names process 1, the first to fail.
FIRST_TO_FAIL = textwrap.dedent("""
    import os, signal, sys, time
    how, gone = sys.argv[1:]
    if os.environ['OUROBOROS_PROCESS_ID'] == '1':
      open(gone, 'w').close()
      os.kill(os.getpid(), signal.SIGKILL) if how == 'kill' else os._exit(5)
    while not os.path.exists(gone):
      time.sleep(0.01)
    time.sleep(0.5)
    os._exit(7)
""")


@pytest.mark.parametrize(
  'how, code, ended, then',
  [
    ('kill', 128 + signal.SIGKILL, 'was killed by SIGKILL', ''),
    ('exit', 5, 'exited with status 5', '; see its output above.'),
  ],
)
def test_launch_names_the_first_process_to_fail(tmp_path, how, code, ended, then):
  """Was: `process 0 exited with status 7`, the first failure by index, not in time."""
  out, reasons = io.StringIO(), []
  program = [sys.executable, '-c', FIRST_TO_FAIL, how, str(tmp_path / 'gone')]
  options = launch.LaunchOptions(program=program)
  assert launch.launch(2, [], options=options, timeout_s=60, out=out, reasons=reasons) == code
  assert reasons == [f'process 1 {ended}{then}'], out.getvalue()
  assert f'[launch] process 1 {ended};' in out.getvalue()


def test_an_unreachable_coordinator_is_one_line():
  port = launch.free_port()  # nothing listens there
  result = subprocess.run(
    [
      sys.executable,
      '-m',
      'ouroboros_jax',
      'train',
      '--coordinator',
      f'127.0.0.1:{port}',
      '--num-processes',
      '2',
      '--process-id',
      '1',
      '--init-timeout',
      '2',
    ],
    capture_output=True,
    text=True,
    timeout=60,
  )
  assert result.returncode == 2, result.stderr
  assert result.stderr.strip().splitlines() == [
    f'error: cannot reach the coordinator 127.0.0.1:{port} within 2 s (Connection refused); '
    'start process 0 there first, fix --coordinator, or wait longer with --init-timeout.'
  ]


# A launcher whose two children print their PID and sleep: killing the launcher must kill them.
LAUNCHER = textwrap.dedent("""
    import sys
    from ouroboros_jax.runtime import launch
    child = "import os, time; print('pid', os.getpid(), flush=True); time.sleep(300)"
    options = launch.LaunchOptions(program=[sys.executable, '-c', child], grace_s=5)
    sys.exit(launch.launch(2, [], options=options))
""")


def _alive(pid: int) -> bool:
  """Running or sleeping; a zombie (exited, not yet reaped by a container's init) is dead."""
  try:
    with open(f'/proc/{pid}/stat') as f:
      return f.read().rsplit(')', 1)[1].split()[0] not in ('Z', 'X')
  except (FileNotFoundError, ProcessLookupError):
    return False


@pytest.mark.parametrize('signum', [signal.SIGKILL, signal.SIGTERM])
def test_children_die_with_the_launcher(signum):
  launcher = subprocess.Popen([sys.executable, '-c', LAUNCHER], stdout=subprocess.PIPE, text=True)
  pids, deadline = [], time.monotonic() + 60
  while len(pids) < 2 and time.monotonic() < deadline:
    line = launcher.stdout.readline()
    if not line:
      break
    if ' pid ' in line:
      pids.append(int(line.split()[-1]))
  assert len(pids) == 2, 'the children did not start'
  os.kill(launcher.pid, signum)
  launcher.wait(timeout=30)
  deadline = time.monotonic() + 20
  while any(map(_alive, pids)) and time.monotonic() < deadline:
    time.sleep(0.1)
  left = [p for p in pids if _alive(p)]
  for pid in left:  # do not leak them into the rest of the test session
    os.kill(pid, signal.SIGKILL)
  assert not left, f'children {left} outlived the launcher ({signal.Signals(signum).name})'
  if signum == signal.SIGTERM:  # a clean stop, reported like a shell would
    assert launcher.returncode == 128 + signal.SIGTERM
    assert 'SIGTERM: passing it on' in launcher.stdout.read()


def test_a_stop_while_the_children_start_stops_them_like_any_other(monkeypatch):
  """Was: a SIGTERM that came while the launcher still started its output threads left it with a
  traceback and exit status 1 (test_children_die_with_the_launcher, once in a loaded CI run)."""
  import io

  start = launch._Children.start

  children = []

  def start_then_stopped(started, *args):
    children.append(started)
    start(started, *args)  # every child started, then the signal
    raise launch._Stop(signal.SIGTERM)

  monkeypatch.setattr(launch._Children, 'start', start_then_stopped)
  child = "import os, time; print('pid', os.getpid(), flush=True); time.sleep(300)"
  options = launch.LaunchOptions(program=[sys.executable, '-c', child], grace_s=5)
  out = io.StringIO()
  assert launch.launch(2, [], options=options, out=out) == 128 + signal.SIGTERM
  assert '[launch] SIGTERM: passing it on to every process' in out.getvalue()
  assert len(children) == 1 and all(p.returncode is not None for p in children[0].procs)


def test_launch_and_process_config_errors(monkeypatch):
  with pytest.raises(ConfigError, match='nothing to launch'):
    launch.launch(2, [])
  with pytest.raises(ConfigError, match='--processes'):
    launch.launch(0, ['train'])
  for name in (
    distributed.ENV_COORDINATOR,
    distributed.ENV_NUM_PROCESSES,
    distributed.ENV_PROCESS_ID,
  ):
    monkeypatch.delenv(name, raising=False)
  assert distributed.initialize(distributed.ProcessConfig()) is False  # plain single process
  with pytest.raises(ConfigError, match='--num-processes'):
    distributed.initialize(distributed.ProcessConfig(coordinator='127.0.0.1:1'))
  with pytest.raises(ConfigError, match='outside'):
    distributed.initialize(
      distributed.ProcessConfig(coordinator='127.0.0.1:1', num_processes=2, process_id=5)
    )
  with pytest.raises(ConfigError, match='--coordinator'):
    distributed.initialize(distributed.ProcessConfig(num_processes=2, process_id=1))


# ----------------------------------------------------------------------------- stopping together

# A constant learning rate after warm-up: a stopped run of 100000 steps and an uninterrupted one
# of a few see the same rates.
TINY_RUN = (
  '--schedule ouroboros --stages 2 --num-layers 2 --d-model 16 --num-heads 2 --d-ff 32 '
  '--seq-len 16 --batch-size 4 --log-every 1 --eval-every 1000000 --eval-batches 1 '
  '--checkpoint-every 1000000 --warmup-steps 2 --min-lr-ratio 1'
).split()


def _small_corpus(tmp_path, text_corpus) -> str:
  """20 KB of text: the final test evaluation stays short."""
  path = tmp_path / 'corpus.txt'
  with open(text_corpus, 'rb') as f:
    path.write_bytes(f.read()[:20_000])
  return f'text:{path}'


def _stopped_steps(lines: list[str]) -> list[int]:
  """The step of each `stopped by SIGTERM` line."""
  return [
    int(line.split('is step ')[1].split()[0]) for line in lines if 'stopped by SIGTERM;' in line
  ]


def _stop_after(procs, signal_to, out, step: int, timeout: float = 120):
  """Waits until the run in `out` has logged `step`, then sends SIGTERM to `signal_to`; returns
  (each process's output lines, seconds from the signal to the last exit)."""
  metrics, deadline = out / 'metrics.jsonl', time.monotonic() + timeout

  def logged() -> int:
    if not metrics.exists():
      return 0
    rows = [line for line in metrics.read_text().splitlines() if '"split": "train"' in line]
    return len(rows)

  while logged() < step:
    assert time.monotonic() < deadline, f'the run did not log step {step}'
    assert all(p.poll() is None for p in procs), 'a process ended early'
    time.sleep(0.2)
  signalled = time.monotonic()
  for p in signal_to:
    p.send_signal(signal.SIGTERM)
  lines = [p.communicate(timeout=60)[0].splitlines() for p in procs]
  return lines, time.monotonic() - signalled


def _final_state(out):
  from ouroboros_jax.training import checkpoint

  manager = checkpoint.make_manager(str(out), read_only=True)
  try:
    return manager.latest_step(), checkpoint.restore_single_device(manager)
  finally:
    manager.close()


def test_sigterm_to_the_launcher_stops_every_process_at_one_checkpointed_step(
  tmp_path, text_corpus
):
  """JAX's preemption notifier takes SIGTERM in a multi-process run: the processes agree on a
  step, save it and stop together, and the checkpoint of that step restores."""
  corpus = _small_corpus(tmp_path, text_corpus)
  run = [sys.executable, '-m', 'ouroboros_jax', 'launch', '--processes', '2', '--', 'train']
  # Data parallelism: the cheapest step to compile (the ring's state resuming exactly is tested
  # in one process, tests/test_train.py, tests/test_checkpoint_states.py).
  data_parallel = ['--schedule', 'data_parallel', '--stages', '1', '--data-parallel', '2']
  common = [*TINY_RUN, *data_parallel, '--data', corpus, '--quiet']
  stopped = subprocess.Popen(
    [*run, *common, '--steps', '100000', '--out', str(tmp_path / 'a')],
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
  )
  try:
    (lines,), took = _stop_after([stopped], [stopped], tmp_path / 'a', step=3)
  finally:
    stopped.kill()
  assert stopped.returncode == 128 + signal.SIGTERM, ''.join(lines[-30:])
  assert took < 30
  steps = _stopped_steps([line for line in lines if line.startswith('[p')])
  assert len(steps) == 2 and steps[0] == steps[1], lines[-30:]  # one common step
  step = steps[0]
  assert _final_state(tmp_path / 'a')[0] == step  # a complete checkpoint of it
  assert not any('Traceback' in line for line in lines)
  # (Resuming it, and an uninterrupted run beside it, went for the suite's 15 minutes: 2 more
  # launches of 2 processes, ~25 s. A resume in 2 processes is tested by test_relayout.py's
  # test_a_run_moves_between_process_counts; a stopped run resuming bit for bit, in one process,
  # by tests/test_cli.py and tests/test_train.py.)


def test_sigterm_to_every_process_of_a_cluster_run_stops_them_at_one_step(tmp_path, text_corpus):
  """As a cluster scheduler does it: no launcher, SIGTERM to each process."""
  port = launch.free_port()
  procs = []
  for i in range(2):
    env = launch.child_env(i, 2, port)
    for name in (
      distributed.ENV_COORDINATOR,
      distributed.ENV_NUM_PROCESSES,
      distributed.ENV_PROCESS_ID,
    ):
      env.pop(name)
    procs.append(
      subprocess.Popen(
        [sys.executable, '-m', 'ouroboros_jax', 'train', *TINY_RUN, '--quiet']
        + ['--data', _small_corpus(tmp_path, text_corpus), '--steps', '100000']
        + ['--out', str(tmp_path / 'run'), '--coordinator', f'127.0.0.1:{port}']
        + ['--num-processes', '2', '--process-id', str(i)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
      )
    )
  try:
    lines, took = _stop_after(procs, procs, tmp_path / 'run', step=3)
  finally:
    for p in procs:
      p.kill()
  assert [p.returncode for p in procs] == [128 + signal.SIGTERM] * 2, lines[0][-20:]
  assert took < 30
  steps = _stopped_steps(lines[0] + lines[1])
  assert len(steps) == 2 and steps[0] == steps[1], lines
  assert _final_state(tmp_path / 'run')[0] == steps[0]


# ----------------------------------------------------------------------------- failing together

FAIL_SCRIPT = textwrap.dedent("""
    from ouroboros_jax.runtime import distributed
    distributed.initialize(distributed.ProcessConfig(heartbeat_timeout_s=100))
    distributed.watch_peers()
    import jax
    from jax.experimental import multihost_utils
    try:
      if jax.process_index() == 1:
        raise RuntimeError('boom in process 1')
      multihost_utils.sync_global_devices('never reached by process 1')
    except Exception:
      distributed.fail_every_process(None, 1)
""")


def test_a_failing_process_ends_its_peers_within_seconds(tmp_path):
  """Process 0 waits in a collective process 1 never joins: it ends because process 1 posted
  its failure, long before the heartbeat time-out (100 s) or the launcher's grace (100 s)."""
  script = tmp_path / 'fail.py'
  script.write_text(FAIL_SCRIPT)
  out = io.StringIO()
  start = time.monotonic()
  code = launch.launch(
    2,
    [],
    options=launch.LaunchOptions(program=[sys.executable, str(script)], failure_grace_s=100),
    timeout_s=120,
    out=out,
  )
  took = time.monotonic() - start
  text = out.getvalue()
  assert code == 1, text[-2000:]  # its status, in every process
  assert took < 30, text[-2000:]
  assert 'RuntimeError: boom in process 1' in text  # the failure's own traceback
  assert '[p0] error: process 1 failed (RuntimeError: boom in process 1); process 0 stops too.' in (
    text
  )


@pytest.mark.parametrize(
  'flags, words',
  [
    (['--stages', '2', '--cpu-devices', '2'], ['--cpu-devices 2 simulates devices', 'drop it']),
    (['--stages', '3', '--num-layers', '3'], ['need 3 devices', '--processes 3']),
  ],
)
def test_flags_a_multi_process_run_cannot_use_are_refused_at_once(tmp_path, flags, words):
  result = subprocess.run(
    [sys.executable, '-m', 'ouroboros_jax', 'launch', '--processes', '2', '--', 'train']
    + ['--schedule', 'ouroboros', '--d-model', '16', '--num-heads', '2', '--steps', '2']
    + ['--out', str(tmp_path / 'run'), *flags],
    capture_output=True,
    text=True,
    timeout=60,
  )
  assert result.returncode == 2, result.stdout[-2000:]
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith('error: process '), result.stderr
  for word in words:
    assert word in lines[0], lines[0]
  assert 'Traceback' not in result.stdout


def test_sigterm_stops_a_two_process_bench_within_seconds(tmp_path):
  """JAX's preemption notifier would take the SIGTERM the launcher passes on and the bench would
  time on until the launcher killed it a minute later; it is the command's own now: each
  process ends at once with one line, and the launcher with 128 + 15."""
  run = subprocess.Popen(
    [sys.executable, '-m', 'ouroboros_jax', 'launch', '--processes', '2', '--', 'bench']
    + ['--stages', '2', '--preset', 'tiny', '--num-layers', '4', '--batch-size', '8']
    + ['--only', 'gpipe,1f1b,backprop', '--out', str(tmp_path / 'bench')],
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
  )
  try:
    for line in run.stdout:  # the two processes have joined and begun to measure
      if 'Gloo' in line and 'connected' in line:
        break
    time.sleep(2)
    run.send_signal(signal.SIGTERM)
    start = time.monotonic()
    out, _ = run.communicate(timeout=40)
  finally:
    run.kill()
  assert time.monotonic() - start < 15
  assert run.returncode == 128 + signal.SIGTERM, out[-2000:]
  assert '[p0] error: stopped by SIGTERM.' in out and '[p1] error: stopped by SIGTERM.' in out
  assert 'Traceback' not in out
