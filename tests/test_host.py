"""The host settings apply only to the CPU backend, and only with flags the installed XLA knows.

Whatever sets $XLA_FLAGS or calls mallopt for real runs in a fresh process: it would otherwise
leak into this one (and every test after it).
"""

from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest

from ouroboros_jax.runtime import host

REGION = host.CPU_XLA_FLAGS[0].split('=')[0]

# Runs configure_cpu_runtime() in a fresh process, then mallocs 256 MiB: glibc serves a block that
# large with its own mmap unless keep_freed_memory() ran (mallinfo2's hblks counts those).
_CONFIGURE = """
import ctypes, os
from ouroboros_jax.runtime import host
fields = ('arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost').split()
class MallInfo2(ctypes.Structure):
  _fields_ = [(name, ctypes.c_size_t) for name in fields]
libc = ctypes.CDLL('libc.so.6')
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype = ctypes.c_void_p
applied = host.configure_cpu_runtime()
before = libc.mallinfo2().hblks
block = libc.malloc(256 << 20)
mmapped = libc.mallinfo2().hblks - before
libc.free(ctypes.c_void_p(block))
print(applied, mmapped, repr(os.environ.get('XLA_FLAGS', '')))
"""


def _has_mallinfo2() -> bool:
  import ctypes  # pylint: disable=import-outside-toplevel

  try:
    return hasattr(ctypes.CDLL('libc.so.6'), 'mallinfo2')
  except OSError:
    return False


def _configure_in_subprocess(platforms: str) -> list[str]:
  env = {**os.environ, 'JAX_PLATFORMS': platforms, 'XLA_FLAGS': '--xla_dump_to=/tmp/x'}
  return (
    subprocess.run(
      [sys.executable, '-c', _CONFIGURE],
      capture_output=True,
      text=True,
      env=env,
      timeout=120,
      check=True,
    )
    .stdout.strip()
    .split(maxsplit=2)
  )


@pytest.fixture
def platforms_from_env(monkeypatch):
  """The platforms come from the environment only: jax, imported by conftest, read its config
  from the environment before the test could set it."""
  monkeypatch.delitem(sys.modules, 'jax', raising=False)
  monkeypatch.delenv('JAX_PLATFORMS', raising=False)
  monkeypatch.delenv('JAX_PLATFORM_NAME', raising=False)
  return monkeypatch


@pytest.mark.parametrize(
  'platforms, expected', [('cuda', False), ('tpu,cpu', False), ('cpu', True), ('CPU,cuda', True)]
)
def test_the_backend_named_by_jax_platforms_decides(platforms_from_env, platforms, expected):
  platforms_from_env.setenv('JAX_PLATFORMS', platforms)
  assert host.cpu_backend_expected() is expected


def test_jax_config_wins_over_a_later_environment(platforms_from_env):
  platforms_from_env.setitem(
    sys.modules, 'jax', types.SimpleNamespace(config=types.SimpleNamespace(jax_platforms='cuda'))
  )
  platforms_from_env.setenv('JAX_PLATFORMS', 'cpu')
  assert host.cpu_backend_expected() is False


def test_with_no_platforms_named_an_installed_accelerator_plugin_means_not_cpu(platforms_from_env):
  monkeypatch = platforms_from_env
  monkeypatch.setattr(host, '_ACCELERATOR_MODULES', ())
  monkeypatch.setattr(host, '_LEGACY_GPU_JAXLIB_DIRS', ())
  monkeypatch.setattr(host.importlib.metadata, 'entry_points', lambda **kw: [])
  assert host.cpu_backend_expected() is True

  real = host.importlib.util.find_spec
  monkeypatch.setattr(host, '_ACCELERATOR_MODULES', ('jax_cuda12_plugin',))
  monkeypatch.setattr(
    host.importlib.util,
    'find_spec',
    lambda name, *a: object() if name == 'jax_cuda12_plugin' else real(name, *a),
  )
  assert host.cpu_backend_expected() is False


def test_with_no_platforms_a_plugin_entry_point_means_not_cpu(platforms_from_env):
  platforms_from_env.setattr(host, '_ACCELERATOR_MODULES', ())
  platforms_from_env.setattr(
    host.importlib.metadata,
    'entry_points',
    lambda **kw: ['xla_cuda12'] if kw.get('group') == 'jax_plugins' else [],
  )
  assert host.cpu_backend_expected() is False


def test_with_no_platforms_a_jaxlib_with_cuda_inside_means_not_cpu(platforms_from_env, tmp_path):
  monkeypatch = platforms_from_env
  monkeypatch.setattr(host, '_ACCELERATOR_MODULES', ())
  monkeypatch.setattr(host.importlib.metadata, 'entry_points', lambda **kw: [])
  monkeypatch.setattr(host, '_jaxlib_dirs', lambda: [str(tmp_path)])
  assert host.cpu_backend_expected() is True
  (tmp_path / 'cuda').mkdir()
  assert host.cpu_backend_expected() is False


