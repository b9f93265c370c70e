"""Weight prediction from a smoothed update: a deep-delay lever of issue 28, tried and not kept.

The library's weight prediction (`--compensation predict`) runs module k's forward at
w_k + tau_k * u_k, with u_k the group's latest update. This script tries the momentum-style
direction instead: an exponential average of the group's updates, s <- beta * s + (1 - beta) * u
(beta = 0 is the library's prediction, bit for bit), on the streamed default recipe, each beta on
the same batches and initialisation. The variant lives only here: it replaces
`compensation.remember_update` while the runs are built.

  python experiments/smoothed_prediction.py --betas 0,0.5,0.9
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lr_sweep  # noqa: E402  (the sweep's recipes and its one training run)

from ouroboros_jax.runtime import host  # noqa: E402


def remember_smoothed_update(beta: float):
  """compensation.remember_update with the kept update smoothed: s <- beta * s + (1 - beta) * u."""
  import jax
  import jax.numpy as jnp
  import optax

  from ouroboros_jax.schedules import compensation

  def remember(tx):
    tx = optax.with_extra_args_support(tx)

    def init(params):
      return compensation.LastUpdateState(tx.init(params), jax.tree.map(jnp.zeros_like, params))

    def update(updates, state, params=None, **extra):
      updates, inner = tx.update(updates, state.inner, params, **extra)

      def smooth(s, u):
        # The first update is taken whole (an average that starts at 0 would predict a step
        # 1 - beta too short); every later one is averaged in.
        return jnp.where(jnp.all(s == 0), u, beta * s + (1 - beta) * u).astype(u.dtype)

      return updates, compensation.LastUpdateState(
        inner, jax.tree.map(smooth, state.last_update, updates)
      )

    return optax.GradientTransformationExtraArgs(init, update)

  return remember


@contextlib.contextmanager
def smoothed_prediction(beta: float):
  from ouroboros_jax.schedules import compensation

  original = compensation.remember_update
  compensation.remember_update = remember_smoothed_update(beta)
  try:
    yield
  finally:
    compensation.remember_update = original


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--betas', default='0,0.5,0.9', help='comma-separated smoothing factors')
  parser.add_argument(
    '--recipe',
    default='g4-stream4-muon-predict-dc',
    help='a lr_sweep.py recipe with weight prediction',
  )
  parser.add_argument('--rate', type=float, default=0.02)
  parser.add_argument('--steps', type=int, default=1000)
  parser.add_argument('--seed', type=int, default=0)
  parser.add_argument('--eval-every', type=int, default=100)
  parser.add_argument('--eval-batches', type=int, default=40)
  parser.add_argument('--out', default='experiments/results/smoothed_prediction')
  args = parser.parse_args(argv)

  host.configure_cpu_runtime()
  import jax

  jax.config.update('jax_num_cpu_devices', 8)
  from ouroboros_jax.training import presets

  overrides = lr_sweep.RECIPES[args.recipe][0]
  if 'predict' not in overrides.get('compensation', ''):
    parser.error(f'{args.recipe} does not use weight prediction; name a recipe with "predict"')
  base = presets.get_preset('tiny')
  curves = {}
  for beta in map(float, args.betas.split(',')):
    out = os.path.join(args.out, f'{args.recipe}-beta{beta:g}@{args.rate:g}-s{args.seed}')
    with smoothed_prediction(beta):
      curves[beta] = lr_sweep.train_one(
        base,
        overrides,
        args.rate,
        args.steps,
        args.eval_every,
        args.eval_batches,
        out,
        True,
        args.seed,
      )

  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, 'smoothed_prediction.csv'), 'w', newline='') as f:
    writer = csv.writer(f)
    writer.writerow(['recipe', 'beta', 'rate', 'seed', 'step', 'bpb'])
    for beta, rows in curves.items():
      writer.writerows([args.recipe, beta, args.rate, args.seed, step, bpb] for step, bpb in rows)
  reference = curves.get(0.0)
  print(f'| beta | val bpb at {args.steps} | vs beta 0 (the library) |')
  print('|---|---|---|')
  for beta, rows in curves.items():
    final = rows[-1][1]
    versus = f'{final / reference[-1][1] - 1:+.1%}' if reference else '-'
    print(f'| {beta:g} | {final:.4f} | {versus} |')


if __name__ == '__main__':
  main()
