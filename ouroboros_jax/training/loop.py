"""The training loop: `train(cfg)` runs one `TrainConfig` end to end and returns a summary.

    params --to_staged--> {'embed', 'stages' [G, N, ...], 'head'}
    schedule = build_schedule(ScheduleConfig(...), transformer_stages(...), adamw(...))
    state = schedule.init(params, example_batch)
    for every step:   state, metrics = schedule.step(state, next(train_iterator))

Any schedule in `schedules.SCHEDULES` runs under the same loop, on the same batches, with the same
optimizer, so their curves and final parameters are directly comparable.

What a run writes into OUT (`cfg.out_dir`):

    config.json      the resolved TrainConfig, written at the start
    metrics.jsonl    one JSON object per line: step, split ('train' | 'validation' | 'test'),
                     loss (nats/byte), bpb (= loss / ln 2), tokens_per_s, wall_s; train rows also
                     loss_batch (the batch the loss belongs to; delayed schedules report an older
                     one), grad_norm and data_crc32 (a fingerprint of every batch consumed so far)
    tb/              the same scalars for TensorBoard
    checkpoints/     Orbax checkpoints (see checkpoint.py); `resume=True` continues bit-exactly
    summary.json     the returned summary; the last line printed is
                     `done: val bpb X, test bpb Y, Z tokens/s, W s`

Timing (`metrics.Report`): the first step (which compiles) is timed on its own as compile_s;
tokens/s counts only the steps after it, and excludes evaluation and checkpointing. Rows also
carry `train_s`, `cpu_s` and `flops` (model FLOPs spent so far, counted from the layers actually
computed, see `step_flops`).

Accelerators (docs/guides/accelerators.md): `--pld` and `--std-loss` swap the staged model
(`staged_model`) and run in this loop under any schedule (the schedules pass PLD's stages the
batch index); `--growth` and `--vcycle` change the model's shape mid-run and are run by
`phased.train_phased` with the library drivers (`growth.train_growth`, `vcycle.train_vcycle`).

Losses are checked for NaN/Inf at every host sync (every `log_every` steps, and always before a
checkpoint is written), so a non-finite state is never saved; the run then stops with
`NonFiniteLossError` and the last good checkpoint stays the latest one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from ouroboros_jax import costs, data, placement, schedules
from ouroboros_jax.accelerators import pld
from ouroboros_jax.errors import (
  CheckpointWriteError,
  ConfigError,
  DiskFullError,
  NonFiniteLossError,
  PeerLostError,
  UserError,
)
from ouroboros_jax.models import partition
from ouroboros_jax.runtime import distributed, watchdog
from ouroboros_jax.training import checkpoint, phased, relayout, resume, rundir, sizing
from ouroboros_jax.training.assemble import build, example_batch, staged_model  # noqa: F401
from ouroboros_jax.training.config import TrainConfig
from ouroboros_jax.training.metrics import MetricsLog, Report, batch_crc32

# ----------------------------------------------------------------------------- building blocks


def step_flops(cfg: TrainConfig, steps) -> np.ndarray:
  """Model FLOPs of each step in `steps`, counted from the layers actually computed
  (`costs.step_flops`). With PLD the layers run are counted from the gates each step really
  drew (`pld.kept_layers`; with several data replicas or micro-batches, where each draws its
  own, the expected number `sum_l p_l(t)`)."""
  steps = np.asarray(steps)
  layers = np.full(steps.shape, float(cfg.model.num_layers))
  if cfg.pld and steps.size:
    theta_bar, gamma = cfg.plans.pld
    run = cfg.schedule_config()
    if run.data_parallel == 1 and run.num_microbatches == 1:
      layers = np.asarray(
        pld.kept_layers(
          cfg.seed, steps, cfg.plans.layers_per_stage, cfg.model.num_layers, theta_bar, gamma
        ),
        float,
      )
    else:
      layers = np.asarray(
        jax.vmap(lambda t: jnp.sum(pld.keep_probs(t, cfg.model.num_layers, theta_bar, gamma)))(
          steps
        ),
        float,
      )
  return costs.step_flops(cfg.model, cfg.tokens_per_step, trained_layers=layers)


def evaluate(schedule, params, tokens, cfg: TrainConfig, max_batches: int | None) -> float:
  """Mean loss (nats per token) over the first max_batches batches of a split, in order.

  A model with a memory (Transformer-XL) is evaluated as it trains: the split as B contiguous
  streams, each batch with the memory the previous one left (`--eval-mem-len` long)."""
  order = data.eval_segments if cfg.segment_order else data.eval_batches
  batches = order(
    tokens, seq_len=cfg.model.seq_len, batch_size=cfg.batch_size, max_batches=max_batches
  )
  if cfg.resolved_eval_mem_len:
    return _evaluate_with_memory(schedule.mesh, params, batches, cfg)
  # One batch at a time: evaluations are independent programs with collectives (stage-sharded
  # params), and on CPU many of them in flight at once can deadlock XLA's in-process rendezvous
  # (seen with 4 simulated devices: "Expected 4 threads to join the rendezvous").
  losses = [
    jax.block_until_ready(schedule.evaluate(params, placement.place_batch(b, schedule.mesh)))
    for b in batches
  ]
  return float(np.mean(jax.device_get(losses)))


@functools.lru_cache(maxsize=8)
def _memory_evaluator(model_cfg, layers_per_stage: tuple[int, ...]):
  """(the staged model, its jitted `recurrent_loss` without dropout), built once per run's
  shape, so every evaluation of a run reuses one compiled program."""
  model = partition.transformer_stages(model_cfg, layers_per_stage)
  return model, jax.jit(lambda p, b, m: model.recurrent_loss(p, b, None, m))


def _evaluate_with_memory(mesh, params, batches, cfg: TrainConfig) -> float:
  """The exact loss of each batch in turn, every stage reading and renewing its memory."""
  model_cfg = dataclasses.replace(cfg.model, mem_len=cfg.resolved_eval_mem_len)
  model, loss_of = _memory_evaluator(model_cfg, tuple(cfg.plans.layers_per_stage))
  memory = placement.empty_memory(model, params, example_batch(cfg))['memory']
  memory_G = placement.onto_mesh(jax.tree.map(lambda a: a[:, 0], memory), mesh)
  losses = []
  for batch in batches:
    loss, (_, memory_G) = loss_of(params, placement.place_batch(batch, mesh), memory_G)
    losses.append(jax.block_until_ready(loss))
  return float(np.mean(jax.device_get(losses)))


@jax.jit
def _all_finite(tree):
  leaves = [
    jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)
  ]
  return jnp.all(jnp.stack(leaves)) if leaves else jnp.bool_(True)


def all_finite(tree) -> bool:
  return bool(_all_finite(tree))


def open_data(cfg: TrainConfig):
  """(splits, train iterator): the corpus, checked against the vocabulary and the batch shape."""
  splits = data.load_splits(cfg.data, data_dir=cfg.data_dir, download=cfg.download)
  data.check_vocab(splits, cfg.model.vocab_size)
  shape = dict(seq_len=cfg.model.seq_len, batch_size=cfg.batch_size)
  if cfg.segment_order:  # rows continue each other, as a memory needs
    train_it = data.make_segment_iterator(splits['train'], **shape)
  else:
    train_it = data.make_train_iterator(splits['train'], **shape, seed=cfg.seed)
  check = data.eval_segments if cfg.segment_order else data.eval_batches
  for split in ('validation', 'test'):  # fail now, not after training, if a split is too short
    check(
      splits[split],
      seq_len=cfg.model.seq_len,
      batch_size=cfg.batch_size,
      max_batches=1,
      split=split,
    )
  return splits, train_it


# ----------------------------------------------------------------------------- the run


def train(
  cfg: TrainConfig,
  *,
  resume: bool = False,
  resume_from: int | None = None,
  quiet: bool = False,
  on_step: Callable[[int, Any], None] | None = None,
) -> dict:
  """Trains cfg, writing into cfg.out_dir; returns the summary (see the module docstring).

  resume: continue from OUT's newest readable checkpoint (same step, params, optimizer state,
    ring buffers and data position); without it OUT must not hold checkpoints yet. An unreadable
    newer checkpoint is reported, moved to OUT/checkpoints-set-aside/ and skipped.
  resume_from: resume from this step's checkpoint instead (implies resume; newer checkpoints are
    set aside the same way).
  on_step: optional callback(step, state) after every step (tests use it).
  The run holds OUT for its whole life (`rundir.claim`): a second run on the same OUT is refused.
  Raises ConfigError / DataError / CheckpointError for user errors, NonFiniteLossError on NaN/Inf.
  """
  t_start = time.perf_counter()
  cfg.validate()
  # The resolved run (what config.json and the checkpoints record, and a resume compares): every
  # auto spelled out for this backend (`TrainConfig.resolved`), the output and the layer split.
  cfg = dataclasses.replace(
    cfg.resolved(), out=cfg.out_dir, layers_per_stage=','.join(map(str, cfg.plans.layers_per_stage))
  )
  sizing.check_fits(cfg)  # a model far beyond the devices would sit in XLA for minutes
  options = _Options(resume or resume_from is not None, resume_from, quiet, on_step, t_start)
  if cfg.fresh_optimizer and not options.resume:
    raise ConfigError('--fresh-optimizer applies to --resume only; drop it, or add --resume.')
  rundir.quiet_disk_full()  # a full disk is one DiskFullError, not a traceback per thread
  with rundir.claim(cfg.out_dir, lock=jax.process_index() == 0):
    return _run(cfg, options)


@dataclasses.dataclass(frozen=True)
class _Options:
  resume: bool
  resume_from: int | None
  quiet: bool
  on_step: Callable[[int, Any], None] | None
  t_start: float


@dataclasses.dataclass
class _Run:
  """Everything one run's loop works with."""

  cfg: TrainConfig
  schedule: schedules.Schedule
  state: Any
  train_it: Any
  splits: dict
  manager: Any
  meta: dict
  report: Report
  on_step: Callable[[int, Any], None] | None
  last_fetched: dict | None = None  # the metrics of the newest step the host has seen


