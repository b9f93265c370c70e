"""Every code path the docs name exists: a code span such as `ring.send_forward`,
`schedules.stash.GraphStash`, `ouroboros_jax.training.loop.train(cfg)`, `ScheduleConfig.label` or
`schedules/stash.py` in the README, docs/, or a docstring or comment of the package names a
module, attribute or file that is there.

Only spans that start with a name of this package are checked: one of its modules or sub-packages
(`ring`, `training`, `ouroboros_jax`, ...), a module of the flat layout (`presets`) or a class it
defines (`StagedModel`). A module name resolves against the package and each of its sub-packages,
so `config.X` passes if either `training.config` or `schedules.config` has an `X`. The old
module paths (`moved.MOVED`: `presets`, `train`, `ouroboros_jax.ring`, `training.windows`) still
import, with a DeprecationWarning, but do not pass: the docs name where the module went. Other
libraries' names (`jax.checkpoint`, `optax.contrib.muon`), a variable's attribute (`cfg.schedule`)
and file names (`config.json`) are left alone.
"""

from __future__ import annotations

import ast
import functools
import importlib
import pathlib
import re
import tokenize

import ouroboros_jax
from ouroboros_jax import moved

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = pathlib.Path(ouroboros_jax.__file__).resolve().parent
SUBPACKAGES = sorted(p.name for p in PACKAGE.iterdir() if (p / '__init__.py').exists())
PREFIXES = ['ouroboros_jax', *(f'ouroboros_jax.{s}' for s in SUBPACKAGES)]

FENCE = re.compile(r'^(```|~~~).*?^\1', re.S | re.M)
SPAN = re.compile(r'(`+)([^`\n]+?)\1')
# a dotted (or slashed) name, maybe called or indexed: `placement.place_batch(...)`, `a.b['k']`
PATH = re.compile(r'([A-Za-z_]\w*(?:[./][A-Za-z_]\w*)+)(?:\(.*\)|\[.*\])?')
FILE_SUFFIXES = {'py', 'md', 'csv', 'json', 'jsonl', 'png', 'txt', 'toml', 'log', 'xml', 'gz'}


def _module_names() -> set[str]:
  names = {'ouroboros_jax', *(old.rpartition('.')[2] for old in moved.MOVED)}
  for path in PACKAGE.rglob('*.py'):
    names |= {part for part in path.relative_to(PACKAGE).with_suffix('').parts}
  return names - {'__init__', '__main__'}


def _classes() -> dict[str, list[str]]:
  """Each class defined at the top level of a module of the package -> the modules defining it."""
  found = {}
  for path in sorted(PACKAGE.rglob('*.py')):
    module = '.'.join(('ouroboros_jax', *path.relative_to(PACKAGE).with_suffix('').parts))
    for node in ast.parse(path.read_text()).body:
      if isinstance(node, ast.ClassDef):
        found.setdefault(node.name, []).append(module.removesuffix('.__init__'))
  return found


MODULES = _module_names()
CLASSES = _classes()
# Variables the docs name after a module, and the class of what they hold: `staging.to_layers`
# (staging = from_layers(...)), `config.stage_groups`, `model.forward_loss(...)`,
# `pipeline.stage_of(d, c)`. Such a span passes if the module or the class has the name.
INSTANCES = {
  'config': ('ScheduleConfig', 'TrainConfig'),
  'model': ('StagedModel',),
  'staging': ('Staging',),
  'pipeline': ('Pipeline',),
}


def _markdown_spans():
  files = [ROOT / 'README.md', *sorted((ROOT / 'docs').rglob('*.md'))]
  for path in files:
    text = FENCE.sub(lambda m: '\n' * m.group(0).count('\n'), path.read_text())
    for match in SPAN.finditer(text):
      yield f'{path.relative_to(ROOT)}:{text.count(chr(10), 0, match.start()) + 1}', match.group(2)


