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

Timing: the first step (which compiles) is timed on its own as compile_s; tokens/s counts only
the steps after it, and excludes evaluation and checkpointing. Rows also carry `train_s` (training
wall-clock so far, compilation included), `cpu_s` (the same in process CPU seconds) and `flops`
(model FLOPs spent so far, counted from the layers actually computed, see `step_flops`).

Accelerators (README "Training accelerators"): `--pld` and `--std-loss` swap the staged model
(`staged_model`) and run in this loop under any schedule (PLD batches carry their step,
`training_batch`); `--growth` and `--vcycle` change the model's shape mid-run and are run by
`train_phased` with the library drivers (`growth.train_growth`, `vcycle.train_vcycle`).

Losses are checked for NaN/Inf at every host sync (every `log_every` steps, and always before a
checkpoint is written), so a non-finite state is never saved; the run then stops with
`NonFiniteLossError` and the last good checkpoint stays the latest one.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import sys
import time
import zlib
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from ouroboros_jax.training import checkpoint, data, config, rundir
from ouroboros_jax.accelerators import growth, pld
from ouroboros_jax import partition, schedules
from ouroboros_jax import staged
from ouroboros_jax.accelerators import stdloss, vcycle
from ouroboros_jax import model as transformer
from ouroboros_jax.errors import NonFiniteLossError
from ouroboros_jax.training.config import TrainConfig

LN2 = math.log(2.0)
# Fields that fix the shape of the TrainState or the data stream: resuming needs them unchanged.
RESUME_FIELDS = ('schedule', 'stages', 'data_parallel', 'stash', 'stash_policy', 'forward',
                 'microbatches', 'batch_size', 'seed', 'data', 'pld', 'std_loss',
                 'std_loss_layers', 'optimizer', 'compensation')


# ----------------------------------------------------------------------------- building blocks


def schedule_config(cfg: TrainConfig) -> schedules.ScheduleConfig:
  return schedules.ScheduleConfig(
      name=cfg.schedule, num_stages=cfg.stages, data_parallel=cfg.data_parallel,
      clip_norm=cfg.clip_norm or None, seed=cfg.seed, stash=cfg.stash,
      stash_policy=cfg.stash_policy,
      sync_warmup_steps=cfg.sync_warmup_steps, tied_grad=cfg.tied_grad, forward=cfg.forward,
      microbatches=cfg.microbatches, compensation=cfg.resolved_compensation())


def build(cfg: TrainConfig):
  """(schedule, staged initial params, layers_per_stage) for a config; nothing is trained."""
  layers_per_stage = cfg.resolved_layers_per_stage()
  cfg.model.validate()  # before tracing, so a bad shape is a one-line ConfigError
  # One compiled init instead of hundreds of eager ops (seconds on CPU).
  init = jax.jit(lambda key: partition.to_staged(transformer.init_params(cfg.model, key),
                                                 layers_per_stage))
  params = init(jax.random.key(cfg.seed))
  model = staged_model(cfg, layers_per_stage)
  schedule = schedules.build_schedule(schedule_config(cfg), model, config.make_optimizer(cfg))
  return schedule, params, layers_per_stage


def staged_model(cfg: TrainConfig, layers_per_stage) -> staged.StagedModel:
  """The Transformer cut into stages, with PLD or the standardization loss when asked for."""
  if cfg.pld:
    return pld.pld_stages(cfg.model, layers_per_stage, *pld.parse(cfg.pld))
  if cfg.std_loss:
    return stdloss.stdloss_stages(cfg.model, layers_per_stage, cfg.std_loss,
                                  cfg.std_loss_layer_ids())
  return partition.transformer_stages(cfg.model, layers_per_stage)


def training_batch(cfg: TrainConfig, batch: dict, step) -> dict:
  """Batch `step` as the step function takes it: PLD stages need the step with the tokens
  (`pld.with_step`); everything else takes the batch as it is."""
  return pld.with_step(batch, step) if cfg.pld else batch


