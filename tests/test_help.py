"""`--help` of every subcommand (issue 42, item 7): each flag says what it does, its choices and
its default, read from where they are defined; each subcommand offers only the flags it reads.

The parsers are walked in-process (`cli_parsers.make_parser`), so nothing here compiles or trains.
"""

from __future__ import annotations

import argparse
import re

import pytest

from ouroboros_jax import choices as named
from ouroboros_jax import cli, cli_parsers, flag_help, optimizers
from ouroboros_jax.models import attention
from ouroboros_jax.models.model import ARCHS, DTYPES
from ouroboros_jax.perf import plan
from ouroboros_jax.perf import settings as settings_lib
from ouroboros_jax.schedules.compensation import COMPENSATIONS
from ouroboros_jax.schedules.stash import STASH_POLICIES
from ouroboros_jax.training import config, field_flags, presets

COMMANDS = cli_parsers.make_parser().commands

# Every flag that takes one of a fixed set of names, with the set, from where it is defined.
CHOICES = {
  '--model': ARCHS,
  '--dtype': DTYPES,
  '--param-dtype': DTYPES,
  '--attention': attention.IMPLEMENTATIONS,
  '--schedule': named.SCHEDULES,
  '--stash': named.STASH_MODES,
  '--stash-policy': tuple(STASH_POLICIES),
  '--stash-memory': named.STASH_MEMORIES,
  '--forward': named.FORWARD_MODES,
  '--flow': named.FLOW_MODES,
  '--tied-grad': named.TIED_GRAD_MODES,
  '--preset': tuple(presets.PRESETS),
  '--data-order': config.DATA_ORDERS,
  '--optimizer': optimizers.OPTIMIZERS,
  '--compensation': COMPENSATIONS,
  '--try-stash': settings_lib.STASH_SETTINGS,
  '--try-stash-memory': named.STASH_MEMORIES,
  '--try-schedules': named.SCHEDULES,
  '--hardware': tuple(plan.HARDWARE),
}
# What only the training loop reads: `compile` and `plan` compile one step on abstract batches.
TRAINING_ONLY = (
  '--steps',
  '--log-every',
  '--eval-every',
  '--eval-batches',
  '--checkpoint-every',
  '--keep-checkpoints',
  '--data',
  '--out',
  '--resume',
  '--quiet',
)


def _actions():
  """(subcommand, flag, action) for every action of every subcommand but -h."""
  for command, parser in COMMANDS.items():
    for action in parser._actions:  # pylint: disable=protected-access
      if isinstance(action, argparse._HelpAction):  # pylint: disable=protected-access
        continue
      yield command, (action.option_strings or [action.dest])[0], action


def _help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
  """The action's help as --help prints it (%(default)s filled in), on one line."""
  return ' '.join(parser._get_formatter()._expand_help(action).split())  # pylint: disable=protected-access


def test_every_flag_of_every_subcommand_says_what_it_does_and_its_default():
  lacking, only_a_default, no_default = [], [], []
  for command, flag, action in _actions():
    text = _help(COMMANDS[command], action) if action.help else ''
    if not text or action.help == argparse.SUPPRESS:
      lacking.append(f'{command} {flag}')
      continue
    if re.fullmatch(r'\(?(tiny|default)[: ].*', text):  # a value, and nothing about the flag
      only_a_default.append(f'{command} {flag}: {text}')
    # --no-X says 'same as --X false'; a positional and a required flag have no default.
    if not (
      text.startswith('same as --')
      or not action.option_strings
      or action.required
      or 'default' in text
    ):
      no_default.append(f'{command} {flag}: {text}')
  assert not lacking, f'{len(lacking)} flags without help: {lacking}'
  assert not only_a_default, only_a_default
  assert not no_default, no_default
  assert sum(1 for _ in _actions()) > 150  # the walk reached every subcommand's field flags


def test_flags_with_choices_list_them():
  seen = set()
  for command, flag, action in _actions():
    if flag in CHOICES:
      text = _help(COMMANDS[command], action)
      words = set(re.split(r'[\s,;:()]+', text))
      missing = [c for c in CHOICES[flag] if c not in words]
      assert not missing, f'{command} {flag} does not list {missing}: {text}'
      seen.add(flag)
  assert seen == set(CHOICES)


