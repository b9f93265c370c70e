"""A corpus as one byte stream: text files read (plain or ``.gz``) and split 90/5/5 by bytes.

This is the ``'text:PATH[,PATH...]'`` spec, and the split every single-stream corpus uses (the
default corpus, a TFDS dataset with only a train split).
"""

from __future__ import annotations

import gzip
import os
import pathlib

import numpy as np

from ouroboros_jax.data.data_errors import first_line
from ouroboros_jax.errors import DataError

VOCAB_SIZE = 256
SPLITS = ('train', 'validation', 'test')


def split_ranges(n_bytes: int) -> dict[str, tuple[int, int]]:
  """Returns the [start, stop) byte range of each split of an n-byte stream.

  First 90% train, next 5% validation, the rest (about 5%) test; integer
  arithmetic so the ranges are contiguous, disjoint and cover [0, n_bytes).
  """
  n_train = n_bytes * 90 // 100
  n_valid = n_bytes * 5 // 100
  return {
    'train': (0, n_train),
    'validation': (n_train, n_train + n_valid),
    'test': (n_train + n_valid, n_bytes),
  }


def split_corpus(corpus_Z: np.ndarray | bytes) -> dict[str, np.ndarray]:
  """Splits one byte stream 90/5/5 into uint8 views (see split_ranges)."""
  if isinstance(corpus_Z, (bytes, bytearray, memoryview)):
    corpus_Z = np.frombuffer(corpus_Z, dtype=np.uint8)
  corpus_Z = np.asarray(corpus_Z, dtype=np.uint8)
  return {name: corpus_Z[start:stop] for name, (start, stop) in split_ranges(len(corpus_Z)).items()}


def read_text_file(path: str | os.PathLike[str]) -> bytes:
  """Returns a file's bytes, gunzipping ``*.gz``; DataError names the path."""
  path = pathlib.Path(path).expanduser()
  try:
    if path.suffix == '.gz':
      with gzip.open(path, 'rb') as f:
        return f.read()
    return path.read_bytes()
  except FileNotFoundError:
    raise DataError(f'data file not found: {path}; check the path (text:PATH[,PATH...]).') from None
  except (OSError, EOFError, gzip.BadGzipFile) as e:
    raise DataError(
      f'cannot read data file {path} ({first_line(e)}); check that it is a'
      ' readable text or .gz file.'
    ) from None


def load_text_files(paths_spec: str) -> dict[str, np.ndarray]:
  """The splits of ``'text:PATHS'``: the files joined with ``b'\\n'`` in order, split 90/5/5."""
  paths = [p.strip() for p in paths_spec.split(',') if p.strip()]
  if not paths:
    raise DataError("empty file list in 'text:' spec; use 'text:PATH[,PATH...]'.")
  corpus = b'\n'.join(read_text_file(p) for p in paths)
  return split_corpus(corpus)
