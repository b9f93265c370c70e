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
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

CPU_XLA_FLAGS = ('--xla_cpu_copy_insertion_use_region_analysis=true',)

# glibc's mallopt() parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8


def use_cpu_xla_flags() -> None:
  """Adds CPU_XLA_FLAGS to $XLA_FLAGS (a flag the user set wins); takes effect only before JAX
  initialises its backend."""
  flags = os.environ.get('XLA_FLAGS', '').split()
  names = {f.split('=')[0] for f in flags}
  flags += [f for f in CPU_XLA_FLAGS if f.split('=')[0] not in names]
  os.environ['XLA_FLAGS'] = ' '.join(flags)


def keep_freed_memory() -> bool:
  """Tells glibc's malloc to keep freed memory for reuse instead of returning it to the kernel.

  One arena (a worker thread's arena hands any block over 64 MiB to mmap, whatever the limits
  say), no mmap for large blocks, and no trimming of the heap's free top (mallopt takes an int;
  glibc reads -1 as the largest size_t). The process's resident memory then stays at its peak. Returns False, and does nothing, where the C
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


def configure_cpu_runtime() -> None:
  """Both of the above; call before JAX initialises its backend (a speed setting only)."""
  use_cpu_xla_flags()
  keep_freed_memory()