def _run(cfg: TrainConfig, options: _Options) -> dict:
  resume.check_out_dir(cfg, options.resume)
  if options.resume:
    finished = resume.finished_summary(cfg, options.resume_from)
    if finished is not None:  # nothing to train, and nothing is written
      return finished
  splits, train_it = open_data(cfg)
  if cfg.growth or cfg.vcycle:
    with _disk_full_ends_run(cfg, None):
      return phased.train_phased(
        cfg, splits, train_it, quiet=options.quiet, t_start=options.t_start
      )
  schedule, params, layers_per_stage = build(cfg)
  state = placement.onto_mesh(schedule.init(params, example_batch(cfg)), schedule.mesh)
  del params
  with _disk_full_ends_run(cfg, checkpoint.state_bytes(state)):
    return _train_state(cfg, options, (splits, train_it), schedule, state, layers_per_stage)


@contextlib.contextmanager
def _disk_full_ends_run(cfg: TrainConfig, checkpoint_bytes: int | None):
  """A write into OUT that finds no space ends the run with one DiskFullError, and a checkpoint
  that cannot be written for another reason (read-only, forbidden, a path too long, an I/O
  error) with one CheckpointWriteError. Every write before it is whole (checkpoints are renamed
  into place when complete, the other files are written whole or not at all), so the run resumes
  from its last checkpoint."""
  try:
    yield
  except Exception as e:  # pylint: disable=broad-exception-caught
    if isinstance(e, UserError):
      raise
    if rundir.is_disk_full(e):
      raise _disk_full(cfg, checkpoint_bytes) from e
    failed = checkpoint.write_failure(e, cfg.out_dir)
    if failed is None:
      raise
    raise _write_failed(cfg, failed) from e


