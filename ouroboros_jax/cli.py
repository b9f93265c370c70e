"""The `ouroboros` command (also `python -m ouroboros_jax`).

    ouroboros train [--preset tiny] [--FIELD VALUE ...] [--out DIR] [--resume] [--quiet]
                    [--cpu-devices N]
    ouroboros sample --ckpt OUT [--prompt TEXT] [--length N] [--temperature T] [--seed S]
    ouroboros bench [--preset tiny] [--FIELD VALUE ...] [--bench-steps 20] [--warmup 3]
    ouroboros compile [--preset tiny] [--FIELD VALUE ...] [--topology v5e:2x2] [--json]
                      [--cpu-devices N]
    ouroboros plan [--preset tiny] [--FIELD VALUE ...] [--topology v5e:2x2] [--json]
                   [--try-microbatches 8] [--try-stash graph/nothing,replay,graph/all]
    ouroboros launch --processes N [--pin-cpus] -- <train|bench args>

`train` and `bench` join a multi-process run with --coordinator HOST:PORT --num-processes N
--process-id I (or the OUROBOROS_* variables `launch` sets; --coordinator auto on a cluster JAX
can detect), see `distributed.py`.

`compile` builds the run `train` would (same flags) with abstract parameters, compiles its step
for the devices of a TPU topology (compile-only: no TPU needed, `pip install "ouroboros-jax[tpu]"`)
or of the local backend, and prints one device's memory (parameters, optimizer state, ring/stash,
temporaries, peak) against the device's; it exits with status 1 when the step does not fit
(`perf/compile.py`). `plan` compiles every schedule x micro-batches x stash for the topology
the same way, beside the simulator's step time, and marks the fastest setting that fits
(`perf/plan.py`). Both take the field flags that shape the step, none of the training loop's
(`_COMPILE_OMITS`, `_PLAN_OMITS`); each flag's help is `flag_help.field_help`.

`train` takes one flag per field of `TrainConfig` and `ModelConfig` (`--d-model 64`,
`--num-layers 2`, `--schedule ouroboros`, `--stages 4`, `--layers-per-stage 1,2,1`, ...; booleans
as `--pre-ln`, `--pre-ln false` or `--no-pre-ln`); flags given override the preset, the rest keep
its values.

User errors (bad settings, missing data, nothing to resume, ...) print one line
`error: <message>` on stderr and exit with status 2; a NaN/Inf loss exits with status 3.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import signal
import sys

from ouroboros_jax import errors, flag_help
from ouroboros_jax.choices import MICROBATCHED, SCHEDULES, STASH_MEMORIES
from ouroboros_jax.runtime import host, watchdog
from ouroboros_jax.training import config

EXIT_USAGE = errors.UserError.exit_code
# Simulated CPU devices: XLA starts them all at once, with threads of their own, in a time that
# grows faster than their number (measured on 2 cores, jaxlib 0.10: 2048 devices 2 s more than
# 64, 8192 54 s, 32768 aborts when pthread_create fails), printing nothing meanwhile. 2048 is
# more than any stages x data replicas a CPU can step through, and starts in seconds.
MAX_CPU_DEVICES = 2048


class _Parser(argparse.ArgumentParser):
  """argparse whose errors are one line, `error: ...`, with a close-match hint."""

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    # `--learning-rate -1e-3` is a negative number, not a flag (argparse knows only -1 and -.5).
    self._negative_number_matcher = re.compile(r'^-(\d+\.?\d*|\.\d+)(e[-+]?\d+)?$', re.I)

  def error(self, message):
    _fail(f'{message}; see --help.', EXIT_USAGE)


def _unknown_flag(parser: argparse.ArgumentParser, extra: list[str]):
  """One line for arguments no flag takes, with the closest known flag of that subcommand."""
  flags = [a for a in extra if a.startswith('-')] or extra
  flag = flags[0].split('=')[0]
  reason = getattr(parser, 'omitted', {}).get(flag)
  if reason is not None:  # a `train` flag this subcommand does not read
    _fail(f'`{parser.prog}` takes no {flag}: {reason}; drop it (see --help).', EXIT_USAGE)
  known = [o for a in parser._actions for o in a.option_strings]  # pylint: disable=protected-access
  close = difflib.get_close_matches(flags[0].split('=')[0], known, n=1, cutoff=0.75)
  hint = f'; did you mean {close[0]}?' if close else '; see --help for the flags.'
  what = 'flag (no such field)' if flags[0].startswith('-') else 'argument'
  _fail(f'unknown {what} {flags[0]} for `{parser.prog}`{hint}', EXIT_USAGE)


def _fail(message: str, code: int):
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
  def parse(text: str):
    return None if text.lower() in ('none', '') else kind(text)

  parse.__name__ = kind.__name__
  return parse


# Config fields that a subcommand does not read, by flat name, each group with the reason its
# `--help` leaves them out (and `_unknown_flag` says when one is given).
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
_PLAN_OMITS = {
  **_COMPILE_OMITS,
  'schedule': 'it tries every schedule; choose some with --try-schedules',
  'stages': 'it tries G = stages with the other devices as data replicas; choose with --try-stages',
  'data_parallel': 'it tries G = stages with the other devices as data replicas; choose with '
  '--try-stages',
  'microbatches': 'it tries each of --try-microbatches',
  'stash': 'it tries each of --try-stash',
  'stash_policy': 'it tries each of --try-stash (graph/POLICY)',
  'stash_memory': 'it tries each of --try-stash-memory',
  'forward': 'it tries both Ouroboros forwards, locked and pipelined',
}
_BENCH_OMITS = {
  **dict.fromkeys(
    _LOOP_FIELDS,
    'it times --bench-steps steps on synthetic batches; the data, the length of the run, its '
    "evaluations and checkpoints are `train`'s",
  )
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
      parser.omitted[config.flag(name)] = omit[name]
      if kind is bool:
        parser.omitted['--no-' + config.flag(name)[2:]] = omit[name]
      continue
    group = groups.get(owner, groups[config.TrainConfig])
    help_text = flag_help.field_help(name)
    if kind is bool:
      _add_bool_flag(group, name, help_text)
    else:
      group.add_argument(
        config.flag(name),
        dest=name,
        type=_optional(kind) if optional else kind,
        default=argparse.SUPPRESS,
        metavar=kind.__name__.upper(),
        help=help_text,
      )


def _add_bool_flag(group, name: str, help_text: str) -> None:
  """--pre-ln, --pre-ln false and --no-pre-ln."""
  group.add_argument(
    config.flag(name),
    dest=name,
    nargs='?',
    const=True,
    type=_bool,
    default=argparse.SUPPRESS,
    metavar='true|false',
    help=help_text,
  )
  group.add_argument(
    '--no-' + config.flag(name)[2:],
    dest=name,
    action='store_false',
    default=argparse.SUPPRESS,
    help=f'same as {config.flag(name)} false',
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
    dest='command', metavar='{train,sample,bench,compile,plan,launch}', parser_class=_Parser
  )
  sub.required = True
  parser.commands = {  # added in this order, listed in this order by --help
    'train': _train_parser(sub),
    'sample': _sample_parser(sub),
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
  bench = _subcommand(
    sub,
    'bench',
    'steady-state speed of every schedule vs its ideal',
    'See ouroboros_jax/perf/bench.py. Model and '
    'batch come from --preset and the field flags; --stages sets G.',
  )
  bench.add_argument(
    '--bench-steps', type=int, default=20, help='timed steps per setting (default %(default)s)'
  )
  bench.add_argument(
    '--warmup', type=int, default=3, help='untimed steps before timing (default %(default)s)'
  )
  bench.add_argument(
    '--rounds',
    type=int,
    default=1,
    help='time the settings in this many rounds, each compiled and warmed up first, and re-time '
    "the pieces in each round, so that a machine's drift slows every setting and the predictions "
    'alike (default %(default)s: one setting after another)',
  )
  bench.add_argument(
    '--only',
    default=None,
    metavar='LABELS',
    help='comma-separated settings to run, by label prefix (e.g. '
    '"backprop,model_parallel,ouroboros pipelined/graph"; default: every setting)',
  )
  return _run_flags(bench, processes=True, omit=_BENCH_OMITS)


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
  from ouroboros_jax.perf import plan as plan_lib
  from ouroboros_jax.perf import simulate

  tries = plan_lib.Tries()  # the defaults of the --try-* flags
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
  plan.add_argument(
    '--try-microbatches',
    default=','.join(map(str, tries.microbatches)),
    metavar='M,M',
    help='micro-batch counts to try on the micro-batched schedules (default %(default)s)',
  )
  plan.add_argument(
    '--try-stash',
    default=','.join(tries.stashes),
    metavar='S,S',
    help=f'ouroboros stashes to try, of {", ".join(plan_lib.STASH_SETTINGS)} (default %(default)s)',
  )
  plan.add_argument(
    '--try-policy',
    default=','.join(tries.policies),
    metavar='P,P',
    help='stash policies (what a forward keeps, the rest recomputed) to try on every schedule '
    f'but ouroboros, of {", ".join(plan_lib.STASH_POLICY_NAMES)} (default %(default)s)',
  )
  plan.add_argument(
    '--try-stages',
    default=None,
    metavar='G,G',
    help='stage counts to try, each with the other devices as data replicas (default: all '
    'devices in one ring, or the most stages the layers allow)',
  )
  plan.add_argument(
    '--try-stash-memory',
    default=','.join(tries.memories),
    metavar='M,M',
    help=f'where ouroboros stashes wait, of {", ".join(STASH_MEMORIES)} (default %(default)s)',
  )
  plan.add_argument(
    '--try-schedules',
    default=None,
    metavar='S,S',
    help=f'only these schedules, of {", ".join(SCHEDULES)} (default: every one)',
  )
  plan.add_argument(
    '--hardware',
    default=None,
    metavar='NAME',
    help=f"the simulator's rates, one of {', '.join(plan_lib.HARDWARE)} (default: the "
    f"topology's TPU generation, else {simulate.NVLINK.name})",
  )
  _json_flag(plan)
  plan.add_argument(
    '--render',
    default=None,
    metavar='FILE',
    help='print the table of a saved --json plan, without planning (default: none, plan the run)',
  )
  return _run_flags(plan, processes=False, omit=_PLAN_OMITS)


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
  cfg = config.get_preset(given.pop('preset', 'tiny'))
  return config.override(cfg, given)


def to_flags(cfg: config.TrainConfig) -> list[str]:
  """Command-line flags that give back cfg exactly (every field spelled out)."""
  argv = []
  for name, value in config.flat(cfg).items():
    if isinstance(value, bool):
      argv.append(config.flag(name) if value else '--no-' + config.flag(name)[2:])
    else:
      argv.append(f'{config.flag(name)}={"none" if value is None else value}')
  return argv


def _join_process_group(args) -> None:
  from ouroboros_jax.runtime import distributed

  if args.command != 'train':  # only train's loop stops at a step every process agrees on
    distributed.leave_signals_to_python()
  if distributed.initialize(
    distributed.ProcessConfig(
      coordinator=args.coordinator,
      num_processes=args.num_processes,
      process_id=args.process_id,
      init_timeout_s=args.init_timeout,
    )
  ):
    distributed.watch_peers()
    if getattr(args, 'cpu_devices', None) is not None:
      raise errors.ConfigError(
        f'--cpu-devices {args.cpu_devices} simulates devices inside one process; in a '
        'multi-process run each process brings its own devices (one each under `ouroboros '
        'launch`): drop it, and use --processes N for N devices.'
      )


def _run_train(args) -> None:
  from ouroboros_jax.training import rundir

  cfg = config_from_args(args)
  cfg.validate()  # settings errors come before the slow imports, data loading and compiling
  rundir.check_writable(cfg.out_dir)
  _join_process_group(args)
  from ouroboros_jax.training import loop

  loop.train(cfg, resume=args.resume, resume_from=args.resume_from, quiet=args.quiet)


def _run_sample(args) -> None:
  from ouroboros_jax.training import sample

  # Streamed: the bytes appear as they are generated, whatever --length is.
  sys.stdout.flush()
  sample.write_sample(
    args.ckpt,
    sys.stdout.buffer,
    prompt=args.prompt,
    length=args.length,
    temperature=args.temperature,
    seed=args.seed,
    step=args.step,
  )
  sys.stdout.buffer.write(b'\n')
  sys.stdout.buffer.flush()


def _run_bench(args) -> None:
  cfg = config_from_args(args)
  # Every schedule is timed; the compensation flags apply to its Ouroboros settings ('auto':
  # the paper's AdamW without compensation, as the benchmark has always timed).
  optimizer = 'adamw' if cfg.optimizer == 'auto' else cfg.optimizer
  spec = 'none' if cfg.compensation == 'auto' else cfg.compensation
  cfg = config.override(cfg, {'optimizer': optimizer, 'compensation': spec})
  stages = max(cfg.schedule.num_stages, 2)
  fixed = [f'--{n} {v}' for n in ('microbatches', 'chunks') if (v := getattr(cfg.schedule, n))]
  if fixed:
    raise errors.ConfigError(
      f'`bench` times every setting with its own micro-batches and chunks (see its labels); drop '
      f'{" and ".join(fixed)} and pick settings with --only.'
    )
  ring = config.override(cfg, {'schedule': 'ouroboros', 'stages': stages})
  ring.validate()  # every flag, --compensation and --layers-per-stage included
  given = [config.flag(n) for n in ('pld', 'growth', 'vcycle', 'std_loss') if getattr(cfg, n)]
  if given:
    raise errors.ConfigError(
      f'`bench` times the schedules alone; {", ".join(given)} apply to '
      '`train` (experiments/accelerators.py compares the accelerators).'
    )
  _join_process_group(args)
  from ouroboros_jax.training import sizing

  # Its state spread the most (G stages): a model beyond that fits no setting (train: loop.train).
  sizing.check_fits(ring)
  from ouroboros_jax.perf import bench

  policy, compensation = cfg.schedule.stash_policy, cfg.resolved_compensation()
  bench.run(
    cfg.model,
    bench.BenchConfig(
      batch_size=cfg.batch_size,
      stages=stages,
      out_dir=cfg.out or 'runs/bench',
      steps=args.bench_steps,
      warmup=args.warmup,
      rounds=args.rounds,
      settings=bench.select_settings(
        stages, args.only, cfg.model.num_layers, cfg.batch_size, policy, compensation
      ),
      stash_policy=policy,
      optimizer=optimizer,
      compensation=compensation,
      layers_per_stage=cfg.layers_per_stage and list(ring.plans.layers_per_stage),
    ),
  )


def _run_compile(args) -> int:
  """Prints the report; 1 when the step does not fit the device, else 0."""
  cfg = _compile_target(args)
  from ouroboros_jax.perf import compile as compile_lib

  report = compile_lib.compile_step(cfg, args.topology)
  print(json.dumps(report) if args.json else compile_lib.format_report(report))
  return 1 if report['fits'] is False else 0


def _run_plan(args) -> int:
  """Prints the plan; 1 when no setting fits, else 0."""
  from ouroboros_jax.perf import plan as plan_lib

  if args.render is not None:
    print(plan_lib.format_plan(plan_lib.load(args.render)))
    return 0
  cfg = _compile_target(args)

  counts = _int_list(args.try_microbatches, '--try-microbatches')
  stashes = tuple(s.strip() for s in args.try_stash.split(',') if s.strip())
  result = plan_lib.plan(
    cfg,
    args.topology,
    plan_lib.Tries(
      microbatches=counts,
      stashes=stashes,
      policies=tuple(p.strip() for p in args.try_policy.split(',') if p.strip()),
      schedules=args.try_schedules and tuple(args.try_schedules.split(',')),
      memories=tuple(args.try_stash_memory.split(',')),
      stages=args.try_stages and _int_list(args.try_stages, '--try-stages'),
    ),
    hardware=args.hardware,
    log=plan_lib.main_log,  # progress on stderr, the result on stdout
  )
  print(json.dumps(result) if args.json else plan_lib.format_plan(result))
  return 0 if result['fastest'] else 1


def _int_list(text: str, flag: str) -> tuple[int, ...]:
  try:
    values = tuple(int(v) for v in text.split(','))
  except ValueError:
    values = ()
  if not values or min(values) < 1:
    raise errors.ConfigError(f'{flag} takes positive integers separated by commas, got {text!r}.')
  return values


def _compile_target(args) -> config.TrainConfig:
  """The run of `compile` and `plan`, checked, with JAX set up for --topology."""
  cfg = config_from_args(args)
  # They compile one step and take no --steps: the run's length cannot refuse a --sync-warmup-steps
  # longer than the preset's run (train checks it against its own --steps).
  warmup = cfg.schedule.sync_warmup_steps
  if warmup >= cfg.steps:
    cfg = config.override(cfg, {'steps': warmup + 1})
  cfg.validate()
  if args.topology is not None and args.cpu_devices is not None:
    raise errors.ConfigError(
      "--cpu-devices simulates local CPU devices, --topology compiles for the topology's; "
      'drop one of them.'
    )
  from ouroboros_jax.perf import compile as compile_lib

  compile_lib.quiet_libtpu()  # before JAX first loads libtpu
  return cfg


def _run_launch(args) -> None:
  from ouroboros_jax.runtime import launch

  rest = args.rest[1:] if args.rest[:1] == ['--'] else args.rest
  reasons = []
  code = launch.launch(
    args.processes,
    rest,
    options=launch.LaunchOptions(pin_cpus=args.pin_cpus),
    timeout_s=args.timeout,
    reasons=reasons,
  )
  if code:  # the children's output is above, on stdout; one line on stderr says why
    raise launch.LaunchFailed(code, reasons[0] if reasons else f'exit status {code}')


def exit_code(exc: BaseException) -> int | None:
  """The exit status of a user error (2; 3 for a NaN/Inf loss), or None for a bug."""
  return exc.exit_code if isinstance(exc, errors.UserError) else None


def out_of_memory(exc: BaseException) -> bool:
  """Host or device memory ran out (a size the machine cannot hold, not a bug)."""
  text = str(exc)
  return isinstance(exc, MemoryError) or 'RESOURCE_EXHAUSTED' in text or ('Out of memory' in text)


def out_of_memory_message(args: argparse.Namespace, exc: BaseException) -> str:
  """The one line for `out_of_memory(exc)`: the sizes that fill memory, with their values, and
  what spreads a `train` step over more devices."""
  head = f'out of memory ({_one_line(exc)[:200]})'
  try:
    cfg = config_from_args(args) if args.command in ('train', 'bench', 'compile', 'plan') else None
  except errors.UserError:
    cfg = None
  if cfg is None:
    return f'{head}; use a machine with more memory.'
  model, run = cfg.model, cfg.schedule_config()
  sizes = [f'--seq-len (now {model.seq_len}; attention memory grows with its square)']
  if model.mem_len:
    sizes.append(f'--mem-len (now {model.mem_len})')
  sizes += [
    f'{config.flag(name)} (now {value})'
    for name, value in (
      ('batch_size', cfg.batch_size),
      ('d_model', model.d_model),
      ('d_ff', model.d_ff),
      ('num_layers', model.num_layers),
      ('vocab_size', model.vocab_size),
    )
  ]
  spread = []
  if args.command == 'train':
    if run.name in MICROBATCHED:
      spread.append(f'more --microbatches (now {run.num_microbatches})')
    if run.name in ('backprop', 'data_parallel'):
      spread.append('--schedule gpipe or ouroboros with --stages N (the layers cut over N devices)')
    elif run.num_stages < model.num_layers:
      spread.append(f'more --stages (now {run.num_stages})')
    replay = run.name == 'ouroboros' and run.stash == 'replay'
    if not replay and run.resolved_stash_policy != 'nothing':  # the least a forward keeps
      spread.append('--stash-policy nothing')
    if run.name == 'ouroboros':
      if run.stash_memory == 'device':
        spread.append('--stash-memory pinned_host')
      if run.stash == 'graph':
        spread.append('--stash replay')
  spread.append('more devices')
  return (
    f'{head}; lower {", ".join(sizes[:-1])} or {sizes[-1]}; or use {", ".join(spread)} '
    '(`ouroboros plan` lists what fits).'
  )


def main(argv=None) -> int:
  parser = make_parser()
  args, extra = parser.parse_known_args(argv)
  if extra:
    _unknown_flag(parser.commands[args.command], extra)
  host.configure_cpu_runtime()  # before anything initialises a JAX backend (nothing above does)
  if getattr(args, 'cpu_devices', None) is not None:
    if not 1 <= args.cpu_devices <= MAX_CPU_DEVICES:
      _fail(
        f'--cpu-devices must be between 1 and {MAX_CPU_DEVICES}, got {args.cpu_devices} '
        '(more simulated devices take minutes to start).',
        EXIT_USAGE,
      )
    # Must happen before anything initialises a JAX backend (nothing above does).
    import jax

    jax.config.update('jax_num_cpu_devices', args.cpu_devices)

  from ouroboros_jax.runtime import distributed, streams
  from ouroboros_jax.training import rundir

  if args.command != 'sample':  # a closed pipe or terminal never stops a run (sample: below)
    streams.outlive_readers()
  handlers, code = {}, 0
  if args.command != 'launch':  # the launcher passes these signals on to its children itself
    stopping = (signal.SIGTERM, signal.SIGHUP) + (
      (signal.SIGINT,) if args.command == 'train' else ()
    )
    handlers = {sig: signal.signal(sig, _terminate) for sig in stopping}
    watchdog.install(_hard_stop_message(args))  # a signal ends it even while XLA holds it
  try:
    code = {
      'train': _run_train,
      'sample': _run_sample,
      'bench': _run_bench,
      'compile': _run_compile,
      'plan': _run_plan,
      'launch': _run_launch,
    }[args.command](args)
  except KeyboardInterrupt as e:
    signum = e.signum if isinstance(e, rundir.Terminated) else signal.SIGINT
    if distributed.is_multi_process():  # every process got the signal: each ends, at once
      distributed.end_stopped(_stopped_message(args, signum), 128 + signum)
    _fail(_stopped_message(args, signum), 128 + signum)
  except Exception as e:  # pylint: disable=broad-exception-caught
    if args.command == 'sample' and streams.reader_gone(e):  # `sample | head` had enough
      streams.silence(sys.stdout)
      return 0
    if distributed.is_peer_lost(e):  # one line instead of XLA's traceback
      e = errors.PeerLostError(distributed.peer_lost_message('its connection closed'))
    code = exit_code(e)
    message = _one_line(e) if code is not None else None
    if code is None and out_of_memory(e):
      message, code = out_of_memory_message(args, e), EXIT_USAGE
    if code is not None:  # refused: an OUT it made and never wrote into goes again
      rundir.remove_unused()
    if distributed.is_multi_process():  # its peers must not wait for it: end them all now
      distributed.fail_every_process(message, code or 1)
    if code is None:
      raise
    _fail(message, code)
  finally:
    watchdog.uninstall()
    for sig, handler in handlers.items():
      signal.signal(sig, handler)
  return code or 0


def _terminate(signum, _frame):
  from ouroboros_jax.training import rundir

  rundir.request_stop(signum)  # a running loop stops at its next step; otherwise raises now
  watchdog.acknowledge()  # the loop took it: it saves and stops, in its own time once steady


def _hard_stop_message(args):
  """The line of a process the watchdog ends (`runtime/watchdog.py`): (signum, steady, signals)
  -> text.
  It runs on the watchdog's thread, which must not import or block: OUT is worked out now."""
  out = None
  if args.command == 'train':
    try:
      out = config_from_args(args).out_dir
    except Exception:  # pylint: disable=broad-exception-caught  (its own error comes later)
      out = None

  def message(signum: int, steady: bool, signals: int = 1) -> str:
    name = signal.Signals(signum).name
    what = 'interrupted' if signum == signal.SIGINT else f'stopped by {name}'
    if out is None:
      return f'{what} during set-up, while XLA was busy (compiling or allocating).'
    where = os.path.join(out, 'checkpoints')  # checkpoint.SUBDIR (importing it loads Orbax)
    try:
      saved = any(entry.isdigit() for entry in os.listdir(where))
    except OSError:
      saved = False
    if saved:
      then = f'continue from the latest checkpoint in {where} with --resume'
    elif not steady:  # no metrics row yet: the same OUT takes the run again
      then = f'no checkpoint in {where}: run it again'
    else:
      then = (
        f'no checkpoint in {where}: start again with another --out (or remove its metrics.jsonl '
        'and config.json)'
      )
    if not steady:
      return f'{what} during set-up, while XLA was busy (compiling or allocating); {then}.'
    why = (
      'a second signal came'
      if signals > 1
      else f'XLA held the run past {watchdog.STEADY_GRACE_S:g} s'
    )
    return f'{what} at once ({why}); the steps after the latest checkpoint are lost; {then}.'

  return message


