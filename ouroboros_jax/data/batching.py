"""What windows and segments share: the batch layout over processes, and ordered batches.

A batch is ``{'inputs': int32[B, L], 'targets': int32[B, L]}`` numpy arrays. ``batch_size`` is
always the global batch; with several processes, process p reads only rows ``[p * B, (p + 1) * B)``
of every global batch, ``B = batch_size // process_count`` (see :class:`BatchLayout`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import grain
import numpy as np

from ouroboros_jax.errors import DataError

Batch = dict[str, np.ndarray]
# Grain defaults to 16 threads and 500 prefetched elements, which for large
# batches is gigabytes of host memory; batches here are cheap array slices.
READ_OPTIONS = grain.ReadOptions(num_threads=2, prefetch_buffer_size=16)


def check_positive(**values: int) -> None:
  """DataError naming the first value that is not a positive integer (and its --flag)."""
  for name, value in values.items():
    if not isinstance(value, (int, np.integer)) or value <= 0:
      raise DataError(
        f'{name} must be a positive integer, got {value!r}; pass --{name.replace("_", "-")} >= 1.'
      )


def token_array(tokens: np.ndarray | bytes, split: str) -> np.ndarray:
  """tokens as a 1-D integer array, its dtype kept (uint8 bytes stay 1 byte a token)."""
  if isinstance(tokens, (bytes, bytearray, memoryview)):
    return np.frombuffer(tokens, np.uint8)
  tokens_Z = np.asarray(tokens)
  if tokens_Z.size == 0 and tokens_Z.ndim == 1:
    return tokens_Z.astype(np.uint8, copy=False)
  if tokens_Z.ndim != 1 or not np.issubdtype(tokens_Z.dtype, np.integer):
    raise DataError(
      f'{split} tokens must be a 1-D integer array, got {tokens_Z.dtype}'
      f'{list(tokens_Z.shape)}; pass a split from load_splits.'
    )
  return tokens_Z


def source_index(index, length: int, what: str) -> int:
  """A Grain source's element index, negative ones counted from the end (IndexError outside)."""
  index = int(index)
  if index < 0:
    index += length
  if not 0 <= index < length:
    raise IndexError(f'{what} {index} out of range [0, {length})')
  return index


@dataclasses.dataclass(frozen=True, kw_only=True)
class BatchLayout:
  """How batches are cut: ``batch_size`` rows of ``seq_len`` tokens, and this process's rows.

  ``batch_size`` is the global batch; process ``process_index`` of ``process_count`` reads rows
  ``[p * B, (p + 1) * B)`` of every global batch, ``B = batch_size // process_count``
  (:attr:`local_batch`). Checked when made: DataError for a non-positive size, a process index
  outside ``[0, process_count)`` or a batch that the processes do not divide.
  """

  seq_len: int
  batch_size: int
  process_index: int = 0
  process_count: int = 1

  def __post_init__(self):
    check_positive(seq_len=self.seq_len, batch_size=self.batch_size)
    check_positive(process_count=self.process_count)
    if not 0 <= self.process_index < self.process_count:
      raise DataError(
        f'process_index must be in [0, {self.process_count}), got {self.process_index}.'
      )
    if self.batch_size % self.process_count:
      raise DataError(
        f'batch_size {self.batch_size} is not divisible by process_count'
        f' {self.process_count}; use a global --batch-size that is a multiple of'
        ' the number of processes.'
      )

  @property
  def local_batch(self) -> int:
    """Rows of every batch this process reads, ``batch_size // process_count``."""
    return self.batch_size // self.process_count

  def local_rows(self) -> np.ndarray:
    """The indices of this process's rows in a global batch."""
    return self.process_index * self.local_batch + np.arange(self.local_batch)


class StridedBatches:
  """Grain random-access source of batches cut from a token array at fixed strides, in order.

  Row r of batch j is ``tokens[s : s + seq_len + 1]`` with ``s = row_starts[r] + j * batch_step``;
  the batch is ``{'inputs': row[:-1], 'targets': row[1:]}`` of every row, both int32. Windows
  batched in order and Transformer-XL's segments are two choices of the strides.
  """

  _what = 'batch'  # what an element is called in an IndexError

  def __init__(self, tokens_Z, seq_len: int, row_starts_B, batch_step: int, num_batches: int):
    self._tokens_Z = tokens_Z
    self._seq_len = int(seq_len)
    self._starts_B = row_starts_B
    self._step = int(batch_step)
    self._len = int(num_batches)
    self._offsets_L1 = np.arange(seq_len + 1)

  @property
  def seq_len(self) -> int:
    return self._seq_len

  def __len__(self) -> int:
    return self._len

  def __getitem__(self, index: int) -> Batch:
    index = source_index(index, self._len, self._what)
    positions_BxL1 = self._starts_B[:, None] + (index * self._step + self._offsets_L1)
    rows_BxL1 = self._tokens_Z[positions_BxL1].astype(np.int32)
    return {
      'inputs': np.ascontiguousarray(rows_BxL1[:, :-1]),
      'targets': np.ascontiguousarray(rows_BxL1[:, 1:]),
    }


def check_max_batches(max_batches: int | None) -> None:
  """DataError unless max_batches is None (no limit) or a positive integer."""
  if max_batches is not None:
    check_positive(max_batches=max_batches)


def first_batches(source: StridedBatches, max_batches: int | None) -> Iterator[Batch]:
  """source's batches in order, at most max_batches of them (None: all)."""
  n_batches = len(source) if max_batches is None else min(len(source), max_batches)
  return (source[j] for j in range(n_batches))
