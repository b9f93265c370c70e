"""Module paths that moved: the old ones still import until `REMOVED_IN`, with a warning.

`MOVED` maps each old dotted path to where the module lives now. `install()` (run by
`import ouroboros_jax`) puts one finder on `sys.meta_path` that answers an import statement of an
old path (`import ouroboros_jax.presets`, `from ouroboros_jax.training.windows import
eval_batches`); `module_getattr`, a package's `__getattr__`, answers the old module read as an
attribute of its package (`from ouroboros_jax import presets`, or with no import statement). Both
give the module at the new path itself (the same object, not a copy) and emit a
`DeprecationWarning` that names the new path and the release that removes the old one.

Standard library only; nothing of the package imports an old path (tests/test_package.py).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings

REMOVED_IN = '0.2.0'  # the next minor release after pyproject.toml's 0.1.0

MOVED = {
  # The flat layout, before the sub-packages (see CHANGELOG.md).
  'ouroboros_jax.presets': 'ouroboros_jax.training.presets',
  'ouroboros_jax.checkpoint': 'ouroboros_jax.training.checkpoint',
  'ouroboros_jax.rundir': 'ouroboros_jax.training.rundir',
  'ouroboros_jax.sample': 'ouroboros_jax.training.sample',
  'ouroboros_jax.train': 'ouroboros_jax.training.loop',
  'ouroboros_jax.ring': 'ouroboros_jax.schedules.ring',
  'ouroboros_jax.ouroboros': 'ouroboros_jax.schedules.ouroboros',
  'ouroboros_jax.reference': 'ouroboros_jax.schedules.reference',
  'ouroboros_jax.delays': 'ouroboros_jax.schedules.delays',
  'ouroboros_jax.compensation': 'ouroboros_jax.schedules.compensation',
  'ouroboros_jax.pld': 'ouroboros_jax.accelerators.pld',
  'ouroboros_jax.growth': 'ouroboros_jax.accelerators.growth',
  'ouroboros_jax.vcycle': 'ouroboros_jax.accelerators.vcycle',
  'ouroboros_jax.stdloss': 'ouroboros_jax.accelerators.stdloss',
  'ouroboros_jax.bench': 'ouroboros_jax.perf.bench',
  'ouroboros_jax.simulate': 'ouroboros_jax.perf.simulate',
  'ouroboros_jax.memory': 'ouroboros_jax.perf.memory',
  'ouroboros_jax.launch': 'ouroboros_jax.runtime.launch',
  'ouroboros_jax.distributed': 'ouroboros_jax.runtime.distributed',
  'ouroboros_jax.host': 'ouroboros_jax.runtime.host',
  # The model family, apart from the step interface (issue 43).
  **{
    f'ouroboros_jax.{name}': f'ouroboros_jax.models.{name}'
    for name in ('model', 'txl', 'attention', 'cross_entropy', 'partition')
  },
  # Data loading, out of training/ into its own package (issue 43).
  'ouroboros_jax.training.data': 'ouroboros_jax.data',
  **{
    f'ouroboros_jax.training.{name}': f'ouroboros_jax.data.{name}'
    for name in (
      'corpora',
      'wikitext',
      'tfds_corpus',
      'windows',
      'segments',
      'batching',
      'byte_corpus',
      'char_corpora',
      'default_corpus',
      'data_errors',
    )
  },
}


def new_path(old: str) -> str | None:
  """Where the module at the dotted path `old` lives now; None if it did not move."""
  return MOVED.get(old)


def _warn(old: str, new: str) -> None:
  warnings.warn(
    f'{old} is deprecated and will be removed in ouroboros_jax {REMOVED_IN}: use {new}',
    DeprecationWarning,
    stacklevel=4,  # the importing line (the import machinery's own frames are skipped)
  )


def load(old: str):
  """The module an old path names, now at its new path, with the deprecation warning."""
  new = MOVED[old]
  _warn(old, new)
  return importlib.import_module(new)


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
  """Answers an import of an old path with the module at its new path."""

  def find_spec(self, name, path=None, target=None):
    if name in MOVED:
      return importlib.machinery.ModuleSpec(name, self)
    return None

  def create_module(self, spec):
    return None  # a placeholder, replaced in exec_module

  def exec_module(self, module):
    # The import system returns what sys.modules holds under the old name once this returns.
    sys.modules[module.__name__] = load(module.__name__)


_FINDER = _Finder()


def install() -> None:
  if not any(isinstance(f, _Finder) for f in sys.meta_path):
    sys.meta_path.insert(0, _FINDER)


def module_getattr(package: str, lazy: dict[str, str] | None = None):
  """A module-level `__getattr__` for `package`: a name of `lazy` (name -> the module defining
  it) is imported on first use; a moved sub-module comes with the warning; any other name is an
  AttributeError, as without it."""
  lazy = lazy or {}

  def __getattr__(name: str):
    if name in lazy:
      return getattr(importlib.import_module(lazy[name]), name)
    old = f'{package}.{name}'
    if old in MOVED:
      return load(old)
    raise AttributeError(f'module {package} has no attribute {name!r}')

  return __getattr__