def _disk_full(cfg: TrainConfig, checkpoint_bytes: int | None) -> DiskFullError:
  checkpoint.remove_unfinished(cfg.out_dir)  # a save cut short never counted as a checkpoint
  latest = checkpoint.latest_step(cfg.out_dir)
  if latest is not None:  # a checkpoint as written, with its metadata
    checkpoint_bytes = max(checkpoint_bytes or 0, checkpoint.checkpoint_size(cfg.out_dir, latest))
  free = rundir.free_bytes(cfg.out_dir)
  need = (
    f'each checkpoint needs about {_size(checkpoint_bytes)}'
    if checkpoint_bytes
    else 'the run needs more'
  )
  free = f', {_size(free)} free' if free is not None else ''
  return DiskFullError(
    f'no space left on the device of {cfg.out_dir} ({need}{free}); '
    f'{_resume_from(cfg, latest, "free space")} (nothing written before was lost).'
  )


def _write_failed(cfg: TrainConfig, failed: OSError) -> CheckpointWriteError:
  checkpoint.remove_unfinished(cfg.out_dir)
  latest = checkpoint.latest_step(cfg.out_dir)
  cause = failed.strerror or type(failed).__name__
  return CheckpointWriteError(
    f'cannot write a checkpoint into {checkpoint.checkpoint_dir(cfg.out_dir)}: {cause} '
    f'({os.fsdecode(failed.filename)}); {_resume_from(cfg, latest, "fix that")} (nothing written '
    'before was lost).'
  )


