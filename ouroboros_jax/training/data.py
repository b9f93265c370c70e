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
"""

from __future__ import annotations

import array
import contextlib
import dataclasses
import gzip
import io
import logging
import os
import pathlib
import posixpath
import re
import zipfile
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import grain
import numpy as np
import tensorflow_datasets as tfds
from etils import epath

from ouroboros_jax.errors import DataError  # re-exported: ouroboros_jax.training.data.DataError

log = logging.getLogger(__name__)

VOCAB_SIZE = 256
SPLITS = ('train', 'validation', 'test')
DEFAULT_CORPUS_PATH = pathlib.Path(__file__).resolve().parents[1] / 'corpus' / 'shakespeare.txt.gz'
DEFAULT_DATA_DIR_ENV = 'OUROBOROS_DATA_DIR'
# Bytes per TFDS record of the default corpus; small enough to keep records
# cheap, large enough that there are only ~80 of them.
CHUNK_BYTES = 64 * 1024
# Grain defaults to 16 threads and 500 prefetched elements, which for large
# batches is gigabytes of host memory; batches here are cheap array slices.
_READ_OPTIONS = grain.ReadOptions(num_threads=2, prefetch_buffer_size=16)
_SPEC_HELP = (
  "use 'default' (or 'shakespeare'), 'text:PATH[,PATH...]', 'tfds:NAME[:FEATURE]',"
  " 'enwik8:PATH', 'text8:PATH' or 'wikitext103:DIR'"
)
# The size of enwik8 and text8 in bytes. Their canonical split (Transformer-XL's
# prep_enwik8.py / prep_text8.py) holds out the last 2 x 5% (5M bytes each) for
# validation and test; a file of any other size is refused. Tests set a small
# value (e.g. 2000) to use small files; the split scales with it.
CANONICAL_BYTES = 100_000_000
# Where the paper's corpora come from (named in error messages; never fetched).
CORPUS_URLS = {
  'enwik8': 'http://mattmahoney.net/dc/enwik8.zip',
  'text8': 'http://mattmahoney.net/dc/text8.zip',
  'wikitext103': 'https://s3.amazonaws.com/research.metamind.io/wikitext/wikitext-103-v1.zip',
}
# WikiText-103's files, as shipped, per split.
WIKITEXT_FILES = {
  'train': 'wiki.train.tokens',
  'validation': 'wiki.valid.tokens',
  'test': 'wiki.test.tokens',
}
EOS = '<eos>'  # appended to every line of a word corpus (word id 0)
UNK = '<unk>'  # what a word unseen in train becomes
# What one token of a corpus is; corpus_info tells a spec's.
UNITS = ('byte', 'char', 'word')


def _one_line(text: str, limit: int = 400) -> str:
  text = ' '.join(str(text).split())
  return text if len(text) <= limit else text[: limit - 3] + '...'


def _first_line(exc: BaseException) -> str:
  lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
  return f'{type(exc).__name__}: {lines[0] if lines else ""}'.rstrip(': ')


@contextlib.contextmanager
def _as_data_error(what: str, fix: str):
  """Any failure inside becomes one DataError line: what failed, why (the error's first line)
  and the fix. A DataError passes through as it is."""
  try:
    yield
  except DataError:
    raise
  except Exception as e:  # pylint: disable=broad-exception-caught
    raise DataError(f'{what} ({_first_line(e)}); {fix}') from None


# ----------------------------------------------------------------------------
# Splits.


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
      f'cannot read data file {path} ({_first_line(e)}); check that it is a'
      ' readable text or .gz file.'
    ) from None


# ----------------------------------------------------------------------------
# The default corpus as a TFDS dataset built without TensorFlow.


def default_data_dir() -> pathlib.Path:
  """``$OUROBOROS_DATA_DIR`` or ``~/.cache/ouroboros_jax/tfds``."""
  env = os.environ.get(DEFAULT_DATA_DIR_ENV)
  if env:
    return pathlib.Path(env).expanduser()
  return pathlib.Path('~/.cache/ouroboros_jax/tfds').expanduser()


class ShakespeareBytes(tfds.core.GeneratorBasedBuilder, skip_registration=True):
  """The embedded Shakespeare corpus as fixed-size byte chunks per split.

  Each record is ``{'index': chunk number, 'bytes': uint8[<= CHUNK_BYTES]}``;
  TFDS shuffles records on write, so readers sort by ``'index'``. Not added to
  the TFDS registry (so re-importing this module is harmless); construct it
  directly, e.g. ``ShakespeareBytes(data_dir=..., file_format='array_record')``.
  """

  VERSION = tfds.core.Version('1.0.0')
  RELEASE_NOTES = {'1.0.0': 'Initial release: 90/5/5 byte split, 64 KiB chunks.'}
  # TFDS 4.9.x derives code_path for builders in packages via a lazy import of
  # the `importlib_resources` backport, which is not installed on Python >=
  # 3.9; it only uses it to look for a checksums file, so give it directly.
  code_path = epath.Path(__file__)

  def _info(self) -> tfds.core.DatasetInfo:
    # dataset_info_from_configs() needs a TFDS package dir; build it directly.
    return tfds.core.DatasetInfo(
      builder=self,
      description=(
        'Complete works of Shakespeare as raw bytes, split 90/5/5 by'
        ' bytes into train/validation/test, stored in'
        f' {CHUNK_BYTES}-byte chunks.'
      ),
      features=tfds.features.FeaturesDict(
        {
          'index': tfds.features.Scalar(dtype=np.int64),
          'bytes': tfds.features.Tensor(shape=(None,), dtype=np.uint8),
        }
      ),
      homepage='https://www.gutenberg.org/ebooks/100',
      citation='',
    )

  def _split_generators(self, dl_manager):
    del dl_manager  # The corpus ships with the package; nothing to download.
    corpus = read_text_file(DEFAULT_CORPUS_PATH)
    return {
      name: self._generate_examples(corpus[start:stop])
      for name, (start, stop) in split_ranges(len(corpus)).items()
    }

  def _generate_examples(self, split_bytes: bytes):
    for index, start in enumerate(range(0, len(split_bytes), CHUNK_BYTES)):
      chunk_Z = np.frombuffer(split_bytes[start : start + CHUNK_BYTES], dtype=np.uint8)
      yield index, {'index': index, 'bytes': chunk_Z}


@contextlib.contextmanager
def _quiet_tfds() -> Iterator[None]:
  """Hides TFDS progress bars, absl info/warnings and prints while active."""
  from tensorflow_datasets.core.utils import tqdm_utils  # pylint: disable=g-import-not-at-top

  bars_were_on = getattr(tqdm_utils, '_active', True)
  absl_logger = logging.getLogger('absl')
  old_level = absl_logger.level
  stdout = io.StringIO()
  tfds.display_progress_bar(False)
  absl_logger.setLevel(logging.ERROR)
  try:
    # TFDS prints "Downloading and preparing ..." with termcolor.
    with contextlib.redirect_stdout(stdout):
      yield
  finally:
    absl_logger.setLevel(old_level)
    tfds.display_progress_bar(bars_were_on)
    if stdout.getvalue().strip():
      log.debug('tfds: %s', _one_line(stdout.getvalue()))


def prepare_default_corpus(data_dir: str | os.PathLike[str] | None = None) -> ShakespeareBytes:
  """Builds the default corpus dataset once into data_dir; returns the builder.

  A dataset that is already prepared (by this or another process) is reused.
  TFDS writes into an ``incomplete.*`` directory and renames it at the end;
  if another process wins that rename, we reuse its result.
  """
  data_dir = pathlib.Path(data_dir).expanduser() if data_dir else None
  data_dir = data_dir or default_data_dir()
  fix = f'pass a writable --data-dir or set ${DEFAULT_DATA_DIR_ENV}.'
  with _quiet_tfds(), _as_data_error(f'cannot prepare the default corpus in {data_dir}', fix):
    data_dir.mkdir(parents=True, exist_ok=True)
    builder = ShakespeareBytes(data_dir=os.fspath(data_dir), file_format='array_record')
    if builder.is_prepared():
      return builder
    log.info('Preparing %s into %s', builder.name, builder.data_dir)
    try:
      # Built from packaged bytes; never look for a prepared copy on GCS.
      builder.download_and_prepare(
        file_format='array_record',
        download_config=tfds.download.DownloadConfig(try_download_gcs=False),
      )
    except Exception:  # pylint: disable=broad-exception-caught
      # Lost a race with a concurrent process: its rename landed first.
      builder = ShakespeareBytes(data_dir=os.fspath(data_dir), file_format='array_record')
      if not builder.is_prepared():
        raise
      log.info('Reusing %s prepared concurrently by another process', builder.data_dir)
    return builder


def _read_chunked_split(
  source: Sequence[dict[str, Any]], name: str, dataset_dir: str
) -> np.ndarray:
  """Reassembles one split's records in 'index' order into a uint8 array."""
  records = sorted((source[i] for i in range(len(source))), key=lambda r: int(r['index']))
  indices = [int(r['index']) for r in records]
  if indices != list(range(len(records))):
    raise DataError(
      f'default corpus split {name!r} has missing or duplicate chunks;'
      f' delete {dataset_dir} and run again to rebuild it.'
    )
  if not records:
    return np.zeros((0,), np.uint8)
  return np.concatenate([np.asarray(r['bytes'], np.uint8) for r in records])


def _load_default(data_dir) -> dict[str, np.ndarray]:
  builder = prepare_default_corpus(data_dir)
  with _quiet_tfds():
    sources = builder.as_data_source()
  return {name: _read_chunked_split(sources[name], name, builder.data_dir) for name in SPLITS}


# ----------------------------------------------------------------------------
# Other sources.


def _load_text(paths_spec: str) -> dict[str, np.ndarray]:
  paths = [p.strip() for p in paths_spec.split(',') if p.strip()]
  if not paths:
    raise DataError("empty file list in 'text:' spec; use 'text:PATH[,PATH...]'.")
  corpus = b'\n'.join(read_text_file(p) for p in paths)
  return split_corpus(corpus)


def _parse_tfds_spec(rest: str) -> tuple[str, str]:
  """'NAME[:FEATURE]' -> (name, feature); 'name:1.0.0' keeps the version."""
  name, feature = rest, 'text'
  if ':' in rest:
    head, tail = rest.rsplit(':', 1)
    if not re.fullmatch(r'\d+\.\d+\.\d+', tail):
      name, feature = head, tail
  if not name or not feature:
    raise DataError(f"bad spec 'tfds:{rest}'; use 'tfds:NAME[:FEATURE]', e.g. 'tfds:lm1b:text'.")
  return name, feature


def _join_documents(source: Sequence[dict[str, Any]], feature: str) -> bytes:
  """One split's UTF-8 documents, in the source's record order, joined."""
  docs: list[bytes] = []
  for start in range(0, len(source), 1024):
    keys = list(range(start, min(start + 1024, len(source))))
    getitems = getattr(source, '__getitems__', None)
    records = getitems(keys) if getitems else [source[k] for k in keys]
    for record in records:
      value = record[feature]
      if isinstance(value, np.ndarray) and value.ndim == 0:
        value = value.item()
      if isinstance(value, str):
        value = value.encode('utf-8')
      if not isinstance(value, bytes):
        raise DataError(
          f'TFDS feature {feature!r} is not text (got'
          f" {type(value).__name__}); use 'tfds:NAME:FEATURE' with a text"
          ' feature.'
        )
      docs.append(value)
  return b'\n'.join(docs)


def _tfds_fix(exc: BaseException, default: str) -> str:
  if isinstance(exc, ModuleNotFoundError) and exc.name:
    # e.g. TFDS 4.9.x needs the `importlib_resources` backport to prepare
    # catalog datasets.
    return f'pip install {exc.name.replace("_", "-")}'
  return default


def _tfds_builder(name: str, data_dir, download: bool):
  """A prepared TFDS builder for name; only with download may TFDS fetch data.

  ``tfds.builder(try_gcs=False)`` reads dataset_info.json from data_dir or the
  dataset's code and makes no network call (TFDS 4.9.x also disables its GCS
  lookups); the network is only reached by ``download_and_prepare``, which
  runs only when ``download`` is set.
  """
  data_dir = os.fspath(data_dir) if data_dir else None
  where = f'in {data_dir}' if data_dir else 'in the TFDS data dir'
  build_cmd = f'tfds build {name} --file_format=array_record --data_dir {data_dir or "DIR"}'
  try:
    namespace = tfds.core.naming.parse_builder_name_kwargs(name)[0].namespace
  except Exception as e:  # pylint: disable=broad-exception-caught
    raise DataError(
      f'bad TFDS dataset name {name!r} ({_first_line(e)}); use'
      " 'tfds:NAME[:FEATURE]', e.g. 'tfds:lm1b:text'."
    ) from None
  if namespace and not download:
    # tfds.builder resolves namespaced datasets (huggingface:, kaggle:, ...)
    # over the network.
    raise DataError(
      f'TFDS dataset {name!r} is in namespace {namespace!r}, which TFDS'
      ' resolves over the network; pass --download to allow that.'
    )
  try:
    with _quiet_tfds():
      builder = tfds.builder(name, data_dir=data_dir, try_gcs=False)
      if builder.is_prepared():
        return builder
  except Exception as e:  # pylint: disable=broad-exception-caught
    fix = _tfds_fix(e, f'check the name and --data-dir, or prepare it with `{build_cmd}`')
    raise DataError(
      f'cannot load TFDS dataset {name!r} {where} ({_first_line(e)}); {fix}.'
    ) from None
  root = builder.data_dir_root
  if not download:
    raise DataError(
      f'TFDS dataset {name!r} is not prepared in {root} and nothing is'
      f' downloaded without --download; prepare it with `tfds build {name}'
      f' --file_format=array_record --data_dir {root}`, or pass --download'
      ' to let TFDS download and prepare it.'
    )
  log.info('Downloading and preparing TFDS dataset %s into %s', name, root)
  try:
    with _quiet_tfds():
      builder = tfds.builder(name, data_dir=data_dir, try_gcs=False, file_format='array_record')
      builder.download_and_prepare(file_format='array_record')
  except Exception as e:  # pylint: disable=broad-exception-caught
    fix = _tfds_fix(
      e, f'check the network and disk space, or prepare it yourself with `{build_cmd}`'
    )
    raise DataError(
      f'cannot download and prepare TFDS dataset {name!r} in {root} ({_first_line(e)}); {fix}.'
    ) from None
  return builder


def _load_tfds(rest: str, data_dir, download: bool) -> dict[str, np.ndarray]:
  """Reads a TFDS text dataset; see load_splits for how splits are chosen."""
  name, feature = _parse_tfds_spec(rest)
  builder = _tfds_builder(name, data_dir, download)
  log.info('Reading TFDS dataset %s from %s', name, builder.data_dir)
  fix = (
    f'rebuild it with `tfds build {name} --file_format=array_record --data_dir '
    f'{builder.data_dir_root}`.'
  )
  with (
    _quiet_tfds(),
    _as_data_error(f'cannot read TFDS dataset {name!r} in {builder.data_dir}', fix),
  ):
    sources = builder.as_data_source()
  sources = {str(k): v for k, v in sources.items()}
  if 'train' not in sources:
    raise DataError(
      f'TFDS dataset {name!r} has no train split (splits:'
      f' {sorted(sources)}); use a dataset with a train split.'
    )
  features = sources['train'].dataset_info.features
  if feature not in features:
    raise DataError(
      f'TFDS dataset {name!r} has no feature {feature!r} (features:'
      f" {sorted(features.keys())}); use 'tfds:{name}:FEATURE'."
    )
  stream = {k: _join_documents(v, feature) for k, v in sources.items() if k in SPLITS}
  if 'validation' in stream and 'test' in stream:
    pass
  elif 'validation' in stream or 'test' in stream:
    # Carve the missing split from the end of train (5% of train's bytes).
    train = stream['train']
    n_carve = len(train) * 5 // 100
    missing = 'test' if 'validation' in stream else 'validation'
    stream['train'], stream[missing] = (
      train[: len(train) - n_carve],
      train[len(train) - n_carve :],
    )
  else:
    return split_corpus(stream['train'])
  return {k: np.frombuffer(stream[k], dtype=np.uint8) for k in SPLITS}


# ----------------------------------------------------------------------------
# The Transformer-XL paper's corpora, from local files.


def canonical_split_ranges() -> dict[str, tuple[int, int]]:
  """The [start, stop) byte range of each split of enwik8 and text8.

  As Transformer-XL's ``prep_enwik8.py``/``prep_text8.py``: the last 5% of
  :data:`CANONICAL_BYTES` is test, the 5% before it validation, the rest
  train; for the real 100,000,000-byte files, 90M/5M/5M. Computed from the
  module constant at call time, so a test that sets ``CANONICAL_BYTES = 2000``
  gets 1800/100/100.
  """
  total = int(CANONICAL_BYTES)
  n_held = total * 5 // 100
  n_train = total - 2 * n_held
  return {
    'train': (0, n_train),
    'validation': (n_train, n_train + n_held),
    'test': (n_train + n_held, total),
  }


def _path_of(spec_name: str, rest: str, what: str) -> pathlib.Path:
  rest = rest.strip()
  if not rest:
    raise DataError(
      f"empty path in '{spec_name}:' spec; use '{spec_name}:{what}' (from {CORPUS_URLS[spec_name]})."
    )
  return pathlib.Path(rest).expanduser()


def _zip_member(zf: zipfile.ZipFile, name: str) -> zipfile.ZipInfo | None:
  """The member called name (or, failing that, the first whose base name is name)."""
  files = [info for info in zf.infolist() if not info.is_dir()]
  for info in files:
    if info.filename == name:
      return info
  for info in files:
    if posixpath.basename(info.filename) == name:
      return info
  return None


def _read_canonical(name: str, path: pathlib.Path) -> bytes:
  """The bytes of enwik8/text8 from the raw file or its zip, checked to be CANONICAL_BYTES long.

  The size is checked before anything is read (a zip member by its header).
  """
  fix_file = f'pass the unmodified {name} or {name}.zip (from {CORPUS_URLS[name]})'
  if not path.exists():
    raise DataError(f'{name} file not found: {path}; {fix_file}.')
  if path.is_dir():
    raise DataError(f'{name} path {path} is a directory, not a file; {fix_file}.')
  expected = int(CANONICAL_BYTES)
  with _as_data_error(f'cannot read {name} file {path}', f'check that it is readable; {fix_file}.'):
    is_zip = path.suffix.lower() == '.zip' or zipfile.is_zipfile(path)
    if is_zip:
      with zipfile.ZipFile(path) as zf:
        info = _zip_member(zf, name)
        if info is None:
          members = [i.filename for i in zf.infolist()][:5]
          raise DataError(
            f'zip file {path} has no member {name!r} (members: {members}); {fix_file}.'
          )
        where, size = f'{path}:{info.filename}', info.file_size
        if size != expected:
          raise _size_error(name, where, size, expected, fix_file)
        raw = zf.read(info)
    else:
      where, size = str(path), path.stat().st_size
      if size != expected:
        raise _size_error(name, where, size, expected, fix_file)
      raw = path.read_bytes()
  if len(raw) != expected:  # changed while read
    raise _size_error(name, where, len(raw), expected, fix_file)
  return raw


def _size_error(name: str, where: str, size: int, expected: int, fix_file: str) -> DataError:
  return DataError(
    f'{name} file {where} has {size:,} bytes, expected exactly {expected:,} (the canonical'
    f' {name}, split {_split_sizes_text()}); {fix_file}, or use text:PATH for other files.'
  )


def _split_sizes_text() -> str:
  sizes = [stop - start for start, stop in canonical_split_ranges().values()]
  return '/'.join(f'{n:,}' for n in sizes) + ' bytes'


# text8 is lower-case a-z and space only; enwik8 is a MediaWiki XML dump. Both
# are 100M bytes, so these tell a swapped pair apart.
_TEXT8_BYTES = np.zeros(256, bool)
_TEXT8_BYTES[np.frombuffer(b' abcdefghijklmnopqrstuvwxyz', np.uint8)] = True
_ENWIK8_PREFIX = b'<mediawiki'


def _load_enwik8(rest: str) -> dict[str, np.ndarray]:
  path = _path_of('enwik8', rest, 'PATH/enwik8.zip')
  raw = _read_canonical('enwik8', path)
  if not raw.startswith(_ENWIK8_PREFIX):
    raise DataError(
      f'{path} does not start with {_ENWIK8_PREFIX.decode()!r} as enwik8 does (got'
      f' {raw[:16]!r}); pass enwik8 itself (text8 is text8:PATH).'
    )
  return _split_canonical(raw)


def _load_text8(rest: str) -> dict[str, np.ndarray]:
  path = _path_of('text8', rest, 'PATH/text8.zip')
  raw = _read_canonical('text8', path)
  corpus_Z = np.frombuffer(raw, np.uint8)
  ok_Z = _TEXT8_BYTES[corpus_Z]
  if not ok_Z.all():
    first = int(np.argmin(ok_Z))
    raise DataError(
      f'{path} holds byte {int(corpus_Z[first])} at offset {first}, but text8 holds only'
      " 'a'-'z' and space; pass text8 itself (enwik8 is enwik8:PATH)."
    )
  return _split_canonical(raw)


def _split_canonical(raw: bytes) -> dict[str, np.ndarray]:
  corpus_Z = np.frombuffer(raw, np.uint8)
  return {name: corpus_Z[start:stop] for name, (start, stop) in canonical_split_ranges().items()}


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


def _wikitext_paths(rest: str) -> dict[str, pathlib.Path]:
  """The three files of a WikiText-103 directory, each checked to exist."""
  directory = _path_of('wikitext103', rest, 'DIR')
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


def _wikitext(rest: str) -> tuple[WordVocab, dict[str, np.ndarray]]:
  paths = _wikitext_paths(rest)
  key = (
    str(paths['train'].parent.resolve()),
    tuple((p.stat().st_size, p.stat().st_mtime_ns) for p in paths.values()),
  )
  if key in _WORD_CACHE:
    return _WORD_CACHE[key]
  log.info('Tokenizing WikiText in %s', paths['train'].parent)
  fix = 'use the files as shipped (UTF-8 text)'
  with _as_data_error(f'cannot read wikitext103 file {paths["train"]}', fix):
    vocab, train_Z = _tokenize_train(paths['train'])
  splits = {'train': train_Z}
  for split in ('validation', 'test'):
    with _as_data_error(f'cannot read wikitext103 file {paths[split]}', fix):
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
  return _wikitext(os.fspath(directory))[0]


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
    splits = _load_default(data_dir)
  elif spec.startswith('text:'):
    splits = _load_text(spec[len('text:') :])
  elif spec.startswith('tfds:'):
    splits = _load_tfds(spec[len('tfds:') :], data_dir, download)
  elif spec.startswith('enwik8:'):
    splits = _load_enwik8(spec[len('enwik8:') :])
  elif spec.startswith('text8:'):
    splits = _load_text8(spec[len('text8:') :])
  elif spec.startswith('wikitext103:'):
    splits = dict(_wikitext(spec[len('wikitext103:') :])[1])
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


# ----------------------------------------------------------------------------
# Windows and iterators.


def _check_positive(**values: int) -> None:
  for name, value in values.items():
    if not isinstance(value, (int, np.integer)) or value <= 0:
      raise DataError(
        f'{name} must be a positive integer, got {value!r}; pass --{name.replace("_", "-")} >= 1.'
      )


def _token_array(tokens: np.ndarray | bytes, split: str) -> np.ndarray:
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


def num_windows(tokens: np.ndarray, seq_len: int) -> int:
  """Number of (seq_len + 1)-token windows at stride seq_len in tokens."""
  _check_positive(seq_len=seq_len)
  return max(0, (len(tokens) - 1) // seq_len)


def _source_index(index, length: int, what: str) -> int:
  """A Grain source's element index, negative ones counted from the end (IndexError outside)."""
  index = int(index)
  if index < 0:
    index += length
  if not 0 <= index < length:
    raise IndexError(f'{what} {index} out of range [0, {length})')
  return index


class WindowSource:
  """Grain random-access source of a split's windows.

  Window i is ``tokens[i*seq_len : i*seq_len + seq_len + 1]``; element i is
  ``{'inputs': window[:-1], 'targets': window[1:]}``, both int32[seq_len].
  Trailing tokens that do not fill a window are not used. tokens may be of any
  integer dtype (uint8 bytes, int32 word ids); it is kept as it is.
  """

  def __init__(self, tokens: np.ndarray, seq_len: int, *, split: str = 'split'):
    _check_positive(seq_len=seq_len)
    self._tokens_Z = _token_array(tokens, split)
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
    index = _source_index(index, self._len, 'window')
    start = index * self._seq_len
    window_L1 = self._tokens_Z[start : start + self._seq_len + 1].astype(np.int32)
    return {'inputs': window_L1[:-1], 'targets': window_L1[1:]}

  def __repr__(self) -> str:
    return (
      f'WindowSource(num_windows={self._len}, seq_len={self._seq_len},'
      f' num_tokens={len(self._tokens_Z)})'
    )


def _check_process(process_index: int, process_count: int, batch_size: int):
  _check_positive(process_count=process_count)
  if not 0 <= process_index < process_count:
    raise DataError(f'process_index must be in [0, {process_count}), got {process_index}.')
  if batch_size % process_count:
    raise DataError(
      f'batch_size {batch_size} is not divisible by process_count'
      f' {process_count}; use a global --batch-size that is a multiple of'
      ' the number of processes.'
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
  tokens: np.ndarray,
  *,
  seq_len: int,
  batch_size: int,
  seed: int,
  process_index: int = 0,
  process_count: int = 1,
  split: str = 'train',
) -> grain.DatasetIterator:
  """Infinite shuffled iterator of training batches (a Grain DatasetIterator).

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
  _check_positive(seq_len=seq_len, batch_size=batch_size)
  _check_process(process_index, process_count, batch_size)
  windows = WindowSource(tokens, seq_len, split=split)
  if len(windows) < batch_size:
    raise DataError(
      f'{split} split has {len(windows)} windows of seq_len + 1 ='
      f' {seq_len + 1} tokens, fewer than batch_size {batch_size}; use a'
      ' smaller --batch-size (or --seq-len).'
    )
  local_batch = batch_size // process_count
  # shuffle before repeat: Grain then reshuffles each epoch (seed + epoch)
  # instead of shuffling one infinite index space.
  ds = grain.MapDataset.source(windows).shuffle(seed=_grain_seed(seed)).repeat()
  # Local batch j*P + p is rows [p*B, (p+1)*B) of global batch j; a strided
  # slice picks this process's local batches and reads only their windows.
  ds = ds.batch(local_batch, drop_remainder=True)
  if process_count > 1:
    ds = ds[process_index::process_count]
  return iter(ds.to_iter_dataset(read_options=_READ_OPTIONS))


def eval_batches(
  tokens: np.ndarray,
  *,
  seq_len: int,
  batch_size: int,
  max_batches: int | None = None,
  process_index: int = 0,
  process_count: int = 1,
  split: str = 'validation',
) -> Iterator[dict[str, np.ndarray]]:
  """Deterministic, unshuffled batches over a split's windows in order.

  The last partial batch is dropped; at most ``max_batches`` batches. Same
  dict format and multi-host slicing as make_train_iterator. Errors are raised
  when called, not on first ``next``.

  Raises:
    DataError: non-positive seq_len/batch_size/max_batches, or a split with
      fewer windows than one batch.
  """
  _check_positive(seq_len=seq_len, batch_size=batch_size)
  if max_batches is not None:
    _check_positive(max_batches=max_batches)
  _check_process(process_index, process_count, batch_size)
  windows = WindowSource(tokens, seq_len, split=split)
  n_batches = len(windows) // batch_size
  if n_batches == 0:
    raise DataError(
      f'{split} split has {len(windows)} windows of seq_len + 1 ='
      f' {seq_len + 1} tokens, fewer than batch_size {batch_size}; use a'
      ' smaller --batch-size (or --seq-len).'
    )
  if max_batches is not None:
    n_batches = min(n_batches, max_batches)
  local_batch = batch_size // process_count
  tokens_Z = _token_array(tokens, split)

  def generate() -> Iterator[dict[str, np.ndarray]]:
    offsets_L1 = np.arange(seq_len + 1)
    for b in range(n_batches):
      first = b * batch_size + process_index * local_batch
      starts_B = (first + np.arange(local_batch)) * seq_len
      windows_BxL1 = tokens_Z[starts_B[:, None] + offsets_L1].astype(np.int32)
      yield {
        'inputs': np.ascontiguousarray(windows_BxL1[:, :-1]),
        'targets': np.ascontiguousarray(windows_BxL1[:, 1:]),
      }

  return generate()


# ----------------------------------------------------------------------------
# Segments: ordered streams, as Transformer-XL's LMOrderedIterator.


class SegmentSource:
  """Grain random-access source of one pass of segment batches, in stream order.

  The split's n tokens are cut into ``batch_size`` contiguous streams of
  ``S = n // batch_size`` tokens; stream b is ``tokens[b*S : (b+1)*S]`` (the
  last ``n - batch_size*S`` tokens are not used). Element j is batch j:
  row b holds ``stream_b[j*L : j*L + L]`` as ``inputs`` and
  ``stream_b[j*L + 1 : j*L + L + 1]`` as ``targets`` (``L = seq_len``), both
  int32. So row b of batch j + 1 continues row b of batch j, which is what a
  recurrent memory (Transformer-XL) needs. There are ``(S - 1) // L`` batches
  (only full ones; a target never leaves its stream).

  Multi-host: ``batch_size`` is the global batch, and process p gets rows
  ``[p*B, (p+1)*B)`` of every batch, ``B = batch_size // process_count``.
  """

  def __init__(
    self,
    tokens: np.ndarray,
    *,
    seq_len: int,
    batch_size: int,
    process_index: int = 0,
    process_count: int = 1,
    split: str = 'split',
  ):
    _check_positive(seq_len=seq_len, batch_size=batch_size)
    _check_process(process_index, process_count, batch_size)
    self._tokens_Z = _token_array(tokens, split)
    self._seq_len = int(seq_len)
    self._stream_len = len(self._tokens_Z) // batch_size
    self._len = max(0, (self._stream_len - 1) // seq_len)
    if self._len == 0:
      raise DataError(
        f'{split} split has {len(self._tokens_Z)} tokens, too few to cut into batch_size'
        f' {batch_size} streams of at least seq_len + 1 = {seq_len + 1} tokens (needs'
        f' {batch_size * (seq_len + 1)}); use a smaller --batch-size or --seq-len.'
      )
    local_batch = batch_size // process_count
    rows_B = process_index * local_batch + np.arange(local_batch)
    self._starts_B = rows_B * self._stream_len
    self._offsets_L1 = np.arange(seq_len + 1)

  @property
  def seq_len(self) -> int:
    return self._seq_len

  @property
  def stream_len(self) -> int:
    """Tokens per stream, ``n // batch_size``."""
    return self._stream_len

  def __len__(self) -> int:
    return self._len

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    index = _source_index(index, self._len, 'segment batch')
    positions_BxL1 = self._starts_B[:, None] + (index * self._seq_len + self._offsets_L1)
    segments_BxL1 = self._tokens_Z[positions_BxL1].astype(np.int32)
    return {
      'inputs': np.ascontiguousarray(segments_BxL1[:, :-1]),
      'targets': np.ascontiguousarray(segments_BxL1[:, 1:]),
    }

  def __repr__(self) -> str:
    return (
      f'SegmentSource(num_batches={self._len}, seq_len={self._seq_len},'
      f' rows={len(self._starts_B)}, stream_len={self._stream_len})'
    )


def make_segment_iterator(
  tokens: np.ndarray,
  *,
  seq_len: int,
  batch_size: int,
  process_index: int = 0,
  process_count: int = 1,
  split: str = 'train',
) -> grain.DatasetIterator:
  """Infinite iterator of ordered segment batches (a Grain DatasetIterator).

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
  segments = SegmentSource(
    tokens,
    seq_len=seq_len,
    batch_size=batch_size,
    process_index=process_index,
    process_count=process_count,
    split=split,
  )
  ds = grain.MapDataset.source(segments).repeat()
  return iter(ds.to_iter_dataset(read_options=_READ_OPTIONS))


def eval_segments(
  tokens: np.ndarray,
  *,
  seq_len: int,
  batch_size: int,
  max_batches: int | None = None,
  process_index: int = 0,
  process_count: int = 1,
  split: str = 'validation',
) -> Iterator[dict[str, np.ndarray]]:
  """One pass of ordered segment batches: the first pass of make_segment_iterator.

  At most ``max_batches`` batches. Same dict format and multi-host rows as
  make_segment_iterator. Errors are raised when called, not on first ``next``.

  Raises:
    DataError: as make_segment_iterator, or a non-positive max_batches.
  """
  if max_batches is not None:
    _check_positive(max_batches=max_batches)
  segments = SegmentSource(
    tokens,
    seq_len=seq_len,
    batch_size=batch_size,
    process_index=process_index,
    process_count=process_count,
    split=split,
  )
  n_batches = len(segments) if max_batches is None else min(len(segments), max_batches)
  return (segments[j] for j in range(n_batches))
