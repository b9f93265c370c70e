"""Tests for ouroboros_jax.data: corpora, splits, windows and iterators."""

import contextlib
import errno
import gzip
import json
import os
import pathlib
import signal
import socket
import time

import numpy as np
import pytest
import tensorflow_datasets as tfds
from etils import epath

from ouroboros_jax import data

SEQ_LEN = 16


# ----------------------------------------------------------------------------
# Helpers and fixtures.


def _raw_default_corpus() -> bytes:
  with gzip.open(data.DEFAULT_CORPUS_PATH, 'rb') as f:
    return f.read()


def _random_bytes(n: int, seed: int = 0) -> bytes:
  return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


@pytest.fixture
def small_corpus(tmp_path) -> tuple[str, bytes]:
  """A 'text:' spec for a random-byte file and the file's bytes."""
  raw = _random_bytes(40_000, seed=1)
  path = tmp_path / 'small.txt'
  path.write_bytes(raw)
  return f'text:{path}', raw


@pytest.fixture
def train_tokens(small_corpus) -> np.ndarray:
  spec, _ = small_corpus
  return data.load_splits(spec)['train']


def _window_ids(tokens: np.ndarray, seq_len: int) -> dict[bytes, int]:
  """Maps each window's input bytes to its index (random bytes: unique)."""
  source = data.WindowSource(tokens, seq_len)
  ids = {source[i]['inputs'].tobytes(): i for i in range(len(source))}
  assert len(ids) == len(source)  # The test corpus really has unique windows.
  return ids


def _ids_of(batches, ids: dict[bytes, int]) -> list[int]:
  return [ids[row.tobytes()] for b in batches for row in b['inputs']]


def _take(it, n: int) -> list[dict[str, np.ndarray]]:
  return [next(it) for _ in range(n)]


def _block_network(monkeypatch) -> list:
  """Makes every connect and DNS lookup fail at once; returns the attempts."""
  attempts = []

  def refuse(*args, **kwargs):
    attempts.append(args)
    raise OSError(errno.ENETUNREACH, 'network is unreachable (test)')

  monkeypatch.setattr(socket.socket, 'connect', refuse)
  monkeypatch.setattr(socket.socket, 'connect_ex', refuse)
  monkeypatch.setattr(socket, 'create_connection', refuse)
  monkeypatch.setattr(socket, 'getaddrinfo', refuse)
  return attempts


@pytest.fixture
def no_network(monkeypatch) -> list:
  return _block_network(monkeypatch)


class _PastDeadline(BaseException):
  """Not an Exception, so retry loops that catch Exception cannot swallow it."""


@contextlib.contextmanager
def _deadline(seconds: float):
  """Aborts the block after `seconds`, so a regression fails instead of hanging."""

  def expire(signum, frame):
    raise _PastDeadline(f'still running after {seconds} s')

  old = signal.signal(signal.SIGALRM, expire)
  signal.setitimer(signal.ITIMER_REAL, seconds)
  try:
    yield
  finally:
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, old)


def _assert_same_batches(a, b) -> None:
  assert len(a) == len(b)
  for x, y in zip(a, b):
    assert x.keys() == y.keys() == {'inputs', 'targets'}
    np.testing.assert_array_equal(x['inputs'], y['inputs'])
    np.testing.assert_array_equal(x['targets'], y['targets'])


# ----------------------------------------------------------------------------
# Default corpus through the TFDS builder.


