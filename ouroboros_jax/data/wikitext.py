"""``'wikitext103:DIR'``: WikiText-103 at the word level, and its word vocabulary.

DIR holds ``wiki.train.tokens``, ``wiki.valid.tokens`` and ``wiki.test.tokens`` as shipped
(``wikitext-103-v1.zip``). Tokenized as Transformer-XL does (see :func:`word_vocab`):
whitespace-split lines, ``'<eos>'`` after every line, a vocabulary of the train file's words,
``'<unk>'`` for the rest. Token ids are int32; nothing is written anywhere, the tokenized splits
are kept in memory.
"""

from __future__ import annotations

import array
import dataclasses
import logging
import os
import pathlib
from collections.abc import Iterable, Iterator

import numpy as np

from ouroboros_jax.data.char_corpora import CORPUS_URLS, corpus_path
from ouroboros_jax.data.data_errors import as_data_error
from ouroboros_jax.errors import DataError

log = logging.getLogger(__name__)

# WikiText-103's files, as shipped, per split.
WIKITEXT_FILES = {
  'train': 'wiki.train.tokens',
  'validation': 'wiki.valid.tokens',
  'test': 'wiki.test.tokens',
}
EOS = '<eos>'  # appended to every line of a word corpus (word id 0)
UNK = '<unk>'  # what a word unseen in train becomes


@dataclasses.dataclass(frozen=True, eq=False)
class WordVocab:
  """A word-level vocabulary: ``words[i]`` is word id i.

  Built from a train file only (see :func:`word_vocab`): ``'<eos>'`` is id 0,
  then the train file's words by descending count, ties by word (code-point
  order), so it is the same on every machine. ``'<unk>'`` keeps its place when
  the train file holds it (WikiText-103 does); otherwise it is appended last.
  ``counts[i]`` is how often word i occurs in train (``'<eos>'``: the number
  of lines). Frequency order is what an adaptive softmax's cutoffs assume.
  """

  words: tuple[str, ...]
  counts: tuple[int, ...]

  def __post_init__(self):
    object.__setattr__(self, '_index', {w: i for i, w in enumerate(self.words)})

  def __len__(self) -> int:
    return len(self.words)

  def __contains__(self, word: str) -> bool:
    return word in self._index

  @property
  def eos_id(self) -> int:
    return self._index[EOS]

  @property
  def unk_id(self) -> int:
    return self._index[UNK]

  def id(self, word: str) -> int:
    """The id of word; ``unk_id`` for a word not in the vocabulary."""
    return self._index.get(word, self.unk_id)

  def encode(self, words: Iterable[str]) -> np.ndarray:
    """int32 ids of words (unknown words -> ``unk_id``)."""
    get, unk = self._index.get, self.unk_id
    return np.fromiter((get(w, unk) for w in words), np.int32)

  def decode(self, ids: Iterable[int]) -> list[str]:
    """The words of ids."""
    return [self.words[int(i)] for i in np.asarray(ids).ravel()]

  def __repr__(self) -> str:
    head = ', '.join(repr(w) for w in self.words[:5])
    return f'WordVocab(size={len(self)}, words=[{head}, ...])'


def _wikitext_paths(rest: str) -> dict[str, pathlib.Path]:
  """The three files of a WikiText-103 directory, each checked to exist."""
  directory = corpus_path('wikitext103', rest, 'DIR')
  names = ', '.join(WIKITEXT_FILES.values())
  fix = f'pass the directory that holds {names} (unzipped {CORPUS_URLS["wikitext103"]})'
  if not directory.exists():
    raise DataError(f'wikitext103 directory not found: {directory}; {fix}.')
  if not directory.is_dir():
    raise DataError(f'wikitext103 path {directory} is not a directory; {fix}.')
  paths = {split: directory / name for split, name in WIKITEXT_FILES.items()}
  missing = [p.name for p in paths.values() if not p.is_file()]
  if missing:
    raise DataError(
      f'wikitext103 directory {directory} lacks {", ".join(missing)}; it must hold all of'
      f' {names}: {fix}.'
    )
  return paths


class _FirstSeenIds(dict):
  """word -> id in order of first sight (a dict that numbers new keys)."""

  def __missing__(self, word: str) -> int:
    i = self[word] = len(self)
    return i


def _read_lines(path: pathlib.Path) -> Iterator[str]:
  """The lines of a UTF-8 file as Transformer-XL reads them (text mode: any newline ends a line)."""
  with path.open('r', encoding='utf-8') as f:
    yield from f