def _stopped_message(args, signum: int) -> str:
  """What a stopped command leaves behind: for `train`, the checkpoint to resume from."""
  what = 'interrupted' if signum == signal.SIGINT else f'stopped by {signal.Signals(signum).name}'
  if args.command != 'train':
    return f'{what}.'
  from ouroboros_jax.training import checkpoint

  try:
    out = config_from_args(args).out_dir
    step = checkpoint.latest_step(out)
  except Exception:  # pylint: disable=broad-exception-caught
    return f'{what}; check the checkpoints in --out before resuming.'
  where = checkpoint.checkpoint_dir(out)
  if step is None:
    logged = os.path.join(out, 'metrics.jsonl')
    if not (os.path.exists(logged) and os.path.getsize(logged)):  # nothing a new run would lose
      return f'{what} before the first checkpoint; nothing to resume in {where}: run it again.'
    return (
      f'{what} before the first checkpoint; nothing to resume in {where}: start again with '
      'another --out (or remove its metrics.jsonl and config.json).'
    )
  return (
    f'{what}; the latest complete checkpoint is step {step} in {where}; continue with --resume.'
  )


def _one_line(exc: BaseException) -> str:
  """The error's message on one line; a user error's config fields as their flags."""
  if isinstance(exc, errors.UserError):
    return ' '.join(errors.render(exc.marked, config.field_flag).split())
  return ' '.join(str(exc).split())