@pytest.mark.skipif(not _has_mallinfo2(), reason='needs glibc >= 2.33 (mallinfo2)')
def test_on_an_accelerator_neither_flags_nor_allocator_change():
  assert _configure_in_subprocess('cuda') == ['False', '1', "'--xla_dump_to=/tmp/x'"]


@pytest.mark.skipif(not _has_mallinfo2(), reason='needs glibc >= 2.33 (mallinfo2)')
def test_on_the_cpu_the_flag_is_added_and_the_allocator_keeps_memory():
  assert _configure_in_subprocess('cpu') == [
    'True',
    '0',
    repr(f'--xla_dump_to=/tmp/x {host.CPU_XLA_FLAGS[0]}'),
  ]


def test_the_real_flag_is_known_to_the_installed_xla():
  assert host.xla_knows_flag(REGION)
  assert REGION in host.supported_cpu_xla_flags()[0]
  assert not host.xla_knows_flag('xla_cpu_no_such_flag_in_any_build')
  # A name that is only part of a flag's name is no flag.
  assert not host.xla_knows_flag(REGION[:-4])


def test_without_jaxlib_no_flag_is_known(monkeypatch):
  monkeypatch.setattr(host, '_jaxlib_dirs', lambda: [])
  assert not host.xla_knows_flag.__wrapped__(REGION)


def test_an_unknown_flag_is_skipped_with_one_warning(monkeypatch, capsys):
  monkeypatch.setattr(
    host, 'CPU_XLA_FLAGS', ('--xla_cpu_renamed_away_flag=true', *host.CPU_XLA_FLAGS)
  )
  monkeypatch.setenv('XLA_FLAGS', '')
  host._supported_xla_flags.cache_clear()  # pylint: disable=protected-access
  host.use_cpu_xla_flags()
  host.use_cpu_xla_flags()  # warned once per process, not once per call
  assert os.environ['XLA_FLAGS'].split() == list(host.CPU_XLA_FLAGS[1:])
  assert host.supported_cpu_xla_flags() == host.CPU_XLA_FLAGS[1:]
  warning = capsys.readouterr().err.strip().splitlines()
  assert warning == [
    'warning: this XLA does not know --xla_cpu_renamed_away_flag; skipped that '
    'speed setting (results are unchanged).'
  ]


def test_a_flag_the_user_set_wins(monkeypatch):
  monkeypatch.setenv('XLA_FLAGS', f'{REGION}=false')
  host.use_cpu_xla_flags()
  assert os.environ['XLA_FLAGS'] == f'{REGION}=false'


def test_libtpu_counts_as_an_accelerator_only_where_tpu_chips_are(platforms_from_env):
  """The `tpu` extra installs libtpu on CPU machines too, to compile for TPU topologies."""
  monkeypatch = platforms_from_env
  monkeypatch.setattr(host, '_ACCELERATOR_MODULES', ())
  monkeypatch.setattr(host, '_LEGACY_GPU_JAXLIB_DIRS', ())
  monkeypatch.setattr(host.importlib.metadata, 'entry_points', lambda **kw: [])
  real = host.importlib.util.find_spec
  monkeypatch.setattr(
    host.importlib.util,
    'find_spec',
    lambda name, *a: object() if name == 'libtpu' else real(name, *a),
  )
  monkeypatch.setattr(host, 'tpu_chips_visible', lambda: False)
  assert host.libtpu_without_chips() and host.cpu_backend_expected() is True
  monkeypatch.setattr(host, 'tpu_chips_visible', lambda: True)
  assert not host.libtpu_without_chips() and host.cpu_backend_expected() is False


# Keeps freed memory (configure_cpu_runtime), then frees 256 MiB it touched: the process's
# resident pages stay, until release_freed_memory() hands them back.
_RELEASE = """
import ctypes
from ouroboros_jax.runtime import host
def resident_mib():
  return int(open('/proc/self/statm').read().split()[1]) * 4096 / 2**20
libc = ctypes.CDLL('libc.so.6')
libc.malloc.restype = ctypes.c_void_p
host.configure_cpu_runtime()
small = libc.malloc(1 << 10)  # above the block: the heap's top cannot simply shrink
block = libc.malloc(256 << 20)
ctypes.memset(block, 1, 256 << 20)
libc.free(ctypes.c_void_p(block))
kept = resident_mib()
released = host.release_freed_memory()
print(released, kept - resident_mib())
"""


@pytest.mark.skipif(not sys.platform.startswith('linux'), reason='glibc malloc')
def test_freed_memory_kept_for_speed_goes_back_to_the_kernel_when_asked():
  env = {**os.environ, 'JAX_PLATFORMS': 'cpu'}
  out = subprocess.run(
    [sys.executable, '-c', _RELEASE], capture_output=True, text=True, env=env, timeout=120
  )
  assert out.returncode == 0, out.stderr[-2000:]
  released, returned_mib = out.stdout.split()
  assert released == 'True'
  assert float(returned_mib) > 200, out.stdout  # of the 256 MiB freed