def _tokenize_train(path: pathlib.Path) -> tuple[WordVocab, np.ndarray]:
  """The train file's vocabulary and its int32 ids, in one pass.

  Each word first gets an id in order of first sight; after the pass the
  counts give the vocabulary's order and the ids are renumbered in place.
  """
  first_seen = _FirstSeenIds({EOS: 0})
  ids = array.array('i')
  lookup = first_seen.__getitem__
  for line in _read_lines(path):
    ids.extend(map(lookup, line.split()))
    ids.append(0)
  ids_Z = np.frombuffer(ids, np.int32) if len(ids) else np.zeros(0, np.int32)
  chunk = 1 << 24
  counts_W = np.zeros(len(first_seen), np.int64)
  for start in range(0, len(ids_Z), chunk):
    counts_W += np.bincount(ids_Z[start : start + chunk], minlength=len(first_seen))
  seen = list(first_seen)  # words in order of first sight; seen[0] is EOS
  if len(seen) == 1:
    raise DataError(
      f'wikitext103 train file {path} holds no words; pass the {WIKITEXT_FILES["train"]}'
      f' that ships in {CORPUS_URLS["wikitext103"]}.'
    )
  order = sorted(range(1, len(seen)), key=lambda i: (-int(counts_W[i]), seen[i]))
  order.insert(0, 0)
  words = [seen[i] for i in order]
  counts = [int(counts_W[i]) for i in order]
  if UNK not in first_seen:
    words.append(UNK)
    counts.append(0)
  final_of_seen_W = np.empty(len(seen), np.int32)
  final_of_seen_W[np.asarray(order)] = np.arange(len(order), dtype=np.int32)
  for start in range(0, len(ids_Z), chunk):
    ids_Z[start : start + chunk] = final_of_seen_W[ids_Z[start : start + chunk]]
  return WordVocab(tuple(words), tuple(counts)), ids_Z


def _encode_file(path: pathlib.Path, vocab: WordVocab) -> np.ndarray:
  """int32 ids of a file's words, ``'<eos>'`` after every line, unseen words -> ``'<unk>'``."""
  get, unk, eos = vocab._index.get, vocab.unk_id, vocab.eos_id  # pylint: disable=protected-access
  ids = array.array('i')
  for line in _read_lines(path):
    ids.extend([get(w, unk) for w in line.split()])
    ids.append(eos)
  return np.frombuffer(ids, np.int32) if len(ids) else np.zeros(0, np.int32)


# One tokenized WikiText directory, kept in memory (never written anywhere):
# key (directory, the files' sizes and mtimes) -> (vocab, splits).
_WORD_CACHE: dict[tuple, tuple[WordVocab, dict[str, np.ndarray]]] = {}


def load_wikitext(rest: str) -> tuple[WordVocab, dict[str, np.ndarray]]:
  """(vocabulary, splits) of ``'wikitext103:DIR'`` (rest is DIR), tokenized once per process."""
  paths = _wikitext_paths(rest)
  key = (
    str(paths['train'].parent.resolve()),
    tuple((p.stat().st_size, p.stat().st_mtime_ns) for p in paths.values()),
  )
  if key in _WORD_CACHE:
    return _WORD_CACHE[key]
  log.info('Tokenizing WikiText in %s', paths['train'].parent)
  fix = 'use the files as shipped (UTF-8 text)'
  with as_data_error(f'cannot read wikitext103 file {paths["train"]}', fix):
    vocab, train_Z = _tokenize_train(paths['train'])
  splits = {'train': train_Z}
  for split in ('validation', 'test'):
    with as_data_error(f'cannot read wikitext103 file {paths[split]}', fix):
      splits[split] = _encode_file(paths[split], vocab)
  for tokens_Z in splits.values():
    tokens_Z.flags.writeable = False  # shared through the cache
  _WORD_CACHE.clear()  # one corpus at a time: WikiText-103 is ~0.5 GB of ids
  _WORD_CACHE[key] = (vocab, splits)
  return vocab, splits


def word_vocab(directory: str | os.PathLike[str]) -> WordVocab:
  """The word vocabulary of a WikiText-103 directory (as ``'wikitext103:DIR'`` tokenizes it).

  Tokenization follows Transformer-XL's ``Vocab`` for wt103: every line is
  stripped and split on whitespace and ``'<eos>'`` is appended to it (empty
  lines too); the vocabulary counts the train file only and is ordered as
  :class:`WordVocab` says (Transformer-XL breaks count ties by first sight, we
  by word; the set of words, and so the size, is the same: 267,735 for
  WikiText-103). Validation and test words unseen in train become
  ``'<unk>'``. The files are read once per process and kept in memory.

  Raises:
    DataError: a missing directory or file, an unreadable or non-UTF-8 file,
      or a train file without words.
  """
  return load_wikitext(os.fspath(directory))[0]
