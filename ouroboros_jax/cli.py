"""The `ouroboros` command (also `python -m ouroboros_jax`).

    ouroboros train [--preset tiny] [--FIELD VALUE ...] [--out DIR] [--resume] [--quiet]
                    [--cpu-devices N]
    ouroboros sample --ckpt OUT [--prompt TEXT] [--length N] [--temperature T] [--seed S]
    ouroboros export --ckpt OUT --to DIR [--step S]
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
(`cli_parsers._COMPILE_OMITS`, `_PLAN_OMITS`); each flag's help is `flag_help.field_help`.

`train` takes one flag per field of `TrainConfig` and `ModelConfig` (`--d-model 64`,
`--num-layers 2`, `--schedule ouroboros`, `--stages 4`, `--layers-per-stage 1,2,1`, ...; booleans
as `--pre-ln`, `--pre-ln false` or `--no-pre-ln`); flags given override the preset, the rest keep
its values.

User errors (bad settings, missing data, nothing to resume, ...) print one line
`error: <message>` on stderr and exit with status 2; a NaN/Inf loss exits with status 3.

This module holds `main` and the commands; the parsers are `cli_parsers.py`, the lines for a
failure or a stop `cli_messages.py`.
"""

from __future__ import annotations

import dataclasses
import json
import signal
import sys

from ouroboros_jax import cli_messages, errors
from ouroboros_jax.cli_parsers import EXIT_USAGE, config_from_args, fail, make_parser, unknown_flag
from ouroboros_jax.runtime import host, watchdog
from ouroboros_jax.training import config, field_flags

# Simulated CPU devices: XLA starts them all at once, with threads of their own, in a time that
# grows faster than their number (measured on 2 cores, jaxlib 0.10: 2048 devices 2 s more than
# 64, 8192 54 s, 32768 aborts when pthread_create fails), printing nothing meanwhile. 2048 is
# more than any stages x data replicas a CPU can step through, and starts in seconds.
MAX_CPU_DEVICES = 2048


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


def _run_export(args) -> None:
  from ouroboros_jax.training import export

  print(export.export(args.ckpt, args.to, step=args.step), flush=True)


