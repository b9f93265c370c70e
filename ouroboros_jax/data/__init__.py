"""Language-model data: corpora, splits, windows, segments and iterators.

A corpus is chosen with one spec string:

* ``'default'`` / ``'shakespeare'``: the embedded Shakespeare corpus
  (``ouroboros_jax/corpus/shakespeare.txt.gz``), served as a locally built TFDS
  dataset (:class:`ShakespeareBytes`, ``array_record`` files, no TensorFlow).
  It is prepared once into ``data_dir`` (default ``$OUROBOROS_DATA_DIR`` or
  ``~/.cache/ouroboros_jax/tfds``) and read back with
  ``builder.as_data_source()``.
* ``'text:PATH[,PATH...]'``: local text files (plain or ``.gz``), concatenated
  in the given order with ``b'\\n'`` between files.
* ``'tfds:NAME[:FEATURE]'``: a TFDS text dataset already prepared in
  ``data_dir`` (``array_record``), read with ``builder.as_data_source()``;
  FEATURE defaults to ``'text'``. Nothing is downloaded unless
  ``download=True`` (``--download``): a missing dataset fails at once instead
  of reaching for the network. Documents are UTF-8 encoded and joined with
  ``b'\\n'`` in the data source's record order; the whole dataset is read into
  memory. With ``data_dir=None`` TFDS's own default applies
  (``$TFDS_DATA_DIR`` or ``~/tensorflow_datasets``).
* ``'enwik8:PATH'``, ``'text8:PATH'``: the Transformer-XL paper's character
  corpora from local files (never downloaded). PATH is the raw
  100,000,000-byte file (``enwik8``, ``text8``) or the zip that holds it
  (``enwik8.zip``, ``text8.zip`` from http://mattmahoney.net/dc/). The split is
  the canonical one of Transformer-XL's ``prep_enwik8.py``/``prep_text8.py``:
  train the first 90M bytes, validation the next 5M, test the last 5M (see
  :data:`CANONICAL_BYTES` and :func:`canonical_split_ranges`). Tokens are the
  bytes; text8 holds only ``a``-``z`` and space, kept as their byte values.
* ``'wikitext103:DIR'``: WikiText-103 at the word level; DIR holds
  ``wiki.train.tokens``, ``wiki.valid.tokens`` and ``wiki.test.tokens`` as
  shipped (``wikitext-103-v1.zip``). Tokenized as Transformer-XL does (see
  :func:`word_vocab`): whitespace-split lines, ``'<eos>'`` after every line, a
  vocabulary of the train file's words, ``'<unk>'`` for the rest. Token ids are
  int32; nothing is written anywhere, the tokenized splits are kept in memory.

Every corpus becomes three 1-D token arrays, ``'train'``, ``'validation'`` and
``'test'``: uint8 for byte and character corpora (vocabulary 256), int32 for
word corpora. :func:`corpus_info` tells a spec's vocabulary size and unit
(``'byte'``, ``'char'`` or ``'word'``), so bits per byte/char or a word
perplexity can be reported. A single byte stream is split 90/5/5 by bytes (see
:func:`split_ranges`); for ``tfds:`` the dataset's own splits are used where
present (see :func:`load_splits`).

Two ways to cut a split into training examples:

* Windows (:func:`make_train_iterator`, :func:`eval_batches`): windows of
  ``seq_len + 1`` tokens with stride ``seq_len`` (:class:`WindowSource`, a
  Grain random-access source); ``inputs`` is a window without its last token
  and ``targets`` the window without its first, so consecutive windows share
  one token and every token is predicted once. Training shuffles them.
* Segments (:func:`make_segment_iterator`, :func:`eval_segments`), the order of
  Transformer-XL's ``LMOrderedIterator``: the split is cut into ``batch_size``
  contiguous streams and batch j holds the j-th segment of every stream, so row
  b of batch j + 1 continues row b of batch j (for recurrent memory).

Typical use::

  splits = data.load_splits('default')
  train_it = data.make_train_iterator(
      splits['train'], seq_len=256, batch_size=32, seed=0)
  batch = next(train_it)  # {'inputs': int32[32, 256], 'targets': ...}
  state = train_it.get_state()  # JSON-serialisable; train_it.set_state(state)
  for batch in data.eval_batches(
      splits['validation'], seq_len=256, batch_size=32, max_batches=10):
    ...

Training order: windows are shuffled with Grain (``shuffle`` then ``repeat``),
which folds the epoch number into the shuffle seed, so every epoch is a fresh
permutation of all windows and the stream is infinite. Batches are cut from
that stream, so a batch may straddle an epoch boundary, but no window is
dropped or duplicated within an epoch.

All problems a user can fix raise :class:`DataError` with a one-line message.

This module is the data pipeline's public face: every name above is importable from here. Each
concern lives in its own module of ``ouroboros_jax.training``:

  corpora         load_splits, corpus_info, check_vocab: a spec string -> its token splits
  byte_corpus     text files read (plain or .gz), the 90/5/5 byte split, the ``text:`` spec
  default_corpus  the embedded Shakespeare as a TFDS dataset (ShakespeareBytes)
  tfds_corpus     ``tfds:NAME[:FEATURE]``: a prepared TFDS text dataset, downloaded only if asked
  char_corpora    ``enwik8:``/``text8:`` and their canonical split (set CANONICAL_BYTES there)
  wikitext        ``wikitext103:`` and its word vocabulary (WordVocab, word_vocab)
  data_errors     how a failure becomes one DataError line
  batching        BatchLayout (seq_len, batch_size, this process's rows) and ordered batches
  windows         WindowSource, make_train_iterator (shuffled), eval_batches (in order)
  segments        SegmentSource, make_segment_iterator, eval_segments (Transformer-XL order)
"""

