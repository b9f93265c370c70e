"""Settings of the host process that make XLA:CPU runs fast; they change nothing on GPU or TPU.

Call `configure_cpu_runtime()` first thing in a script, before JAX initialises its backend. The
`ouroboros` command, the launcher's children, the tests and the experiments do.

Two things, both measured on the 2-process benchmark (d_model 1024, 4 layers, batch 8 x 128):

* XLA flags (`CPU_XLA_FLAGS`): region-based copy insertion. By default XLA:CPU copies a donated
  buffer that one step both reads and updates in place (Ouroboros' stash ring: read one slot,
  write another), i.e. every stash buffer twice per step; the region analysis proves the in-place
  update safe (GPU and TPU analyse it that way).
* The allocator (`keep_freed_memory`). XLA:CPU allocates a step's scratch memory (gigabytes for a
  pipelined Ouroboros step at that size) with `malloc` on a worker thread, and glibc serves and
  frees any block that large with a fresh `mmap`/`munmap`, so every step page-faults its whole
  scratch memory in again (the kernel zeroes each page first). What that cost, measured:
  docs/results/README.md#s-heap-trim (two processes faulting at once also compete for memory
  bandwidth). Keeping freed memory in the process (as
  tcmalloc or jemalloc would) removes it.

Both apply only where they can help and cannot hurt: when the CPU backend is the one JAX will use
(`cpu_backend_expected`, decided without starting a backend: `jax_platforms` / `JAX_PLATFORMS`
when set, else no accelerator plugin installed), and each XLA flag only if the installed XLA
defines it (`supported_cpu_xla_flags`: its name is a string in jaxlib's libjax_common.so): XLA
aborts at start-up on an unknown flag, so a jaxlib that renamed or dropped one would otherwise stop
every command. A skipped flag is said in one warning line per process.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import glob
import importlib.metadata
import importlib.util
import mmap
import os
import pathlib
import sys

CPU_XLA_FLAGS = ('--xla_cpu_copy_insertion_use_region_analysis=true',)

# glibc's mallopt() parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8


# Accelerator PJRT plugins and runtimes JAX would pick over the CPU when they are installed.
_ACCELERATOR_MODULES = (
  'jax_plugins',
  'jax_cuda12_plugin',
  'jax_cuda13_plugin',
  'jax_rocm60_plugin',
  'jax_rocm7_plugin',
)
# Subpackages of a jaxlib built with CUDA or ROCm inside (before the PJRT plugins).
_LEGACY_GPU_JAXLIB_DIRS = ('cuda', 'rocm')


def _requested_platforms() -> str:
  """The platforms asked for: jax.config's value once jax is imported (it read $JAX_PLATFORMS
  then, and a later change of the variable no longer counts), else the environment."""
  jax = sys.modules.get('jax')
  platforms = getattr(getattr(jax, 'config', None), 'jax_platforms', None)
  if platforms:
    return platforms
  return os.environ.get('JAX_PLATFORMS') or os.environ.get('JAX_PLATFORM_NAME') or ''


def _accelerator_installed() -> bool:
  """Whether an accelerator backend is installed, found without importing it (JAX's own plugin
  discovery: the `jax_plugins` namespace package and entry-point group, old GPU jaxlibs)."""
  try:
    if list(importlib.metadata.entry_points(group='jax_plugins')):
      return True
  except Exception:  # pylint: disable=broad-exception-caught  (a broken install: look below)
    pass
  if any(importlib.util.find_spec(name) is not None for name in _ACCELERATOR_MODULES):
    return True
  if importlib.util.find_spec('libtpu') is not None and tpu_chips_visible():
    return True
  return any(
    (pathlib.Path(root) / name).is_dir()
    for root in _jaxlib_dirs()
    for name in _LEGACY_GPU_JAXLIB_DIRS
  )


def tpu_chips_visible() -> bool:
  """Whether this machine has TPU chips (their device files), so an installed libtpu (the `tpu`
  extra, also used to compile for a TPU topology on a CPU machine) will find one."""
  vfio = pathlib.Path('/dev/vfio')
  return bool(glob.glob('/dev/accel*')) or (
    vfio.is_dir() and any(p.name.isdigit() for p in vfio.iterdir())
  )


def libtpu_without_chips() -> bool:
  """libtpu is installed on a machine without TPU chips: JAX would still try it first, and fail
  with pages of warnings, before falling back to the CPU."""
  return importlib.util.find_spec('libtpu') is not None and not tpu_chips_visible()


def cpu_backend_expected() -> bool:
  """Whether JAX will run on its CPU backend, decided without initialising a backend.

  The first of the platforms asked for (`jax.config.jax_platforms`, `JAX_PLATFORMS`,
  `JAX_PLATFORM_NAME`) when set; otherwise the CPU only if no accelerator plugin is installed,
  since JAX prefers any accelerator it finds.
  """
  platforms = _requested_platforms()
  if platforms.strip():
    return platforms.split(',')[0].strip().lower() == 'cpu'
  return not _accelerator_installed()


def _jaxlib_dirs() -> list[str]:
  """jaxlib's package directories, found without importing it."""
  spec = importlib.util.find_spec('jaxlib')
  return list(spec.submodule_search_locations or []) if spec is not None else []


