"""The `ouroboros` command's parsers: one per subcommand (`make_parser`), one flag per config
field (`--d-model 64`, `--num-layers 2`, `--schedule ouroboros`, `--stages 4`,
`--layers-per-stage 1,2,1`, ...; booleans as `--pre-ln`, `--pre-ln false` or `--no-pre-ln`), and
the config the flags given make (`config_from_args`) and give back (`to_flags`).

`compile` and `plan` take the field flags that shape the step, none of the training loop's
(`_COMPILE_OMITS`, `_PLAN_OMITS`); `bench` none of the loop's either (`_BENCH_OMITS`); each
flag's help is `flag_help.field_help`. A parser's error is one line, `error: <message>`, exit
status 2 (`fail`), with the closest flag for one it does not know (`unknown_flag`).
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys

from ouroboros_jax import errors, flag_help
from ouroboros_jax.choices import FORWARD_MODES, SCHEDULES, STASH_MEMORIES, STASH_POLICY_NAMES
from ouroboros_jax.runtime import watchdog
from ouroboros_jax.training import config, field_flags, presets

EXIT_USAGE = errors.UserError.exit_code


class _Parser(argparse.ArgumentParser):
  """argparse whose errors are one line, `error: ...`, with a close-match hint."""

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    # `--learning-rate -1e-3` is a negative number, not a flag (argparse knows only -1 and -.5).
    self._negative_number_matcher = re.compile(r'^-(\d+\.?\d*|\.\d+)(e[-+]?\d+)?$', re.I)

  def error(self, message):
    fail(f'{message}; see --help.', EXIT_USAGE)


def unknown_flag(parser: argparse.ArgumentParser, extra: list[str]):
  """One line for arguments no flag takes, with the closest known flag of that subcommand."""
  flags = [a for a in extra if a.startswith('-')] or extra
  flag = flags[0].split('=')[0]
  reason = getattr(parser, 'omitted', {}).get(flag)
  if reason is not None:  # a `train` flag this subcommand does not read
    fail(f'`{parser.prog}` takes no {flag}: {reason}; drop it (see --help).', EXIT_USAGE)
  known = [o for a in parser._actions for o in a.option_strings]  # pylint: disable=protected-access
  close = difflib.get_close_matches(flags[0].split('=')[0], known, n=1, cutoff=0.75)
  hint = f'; did you mean {close[0]}?' if close else '; see --help for the flags.'
  what = 'flag (no such field)' if flags[0].startswith('-') else 'argument'
  fail(f'unknown {what} {flags[0]} for `{parser.prog}`{hint}', EXIT_USAGE)


def fail(message: str, code: int):
  """Ends the process with `error: <message>` on stderr and exit status `code`."""
  watchdog.said()  # a watchdog ending the process after this adds no line of its own
  print(f'error: {message}', file=sys.stderr)
  sys.exit(code)


def _bool(text: str) -> bool:
  if text.lower() in ('1', 'true', 'yes', 'on'):
    return True
  if text.lower() in ('0', 'false', 'no', 'off'):
    return False
  raise argparse.ArgumentTypeError(f'expected true or false, got {text!r}')


def _optional(kind):
  def parse(text: str):  # '' is kept: an empty --out or --data is refused by name, not defaulted
    return None if text.lower() == 'none' else kind(text)

  parse.__name__ = kind.__name__
  return parse


# Config fields that a subcommand does not read, by flat name, each group with the reason its
# `--help` leaves them out (and `unknown_flag` says when one is given).
_LOOP_FIELDS = (
  'data',
  'data_dir',
  'download',
  'data_order',
  'steps',
  'log_every',
  'eval_every',
  'eval_batches',
  'test_batches',
  'eval_mem_len',
  'checkpoint_every',
  'keep_checkpoints',
  'drain',
  'fresh_optimizer',
)
_COMPILE_OMITS = {
  **dict.fromkeys(
    (*_LOOP_FIELDS, 'out'),
    'it compiles one step on abstract batches; the data, the length of the run, its '
    "evaluations, checkpoints and output directory are `train`'s",
  ),
  **dict.fromkeys(
    ('growth', 'vcycle'),
    'they change the model mid-run, so there is no one step to compile; compile each phase as '
    'its own model (--num-layers, --d-model)',
  ),
}
# What `plan` and `bench` try rather than take (the --try-* flags, settings.Tries).
_TRIED = {
  'microbatches': 'it tries each of --try-microbatches',
  'stash': 'it tries each of --try-stash',
  'stash_policy': 'it tries each of --try-policy, and of --try-stash (graph/POLICY) on ouroboros',
  'stash_memory': 'it tries each of --try-stash-memory',
  'forward': 'it tries both Ouroboros forwards, locked and pipelined',
  'fsdp': 'it tries each layout of the state over the data replicas (--try-sharding)',
  'shard_update': 'it tries each layout of the state over the data replicas (--try-sharding)',
}
_PLAN_OMITS = {
  **_COMPILE_OMITS,
  **_TRIED,
  'schedule': 'it tries every schedule; choose some with --try-schedules',
  'stages': 'it tries G = stages with the other devices as data replicas; choose with --try-stages',
  'data_parallel': 'it tries G = stages with the other devices as data replicas; choose with '
  '--try-stages',
}
_BENCH_OMITS = {
  **dict.fromkeys(
    _LOOP_FIELDS,
    'it times --bench-steps steps on synthetic batches; the data, the length of the run, its '
    "evaluations and checkpoints are `train`'s",
  ),
  **_TRIED,
  'schedule': 'it times every schedule; choose some with --only or --try-schedules',
  'data_parallel': 'it runs every setting on G = --stages devices (data_parallel on all of them)',
}


def _add_field_flags(parser: argparse.ArgumentParser, omit: dict[str, str] | None = None) -> None:
  """One flag per config field but those in `omit` (flat name: why this subcommand does not read
  it), default SUPPRESS so only flags given show up in the namespace. Each flag's help is
  `flag_help.field_help`: what it does, its choices, its default."""
  omit = omit or {}
  groups = {  # created in this order: the order of the sections in --help
    config.ModelConfig: parser.add_argument_group('model (ModelConfig)'),
    config.TrainConfig: parser.add_argument_group('training (TrainConfig)'),
    config.ScheduleConfig: parser.add_argument_group('schedule (ScheduleConfig)'),
  }
  parser.omitted = {}
  for name, (kind, optional, owner, _) in config.fields().items():
    if name in omit:
      parser.omitted[field_flags.flag(name)] = omit[name]
      if kind is bool:
        parser.omitted['--no-' + field_flags.flag(name)[2:]] = omit[name]
      continue
    group = groups.get(owner, groups[config.TrainConfig])
    help_text = flag_help.field_help(name)
    if kind is bool:
      _add_bool_flag(group, name, help_text)
    else:
      group.add_argument(
        field_flags.flag(name),
        dest=name,
        type=_optional(kind) if optional else kind,
        default=argparse.SUPPRESS,
        metavar=kind.__name__.upper(),
        help=help_text,
      )


def _add_bool_flag(group, name: str, help_text: str) -> None:
  """--pre-ln, --pre-ln false and --no-pre-ln."""
  group.add_argument(
    field_flags.flag(name),
    dest=name,
    nargs='?',
    const=True,
    type=_bool,
    default=argparse.SUPPRESS,
    metavar='true|false',
    help=help_text,
  )
  group.add_argument(
    '--no-' + field_flags.flag(name)[2:],
    dest=name,
    action='store_false',
    default=argparse.SUPPRESS,
    help=f'same as {field_flags.flag(name)} false',
  )


def _cpu_devices_flag(parser):
  parser.add_argument(
    '--cpu-devices',
    type=int,
    default=None,
    metavar='N',
    help='simulate N CPU devices (for multi-stage schedules on a CPU machine; default: the '
    "machine's own devices)",
  )


def _process_flags(parser):
  from ouroboros_jax.runtime import distributed

  group = parser.add_argument_group('multi-process / multi-host (see distributed.py)')
  group.add_argument(
    '--coordinator',
    default=None,
    metavar='HOST:PORT',
    help="process 0's address, or 'auto' for JAX's cluster detection (default "
    f'${distributed.ENV_COORDINATOR}; neither: one process)',
  )
  group.add_argument(
    '--num-processes',
    type=int,
    default=None,
    metavar='N',
    help=f'processes in the job (default ${distributed.ENV_NUM_PROCESSES})',
  )
  group.add_argument(
    '--process-id',
    type=int,
    default=None,
    metavar='I',
    help=f"this process's index, 0 .. N-1 (default ${distributed.ENV_PROCESS_ID})",
  )
  group.add_argument(
    '--init-timeout',
    type=int,
    default=120,
    metavar='S',
    help='seconds to wait for the coordinator and every process (default %(default)s)',
  )


def _json_flag(parser):
  parser.add_argument(
    '--json', action='store_true', help='print one JSON object instead of the table (default off)'
  )


def _run_flags(
  parser, *, processes: bool, omit: dict[str, str] | None = None
) -> argparse.ArgumentParser:
  """The flags after a run's own: --cpu-devices, the process group's (`processes`) and one per
  config field but those in `omit` (flat name: why the subcommand does not read it)."""
  _cpu_devices_flag(parser)
  if processes:
    _process_flags(parser)
  _add_field_flags(parser, omit)
  return parser


def make_parser() -> argparse.ArgumentParser:
  """The root parser; `parser.commands` maps each subcommand to its own parser."""
  parser = _Parser(
    prog='ouroboros',
    allow_abbrev=False,
    description='Ouroboros delayed-gradient model parallelism for Transformer LMs.',
  )
  sub = parser.add_subparsers(
    dest='command', metavar='{train,sample,export,bench,compile,plan,launch}', parser_class=_Parser
  )
  sub.required = True
  parser.commands = {  # added in this order, listed in this order by --help
    'train': _train_parser(sub),
    'sample': _sample_parser(sub),
    'export': _export_parser(sub),
    'bench': _bench_parser(sub),
    'compile': _compile_parser(sub),
    'plan': _plan_parser(sub),
    'launch': _launch_parser(sub),
  }
  return parser


def _subcommand(sub, name: str, summary: str, description: str | None = None):
  """A subcommand's parser (no abbreviated flags); `summary` is its line in the root's --help."""
  return sub.add_parser(name, help=summary, allow_abbrev=False, description=description)


def _train_parser(sub) -> argparse.ArgumentParser:
  train = _subcommand(
    sub,
    'train',
    'train a byte-level Transformer LM',
    'Train a preset; any field can be overridden by its flag.',
  )
  train.add_argument(
    '--resume',
    action='store_true',
    help="continue from OUT's newest readable checkpoint, exactly where it "
    'stopped (an unreadable newer one is reported and set aside; default off: a new run)',
  )
  train.add_argument(
    '--resume-from',
    type=int,
    default=None,
    metavar='STEP',
    help='resume from the checkpoint of this step (implies --resume; newer '
    'checkpoints are moved to OUT/checkpoints-set-aside; default: the newest)',
  )
  train.add_argument(
    '--quiet', action='store_true', help='no progress bar or eval lines (default off)'
  )
  return _run_flags(train, processes=True)


def _export_parser(sub) -> argparse.ArgumentParser:
  export = _subcommand(
    sub,
    'export',
    "write a run's trained model as one plain parameter tree",
    "Write a checkpoint's model, whatever schedule and mesh trained it, as the model's own "
    "parameter tree ({'embed', 'layers', 'head'}, Orbax's standard format) with its config; "
    '`ouroboros sample --ckpt DIR` reads it.',
  )
  export.add_argument(
    '--ckpt', required=True, metavar='OUT', help='the OUT directory of a training run (required)'
  )
  export.add_argument(
    '--to', required=True, metavar='DIR', help='a new or empty directory to write (required)'
  )
  export.add_argument(
    '--step',
    type=int,
    default=None,
    help='the checkpoint of this step (default: the newest readable)',
  )
  _cpu_devices_flag(export)
  return export


def _sample_parser(sub) -> argparse.ArgumentParser:
  sample = _subcommand(sub, 'sample', 'generate text from a checkpoint')
  sample.add_argument(
    '--ckpt',
    required=True,
    metavar='OUT',
    help='the OUT directory of a training run (its newest readable checkpoint is used; required)',
  )
  sample.add_argument('--prompt', default='', help='text to continue (default: a new line)')
  sample.add_argument(
    '--length', type=int, default=500, help='tokens to generate (default %(default)s)'
  )
  sample.add_argument(
    '--temperature',
    type=float,
    default=0.8,
    help='sampling temperature, 0 for greedy (default %(default)s)',
  )
  sample.add_argument(
    '--seed', type=int, default=0, help='seed of the sampling (default %(default)s)'
  )
  sample.add_argument(
    '--step',
    type=int,
    default=None,
    help='the checkpoint of this step (default: the newest readable)',
  )
  _cpu_devices_flag(sample)
  return sample


def _bench_parser(sub) -> argparse.ArgumentParser:
  from ouroboros_jax.perf import bench as bench_lib  # its defaults: BenchConfig's, stated once

  bench = _subcommand(
    sub,
    'bench',
    'steady-state speed of every schedule vs its ideal',
    'See ouroboros_jax/perf/bench.py. Model and '
    'batch come from --preset and the field flags; --stages sets G.',
  )
  defaults = bench_lib.BenchConfig
  bench.add_argument(
    '--bench-steps',
    type=int,
    default=defaults.steps,
    help='timed steps per setting (default %(default)s)',
  )
  bench.add_argument(
    '--warmup',
    type=int,
    default=defaults.warmup,
    help='untimed steps before timing (default %(default)s)',
  )
  bench.add_argument(
    '--rounds',
    type=int,
    default=defaults.rounds,
    help='time the settings in this many rounds, each compiled and warmed up first, and re-time '
    "the pieces in each round, so that a machine's drift slows every setting and the predictions "
    'alike (default %(default)s: one setting after another)',
  )
  bench.add_argument(
    '--only',
    default=None,
    metavar='LABELS',
    help='comma-separated settings to run, each a label or a prefix of labels (e.g. '
    '"backprop,model_parallel,ouroboros M=8 pipelined/graph"; default: every setting tried)',
  )
  _try_flags(bench, stages=False)
  _run_flags(bench, processes=True, omit=_BENCH_OMITS)
  # It times the paper's method by default (BenchConfig's); 'auto' given means train's recipe.
  _set_default(bench, 'optimizer', defaults.optimizer)
  _set_default(bench, 'compensation', ','.join(defaults.compensation.names()) or 'none')
  return bench


def _set_default(parser: argparse.ArgumentParser, dest: str, value: str) -> None:
  """A field flag's default for this subcommand alone, said in its help."""
  parser.set_defaults(**{dest: value})
  action = next(a for a in parser._actions if a.dest == dest)  # pylint: disable=protected-access
  head = action.help.split(' (default')[0]
  action.help = f'{head} (default {value} here; auto: as `train` resolves it)'


