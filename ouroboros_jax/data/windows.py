"""Windows: a split cut into ``seq_len + 1``-token windows, shuffled for training (Grain).

Window i is ``tokens[i*seq_len : i*seq_len + seq_len + 1]`` (stride ``seq_len``); ``inputs`` is a
window without its last token and ``targets`` the window without its first, so consecutive
windows share one token and every token is predicted once. Training shuffles the windows with
Grain (``shuffle`` then ``repeat``), which folds the epoch number into the shuffle seed, so every
epoch is a fresh permutation of all windows and the stream is infinite. Batches are cut from that
stream, so a batch may straddle an epoch boundary, but no window is dropped or duplicated within
an epoch. Evaluation reads the windows in order.
"""

from __future__ import annotations

from collections.abc import Iterator

import grain
import numpy as np

from ouroboros_jax.data.batching import (
  READ_OPTIONS,
  Batch,
  BatchLayout,
  StridedBatches,
  check_max_batches,
  check_positive,
  first_batches,
  source_index,
  token_array,
)
from ouroboros_jax.errors import DataError


def num_windows(tokens: np.ndarray, seq_len: int) -> int:
  """Number of (seq_len + 1)-token windows at stride seq_len in tokens."""
  check_positive(seq_len=seq_len)
  return max(0, (len(tokens) - 1) // seq_len)


class WindowSource:
  """Grain random-access source of a split's windows.

  Window i is ``tokens[i*seq_len : i*seq_len + seq_len + 1]``; element i is
  ``{'inputs': window[:-1], 'targets': window[1:]}``, both int32[seq_len].
  Trailing tokens that do not fill a window are not used. tokens may be of any
  integer dtype (uint8 bytes, int32 word ids); it is kept as it is.
  """

  def __init__(self, tokens: np.ndarray, seq_len: int, *, split: str = 'split'):
    check_positive(seq_len=seq_len)
    self._tokens_Z = token_array(tokens, split)
    self._seq_len = int(seq_len)
    self._len = num_windows(self._tokens_Z, seq_len)
    if self._len == 0:
      raise DataError(
        f'{split} split has {len(self._tokens_Z)} tokens but one window'
        f' needs seq_len + 1 = {seq_len + 1}; use a smaller --seq-len or'
        ' more data.'
      )

  @property
  def seq_len(self) -> int:
    return self._seq_len

  def __len__(self) -> int:
    return self._len

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    index = source_index(index, self._len, 'window')
    start = index * self._seq_len
    window_L1 = self._tokens_Z[start : start + self._seq_len + 1].astype(np.int32)
    return {'inputs': window_L1[:-1], 'targets': window_L1[1:]}

  def __repr__(self) -> str:
    return (
      f'WindowSource(num_windows={self._len}, seq_len={self._seq_len},'
      f' num_tokens={len(self._tokens_Z)})'
    )


def _batchable_windows(tokens: np.ndarray, layout: BatchLayout, split: str) -> WindowSource:
  """The split's windows, checked to fill at least one batch."""
  windows = WindowSource(tokens, layout.seq_len, split=split)
  if len(windows) < layout.batch_size:
    raise DataError(
      f'{split} split has {len(windows)} windows of seq_len + 1 ='
      f' {layout.seq_len + 1} tokens, fewer than batch_size {layout.batch_size}; use a'
      ' smaller --batch-size (or --seq-len).'
    )
  return windows


class WindowBatches(StridedBatches):
  """Grain random-access source of a split's windows batched in order, unshuffled.

  Batch b holds windows ``b * batch_size`` to ``(b + 1) * batch_size - 1``, of which this
  process reads its rows (see :class:`BatchLayout`); the windows after the last full batch are
  not used. ``layout`` is :class:`BatchLayout`'s fields (``seq_len``, ``batch_size``, ...).
  """

  _what = 'window batch'

  def __init__(self, tokens: np.ndarray, *, split: str = 'split', **layout: int):
    layout = BatchLayout(**layout)
    windows = _batchable_windows(tokens, layout, split)
    seq_len, batch_size = layout.seq_len, layout.batch_size
    super().__init__(
      token_array(tokens, split),
      seq_len,
      row_starts_B=layout.local_rows() * seq_len,
      batch_step=batch_size * seq_len,
      num_batches=len(windows) // batch_size,
    )

  def __repr__(self) -> str:
    return (
      f'WindowBatches(num_batches={self._len}, seq_len={self._seq_len}, rows={len(self._starts_B)})'
    )


def _grain_seed(seed: int) -> int:
  """Mixes seed into a 32-bit Grain shuffle seed.

  Grain shuffles epoch e with seed + e, so raw seeds s and s + 1 would give
  shifted copies of the same epoch orders; mixing decorrelates nearby seeds.
  """
  if not isinstance(seed, (int, np.integer)) or seed < 0:
    raise DataError(f'seed must be a non-negative integer, got {seed!r}.')
  return int(np.random.SeedSequence(int(seed)).generate_state(1)[0])


def make_train_iterator(
  tokens: np.ndarray, *, seed: int, split: str = 'train', **layout: int
) -> grain.DatasetIterator:
  """Infinite shuffled iterator of training batches (a Grain DatasetIterator).

  ``layout`` is :class:`BatchLayout`'s fields: ``seq_len``, ``batch_size`` (the global batch)
  and, multi-host, ``process_index`` and ``process_count``.

  Yields ``{'inputs': int32[B, L], 'targets': int32[B, L]}`` numpy arrays with
  ``B = batch_size // process_count`` and ``L = seq_len``. The order depends
  only on ``seed``; each epoch is a new permutation of all windows. The
  iterator has ``get_state()``/``set_state()``; the state is a small
  JSON-serialisable dict (``{'next_index': int}``).

  Multi-host: ``batch_size`` is the global batch. Process p reads only rows
  ``[p * B, (p + 1) * B)`` of every global batch, so concatenating the
  processes' batches in process order gives exactly the single-process batch.

  Raises:
    DataError: non-positive seq_len/batch_size, a split shorter than one window
      or with fewer windows than batch_size, or bad process arguments.
  """
  layout = BatchLayout(**layout)
  windows = _batchable_windows(tokens, layout, split)
  # shuffle before repeat: Grain then reshuffles each epoch (seed + epoch)
  # instead of shuffling one infinite index space.
  ds = grain.MapDataset.source(windows).shuffle(seed=_grain_seed(seed)).repeat()
  # Local batch j*P + p is rows [p*B, (p+1)*B) of global batch j; a strided
  # slice picks this process's local batches and reads only their windows.
  ds = ds.batch(layout.local_batch, drop_remainder=True)
  if layout.process_count > 1:
    ds = ds[layout.process_index :: layout.process_count]
  return iter(ds.to_iter_dataset(read_options=READ_OPTIONS))


def eval_batches(
  tokens: np.ndarray, *, max_batches: int | None = None, split: str = 'validation', **layout: int
) -> Iterator[Batch]:
  """Deterministic, unshuffled batches over a split's windows in order (:class:`WindowBatches`).

  ``layout`` is :class:`BatchLayout`'s fields, as for make_train_iterator. The last partial
  batch is dropped; at most ``max_batches`` batches. Same dict format and multi-host slicing as
  make_train_iterator. Errors are raised when called, not on first ``next``.

  Raises:
    DataError: non-positive seq_len/batch_size/max_batches, or a split with
      fewer windows than one batch.
  """
  check_max_batches(max_batches)
  return first_batches(WindowBatches(tokens, split=split, **layout), max_batches)