def _resume_from(cfg: TrainConfig, latest: int | None, fix: str) -> str:
  ckpt_dir = checkpoint.checkpoint_dir(cfg.out_dir)
  if latest is not None:
    return (
      f'the last good checkpoint is step {latest} in {ckpt_dir}: {fix} and continue with --resume'
    )
  return f'no checkpoint was saved in {ckpt_dir}: {fix} and start again with another --out'


def _size(num_bytes: int) -> str:
  return f'{num_bytes / 2**20:.1f} MiB'


def _train_state(cfg: TrainConfig, options: _Options, opened, schedule, state, layers_per_stage):
  """The run from its fresh state (or, resuming, the checkpoint's) to its summary.
  opened: (the splits, the train iterator) of `open_data`."""
  splits, train_it = opened
  os.makedirs(cfg.out_dir, exist_ok=True)
  manager = checkpoint.make_manager(cfg.out_dir, keep=cfg.keep_checkpoints)
  try:
    crc = 0
    if options.resume:
      target = checkpoint.abstract_like(state)
      fresh_opt_state = state.opt_state if cfg.fresh_optimizer else None
      del state  # free the fresh state before the restored one arrives
      state, data_state, manager = resume.resume_state(
        cfg, manager, target, layers_per_stage, options.resume_from, fresh_opt_state
      )
      train_it.set_state(data_state['iterator'])
      crc = data_state['crc32']
    rundir.write_whole(
      os.path.join(cfg.out_dir, 'config.json'), json.dumps(cfg.to_dict(), indent=2)
    )
    start_step = int(jax.device_get(state.step))
    log = MetricsLog(cfg.out_dir, start_step if options.resume else None)
    report = Report(cfg, log, start_step=start_step, quiet=options.quiet, t_start=options.t_start)
    report.crc = crc
    report.flops = float(step_flops(cfg, np.arange(start_step)).sum())
    run = _Run(
      cfg,
      schedule,
      state,
      train_it,
      splits,
      manager,
      resume.run_meta(cfg, layers_per_stage),
      report,
      options.on_step,
    )
    try:
      with rundir.stoppable(agreed=jax.process_count() > 1):
        summary = _loop(run, start_step)
    finally:
      report.bar.close()
      log.close()
    with rundir.shielded():
      manager.wait_until_finished()
  except BaseException as e:
    if distributed.is_peer_lost(e):  # a save in flight would wait for the lost peer, forever
      raise PeerLostError(distributed.peer_lost_message('its connection closed')) from None
    # An async save in flight must land, also on errors and whatever signals come; if it fails
    # too (a full disk), the error on its way says what happened.
    with contextlib.suppress(Exception), rundir.shielded(then_stop=False):
      manager.wait_until_finished()
    with contextlib.suppress(Exception):
      manager.close()
      checkpoint.remove_unfinished(cfg.out_dir)
    raise
  manager.close()
  return summary


