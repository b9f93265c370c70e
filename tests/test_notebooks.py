"""Every notebook in colab/ is stored clean and runs top to bottom (in smoke mode).

Each notebook is executed with nbclient in a fresh `python3` kernel (the interpreter running the
tests), in a temporary directory so nothing is written into the repository, with
OUROBOROS_NOTEBOOK_SMOKE=1 so that its parameter cell shrinks the step counts to a few. A cell
that raises fails the test, with the cell's traceback. New notebooks are picked up by the glob.
"""

from __future__ import annotations

import os
import pathlib
import sys

import pytest

nbformat = pytest.importorskip('nbformat')
nbclient = pytest.importorskip('nbclient')

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((REPO_ROOT / 'colab').glob('*.ipynb'))
REPO_URL = 'https://github.com/ouroboros-jax/ouroboros_jax'
CELL_TIMEOUT_S = 300
SMOKE_ENV = 'OUROBOROS_NOTEBOOK_SMOKE'


def read(path: pathlib.Path):
  return nbformat.read(path, as_version=4)


def code_cells(nb):
  return [c for c in nb.cells if c.cell_type == 'code']


def test_there_are_notebooks():
  names = {p.name for p in NOTEBOOKS}
  assert {
    '01_quickstart.ipynb',
    '02_how_ouroboros_works.ipynb',
    '03_bring_your_own_model.ipynb',
  } <= names


@pytest.mark.parametrize('path', NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_stored_clean_and_starts_right(path):
  nb = read(path)
  nbformat.validate(nb)
  assert nb.metadata.get('kernelspec', {}).get('name') == 'python3'
  for cell in code_cells(nb):
    assert not cell.get('outputs') and cell.get('execution_count') is None, (
      f'{path.name} is stored with outputs; clear them before committing'
    )
  first = nb.cells[0]
  badge = (
    f'https://colab.research.google.com/github/ouroboros-jax/ouroboros_jax/blob/main/'
    f'colab/{path.name}'
  )
  assert first.cell_type == 'markdown' and badge in first.source, (
    f'{path.name} must start with its "Open in Colab" badge'
  )
  install, setup = code_cells(nb)[:2]
  assert "'google.colab' in sys.modules" in install.source and REPO_URL in install.source, (
    f'{path.name}: the first code cell must install the package on Colab only'
  )
  assert 'pip' in install.source and 'install' in install.source
  # A notebook that simulates devices does so in the next code cell, before JAX touches one.
  if any('jax_num_cpu_devices' in c.source for c in code_cells(nb)):
    assert 'jax_num_cpu_devices' in setup.source, (
      f'{path.name}: set up the (simulated) devices in the code cell after the install cell'
    )
  assert SMOKE_ENV in '\n'.join(c.source for c in code_cells(nb)), (
    f'{path.name} must shrink its settings when ${SMOKE_ENV} is set, to keep CI fast'
  )


@pytest.mark.parametrize('path', NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path, tmp_path, monkeypatch, prepared_data_dir):
  # The kernel inherits this environment: smoke mode, the prepared corpus (from the fixture,
  # already in $OUROBOROS_DATA_DIR), this checkout first on the path, and of the test suite's
  # XLA_FLAGS only its compile-speed settings (the notebook sets its own devices, as it does for
  # a user).
  monkeypatch.setenv(SMOKE_ENV, '1')
  monkeypatch.setenv(
    'PYTHONPATH',
    os.pathsep.join(
      [str(REPO_ROOT)] + [p for p in os.environ.get('PYTHONPATH', '').split(os.pathsep) if p]
    ),
  )
  compile_speed_flags = [
    f
    for f in os.environ.get('XLA_FLAGS', '').split()
    if not f.startswith('--xla_force_host_platform_device_count')
  ]
  monkeypatch.setenv('XLA_FLAGS', ' '.join(compile_speed_flags))
  nb = read(path)
  # One extra cell at the end says which interpreter the kernel ran: this one (ipykernel's
  # `python3` kernelspec resolves to the interpreter that starts it).
  nb.cells.append(nbformat.v4.new_code_cell('import sys; print(sys.executable)'))
  client = nbclient.NotebookClient(
    nb,
    timeout=CELL_TIMEOUT_S,
    kernel_name='python3',
    resources={'metadata': {'path': str(tmp_path)}},
  )
  client.execute()  # raises CellExecutionError (with the cell's traceback) when a cell fails
  executable = nb.cells[-1].outputs[0]['text'].strip()
  assert pathlib.Path(executable).resolve() == pathlib.Path(sys.executable).resolve()