def test_default_corpus_splits_through_tfds_array_record(tmp_path, monkeypatch, no_network):
  raw = _raw_default_corpus()
  n = len(raw)
  assert n == 5_057_321

  splits = data.load_splits('default', data_dir=tmp_path)
  assert no_network == []  # Built from the packaged bytes, offline.

  assert set(splits) == {'train', 'validation', 'test'}
  assert len(splits['train']) == n * 90 // 100
  assert len(splits['validation']) == n * 5 // 100
  assert len(splits['test']) == n - n * 90 // 100 - n * 5 // 100
  for split in splits.values():
    assert split.dtype == np.uint8
  joined = np.concatenate([splits[k] for k in data.SPLITS]).tobytes()
  assert joined == raw

  # The data really went through array_record files in the data_dir.
  dataset_dir = tmp_path / 'shakespeare_bytes' / '1.0.0'
  files = sorted(p.name for p in dataset_dir.iterdir())
  record_files = [f for f in files if '.array_record' in f]
  assert {f.split('.array_record')[0] for f in record_files} == {
    f'shakespeare_bytes-{s}' for s in data.SPLITS
  }
  assert 'dataset_info.json' in files
  mtimes = {p: p.stat().st_mtime_ns for p in dataset_dir.iterdir()}

  # Preparing again reuses the data: generation would now fail, files stay.
  def _no_generation(self, split_bytes):
    raise AssertionError('dataset was regenerated instead of reused')

  monkeypatch.setattr(data.ShakespeareBytes, '_generate_examples', _no_generation)
  again = data.load_splits('shakespeare', data_dir=tmp_path)
  for k in data.SPLITS:
    np.testing.assert_array_equal(again[k], splits[k])
  assert {p: p.stat().st_mtime_ns for p in dataset_dir.iterdir()} == mtimes


def test_prepare_reuses_dataset_from_concurrent_process(tmp_path, monkeypatch):
  original = data.ShakespeareBytes.download_and_prepare

  def lose_race(self, **kwargs):
    # Another process prepares the same dataset and renames first; ours fails.
    other = data.ShakespeareBytes(data_dir=os.fspath(tmp_path), file_format='array_record')
    original(other, **kwargs)
    raise OSError(f'[Errno 39] Directory not empty: {self.data_dir}')

  monkeypatch.setattr(data.ShakespeareBytes, 'download_and_prepare', lose_race)
  splits = data.load_splits('default', data_dir=tmp_path)
  joined = np.concatenate([splits[k] for k in data.SPLITS]).tobytes()
  assert joined == _raw_default_corpus()


def test_prepare_failure_is_one_line_data_error(tmp_path, monkeypatch):
  def fail(self, **kwargs):
    raise OSError('disk full\nsecond line')

  monkeypatch.setattr(data.ShakespeareBytes, 'download_and_prepare', fail)
  with pytest.raises(data.DataError) as e:
    data.load_splits('default', data_dir=tmp_path / 'cache')
  assert str(tmp_path / 'cache') in str(e.value)
  assert 'disk full' in str(e.value)
  assert '\n' not in str(e.value)


def test_default_data_dir_honours_environment(tmp_path, monkeypatch):
  monkeypatch.setenv(data.DEFAULT_DATA_DIR_ENV, os.fspath(tmp_path / 'x'))
  assert data.default_data_dir() == tmp_path / 'x'
  monkeypatch.delenv(data.DEFAULT_DATA_DIR_ENV)
  assert data.default_data_dir() == (pathlib.Path.home() / '.cache' / 'ouroboros_jax' / 'tfds')


# ----------------------------------------------------------------------------
# Splits.


