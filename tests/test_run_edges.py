"""A run at its edges (issue 42): a full disk as --out, --resume on a finished run, damaged
checkpoints as `train --resume` and `sample` report them, and what a resume says."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import pathlib
import re
import shlex
import shutil
import signal
import struct
import subprocess
import sys

import pytest

from ouroboros_jax import cli_messages, cli_parsers, errors
from ouroboros_jax.training import checkpoint, field_flags, loop, metrics, rundir, sample

from helpers import REPO_ROOT, assert_one_line_error, cli_message, run_cli, tiny_config, unfinish
from helpers import SMALL_CLI as SMALL


@pytest.fixture(scope='module')
def finished_run(tmp_path_factory, prepared_data_dir):
  """A finished 4-step run with checkpoints at steps 2 and 4."""
  out = tmp_path_factory.mktemp('finished_run')
  cfg = tiny_config(out, prepared_data_dir, steps=4, checkpoint_every=2, eval_every=4)
  loop.train(cfg, quiet=True)
  return cfg


def _copy(cfg, tmp_path, **overrides):
  """The finished run copied into tmp_path/run, and its config pointed there."""
  out = tmp_path / 'run'
  shutil.copytree(cfg.out_dir, out)
  return out, field_flags.override(cfg, {'out': os.fspath(out), **overrides})


def _truncate(step_dir: pathlib.Path) -> None:
  """Cuts every data file of a checkpoint's state to half its length."""
  for path in (step_dir / 'state').rglob('*'):
    if path.is_file() and path.parent.name == 'd':
      with open(path, 'r+b') as f:
        f.truncate(path.stat().st_size // 2)


def _hashes(out: pathlib.Path) -> dict[str, str]:
  """Every file under OUT (its lock aside) and its SHA-256."""
  return {
    os.fspath(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest()
    for p in sorted(out.rglob('*'))
    if p.is_file() and p.name != rundir.LOCK_NAME
  }


def _events(path) -> list:
  """The events of a TensorBoard file, each record's length and data checked by its CRC."""
  from tensorboardX.proto import event_pb2
  from tensorboardX.record_writer import masked_crc32c

  raw, events, at = pathlib.Path(path).read_bytes(), [], 0
  while at < len(raw):
    header = raw[at : at + 8]
    (length,) = struct.unpack('Q', header)
    assert struct.unpack('I', raw[at + 8 : at + 12])[0] == masked_crc32c(header)
    data = raw[at + 12 : at + 12 + length]
    assert struct.unpack('I', raw[at + 12 + length : at + 16 + length])[0] == masked_crc32c(data)
    events.append(event_pb2.Event.FromString(data))
    at += 16 + length
  return events


# ----------------------------------------------------------------------------- a full disk


def _small_file_system(where: pathlib.Path, size: str, script: str) -> subprocess.CompletedProcess:
  """Runs `script` (sh) with a `size` tmpfs mounted at `where`, in a mount namespace of its own."""
  where.mkdir()
  return _in_mount_namespace(f'mount -t tmpfs -o size={size} tmpfs "{where}"', script)


def _in_mount_namespace(mount: str, script: str) -> subprocess.CompletedProcess:
  """Runs `mount` then `script` (sh) in a mount namespace of its own: a user namespace needs no
  privileges where the kernel allows them (root also works without one). Skips the test, with
  the reason, where neither can mount."""
  mount = f'{{ {mount}; }} || exit 97\n'
  tries = [['unshare', '--user', '--map-root-user', '--mount']]
  if os.geteuid() == 0:
    tries.append(['unshare', '--mount'])
  reasons = []
  for unshare in tries:
    if shutil.which(unshare[0]) is None:
      pytest.skip('no `unshare` here to mount without privileges')
    result = subprocess.run(
      [*unshare, 'sh', '-c', mount + script],
      cwd=REPO_ROOT,
      capture_output=True,
      text=True,
      timeout=120,
    )
    if result.returncode != 97 and 'unshare:' not in result.stderr:
      return result
    reasons.append(f'{" ".join(unshare)}: {result.stderr.strip()[:200]}')
  pytest.skip(f'cannot mount here ({"; ".join(reasons)})')


def test_a_full_disk_ends_train_in_one_line_and_keeps_the_last_checkpoint(tmp_path, text_corpus):
  # A 768 KiB tmpfs holds the first checkpoint of this model (~0.4 MiB with its files' pages)
  # and not a second beside it. The tmpfs lives as long as its namespace: what the run left on
  # it is copied out before the namespace ends.
  disk, after = tmp_path / 'disk', tmp_path / 'after'
  out = disk / 'run'
  argv = [*_train_argv(text_corpus, out, steps='6'), '--log-every', '1']
  script = (
    f'{shlex.join(map(str, argv))} > "{tmp_path}/stdout" 2> "{tmp_path}/stderr"\n'
    f'code=$?; cp -a "{out}" "{after}"; exit $code\n'
  )
  result = _small_file_system(disk, '768k', script)
  stderr = (tmp_path / 'stderr').read_text()
  result = subprocess.CompletedProcess(result.args, result.returncode, '', stderr)
  # Exit status 2 as every user error; the line names the directory, the space a checkpoint
  # needs and the checkpoint to resume from.
  assert_one_line_error(result, 2, f'no space left on the device of {out} ', 'MiB free')
  assert re.search(r'each checkpoint needs about \d+\.\d MiB, \d+\.\d MiB free', stderr), stderr
  kept = re.search(
    rf'the last good checkpoint is step (\d+) in {re.escape(str(out))}/checkpoints: .* --resume',
    stderr,
  )
  # Where the disk fills depends on the logs' and the save's temporary files, which vary from run
  # to run by a page or two: the last good checkpoint is one of the run's checkpoint steps before
  # its last (step 6 never fits beside an earlier one).
  if os.sysconf('SC_PAGE_SIZE') == 4096:  # tmpfs counts whole pages: larger ones fill it sooner
    assert kept and kept[1] in ('2', '4'), stderr
  # The last good checkpoint stays, whole, and nothing a cut-short save began is left (a save
  # that would not fit is refused before it begins). Step 2 may stay beside step 4 where both
  # fitted (the run keeps 3).
  left = sorted(os.listdir(after / 'checkpoints'), key=int)
  assert left[-1:] == ([kept[1]] if kept else []) and set(left) <= {'2', '4'}, left
  if kept:
    manager = checkpoint.make_manager(after, read_only=True)
    try:
      assert int(checkpoint.restore_single_device(manager, int(kept[1]))['step']) == int(kept[1])
    finally:
      manager.close()
  # The logs hold whole rows and records only.
  rows = [json.loads(line) for line in (after / 'metrics.jsonl').read_text().splitlines()]
  assert [r['step'] for r in rows if r['split'] == 'train'][:2] == [1, 2]
  (events,) = (after / 'tb').iterdir()
  assert any(e.step == 2 for e in _events(events))


class _FullAfter:
  """os.write that writes `budget` bytes in all, then fails as a full disk does: part of the
  write that crosses the budget lands, the rest raises ENOSPC."""

  def __init__(self, budget: int):
    self.budget, self.write = budget, os.write

  def __call__(self, fd, data):
    if self.budget <= 0:
      raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    written = self.write(fd, bytes(data)[: self.budget])
    self.budget -= written
    return written


def test_a_failed_write_leaves_metrics_tensorboard_and_summary_as_they_were(tmp_path, monkeypatch):
  log = metrics.MetricsLog(os.fspath(tmp_path), None)
  row = {'step': 1, 'split': 'train', 'loss': 1.0, 'bpb': 1.4, 'tokens_per_s': 10.0}
  log.write(row)
  (tmp_path / 'summary.json').write_text('{"step": 1}')
  (events,) = (tmp_path / 'tb').iterdir()
  before = _hashes(tmp_path)
  for budget in (0, 7, 150):  # nothing, a part of a row or record, more than one file's part
    monkeypatch.setattr(os, 'write', _FullAfter(budget))
    with pytest.raises(OSError) as info:
      log.write(dict(row, step=2))
    assert rundir.is_disk_full(info.value)
    monkeypatch.setattr(os, 'write', _FullAfter(budget))
    with pytest.raises(OSError):
      rundir.write_whole(os.fspath(tmp_path / 'summary.json'), json.dumps({'step': 2} | row))
    monkeypatch.undo()
    # metrics.jsonl, TensorBoard's file and summary.json as they were, no temporary file left.
    assert _hashes(tmp_path) == before, budget
  log.write(dict(row, step=2))  # space again: the files go on whole
  log.close()
  assert [json.loads(line)['step'] for line in open(tmp_path / 'metrics.jsonl')] == [1, 2]
  assert [e.step for e in _events(events) if e.HasField('summary')] == [1] * 3 + [2] * 3


def test_a_full_disk_in_any_write_of_a_run_is_one_disk_full_error(
  tmp_path, prepared_data_dir, monkeypatch
):
  """The same end where the disk fills in a metrics row (where no small file system can be made,
  this is the full-disk test of the loop)."""
  cfg = tiny_config(tmp_path / 'run', prepared_data_dir, steps=6, checkpoint_every=2)
  append = rundir.append_whole

  def full_at_step_5(fd, data):
    if data.startswith(b'{"step": 5'):
      raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    append(fd, data)

  monkeypatch.setattr(rundir, 'append_whole', full_at_step_5)
  with pytest.raises(errors.DiskFullError) as info:
    loop.train(cfg, quiet=True)
  message = str(info.value)
  assert message.startswith(f'no space left on the device of {cfg.out_dir} (each checkpoint ')
  assert f'the last good checkpoint is step 4 in {cfg.out_dir}/checkpoints' in message
  assert sorted(os.listdir(tmp_path / 'run' / 'checkpoints')) == ['2', '4']
  with open(tmp_path / 'run' / 'metrics.jsonl') as f:
    assert [json.loads(line)['step'] for line in f][-1] == 4


# ----------------------------------------------------------------------------- a finished run


def test_resume_on_a_finished_run_says_so_and_changes_nothing(finished_run, tmp_path):
  out, cfg = _copy(finished_run, tmp_path)
  before = _hashes(out)
  result = run_cli('train', *cli_parsers.to_flags(cfg), '--resume')
  assert result.returncode == 0, result.stderr
  assert result.stderr == ''
  assert result.stdout.strip().splitlines() == [
    f'{out} holds a run finished at step 4 ({out}/summary.json); nothing to resume and nothing '
    'changed: pass --steps above 4 to train on.'
  ]
  assert _hashes(out) == before  # summary.json, metrics.jsonl, TensorBoard, checkpoints


def test_a_larger_steps_resumes_a_finished_run_and_says_from_which_step(
  finished_run, tmp_path, capsys
):
  out, cfg = _copy(finished_run, tmp_path, steps=6)
  summary = loop.train(cfg, resume=True, quiet=True)
  said = capsys.readouterr()
  assert said.out.splitlines()[0] == (
    f'resuming from step 4 in {out}/checkpoints, with changed settings: --steps 4 -> 6.'
  )
  assert summary['step'] == 6 and said.err == ''


# ----------------------------------------------------------------------------- damaged checkpoints


def test_a_truncated_checkpoint_is_its_file_and_reason_on_stderr(finished_run, tmp_path, capsys):
  out, cfg = _copy(finished_run, tmp_path)
  unfinish(out)  # stopped before its end: --resume has work to do
  _truncate(out / 'checkpoints' / '4')
  loop.train(cfg, resume=True, quiet=True)
  said = capsys.readouterr()
  (warning,) = said.err.splitlines()
  assert warning.startswith(
    f'warning: checkpoint step 4 in {out}/checkpoints is unreadable ({out}/checkpoints/4/state/'
  ), warning
  assert re.search(r'/d/[0-9a-f]+: Requested byte range \[\d+, \d+\) is not valid', warning)
  for binding in ('bound method', 'pybind11', 'TensorStore(', 'tensorstore_spec', 'slice('):
    assert binding not in warning, warning
  assert 'warning' not in said.out
  assert (
    f'resuming from step 2 in {out}/checkpoints, the newest readable checkpoint.'
    in said.out.splitlines()
  )


def test_sample_on_damaged_checkpoints_says_what_train_resume_says(finished_run, tmp_path, capsys):
  out, cfg = _copy(finished_run, tmp_path)
  unfinish(out)
  _truncate(out / 'checkpoints' / '4')
  # The newest is damaged: both fall back to step 2 with the same warning, on stderr.
  assert sample.sample(os.fspath(out), length=4, temperature=0) is not None
  said = capsys.readouterr()
  assert said.out == ''
  warning, sampling = said.err.splitlines()
  assert warning.startswith(f'warning: checkpoint step 4 in {out}/checkpoints is unreadable (')
  assert sampling == 'sampling from step 2, the newest readable checkpoint.'
  # All damaged: one line, the same for both commands, and nothing else.
  _truncate(out / 'checkpoints' / '2')
  with pytest.raises(errors.CorruptCheckpointError) as info:
    loop.train(cfg, resume=True, quiet=True)
  assert capsys.readouterr().err == ''
  result = run_cli('sample', '--ckpt', out, '--length', '4')
  assert_one_line_error(result, 2, 'no readable checkpoint in ', 'steps [2, 4]', 'another --out')
  assert result.stderr.strip() == f'error: {cli_message(info.value)}'


# -------------------------------------------------------------- a checkpoint that cannot be written


def _train_argv(text_corpus, out, steps='4') -> list[str]:
  return [
    sys.executable,
    '-m',
    'ouroboros_jax',
    'train',
    *SMALL,
    '--data',
    f'text:{text_corpus}',
    '--steps',
    steps,
    '--checkpoint-every',
    '2',
    '--out',
    os.fspath(out),
  ]


# ---------------------------------------------------------------------------- signals during a save

UNDER_FIRE = """
import os, signal, sys
from ouroboros_jax import cli
from ouroboros_jax.training import checkpoint

real = checkpoint.save


def save_under_fire(manager, state, *args):  # the save of step 4 gets two SIGTERMs at once
  if int(state.step) == 4:
    os.kill(os.getpid(), signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGTERM)
  real(manager, state, *args)


checkpoint.save = save_under_fire
sys.exit(cli.main(sys.argv[1:]))
"""


def test_two_sigterms_during_a_save_end_train_in_one_line_with_the_save_whole(
  tmp_path, text_corpus
):
  """The second signal, which stops a run at once, waits for the save it falls into: one line,
  exit 128 + 15, step 4 saved whole, and nothing else left in the checkpoints directory (the
  old step Orbax deletes is renamed away whole first)."""
  out = tmp_path / 'run'
  argv = _train_argv(text_corpus, out, steps='8')[3:]  # after `python -m ouroboros_jax`
  result = subprocess.run(
    [sys.executable, '-c', UNDER_FIRE, *argv, '--keep-checkpoints', '1'],
    cwd=REPO_ROOT,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert_one_line_error(
    result, 143, 'stopped by SIGTERM; the latest complete checkpoint is step 4', '--resume'
  )
  assert os.listdir(out / 'checkpoints') == ['4']
  manager = checkpoint.make_manager(out, read_only=True)
  try:
    assert int(checkpoint.restore_single_device(manager, 4)['step']) == 4
  finally:
    manager.close()


def test_the_watchdogs_line_says_why_it_ended_the_run(tmp_path):
  """One signal that XLA held past the grace, or a second one: the line names which."""
  args = cli_parsers.make_parser().parse_args(['train', '--out', str(tmp_path / 'run')])
  message = cli_messages.hard_stop_message(args)
  held = message(signal.SIGTERM, True, 1)
  assert held.startswith('stopped by SIGTERM at once (XLA held the run past 30 s)'), held
  again = message(signal.SIGTERM, True, 2)
  assert again.startswith('stopped by SIGTERM at once (a second signal came)'), again
  assert message(signal.SIGINT, False, 1).startswith('interrupted during set-up')


def test_a_finished_run_stays_finished(finished_run, tmp_path, capsys):
  """--resume of a finished run whose summary.json is gone or garbled is refused (evaluating it
  again would log its final rows twice); one whose final checkpoint is damaged says so; and
  --resume-from an earlier step keeps the rows and summary it trains over, beside the
  checkpoints it sets aside."""
  out, cfg = _copy(finished_run, tmp_path)
  rows = (out / 'metrics.jsonl').read_text()
  summary = (out / 'summary.json').read_text()
  for damage in ('missing', 'garbled'):
    if damage == 'missing':
      os.remove(out / 'summary.json')
    else:
      (out / 'summary.json').write_text('{"step": ')
    with pytest.raises(
      errors.CheckpointError, match=r'holds a run finished at step 4 .* put summary.json back'
    ):
      loop.train(cfg, resume=True, quiet=True)
    assert (out / 'metrics.jsonl').read_text() == rows  # no second pair of final rows
  (out / 'summary.json').write_text(summary)
  _truncate(out / 'checkpoints' / '4')
  capsys.readouterr()
  loop.train(cfg, resume=True, quiet=True)
  said = capsys.readouterr()
  assert 'nothing to resume and nothing changed' in said.out
  assert said.err.startswith('checkpoint step 4 in ') and 'cannot be trained on' in said.err
  out, cfg = _copy(finished_run, tmp_path / 'again')
  loop.train(cfg, resume_from=2, quiet=True)
  aside = out / 'checkpoints-set-aside'
  assert (aside / 'metrics-until-step-4.jsonl').read_text() == rows
  assert (aside / 'summary-step-4.json').read_text() == summary


INJECTED = """
import errno, os, sys
from ouroboros_jax import cli
from ouroboros_jax.training import checkpoint

code = getattr(errno, sys.argv[1])


def failing_save(manager, state, *args):  # the write fails as a device would make it fail
  where = os.path.join(str(manager.directory), f'{int(state.step)}.orbax-checkpoint-tmp')
  raise OSError(code, os.strerror(code), where)


checkpoint.save = failing_save
sys.exit(cli.main(sys.argv[2:]))
"""


@pytest.mark.parametrize('name', ['EIO'])  # EFBIG and EACCES take the same path
def test_a_failing_checkpoint_write_is_one_line(tmp_path, text_corpus, name):
  """Injected at the write: an I/O error. One error line naming the path and the cause; the
  run ends (no hang)."""
  out = tmp_path / 'run'
  argv = _train_argv(text_corpus, out, steps='2')[3:]
  result = subprocess.run(
    [sys.executable, '-c', INJECTED, name, *argv],
    cwd=REPO_ROOT,
    capture_output=True,
    text=True,
    timeout=120,
  )
  cause = os.strerror(getattr(errno, name))
  assert_one_line_error(result, 2, f'cannot write a checkpoint into {out}/checkpoints: {cause}')


def test_a_read_only_checkpoints_directory_ends_a_two_process_run(tmp_path, text_corpus):
  """EROFS on the first save, in two processes (one process takes the same path, as the
  ENAMETOOLONG test shows): one line that names the cause, every process ends, nothing hangs
  (Orbax's threads would wait for the failed save), nothing left behind."""
  out = tmp_path / 'run'
  (out / 'checkpoints').mkdir(parents=True)
  where = out / 'checkpoints'
  mount = f'mount --bind "{where}" "{where}" && mount -o remount,bind,ro "{where}"'
  train = [
    *_train_argv(text_corpus, out)[3:],
    '--schedule',
    'data_parallel',
    '--data-parallel',
    '2',
  ]
  launch = [sys.executable, '-m', 'ouroboros_jax', 'launch', '--processes', '2', '--', *train]
  result = _in_mount_namespace(mount, shlex.join(launch))
  assert result.returncode == 2, result.stderr[-2000:]
  assert (
    'cannot write a checkpoint into' in result.stderr and 'Read-only file system' in result.stderr
  )
  assert 'Traceback' not in result.stderr and os.listdir(where) == []