def _run_bench(args) -> None:
  cfg = config_from_args(args)
  stages = max(cfg.schedule.num_stages, 2)
  # Every flag (--compensation and --layers-per-stage included) checked on the ring of G
  # stages, whose compensation and optimizer the settings take ('auto': as train resolves them).
  ring = field_flags.override(cfg, {'schedule': 'ouroboros', 'stages': stages})
  ring.validate()
  given = [field_flags.flag(n) for n in ('pld', 'growth', 'vcycle', 'std_loss') if getattr(cfg, n)]
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

  compensation, tries = ring.resolved_compensation(), _tries(args)
  base = dataclasses.replace(cfg.schedule, seed=cfg.seed, compensation=compensation)
  settings = bench.bench_settings(
    stages, tries, base, num_layers=cfg.model.num_layers, batch_size=cfg.batch_size, only=args.only
  )
  bench.run(
    cfg.model,
    bench.BenchConfig(
      batch_size=cfg.batch_size,
      stages=stages,
      out_dir=cfg.out or 'runs/bench',
      steps=args.bench_steps,
      warmup=args.warmup,
      rounds=args.rounds,
      settings=settings,
      tries=tries,
      optimizer=ring.resolved_optimizer(),
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

  result = plan_lib.plan(
    cfg,
    args.topology,
    _tries(args),
    hardware=args.hardware,
    log=plan_lib.main_log,  # progress on stderr, the result on stdout
  )
  print(json.dumps(result) if args.json else plan_lib.format_plan(result))
  return 0 if result['fastest'] else 1


def _tries(args):
  """The --try-* flags of `plan` and `bench` as their `settings.Tries`."""
  from ouroboros_jax.perf import settings as settings_lib

  words = lambda text: tuple(w.strip() for w in text.split(',') if w.strip())
  stages = getattr(args, 'try_stages', None)  # plan's alone: bench runs G = --stages
  return settings_lib.Tries(
    microbatches=_int_list(args.try_microbatches, '--try-microbatches'),
    stashes=words(args.try_stash),
    policies=words(args.try_policy),
    schedules=args.try_schedules and words(args.try_schedules),
    memories=words(args.try_stash_memory),
    forwards=words(args.try_forward),
    flows=args.try_flow and words(args.try_flow),
    stages=stages and ('all' if stages == 'all' else _int_list(stages, '--try-stages', ', or all')),
    shardings=words(args.try_sharding),
  )


def _int_list(text: str, flag: str, other: str = '') -> tuple[int, ...]:
  try:
    values = tuple(int(v) for v in text.split(','))
  except ValueError:
    values = ()
  if not values or min(values) < 1:
    raise errors.ConfigError(
      f'{flag} takes positive integers separated by commas{other}, got {text!r}.'
    )
  return values


def _compile_target(args) -> config.TrainConfig:
  """The run of `compile` and `plan`, checked, with JAX set up for --topology."""
  cfg = config_from_args(args)
  # They compile one step and take no --steps: the run's length cannot refuse a --sync-warmup-steps
  # longer than the preset's run (train checks it against its own --steps).
  warmup = cfg.schedule.sync_warmup_steps
  if warmup >= cfg.steps:
    cfg = field_flags.override(cfg, {'steps': warmup + 1})
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


def main(argv=None) -> int:
  """The `ouroboros` command on argv (default: sys.argv[1:]); its exit status."""
  args = _parse(argv)
  from ouroboros_jax.runtime import distributed, streams
  from ouroboros_jax.training import rundir

  if args.command != 'sample':  # a closed pipe or terminal never stops a run (sample: below)
    streams.outlive_readers()
  handlers, code = _catch_stop_signals(args), 0
  try:
    code = _command(args.command)(args)
  except KeyboardInterrupt as e:
    signum = e.signum if isinstance(e, rundir.Terminated) else signal.SIGINT
    if distributed.is_multi_process():  # every process got the signal: each ends, at once
      distributed.end_stopped(cli_messages.stopped_message(args, signum), 128 + signum)
    fail(cli_messages.stopped_message(args, signum), 128 + signum)
  except Exception as e:  # pylint: disable=broad-exception-caught
    if args.command == 'sample' and streams.reader_gone(e):  # `sample | head` had enough
      streams.silence(sys.stdout)
      return 0
    message, code = cli_messages.failure(args, e)
    if code is not None:  # refused: an OUT it made and never wrote into goes again
      rundir.remove_unused()
    if distributed.is_multi_process():  # its peers must not wait for it: end them all now
      distributed.fail_every_process(message, code or 1)
    if code is None:
      raise
    fail(message, code)
  finally:
    watchdog.uninstall()
    for sig, handler in handlers.items():
      signal.signal(sig, handler)
  return code or 0


def _parse(argv):
  """The command line's namespace, with JAX set up for --cpu-devices; a bad line ends here."""
  parser = make_parser()
  args, extra = parser.parse_known_args(argv)
  if extra:
    unknown_flag(parser.commands[args.command], extra)
  host.configure_cpu_runtime()  # before anything initialises a JAX backend (nothing above does)
  if getattr(args, 'cpu_devices', None) is not None:
    if not 1 <= args.cpu_devices <= MAX_CPU_DEVICES:
      fail(
        f'--cpu-devices must be between 1 and {MAX_CPU_DEVICES}, got {args.cpu_devices} '
        '(more simulated devices take minutes to start).',
        EXIT_USAGE,
      )
    # Must happen before anything initialises a JAX backend (nothing above does).
    import jax

    jax.config.update('jax_num_cpu_devices', args.cpu_devices)
  return args


def _catch_stop_signals(args) -> dict:
  """Stops the command on SIGTERM and SIGHUP (and SIGINT for `train`), with the watchdog that
  ends it even while XLA holds it; the handlers they replace, to put back."""
  if args.command == 'launch':  # the launcher passes these signals on to its children itself
    return {}
  stopping = (signal.SIGTERM, signal.SIGHUP) + ((signal.SIGINT,) if args.command == 'train' else ())
  handlers = {sig: signal.signal(sig, _terminate) for sig in stopping}
  watchdog.install(cli_messages.hard_stop_message(args))  # a signal ends it even while XLA holds it
  return handlers


def _command(name: str):
  return {
    'train': _run_train,
    'sample': _run_sample,
    'export': _run_export,
    'bench': _run_bench,
    'compile': _run_compile,
    'plan': _run_plan,
    'launch': _run_launch,
  }[name]


def _terminate(signum, _frame):
  from ouroboros_jax.training import rundir

  rundir.request_stop(signum)  # a running loop stops at its next step; otherwise raises now
  watchdog.acknowledge()  # the loop took it: it saves and stops, in its own time once steady
