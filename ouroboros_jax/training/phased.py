"""Runs whose model changes shape mid-run: `--growth` (MSLT / progressive stacking,
`growth.train_growth`) and `--vcycle` (`vcycle.train_vcycle`).

The library driver trains; `train_phased` feeds it batches and reports like `loop.train`, through
the same `metrics.Report` (metrics.jsonl, TensorBoard, config.json, summary.json and the last
line; no checkpoints). Evaluation runs the model of the moment, all its layers, no dropout: a
shallower one during the early growth phases, the coalesced one during a V-cycle's dip.

Timing: the first step of every phase (compilation, growing, coalescing, re-initialising) is a
compile lap, the other steps training laps (`Report.lap`); evaluation is neither. `flops` is the
driver's count of the layers it actually ran (`costs.step_flops`: a frozen layer its forward, a
trained one forward + backward; each V-cycle level at its own size).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os

import jax
import numpy as np

from ouroboros_jax import data, optimizers, staged
from ouroboros_jax.accelerators import growth, vcycle
from ouroboros_jax.errors import NonFiniteLossError
from ouroboros_jax.models import model as transformer
from ouroboros_jax.training import rundir
from ouroboros_jax.training.config import TrainConfig
from ouroboros_jax.training.metrics import MetricsLog, Report, batch_crc32
from ouroboros_jax.training.optimizer_setup import lr_schedule


@functools.lru_cache(maxsize=16)
def _plain_loss(model_cfg: transformer.ModelConfig):
  return jax.jit(lambda params, batch: transformer.loss_fn(model_cfg, params, batch)[0])


def evaluate_plain(model_cfg, params, tokens, cfg: TrainConfig, max_batches) -> float:
  """Mean loss of unstaged params {'embed', 'layers', 'head'} over a split (one device)."""
  loss_of = _plain_loss(model_cfg)
  losses = [
    loss_of(params, b)
    for b in data.eval_batches(
      tokens, seq_len=model_cfg.seq_len, batch_size=cfg.batch_size, max_batches=max_batches
    )
  ]
  return float(np.mean(jax.device_get(losses)))


class _Reporter:
  """The driver's per-step callback: laps, rows, evaluations, through one `Report`."""

  def __init__(self, cfg: TrainConfig, report: Report, splits: dict):
    self.cfg, self.report, self.splits = cfg, report, splits
    self.phase, self.val_bpb = None, None

  def batches(self, train_it):
    while True:
      batch = next(train_it)
      self.report.crc = batch_crc32(batch, self.report.crc)
      yield batch

  def on_step(self, row: dict, model_cfg, params_fn) -> None:
    cfg, report = self.cfg, self.report
    step = row['step'] + 1
    report.flops = row['flops']
    phase = tuple(row.get(k) for k in ('level', 'phase'))
    if phase != self.phase:  # the first step of a phase: its compile (and re-init) time
      float(row['loss'])
      self.phase = phase
      report.lap(1, compiling=True)
    else:
      report.lap(1, compiling=False)
    do_eval = step % cfg.eval_every == 0 or step == cfg.steps
    if not (step % cfg.log_every == 0 or do_eval or step == 1):
      return
    loss = float(row['loss'])
    if not math.isfinite(loss):
      raise NonFiniteLossError(
        f'loss became {loss} at step {step}; no checkpoint is written by --growth / --vcycle runs.'
      )
    extra = {k: row[k] for k in ('phase', 'depth', 'frozen', 'level') if k in row}
    report.row(step, 'train', loss, data_crc32=report.crc, **extra)
    report.progress(step, loss, report.tokens_per_s())
    if do_eval:
      loss = evaluate_plain(
        model_cfg, params_fn(), self.splits['validation'], cfg, cfg.eval_batches
      )
      self.val_bpb = report.evaluated(step, 'validation', loss, **extra)
      report.mark()


def train_phased(
  cfg: TrainConfig, splits, train_it, *, quiet: bool = False, t_start: float | None = None
) -> dict:
  """A --growth or --vcycle run of cfg (see the module docstring); returns the summary."""
  os.makedirs(cfg.out_dir, exist_ok=True)
  rundir.write_whole(os.path.join(cfg.out_dir, 'config.json'), json.dumps(cfg.to_dict(), indent=2))
  log = MetricsLog(cfg.out_dir, None)
  report = Report(cfg, log, quiet=quiet, t_start=t_start)
  reporter = _Reporter(cfg, report, splits)
  try:
    run = _run_growth if cfg.growth else _run_vcycle
    params = run(cfg, reporter.batches(train_it), reporter.on_step)
    test_loss = evaluate_plain(cfg.model, params, splits['test'], cfg, cfg.test_batches)
    test_bpb = report.evaluated(cfg.steps, 'test', test_loss)
  finally:
    report.bar.close()
    log.close()
  return report.finish(cfg.steps, reporter.val_bpb, test_bpb)


def _mu_dtype(cfg: TrainConfig):
  """AdamW's first moment in the run's --state-dtype, as `optimizer_setup.make_optimizer` stores
  it."""
  return optimizers.state_jnp_dtype(cfg.resolved_state_dtype())


def _run_growth(cfg: TrainConfig, batches, on_step):
  plan = cfg.plans.growth
  starts = np.cumsum([0, *(steps for _, steps, _ in plan.phases())])

  def tx_factory(phase):  # the run's warmup-cosine, continued across the phases
    base, offset = lr_schedule(cfg), int(starts[phase])
    return staged.adamw(
      lambda count: base(count + offset), weight_decay=cfg.weight_decay, mu_dtype=_mu_dtype(cfg)
    )

  params, _ = growth.train_growth(
    plan,
    cfg.model,
    batches,
    tx_factory,
    growth.GrowthRun(
      key=jax.random.key(cfg.seed),
      clip_norm=cfg.schedule.clip_norm,
      seed=cfg.seed,
      on_step=lambda row, p: on_step(
        row, dataclasses.replace(cfg.model, num_layers=row['depth']), lambda: p
      ),
    ),
  )
  return params


def _run_vcycle(cfg: TrainConfig, batches, on_step):
  plan, lr_scale = cfg.plans.vcycle
  configs = vcycle.level_configs(cfg.model, plan.levels, width=plan.width, depth=plan.depth)
  level_steps = vcycle.level_steps(plan)

  def tx_factory(level):  # warmup-cosine over the steps this level trains, lr x scale^level
    return staged.adamw(
      lr_schedule(cfg, level_steps[level], cfg.learning_rate * lr_scale**level),
      weight_decay=cfg.weight_decay,
      mu_dtype=_mu_dtype(cfg),
    )

  params, _, _ = vcycle.train_vcycle(
    plan,
    cfg.model,
    batches,
    tx_factory,
    vcycle.VCycleRun(
      schedule_config=cfg.schedule_config(),
      key=jax.random.key(cfg.seed),
      on_step=lambda row, params_fn: on_step(row, configs[row['level']], params_fn),
    ),
  )
  return params
