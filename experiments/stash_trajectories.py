"""Ouroboros' trajectories over a grid of settings, saved so two versions of the ring can be
compared bit for bit (issue 58: the stash in micro-batch slots must train exactly as the stash in
step slots did).

  python experiments/stash_trajectories.py record OUT.npz [REGEX]   # on one version (the
                                                                     # settings REGEX matches)
  python experiments/stash_trajectories.py compare A.npz B.npz

The grid: G in {1, 2, 4}; M in {1, 2, G, 2G, 4G}; locked and pipelined; as one batch and
streamed; the graph stash under every policy and the replay stash; Transformer-XL (G = 2). Each
setting runs 2G + 4 steps of the tests' tiny Transformer with dropout on 16-row batches, and
records its losses and final parameters.
"""

from __future__ import annotations

import os
import re
import sys

os.environ.setdefault('JAX_PLATFORMS', 'cpu')
os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=4')

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), '..', 'tests'))

import jax  # noqa: E402

from ouroboros_jax.schedules import ScheduleConfig  # noqa: E402
from ouroboros_jax.schedules.compensation import Compensation  # noqa: E402

from helpers import adam, random_batches, run_schedule, tiny_transformer  # noqa: E402

POLICIES = ('nothing', 'dots', 'dots_no_batch', 'all')


def settings():
  """(label, model options, ScheduleConfig options) for every setting of the grid."""
  for num_stages in (1, 2, 4):
    micros = sorted({1, 2, num_stages, 2 * num_stages, 4 * num_stages})
    for micro in micros:
      for forward in ('locked', 'pipelined'):
        for flow in ('batch', 'stream'):
          stashes = [('graph', p) for p in POLICIES] + [('replay', None)]
          for stash, policy in stashes:
            if micro not in (1, 2 * num_stages) and policy not in ('nothing', None):
              continue  # every policy at M = 1 and 2G; the graph default and replay elsewhere
            options = dict(stash=stash, forward=forward, flow=flow, microbatches=micro)
            if policy:
              options['stash_policy'] = policy
            label = f'G={num_stages} M={micro} {forward} {flow} {stash} {policy or ""}'.strip()
            yield label, dict(), num_stages, options
  for stash in ('graph', 'replay'):
    for forward, flow in (('locked', 'batch'), ('pipelined', 'stream')):
      options = dict(stash=stash, forward=forward, flow=flow, microbatches=2)
      txl = dict(arch='transformer-xl', mem_len=8, num_layers=4)
      yield f'TXL G=2 M=2 {forward} {flow} {stash}', txl, 2, options


def record(out: str, pattern: str = '') -> None:
  results = {}
  for label, model_options, num_stages, options in settings():
    if not re.search(pattern, label):
      continue
    model, params = tiny_transformer(num_stages, dropout=0.1, **model_options)
    batches = random_batches(2 * num_stages + 4, seed=2, batch=16)
    config = ScheduleConfig(
      name='ouroboros', num_stages=num_stages, compensation=Compensation(), seed=3, **options
    )
    state, losses = run_schedule(config, model, adam(), params, batches)
    leaves = [np.asarray(a, np.float32).ravel() for a in jax.tree.leaves(state.params)]
    results[label + '|losses'] = np.asarray(losses, np.float32)
    results[label + '|params'] = np.concatenate(leaves)
    print(label, losses[-1], flush=True)
  np.savez_compressed(out, **results)


def compare(a: str, b: str) -> None:
  old, new = np.load(a), np.load(b)
  worst, equal = 0.0, 0
  for key in sorted(old.files):
    if key not in new.files:
      continue  # recorded in one of them only
    diff = float(np.max(np.abs(old[key] - new[key]))) if old[key].size else 0.0
    equal += diff == 0.0
    worst = max(worst, diff)
    if diff > 0:
      print(f'{key}: {diff:.3g}')
  compared = len(set(old.files) & set(new.files))
  print(f'{compared} arrays, {equal} bit for bit, largest difference {worst:.3g}')


if __name__ == '__main__':
  {'record': record, 'compare': compare}[sys.argv[1]](*sys.argv[2:])
