"""The `ouroboros` command: flags, presets, one-line user errors and exit codes, sampling.

Everything here runs `python -m ouroboros_jax` in a subprocess, as a user would (the one-line
refusals each in a process forked from one that has imported the command: forked_cli.py).
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import forked_cli
import pytest

from ouroboros_jax import cli_messages, cli_parsers
from ouroboros_jax.models.model import ConfigError
from ouroboros_jax.training import config, field_flags, presets

from helpers import SMALL_CLI as SMALL
from helpers import assert_one_line_error, cli_message, raises_for_cli, run_cli

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent


# ----------------------------------------------------------------------------- flags & presets


def test_every_config_field_has_a_flag():
  parser = cli_parsers.make_parser().commands['train']
  flags = {o for a in parser._actions for o in a.option_strings}
  for name in config.fields():
    assert field_flags.flag(name) in flags, name
  assert {'--resume', '--quiet', '--cpu-devices'} <= flags


def test_flags_override_the_preset_and_nothing_else():
  args = cli_parsers.make_parser().parse_args(
    [
      'train',
      '--preset',
      'small',
      '--d-model',
      '96',
      '--num-layers',
      '3',
      '--steps',
      '10',
      '--no-pre-ln',
      '--layers-per-stage',
      '1,2',
      '--stages',
      '2',
      '--schedule',
      'ouroboros',
    ]
  )
  cfg = cli_parsers.config_from_args(args)
  small = presets.get_preset('small')
  assert (cfg.model.d_model, cfg.model.num_layers, cfg.model.pre_ln) == (96, 3, False)
  assert (cfg.steps, cfg.layers_per_stage, cfg.schedule.num_stages) == (10, '1,2', 2)
  assert cfg.model.seq_len == small.model.seq_len and cfg.batch_size == small.batch_size
  assert cfg.out_dir == 'runs/small-ouroboros'
  cfg.validate()


def test_presets_are_valid_and_have_the_documented_shapes():
  for name, cfg in presets.PRESETS.items():
    assert cfg.preset == name
    cfg.validate()
  base = presets.get_preset('enwik8-base').model
  assert (base.num_layers, base.d_model, base.num_heads, base.d_ff, base.seq_len, base.dropout) == (
    12,
    512,
    8,
    2048,
    512,
    0.1,
  )
  gpt2 = presets.get_preset('gpt2-small').model
  assert (
    gpt2.num_layers,
    gpt2.d_model,
    gpt2.num_heads,
    gpt2.d_ff,
    gpt2.seq_len,
    gpt2.vocab_size,
  ) == (12, 768, 12, 3072, 1024, 256)
  assert presets.get_preset('enwik8-base').batch_size == 22
  with raises_for_cli('unknown field nonsense'):
    field_flags.override(presets.get_preset('tiny'), {'nonsense': 1})


# ----------------------------------------------------------------------------- user errors


BAD_SETTINGS = [
  (['--preset', 'huge'], ['unknown --preset huge', 'tiny']),
  (['--nonsense', '1'], ['unknown flag', '--nonsense']),
  (['--d-model', '30', '--num-heads', '4'], ['--d-model 30', '--num-heads 4', 'divisible']),
  (['--num-layers', '0'], ['--num-layers must be a positive integer, got 0']),
  (['--batch-size', '-1'], ['--batch-size must be a positive integer']),
  (['--d-model', 'x'], ['--d-model', "invalid int value: 'x'"]),
  (
    ['--schedule', 'ouroboros', '--stages', '3', '--num-layers', '2'],
    ['--stages 3', 'only 2 layers', '--num-layers 3 or more'],
  ),
  (['--schedule', 'nope'], ['unknown --schedule nope', 'backprop']),
  (
    ['--schedule', 'gpipe', '--stages', '2', '--stash-policy', 'everything'],
    ['unknown --stash-policy everything; choose one of auto, all'],
  ),
]


@pytest.fixture(scope='module')
def refused(tmp_path_factory, text_corpus):
  """The one-line refusals of the tests below, each command line run in a process of its own
  forked from one that has imported the command (a subprocess each before: 40 s of a 15-minute
  suite, most of it imports of JAX): (their directory, {name: result})."""
  tmp = tmp_path_factory.mktemp('refused')
  (tmp / 'short.txt').write_text('To be, or not to be.\n')
  (tmp / 'a_file').write_text('not a directory')
  (tmp / 'finished').mkdir()
  (tmp / 'finished' / 'summary.json').write_text('{}')
  (tmp / 'no_checkpoint').mkdir()
  train, corpus = ['train', *SMALL], f'text:{text_corpus}'
  lines = {
    'missing data': [*train, '--data', 'text:/nonexistent/corpus.txt', '--out', tmp / 'missing'],
    'short corpus': [*train, '--data', f'text:{tmp / "short.txt"}', '--out', tmp / 'short'],
    'resume': [*train, '--data', corpus, '--resume', '--out', tmp / 'empty'],
    'sample': ['sample', '--ckpt', tmp / 'no_checkpoint'],
    'out is a file': [*train, '--steps', '2', '--out', tmp / 'a_file'],
    'out under a file': [*train, '--steps', '2', '--out', tmp / 'a_file' / 'run'],
    'vocabulary': [*train, '--data', corpus, '--vocab-size', '100', '--steps', '2']
    + ['--out', tmp / 'vocabulary'],
    'finished': [*train, '--steps', '2', '--out', tmp / 'finished'] + ['--growth', 'mslt:1x1,2x*'],
    'stages do nothing': ['train', '--schedule', 'backprop', '--stages', '2'],
    'pre-ln maybe': ['train', '--pre-ln', 'maybe'],
    'negative rate': ['train', '--learning-rate', '-1e-3'],
    'empty compensation': ['train', '--compensation', ''],
    # Checked before the checkpoint is looked for: an empty OUT is enough.
    'length': ['sample', '--ckpt', tmp / 'no_checkpoint', '--length', str(10**12)],
    'temperature': ['sample', '--ckpt', tmp / 'no_checkpoint', '--temperature', 'nan'],
  }
  for i, (args, _) in enumerate(BAD_SETTINGS):  # checked before any data is read or compiled
    lines[f'bad {i}'] = ['train', *args, '--out', os.devnull + '/x']
  return tmp, dict(zip(lines, forked_cli.run_each(*lines.values()), strict=True))


def test_bad_settings_fail_in_one_line(refused):
  for i, (_, words) in enumerate(BAD_SETTINGS):
    assert_one_line_error(refused[1][f'bad {i}'], 2, *words)


def test_missing_data_file(refused):
  assert_one_line_error(
    refused[1]['missing data'], 2, 'data file not found', '/nonexistent/corpus.txt'
  )


def test_corpus_shorter_than_one_window(refused):
  assert_one_line_error(refused[1]['short corpus'], 2, 'train split', 'one window', '--seq-len')


def test_resume_without_a_checkpoint(refused):
  tmp, results = refused
  assert_one_line_error(results['resume'], 2, '--resume', 'no checkpoint', str(tmp / 'empty'))


def test_cpu_devices_sets_the_device_count(tmp_path, text_corpus):
  env = {k: v for k, v in os.environ.items() if k != 'XLA_FLAGS'}
  result = run_cli(
    'train',
    *SMALL,
    '--data',
    f'text:{text_corpus}',
    '--schedule',
    'ouroboros',
    '--stages',
    '2',
    '--cpu-devices',
    '1',
    '--out',
    tmp_path / 'run',
    env=env,
  )
  assert_one_line_error(result, 2, 'need 2 devices', 'only 1', '--cpu-devices 2')


def test_sample_without_a_checkpoint(refused):
  assert_one_line_error(refused[1]['sample'], 2, 'no checkpoint')


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path, text_corpus):
  # A learning rate of 1e30 and no warmup: the first update sends the weights to ~1e30, so the
  # second step's logits overflow and its loss is NaN. The state after step 1 is still finite.
  out = tmp_path / 'nan'
  result = run_cli(
    'train',
    *SMALL,
    '--data',
    f'text:{text_corpus}',
    '--learning-rate',
    '1e30',
    '--warmup-steps',
    '0',
    '--steps',
    '10',
    '--checkpoint-every',
    '1',
    '--out',
    out,
  )
  assert_one_line_error(
    result,
    3,
    'loss became nan at step 2',
    f'the last good checkpoint is step 1 in {out}/checkpoints',
  )
  assert sorted(os.listdir(out / 'checkpoints')) == ['1']


# ----------------------------------------------------------------------------- train + sample


def test_train_then_sample(tmp_path, text_corpus):
  out = tmp_path / 'run'
  result = run_cli(
    'train',
    *SMALL,
    '--data',
    f'text:{text_corpus}',
    '--steps',
    '30',
    '--eval-every',
    '15',
    '--out',
    out,
    '--cpu-devices',
    '2',
  )
  assert result.returncode == 0, result.stderr
  assert 'Traceback' not in result.stderr
  done = result.stdout.strip().splitlines()[-1]
  assert done.startswith('done: val bpb ') and 'test bpb' in done and 'tokens/s' in done
  assert {'config.json', 'metrics.jsonl', 'summary.json', 'tb', 'checkpoints'} <= set(
    os.listdir(out)
  )

  result = run_cli(
    'sample', '--ckpt', out, '--prompt', 'ROMEO:', '--length', '64', '--temperature', '0'
  )
  assert result.returncode == 0, result.stderr
  text = result.stdout[:-1]  # print's newline
  assert text.startswith('ROMEO:')
  # 64 bytes decoded with errors='replace': at most 64 characters, and ASCII after training.
  assert 0 < len(text) - len('ROMEO:') <= 64
  again = run_cli(
    'sample', '--ckpt', out, '--prompt', 'ROMEO:', '--length', '64', '--temperature', '0'
  )
  assert again.stdout == result.stdout  # greedy is deterministic
  # Bytes that are not UTF-8 arrive in argv as surrogates and are passed on as the raw bytes.
  raw = run_cli(
    'sample',
    '--ckpt',
    out,
    '--prompt',
    b'\xff\xfe'.decode('utf-8', 'surrogateescape'),
    '--length',
    '8',
    errors='replace',
  )
  assert raw.returncode == 0 and 'Traceback' not in raw.stderr, raw.stderr


# ----------------------------------------------------------------------------- hardening


def _wait_for(condition, timeout_s: float, what: str):
  deadline = time.monotonic() + timeout_s
  while not condition():
    assert time.monotonic() < deadline, f'timed out waiting for {what}'
    time.sleep(0.2)


def test_one_run_per_out_sigterm_and_resume(tmp_path, text_corpus):
  """A second run on a busy OUT is refused; SIGTERM stops the first cleanly at a complete
  checkpoint; without a terminal it prints status lines and checkpoint sizes; it resumes."""
  out = tmp_path / 'run'
  common = [
    *SMALL[:-1],
    '--data',
    f'text:{text_corpus}',
    '--log-every',
    '10',
    '--eval-every',
    '1000000',
    '--checkpoint-every',
    '20',
    '--out',
    out,
  ]
  first = subprocess.Popen(
    [sys.executable, '-m', 'ouroboros_jax', 'train', *map(str, common), '--steps', '1000000'],
    cwd=REPO_ROOT,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
  )
  try:
    _wait_for(lambda: os.path.isdir(out / 'checkpoints' / '20'), 120, 'the first checkpoint')
    second = run_cli('train', *common, '--steps', '40', '--seed', '1')
    assert_one_line_error(second, 2, 'in use by another run', f'process {first.pid}')
    first.send_signal(signal.SIGTERM)
    stdout, stderr = first.communicate(timeout=60)
  finally:
    first.kill()
  assert first.returncode == 128 + signal.SIGTERM, stderr
  lines = stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith(
    'error: stopped by SIGTERM; the latest complete checkpoint is step '
  ), stderr
  step = int(lines[0].split('is step ')[1].split()[0])
  assert step % 20 == 0 and step >= 20 and os.path.isdir(out / 'checkpoints' / str(step))
  assert 'step 10/1000000: loss ' in stdout and 'tokens/s, ETA ' in stdout  # no terminal here
  assert 'checkpoint step 20: ' in stdout and ' MiB in ' in stdout

  resumed = run_cli('train', *common, '--steps', step + 20, '--resume', timeout=180)
  assert resumed.returncode == 0, resumed.stderr
  assert f'with changed settings: --steps 1000000 -> {step + 20}' in resumed.stdout
  with open(out / 'metrics.jsonl') as f:
    train_steps = [r['step'] for r in map(json.loads, f) if r['split'] == 'train']
  assert train_steps == sorted(set(train_steps)) and train_steps[-1] == step + 20


@pytest.mark.parametrize('where', ['file', 'under_file'])
def test_unwritable_out_is_one_line(refused, where):
  tmp, results = refused
  out = tmp / 'a_file' if where == 'file' else tmp / 'a_file' / 'run'
  result = results['out is a file' if where == 'file' else 'out under a file']
  assert_one_line_error(result, 2, f'cannot write into --out {out}', 'writable directory')


def test_data_beyond_the_vocabulary_is_one_line(refused):
  result = refused[1]['vocabulary']
  assert_one_line_error(result, 2, '--vocab-size 100', 'smaller than', '256')


def test_a_finished_run_is_not_overwritten(refused):
  assert_one_line_error(refused[1]['finished'], 2, 'already holds a finished run')


def test_silent_settings_are_refused_and_booleans_take_values(refused):
  results = refused[1]
  assert_one_line_error(results['stages do nothing'], 2, '--stages 2 does nothing')
  parser = cli_parsers.make_parser()
  for flags, value in (
    (['--pre-ln', 'false'], False),
    (['--pre-ln'], True),
    (['--no-pre-ln'], False),
    (['--pre-ln', 'true'], True),
  ):
    assert cli_parsers.config_from_args(parser.parse_args(['train', *flags])).model.pre_ln is value
  assert_one_line_error(results['pre-ln maybe'], 2, "expected true or false, got 'maybe'")
  # A negative number in exponent form is a value, not a flag; an empty value is refused.
  args = parser.parse_args(['train', '--learning-rate', '-1e-3'])
  assert cli_parsers.config_from_args(args).learning_rate == -1e-3
  assert_one_line_error(results['negative rate'], 2, '--learning-rate must be positive')
  assert_one_line_error(results['empty compensation'], 2, '--compensation is empty')
  # An empty --out is refused, not read as 'none' (which wrote to runs/PRESET-SCHEDULE).
  args = parser.parse_args(['train', '--out', ''])
  with pytest.raises(ConfigError, match='out.? is empty'):
    cli_parsers.config_from_args(args).validate()
  assert cli_parsers.config_from_args(parser.parse_args(['train', '--out', 'none'])).out is None


def _refused(flags: list[str], *words: str) -> None:
  """`train FLAGS` is refused by the settings check, one line naming every word."""
  cfg = cli_parsers.config_from_args(cli_parsers.make_parser().parse_args(['train', *flags]))
  with pytest.raises(ConfigError) as error:
    cfg.validate()
  message = cli_message(error.value)
  assert '\n' not in message
  for word in words:
    assert word in message, (word, message)


def test_a_sync_warm_up_as_long_as_the_run_is_refused():
  _refused(
    ['--schedule', 'ouroboros', '--stages', '2', '--sync-warmup-steps', '50', '--steps', '20'],
    '--sync-warmup-steps 50',
    '--steps 20',
    'synchronous backprop',
    'below 20',
  )
  _refused(
    ['--schedule', 'ouroboros', '--stages', '2', '--sync-warmup-steps', '20', '--steps', '20'],
    '--sync-warmup-steps 20',
  )
  ok = ['--schedule', 'ouroboros', '--stages', '2', '--sync-warmup-steps', '19', '--steps', '20']
  cli_parsers.config_from_args(cli_parsers.make_parser().parse_args(['train', *ok])).validate()


def test_microbatches_on_a_schedule_without_them_is_refused():
  for schedule in ('model_parallel',):
    _refused(
      ['--schedule', schedule, '--stages', '2', '--microbatches', '3'],
      '--microbatches 3 applies to --schedule gpipe',
      'ouroboros',
      f'not {schedule}',
      'drop it',
    )
  _refused(['--microbatches', '2'], '--microbatches 2', 'not backprop')
  parser = cli_parsers.make_parser()
  for flags, micro in (
    (['--schedule', 'ouroboros', '--stages', '2'], 1),  # not given: nothing to refuse
    (['--schedule', 'ouroboros', '--stages', '2', '--microbatches', '1'], 1),
    (['--schedule', 'ouroboros', '--stages', '2', '--microbatches', '8'], 8),
    (['--schedule', 'gpipe', '--stages', '2'], 4),  # not given: gpipe's default
    (['--schedule', 'gpipe', '--stages', '2', '--microbatches', '8'], 8),
  ):
    cfg = cli_parsers.config_from_args(parser.parse_args(['train', *flags]))
    cfg.validate()
    assert cfg.schedule.num_microbatches == micro, flags


def test_the_tie_is_an_ouroboros_flag_and_the_stash_policy_is_every_schedule_s():
  """--tied-grad changes nothing on the other schedules, nor --stash-policy on the replay stash:
  refused in one line, as the other Ouroboros flags are. --stash-policy applies to every other
  schedule (their recomputation, tests/test_recompute.py)."""
  for schedule in ('gpipe', 'model_parallel', 'zb_h1'):
    _refused(
      ['--schedule', schedule, '--stages', '2', '--tied-grad', 'mean'],
      '--tied-grad mean applies to --schedule ouroboros only',
      f'not {schedule}',
      'drop it or use --schedule ouroboros',
    )
  _refused(['--tied-grad', 'mean'], '--tied-grad mean applies', 'not backprop')
  _refused(
    ['--schedule', 'ouroboros', '--stages', '2', '--stash', 'replay', '--stash-policy', 'dots'],
    '--stash-policy dots chooses what --stash graph keeps',
    '--stash replay keeps only the input',
    'drop it or use --stash graph',
  )
  parser = cli_parsers.make_parser()
  for flags in (
    ['--schedule', 'gpipe', '--stages', '2'],
    ['--schedule', 'zb_h1', '--stages', '2', '--stash-policy', 'nothing'],
    ['--schedule', 'ouroboros', '--stages', '2', '--stash', 'replay'],
    ['--schedule', 'ouroboros', '--stages', '2', '--stash-policy', 'all', '--tied-grad', 'mean'],
  ):
    cli_parsers.config_from_args(parser.parse_args(['train', *flags])).validate()
  # A run saved before (every config.json holds them; the policy's default was once 'all')
  # still loads and resumes: what nothing read is dropped, but the other schedules' policy,
  # which they now read, is kept (a resume does not compare it there: it shapes no state).
  for saved, kept in (
    (
      {'name': 'gpipe', 'num_stages': 2, 'stash_policy': 'all', 'tied_grad': 'mean'},
      {'stash_policy': 'all'},
    ),
    ({'name': 'ouroboros', 'num_stages': 2, 'stash': 'replay', 'stash_policy': 'all'}, {}),
    (
      {'name': 'ouroboros', 'num_stages': 2, 'stash_policy': 'all', 'tied_grad': 'mean'},
      {'stash_policy': 'all', 'tied_grad': 'mean'},
    ),
  ):
    cfg = presets.get_preset('tiny')
    old = config.TrainConfig.from_dict({**cfg.to_dict(), 'schedule': saved})
    old.validate()
    assert {k: getattr(old.schedule, k) for k in kept} == kept
    assert old.schedule.stash_policy == kept.get('stash_policy', 'auto')


def test_streamed_micro_batches_are_an_ouroboros_flag():
  _refused(
    ['--schedule', '1f1b', '--stages', '2', '--flow', 'stream'],
    '--flow stream applies to --schedule ouroboros only',
    'not 1f1b',
  )
  _refused(['--schedule', 'ouroboros', '--flow', 'streams'], 'unknown --flow streams', 'batch')
  flags = ['--schedule', 'ouroboros', '--stages', '2', '--microbatches', '4', '--flow', 'stream']
  cfg = cli_parsers.config_from_args(cli_parsers.make_parser().parse_args(['train', *flags]))
  cfg.validate()
  assert cfg.schedule_config().flow == 'stream'


def test_too_many_stages_says_each_stage_needs_a_whole_layer():
  _refused(
    ['--schedule', 'ouroboros', '--stages', '3', '--num-layers', '2'],
    '--stages 3 cuts the model into 3 groups of whole layers',
    'only 2 layers',
    'use --stages 2 or fewer, or --num-layers 3 or more',
  )


def test_out_of_memory_names_the_sizes_to_lower():
  parser = cli_parsers.make_parser()
  oom = RuntimeError('RESOURCE_EXHAUSTED: Out of memory allocating 1.2 TiB')
  assert cli_messages.out_of_memory(oom)
  args = parser.parse_args(['train', '--seq-len', '200000', '--batch-size', '1'])
  message = cli_messages.out_of_memory_message(args, oom)
  assert '\n' not in message and message.startswith('out of memory (RESOURCE_EXHAUSTED')
  for words in ('--seq-len (now 200000; attention memory grows with its square)',
                '--batch-size (now 1)', '--d-model (now 128)', '--num-layers (now 2)',
                '--schedule gpipe or ouroboros with --stages N', 'more devices'):  # fmt: skip
    assert words in message, (words, message)
  args = parser.parse_args(['train', '--schedule', 'gpipe', '--stages', '2', '--num-layers', '4'])
  message = cli_messages.out_of_memory_message(args, oom)
  assert 'more --microbatches (now 4)' in message and 'more --stages (now 2)' in message
  assert '--stash-policy nothing' in message  # every schedule can recompute
  args = parser.parse_args(['train', '--schedule', 'gpipe', '--stages', '2', '--num-layers', '4',
                            '--stash-policy', 'nothing'])  # fmt: skip
  assert '--stash-policy' not in cli_messages.out_of_memory_message(args, oom)  # it keeps the least
  args = parser.parse_args(['sample', '--ckpt', 'runs/x'])
  assert 'more memory' in cli_messages.out_of_memory_message(args, oom)


def test_sample_refuses_impossible_lengths_and_temperatures(refused):
  assert_one_line_error(refused[1]['length'], 2, '--length', str(10**12))
  assert_one_line_error(refused[1]['temperature'], 2, '--temperature', 'nan')


def test_ctrl_c_before_the_first_checkpoint_says_so(tmp_path, text_corpus):
  out = tmp_path / 'run'
  run = subprocess.Popen(
    [
      sys.executable,
      '-m',
      'ouroboros_jax',
      'train',
      *SMALL,
      '--data',
      f'text:{text_corpus}',
      '--log-every',
      '5',
      '--steps',
      '1000000',
      '--checkpoint-every',
      '1000000',
      '--out',
      out,
    ],
    cwd=REPO_ROOT,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
  )
  try:
    _wait_for(
      lambda: (out / 'metrics.jsonl').exists() and (out / 'metrics.jsonl').stat().st_size > 0,
      120,
      'the first metrics row',
    )
    run.send_signal(signal.SIGINT)
    _, stderr = run.communicate(timeout=60)
  finally:
    run.kill()
  assert run.returncode == 128 + signal.SIGINT, stderr
  assert stderr.strip().splitlines() == [
    f'error: interrupted before the first checkpoint; nothing to resume in {out}/checkpoints: '
    'start again with another --out (or remove its metrics.jsonl and config.json).'
  ]


def test_a_dangling_symlink_out_is_named_as_one(tmp_path):
  from ouroboros_jax.training import rundir

  out = tmp_path / 'run'
  out.symlink_to(tmp_path / 'gone')
  with pytest.raises(ConfigError, match=r'it is a symbolic link to .*gone, which does not exist'):
    rundir.check_writable(str(out))


def test_a_run_stopped_before_it_logged_is_told_to_run_again(tmp_path):
  """No metrics row yet: the same --out takes the run again, and no file is named to remove."""
  out = tmp_path / 'run'
  out.mkdir()
  args = cli_parsers.make_parser().parse_args(['train', '--out', str(out)])
  line = cli_messages.stopped_message(args, signal.SIGTERM)
  assert line == (
    f'stopped by SIGTERM before the first checkpoint; nothing to resume in {out}/checkpoints: '
    'run it again.'
  )
  (out / 'metrics.jsonl').write_text('{"step": 10}\n')
  assert 'remove its metrics.jsonl' in cli_messages.stopped_message(args, signal.SIGTERM)


def test_a_refused_run_leaves_no_directories_behind(tmp_path):
  """A run refused after it made --out (data that is not there) takes the directories it made
  away again; one that existed stays."""
  deep = tmp_path / 'a' / 'b' / 'c'
  result = run_cli('train', *SMALL, '--steps', '2', '--data', 'text:/no/such.txt', '--out', deep)
  assert_one_line_error(result, 2, 'data file not found')
  assert os.listdir(tmp_path) == []
  (tmp_path / 'mine').mkdir()
  result = run_cli(
    'train', *SMALL, '--steps', '2', '--data', 'text:/no/such.txt', '--out', tmp_path / 'mine'
  )
  assert result.returncode == 2 and (tmp_path / 'mine').is_dir()
