"""The package's face and its layers: what moved still imports (with a DeprecationWarning that
names the new path), nothing imports an old path or upward."""

from __future__ import annotations

import ast
import importlib
import pathlib
import subprocess
import sys

import pytest

import ouroboros_jax
from ouroboros_jax import moved

PACKAGE = pathlib.Path(ouroboros_jax.__file__).resolve().parent

# The layer of each top-level module or sub-package (docs/architecture.md): a module may import
# from its own layer and the ones below, never from above.
LAYERS = {
  'errors': 0,
  'choices': 0,
  'moved': 0,  # the old module paths, for one release
  # the step interface, the update, the mesh, the stage layout and the cost model
  'staged': 1,
  'update': 1,
  'optimizers': 1,
  'placement': 1,
  'staging': 1,
  'layer_shards': 1,
  'costs': 1,
  'runtime': 1,
  'data': 1,  # data loading: the corpora, batches, windows and segments
  # the built-in models (model, txl, attention, cross_entropy, partition): clients of the step
  # interface, as the schedules are; neither imports the other
  'models': 2,
  'schedules': 2,
  'accelerators': 3,
  'perf': 4,
  'training': 4,
  'cli': 5,  # main and the commands
  'cli_parsers': 5,  # the cli's parsers and the config its flags make
  'cli_messages': 5,  # the cli's lines for a failure or a stop
  'flag_help': 5,  # the cli's help lines: it reads the config, the presets and the choices
  '__main__': 5,
  '__init__': 5,
}


def _part(module: str) -> str:
  """'ouroboros_jax.schedules.ring' -> 'schedules'."""
  return module.split('.')[1] if module.count('.') else '__init__'


def _imports(path: pathlib.Path) -> set[str]:
  tree = ast.parse(path.read_text())
  found = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith('ouroboros_jax'):
      found |= (
        {f'{node.module}.{a.name}' for a in node.names}
        if node.module == 'ouroboros_jax'
        else {node.module}
      )
    elif isinstance(node, ast.Import):
      found |= {a.name for a in node.names if a.name.startswith('ouroboros_jax.')}
  return found


def test_no_module_imports_from_a_layer_above_its_own():
  upward = []
  for path in sorted(PACKAGE.rglob('*.py')):
    relative = path.relative_to(PACKAGE).with_suffix('')
    own = relative.parts[0]
    if own not in LAYERS:
      pytest.fail(f'{relative} is in no layer; add it to LAYERS and docs/architecture.md')
    for module in _imports(path):
      other = _part(module)
      if own != '__init__' and LAYERS[other] > LAYERS[own]:
        upward.append(f'{relative} imports {module}')
  assert not upward, upward


def test_the_models_and_the_schedules_meet_only_at_the_step_interface():
  """A schedule runs any `StagedModel`, a built-in model is one: neither imports the other."""
  across = [
    f'{path.relative_to(PACKAGE)} imports {module}'
    for own, other in (('models', 'schedules'), ('schedules', 'models'))
    for path in sorted((PACKAGE / own).rglob('*.py'))
    for module in _imports(path)
    if _part(module) == other
  ]
  assert not across, across


def _module_graph() -> dict[str, set[str]]:
  """Each module of the package (dotted, without 'ouroboros_jax.') -> the modules it imports,
  lazy imports inside functions included. `from ouroboros_jax.schedules import ring` is an edge
  to schedules.ring, not to the schedules package."""
  modules = {}
  for path in sorted(PACKAGE.rglob('*.py')):
    parts = path.relative_to(PACKAGE).with_suffix('').parts
    modules['.'.join(parts[:-1] if parts[-1] == '__init__' else parts)] = path

  def resolve(name: str) -> str | None:
    dotted = name.removeprefix('ouroboros_jax').lstrip('.')
    while dotted and dotted not in modules:  # a name imported from a module: the module
      dotted = dotted.rpartition('.')[0]
    return dotted or None  # None: the package's own __init__

  def imported(path):  # every dotted name an import statement may mean, module or attribute
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.ImportFrom) and (node.module or '').startswith('ouroboros_jax'):
        yield from (f'{node.module}.{a.name}' for a in node.names)
      elif isinstance(node, ast.Import):
        yield from (a.name for a in node.names if a.name.startswith('ouroboros_jax.'))

  graph = {}
  for name, path in modules.items():
    if not name:  # the package's __init__ imports everything it re-exports
      continue
    graph[name] = {m for m in map(resolve, imported(path)) if m and m != name}
  return graph


def test_no_import_cycle_even_inside_a_layer():
  graph = _module_graph()
  assert {'models.model', 'models.txl', 'schedules.ring'} <= set(graph) and graph['models.txl']
  done, path = set(), []

  def visit(module):
    if module in path:
      cycle = path[path.index(module) :] + [module]
      pytest.fail('import cycle: ' + ' -> '.join(cycle))
    if module in done:
      return
    path.append(module)
    for other in sorted(graph.get(module, ())):
      visit(other)
    path.pop()
    done.add(module)

  for module in sorted(graph):
    visit(module)


def _forget(old: str) -> None:
  """Undo an earlier import of the old path, so that importing it again runs the finder."""
  sys.modules.pop(old, None)
  parent, _, name = old.rpartition('.')
  sys.modules[parent].__dict__.pop(name, None)