_TOPOLOGY_HELP = (
  'a TPU topology libtpu knows, e.g. v5e:2x2, v5e:2x4, v4:2x2x1, v5p:2x2x1, v6e:2x2 '
  '(compile-only devices; needs pip install "ouroboros-jax[tpu]"); default: the local devices'
)


def _compile_parser(sub) -> argparse.ArgumentParser:
  compile_ = _subcommand(
    sub,
    'compile',
    "a run's per-device memory, from its step compiled for a device (none needed)",
    'Build the run `train` would (same flags) with abstract parameters, compile its '
    "step for --topology (or the local devices) and report one device's memory; exit status 1 "
    'if it does not fit. See ouroboros_jax/perf/compile.py.',
  )
  compile_.add_argument('--topology', default=None, metavar='NAME', help=_TOPOLOGY_HELP)
  _json_flag(compile_)
  return _run_flags(compile_, processes=False, omit=_COMPILE_OMITS)


def _plan_parser(sub) -> argparse.ArgumentParser:
  from ouroboros_jax.perf import cost_model
  from ouroboros_jax.perf import plan as plan_lib

  plan = _subcommand(
    sub,
    'plan',
    'every schedule x micro-batches x stash: compiled memory, predicted step time',
    "For the run train's flags describe, compile every schedule (G = all devices, or fewer "
    'with data replicas when the model has fewer layers) at each --try-microbatches and, for '
    'ouroboros, each --try-stash and forward, for --topology (or the local devices); print each '
    "per-device peak beside the simulator's step time and mark the fastest setting that fits. "
    'Settings the model cannot take are skipped, with one line that says why. See '
    'ouroboros_jax/perf/plan.py.',
  )
  plan.add_argument('--topology', default=None, metavar='NAME', help=_TOPOLOGY_HELP)
  _try_flags(plan)
  plan.add_argument(
    '--hardware',
    default=None,
    metavar='NAME',
    help=f"the simulator's rates, one of {', '.join(plan_lib.HARDWARE)} (default: the "
    f"topology's TPU generation, else {cost_model.NVLINK.name})",
  )
  _json_flag(plan)
  plan.add_argument(
    '--render',
    default=None,
    metavar='FILE',
    help='print the table of a saved --json plan, without planning (default: none, plan the run)',
  )
  return _run_flags(plan, processes=False, omit=_PLAN_OMITS)


