"""Streaming generation in `sample`: same bytes as the one-buffer algorithm, bounded memory, checks.

The models are tiny random-init ones (no checkpoint); `sample.load` is replaced where a function
would read a run.
"""

from __future__ import annotations

import functools
import io
import itertools
import math
import tracemalloc

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ouroboros_jax.models import model as transformer
from ouroboros_jax.models.model import ConfigError, ModelConfig
from ouroboros_jax.training import sample

# A large init_std gives peaked logits: greedy text varies (no fixed point) and has no near-ties.
CFG = ModelConfig(
  vocab_size=256, d_model=16, num_heads=2, num_layers=1, d_ff=32, seq_len=16, init_std=1.0
)
LONG_PROMPT = b'KING RICHARD III:\n'  # 18 bytes, longer than the 16-byte window


@pytest.fixture(scope='module')
def params():
  return transformer.init_params(CFG, jax.random.key(0))


@functools.partial(jax.jit, static_argnames=('cfg', 'prompt_len', 'length'))
def _reference_generate(
  cfg: ModelConfig, params, buffer_T, prompt_len: int, length: int, temperature, key
):
  """The pre-streaming `_generate`, verbatim: one fori_loop over a prompt+length buffer."""
  window = cfg.seq_len

  def next_token(i, buffer_T):
    pos = prompt_len + i  # index of the token being generated
    start = jnp.maximum(0, pos - window)
    window_1xL = jax.lax.dynamic_slice(buffer_T, (start,), (window,))[None]
    x_1xLxD = transformer.embed(cfg, params['embed'], window_1xL)
    x_1xLxD = transformer.layers(cfg, params['layers'], x_1xLxD)
    logits_V = transformer.logits(cfg, params['head'], params['embed'], x_1xLxD)[0, pos - 1 - start]
    logits_V = logits_V.astype(jnp.float32)
    greedy = jnp.argmax(logits_V)
    scaled = logits_V / jnp.maximum(temperature, 1e-6)
    sampled = jax.random.categorical(jax.random.fold_in(key, i), scaled)
    token = jnp.where(temperature > 0, sampled, greedy).astype(buffer_T.dtype)
    return buffer_T.at[pos].set(token)

  return jax.lax.fori_loop(0, length, next_token, buffer_T)


def reference(cfg, params, prompt: bytes, *, length, temperature, seed) -> bytes:
  """The pre-streaming `generate` (without its argument checks)."""
  prompt = prompt or b'\n'
  prompt_P = np.frombuffer(prompt, np.uint8).astype(np.int32)
  buffer_T = np.zeros(max(len(prompt_P) + length, cfg.seq_len), np.int32)
  buffer_T[: len(prompt_P)] = prompt_P
  out_T = _reference_generate(
    cfg,
    params,
    jnp.asarray(buffer_T),
    len(prompt_P),
    length,
    jnp.float32(temperature),
    jax.random.key(seed),
  )
  out_T = np.asarray(jax.device_get(out_T))
  return out_T[len(prompt_P) : len(prompt_P) + length].astype(np.uint8).tobytes()


@pytest.mark.parametrize('prompt', [b'', b'To be', LONG_PROMPT], ids=['empty', 'short', 'long'])
@pytest.mark.parametrize(
  'temperature,seed',
  [(0.0, 0), (0.8, 3), (1.7, 2**32 - 1)],
  ids=['greedy', 'sampled', 'hot-max-seed'],
)
def test_stream_equals_the_one_buffer_algorithm(params, prompt, temperature, seed):
  # 45 bytes: past the window (16) and not a multiple of the chunk (8); the window slides.
  want = reference(CFG, params, prompt, length=45, temperature=temperature, seed=seed)
  chunks = list(
    sample.stream_bytes(CFG, params, prompt, length=45, temperature=temperature, seed=seed, chunk=8)
  )
  assert [len(c) for c in chunks] == [8] * 5 + [5]
  assert b''.join(chunks) == want
  assert sample.generate(CFG, params, prompt, length=45, temperature=temperature, seed=seed) == want


def test_generate_across_default_chunks_equals_the_reference(params):
  length = sample.DEFAULT_CHUNK + 19
  want = reference(CFG, params, LONG_PROMPT, length=length, temperature=0.9, seed=7)
  assert sample.generate(CFG, params, LONG_PROMPT, length=length, temperature=0.9, seed=7) == want


def test_zero_length_yields_nothing(params):
  assert list(sample.stream_bytes(CFG, params, b'abc', length=0)) == []
  assert sample.generate(CFG, params, b'abc', length=0) == b''


def test_one_program_per_chunk_size(params):
  list(sample.stream_bytes(CFG, params, b'a', length=3, chunk=8))
  compiled = sample._generate_chunk._cache_size()
  for prompt, length in ((b'', 5), (LONG_PROMPT, 20), (b'xy', 37)):
    list(sample.stream_bytes(CFG, params, prompt, length=length, temperature=0.5, seed=1, chunk=8))
  assert sample._generate_chunk._cache_size() == compiled