def _docstring_spans():
  for path in sorted(PACKAGE.rglob('*.py')):
    for node in ast.walk(ast.parse(path.read_text())):
      if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
        continue
      if not (node.body and isinstance(node.body[0], ast.Expr)):
        continue
      doc = node.body[0].value
      if not (isinstance(doc, ast.Constant) and isinstance(doc.value, str)):
        continue
      for match in SPAN.finditer(doc.value):
        line = doc.lineno + doc.value.count('\n', 0, match.start())
        yield f'{path.relative_to(ROOT)}:{line}', match.group(2)


def _comment_spans():
  for path in sorted(PACKAGE.rglob('*.py')):
    with path.open() as lines:
      for token in tokenize.generate_tokens(lines.readline):
        if token.type == tokenize.COMMENT:
          for match in SPAN.finditer(token.string):
            yield f'{path.relative_to(ROOT)}:{token.start[0]}', match.group(2)


def _ours(dotted: str) -> bool:
  return dotted.split('.')[0] in MODULES.union(CLASSES)


@functools.cache
def _import(name: str):
  parts = name.split('.')
  if any('.'.join(parts[:n]) in moved.MOVED for n in range(1, len(parts) + 1)):
    return None  # an old path: it imports, but the docs name the new one
  try:
    return importlib.import_module(name)
  except ModuleNotFoundError as error:
    if error.name and (name == error.name or name.startswith(error.name + '.')):
      return None  # no such module (rather than a module that fails to import)
    raise


def _has(owner, name: str) -> bool:
  if f'{getattr(owner, "__name__", "")}.{name}' in moved.MOVED:
    return False  # an old module path, still importable: the docs name where it went
  if hasattr(owner, name):
    return True
  if isinstance(owner, type):  # a dataclass field or an annotated member without a default
    return any(name in getattr(k, '__annotations__', {}) for k in owner.__mro__) or name in getattr(
      owner, '__dataclass_fields__', {}
    )
  return False


def _resolve(parts: list[str]) -> bool:
  """Whether `a.b.c` is there: the longest module prefix imported, the rest its attributes."""
  for cut in range(len(parts), 0, -1):
    owner = _import('.'.join(parts[:cut]))
    if owner is None:
      continue
    for name in parts[cut:]:
      if not _has(owner, name):
        return False
      owner = getattr(owner, name, owner)  # an annotation-only member: nothing further to check
    return True
  return False


def _candidates(dotted: str):
  """Each absolute name a dotted span may mean."""
  first, _, rest = dotted.partition('.')
  for cls in (first,) if first in CLASSES else INSTANCES.get(first, ()):
    for module in CLASSES[cls]:
      yield f'{module}.{cls}' + (f'.{rest}' if rest else '')
  if first == 'ouroboros_jax':
    yield dotted
  elif first in MODULES:
    for prefix in PREFIXES:
      yield f'{prefix}.{dotted}'


def _file_exists(path: str) -> bool:
  """`schedules/stash.py`, `staging.py`: in the package, one of its sub-packages or the repo."""
  return any(
    (base / path).exists() for base in (PACKAGE, *(PACKAGE / s for s in SUBPACKAGES), ROOT)
  )


def references():
  """(where, span, what it names) of every span that names a path of this package."""
  for where, span in (*_markdown_spans(), *_docstring_spans(), *_comment_spans()):
    match = PATH.fullmatch(span.strip())
    if not match:
      continue
    path = match.group(1)
    head, _, suffix = path.rpartition('.')
    if suffix in FILE_SUFFIXES:
      # a file: checked if it sits in the package (`schedules/stash.py`, `staging.py`)
      if suffix == 'py' and head.replace('/', '.').split('.')[0] in MODULES:
        yield where, span, path
      continue
    dotted = path.replace('/', '.')
    if _ours(dotted):
      yield where, span, dotted


def test_every_code_path_named_in_the_docs_exists():
  checked, missing = 0, []
  for where, span, named in references():
    checked += 1
    if named.endswith('.py'):
      ok = _file_exists(named)
    else:
      ok = any(_resolve(c.split('.')) for c in _candidates(named))
    if not ok:
      missing.append(f'{where}: `{span}`')
  assert checked >= 100, f'only {checked} code paths found: is the span pattern still right?'
  assert not missing, 'code paths named in the docs that do not exist:\n' + '\n'.join(missing)
