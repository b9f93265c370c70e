"""The cost of moving a run (issue 63): Ouroboros on G = 2 stages, stopped at step 500 with
--drain (a SIGTERM, as a preemption sends it), resumed on G = 4 to step 1000, against the same
run that never moved. Prints one table: the final validation bpb of each, the drain's and the
restore's seconds, and the drained checkpoint's size beside an undrained one's.

    python experiments/move_quality.py [--steps 1000] [--layers 4] [--out /tmp/move_quality]

The tiny preset with 4 layers (so 2 and 4 stages hold whole layers), the embedded corpus, the
library's defaults (the recipe: Muon, streamed micro-batches, predict + DC-ASGD), 4 simulated
CPU devices.
"""

from __future__ import annotations

import argparse
import os
import signal
import time

os.environ.setdefault('JAX_PLATFORMS', 'cpu')  # libtpu's own SIGTERM handler would end the run
import jax  # noqa: E402

jax.config.update('jax_num_cpu_devices', 4)

from ouroboros_jax.training import checkpoint, field_flags, loop, presets, resume, rundir  # noqa: E402


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


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--steps', type=int, default=1000)
  parser.add_argument('--layers', type=int, default=4)
  parser.add_argument('--out', default='/tmp/move_quality')
  args = parser.parse_args()
  half = args.steps // 2
  unmoved = _config(os.path.join(args.out, 'unmoved'), args.steps, args.layers)
  straight = loop.train(unmoved, quiet=True)
  moved = _config(os.path.join(args.out, 'moved'), args.steps, args.layers, drain=True)

  def preempt(step, _state):  # a SIGTERM's stop request (the CLI's handler makes the same),
    if step == half:  # which the loop takes at its next step boundary: step `half`
      rundir.request_stop(signal.SIGTERM)

  started = time.perf_counter()
  try:
    loop.train(moved, quiet=False, on_step=preempt)
  except rundir.Terminated:
    pass
  first_leg = time.perf_counter() - started
  drained_mib = _size(moved.out_dir, half)
  on_four = field_flags.override(moved, {'stages': 4, 'drain': False})  # no drain at its end
  restore_s = _restore_seconds(on_four)
  started = time.perf_counter()
  resumed = loop.train(on_four, quiet=False, resume=True)
  print(
    f'first leg {first_leg:.1f} s; restore on 4 stages {restore_s:.2f} s; resumed leg '
    f'{time.perf_counter() - started:.1f} s (the drain: its own line above)'
  )
  print('| run | final val bpb | checkpoint MiB |')
  print('|---|---|---|')
  print(
    f'| never moved (G = 2) | {straight["val_bpb"]:.4f} | {_size(unmoved.out_dir, args.steps):.2f} |'
  )
  print(
    f'| moved G = 2 -> 4 at step {half} | {resumed["val_bpb"]:.4f} | {drained_mib:.2f} (drained) |'
  )


if __name__ == '__main__':
  main()