def _try_flags(parser, stages: bool = True) -> None:
  """The --try-* flags of `plan` and `bench`: the settings they try, by default
  `settings.Tries()`'s (--try-stages: `plan`'s alone; `bench` runs G = --stages)."""
  flags = _try_flag_table()
  if stages:
    flags.append(
      (
        '--try-stages',
        None,
        'G,G',
        'stage counts to try, each with the other devices as data replicas, or all (every '
        'factorisation G x D of the devices; default: all devices in one ring, or the most '
        'stages the layers allow)',
      )
    )
  for flag, default, metavar, help_text in flags:
    parser.add_argument(flag, default=default, metavar=metavar, help=help_text)


def _try_flag_table() -> list[tuple]:
  """(flag, default, metavar, help) of each --try-* flag both `plan` and `bench` take."""
  from ouroboros_jax.perf import settings as settings_lib

  tries = settings_lib.Tries()  # the defaults of the --try-* flags
  joined = lambda values: ','.join(map(str, values))
  return [
    (
      '--try-microbatches',
      joined(tries.microbatches),
      'M,M',
      'micro-batch counts to try on the micro-batched schedules (default %(default)s)',
    ),
    (
      '--try-stash',
      joined(tries.stashes),
      'S,S',
      f'ouroboros stashes to try, of {joined(settings_lib.STASH_SETTINGS)} (default %(default)s)',
    ),
    (
      '--try-policy',
      joined(tries.policies),
      'P,P',
      'stash policies (what a forward keeps, the rest recomputed) to try on every schedule but '
      f'ouroboros, of {joined(STASH_POLICY_NAMES)} (default %(default)s)',
    ),
    (
      '--try-stash-memory',
      joined(tries.memories),
      'M,M',
      f'where ouroboros stashes wait, of {joined(STASH_MEMORIES)} (default %(default)s)',
    ),
    (
      '--try-forward',
      joined(tries.forwards),
      'F,F',
      f'ouroboros forwards to try, of {joined(FORWARD_MODES)} (default %(default)s)',
    ),
    (
      '--try-flow',
      None,
      'F,F',
      "ouroboros flows to try, of batch, stream (default: the run's --flow)",
    ),
    (
      '--try-sharding',
      joined(tries.shardings),
      'S,S',
      'how data_parallel and the stage schedules on several replicas keep their state, of '
      f'{joined(settings_lib.SHARDINGS)} (update: the optimizer state split over the replicas, '
      'fsdp: all of it; default %(default)s)',
    ),
    (
      '--try-schedules',
      None,
      'S,S',
      f'only these schedules, of {joined(SCHEDULES)} (default: every one)',
    ),
  ]


