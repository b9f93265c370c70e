"""A corpus spec string -> its three token splits, and what one token of it is.

Every corpus becomes three 1-D token arrays, ``'train'``, ``'validation'`` and ``'test'``: uint8
for byte and character corpora (vocabulary 256), int32 for word corpora. The spec forms and where
each is read: ``'default'``/``'shakespeare'`` (default_corpus), ``'text:PATH[,PATH...]'``
(byte_corpus), ``'tfds:NAME[:FEATURE]'`` (tfds_corpus), ``'enwik8:PATH'``/``'text8:PATH'``
(char_corpora) and ``'wikitext103:DIR'`` (wikitext).
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from ouroboros_jax.data import char_corpora, default_corpus, tfds_corpus, wikitext
from ouroboros_jax.data.byte_corpus import VOCAB_SIZE, load_text_files
from ouroboros_jax.data.wikitext import WordVocab, word_vocab
from ouroboros_jax.errors import DataError

_SPEC_HELP = (
  "use 'default' (or 'shakespeare'), 'text:PATH[,PATH...]', 'tfds:NAME[:FEATURE]',"
  " 'enwik8:PATH', 'text8:PATH' or 'wikitext103:DIR'"
)
# What one token of a corpus is; corpus_info tells a spec's.
UNITS = ('byte', 'char', 'word')


@dataclasses.dataclass(frozen=True)
class CorpusInfo:
  """What a spec's tokens are: ``vocab_size`` ids of one ``unit`` each.

  ``unit`` is ``'byte'`` (default, text:, tfds:, enwik8:), ``'char'`` (text8:
  one ASCII character per byte) or ``'word'`` (wikitext103:). Byte and char
  corpora have ``vocab_size`` 256 and report bits per byte/char; word corpora
  have the train vocabulary's size and ``vocab`` set, and report perplexity
  (``exp`` of the mean loss in nats per word).
  """

  vocab_size: int
  unit: str
  vocab: WordVocab | None = None


def corpus_info(spec: str = 'default') -> CorpusInfo:
  """The vocabulary size and unit of a spec's tokens (see :class:`CorpusInfo`).

  Byte and char specs are answered without reading anything; ``wikitext103:``
  tokenizes the directory (once per process, shared with load_splits).

  Raises:
    DataError: an unknown spec, or (wikitext103:) what :func:`word_vocab` raises.
  """
  spec = spec.strip()
  if spec.startswith('wikitext103:'):
    vocab = word_vocab(spec[len('wikitext103:') :])
    return CorpusInfo(vocab_size=len(vocab), unit='word', vocab=vocab)
  if spec.startswith('text8:'):
    return CorpusInfo(vocab_size=VOCAB_SIZE, unit='char')
  if spec in ('default', 'shakespeare') or spec.startswith(('text:', 'tfds:', 'enwik8:')):
    return CorpusInfo(vocab_size=VOCAB_SIZE, unit='byte')
  raise DataError(f'unknown data spec {spec!r}; {_SPEC_HELP}.')


def load_splits(
  spec: str = 'default', *, data_dir: str | os.PathLike[str] | None = None, download: bool = False
) -> dict[str, np.ndarray]:
  """Returns {'train', 'validation', 'test'} -> 1-D token arrays for a spec.

  The arrays are uint8 (bytes; text8's characters) except for
  ``wikitext103:``, whose word ids are int32 (see :func:`corpus_info` for the
  vocabulary size and unit).

  Args:
    spec: ``'default'``/``'shakespeare'``, ``'text:PATH[,PATH...]'``,
      ``'tfds:NAME[:FEATURE]'``, ``'enwik8:PATH'``, ``'text8:PATH'`` (PATH the
      raw file or its zip) or ``'wikitext103:DIR'``. For ``tfds:`` the
      dataset's splits are used: train/validation/test as they are; with only
      train and test (or train and validation), the missing split is the last
      5% of train's bytes; with only train, train is split 90/5/5. enwik8 and
      text8 must be exactly :data:`CANONICAL_BYTES` long and are split as
      :func:`canonical_split_ranges` says; wikitext103 uses its three files.
    data_dir: where TFDS datasets live. For the default corpus it defaults to
      ``$OUROBOROS_DATA_DIR`` or ``~/.cache/ouroboros_jax/tfds``; for ``tfds:``
      to TFDS's own default. Unused for the other specs.
    download: ``tfds:`` only. False (default): read only a dataset already
      prepared in data_dir and never touch the network; a missing one raises
      DataError at once. True: TFDS may download and prepare it
      (``array_record``). The other specs never download.

  Raises:
    DataError: unknown spec, missing or unreadable file, a zip without the
      corpus, a file of the wrong size, missing dataset/feature, or an empty
      corpus.
  """
  spec = spec.strip()
  if spec in ('default', 'shakespeare'):
    splits = default_corpus.load_default(data_dir)
  elif spec.startswith('text:'):
    splits = load_text_files(spec[len('text:') :])
  elif spec.startswith('tfds:'):
    splits = tfds_corpus.load_tfds(spec[len('tfds:') :], data_dir, download)
  elif spec.startswith('enwik8:'):
    splits = char_corpora.load_enwik8(spec[len('enwik8:') :])
  elif spec.startswith('text8:'):
    splits = char_corpora.load_text8(spec[len('text8:') :])
  elif spec.startswith('wikitext103:'):
    splits = dict(wikitext.load_wikitext(spec[len('wikitext103:') :])[1])
  else:
    raise DataError(f'unknown data spec {spec!r}; {_SPEC_HELP}.')
  total = sum(len(v) for v in splits.values())
  if total == 0:
    raise DataError(f'data spec {spec!r} gives an empty corpus; use more data.')
  return splits


def check_vocab(splits: dict[str, np.ndarray], vocab_size: int) -> None:
  """Raises DataError if a token is >= vocab_size.

  Out-of-range ids do not raise in JAX (gathers fill or clamp them), so
  without this check training reports a NaN loss at step 1 instead. uint8
  splits are byte data (the fix names 256); any other integer dtype is word
  ids (the fix names the largest id + 1; :func:`corpus_info` gives the
  vocabulary's size).
  """
  maxima = [int(np.max(v)) for v in splits.values() if np.size(v)]
  largest = max(maxima, default=-1)
  if largest >= vocab_size:
    is_bytes = all(np.asarray(v).dtype == np.uint8 for v in splits.values())
    what, fix = (
      ('byte values', f'use --vocab-size {VOCAB_SIZE} or more for byte data')
      if is_bytes
      else ('word ids', f"use --vocab-size {largest + 1} or more (the corpus's vocabulary size)")
    )
    raise DataError(
      f'the vocabulary (--vocab-size {vocab_size}) is smaller than the'
      f" data's symbol range (the data holds {what} up to {largest}); {fix}."
    )