from __future__ import annotations

from ouroboros_jax.data.batching import BatchLayout
from ouroboros_jax.data.byte_corpus import (
  SPLITS,
  VOCAB_SIZE,
  read_text_file,
  split_corpus,
  split_ranges,
)
from ouroboros_jax.data.char_corpora import CANONICAL_BYTES, CORPUS_URLS, canonical_split_ranges
from ouroboros_jax.data.corpora import UNITS, CorpusInfo, check_vocab, corpus_info, load_splits
from ouroboros_jax.data.default_corpus import (
  CHUNK_BYTES,
  DEFAULT_CORPUS_PATH,
  DEFAULT_DATA_DIR_ENV,
  ShakespeareBytes,
  default_data_dir,
  prepare_default_corpus,
)
from ouroboros_jax.data.segments import SegmentSource, eval_segments, make_segment_iterator
from ouroboros_jax.data.wikitext import EOS, UNK, WIKITEXT_FILES, WordVocab, word_vocab
from ouroboros_jax.data.windows import (
  WindowBatches,
  WindowSource,
  eval_batches,
  make_train_iterator,
  num_windows,
)
from ouroboros_jax.errors import DataError  # re-exported: ouroboros_jax.data.DataError

__all__ = [
  'CANONICAL_BYTES',
  'CHUNK_BYTES',
  'CORPUS_URLS',
  'DEFAULT_CORPUS_PATH',
  'DEFAULT_DATA_DIR_ENV',
  'EOS',
  'SPLITS',
  'UNITS',
  'UNK',
  'VOCAB_SIZE',
  'WIKITEXT_FILES',
  'BatchLayout',
  'CorpusInfo',
  'DataError',
  'SegmentSource',
  'ShakespeareBytes',
  'WindowBatches',
  'WindowSource',
  'WordVocab',
  'canonical_split_ranges',
  'check_vocab',
  'corpus_info',
  'default_data_dir',
  'eval_batches',
  'eval_segments',
  'load_splits',
  'make_segment_iterator',
  'make_train_iterator',
  'num_windows',
  'prepare_default_corpus',
  'read_text_file',
  'split_corpus',
  'split_ranges',
  'word_vocab',
]