def _launch_parser(sub) -> argparse.ArgumentParser:
  launch = _subcommand(sub, 'launch', 'run N local processes as one multi-host job')
  launch.add_argument(
    '--processes',
    type=int,
    required=True,
    metavar='N',
    help='how many processes to start, each with one CPU device (required)',
  )
  launch.add_argument(
    '--pin-cpus', action='store_true', help='pin process i to core i (default off)'
  )
  launch.add_argument(
    '--timeout',
    type=float,
    default=None,
    metavar='S',
    help='stop every process after S seconds (default: no limit)',
  )
  launch.add_argument(
    'rest',
    nargs=argparse.REMAINDER,
    help='-- then the command for each process, e.g. -- train --stages 2',
  )
  return launch


def config_from_args(args: argparse.Namespace) -> config.TrainConfig:
  """The preset named by --preset with every field flag given applied on top."""
  given = {k: v for k, v in vars(args).items() if k in config.fields()}
  cfg = presets.get_preset(given.pop('preset', 'tiny'))
  return field_flags.override(cfg, given)


def to_flags(cfg: config.TrainConfig) -> list[str]:
  """Command-line flags that give back cfg exactly (every field spelled out)."""
  argv = []
  for name, value in config.flat(cfg).items():
    if isinstance(value, bool):
      argv.append(field_flags.flag(name) if value else '--no-' + field_flags.flag(name)[2:])
    else:
      argv.append(f'{field_flags.flag(name)}={"none" if value is None else value}')
  return argv