def step_flops(cfg: TrainConfig, steps) -> np.ndarray:
  """Model FLOPs of each step in `steps` (an analytic count of the layers actually computed):
  per token 3 (forward + backward) x (F per layer run + H for embedding, head and loss),
  `partition.layer_flops` / `head_flops`. With PLD the layers run are counted from the gates
  each step really drew (`pld.kept_layers`; with several data replicas or micro-batches, where
  each draws its own, the expected number `sum_l p_l(t)`)."""
  steps = np.asarray(steps)
  tokens = cfg.tokens_per_step
  per_layer, head = partition.layer_flops(cfg.model), partition.head_flops(cfg.model)
  layers = np.full(steps.shape, float(cfg.model.num_layers))
  if cfg.pld and steps.size:
    theta_bar, gamma = pld.parse(cfg.pld)
    exact = cfg.data_parallel == 1 and (cfg.schedule != 'gpipe' or cfg.microbatches == 1)
    if exact:
      layers = np.asarray(pld.kept_layers(cfg.seed, steps, cfg.resolved_layers_per_stage(),
                                          cfg.model.num_layers, theta_bar, gamma), float)
    else:
      layers = np.asarray(jax.vmap(lambda t: jnp.sum(pld.keep_probs(
          t, cfg.model.num_layers, theta_bar, gamma)))(steps), float)
  return 3.0 * (layers * per_layer + head) * tokens


def example_batch(cfg: TrainConfig) -> dict:
  shape_BxL = (cfg.batch_size, cfg.model.seq_len)
  batch = {'inputs': np.zeros(shape_BxL, np.int32), 'targets': np.zeros(shape_BxL, np.int32)}
  return training_batch(cfg, batch, 0)


def batch_crc32(batch: dict, crc: int) -> int:
  """Chains a batch into a running CRC: equal values mean the same batches in the same order."""
  crc = zlib.crc32(np.ascontiguousarray(batch['inputs']).tobytes(), crc)
  return zlib.crc32(np.ascontiguousarray(batch['targets']).tobytes(), crc)


def evaluate(schedule, params, tokens, cfg: TrainConfig, max_batches: int | None) -> float:
  """Mean loss (nats per byte) over the first max_batches batches of a split, in order."""
  # One batch at a time: evaluations are independent programs with collectives (stage-sharded
  # params), and on CPU many of them in flight at once can deadlock XLA's in-process rendezvous
  # (seen with 4 simulated devices: "Expected 4 threads to join the rendezvous").
  losses = [jax.block_until_ready(schedule.evaluate(params, staged.place_batch(b, schedule.mesh)))
            for b in data.eval_batches(tokens, seq_len=cfg.model.seq_len,
                                       batch_size=cfg.batch_size, max_batches=max_batches)]
  return float(np.mean(jax.device_get(losses)))


@jax.jit
def _all_finite(tree):
  leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)
            if jnp.issubdtype(x.dtype, jnp.inexact)]
  return jnp.all(jnp.stack(leaves)) if leaves else jnp.bool_(True)


def all_finite(tree) -> bool:
  return bool(_all_finite(tree))


def run_meta(cfg: TrainConfig, layers_per_stage) -> dict:
  return {'schedule': cfg.schedule, 'stages': cfg.stages,
          'layers_per_stage': list(layers_per_stage), 'config': cfg.to_dict()}


def resume_state(cfg: TrainConfig, manager, target, layers_per_stage, resume_from):
  """(state, data state, manager) restored from the newest readable checkpoint (or resume_from).

  Newer checkpoints that are unreadable, or newer than resume_from, are moved aside (the run
  will write those steps again) and the manager is reopened on what is left.
  """
  ckpt_dir = checkpoint.checkpoint_dir(cfg.out_dir)
  changed = []

  def check(meta):
    changed[:] = check_resumable(meta, cfg, layers_per_stage, ckpt_dir)

  state, data_state, step = checkpoint.restore_newest(manager, target, check, step=resume_from)
  newer = [s for s in manager.all_steps() if s > step]
  if newer:
    manager.close()
    where = checkpoint.set_aside(cfg.out_dir, newer)
    print(f'moved the checkpoints of steps {sorted(newer)} to {where} (nothing was deleted).',
          flush=True)
    manager = checkpoint.make_manager(cfg.out_dir, keep=cfg.keep_checkpoints)
  if changed:
    print(f'resuming step {step} with changed settings: {"; ".join(changed)}.', flush=True)
  return state, data_state, manager


