"""Settings of the host process that make XLA:CPU runs fast; they change nothing on GPU or TPU.

Call `configure_cpu_runtime()` first thing in a script, before JAX initialises its backend. The
`ouroboros` command, the launcher's children, the tests and the experiments do.

Two things, both measured on the 2-process benchmark (d_model 1024, 4 layers, batch 8 x 128):

* XLA flags (`CPU_XLA_FLAGS`): region-based copy insertion. By default XLA:CPU copies a donated
  buffer that one step both reads and updates in place (Ouroboros' stash ring: read one slot,
  write another), i.e. every stash buffer twice per step; the region analysis proves the in-place
  update safe (GPU and TPU analyse it that way).
* The allocator (`keep_freed_memory`). XLA:CPU allocates a step's scratch memory (1.8 GB for a
  pipelined Ouroboros step at that size) with `malloc` on a worker thread, and glibc serves and
  frees any block that large with a fresh `mmap`/`munmap`, so every step page-faults its whole
  scratch memory in again (the kernel zeroes each page first). That cost 70 s of system time in
  a 3-minute benchmark and slowed the pipelined step from 2.4 s to 3.1 s, because two processes
  faulting at once also compete for memory bandwidth. Keeping freed memory in the process (as
  tcmalloc or jemalloc would) removes it.

Both apply only where they can help and cannot hurt: when the CPU backend is the one JAX will use
(`cpu_backend_expected`, decided without starting a backend: `JAX_PLATFORMS`, else no accelerator
plugin installed), and each XLA flag only if the installed XLA knows its name
(`supported_cpu_xla_flags`): XLA aborts at start-up on an unknown flag, so a jaxlib that renamed
or dropped one would otherwise stop every command. A skipped flag is said in one warning line.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
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
_ACCELERATOR_MODULES = ('jax_plugins', 'jax_cuda12_plugin', 'jax_cuda13_plugin',
                        'jax_rocm60_plugin', 'jax_rocm7_plugin', 'libtpu')


def cpu_backend_expected() -> bool:
  """Whether JAX will run on its CPU backend, decided without initialising one.

  `JAX_PLATFORMS` (or `JAX_PLATFORM_NAME`) names the backend when set (its first entry wins);
  otherwise JAX uses an accelerator whenever a PJRT plugin for one is installed.
  """
  platforms = os.environ.get('JAX_PLATFORMS') or os.environ.get('JAX_PLATFORM_NAME') or ''
  if platforms.strip():
    return platforms.split(',')[0].strip().lower() == 'cpu'
  try:
    if list(importlib.metadata.entry_points(group='jax_plugins')):
      return False
  except Exception:  # pylint: disable=broad-exception-caught  (a broken install: look below)
    pass
  return not any(importlib.util.find_spec(name) is not None for name in _ACCELERATOR_MODULES)


def _xla_libraries() -> list[pathlib.Path]:
  """jaxlib's shared libraries, the largest (XLA itself: libjax_common.so today) first."""
  spec = importlib.util.find_spec('jaxlib')
  if spec is None or not spec.submodule_search_locations:
    return []
  libraries = [p for root in spec.submodule_search_locations
               for p in pathlib.Path(root).rglob('*.so*') if p.is_file()]
  return sorted(libraries, key=lambda p: p.stat().st_size, reverse=True)


@functools.cache
def xla_knows_flag(name: str) -> bool:
  """Whether the installed XLA defines the flag `name` (without its leading dashes): its name is
  then a string in one of jaxlib's libraries. False where none can be read."""
  needle = name.lstrip('-').encode()
  for library in _xla_libraries():
    try:
      with open(library, 'rb') as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        if data.find(needle) != -1:
          return True
    except (OSError, ValueError):
      continue
  return False


def supported_cpu_xla_flags() -> tuple[str, ...]:
  """The flags of CPU_XLA_FLAGS this XLA knows; one warning line for each it does not."""
  supported = []
  for flag in CPU_XLA_FLAGS:
    if xla_knows_flag(flag.split('=')[0]):
      supported.append(flag)
    else:
      print(f'warning: this XLA does not know {flag.split("=")[0]}; skipped that speed setting '
            '(results are unchanged).', file=sys.stderr)
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
  Returns False, and does nothing, where the C
  library is not glibc (macOS, musl), which have their own allocators.
  """
  if not sys.platform.startswith('linux'):
    return False
  try:
    libc = ctypes.CDLL(ctypes.util.find_library('c') or 'libc.so.6')
    libc.gnu_get_libc_version  # noqa: B018  (raises AttributeError outside glibc)
  except (OSError, AttributeError):
    return False
  return all(libc.mallopt(param, value) == 1 for param, value in (
      (_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, -1)))


def configure_cpu_runtime() -> bool:
  """Both of the above when the CPU backend will be used; call before JAX initialises its
  backend (a speed setting only). Returns whether it applied them."""
  if not cpu_backend_expected():
    return False
  use_cpu_xla_flags()
  keep_freed_memory()
  return True
