"""Test setup shared by every test file.

* 8 simulated CPU devices, so multi-stage / data-parallel schedules run on a CPU-only machine.
  This must happen before JAX initialises its backend, hence at import time, here.
* A session-wide data directory: the default corpus is prepared once into a temporary directory
  (never ~/.cache), and $OUROBOROS_DATA_DIR points there so subprocesses use it too.
"""

from __future__ import annotations

import os
import pathlib

NUM_CPU_DEVICES = 8
# The suite is written for simulated CPU devices: on an accelerator machine it still runs on the
# CPU unless OUROBOROS_TEST_PLATFORMS names another platform (e.g. cuda, for the checks that
# run on one device).
os.environ['JAX_PLATFORMS'] = os.environ.get('OUROBOROS_TEST_PLATFORMS', 'cpu')
from ouroboros_jax.runtime import host  # noqa: E402  (initialises no JAX backend)

# The tests compile hundreds of tiny programs and run each a few steps, so compiling dominates and
# these XLA:CPU settings trade run time for compile time (every test passes either way):
# * backend optimisation level 0 (test_schedules.py and test_ouroboros.py: 304 s -> 187 s);
# * the classic loop emitters for fusions instead of the newer fusion emitters, and code generated
#   as one module rather than split for parallel compilation (on 2 busy cores there is no spare
#   core to use): backend compile time of the slow-reference tests 41.7 s -> 11.5 s. Only the
#   tests use them: their run time is mixed (`ouroboros bench --preset tiny`: backprop's step
#   67.5 -> 85.1 ms, ZB-H1's 83.5 -> 80.9 ms).
# Each only where the installed XLA knows it: an unknown flag aborts XLA's start-up.
_FAST_COMPILE_FLAGS = (
  '--xla_backend_optimization_level=0',
  '--xla_cpu_use_fusion_emitters=false',
  '--xla_cpu_parallel_codegen_split_count=1',
)
os.environ.setdefault(
  'XLA_FLAGS',
  ' '.join(
    (
      f'--xla_force_host_platform_device_count={NUM_CPU_DEVICES}',
      *(f for f in _FAST_COMPILE_FLAGS if host.xla_knows_flag(f.split('=')[0])),
    )
  ),
)
host.configure_cpu_runtime()

import jax  # noqa: E402  (after XLA_FLAGS on purpose)
import pytest  # noqa: E402

jax.config.update('jax_num_cpu_devices', NUM_CPU_DEVICES)
# Many tests compile the same tiny programs (the reference's pieces, backprop, the optimizer, the
# CLI's train step): a compilation cache shared by the test workers and, through the environment,
# by the processes the tests start turns the repeats into cache hits. Even the smallest programs
# are worth caching: min time 0 made test_ouroboros.py 139 s -> 122 s on 2 cores.
_CACHE = os.path.abspath(
  os.environ.get(
    'OUROBOROS_TEST_COMPILE_CACHE',
    os.path.join(os.path.dirname(__file__), '..', '.pytest_cache', 'xla'),
  )
)
os.environ['JAX_COMPILATION_CACHE_DIR'] = _CACHE
os.environ['JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS'] = '0'
os.environ['JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES'] = '0'
jax.config.update('jax_compilation_cache_dir', _CACHE)
jax.config.update('jax_persistent_cache_min_compile_time_secs', 0)
jax.config.update('jax_persistent_cache_min_entry_size_bytes', 0)


REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope='session')
def prepared_data_dir(tmp_path_factory) -> str:
  """A prepared copy of the default corpus; also exported as $OUROBOROS_DATA_DIR."""
  from ouroboros_jax import data

  path = tmp_path_factory.mktemp('tfds')
  data.prepare_default_corpus(path)
  old = os.environ.get(data.DEFAULT_DATA_DIR_ENV)
  os.environ[data.DEFAULT_DATA_DIR_ENV] = os.fspath(path)
  yield os.fspath(path)
  if old is None:
    os.environ.pop(data.DEFAULT_DATA_DIR_ENV, None)
  else:
    os.environ[data.DEFAULT_DATA_DIR_ENV] = old


@pytest.fixture(scope='session')
def text_corpus(tmp_path_factory) -> str:
  """A 300 KB slice of the embedded Shakespeare as a plain text file (fast to load)."""
  from ouroboros_jax import data

  path = tmp_path_factory.mktemp('text') / 'shakespeare-300k.txt'
  path.write_bytes(data.read_text_file(data.DEFAULT_CORPUS_PATH)[:300_000])
  return os.fspath(path)