@pytest.mark.parametrize('old, new', sorted(moved.MOVED.items()))
def test_an_old_module_path_warns_with_the_new_one_and_gives_the_same_module(old, new):
  module = importlib.import_module(new)
  parent, _, name = old.rpartition('.')
  _forget(old)
  with pytest.warns(DeprecationWarning, match=f'{old} is deprecated .* use {new}$') as caught:
    assert importlib.import_module(old) is module  # `import ouroboros_jax.presets`
  assert moved.REMOVED_IN in str(caught[0].message)
  _forget(old)
  with pytest.warns(DeprecationWarning, match=f'use {new}$'):
    assert getattr(importlib.import_module(parent), name) is module  # `from ... import presets`
  _forget(old)


def test_the_old_paths_go_in_the_release_the_warning_names():
  """Once pyproject.toml reaches moved.REMOVED_IN, moved.MOVED's paths and the finder go."""
  import re

  pyproject = (PACKAGE.parent / 'pyproject.toml').read_text()
  version = re.search(r'^version = "([^"]+)"', pyproject, re.M).group(1)
  number = lambda v: tuple(int(part) for part in v.split('.')[:2])
  assert number(version) < number(moved.REMOVED_IN), (
    f'version {version}: remove the old module paths (moved.MOVED) deprecated until '
    f'{moved.REMOVED_IN}, and say so in CHANGELOG.md'
  )


def test_the_documented_imports_of_the_flat_layout_still_work():
  with pytest.warns(DeprecationWarning) as caught:
    from ouroboros_jax import presets, train  # the README of the flat layout
  new = {str(w.message).rpartition(' ')[2] for w in caught}
  assert new == {'ouroboros_jax.training.presets', 'ouroboros_jax.training.loop'}

  cfg = presets.override(presets.get_preset('tiny'), {'stages': 2, 'schedule': 'ouroboros'})
  assert callable(train.train) and cfg.schedule.num_stages == 2
  assert ouroboros_jax.TrainConfig is presets.TrainConfig
  with pytest.raises(AttributeError, match='no attribute'):
    ouroboros_jax.not_a_module  # noqa: B018


def test_nothing_of_the_package_imports_an_old_path():
  """No import statement (lazy ones inside functions included) names a moved module, and
  importing the package and its command warns of nothing of ours."""
  old = []
  for path in sorted(PACKAGE.rglob('*.py')):
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.ImportFrom) and node.module:
        names = {node.module, *(f'{node.module}.{a.name}' for a in node.names)}
      elif isinstance(node, ast.Import):
        names = {a.name for a in node.names}
      else:
        continue
      old += [f'{path.relative_to(PACKAGE)} imports {n}' for n in sorted(names & set(moved.MOVED))]
  assert not old, old
  code = (
    'import warnings\n'
    'warnings.filterwarnings("error", "ouroboros_jax", DeprecationWarning)\n'
    'import ouroboros_jax, ouroboros_jax.cli, ouroboros_jax.training.loop\n'
  )
  done = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True)
  assert done.returncode == 0, done.stderr[-2000:]


def test_a_config_written_before_the_schedule_was_nested_still_reads():
  """config.json and checkpoint metadata of older runs hold the schedule settings flat."""
  from ouroboros_jax.training import config, field_flags, presets

  cfg = field_flags.override(
    presets.get_preset('tiny'),
    {
      'schedule': 'ouroboros',
      'stages': 2,
      'stash': 'replay',
      'clip_norm': 0.5,
      'microbatches': 2,
      'data_parallel': 1,
      'forward': 'pipelined',
    },
  )
  flat = cfg.to_dict()
  schedule = flat.pop('schedule')
  flat.update(
    {
      'schedule': schedule['name'],
      'stages': schedule['num_stages'],
      # fsdp and shard_update came after the nesting: no flat config holds them
      **{
        k: v for k, v in schedule.items() if k not in ('name', 'num_stages', 'fsdp', 'shard_update')
      },
    }
  )
  assert config.TrainConfig.from_dict(flat) == cfg
  assert config.TrainConfig.from_dict(cfg.to_dict()) == cfg
  assert 'seed' not in cfg.to_dict()['schedule']  # TrainConfig's --seed gives it


# What a machine that only compiles, plans or times may lack (the device image: docs/device.md).
DATA_STACK = ('grain', 'tensorflow_datasets', 'array_record', 'tensorboardX')
_BLOCK_DATA_STACK = f"""
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
  def find_spec(self, name, path, target=None):
    if name.partition('.')[0] in {DATA_STACK!r}:
      raise ImportError('the data stack is not installed here: ' + name)
sys.meta_path.insert(0, Block())
"""


def test_bench_compile_and_plan_import_nothing_of_the_data_stack():
  """`ouroboros bench`, `compile` and `plan` run where Grain, TFDS, array_record and
  tensorboardX are missing; the training loop, which reads data, does need them."""
  import subprocess
  import sys

  modules = ('cli', 'perf.bench', 'perf.compile', 'perf.plan', 'perf.simulate', 'training.assemble')
  check = _BLOCK_DATA_STACK + ''.join(f'import ouroboros_jax.{m}\n' for m in modules)
  run = lambda code: subprocess.run([sys.executable, '-c', code], capture_output=True, text=True)
  done = run(
    check + 'print(sorted(m for m in sys.modules if m.partition(".")[0] in ' + f'{DATA_STACK!r}))'
  )
  assert done.returncode == 0 and done.stdout.strip() == '[]', done.stderr[-2000:]
  loop = run(_BLOCK_DATA_STACK + 'import ouroboros_jax.training.loop')
  assert loop.returncode != 0 and 'the data stack is not installed here' in loop.stderr