def test_split_ranges_are_disjoint_and_cover_the_corpus():
  for n in [0, 1, 19, 20, 21, 999, 5_057_321]:
    ranges = data.split_ranges(n)
    assert list(ranges) == ['train', 'validation', 'test']
    assert ranges['train'] == (0, n * 90 // 100)
    assert ranges['validation'] == (n * 90 // 100, n * 90 // 100 + n * 5 // 100)
    assert ranges['train'][1] == ranges['validation'][0]
    assert ranges['validation'][1] == ranges['test'][0]
    assert ranges['test'][1] == n
    assert all(start <= stop for start, stop in ranges.values())


def test_splits_are_disjoint_byte_ranges_and_windows_stay_inside(small_corpus):
  spec, raw = small_corpus
  splits = data.load_splits(spec)
  corpus_Z = np.frombuffer(raw, np.uint8)
  for name, (start, stop) in data.split_ranges(len(raw)).items():
    np.testing.assert_array_equal(splits[name], corpus_Z[start:stop])
  assert np.concatenate([splits[k] for k in data.SPLITS]).tobytes() == raw
  for a in data.SPLITS:
    for b in data.SPLITS:
      if a != b:
        assert not np.shares_memory(splits[a], splits[b])

  # A split's windows only ever read that split's bytes.
  for name, tokens in splits.items():
    source = data.WindowSource(tokens, SEQ_LEN, split=name)
    stream = [source[i]['inputs'] for i in range(len(source))]
    stream.append(source[len(source) - 1]['targets'][-1:])
    covered = np.concatenate(stream)
    assert len(covered) == len(source) * SEQ_LEN + 1 <= len(tokens)
    np.testing.assert_array_equal(covered, tokens[: len(covered)])


# ----------------------------------------------------------------------------
# Windows and eval batches.


def test_windows_are_shifted_by_one_and_equal_raw_bytes():
  tokens = np.frombuffer(_random_bytes(1000, seed=2), np.uint8)
  source = data.WindowSource(tokens, SEQ_LEN)
  assert len(source) == (1000 - 1) // SEQ_LEN == data.num_windows(tokens, SEQ_LEN)
  for i in [0, 1, 30, len(source) - 1]:
    w = source[i]
    assert w['inputs'].shape == w['targets'].shape == (SEQ_LEN,)
    assert w['inputs'].dtype == w['targets'].dtype == np.int32
    start = i * SEQ_LEN
    np.testing.assert_array_equal(w['inputs'], tokens[start : start + SEQ_LEN])
    np.testing.assert_array_equal(w['targets'], tokens[start + 1 : start + SEQ_LEN + 1])
    np.testing.assert_array_equal(w['inputs'][1:], w['targets'][:-1])
  # Consecutive windows share exactly one token.
  assert source[1]['inputs'][0] == source[0]['targets'][-1]
  with pytest.raises(IndexError):
    source[len(source)]  # pylint: disable=pointless-statement


def test_num_windows_edges():
  assert data.num_windows(np.zeros(SEQ_LEN + 1, np.uint8), SEQ_LEN) == 1
  assert data.num_windows(np.zeros(SEQ_LEN, np.uint8), SEQ_LEN) == 0
  assert data.num_windows(np.zeros(0, np.uint8), SEQ_LEN) == 0
  assert data.num_windows(np.zeros(2 * SEQ_LEN + 1, np.uint8), SEQ_LEN) == 2
  assert data.num_windows(np.zeros(2 * SEQ_LEN, np.uint8), SEQ_LEN) == 1


def test_eval_batches_are_windows_in_order():
  tokens = np.frombuffer(_random_bytes(2000, seed=3), np.uint8)
  source = data.WindowSource(tokens, SEQ_LEN)
  batch_size = 8
  batches = list(data.eval_batches(tokens, seq_len=SEQ_LEN, batch_size=batch_size))
  assert len(batches) == len(source) // batch_size  # Partial batch dropped.
  assert len(source) % batch_size != 0  # ... and there was one to drop.
  for b, batch in enumerate(batches):
    assert batch['inputs'].shape == batch['targets'].shape == (batch_size, SEQ_LEN)
    assert batch['inputs'].dtype == batch['targets'].dtype == np.int32
    for r in range(batch_size):
      w = source[b * batch_size + r]
      np.testing.assert_array_equal(batch['inputs'][r], w['inputs'])
      np.testing.assert_array_equal(batch['targets'][r], w['targets'])
  limited = list(data.eval_batches(tokens, seq_len=SEQ_LEN, batch_size=batch_size, max_batches=3))
  _assert_same_batches(limited, batches[:3])
  # Deterministic: a second pass gives the same batches.
  _assert_same_batches(
    list(data.eval_batches(tokens, seq_len=SEQ_LEN, batch_size=batch_size)), batches
  )
  # Process slices of eval batches concatenate to the global batch.
  halves = [
    list(
      data.eval_batches(
        tokens, seq_len=SEQ_LEN, batch_size=batch_size, process_index=p, process_count=2
      )
    )
    for p in range(2)
  ]
  for b, batch in enumerate(batches):
    np.testing.assert_array_equal(
      np.concatenate([halves[0][b]['inputs'], halves[1][b]['inputs']]), batch['inputs']
    )


# ----------------------------------------------------------------------------
# Training iterator.


def test_train_batches_have_the_right_format(train_tokens):
  it = data.make_train_iterator(train_tokens, seq_len=SEQ_LEN, batch_size=4, seed=0)
  ids = _window_ids(train_tokens, SEQ_LEN)
  source = data.WindowSource(train_tokens, SEQ_LEN)
  batch = next(it)
  assert set(batch) == {'inputs', 'targets'}
  for v in batch.values():
    assert isinstance(v, np.ndarray)
    assert v.shape == (4, SEQ_LEN)
    assert v.dtype == np.int32
  for row_in, row_tg in zip(batch['inputs'], batch['targets']):
    # Each row is a real window, with its own targets.
    np.testing.assert_array_equal(row_tg, source[ids[row_in.tobytes()]]['targets'])


def test_train_iterator_is_deterministic_per_seed(train_tokens):
  kwargs = dict(seq_len=SEQ_LEN, batch_size=8)
  a = _take(data.make_train_iterator(train_tokens, seed=7, **kwargs), 20)
  b = _take(data.make_train_iterator(train_tokens, seed=7, **kwargs), 20)
  c = _take(data.make_train_iterator(train_tokens, seed=8, **kwargs), 20)
  _assert_same_batches(a, b)
  ids = _window_ids(train_tokens, SEQ_LEN)
  assert _ids_of(a, ids) != _ids_of(c, ids)


def test_each_epoch_is_a_new_permutation_of_all_windows(train_tokens):
  ids = _window_ids(train_tokens, SEQ_LEN)
  n = len(ids)
  batch_size = 7
  assert n % batch_size != 0  # Batches straddle epoch boundaries.
  it = data.make_train_iterator(train_tokens, seq_len=SEQ_LEN, batch_size=batch_size, seed=0)
  stream = _ids_of(_take(it, -(-3 * n // batch_size)), ids)
  epochs = [stream[e * n : (e + 1) * n] for e in range(3)]
  for epoch in epochs:
    assert sorted(epoch) == list(range(n))  # Every window exactly once.
  assert epochs[0] != list(range(n))  # Shuffled ...
  assert epochs[1] != epochs[0]  # ... and reshuffled every epoch.
  assert epochs[2] != epochs[1]
  assert epochs[2] != epochs[0]


def test_iterator_state_round_trips_through_json(train_tokens):
  kwargs = dict(seq_len=SEQ_LEN, batch_size=8, seed=3)
  it = data.make_train_iterator(train_tokens, **kwargs)
  _take(it, 5)
  state = json.loads(json.dumps(it.get_state()))
  expected = _take(it, 6)
  fresh = data.make_train_iterator(train_tokens, **kwargs)
  first = next(fresh)
  fresh.set_state(state)
  _assert_same_batches(_take(fresh, 6), expected)
  # The state really moved: the restored batches are not the first ones.
  assert not np.array_equal(expected[0]['inputs'], first['inputs'])


@pytest.mark.parametrize('process_count', [2, 4])
def test_process_slices_concatenate_to_the_global_batch(train_tokens, process_count):
  kwargs = dict(seq_len=SEQ_LEN, batch_size=8, seed=5)
  global_batches = _take(data.make_train_iterator(train_tokens, **kwargs), 30)
  per_process = [
    _take(
      data.make_train_iterator(
        train_tokens, process_index=p, process_count=process_count, **kwargs
      ),
      30,
    )
    for p in range(process_count)
  ]
  for step, global_batch in enumerate(global_batches):
    for key in ('inputs', 'targets'):
      parts = [per_process[p][step][key] for p in range(process_count)]
      assert parts[0].shape == (8 // process_count, SEQ_LEN)
      np.testing.assert_array_equal(np.concatenate(parts), global_batch[key])

  # A process's state restores its own stream.
  it = data.make_train_iterator(
    train_tokens, process_index=1, process_count=process_count, **kwargs
  )
  _take(it, 4)
  state = json.loads(json.dumps(it.get_state()))
  fresh = data.make_train_iterator(
    train_tokens, process_index=1, process_count=process_count, **kwargs
  )
  fresh.set_state(state)
  _assert_same_batches(_take(fresh, 3), per_process[1][4:7])


# ----------------------------------------------------------------------------
# Other sources.


def test_text_spec_concatenates_plain_and_gz_files(tmp_path):
  a = b'First file.\nWith two lines.'
  b = _random_bytes(3000, seed=4)
  c = 'Third, gzipped: caf\u00e9.\n'.encode('utf-8')
  (tmp_path / 'a.txt').write_bytes(a)
  (tmp_path / 'b.bin').write_bytes(b)
  with gzip.open(tmp_path / 'c.txt.gz', 'wb') as f:
    f.write(c)
  spec = f'text:{tmp_path / "a.txt"},{tmp_path / "b.bin"},{tmp_path / "c.txt.gz"}'
  splits = data.load_splits(spec)
  expected = a + b'\n' + b + b'\n' + c
  assert np.concatenate([splits[k] for k in data.SPLITS]).tobytes() == expected
  assert len(splits['train']) == len(expected) * 90 // 100
  assert len(splits['validation']) == len(expected) * 5 // 100
  # Order matters: the files are concatenated in the order given.
  swapped = data.load_splits(f'text:{tmp_path / "c.txt.gz"},{tmp_path / "a.txt"}')
  assert np.concatenate([swapped[k] for k in data.SPLITS]).tobytes() == (c + b'\n' + a)


class OuroborosTestDocs(tfds.core.GeneratorBasedBuilder, skip_registration=True):
  """Tiny text dataset with train and test splits and two text features."""

  VERSION = tfds.core.Version('1.0.0')
  code_path = epath.Path(__file__)  # See data.ShakespeareBytes.
  SPLIT_SIZES = {'train': 60, 'test': 10}

  def _info(self):
    return tfds.core.DatasetInfo(
      builder=self,
      description='test documents',
      features=tfds.features.FeaturesDict(
        {
          'text': tfds.features.Text(),
          'title': tfds.features.Text(),
          'id': tfds.features.Scalar(dtype=np.int64),
        }
      ),
    )

  def _split_generators(self, dl_manager):
    return {name: self._generate_examples(name, n) for name, n in self.SPLIT_SIZES.items()}

  def _generate_examples(self, split, n):
    for i in range(n):
      yield (
        f'{split}{i}',
        {'text': f'{split} document {i} \u00e9t\u00e9', 'title': f'{split.upper()}-{i}', 'id': i},
      )


class OuroborosTestTrainOnly(OuroborosTestDocs, skip_registration=True):
  SPLIT_SIZES = {'train': 80}


class OuroborosTestDownload(OuroborosTestDocs):
  """Registered (found by name like a catalog dataset); generated offline."""

  SPLIT_SIZES = {'train': 40, 'validation': 5, 'test': 5}


def _prepare(builder_cls, data_dir) -> None:
  builder_cls(data_dir=os.fspath(data_dir)).download_and_prepare(file_format='array_record')


def test_tfds_spec_reads_prepared_dataset_and_feature(tmp_path, monkeypatch):
  _prepare(OuroborosTestDocs, tmp_path)
  attempts = _block_network(monkeypatch)  # Prepared: read offline.

  splits = data.load_splits('tfds:ouroboros_test_docs:title', data_dir=tmp_path)
  train_docs = [f'TRAIN-{i}'.encode() for i in range(60)]
  test_docs = [f'TEST-{i}'.encode() for i in range(10)]
  # No validation split in the dataset: it is the last 5% of train's bytes.
  train_stream = splits['train'].tobytes() + splits['validation'].tobytes()
  assert len(splits['validation']) == len(train_stream) * 5 // 100 > 0
  assert sorted(train_stream.split(b'\n')) == sorted(train_docs)
  assert sorted(splits['test'].tobytes().split(b'\n')) == sorted(test_docs)

  # FEATURE defaults to 'text'; documents are UTF-8.
  text = data.load_splits('tfds:ouroboros_test_docs', data_dir=tmp_path)
  test_text = sorted(text['test'].tobytes().split(b'\n'))
  assert test_text == sorted(f'test document {i} \u00e9t\u00e9'.encode('utf-8') for i in range(10))
  assert attempts == []


def test_tfds_unprepared_dataset_fails_fast_without_network(tmp_path, no_network):
  assert tfds.builder_cls('lm1b')  # A real catalog text dataset.
  start = time.monotonic()
  with _deadline(60), pytest.raises(data.DataError) as e:
    data.load_splits('tfds:lm1b', data_dir=tmp_path)
  elapsed = time.monotonic() - start
  message = str(e.value)
  print(f'unprepared tfds:lm1b failed in {elapsed:.2f} s: {message}')
  assert elapsed < 10
  assert no_network == []  # Not even a DNS lookup.
  assert '\n' not in message
  assert "'lm1b'" in message and str(tmp_path) in message
  assert '--download' in message
  assert f'tfds build lm1b --file_format=array_record --data_dir {tmp_path}' in (message)
  assert list(tmp_path.iterdir()) == []  # Nothing was prepared or downloaded.


def test_tfds_download_prepares_only_when_asked(tmp_path, no_network):
  with _deadline(60):
    message = _error(data.load_splits, 'tfds:ouroboros_test_download', data_dir=tmp_path)
    assert '--download' in message and 'not prepared' in message
    assert not (tmp_path / 'ouroboros_test_download').exists()

    splits = data.load_splits(
      'tfds:ouroboros_test_download:title', data_dir=tmp_path, download=True
    )
  for split, n in OuroborosTestDownload.SPLIT_SIZES.items():
    assert sorted(splits[split].tobytes().split(b'\n')) == sorted(
      f'{split.upper()}-{i}'.encode() for i in range(n)
    )
  files = [p.name for p in (tmp_path / 'ouroboros_test_download' / '1.0.0').iterdir()]
  assert any('.array_record' in f for f in files)
  # Once prepared it is read without --download.
  again = data.load_splits('tfds:ouroboros_test_download:title', data_dir=tmp_path)
  for k in data.SPLITS:
    np.testing.assert_array_equal(again[k], splits[k])
  assert no_network == []


def test_namespaced_tfds_dataset_needs_download(tmp_path, no_network):
  message = _error(data.load_splits, 'tfds:huggingface:some_ds:text', data_dir=tmp_path)
  assert 'huggingface' in message and '--download' in message
  assert no_network == []


def test_tfds_spec_with_only_train_splits_90_5_5(tmp_path):
  _prepare(OuroborosTestTrainOnly, tmp_path)
  splits = data.load_splits('tfds:ouroboros_test_train_only:title', data_dir=tmp_path)
  stream = b''.join(splits[k].tobytes() for k in data.SPLITS)
  assert sorted(stream.split(b'\n')) == sorted(f'TRAIN-{i}'.encode() for i in range(80))
  assert len(splits['train']) == len(stream) * 90 // 100
  assert len(splits['validation']) == len(stream) * 5 // 100


# ----------------------------------------------------------------------------
# Errors.


def _error(fn, *args, **kwargs) -> str:
  with pytest.raises(data.DataError) as e:
    fn(*args, **kwargs)
  message = str(e.value)
  assert '\n' not in message and message.strip() == message and message
  assert isinstance(e.value, ValueError)
  return message


def test_missing_and_unreadable_files_name_the_path(tmp_path):
  missing = tmp_path / 'nope.txt'
  assert str(missing) in _error(data.load_splits, f'text:{missing}')
  message = _error(data.load_splits, f'text:{tmp_path}')  # A directory.
  assert str(tmp_path) in message
  bad_gz = tmp_path / 'bad.txt.gz'
  bad_gz.write_bytes(b'not gzip at all')
  assert str(bad_gz) in _error(data.load_splits, f'text:{bad_gz}')
  # The good file before a missing one does not hide the error.
  good = tmp_path / 'good.txt'
  good.write_bytes(b'x' * 100)
  assert str(missing) in _error(data.load_splits, f'text:{good},{missing}')
  empty = tmp_path / 'empty.txt'
  empty.write_bytes(b'')
  assert 'empty' in _error(data.load_splits, f'text:{empty}')


def test_unknown_spec_names_accepted_forms():
  for spec in ['bogus', 'txt:/x', '', 'tfds']:
    message = _error(data.load_splits, spec)
    assert 'default' in message and 'text:' in message and 'tfds:' in message


def test_tfds_errors(tmp_path, no_network):
  message = _error(data.load_splits, 'tfds:no_such_dataset_ouroboros', data_dir=tmp_path)
  assert 'no_such_dataset_ouroboros' in message
  assert no_network == []
  _prepare(OuroborosTestDocs, tmp_path)
  message = _error(data.load_splits, 'tfds:ouroboros_test_docs:body', data_dir=tmp_path)
  assert "'body'" in message and 'text' in message and 'title' in message
  message = _error(data.load_splits, 'tfds:ouroboros_test_docs:id', data_dir=tmp_path)
  assert "'id'" in message and 'not text' in message
  assert 'tfds:' in _error(data.load_splits, 'tfds:', data_dir=tmp_path)


def test_check_vocab_names_the_vocabulary_and_the_byte_range():
  splits = {
    'train': np.array([0, 65, 200], np.uint8),
    'validation': np.array([10], np.uint8),
    'test': np.zeros(0, np.uint8),
  }
  data.check_vocab(splits, 256)
  data.check_vocab(splits, 201)  # Largest token 200 < 201.
  message = _error(data.check_vocab, splits, 200)
  assert '--vocab-size 200' in message and 'up to 200' in message
  assert '--vocab-size 256 or more' in message
  # Any split counts, not just train.
  splits['test'] = np.array([255], np.uint8)
  message = _error(data.check_vocab, splits, 201)
  assert 'up to 255' in message and '--vocab-size 201' in message
  data.check_vocab({k: np.zeros(0, np.uint8) for k in data.SPLITS}, 1)


def test_split_shorter_than_one_window(tmp_path):
  tokens = np.zeros(10, np.uint8)
  message = _error(data.make_train_iterator, tokens, seq_len=SEQ_LEN, batch_size=1, seed=0)
  assert 'seq_len' in message and '10' in message and str(SEQ_LEN + 1) in message
  assert '--seq-len' in message
  message = _error(data.eval_batches, tokens, seq_len=SEQ_LEN, batch_size=1)
  assert 'validation' in message and 'seq_len' in message
  # A tiny corpus: the validation split is too short for a window.
  path = tmp_path / 'tiny.txt'
  path.write_bytes(b'a' * 200)
  splits = data.load_splits(f'text:{path}')
  assert len(splits['validation']) == 10
  message = _error(
    data.eval_batches, splits['validation'], seq_len=SEQ_LEN, batch_size=1, split='validation'
  )
  assert 'validation split has 10 tokens' in message


def test_fewer_windows_than_batch_size(train_tokens):
  n = data.num_windows(train_tokens, SEQ_LEN)
  message = _error(
    data.make_train_iterator, train_tokens, seq_len=SEQ_LEN, batch_size=n + 1, seed=0
  )
  assert 'batch' in message and str(n) in message
  # Exactly n windows is enough.
  it = data.make_train_iterator(train_tokens, seq_len=SEQ_LEN, batch_size=n, seed=0)
  assert next(it)['inputs'].shape == (n, SEQ_LEN)


def test_non_positive_sizes(train_tokens):
  for bad in [0, -3]:
    assert 'seq_len' in _error(
      data.make_train_iterator, train_tokens, seq_len=bad, batch_size=2, seed=0
    )
    assert 'batch_size' in _error(
      data.make_train_iterator, train_tokens, seq_len=SEQ_LEN, batch_size=bad, seed=0
    )
    assert 'seq_len' in _error(data.eval_batches, train_tokens, seq_len=bad, batch_size=2)
    assert 'batch_size' in _error(data.eval_batches, train_tokens, seq_len=SEQ_LEN, batch_size=bad)
    assert 'seq_len' in _error(data.num_windows, train_tokens, bad)
  assert 'process_count' in _error(
    data.make_train_iterator, train_tokens, seq_len=SEQ_LEN, batch_size=6, seed=0, process_count=4
  )
  assert 'process_index' in _error(
    data.make_train_iterator,
    train_tokens,
    seq_len=SEQ_LEN,
    batch_size=8,
    seed=0,
    process_index=2,
    process_count=2,
  )
  assert 'seed' in _error(
    data.make_train_iterator, train_tokens, seq_len=SEQ_LEN, batch_size=2, seed=-1
  )


def test_windows_and_iterators_keep_word_ids_above_255():
  tokens = np.arange(300, 300 + 20 * SEQ_LEN + 1, dtype=np.int32)  # int32 word ids, not bytes
  source = data.WindowSource(tokens, SEQ_LEN)
  np.testing.assert_array_equal(source[1]['inputs'], tokens[SEQ_LEN : 2 * SEQ_LEN])
  batch = next(data.make_train_iterator(tokens, seq_len=SEQ_LEN, batch_size=4, seed=0))
  assert batch['inputs'].dtype == np.int32 and batch['inputs'].min() >= 300
  np.testing.assert_array_equal(batch['targets'], batch['inputs'] + 1)
  first = next(data.eval_batches(tokens, seq_len=SEQ_LEN, batch_size=2))
  np.testing.assert_array_equal(first['inputs'].ravel(), tokens[: 2 * SEQ_LEN])
  assert 'integer' in _error(data.WindowSource, np.ones(40, np.float32), SEQ_LEN)


# ----------------------------------------------------------------------------
# The public face: data.py re-exports the modules it was split into.

# Every public name of data.py before it was split (and DataError); callers import them from here.
OLD_NAMES = (
  'CANONICAL_BYTES CHUNK_BYTES CORPUS_URLS DEFAULT_CORPUS_PATH DEFAULT_DATA_DIR_ENV EOS SPLITS'
  ' UNITS UNK VOCAB_SIZE WIKITEXT_FILES CorpusInfo DataError SegmentSource ShakespeareBytes'
  ' WindowSource WordVocab canonical_split_ranges check_vocab corpus_info default_data_dir'
  ' eval_batches eval_segments load_splits make_segment_iterator make_train_iterator num_windows'
  ' prepare_default_corpus read_text_file split_corpus split_ranges word_vocab'
).split()


def test_every_old_name_still_imports_from_data():
  import ouroboros_jax
  from ouroboros_jax import errors
  from ouroboros_jax.data import corpora, windows

  assert [name for name in OLD_NAMES if not hasattr(data, name)] == []
  assert sorted(data.__all__) == sorted(set(data.__all__)) and set(OLD_NAMES) <= set(data.__all__)
  assert ouroboros_jax.data is data  # its own package, where the flat layout had it
  assert data.DataError is errors.DataError
  assert data.load_splits is corpora.load_splits
  assert data.make_train_iterator is windows.make_train_iterator


def test_batch_layout_is_checked_when_made_and_names_this_process_rows():
  layout = data.BatchLayout(seq_len=4, batch_size=8, process_index=1, process_count=4)
  assert layout.local_batch == 2
  np.testing.assert_array_equal(layout.local_rows(), [2, 3])
  np.testing.assert_array_equal(data.BatchLayout(seq_len=4, batch_size=3).local_rows(), [0, 1, 2])
  for fields, named in [
    (dict(seq_len=0, batch_size=2), 'seq_len'),
    (dict(seq_len=2, batch_size=-1), 'batch_size'),
    (dict(seq_len=2, batch_size=2, process_count=0), 'process_count'),
    (dict(seq_len=2, batch_size=2, process_index=2, process_count=2), 'process_index'),
    (dict(seq_len=2, batch_size=3, process_count=2), 'process_count'),
  ]:
    assert named in _error(data.BatchLayout, **fields)
  with pytest.raises(TypeError):
    data.BatchLayout(seq_len=4, batch_size=8, seed=0)  # a field it does not have


def test_window_batches_are_the_eval_batches_as_a_random_access_source(train_tokens):
  kwargs = dict(seq_len=SEQ_LEN, batch_size=8, process_index=1, process_count=2)
  source = data.WindowBatches(train_tokens, **kwargs)
  assert len(source) == data.num_windows(train_tokens, SEQ_LEN) // 8
  batches = [source[j] for j in range(len(source))]
  _assert_same_batches(batches, list(data.eval_batches(train_tokens, **kwargs)))
  _assert_same_batches([source[-1]], [source[len(source) - 1]])
  with pytest.raises(IndexError, match='window batch'):
    source[len(source)]
  assert repr(source).startswith(f'WindowBatches(num_batches={len(source)}, seq_len={SEQ_LEN}')
