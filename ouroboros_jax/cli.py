"""The `ouroboros` command (also `python -m ouroboros_jax`).

    ouroboros train [--preset tiny] [--FIELD VALUE ...] [--out DIR] [--resume] [--quiet]
                    [--cpu-devices N]
    ouroboros sample --ckpt OUT [--prompt TEXT] [--length N] [--temperature T] [--seed S]

`train` takes one flag per field of `TrainConfig` and `ModelConfig` (`--d-model 64`,
`--num-layers 2`, `--schedule ouroboros`, `--stages 4`, `--layers-per-stage 1,2,1`, ...; booleans
as `--pre-ln` / `--no-pre-ln`); flags given override the preset, the rest keep its values.

User errors (bad settings, missing data, nothing to resume, ...) print one line
`error: <message>` on stderr and exit with status 2; a NaN/Inf loss exits with status 3.
"""

from __future__ import annotations

import argparse
import difflib
import sys

from ouroboros_jax import presets

EXIT_USAGE, EXIT_NONFINITE = 2, 3


class _Parser(argparse.ArgumentParser):
  """argparse whose errors are one line, `error: ...`, with a close-match hint."""

  def error(self, message):
    if message.startswith('unrecognized arguments:'):
      unknown = message.split(':', 1)[1].split()
      flags = [a for a in unknown if a.startswith('--')] or unknown
      known = [o for a in self._actions for o in a.option_strings]
      close = difflib.get_close_matches(flags[0].split('=')[0], known, n=1)
      hint = f'; did you mean {close[0]}?' if close else ''
      message = f'unknown flag {flags[0]} (ouroboros {self.prog.split()[-1]}){hint}'
    _fail(f'{message}; see --help.' if not message.endswith('?') else message, EXIT_USAGE)


def _fail(message: str, code: int):
  print(f'error: {message}', file=sys.stderr)
  sys.exit(code)


def _bool(text: str) -> bool:
  if text.lower() in ('1', 'true', 'yes', 'on'):
    return True
  if text.lower() in ('0', 'false', 'no', 'off'):
    return False
  raise argparse.ArgumentTypeError(f'expected true or false, got {text!r}')


def _optional(kind):
  def parse(text: str):
    return None if text.lower() in ('none', '') else kind(text)
  parse.__name__ = kind.__name__
  return parse


def _add_field_flags(parser: argparse.ArgumentParser) -> None:
  """One flag per config field, default SUPPRESS so only flags given show up in the namespace."""
  model_group = parser.add_argument_group('model (ModelConfig)')
  train_group = parser.add_argument_group('training (TrainConfig)')
  for name, (kind, optional, owner) in presets.fields().items():
    group = model_group if owner is presets.ModelConfig else train_group
    default = getattr(presets.ModelConfig() if owner is presets.ModelConfig
                      else presets.TrainConfig(), name)
    help_text = f'(tiny: {default})'
    if name == 'out':
      help_text = 'output directory (default runs/<preset>-<schedule>)'
    if name == 'preset':
      help_text = f'starting point: {", ".join(presets.PRESETS)} (default tiny)'
    if kind is bool:
      group.add_argument(presets.flag(name), dest=name, action=argparse.BooleanOptionalAction,
                         default=argparse.SUPPRESS, help=help_text)
    else:
      parse = _optional(kind) if optional else kind
      group.add_argument(presets.flag(name), dest=name, type=parse, default=argparse.SUPPRESS,
                         metavar=kind.__name__.upper(), help=help_text)


def _cpu_devices_flag(parser):
  parser.add_argument('--cpu-devices', type=int, default=None, metavar='N',
                      help='simulate N CPU devices (for multi-stage schedules on a CPU machine)')


def make_parser() -> argparse.ArgumentParser:
  parser = _Parser(prog='ouroboros', allow_abbrev=False,
                   description='Ouroboros delayed-gradient model parallelism for Transformer LMs.')
  sub = parser.add_subparsers(dest='command', metavar='{train,sample}', parser_class=_Parser)
  sub.required = True

  train = sub.add_parser('train', help='train a byte-level Transformer LM', allow_abbrev=False,
                         description='Train a preset; any field can be overridden by its flag.')
  train.add_argument('--resume', action='store_true',
                     help="continue from OUT's latest checkpoint, exactly where it stopped")
  train.add_argument('--quiet', action='store_true', help='no progress bar or eval lines')
  _cpu_devices_flag(train)
  _add_field_flags(train)

  sample = sub.add_parser('sample', help='generate text from a checkpoint', allow_abbrev=False)
  sample.add_argument('--ckpt', required=True, metavar='OUT',
                      help='the OUT directory of a training run (its latest checkpoint is used)')
  sample.add_argument('--prompt', default='', help='text to continue (default: a new line)')
  sample.add_argument('--length', type=int, default=500, help='bytes to generate')
  sample.add_argument('--temperature', type=float, default=0.8, help='0 means greedy')
  sample.add_argument('--seed', type=int, default=0)
  sample.add_argument('--step', type=int, default=None, help='checkpoint step (default latest)')
  _cpu_devices_flag(sample)
  return parser


def config_from_args(args: argparse.Namespace) -> presets.TrainConfig:
  """The preset named by --preset with every field flag given applied on top."""
  given = {k: v for k, v in vars(args).items() if k in presets.fields()}
  cfg = presets.get_preset(given.pop('preset', 'tiny'))
  return presets.override(cfg, given)


def _run_train(args) -> None:
  from ouroboros_jax import train

  cfg = config_from_args(args)
  train.train(cfg, resume=args.resume, quiet=args.quiet)


def _run_sample(args) -> None:
  from ouroboros_jax import sample

  text = sample.sample(args.ckpt, prompt=args.prompt, length=args.length,
                       temperature=args.temperature, seed=args.seed, step=args.step)
  sys.stdout.write(text + '\n')


def main(argv=None) -> int:
  args = make_parser().parse_args(argv)
  if args.cpu_devices is not None:
    # Must happen before anything initialises a JAX backend (parsing above does not).
    import jax
    if args.cpu_devices < 1:
      _fail(f'--cpu-devices must be >= 1, got {args.cpu_devices}.', EXIT_USAGE)
    jax.config.update('jax_num_cpu_devices', args.cpu_devices)

  from ouroboros_jax.data import DataError
  from ouroboros_jax.model import ConfigError
  from ouroboros_jax.train import NonFiniteLossError

  try:
    {'train': _run_train, 'sample': _run_sample}[args.command](args)
  except (ConfigError, DataError) as e:
    _fail(_one_line(e), EXIT_USAGE)
  except NonFiniteLossError as e:
    _fail(_one_line(e), EXIT_NONFINITE)
  except KeyboardInterrupt:
    _fail('interrupted; resume with --resume (the latest checkpoint is complete).', 130)
  return 0


def _one_line(exc: BaseException) -> str:
  return ' '.join(str(exc).split())