def test_help_reads_defaults_from_where_they_are_defined(monkeypatch):
  tiny = config.flat(presets.get_preset(config.TrainConfig().preset))
  train = COMMANDS['train']
  by_flag = {a.option_strings[0]: a for a in train._actions if a.option_strings}
  for name in ('num_layers', 'steps', 'dtype', 'stash_policy', 'keep_checkpoints'):
    assert f'(default {tiny[name]}' in _help(train, by_flag[field_flags.flag(name)]), name
  # Rules are read at the time of asking: change the constant and the help follows.
  monkeypatch.setitem(config.DEFAULT_MUON_RATES, 'exact', 0.0123)
  monkeypatch.setitem(optimizers.DEFAULT_MOMENTUM, 'nadamw', 0.987)
  assert '0.0123' in flag_help.field_help('muon_learning_rate')
  assert '0.987' in flag_help.field_help('momentum')
  assert 'backprop' in _help(COMMANDS['plan'], _by_flag('plan')['--try-schedules'])
  assert f'default {",".join(settings_lib.Tries().stashes)}' in _help(
    COMMANDS['plan'], _by_flag('plan')['--try-stash']
  )


def test_help_quotes_no_measured_results():
  """A measurement belongs in docs/results/ with its conditions, not in a flag's help."""
  for command, flag, action in _actions():
    text = _help(COMMANDS[command], action) if action.help else ''
    assert not re.search(r'\bbpb\b|\bbpc\b|measured', text), f'{command} {flag}: {text}'


def _by_flag(command: str) -> dict[str, argparse.Action]:
  return {o: a for a in COMMANDS[command]._actions for o in a.option_strings}


@pytest.mark.parametrize('command', ['compile', 'plan'])
def test_compile_and_plan_offer_no_training_only_flag(command):
  flags = set(_by_flag(command))
  assert not flags & set(TRAINING_ONLY), sorted(flags & set(TRAINING_ONLY))
  assert {'--d-model', '--batch-size', '--optimizer', '--topology', '--json'} <= flags


def test_plan_offers_no_flag_its_tries_replace():
  flags = set(_by_flag('plan'))
  replaced = {'--schedule', '--stages', '--data-parallel', '--microbatches', '--stash'}
  assert not flags & replaced
  assert {'--try-schedules', '--try-stages', '--try-microbatches', '--try-stash'} <= flags


def test_bench_offers_no_flag_of_the_training_loop():
  flags = set(_by_flag('bench'))
  assert not flags & {'--steps', '--log-every', '--checkpoint-every', '--data', '--eval-every'}
  assert {'--bench-steps', '--warmup', '--out', '--stages'} <= flags


@pytest.mark.parametrize(
  'argv, words',
  [
    (['compile', '--steps', '5'], ('`ouroboros compile` takes no --steps', 'one step', 'train')),
    (['plan', '--log-every=5'], ('`ouroboros plan` takes no --log-every',)),
    (['plan', '--stages', '2'], ('`ouroboros plan` takes no --stages', '--try-stages')),
    (['compile', '--growth', 'mslt:1x*'], ('takes no --growth', 'each phase')),
    (['bench', '--no-download'], ('`ouroboros bench` takes no --no-download',)),
  ],
)
def test_a_flag_the_subcommand_does_not_read_is_one_line_saying_why(argv, words, capsys):
  with pytest.raises(SystemExit) as info:
    cli.main(argv)
  assert info.value.code == 2
  err = capsys.readouterr().err
  assert err.count('\n') == 1 and err.startswith('error: '), err
  for word in words:
    assert word in err, (word, err)


def test_compile_takes_a_warm_up_longer_than_the_presets_run():
  """`compile` has no --steps, so the preset's cannot refuse a --sync-warmup-steps (train's
  check of the two stays)."""
  flags = ['--schedule', 'ouroboros', '--stages', '2', '--sync-warmup-steps', '5000']
  args = cli_parsers.make_parser().parse_args(['compile', *flags])
  cfg = cli._compile_target(args)  # pylint: disable=protected-access
  assert cfg.schedule.sync_warmup_steps == 5000 < cfg.steps
  train = cli_parsers.config_from_args(cli_parsers.make_parser().parse_args(['train', *flags]))
  with pytest.raises(config.ConfigError, match='not shorter than'):
    train.validate()
