"""Regenerate the tables of docs/results' pages from their CSVs, so that none is edited by hand.

A page marks each generated table with the command that prints it, run from the repository root:

    <!-- render: python experiments/lr_sweep.py --render docs/results/stream_ring_1000.csv -->
    ...the command's output, written here...
    <!-- /render -->

This script runs every such command (an experiment script's `--render`, which reads a CSV and
trains nothing) and writes its output between the markers, under a line that shows the command.
`--check` changes nothing and fails if a page's tables differ from what their CSVs give
(tests/test_render.py runs it).

    python experiments/render_results.py            # rewrite docs/results/*.md's tables
    python experiments/render_results.py --check    # are they up to date?
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import os
import pathlib
import re
import shlex
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
BLOCK = re.compile(
  r'(<!-- render: (?P<command>[^\n]*?) -->\n)(?P<body>.*?)(<!-- /render -->)', re.S
)


def run(command: str) -> str:
  """The output of `python experiments/SCRIPT.py ARGS...` (a `--render`), run in this process."""
  python, script, *argv = shlex.split(command)
  if python != 'python' or not script.startswith('experiments/') or '--render' not in argv:
    raise SystemExit(f'not a render command: {command}')
  spec = importlib.util.spec_from_file_location(
    f'_render_{pathlib.Path(script).stem}', ROOT / script
  )
  module = importlib.util.module_from_spec(spec)
  sys.path.insert(0, str(ROOT / 'experiments'))
  here = os.getcwd()
  try:
    spec.loader.exec_module(module)
    out = io.StringIO()
    os.chdir(ROOT)  # the command's paths are the repository root's
    with contextlib.redirect_stdout(out):
      module.main(argv)
  finally:
    os.chdir(here)
    sys.path.remove(str(ROOT / 'experiments'))
  return out.getvalue()


def rendered(text: str) -> str:
  """The page with every marked table regenerated."""

  def body(match):
    command = match.group('command')
    return f'{match.group(1)}`{command}`:\n\n{run(command).rstrip()}\n{match.group(4)}'

  return BLOCK.sub(body, text)


def pages():
  return sorted((ROOT / 'docs' / 'results').glob('*.md'))


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--check', action='store_true', help='change nothing; fail if out of date')
  parser.add_argument('pages', nargs='*', type=pathlib.Path, help='default: docs/results/*.md')
  args = parser.parse_args(argv)
  stale = []
  for page in args.pages or pages():
    text = page.read_text()
    new = rendered(text)
    if new != text:
      stale.append(str(page))
      if not args.check:
        page.write_text(new)
  if stale:
    print(('out of date: ' if args.check else 'rewrote: ') + ', '.join(stale))
  if args.check and stale:
    raise SystemExit(1)


if __name__ == '__main__':
  main()
