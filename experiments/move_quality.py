"""The cost of moving a run (issue 63): Ouroboros on G = 2 stages, stopped at step 500 with
--drain (a SIGTERM, as a preemption sends it), resumed on G = 4 to step 1000, against the same
run that never moved. Writes two rows to --csv and prints
the table: the final validation bpb of each, the drain's and the restore's seconds, and the
drained checkpoint's size beside an undrained one's.

    python experiments/move_quality.py [--steps 1000] [--layers 4] [--out /tmp/move_quality]
    python experiments/move_quality.py --render docs/results/move_quality.csv

The tiny preset with 4 layers (so 2 and 4 stages hold whole layers), the embedded corpus, the
library's defaults (the recipe: Muon, streamed micro-batches, predict + DC-ASGD), 4 simulated
CPU devices.
"""

from __future__ import annotations

import argparse
import csv
import os
import signal
import time

import jax

from ouroboros_jax.training import checkpoint, field_flags, loop, presets, resume, rundir


def _config(out: str, steps: int, layers: int, **flags):
  values = dict(num_layers=layers, steps=steps, schedule='ouroboros', stages=2, out=out)
  values.update(eval_every=steps // 2, checkpoint_every=steps, **flags)
  return field_flags.override(presets.get_preset('tiny'), values)


def _size(out: str, step: int) -> float:
  return checkpoint.checkpoint_size(out, step) / 2**20


def _restore_seconds(cfg) -> float:
  """Seconds `--resume` takes to restore the drained checkpoint onto cfg's layout: restored as
  saved, re-staged and placed (`resume.resume_state`), the run's fresh state built before."""
  schedule, params, layers_per_stage = loop.build(cfg)
  target = checkpoint.abstract_like(schedule.init(params, loop.example_batch(cfg)))
  manager = checkpoint.make_manager(cfg.out_dir, keep=cfg.keep_checkpoints)
  started = time.perf_counter()
  state, _, manager = resume.resume_state(cfg, manager, target, layers_per_stage, None)
  jax.block_until_ready(state)
  seconds = time.perf_counter() - started
  manager.close()
  return seconds


FIELDS = ['run', 'steps', 'moved_at', 'stages', 'val_bpb', 'checkpoint_mib', 'drain_s', 'restore_s']


def _legs(args) -> list[dict]:
  """The two runs, as CSV rows."""
  half = args.steps // 2
  unmoved = _config(os.path.join(args.out, 'unmoved'), args.steps, args.layers)
  straight = loop.train(unmoved, quiet=True)
  moved = _config(os.path.join(args.out, 'moved'), args.steps, args.layers, drain=True)

  def preempt(step, _state):  # a SIGTERM's stop request (the CLI's handler makes the same),
    if step == half:  # which the loop takes at its next step boundary: step `half`
      rundir.request_stop(signal.SIGTERM)

  try:
    loop.train(moved, quiet=True, on_step=preempt)
  except rundir.Terminated:
    pass
  manager = checkpoint.make_manager(moved.out_dir, read_only=True)
  drain_s = checkpoint.read_meta(manager, half)['drain_seconds']
  manager.close()
  on_four = field_flags.override(moved, {'stages': 4, 'drain': False})  # no drain at its end
  restore_s = _restore_seconds(on_four)
  resumed = loop.train(on_four, quiet=True, resume=True)
  row = dict(steps=args.steps, drain_s='', restore_s='')
  return [
    dict(row, run='never moved', moved_at='', stages='2', val_bpb=straight['val_bpb'],
         checkpoint_mib=_size(unmoved.out_dir, args.steps)),
    dict(row, run='moved', moved_at=half, stages='2 -> 4', val_bpb=resumed['val_bpb'],
         checkpoint_mib=_size(moved.out_dir, half), drain_s=drain_s, restore_s=restore_s),
  ]  # fmt: skip


def render(path: str) -> str:
  """The CSV as the markdown table quality.md shows."""
  with open(path, newline='') as f:
    rows = list(csv.DictReader(f))
  base = float(rows[0]['val_bpb'])
  lines = [
    '| run | stages | final val bpb | vs never moved | checkpoint MiB | drain s | restore s |',
    '|---|---|---|---|---|---|---|',
  ]
  for r in rows:
    where = f' at step {r["moved_at"]}' if r['moved_at'] else ''
    gap = 100 * (float(r['val_bpb']) / base - 1)
    seconds = [f'{float(r[k]):.2f}' if r[k] else '-' for k in ('drain_s', 'restore_s')]
    lines.append(
      f'| {r["run"]}{where} | {r["stages"]} | {float(r["val_bpb"]):.4f} | {gap:+.2f}% | '
      f'{float(r["checkpoint_mib"]):.2f} | {seconds[0]} | {seconds[1]} |'
    )
  return '\n'.join(lines)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--steps', type=int, default=1000)
  parser.add_argument('--layers', type=int, default=4)
  parser.add_argument('--out', default='/tmp/move_quality')
  parser.add_argument('--csv', default='docs/results/move_quality.csv', help='rows written here')
  parser.add_argument('--render', metavar='CSV', help='print the table of CSV and exit')
  args = parser.parse_args(argv)
  if args.render:
    print(render(args.render))
    return
  jax.config.update('jax_platforms', 'cpu')  # libtpu's own SIGTERM handler would end the run
  jax.config.update('jax_num_cpu_devices', 4)
  with open(args.csv, 'w', newline='') as f:
    writer = csv.DictWriter(f, fieldnames=FIELDS)
    writer.writeheader()
    writer.writerows(_legs(args))
  print(render(args.csv))


if __name__ == '__main__':
  main()