def _loop(run: _Run, step: int) -> dict:
  """Steps to cfg.steps: syncing, logging, evaluating and saving as the config says."""
  cfg, report = run.cfg, run.report
  pending = []  # device metrics of the steps since the last host sync
  saved = _Saved(run.manager.latest_step())
  val_bpb = None
  compiled = False
  while step < cfg.steps:
    _stop_if_asked(run, step, pending, saved)
    batch = next(run.train_it)
    report.crc = batch_crc32(batch, report.crc)
    run.state, metrics = run.schedule.step(
      run.state, placement.place_batch(batch, run.schedule.mesh)
    )
    step += 1
    distributed.note_progress(step, cfg.out_dir)  # for the line of a lost peer
    pending.append((step, {k: metrics[k] for k in ('loss', 'loss_batch', 'grad_norm')}))
    if run.on_step is not None:
      run.on_step(step, run.state)
    is_last = step == cfg.steps
    do_eval = step % cfg.eval_every == 0 or is_last
    do_save = step % cfg.checkpoint_every == 0 or is_last
    do_log = step % cfg.log_every == 0 or do_eval or do_save
    if compiled and not do_log:
      continue
    rate = _sync(run, pending, saved, compiling=not compiled)
    if do_log:  # the first step compiles: it is timed on its own, and logged only if due
      _log_train(run, step, rate)
    if not compiled:  # a stop signal from now on waits for a step boundary (runtime/watchdog.py)
      watchdog.steady()
    compiled = True
    if do_eval:
      val_bpb = _evaluate(run, step, 'validation', cfg.eval_batches)
    if do_save:
      _save(run, step, saved, last=is_last)
    report.mark()  # evaluation and saving are not training time
  if not compiled:  # resumed a finished run: nothing left to train (but perhaps a drain)
    if cfg.drain and not run.meta.get('drained'):
      _save(run, step, saved, last=True)
    val_bpb = _evaluate(run, step, 'validation', cfg.eval_batches)
  test_bpb = _evaluate(run, step, 'test', cfg.test_batches)
  _land(run)
  saved.report(run)
  return report.finish(step, val_bpb, test_bpb)


@dataclasses.dataclass
class _Saved:
  """The newest checkpoint on disk, and the one this run wrote last (its size is said once it
  is written)."""

  latest: int | None
  unreported: int | None = None

  def report(self, run: _Run) -> None:
    if self.unreported is not None:
      size = checkpoint.checkpoint_size(run.cfg.out_dir, self.unreported)
      where = os.path.join(checkpoint.checkpoint_dir(run.cfg.out_dir), str(self.unreported))
      run.report.say(f'checkpoint step {self.unreported}: {size / 2**20:.1f} MiB in {where}')
      self.unreported = None


def _stop_if_asked(run: _Run, step: int, pending: list, saved: _Saved) -> None:
  """A SIGTERM / Ctrl-C stops here, between steps (`rundir`); the save in flight lands first.
  The processes of a multi-process run stop at one step they agreed on, and save it first; with
  --drain a single process saves its drained state too."""
  signum = rundir.stop_agreed(step)
  if signum is None and run.cfg.drain:
    signum = rundir.requested_stop()
  try:
    if signum is not None:
      if pending:  # checks their losses: a non-finite state is never saved
        _sync(run, pending, saved, compiling=False)
      if saved.latest != step or run.cfg.drain:
        _save(run, step, saved, last=True)
      raise rundir.Terminated(signum)
    rundir.check_stop()
  except rundir.Terminated:
    _land(run)
    saved.report(run)
    raise


def _non_finite(run: _Run, saved: _Saved, what: str) -> NonFiniteLossError:
  where = os.path.join(run.cfg.out_dir, checkpoint.SUBDIR)
  where = (
    f'the last good checkpoint is step {saved.latest} in {where}'
    if saved.latest is not None
    else f'no checkpoint was saved in {where}'
  )
  return NonFiniteLossError(f'{what}; {where}.')


