"""Segments: ordered streams, as Transformer-XL's ``LMOrderedIterator`` cuts a split.

The split is cut into ``batch_size`` contiguous streams and batch j holds the j-th segment of
every stream, so row b of batch j + 1 continues row b of batch j (for recurrent memory).
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
  first_batches,
  token_array,
)
from ouroboros_jax.errors import DataError


class SegmentSource(StridedBatches):
  """Grain random-access source of one pass of segment batches, in stream order.

  The split's n tokens are cut into ``batch_size`` contiguous streams of
  ``S = n // batch_size`` tokens; stream b is ``tokens[b*S : (b+1)*S]`` (the
  last ``n - batch_size*S`` tokens are not used). Element j is batch j:
  row b holds ``stream_b[j*L : j*L + L]`` as ``inputs`` and
  ``stream_b[j*L + 1 : j*L + L + 1]`` as ``targets`` (``L = seq_len``), both
  int32. So row b of batch j + 1 continues row b of batch j, which is what a
  recurrent memory (Transformer-XL) needs. There are ``(S - 1) // L`` batches
  (only full ones; a target never leaves its stream).

  ``layout`` is :class:`BatchLayout`'s fields. Multi-host: ``batch_size`` is the global batch,
  and process p gets rows ``[p*B, (p+1)*B)`` of every batch, ``B = batch_size // process_count``.
  """

  _what = 'segment batch'

  def __init__(self, tokens: np.ndarray, *, split: str = 'split', **layout: int):
    layout = BatchLayout(**layout)
    tokens_Z = token_array(tokens, split)
    seq_len, batch_size = layout.seq_len, layout.batch_size
    self._stream_len = len(tokens_Z) // batch_size
    num_batches = max(0, (self._stream_len - 1) // seq_len)
    if num_batches == 0:
      raise DataError(
        f'{split} split has {len(tokens_Z)} tokens, too few to cut into batch_size'
        f' {batch_size} streams of at least seq_len + 1 = {seq_len + 1} tokens (needs'
        f' {batch_size * (seq_len + 1)}); use a smaller --batch-size or --seq-len.'
      )
    super().__init__(
      tokens_Z,
      seq_len,
      row_starts_B=layout.local_rows() * self._stream_len,
      batch_step=seq_len,
      num_batches=num_batches,
    )

  @property
  def stream_len(self) -> int:
    """Tokens per stream, ``n // batch_size``."""
    return self._stream_len

  def __repr__(self) -> str:
    return (
      f'SegmentSource(num_batches={self._len}, seq_len={self._seq_len},'
      f' rows={len(self._starts_B)}, stream_len={self._stream_len})'
    )


def make_segment_iterator(
  tokens: np.ndarray, *, split: str = 'train', **layout: int
) -> grain.DatasetIterator:
  """Infinite iterator of ordered segment batches (a Grain DatasetIterator).

  ``layout`` is :class:`BatchLayout`'s fields: ``seq_len``, ``batch_size`` (the global batch)
  and, multi-host, ``process_index`` and ``process_count``.

  Yields ``{'inputs': int32[B, L], 'targets': int32[B, L]}`` numpy arrays,
  ``B = batch_size // process_count``, ``L = seq_len``, in the order of
  :class:`SegmentSource` (Transformer-XL's ``LMOrderedIterator``): row b of
  batch j + 1 continues row b of batch j. After the last full batch of a pass
  it starts again at batch 0, forever. No shuffling and no seed: the order is
  fixed by the tokens, seq_len and batch_size. ``get_state()``/``set_state()``
  as for make_train_iterator (``{'next_index': int}``, JSON-serialisable);
  next_index counts batches from the start, across passes.

  Multi-host: ``batch_size`` is the global batch; process p gets rows
  ``[p * B, (p + 1) * B)`` of every global batch, so concatenating the
  processes' batches in process order gives the single-process batch.

  Raises:
    DataError: non-positive seq_len/batch_size, bad process arguments, or a
      split shorter than ``batch_size * (seq_len + 1)`` tokens.
  """
  segments = SegmentSource(tokens, split=split, **layout)
  ds = grain.MapDataset.source(segments).repeat()
  return iter(ds.to_iter_dataset(read_options=READ_OPTIONS))


def eval_segments(
  tokens: np.ndarray, *, max_batches: int | None = None, split: str = 'validation', **layout: int
) -> Iterator[Batch]:
  """One pass of ordered segment batches: the first pass of make_segment_iterator.

  ``layout`` is :class:`BatchLayout`'s fields, as for make_segment_iterator. At most
  ``max_batches`` batches. Same dict format and multi-host rows as make_segment_iterator.
  Errors are raised when called, not on first ``next``.

  Raises:
    DataError: as make_segment_iterator, or a non-positive max_batches.
  """
  check_max_batches(max_batches)
  return first_batches(SegmentSource(tokens, split=split, **layout), max_batches)