def check_resumable(saved: dict, cfg: TrainConfig, layers_per_stage, where: str) -> list[str]:
  """One-line CheckpointError naming the flags to use when the checkpoint does not fit cfg.

  Returns the other settings that differ from the checkpoint's ('--steps 100 -> 200', ...): they
  are allowed (a longer run, another rate) but worth saying.
  """
  saved_cfg = config.TrainConfig.from_dict(saved['config'])
  want, have = config.flat(saved_cfg), config.flat(cfg)
  names = [f.name for f in dataclasses.fields(transformer.ModelConfig)] + list(RESUME_FIELDS)
  wrong = [n for n in names if want[n] != have[n]]
  if tuple(saved['layers_per_stage']) != tuple(layers_per_stage) and not wrong:
    wrong = ['layers_per_stage']
    want['layers_per_stage'] = ','.join(map(str, saved['layers_per_stage']))
    have['layers_per_stage'] = ','.join(map(str, layers_per_stage))

  def flags(values):
    return ' '.join(f'{config.flag(n)} {values[n]}' for n in wrong)

  if wrong:
    raise checkpoint.CheckpointError(
        f'the checkpoint in {where} was made with {flags(want)} but the flags give {flags(have)}; '
        'resume with the checkpoint\'s flags or choose another --out.')
  ignored = set(names) | {'out', 'layers_per_stage'}
  return [f'{config.flag(n)} {want[n]} -> {have[n]}' for n in have
          if n not in ignored and n in want and want[n] != have[n]]


def read_metrics(path: str) -> list[dict]:
  """The rows of a metrics.jsonl. A torn last line (the run died while writing it) is dropped
  with a note; a damaged line before it is a CheckpointError naming the line."""
  with open(path) as f:
    lines = [(n, line) for n, line in enumerate(f, 1) if line.strip()]
  rows = []
  for i, (number, line) in enumerate(lines):
    try:
      rows.append(json.loads(line))
    except json.JSONDecodeError:
      if i == len(lines) - 1:
        print(f'{path}: dropped its torn last line {number} (the run stopped while writing it).',
              flush=True)
        break
      raise checkpoint.CheckpointError(f'{path} line {number} is not JSON; repair or delete that '
                                       'line, then resume again.') from None
  return rows


def checkpoint_size(out_dir: str, step: int) -> int:
  """Bytes on disk of one checkpoint."""
  total = 0
  for root, _, files in os.walk(os.path.join(checkpoint.checkpoint_dir(out_dir), str(step))):
    total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
  return total


class MetricsLog:
  """metrics.jsonl + TensorBoard; on resume, rows past the resumed step are dropped first."""

  def __init__(self, out_dir: str, resume_step: int | None):
    from tensorboardX import SummaryWriter

    # In a multi-process run every process computes the same metrics; process 0 writes them.
    self.writer = jax.process_index() == 0
    if not self.writer:
      return
    self.path = os.path.join(out_dir, 'metrics.jsonl')
    tb_dir = os.path.join(out_dir, 'tb')
    rows = []
    if resume_step is not None and os.path.exists(self.path):
      rows = [r for r in read_metrics(self.path) if r['step'] <= resume_step]
    elif resume_step is None and os.path.isdir(tb_dir):  # a fresh run: drop a failed run's curves
      for name in os.listdir(tb_dir):
        if name.startswith('events.out.tfevents'):
          os.remove(os.path.join(tb_dir, name))
    with open(self.path, 'w') as f:
      f.writelines(json.dumps(r) + '\n' for r in rows)
    # purge_step hides TensorBoard events a previous (interrupted) run wrote past the resume step.
    self.tb = SummaryWriter(tb_dir, purge_step=resume_step)

  def write(self, row: dict) -> None:
    if not self.writer:
      return
    with open(self.path, 'a') as f:
      f.write(json.dumps(row) + '\n')
    for key in ('loss', 'bpb', 'tokens_per_s', 'grad_norm'):
      if key in row:
        self.tb.add_scalar(f'{row["split"]}/{key}', row[key], row['step'])

  def close(self) -> None:
    if self.writer:
      self.tb.close()


