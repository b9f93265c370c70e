"""House rules on the package's size (issue 60): no function over 60 lines, no module over 700,
and docs/results' top level short enough to read.

A function's length is `end_lineno - lineno + 1` of its `ast` node: from the `def` line to its
last line, docstring included (decorators not).
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / 'ouroboros_jax'

FUNCTION_LINES_LIMIT = 60
MODULE_LINES_LIMIT = 700
RESULTS_TOP_LEVEL_LIMIT = 40


def _modules() -> list[pathlib.Path]:
  return sorted(PACKAGE.rglob('*.py'))


def test_no_function_is_over_60_lines():
  too_long = []
  for path in _modules():
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        lines = node.end_lineno - node.lineno + 1
        if lines > FUNCTION_LINES_LIMIT:
          too_long.append(f'{path.relative_to(ROOT)}:{node.name} ({lines})')
  assert not too_long, (
    f'functions over {FUNCTION_LINES_LIMIT} lines; split them into helpers:\n' + '\n'.join(too_long)
  )


def test_no_module_is_over_700_lines():
  too_long = []
  for path in _modules():
    lines = path.read_text().count('\n')
    if lines > MODULE_LINES_LIMIT:
      too_long.append(f'{path.relative_to(ROOT)} ({lines})')
  assert not too_long, f'modules over {MODULE_LINES_LIMIT} lines; split them by job:\n' + '\n'.join(
    too_long
  )


def test_docs_results_top_level_is_short():
  entries = sorted(p.name for p in (ROOT / 'docs' / 'results').iterdir())
  assert len(entries) <= RESULTS_TOP_LEVEL_LIMIT, (
    f'docs/results holds {len(entries)} entries at its top level, more than '
    f'{RESULTS_TOP_LEVEL_LIMIT}; move the older ones into an archive folder'
  )