@pytest.mark.parametrize('length', [10**9, sample.MAX_LENGTH])
def test_a_huge_length_streams_its_first_chunk_in_bounded_memory(params, length):
  list(sample.stream_bytes(CFG, params, b'', length=3, chunk=32))  # compile outside the trace
  tracemalloc.start()
  try:
    first = list(
      itertools.islice(sample.stream_bytes(CFG, params, LONG_PROMPT, length=length, chunk=32), 1)
    )
    _, peak = tracemalloc.get_traced_memory()
  finally:
    tracemalloc.stop()
  assert [len(c) for c in first] == [32]
  assert first[0] == sample.generate(CFG, params, LONG_PROMPT, length=32)
  assert peak < 16 * 2**20  # one buffer of `length` int32 tokens would be gigabytes


BAD_ARGS = [
  ('length', -1),
  ('length', sample.MAX_LENGTH + 1),
  ('length', 2 * 10**10),
  ('length', 1e9),
  ('length', 10.0),
  ('temperature', math.nan),
  ('temperature', math.inf),
  ('temperature', -math.inf),
  ('temperature', -0.1),
  ('temperature', '0.8'),
  ('seed', -1),
  ('seed', 2**32),
  ('seed', 1.5),
]


def _kwargs(flag, value):
  kwargs = dict(length=4, temperature=0.8, seed=0)
  kwargs[flag] = value
  return kwargs


@pytest.mark.parametrize('flag,value', BAD_ARGS)
def test_bad_arguments_raise_one_line_config_errors(params, flag, value):
  with pytest.raises(ConfigError, match=f'--{flag}') as info:
    sample.stream_bytes(CFG, params, b'x', **_kwargs(flag, value))  # at the call, not at next()
  assert '\n' not in str(info.value)
  with pytest.raises(ConfigError, match=f'--{flag}'):
    sample.generate(CFG, params, b'x', **_kwargs(flag, value))


@pytest.mark.parametrize(
  'flag,value', [('length', 2 * 10**10), ('temperature', math.nan), ('seed', 2**32)]
)
def test_checkpoint_functions_check_before_loading(monkeypatch, flag, value):
  def no_load(*args, **kwargs):
    raise AssertionError('loaded a checkpoint before checking the arguments')

  monkeypatch.setattr(sample, 'load', no_load)
  with pytest.raises(ConfigError, match=f'--{flag}'):
    sample.write_sample('/nonexistent', io.BytesIO(), **_kwargs(flag, value))
  with pytest.raises(ConfigError, match=f'--{flag}'):
    sample.sample('/nonexistent', **_kwargs(flag, value))


def test_bad_chunk_is_rejected(params):
  with pytest.raises(ConfigError, match='chunk'):
    sample.stream_bytes(CFG, params, b'x', length=4, chunk=0)


class _FlushLog(io.BytesIO):
  """A binary file that records what had been written at each flush."""

  def __init__(self):
    super().__init__()
    self.flushed = []

  def flush(self):
    super().flush()
    self.flushed.append(self.getvalue())


def test_write_sample_writes_the_prompt_then_each_chunk_flushed(params, monkeypatch):
  monkeypatch.setattr(sample, 'load', lambda out_dir, step=None: (CFG, params, 7))
  out = _FlushLog()
  step = sample.write_sample(
    'run', out, prompt='Wie? ', length=20, temperature=0.6, seed=4, chunk=8
  )
  want = b'Wie? ' + reference(CFG, params, b'Wie? ', length=20, temperature=0.6, seed=4)
  assert step == 7 and out.getvalue() == want
  assert [len(f) for f in out.flushed] == [5, 13, 21, 25]  # prompt, then 8 + 8 + 4 bytes
  text = sample.sample('run', prompt='Wie? ', length=20, temperature=0.6, seed=4)
  assert text == want.decode('utf-8', errors='replace')


def test_sample_options_are_one_checked_record(monkeypatch):
  options = sample.SampleOptions(length=4)
  assert (options.temperature, options.seed, options.chunk) == (0.8, 0, sample.DEFAULT_CHUNK)
  with pytest.raises(ConfigError, match='--seed'):
    sample.SampleOptions(length=4, seed=-1)
  with pytest.raises(ConfigError, match='chunk'):
    sample.SampleOptions(length=4, chunk=0)
  with pytest.raises(TypeError):
    sample.SampleOptions(length=4, step=3)  # not a sampling option

  def no_load(*args, **kwargs):
    raise AssertionError('loaded a checkpoint before checking the arguments')

  monkeypatch.setattr(sample, 'load', no_load)
  with pytest.raises(ConfigError, match='chunk'):
    sample.write_sample('/nonexistent', io.BytesIO(), length=4, chunk=0)
