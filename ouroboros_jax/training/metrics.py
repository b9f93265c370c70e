"""What a run reports: metrics.jsonl and TensorBoard (`MetricsLog`, `EventFile`), the clock, the
FLOP and data counters, the progress bar and the summary (`Report`), shared by every kind of run.

Timing: a run's wall-clock is cut into laps (`Report.lap`). A lap that compiles (the first step,
or the first step of a growth / V-cycle phase) counts as compile_s; the others as train_s, and
tokens/s counts only those. Evaluation and checkpointing happen between laps and count as
neither. Rows carry `train_s` (compile + train so far), `cpu_s` (the same in process CPU seconds,
all threads: robust to a loaded machine) and `flops` (model FLOPs spent so far, `costs`).
"""

from __future__ import annotations

import functools
import json
import math
import os
import socket
import struct
import sys
import time
import zlib

import jax
import numpy as np

from ouroboros_jax.errors import CheckpointError
from ouroboros_jax.training import rundir

LN2 = math.log(2.0)
SCALARS = ('loss', 'bpb', 'tokens_per_s', 'grad_norm')  # what TensorBoard gets of a row


def batch_crc32(batch: dict, crc: int) -> int:
  """Chains a batch into a running CRC: equal values mean the same batches in the same order."""
  crc = zlib.crc32(np.ascontiguousarray(batch['inputs']).tobytes(), crc)
  return zlib.crc32(np.ascontiguousarray(batch['targets']).tobytes(), crc)


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
        print(
          f'{path}: dropped its torn last line {number} (the run stopped while writing it).',
          flush=True,
        )
        break
      raise CheckpointError(
        f'{path} line {number} is not JSON; repair or delete that line, then resume again.'
      ) from None
  return rows


class MetricsLog:
  """metrics.jsonl + TensorBoard; on resume, rows past the resumed step are dropped first.

  Every row reaches both files whole, or neither (`rundir.append_whole`), so a write that finds
  the disk full raises with the files as they were."""

  def __init__(self, out_dir: str, resume_step: int | None):
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
    rundir.write_whole(self.path, ''.join(json.dumps(r) + '\n' for r in rows))
    # purge_step hides TensorBoard events a previous (interrupted) run wrote past the resume step.
    self.tb = EventFile(tb_dir, purge_step=resume_step)

  def write(self, row: dict) -> None:
    if not self.writer:
      return
    fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
      size = os.fstat(fd).st_size
      rundir.append_whole(fd, (json.dumps(row) + '\n').encode())
      try:
        self.tb.scalars(
          row['step'], {f'{row["split"]}/{key}': row[key] for key in SCALARS if key in row}
        )
      except BaseException:  # the row goes into both files or neither
        os.ftruncate(fd, size)
        raise
    finally:
      os.close(fd)

  def close(self) -> None:
    if self.writer:
      self.tb.close()


class EventFile:
  """A TensorBoard event file (`events.out.tfevents.*` in `tb_dir`), written in the caller's
  thread, each call's events whole or not at all. (tensorboardX's SummaryWriter writes from a
  thread of its own, where a full disk is a traceback and a torn record.)

  purge_step: the step a resumed run starts from; TensorBoard hides the events an earlier run
  wrote at or past it (a SessionLog START at that step, as SummaryWriter(purge_step=) writes).
  """

  def __init__(self, tb_dir: str, purge_step: int | None = None):
    from tensorboardX.proto import event_pb2

    self._event_pb2 = event_pb2
    os.makedirs(tb_dir, exist_ok=True)
    name = f'events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}'
    self.path = os.path.join(tb_dir, name)
    self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    events = [event_pb2.Event(wall_time=time.time(), file_version='brain.Event:2')]
    if purge_step is not None:
      start = event_pb2.SessionLog(status=event_pb2.SessionLog.START)
      events.append(event_pb2.Event(wall_time=time.time(), step=purge_step, session_log=start))
    self._append(events)

  def scalars(self, step: int, values: dict) -> None:
    """One scalar event per tag in `values` at `step`."""
    from tensorboardX.summary import scalar

    now = time.time()
    self._append(
      [
        self._event_pb2.Event(wall_time=now, step=int(step), summary=scalar(tag, float(value)))
        for tag, value in values.items()
      ]
    )

  def _append(self, events) -> None:
    from tensorboardX.record_writer import masked_crc32c

    records = []
    for event in events:
      data = event.SerializeToString()
      header = struct.pack('Q', len(data))
      records += [header, struct.pack('I', masked_crc32c(header)), data]
      records.append(struct.pack('I', masked_crc32c(data)))
    rundir.append_whole(self._fd, b''.join(records))

  def close(self) -> None:
    if self._fd is not None:
      os.close(self._fd)
      self._fd = None


def duration(seconds: float) -> str:
  """'1:02:03' or '2:03'; '?' when unknown."""
  if not math.isfinite(seconds):
    return '?'
  minutes, secs = divmod(int(round(seconds)), 60)
  hours, minutes = divmod(minutes, 60)
  return f'{hours}:{minutes:02d}:{secs:02d}' if hours else f'{minutes}:{secs:02d}'


