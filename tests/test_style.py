"""The tree keeps the one style pyproject.toml configures (`ruff format`, `ruff check`)."""

from __future__ import annotations

import shutil
import subprocess

from helpers import REPO_ROOT

PATHS = ['ouroboros_jax', 'tests', 'experiments']


def _ruff(*args):
  ruff = shutil.which('ruff')
  assert ruff, 'ruff is a test dependency: pip install -e ".[test]"'
  return subprocess.run(
    [ruff, *args, *PATHS], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60
  )


def test_the_tree_is_formatted():
  result = _ruff('format', '--check')
  assert result.returncode == 0, 'run `ruff format`:\n' + result.stdout + result.stderr


def test_the_tree_passes_the_linter():
  result = _ruff('check')
  assert result.returncode == 0, 'run `ruff check --fix`:\n' + result.stdout + result.stderr