def _progress(total: int, initial: int, quiet: bool):
  from tqdm.auto import tqdm

  return tqdm(total=total, initial=initial, unit='step', dynamic_ncols=True,
              disable=quiet or not sys.stderr.isatty())


def _duration(seconds: float) -> str:
  if not math.isfinite(seconds):
    return '?'
  minutes, secs = divmod(int(round(seconds)), 60)
  hours, minutes = divmod(minutes, 60)
  return f'{hours}:{minutes:02d}:{secs:02d}' if hours else f'{minutes}:{secs:02d}'


def _say_saved(bar, quiet: bool, out_dir: str, step: int) -> None:
  """The size of a finished checkpoint: graph stashes make them large (README "Checkpoints")."""
  size = checkpoint_size(out_dir, step)
  _say(bar, quiet, f'checkpoint step {step}: {size / 2**20:.1f} MiB in '
       f'{os.path.join(checkpoint.checkpoint_dir(out_dir), str(step))}')


def _say(bar, quiet: bool, text: str) -> None:
  """A line on stdout that does not break the progress bar."""
  if quiet:
    return
  if bar.disable:
    print(text, flush=True)
  else:
    bar.write(text)


# ----------------------------------------------------------------------------- the loop


def train(cfg: TrainConfig, *, resume: bool = False, resume_from: int | None = None,
          quiet: bool = False, on_step: Callable[[int, Any], None] | None = None) -> dict:
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
  # The resolved config (what config.json and the checkpoints record): no implicit defaults left.
  cfg = dataclasses.replace(cfg, out=cfg.out_dir, layers_per_stage=','.join(
      map(str, cfg.resolved_layers_per_stage())))
  resume = resume or resume_from is not None
  with rundir.claim(cfg.out_dir, lock=jax.process_index() == 0):
    return _train_claimed(cfg, resume, resume_from, quiet, on_step, t_start)


def _train_claimed(cfg: TrainConfig, resume: bool, resume_from: int | None, quiet: bool,
                   on_step, t_start: float) -> dict:
  out_dir = cfg.out_dir
  found = checkpoint.latest_step(out_dir)
  ckpt_dir = checkpoint.checkpoint_dir(out_dir)
  if resume and (cfg.growth or cfg.vcycle):
    raise checkpoint.CheckpointError('--resume does not apply to --growth / --vcycle runs (they '
                                     'write no checkpoints mid-plan); start a new run.')
  if resume and found is None:
    raise checkpoint.CheckpointError(f'--resume: no checkpoint in {ckpt_dir}; run without '
                                     '--resume to start, or point --out at an earlier run.')
  if not resume and found is not None:
    raise checkpoint.CheckpointError(f'{out_dir} already holds checkpoints (latest step {found}); '
                                     'pass --resume to continue it, or choose another --out.')
  if not resume and os.path.exists(os.path.join(out_dir, 'summary.json')):
    raise checkpoint.CheckpointError(f'{out_dir} already holds a finished run (summary.json); '
                                     'choose another --out, or remove it to train there again.')
  splits = data.load_splits(cfg.data, data_dir=cfg.data_dir, download=cfg.download)
  data.check_vocab(splits, cfg.model.vocab_size)
  train_it = data.make_train_iterator(splits['train'], seq_len=cfg.model.seq_len,
                                      batch_size=cfg.batch_size, seed=cfg.seed)
  for split in ('validation', 'test'):  # fail now, not after training, if a split is too short
    data.eval_batches(splits[split], seq_len=cfg.model.seq_len, batch_size=cfg.batch_size,
                      max_batches=1, split=split)
  if cfg.growth or cfg.vcycle:
    return train_phased(cfg, splits, train_it, quiet=quiet, t_start=t_start)

  schedule, params, layers_per_stage = build(cfg)
  meta = run_meta(cfg, layers_per_stage)
  state = staged.onto_mesh(schedule.init(params, example_batch(cfg)), schedule.mesh)
  del params
  os.makedirs(out_dir, exist_ok=True)
  manager = checkpoint.make_manager(out_dir, keep=cfg.keep_checkpoints)
  crc = 0
  try:
    if resume:
      target = checkpoint.abstract_like(state)
      del state  # free the fresh state before the restored one arrives
      state, data_state, manager = resume_state(cfg, manager, target, layers_per_stage,
                                                resume_from)
      train_it.set_state(data_state['iterator'])
      crc = data_state['crc32']
    with open(os.path.join(out_dir, 'config.json'), 'w') as f:
      json.dump(cfg.to_dict(), f, indent=2)
    start_step = int(jax.device_get(state.step))
    log = MetricsLog(out_dir, start_step if resume else None)
    try:
      with rundir.stoppable():
        state, summary = _loop(cfg, schedule, state, train_it, splits, manager, meta, log, crc,
                               start_step, quiet, on_step, t_start)
    finally:
      log.close()
  finally:
    manager.wait_until_finished()  # an async save in flight must land, also on errors
    manager.close()
  with open(os.path.join(out_dir, 'summary.json'), 'w') as f:
    json.dump(summary, f, indent=2)
  return summary


