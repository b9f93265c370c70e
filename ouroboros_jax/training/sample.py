"""Sampling bytes from a trained run: `ouroboros sample --ckpt OUT`.

The latest checkpoint's parameters are restored onto one device (whatever schedule and mesh
trained them), un-staged with `partition.from_staged`, and text is generated one byte at a time.

Generation streams, so `--length` costs time, not memory. The host keeps only a rolling window of
the last seq_len tokens; one jitted `lax.fori_loop` (`_generate_chunk`, compiled once per model and
chunk size) extends that window by up to `chunk` tokens and returns the new window with the
tokens, which `stream_bytes` yields while the device already works on the next chunk. Each step
runs the full model over the window (no KV cache; the model is small and the code stays simple)
and samples the next byte from the logits at the window's last filled position. Until the text
fills a window, the window is the text followed by zeros; causal attention means those zeros never
influence the filled positions. Token i of the generation (0-based) is drawn with
`jax.random.fold_in(key, i)` whatever the chunking, so the output depends only on the prompt,
length, temperature and seed.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import math
import numbers
from collections.abc import Iterator
from typing import BinaryIO, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ouroboros_jax.errors import ConfigError
from ouroboros_jax.models import model as transformer
from ouroboros_jax.models.model import ModelConfig

# The generation index i (the `fold_in` data) is an int32 inside jit. The prompt never enters it
# (the window carries the prompt), so every length up to the largest int32 is exact.
MAX_LENGTH = 2**31 - 1
# jax.random.key keeps 32 bits of seed (2**32 gives the key of 0, -1 that of 2**32 - 1).
MAX_SEED = 2**32 - 1
DEFAULT_CHUNK = 256


def load(out_dir: str, step: int | None = None) -> tuple[ModelConfig, dict, int]:
  """(model config, unstaged params {'embed','layers','head'}, step) of a run's checkpoint, or
  of what `ouroboros export` wrote (training/export.py)."""
  from ouroboros_jax.training import export

  if export.is_export(out_dir):
    if step is not None:
      raise ConfigError(f'{out_dir} is an export of one step; drop --step.')
    model, params, step = export.load(out_dir)
  else:
    model, params, step = export.load_run(out_dir, step)
  if model.arch != 'gpt':
    raise ConfigError(
      f'{out_dir} holds a {model.arch} model; ouroboros sample generates from GPT runs only '
      '(sampling with a Transformer-XL memory is not written yet).'
    )
  return model, params, step


def check_args(*, length, temperature, seed) -> None:
  """Raises ConfigError for a bad --length/--temperature/--seed, before any loading or compiling."""
  if (
    not isinstance(length, numbers.Integral)
    or isinstance(length, bool)
    or not 0 <= length <= MAX_LENGTH
  ):
    raise ConfigError(
      f'--length must be an integer from 0 to {MAX_LENGTH} (2**31 - 1), got '
      f'{length!r}; pass a --length in that range.'
    )
  if (
    not isinstance(temperature, numbers.Real)
    or isinstance(temperature, bool)
    or not math.isfinite(temperature)
    or temperature < 0
  ):
    raise ConfigError(
      f'--temperature must be a finite number >= 0 (0 is greedy), got '
      f'{temperature!r}; pass e.g. --temperature 0.8.'
    )
  if not isinstance(seed, numbers.Integral) or isinstance(seed, bool) or not 0 <= seed <= MAX_SEED:
    raise ConfigError(
      f'--seed must be an integer from 0 to {MAX_SEED} (2**32 - 1), got '
      f'{seed!r}; pass a --seed in that range.'
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class SampleOptions:
  """How to sample: `length` new bytes, drawn at `temperature` (0 is greedy) from `seed`, at most
  `chunk` of them per device call. Checked when made: ConfigError names the bad --flag."""

  length: int
  temperature: float = 0.8
  seed: int = 0
  chunk: int = DEFAULT_CHUNK

  def __post_init__(self):
    check_args(length=self.length, temperature=self.temperature, seed=self.seed)
    chunk = self.chunk
    if not isinstance(chunk, numbers.Integral) or isinstance(chunk, bool) or chunk <= 0:
      raise ConfigError(f'chunk must be a positive integer, got {chunk!r}; pass e.g. chunk=256.')


class _Text(NamedTuple):
  """Where a generation stands, on the device: the last seq_len tokens of the text (`filled` of
  them real, then zeros) and how many tokens have been generated (the next one's index)."""

  window_L: jax.Array
  filled: jax.Array
  generated: jax.Array


class _Draw(NamedTuple):
  """How token i of a generation is drawn: from the logits / temperature with
  `jax.random.fold_in(key, i)`, or greedily where temperature is 0."""

  temperature: jax.Array
  key: jax.Array


@functools.partial(jax.jit, static_argnames=('cfg', 'chunk'))
def _generate_chunk(cfg: ModelConfig, params, text: _Text, count, draw: _Draw, *, chunk: int):
  """Generates the next `count` tokens (count <= chunk) after the text so far.

  Returns (the text after them, tokens_T); tokens_T[count:] are zeros. The trip count is traced
  so that a shorter last chunk reuses the same program.
  """
  last = cfg.seq_len - 1
  first = text.generated

  def next_token(i, carry):
    window_L, filled, tokens_T = carry
    x_1xLxD = transformer.embed(cfg, params['embed'], window_L[None])
    x_1xLxD = transformer.layers(cfg, params['layers'], x_1xLxD)
    logits_V = transformer.logits(cfg, params['head'], params['embed'], x_1xLxD)[0, filled - 1]
    logits_V = logits_V.astype(jnp.float32)
    greedy = jnp.argmax(logits_V)
    scaled = logits_V / jnp.maximum(draw.temperature, 1e-6)
    sampled = jax.random.categorical(jax.random.fold_in(draw.key, first + i), scaled)
    token = jnp.where(draw.temperature > 0, sampled, greedy).astype(window_L.dtype)
    # A full window slides left by one; otherwise the token fills the next free slot.
    full = filled > last
    window_L = jnp.where(full, jnp.roll(window_L, -1), window_L)
    window_L = window_L.at[jnp.minimum(filled, last)].set(token)
    return window_L, jnp.minimum(filled + 1, cfg.seq_len), tokens_T.at[i].set(token)

  tokens_T = jnp.zeros((chunk,), text.window_L.dtype)
  window_L, filled, tokens_T = jax.lax.fori_loop(
    0, count, next_token, (text.window_L, text.filled, tokens_T)
  )
  return _Text(window_L, filled, first + count), tokens_T


def stream_bytes(cfg: ModelConfig, params: dict, prompt: bytes, **options) -> Iterator[bytes]:
  """Yields `length` new bytes continuing `prompt`, at most `chunk` at a time, as generated.

  `options` are :class:`SampleOptions`' fields: length, and optionally temperature (0.8), seed
  (0) and chunk. An empty prompt starts from a newline. Arguments are checked now, not at the
  first `next`. Memory is one seq_len window plus one chunk whatever `length` is.
  """
  return _stream(cfg, params, prompt or b'\n', SampleOptions(**options))


def _stream(cfg, params, prompt: bytes, options: SampleOptions) -> Iterator[bytes]:
  length, chunk = int(options.length), int(options.chunk)
  tail_P = np.frombuffer(prompt, np.uint8)[-cfg.seq_len :].astype(np.int32)
  window_L = np.zeros(cfg.seq_len, np.int32)
  window_L[: len(tail_P)] = tail_P
  text = _Text(jnp.asarray(window_L), jnp.int32(len(tail_P)), jnp.int32(0))
  draw = _Draw(jnp.float32(float(options.temperature)), jax.random.key(int(options.seed)))
  pending = None  # the previous chunk: fetched once the next one is dispatched
  for first in range(0, length, chunk):
    count = min(chunk, length - first)
    text, tokens_T = _generate_chunk(cfg, params, text, np.int32(count), draw, chunk=chunk)
    if pending is not None:
      yield _to_bytes(*pending)
    pending = tokens_T, count
  if pending is not None:
    yield _to_bytes(*pending)


def _to_bytes(tokens_T, count: int) -> bytes:
  return np.asarray(jax.device_get(tokens_T))[:count].astype(np.uint8).tobytes()


def generate(cfg: ModelConfig, params: dict, prompt: bytes, **options) -> bytes:
  """`length` new bytes continuing `prompt` (an empty prompt starts from a newline), all at
  once; `options` are `stream_bytes`'s (length, temperature, seed, chunk)."""
  return b''.join(stream_bytes(cfg, params, prompt, **options))


def write_sample(
  out_dir: str, file: BinaryIO, *, prompt: str = '', step: int | None = None, **options
) -> int:
  """Writes prompt then sampled bytes to binary `file`, flushing each chunk; returns the step.

  `options` are :class:`SampleOptions`' fields (length defaults to 500 here), checked before the
  checkpoint is read. Bytes go out as generated, so a long --length shows output at once and
  never grows memory.
  """
  options = SampleOptions(**{'length': 500, **options})
  cfg, params, step = load(out_dir, step)
  prompt_bytes = prompt.encode('utf-8', 'surrogateescape')  # argv keeps raw bytes that way
  file.write(prompt_bytes)
  file.flush()
  for piece in _stream(cfg, params, prompt_bytes or b'\n', options):
    file.write(piece)
    file.flush()
  return step


def sample(out_dir: str, **options) -> str:
  """Prompt plus `length` sampled bytes from a run's checkpoint, decoded as UTF-8 (replace);
  `options` are `write_sample`'s (prompt, step, length, temperature, seed, chunk)."""
  buffer = io.BytesIO()
  write_sample(out_dir, buffer, **options)
  return buffer.getvalue().decode('utf-8', errors='replace')
