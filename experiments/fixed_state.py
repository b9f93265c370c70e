"""Ouroboros' fixed state per device, piece by piece (docs/results/memory.md, its fixed state).

What one device keeps from step to step besides its parameters: the optimizer state (the
optimizer's own moments, DC-ASGD's weight history and running mean, weight prediction's latest
update) and the ring (the graph stash's forward weights, the stage inputs in flight, the error
gradients). Every number is exact and needs no compile: the state's shapes, each leaf's largest
shard, as `ouroboros compile` counts them (`perf.compile.shard_bytes`).

    python experiments/fixed_state.py                       # the 1B shape, G = 8, the defaults
    python experiments/fixed_state.py --out docs/results/fixed_state.csv
    python experiments/fixed_state.py --render docs/results/fixed_state.csv
    python experiments/fixed_state.py --flags "--flow batch"  # any train flags on top
    python experiments/fixed_state.py --flags "--state-dtype float32"  # the states in float32

The per-weight optimizer and compensation states are stored in --state-dtype, bfloat16 by default
at this shape (it computes in bfloat16); a CSV's column is a commit, with the state dtype where it
is not float32's (rows written before the setting have none: every state was float32).
"""

from __future__ import annotations

import argparse
import csv
import os
import shlex
import subprocess
import sys

# The 1B shape of docs/results/memory.md: d_model 2048, 24 layers, seq 2048, batch 32, bf16,
# G = 8, the micro-batches Ouroboros takes on an accelerator.
ONE_B = (
  '--preset gpt2-small --d-model 2048 --num-layers 24 --num-heads 16 --d-ff 8192 --seq-len 2048 '
  '--batch-size 32 --dtype bfloat16 --schedule ouroboros --stages 8 --microbatches 8'
)
GIB = 2**30
HOST = "['host']"  # placement.HOST: the ring's buffers in host memory

# (piece, which state, a test on a leaf's path): the first piece whose test matches takes the leaf.
PIECES = (
  ('DC-ASGD weight history', 'opt_state', lambda p: '.history' in p),
  ('DC-ASGD running mean of g*g', 'opt_state', lambda p: '.mean_square' in p),
  ("weight prediction's latest update", 'opt_state', lambda p: '.last_update' in p),
  ("the optimizer's own state (Muon; Adam off the matrices)", 'opt_state', lambda p: True),
  ('the stash in host memory (--stash-memory pinned_host)', 'ring', lambda p: p.startswith(HOST)),
  ("graph stash: the forward's weights", 'ring', lambda p: p.startswith("['weights']")),
  ('stage inputs in flight (per batch)', 'ring', lambda p: p.startswith("['stash']")),
  ('batches in flight (token ids)', 'ring', lambda p: p.startswith("['batches']")),
  ('error gradients and activations in flight', 'ring', lambda p: True),
)


def pieces(flags: list[str]) -> list[dict]:
  """One row per piece: bytes per device and the multiple of the device's parameters."""
  os.environ.setdefault('JAX_PLATFORMS', 'cpu')
  os.environ['XLA_FLAGS'] = '--xla_force_host_platform_device_count=8'
  import jax

  from ouroboros_jax import cli_parsers
  from ouroboros_jax.perf import compile as compile_lib
  from ouroboros_jax.training import field_flags

  args = cli_parsers.make_parser().parse_args(['compile', *flags])
  cfg = field_flags.override(cli_parsers.config_from_args(args), {'attention': 'xla'})
  run = cfg.schedule_config('tpu')  # what the run resolves to on an accelerator
  devices = jax.devices()[: run.num_stages * run.data_parallel]
  _, state, _ = compile_lib._abstract_step(cfg, run, devices)  # pylint: disable=protected-access
  params = compile_lib.shard_bytes(state.params)
  totals = {name: 0 for name, _, _ in PIECES}
  for where in ('opt_state', 'ring'):
    for path, leaf in jax.tree_util.tree_leaves_with_path(getattr(state, where)):
      key = jax.tree_util.keystr(path)
      name = next(n for n, w, test in PIECES if w == where and test(key))
      totals[name] += compile_lib.shard_bytes(leaf)
  rows = [{'piece': 'parameters', 'state': 'params', 'bytes': params}]
  rows += [{'piece': n, 'state': w, 'bytes': totals[n]} for n, w, _ in PIECES]
  for row in rows:
    row.update(
      label=run.label,
      times_params=round(row['bytes'] / params, 3),
      state_dtype=cfg.resolved_state_dtype(),
    )
  return rows


def column(row: dict) -> str:
  """A row's column: its commit, and its state dtype unless float32 (or written before)."""
  dtype = row.get('state_dtype') or 'float32'
  commit = row.get('commit', '')
  return commit if dtype == 'float32' else f'{commit} {dtype} state'


def render(rows: list[dict]) -> str:
  """One table per setting, one column per commit it was measured at (x parameters, and GiB for
  the totals)."""
  out = []
  for label in dict.fromkeys(r['label'] for r in rows):
    mine = [r for r in rows if r['label'] == label]
    commits = list(dict.fromkeys(column(r) for r in mine))
    at = {(r['piece'], column(r)): r for r in mine}
    params = {c: int(at['parameters', c]['bytes']) for c in commits}
    lines = [
      f'{label}, per device:',
      '',
      '| piece | kept in | ' + ' | '.join(commits) + ' |',
      '|---|---|' + '---|' * len(commits),
    ]
    for piece in dict.fromkeys(r['piece'] for r in mine):
      state = next(r['state'] for r in mine if r['piece'] == piece)
      cells = [f'{float(at[piece, c]["times_params"]):.2f}x' for c in commits]
      lines.append(f'| {piece} | {state} | ' + ' | '.join(cells) + ' |')

    def total(name, pick, commit):
      size = sum(int(r['bytes']) for r in mine if column(r) == commit and pick(r))
      return f'**{size / params[commit]:.2f}x** ({size / GIB:.2f} GiB)' if size else '-'

    host = lambda r: r['piece'].startswith('the stash in host')
    for name, pick in (
      ('optimizer state + ring', lambda r: r['state'] in ('opt_state', 'ring')),
      ('... of which on the chip', lambda r: r['state'] in ('opt_state', 'ring') and not host(r)),
    ):
      cells = [total(name, pick, c) for c in commits]
      lines.append(f'| **{name}** | | ' + ' | '.join(cells) + ' |')
    out.append('\n'.join(lines))
  return '\n\n'.join(out)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--flags', default='', help='train flags on top of the 1B defaults')
  parser.add_argument('--out', help='write the rows to this CSV')
  parser.add_argument('--render', help='print the table of a CSV written with --out')
  args = parser.parse_args(argv)
  if args.render:
    with open(args.render) as f:
      print(render(list(csv.DictReader(f))))
    return 0
  rows = pieces(shlex.split(ONE_B) + shlex.split(args.flags))
  commit = subprocess.run(
    ['git', 'rev-parse', '--short', 'HEAD'], capture_output=True, text=True, check=False
  ).stdout.strip()
  for row in rows:
    row['commit'] = commit
  print(render(rows))
  if args.out:  # appended; rows written before a column existed get it empty
    old = []
    if os.path.exists(args.out):
      with open(args.out) as f:
        old = list(csv.DictReader(f))
    fields = list(dict.fromkeys([*(old[0] if old else {}), *rows[0]]))
    with open(args.out, 'w', newline='') as f:
      writer = csv.DictWriter(f, fieldnames=fields, restval='')
      writer.writeheader()
      writer.writerows(old + rows)
  return 0


if __name__ == '__main__':
  sys.exit(main())