def _loop(cfg, schedule, state, train_it, splits, manager, meta, log, crc, start_step, quiet,
          on_step, t_start):
  tokens_per_step = cfg.tokens_per_step
  bar = _progress(cfg.steps, start_step, quiet)
  pending = []                # device metrics of the steps since the last host sync
  last_saved = manager.latest_step()
  saved_now = None            # the step this run saved last (its size is reported once written)
  ckpt_where = os.path.join(cfg.out_dir, checkpoint.SUBDIR)
  train_s, train_tokens, compile_s = 0.0, 0, None
  cpu = {'compile': 0.0, 'train': 0.0}  # process CPU seconds (all threads): robust to load
  val_bpb = None
  step = start_step
  flops = float(step_flops(cfg, np.arange(start_step)).sum())  # counted, see `step_flops`

  def wall():
    return time.perf_counter() - t_start

  def throughput():
    return train_tokens / train_s if train_s else 0.0

  def stop(what: str):
    where = (f'the last good checkpoint is step {last_saved} in {ckpt_where}'
             if last_saved is not None else f'no checkpoint was saved in {ckpt_where}')
    raise NonFiniteLossError(f'{what}; {where}.')

  def sync():
    """Host sync: fetch pending metrics and stop on the first non-finite loss."""
    fetched = jax.device_get(pending)
    pending.clear()
    for done_step, m in fetched:
      for key in ('loss', 'grad_norm'):
        if not math.isfinite(float(m[key])):
          stop(f'{key.replace("_", " ")} became {float(m[key])} at step {done_step}')
    return fetched

  def evaluate_split(split, max_batches):
    loss = evaluate(schedule, state.params, splits[split], cfg, max_batches)
    row = {'step': step, 'split': split, 'loss': loss, 'bpb': loss / LN2,
           'tokens_per_s': throughput(), 'wall_s': wall(), 'flops': flops,
           'train_s': (compile_s or 0.0) + train_s, 'cpu_s': cpu['compile'] + cpu['train']}
    log.write(row)
    _say(bar, quiet, f'step {step}: {split} loss {loss:.4f}, bpb {loss / LN2:.4f}')
    return row

  try:
    t_mark, c_mark = time.perf_counter(), time.process_time()
    while step < cfg.steps:
      try:
        rundir.check_stop()  # a SIGTERM / Ctrl-C stops here, between steps (see rundir)
      except rundir.Terminated:
        manager.wait_until_finished()  # the save in flight lands first
        if saved_now is not None:
          _say_saved(bar, quiet, cfg.out_dir, saved_now)
        raise
      batch = next(train_it)
      crc = batch_crc32(batch, crc)
      state, metrics = schedule.step(
          state, staged.place_batch(training_batch(cfg, batch, step), schedule.mesh))
      step += 1
      pending.append((step, {k: metrics[k] for k in ('loss', 'loss_batch', 'grad_norm')}))
      if on_step is not None:
        on_step(step, state)
      is_last = step == cfg.steps
      do_eval = step % cfg.eval_every == 0 or is_last
      do_save = step % cfg.checkpoint_every == 0 or is_last
      first = compile_s is None
      if not (first or step % cfg.log_every == 0 or do_eval or do_save):
        continue

      fetched = sync()
      flops += float(step_flops(cfg, [s - 1 for s, _ in fetched]).sum())
      elapsed = time.perf_counter() - t_mark
      cpu['compile' if first else 'train'] += time.process_time() - c_mark
      if first:  # the first step compiles; it is timed on its own and not counted in tokens/s
        compile_s = elapsed
        rate = tokens_per_step / elapsed
      else:
        train_s += elapsed
        train_tokens += len(fetched) * tokens_per_step
        rate = len(fetched) * tokens_per_step / elapsed
      bar.update(step - bar.n)
      if first and not (step % cfg.log_every == 0 or do_eval or do_save):
        t_mark, c_mark = time.perf_counter(), time.process_time()
        continue
      _, m = fetched[-1]
      loss = float(m['loss'])
      log.write({'step': step, 'split': 'train', 'loss': loss, 'bpb': loss / LN2,
                 'tokens_per_s': rate, 'wall_s': wall(), 'loss_batch': int(m['loss_batch']),
                 'grad_norm': float(m['grad_norm']), 'data_crc32': crc, 'flops': flops,
                 'train_s': (compile_s or 0.0) + train_s,
                 'cpu_s': cpu['compile'] + cpu['train']})
      bar.set_postfix(loss=f'{loss:.3f}', tok_s=f'{rate:,.0f}')
      if bar.disable and not quiet:  # no terminal (a cluster job, nohup): a status line instead
        timed_steps = train_tokens / tokens_per_step
        eta = (cfg.steps - step) * train_s / timed_steps if timed_steps else math.nan
        print(f'step {step}/{cfg.steps}: loss {loss:.4f}, {rate:,.0f} tokens/s, ETA '
              f'{_duration(eta)}', flush=True)
      if do_eval:
        val_bpb = evaluate_split('validation', cfg.eval_batches)['bpb']
      if do_save:
        if not all_finite(state.params):  # a finite loss, but the update overflowed
          stop(f'parameters became non-finite at step {step}')
        manager.wait_until_finished()  # Orbax would wait for the previous save here anyway
        if saved_now is not None:
          _say_saved(bar, quiet, cfg.out_dir, saved_now)
        checkpoint.save(manager, state, {'iterator': train_it.get_state(), 'crc32': crc}, meta)
        last_saved = saved_now = step
      # evaluation and saving are not training time
      t_mark, c_mark = time.perf_counter(), time.process_time()
    if compile_s is None:  # resumed a finished run: nothing left to train
      compile_s = 0.0
      val_bpb = evaluate_split('validation', cfg.eval_batches)['bpb']
    test_bpb = evaluate_split('test', None)['bpb']
    manager.wait_until_finished()
    if saved_now is not None:
      _say_saved(bar, quiet, cfg.out_dir, saved_now)
  finally:
    bar.close()

  summary = {'step': step, 'val_bpb': val_bpb, 'test_bpb': test_bpb,
             'tokens_per_s': throughput(), 'train_s': train_s, 'compile_s': compile_s,
             'wall_s': wall(), 'data_crc32': crc, 'out': cfg.out_dir, 'flops': flops,
             'compile_cpu_s': cpu['compile'], 'train_cpu_s': cpu['train']}
  _say(bar, False, f'done: val bpb {val_bpb:.4f}, test bpb {test_bpb:.4f}, '
       f'{summary["tokens_per_s"]:,.0f} tokens/s, {summary["wall_s"]:.1f} s')
  return state, summary