def _xla_libraries() -> list[pathlib.Path]:
  """jaxlib's shared libraries, the largest (XLA itself: libjax_common.so today) first."""
  libraries = [
    p for root in _jaxlib_dirs() for p in pathlib.Path(root).rglob('*.so*') if p.is_file()
  ]
  return sorted(libraries, key=lambda p: p.stat().st_size, reverse=True)


@functools.cache
def xla_knows_flag(name: str) -> bool:
  """Whether the installed XLA (jaxlib's, which runs the CPU backend) defines the flag `name`.

  XLA's flag table holds each name as a C string, so `name` between two NUL bytes marks a flag;
  a DebugOptions proto field or a setter's symbol does not (they can outlive a dropped flag).
  False where no library can be read: skipping a speed setting is the safe side. About 10 ms
  for a known flag (found 20 MB into the 350 MB library), 0.3 s to rule one out; cached.
  """
  needle = b'\0' + name.lstrip('-').encode() + b'\0'
  for library in _xla_libraries():
    try:
      with open(library, 'rb') as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        if data.find(needle) != -1:
          return True
    except (OSError, ValueError):
      continue
  return False


def supported_cpu_xla_flags() -> tuple[str, ...]:
  """The flags of CPU_XLA_FLAGS the installed XLA knows, for $XLA_FLAGS; one warning line on
  stderr per process for each it does not (an unknown flag would abort XLA's start-up)."""
  return _supported_xla_flags(tuple(CPU_XLA_FLAGS))


@functools.cache
def _supported_xla_flags(flags: tuple[str, ...]) -> tuple[str, ...]:
  supported = []
  for flag in flags:
    name = flag.split('=')[0]
    if xla_knows_flag(name):
      supported.append(flag)
    else:
      print(
        f'warning: this XLA does not know {name}; skipped that speed setting '
        '(results are unchanged).',
        file=sys.stderr,
      )
  return tuple(supported)


def use_cpu_xla_flags() -> None:
  """Adds the supported CPU_XLA_FLAGS to $XLA_FLAGS (a flag the user set wins); takes effect
  only before JAX initialises its backend."""
  flags = os.environ.get('XLA_FLAGS', '').split()
  names = {f.split('=')[0] for f in flags}
  wanted = [f for f in CPU_XLA_FLAGS if f.split('=')[0] not in names]
  if wanted:
    supported = supported_cpu_xla_flags()
    flags += [f for f in wanted if f in supported]
  os.environ['XLA_FLAGS'] = ' '.join(flags)


def keep_freed_memory() -> bool:
  """Tells glibc's malloc to keep freed memory for reuse instead of returning it to the kernel.

  One arena (a worker thread's arena hands any block over 64 MiB to mmap, whatever the limits
  say), no mmap for large blocks, and no trimming of the heap's free top (mallopt takes an int;
  glibc reads -1 as the largest size_t). The process's resident memory then stays at its peak.
  Returns False, and does nothing, where the C library is not glibc (macOS, musl), which have
  their own allocators.
  """
  libc = _glibc()
  if libc is None:
    return False
  return all(
    libc.mallopt(param, value) == 1
    for param, value in ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, -1))
  )


def release_freed_memory() -> bool:
  """Hands the pages of the memory the process has freed back to the kernel (glibc's
  `malloc_trim`), which `keep_freed_memory` otherwise keeps: for a program that interleaves
  short-lived work of many sizes with long-lived state, as the benchmark's rounds do (its heap,
  one arena never trimmed, grew ~1.5 GiB a round on process 0 until a 24 GiB machine ran out).
  The next step of any program then faults its scratch memory in again: run one untimed. Returns
  False, and does nothing, outside glibc."""
  libc = _glibc()
  if libc is None:
    return False
  libc.malloc_trim(0)
  return True


def _glibc():
  """glibc's C library, None where the C library is another (macOS, musl) or not Linux."""
  if not sys.platform.startswith('linux'):
    return None
  try:
    libc = ctypes.CDLL(ctypes.util.find_library('c') or 'libc.so.6')
    libc.gnu_get_libc_version  # noqa: B018  (raises AttributeError outside glibc)
  except (OSError, AttributeError):
    return None
  return libc


def configure_cpu_runtime() -> bool:
  """Both of the above when the CPU backend will be used; call before JAX initialises its
  backend (a speed setting only). Returns whether it applied them."""
  if not cpu_backend_expected():
    return False
  if not _requested_platforms().strip() and libtpu_without_chips():
    # libtpu serves deviceless compiles (`ouroboros compile`) only; child processes inherit this.
    os.environ['JAX_PLATFORMS'] = 'cpu'
    if 'jax' in sys.modules:
      sys.modules['jax'].config.update('jax_platforms', 'cpu')
  use_cpu_xla_flags()
  keep_freed_memory()
  return True