def _sync(run: _Run, pending: list, saved: _Saved, *, compiling: bool) -> float:
  """Host sync: fetches the pending metrics, stops on the first non-finite loss, counts the
  steps' FLOPs and time; returns the lap's tokens/s."""
  fetched = jax.device_get(pending)
  pending.clear()
  for done_step, m in fetched:
    for key in ('loss', 'grad_norm'):
      if not math.isfinite(float(m[key])):
        raise _non_finite(
          run, saved, f'{key.replace("_", " ")} became {float(m[key])} at step {done_step}'
        )
  run.report.flops += float(step_flops(run.cfg, [s - 1 for s, _ in fetched]).sum())
  run.last_fetched = fetched[-1][1]
  return run.report.lap(len(fetched), compiling=compiling)


def _log_train(run: _Run, step: int, rate: float) -> None:
  m = run.last_fetched
  loss = float(m['loss'])
  run.report.row(
    step,
    'train',
    loss,
    tokens_per_s=rate,
    loss_batch=int(m['loss_batch']),
    grad_norm=float(m['grad_norm']),
    data_crc32=run.report.crc,
  )
  run.report.progress(step, loss, rate)


def _evaluate(run: _Run, step: int, split: str, max_batches: int | None) -> float:
  loss = evaluate(run.schedule, run.state.params, run.splits[split], run.cfg, max_batches)
  return run.report.evaluated(step, split, loss)


def _drain(run: _Run, step: int, saved: _Saved) -> None:
  """--drain: the ring applies every gradient it holds (`Schedule.drain`), and the checkpoint
  says so (meta 'drained': it may resume on another layout). An undrained checkpoint of the
  same step is set aside first (checkpoints-set-aside/: nothing is deleted)."""
  started = time.perf_counter()
  run.state = jax.block_until_ready(run.schedule.drain(run.state))
  seconds = time.perf_counter() - started
  run.meta = {**run.meta, 'drained': True, 'drain_seconds': seconds}
  if step in run.manager.all_steps():
    where = checkpoint.set_aside(run.cfg.out_dir, [step])
    # Not a new manager: its clean-up of unfinished saves runs in the background, and would
    # race the save that follows.
    run.manager.reload()
    saved.latest = run.manager.latest_step()
    run.report.say(f'moved the undrained checkpoint of step {step} to {where}.')
  run.report.say(
    f'drained the ring at step {step} in {seconds:.1f} s: every gradient in flight applied; '
    'this checkpoint may resume on another layout.'
  )


def _land(run: _Run) -> None:
  """Waits for the save in flight to land, whatever signals come meanwhile (`rundir.shielded`),
  then removes what Orbax set aside (old checkpoints renamed for deletion)."""
  with rundir.shielded():
    run.manager.wait_until_finished()
  checkpoint.remove_unfinished(run.cfg.out_dir)


def _save(run: _Run, step: int, saved: _Saved, *, last: bool = False) -> None:
  """Saves the state of `step`; the run's last checkpoint, with --drain, drained first."""
  if not all_finite(run.state.params):  # a finite loss, but the update overflowed
    raise _non_finite(run, saved, f'parameters became non-finite at step {step}')
  _land(run)  # Orbax would wait for the previous save here anyway
  saved.report(run)
  if last and run.cfg.drain:
    _drain(run, step, saved)
  # Before Orbax's threads start: a save that fails in them hangs (read-only) or races the
  # clean-up (a disk that fills half-way); a checkpoint needs about what the last one took.
  latest = checkpoint.latest_step(run.cfg.out_dir)
  need = checkpoint.checkpoint_size(run.cfg.out_dir, latest) if latest is not None else None
  checkpoint.check_writable(run.cfg.out_dir, step, need)
  with rundir.shielded():  # a second signal waits for the save to be under way
    checkpoint.save(
      run.manager,
      relayout.stored(run.state, tuple(run.meta['layers_per_stage'])),
      {'iterator': run.train_it.get_state(), 'crc32': run.report.crc},
      run.meta,
    )
  saved.latest = saved.unreported = step