# ----------------------------------------------------------------------------- growth & V-cycle


@functools.lru_cache(maxsize=16)
def _plain_loss(model_cfg: transformer.ModelConfig):
  return jax.jit(lambda params, batch: transformer.loss_fn(model_cfg, params, batch)[0])


def evaluate_plain(model_cfg, params, tokens, cfg: TrainConfig, max_batches) -> float:
  """Mean loss of unstaged params {'embed', 'layers', 'head'} over a split (one device)."""
  loss_of = _plain_loss(model_cfg)
  losses = [loss_of(params, b) for b in data.eval_batches(
      tokens, seq_len=model_cfg.seq_len, batch_size=cfg.batch_size, max_batches=max_batches)]
  return float(np.mean(jax.device_get(losses)))


def train_phased(cfg: TrainConfig, splits, train_it, *, quiet: bool = False,
                 t_start: float | None = None) -> dict:
  """A --growth (MSLT / stacking, `growth.train_growth`) or --vcycle (`vcycle.train_vcycle`)
  run: the library driver trains, this loop feeds it batches and logs and evaluates like
  `train` (metrics.jsonl, TensorBoard, config.json, summary.json; no checkpoints).

  Evaluation runs the model of the moment, all its layers, no dropout: a shallower one during
  the early growth stages, the coalesced one during a V-cycle's dip. The rows' train_s is the
  wall-clock of the training steps *including* every phase's compilation (a new depth or width
  compiles a new step), excluding evaluation; the summary splits it, as `train` does, into
  compile_s (the first step of every phase: compilation, growing, coalescing, re-initialising)
  and train_s (the rest). flops is the driver's count of the layers it actually ran
  (`growth.step_flops`: a frozen layer its forward, a trained one forward + backward;
  `vcycle.step_flops` at each level's size).
  """
  t_start = time.perf_counter() if t_start is None else t_start
  out_dir = cfg.out_dir
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, 'config.json'), 'w') as f:
    json.dump(cfg.to_dict(), f, indent=2)
  log = MetricsLog(out_dir, None)
  bar = _progress(cfg.steps, 0, quiet)
  state = {'crc': 0, 'eval_s': 0.0, 'val_bpb': None, 'flops': 0.0, 'phase': None,
           'switch_s': 0.0, 'eval_cpu': 0.0, 'switch_cpu': 0.0}
  t_train, c_train = time.perf_counter(), time.process_time()
  state['c_prev'] = c_train
  state['t_prev'] = t_train

  def batches():
    while True:
      batch = next(train_it)
      state['crc'] = batch_crc32(batch, state['crc'])
      yield batch

  def train_s():
    return time.perf_counter() - t_train - state['eval_s']

  def cpu_s():
    return time.process_time() - c_train - state['eval_cpu']

  def on_step(row, model_cfg, params_fn):
    step = row['step'] + 1
    state['flops'] = row['flops']
    now = time.perf_counter()
    phase = tuple(row.get(k) for k in ('stage', 'level', 'phase'))
    if phase != state['phase']:  # the first step of a phase: its compile (and re-init) time
      float(row['loss'])
      now = time.perf_counter()
      state['switch_s'] += now - state['t_prev']
      state['switch_cpu'] += time.process_time() - state['c_prev']
      state['phase'] = phase
    state['t_prev'], state['c_prev'] = now, time.process_time()
    is_last = step == cfg.steps
    do_eval = step % cfg.eval_every == 0 or is_last
    if not (step % cfg.log_every == 0 or do_eval or step == 1):
      return
    loss = float(row['loss'])
    if not math.isfinite(loss):
      raise NonFiniteLossError(f'loss became {loss} at step {step}; no checkpoint is written by '
                               '--growth / --vcycle runs.')
    extra = {k: row[k] for k in ('stage', 'depth', 'frozen', 'level', 'phase') if k in row}
    log.write({'step': step, 'split': 'train', 'loss': loss, 'bpb': loss / LN2,
               'tokens_per_s': step * cfg.tokens_per_step / max(train_s(), 1e-9),
               'wall_s': time.perf_counter() - t_start, 'data_crc32': state['crc'],
               'flops': row['flops'], 'train_s': train_s(), 'cpu_s': cpu_s(), **extra})
    bar.update(step - bar.n)
    bar.set_postfix(loss=f'{loss:.3f}')
    if do_eval:
      t0, c0 = time.perf_counter(), time.process_time()
      params = params_fn()
      loss = evaluate_plain(model_cfg, params, splits['validation'], cfg, cfg.eval_batches)
      state['eval_s'] += time.perf_counter() - t0
      state['eval_cpu'] += time.process_time() - c0
      state['val_bpb'] = loss / LN2
      log.write({'step': step, 'split': 'validation', 'loss': loss, 'bpb': loss / LN2,
                 'tokens_per_s': step * cfg.tokens_per_step / max(train_s(), 1e-9),
                 'wall_s': time.perf_counter() - t_start, 'flops': row['flops'],
                 'train_s': train_s(), 'cpu_s': cpu_s(), **extra})
      _say(bar, quiet, f'step {step}: validation loss {loss:.4f}, bpb {loss / LN2:.4f}')
      state['t_prev'], state['c_prev'] = time.perf_counter(), time.process_time()

  try:
    if cfg.growth:
      plan = growth.parse_plan(cfg.growth, cfg.model.num_layers, cfg.steps)
      starts = np.cumsum([0, *(steps for _, steps, _ in plan.stages())])

      def tx_factory(stage):  # the run's warmup-cosine, continued across the stages
        base, offset = config.lr_schedule(cfg), int(starts[stage])
        return staged.adamw(lambda count: base(count + offset), weight_decay=cfg.weight_decay)

      params, _ = growth.train_growth(
          plan, cfg.model, batches(), tx_factory, key=jax.random.key(cfg.seed),
          clip_norm=cfg.clip_norm or None, seed=cfg.seed,
          on_step=lambda row, p: on_step(row, dataclasses.replace(
              cfg.model, num_layers=row['depth']), lambda: p))
      final_cfg = cfg.model
    else:
      plan, lr_scale = vcycle.parse_plan(cfg.vcycle, cfg.steps)
      configs = vcycle.level_configs(cfg.model, plan.levels, width=plan.width, depth=plan.depth)
      level_steps = vcycle.level_steps(plan)

      def tx_factory(level):  # warmup-cosine over the steps this level trains, lr x scale^level
        return staged.adamw(config.lr_schedule(cfg, level_steps[level],
                                                cfg.learning_rate * lr_scale ** level),
                            weight_decay=cfg.weight_decay)

      params, _, _ = vcycle.train_vcycle(
          plan, cfg.model, batches(), tx_factory, schedule_config=schedule_config(cfg),
          key=jax.random.key(cfg.seed),
          on_step=lambda row, params_fn: on_step(row, configs[row['level']], params_fn))
      final_cfg = cfg.model
    total_train_s, total_cpu_s = train_s(), cpu_s()
    test_loss = evaluate_plain(final_cfg, params, splits['test'], cfg, None)
    log.write({'step': cfg.steps, 'split': 'test', 'loss': test_loss, 'bpb': test_loss / LN2,
               'tokens_per_s': cfg.steps * cfg.tokens_per_step / total_train_s,
               'wall_s': time.perf_counter() - t_start, 'flops': state['flops'],
               'train_s': total_train_s, 'cpu_s': total_cpu_s})
  finally:
    bar.close()
    log.close()
  steady_s = max(total_train_s - state['switch_s'], 1e-9)
  summary = {'step': cfg.steps, 'val_bpb': state['val_bpb'], 'test_bpb': test_loss / LN2,
             'tokens_per_s': cfg.steps * cfg.tokens_per_step / steady_s,
             'train_s': steady_s, 'compile_s': state['switch_s'],
             'wall_s': time.perf_counter() - t_start, 'data_crc32': state['crc'],
             'out': out_dir, 'flops': state['flops'], 'compile_cpu_s': state['switch_cpu'],
             'train_cpu_s': total_cpu_s - state['switch_cpu']}
  with open(os.path.join(out_dir, 'summary.json'), 'w') as f:
    json.dump(summary, f, indent=2)
  _say(bar, False, f'done: val bpb {summary["val_bpb"]:.4f}, test bpb {summary["test_bpb"]:.4f}, '
       f'{summary["tokens_per_s"]:,.0f} tokens/s, {summary["wall_s"]:.1f} s')
  return summary