class Report:
  """A run's clock, counters, rows, progress bar and summary.

  `flops` and `crc` are the run's counters (the caller adds to them); `lap` closes a stretch of
  steps; `row` writes a metrics row with the clock's columns; `finish` writes summary.json and
  prints the last line, `done: val bpb X, test bpb Y, Z tokens/s, W s`.
  """

  def __init__(
    self,
    cfg,
    log: MetricsLog,
    *,
    start_step: int = 0,
    quiet: bool = False,
    t_start: float | None = None,
  ):
    from tqdm.auto import tqdm

    self.cfg, self.log, self.quiet = cfg, log, quiet
    self.t_start = time.perf_counter() if t_start is None else t_start
    self.bar = tqdm(
      total=cfg.steps,
      initial=start_step,
      unit='step',
      dynamic_ncols=True,
      disable=quiet or not sys.stderr.isatty(),
    )
    self.compile_s = self.train_s = self.compile_cpu_s = self.train_cpu_s = 0.0
    self.train_tokens, self.flops, self.crc = 0, 0.0, 0
    self.mark()

  def mark(self) -> None:
    """Starts a lap (after evaluation or saving, which are not training time)."""
    self._lap_start = time.perf_counter(), time.process_time()

  def lap(self, steps: int, *, compiling: bool) -> float:
    """Counts the time since `mark` as `steps` steps of compilation or training; starts the next
    lap and returns the lap's tokens/s."""
    wall, cpu = time.perf_counter() - self._lap_start[0], time.process_time() - self._lap_start[1]
    tokens = steps * self.cfg.tokens_per_step
    if compiling:
      self.compile_s, self.compile_cpu_s = self.compile_s + wall, self.compile_cpu_s + cpu
    else:
      self.train_s, self.train_cpu_s = self.train_s + wall, self.train_cpu_s + cpu
      self.train_tokens += tokens
    self.mark()
    return tokens / wall if wall else 0.0

  def tokens_per_s(self) -> float:
    """Training throughput so far, compilation excluded."""
    return self.train_tokens / self.train_s if self.train_s else 0.0

  def row(self, step: int, split: str, loss: float, **extra) -> dict:
    """Writes one metrics row: the loss, its bits per byte and the clock's columns."""
    row = {
      'step': step,
      'split': split,
      'loss': loss,
      'bpb': loss / LN2,
      'tokens_per_s': self.tokens_per_s(),
      'wall_s': time.perf_counter() - self.t_start,
      'flops': self.flops,
      'train_s': self.compile_s + self.train_s,
      'cpu_s': self.compile_cpu_s + self.train_cpu_s,
      **extra,
    }
    self.log.write(row)
    return row

  def evaluated(self, step: int, split: str, loss: float, **extra) -> float:
    """Writes an evaluation row (with its perplexity, exp(loss)) and its line; returns its bits
    per token (per byte on byte-level data; on word-level data perplexity is the metric)."""
    self.row(step, split, loss, ppl=math.exp(min(loss, 700.0)), **extra)
    metric = f'ppl {math.exp(min(loss, 700.0)):.2f}' if self.words else f'bpb {loss / LN2:.4f}'
    self.say(f'step {step}: {split} loss {loss:.4f}, {metric}')
    return loss / LN2

  @functools.cached_property
  def words(self) -> bool:
    """Whether the run's tokens are words (WikiText-103), whose metric is perplexity."""
    from ouroboros_jax import data

    return data.corpus_info(self.cfg.data).unit == 'word'

  def progress(self, step: int, loss: float, rate: float) -> None:
    """Moves the bar; without a terminal (a cluster job, nohup) prints a status line instead."""
    self.bar.update(step - self.bar.n)
    self.bar.set_postfix(loss=f'{loss:.3f}', tok_s=f'{rate:,.0f}')
    if self.bar.disable and not self.quiet:
      timed_steps = self.train_tokens / self.cfg.tokens_per_step
      eta = (self.cfg.steps - step) * self.train_s / timed_steps if timed_steps else math.nan
      print(
        f'step {step}/{self.cfg.steps}: loss {loss:.4f}, {rate:,.0f} tokens/s, ETA {duration(eta)}',
        flush=True,
      )

  def say(self, text: str, *, always: bool = False) -> None:
    """A line on stdout that does not break the progress bar (--quiet drops it)."""
    if self.quiet and not always:
      return
    if self.bar.disable:
      print(text, flush=True)
    else:
      self.bar.write(text)

  def finish(self, step: int, val_bpb: float, test_bpb: float) -> dict:
    """The summary: written to OUT/summary.json, and the last line printed."""
    self.bar.close()
    summary = {
      'step': step,
      'val_bpb': val_bpb,
      'test_bpb': test_bpb,
      'val_ppl': math.exp(min(val_bpb * LN2, 700.0)),
      'test_ppl': math.exp(min(test_bpb * LN2, 700.0)),
      'tokens_per_s': self.tokens_per_s(),
      'train_s': self.train_s,
      'compile_s': self.compile_s,
      'wall_s': time.perf_counter() - self.t_start,
      'data_crc32': self.crc,
      'out': self.cfg.out_dir,
      'flops': self.flops,
      'compile_cpu_s': self.compile_cpu_s,
      'train_cpu_s': self.train_cpu_s,
    }
    if jax.process_index() == 0:  # the old summary.json stays whole if this write fails
      rundir.write_whole(
        os.path.join(self.cfg.out_dir, 'summary.json'), json.dumps(summary, indent=2)
      )
    quality = (
      f'val ppl {summary["val_ppl"]:.2f}, test ppl {summary["test_ppl"]:.2f}'
      if self.words
      else f'val bpb {val_bpb:.4f}, test bpb {test_bpb:.4f}'
    )
    self.say(
      f'done: {quality}, {summary["tokens_per_s"]:,.0f} tokens/s, {summary["wall_s"]:.1f} s',
      always=True,
    )
    return summary
