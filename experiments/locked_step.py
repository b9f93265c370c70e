"""The locked Ouroboros step against its ideal, two versions of the code side by side.

docs/results/locked_step.md's runs: `ouroboros launch --processes 2 --pin-cpus -- bench ...
--only ouroboros`, once with an older commit on PYTHONPATH (a `git worktree`) and once with
today's, in alternating order, pair after pair (the page gives the commands). Their rows, one per
pair, code and forward, are collected into one CSV (`pair,code,label,step_ms,ideal_ms,...`, the
bench's per-stage pieces as `;`-joined lists).

    python experiments/locked_step.py --render docs/results/archive/locked_step_bisect.csv

prints the page's table from that CSV and measures nothing.
"""

from __future__ import annotations

import argparse
import csv

FORWARDS = ('locked', 'pipelined')


def render(path: str) -> str:
  """One line per (pair, code): each forward's step and its ideal (ms), measured / ideal, and
  device 0's optimizer update as timed at that run's start (the piece that moves the ideal)."""
  with open(path, newline='') as f:
    rows = list(csv.DictReader(f))
  keys = list(dict.fromkeys((r['pair'], r['code']) for r in rows))
  by = {(r['pair'], r['code'], r['label'].split()[1].split('/')[0]): r for r in rows}
  head = ['pair', 'code']
  for forward in FORWARDS:
    head += [f'{forward} ms', 'its ideal ms', 'measured / ideal']
  head += ['update s, device 0']
  lines = ['| ' + ' | '.join(head) + ' |', '|' + '---|' * len(head)]
  for pair, code in keys:
    cells = [pair, code]
    for forward in FORWARDS:
      row = by[(pair, code, forward)]
      step, ideal = float(row['step_ms']), float(row['ideal_ms'])
      cells += [f'{step:.0f}', f'{ideal:.0f}', f'{step / ideal:.2f}']
    update = by[(pair, code, FORWARDS[0])]['update_s_per_stage'].split(';')[0]
    cells.append(f'{float(update):.2f}')
    lines.append('| ' + ' | '.join(cells) + ' |')
  return '\n'.join(lines)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--render', metavar='CSV', required=True, help='print the table of a CSV')
  args = parser.parse_args(argv)
  print(render(args.render))


if __name__ == '__main__':
  main()
