"""What the small experiment scripts share: their rows written to a CSV and read back, a markdown
table of them, and the `--out CSV` / `--render CSV` command line (render_results.py runs every
`--render`)."""

from __future__ import annotations

import argparse
import csv


def write(path: str, columns: list[str], rows: list[dict]) -> None:
  with open(path, 'w', newline='') as f:
    writer = csv.DictWriter(f, fieldnames=columns)
    writer.writeheader()
    writer.writerows(rows)


def read(path: str) -> list[dict]:
  with open(path) as f:
    return list(csv.DictReader(f))


def table(header: list[str], lines: list[list[str]]) -> str:
  """A markdown table: the header's cells, then one row of cells per line."""
  row = lambda cells: '| ' + ' | '.join(cells) + ' |'
  rule = '|' + '|'.join(['---'] * len(header)) + '|'
  return '\n'.join([row(header), rule, *(row(c) for c in lines)])


def parser(doc: str, out: str) -> argparse.ArgumentParser:
  """A script's parser: its doc's first paragraph, --out (where it writes) and --render."""
  p = argparse.ArgumentParser(description=doc.split('\n\n')[0])
  p.add_argument('--out', default=out)
  p.add_argument('--render', metavar='CSV', help='print the markdown table of a saved CSV')
  return p
