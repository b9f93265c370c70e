"""Tests for the paper's corpora (enwik8, text8, WikiText-103) and ordered segment batches.

The corpora are small synthetic files in the real formats; ``CANONICAL_BYTES`` (set in
``char_corpora``, re-exported by ``data``) is 2000 so that enwik8/text8 split 1800/100/100 as the
real 100M-byte files split 90M/5M/5M.
"""

import json
import zipfile

import numpy as np
import pytest

from ouroboros_jax import data
from ouroboros_jax.data import char_corpora, wikitext

SMALL = 2000  # CANONICAL_BYTES in these tests
SEQ_LEN = 8


@pytest.fixture
def small_canonical(monkeypatch):
  monkeypatch.setattr(char_corpora, 'CANONICAL_BYTES', SMALL)
  return SMALL


def _error(fn, *args, **kwargs) -> str:
  with pytest.raises(data.DataError) as e:
    fn(*args, **kwargs)
  message = str(e.value)
  assert message and '\n' not in message and message.strip() == message
  return message


def _enwik8_bytes(n: int, seed: int = 0) -> bytes:
  head = b'<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.3/">\n'
  rest = np.random.default_rng(seed).integers(0, 256, n - len(head), dtype=np.uint8)
  return head + rest.tobytes()


def _text8_bytes(n: int, seed: int = 0) -> bytes:
  alphabet = np.frombuffer(b' abcdefghijklmnopqrstuvwxyz', np.uint8)
  return alphabet[np.random.default_rng(seed).integers(0, 27, n)].tobytes()


_MAKERS = {'enwik8': _enwik8_bytes, 'text8': _text8_bytes}


def _write(tmp_path, name: str, raw: bytes, as_zip: bool, member: str | None = None):
  if not as_zip:
    path = tmp_path / name
    path.write_bytes(raw)
    return path
  path = tmp_path / f'{name}.zip'
  with zipfile.ZipFile(path, 'w', compression=zipfile.ZIP_DEFLATED) as zf:
    zf.writestr(member or name, raw)
  return path


# ----------------------------------------------------------------------------
# enwik8 and text8.


def test_canonical_split_is_90m_5m_5m_and_scales(monkeypatch):
  assert data.CANONICAL_BYTES == 100_000_000
  assert data.canonical_split_ranges() == {
    'train': (0, 90_000_000),
    'validation': (90_000_000, 95_000_000),
    'test': (95_000_000, 100_000_000),
  }
  monkeypatch.setattr(char_corpora, 'CANONICAL_BYTES', SMALL)
  assert data.canonical_split_ranges() == {
    'train': (0, 1800),
    'validation': (1800, 1900),
    'test': (1900, 2000),
  }


@pytest.mark.parametrize('name', ['enwik8', 'text8'])
@pytest.mark.parametrize('as_zip', [False, True], ids=['raw', 'zip'])
def test_canonical_corpus_splits_and_bytes(tmp_path, small_canonical, name, as_zip):
  raw = _MAKERS[name](SMALL)
  path = _write(tmp_path, name, raw, as_zip)
  splits = data.load_splits(f'{name}:{path}')
  assert {k: len(v) for k, v in splits.items()} == {'train': 1800, 'validation': 100, 'test': 100}
  for v in splits.values():
    assert v.dtype == np.uint8
  assert splits['train'].tobytes() == raw[:1800]
  assert splits['validation'].tobytes() == raw[1800:1900]
  assert splits['test'].tobytes() == raw[1900:]
  info = data.corpus_info(f'{name}:{path}')
  assert info.vocab_size == 256 and info.vocab is None
  assert info.unit == {'enwik8': 'byte', 'text8': 'char'}[name]
  data.check_vocab(splits, info.vocab_size)


def test_zip_member_may_sit_in_a_folder(tmp_path, small_canonical):
  raw = _enwik8_bytes(SMALL, seed=3)
  path = _write(tmp_path, 'enwik8', raw, as_zip=True, member='data/enwik8')
  splits = data.load_splits(f'enwik8:{path}')
  assert np.concatenate([splits[k] for k in data.SPLITS]).tobytes() == raw


@pytest.mark.parametrize('name', ['enwik8', 'text8'])
@pytest.mark.parametrize('as_zip', [False, True], ids=['raw', 'zip'])
def test_wrong_size_names_found_and_expected(tmp_path, small_canonical, name, as_zip):
  path = _write(tmp_path, name, _MAKERS[name](SMALL - 1), as_zip)
  message = _error(data.load_splits, f'{name}:{path}')
  assert str(path) in message
  assert '1,999 bytes' in message and 'exactly 2,000' in message
  assert data.CORPUS_URLS[name] in message  # the fix: the unmodified file


def test_full_size_rule_without_monkeypatch(tmp_path):
  path = _write(tmp_path, 'enwik8', _enwik8_bytes(SMALL), as_zip=False)
  message = _error(data.load_splits, f'enwik8:{path}')
  assert '2,000 bytes' in message and 'exactly 100,000,000' in message


@pytest.mark.parametrize('name', ['enwik8', 'text8'])
def test_missing_unreadable_and_memberless_files(tmp_path, small_canonical, name):
  missing = tmp_path / 'nope' / name
  message = _error(data.load_splits, f'{name}:{missing}')
  assert 'not found' in message and str(missing) in message
  assert data.CORPUS_URLS[name] in message

  message = _error(data.load_splits, f'{name}:{tmp_path}')  # a directory
  assert 'directory' in message and str(tmp_path) in message

  other = _write(tmp_path, name, _MAKERS[name](SMALL), as_zip=True, member='README')
  message = _error(data.load_splits, f'{name}:{other}')
  assert f'no member {name!r}' in message and 'README' in message and str(other) in message

  bad_zip = tmp_path / f'{name}.bad.zip'
  bad_zip.write_bytes(b'not a zip file')
  message = _error(data.load_splits, f'{name}:{bad_zip}')
  assert str(bad_zip) in message and 'BadZipFile' in message

  assert f"'{name}:" in _error(data.load_splits, f'{name}:  ')


def test_swapped_enwik8_and_text8_are_refused(tmp_path, small_canonical):
  text8 = _write(tmp_path, 'text8', _text8_bytes(SMALL), as_zip=False)
  enwik8 = _write(tmp_path, 'enwik8', _enwik8_bytes(SMALL), as_zip=False)
  message = _error(data.load_splits, f'enwik8:{text8}')
  assert '<mediawiki' in message and 'text8:PATH' in message
  message = _error(data.load_splits, f'text8:{enwik8}')
  assert "'a'-'z' and space" in message and 'offset 0' in message


# ----------------------------------------------------------------------------
# WikiText-103.

# In the shipped files' layout: a blank line, a heading, paragraphs, a blank line.
_WT_TRAIN = (
  ' \n = The cat = \n the cat sat on the mat . \n the <unk> sat . \n \n a dog , the cat . \n'
)
_WT_VALID = ' \n the zebra sat . \n'
_WT_TEST = ' the cat ran \n'


def _lines_as_tokens(text: str) -> list[str]:
  """Transformer-XL's wt103 tokenization: split each line, then '<eos>'."""
  return [w for line in text.split('\n')[:-1] for w in [*line.split(), '<eos>']]


@pytest.fixture
def wikitext_dir(tmp_path):
  directory = tmp_path / 'wikitext-103'
  directory.mkdir()
  for split, text in {'train': _WT_TRAIN, 'validation': _WT_VALID, 'test': _WT_TEST}.items():
    (directory / data.WIKITEXT_FILES[split]).write_text(text, encoding='utf-8')
  return directory


def test_wikitext_vocab_from_train_only(wikitext_dir):
  vocab = data.word_vocab(wikitext_dir)
  # '<eos>' first, then by descending train count, ties by word.
  # Case matters ('The' is not 'the'); ties go by code point ('.' < 'cat', ',' < '<unk>' < 'The').
  assert vocab.words == (
    '<eos>',
    'the',
    '.',
    'cat',
    '=',
    'sat',
    ',',
    '<unk>',
    'The',
    'a',
    'dog',
    'mat',
    'on',
  )
  assert vocab.counts == (6, 4, 3, 3, 2, 2, 1, 1, 1, 1, 1, 1, 1)
  assert vocab.eos_id == 0 and vocab.unk_id == 7 and len(vocab) == 13
  assert 'zebra' not in vocab and 'ran' not in vocab  # valid/test words are not counted
  assert vocab.id('zebra') == vocab.unk_id
  info = data.corpus_info(f'wikitext103:{wikitext_dir}')
  assert info == data.CorpusInfo(vocab_size=13, unit='word', vocab=vocab)


def test_wikitext_splits_are_words_with_eos_per_line(wikitext_dir):
  splits = data.load_splits(f'wikitext103:{wikitext_dir}')
  vocab = data.word_vocab(wikitext_dir)
  for split, text in {'train': _WT_TRAIN, 'validation': _WT_VALID, 'test': _WT_TEST}.items():
    tokens = splits[split]
    assert tokens.dtype == np.int32
    expected = [w if w in vocab else '<unk>' for w in _lines_as_tokens(text)]
    assert vocab.decode(tokens) == expected
    np.testing.assert_array_equal(vocab.encode(expected), tokens)
    assert np.count_nonzero(tokens == vocab.eos_id) == text.count('\n')  # empty lines too
  assert vocab.decode(splits['validation']) == ['<eos>', 'the', '<unk>', 'sat', '.', '<eos>']
  data.check_vocab(splits, len(vocab))
  message = _error(data.check_vocab, splits, len(vocab) - 1)
  assert 'word ids up to 12' in message and '--vocab-size 13 or more' in message

  # The windows and iterators take int32 word ids as they are.
  batch = next(iter(data.eval_batches(splits['train'], seq_len=4, batch_size=2)))
  np.testing.assert_array_equal(batch['inputs'].ravel(), splits['train'][:8])


def test_wikitext_without_unk_in_train_appends_it(wikitext_dir):
  (wikitext_dir / 'wiki.train.tokens').write_text('b a b\n', encoding='utf-8')
  vocab = data.word_vocab(wikitext_dir)
  assert vocab.words == ('<eos>', 'b', 'a', '<unk>') and vocab.counts == (1, 2, 1, 0)
  splits = data.load_splits(f'wikitext103:{wikitext_dir}')
  assert vocab.decode(splits['test']) == ['<unk>', '<unk>', '<unk>', '<eos>']  # ' the cat ran '
  assert vocab.decode(splits['train']) == ['b', 'a', 'b', '<eos>']


def test_wikitext_is_tokenized_once_and_not_written(wikitext_dir, monkeypatch):
  before = sorted(p.name for p in wikitext_dir.iterdir())
  first = data.load_splits(f'wikitext103:{wikitext_dir}')

  def again(*args):
    raise AssertionError('tokenized twice')

  monkeypatch.setattr(wikitext, '_tokenize_train', again)
  second = data.load_splits(f'wikitext103:{wikitext_dir}')
  for k in data.SPLITS:
    assert second[k] is first[k]
    assert not second[k].flags.writeable
  data.corpus_info(f'wikitext103:{wikitext_dir}')
  assert sorted(p.name for p in wikitext_dir.iterdir()) == before


def test_wikitext_errors_name_the_problem(tmp_path, wikitext_dir):
  missing = tmp_path / 'nowhere'
  message = _error(data.load_splits, f'wikitext103:{missing}')
  assert 'not found' in message and str(missing) in message and 'wiki.train.tokens' in message

  (wikitext_dir / 'wiki.valid.tokens').unlink()
  message = _error(data.load_splits, f'wikitext103:{wikitext_dir}')
  assert 'lacks wiki.valid.tokens' in message
  assert all(name in message for name in data.WIKITEXT_FILES.values())
  (wikitext_dir / 'wiki.test.tokens').unlink()
  message = _error(data.corpus_info, f'wikitext103:{wikitext_dir}')
  assert 'lacks wiki.valid.tokens, wiki.test.tokens' in message

  (wikitext_dir / 'wiki.valid.tokens').write_text(_WT_VALID, encoding='utf-8')
  (wikitext_dir / 'wiki.test.tokens').write_text(_WT_TEST, encoding='utf-8')
  (wikitext_dir / 'wiki.train.tokens').write_text(' \n \n', encoding='utf-8')
  message = _error(data.load_splits, f'wikitext103:{wikitext_dir}')
  assert 'no words' in message and 'wiki.train.tokens' in message
  (wikitext_dir / 'wiki.train.tokens').write_bytes(b'')
  assert 'no words' in _error(data.word_vocab, wikitext_dir)

  (wikitext_dir / 'wiki.train.tokens').write_bytes(b'caf\xe9 \n')  # Latin-1, not UTF-8
  message = _error(data.load_splits, f'wikitext103:{wikitext_dir}')
  assert 'UnicodeDecodeError' in message and 'wiki.train.tokens' in message

  file_path = wikitext_dir / 'wiki.test.tokens'
  assert 'not a directory' in _error(data.load_splits, f'wikitext103:{file_path}')


def test_spec_help_and_corpus_info_of_byte_specs():
  for spec in ['default', 'shakespeare', 'text:/x', 'tfds:lm1b', 'enwik8:/x']:
    assert data.corpus_info(spec) == data.CorpusInfo(vocab_size=256, unit='byte')
  message = _error(data.corpus_info, 'wt103:/x')
  for form in ['enwik8:PATH', 'text8:PATH', 'wikitext103:DIR']:
    assert form in message
    assert form in _error(data.load_splits, 'bogus')


# ----------------------------------------------------------------------------
# Ordered segment batches.


def _ids(n: int) -> np.ndarray:
  """Distinct int32 ids (above 255: word ids survive as they are)."""
  return np.arange(1000, 1000 + n, dtype=np.int32)


def _reference_batches(tokens, seq_len, batch_size):
  """Transformer-XL's LMOrderedIterator, full batches only."""
  stream_len = len(tokens) // batch_size
  streams_BxS = tokens[: stream_len * batch_size].reshape(batch_size, stream_len)
  return [
    {
      'inputs': streams_BxS[:, j * seq_len : (j + 1) * seq_len],
      'targets': streams_BxS[:, j * seq_len + 1 : (j + 1) * seq_len + 1],
    }
    for j in range((stream_len - 1) // seq_len)
  ]


def _assert_same(a, b) -> None:
  assert len(a) == len(b)
  for x, y in zip(a, b):
    assert x.keys() == y.keys() == {'inputs', 'targets'}
    np.testing.assert_array_equal(x['inputs'], y['inputs'])
    np.testing.assert_array_equal(x['targets'], y['targets'])


def _take(it, n: int):
  return [next(it) for _ in range(n)]


def test_segments_continue_their_streams():
  n, batch_size = 1003, 4
  tokens = _ids(n)
  stream_len = n // batch_size  # 250
  n_batches = (stream_len - 1) // SEQ_LEN  # 31
  it = data.make_segment_iterator(tokens, seq_len=SEQ_LEN, batch_size=batch_size)
  batches = _take(it, n_batches)
  _assert_same(batches, _reference_batches(tokens, SEQ_LEN, batch_size))
  for batch in batches:
    assert batch['inputs'].shape == batch['targets'].shape == (batch_size, SEQ_LEN)
    assert batch['inputs'].dtype == batch['targets'].dtype == np.int32
    np.testing.assert_array_equal(batch['inputs'][:, 1:], batch['targets'][:, :-1])
  # Stream b starts at b * (n // batch_size).
  np.testing.assert_array_equal(batches[0]['inputs'][:, 0], tokens[np.arange(4) * stream_len])
  # Row b of batch j + 1 continues row b of batch j.
  # Row b of batch j + 1 continues row b of batch j: its first input is the last target.
  for j in range(n_batches - 1):
    np.testing.assert_array_equal(batches[j + 1]['inputs'][:, 0], batches[j]['targets'][:, -1])
    np.testing.assert_array_equal(batches[j + 1]['inputs'][:, 0], batches[j]['inputs'][:, -1] + 1)
  # Targets never leave their stream (the last stream token is tokens[(b + 1) * S - 1]).
  assert np.all(batches[-1]['targets'][:, -1] <= tokens[np.arange(1, 5) * stream_len - 1])
  # After the last full batch, the next pass starts again at batch 0.
  _assert_same(_take(it, n_batches + 2), batches + batches[:2])


def test_segment_iterator_resumes_from_its_state():
  tokens = _ids(600)
  kwargs = dict(seq_len=SEQ_LEN, batch_size=3)
  it = data.make_segment_iterator(tokens, **kwargs)
  n_batches = len(data.SegmentSource(tokens, **kwargs))
  _take(it, n_batches - 2)  # the state crosses a pass boundary below
  state = json.loads(json.dumps(it.get_state()))
  expected = _take(it, 5)
  fresh = data.make_segment_iterator(tokens, **kwargs)
  first = next(fresh)
  fresh.set_state(state)
  _assert_same(_take(fresh, 5), expected)
  assert not np.array_equal(expected[0]['inputs'], first['inputs'])


@pytest.mark.parametrize('process_count', [2, 4])
def test_segment_process_rows_concatenate_to_the_global_batch(process_count):
  tokens = _ids(2000)
  kwargs = dict(seq_len=SEQ_LEN, batch_size=8)
  n_batches = len(data.SegmentSource(tokens, **kwargs))
  steps = n_batches + 3  # into the second pass
  global_batches = _take(data.make_segment_iterator(tokens, **kwargs), steps)
  per_process = [
    _take(
      data.make_segment_iterator(tokens, process_index=p, process_count=process_count, **kwargs),
      steps,
    )
    for p in range(process_count)
  ]
  for step, global_batch in enumerate(global_batches):
    for key in ('inputs', 'targets'):
      parts = [per_process[p][step][key] for p in range(process_count)]
      assert parts[0].shape == (8 // process_count, SEQ_LEN)
      np.testing.assert_array_equal(np.concatenate(parts), global_batch[key])
  halves = [
    list(data.eval_segments(tokens, process_index=p, process_count=process_count, **kwargs))
    for p in range(process_count)
  ]
  for j, global_batch in enumerate(global_batches[:n_batches]):
    merged = np.concatenate([halves[p][j]['inputs'] for p in range(process_count)])
    np.testing.assert_array_equal(merged, global_batch['inputs'])


def test_eval_segments_is_the_first_pass():
  tokens = _ids(777)
  kwargs = dict(seq_len=SEQ_LEN, batch_size=5)
  n_batches = len(data.SegmentSource(tokens, **kwargs))
  first_pass = _take(data.make_segment_iterator(tokens, **kwargs), n_batches)
  _assert_same(list(data.eval_segments(tokens, **kwargs)), first_pass)
  _assert_same(list(data.eval_segments(tokens, max_batches=3, **kwargs)), first_pass[:3])
  _assert_same(list(data.eval_segments(tokens, max_batches=10**6, **kwargs)), first_pass)


def test_segments_of_bytes_and_edges():
  raw = np.random.default_rng(0).integers(0, 256, 500, dtype=np.uint8)
  batches = list(data.eval_segments(raw, seq_len=SEQ_LEN, batch_size=4))
  _assert_same(batches, _reference_batches(raw.astype(np.int32), SEQ_LEN, 4))
  # Exactly batch_size * (seq_len + 1) tokens: one batch.
  tokens = _ids(4 * (SEQ_LEN + 1))
  assert len(list(data.eval_segments(tokens, seq_len=SEQ_LEN, batch_size=4))) == 1


def test_segment_errors():
  tokens = _ids(4 * (SEQ_LEN + 1) - 1)
  for fn in (data.make_segment_iterator, data.eval_segments):
    message = _error(fn, tokens, seq_len=SEQ_LEN, batch_size=4, split='validation')
    assert 'validation split has 35 tokens' in message and 'needs 36' in message
    assert '--batch-size' in message and '--seq-len' in message
    assert 'seq_len' in _error(fn, tokens, seq_len=0, batch_size=1)
    assert 'batch_size' in _error(fn, tokens, seq_len=2, batch_size=-1)
    assert 'process_count' in _error(fn, tokens, seq_len=2, batch_size=3, process_count=2)
    assert 'process_index' in _error(
      fn, tokens, seq_len=2, batch_size=2, process_index=2, process_count=2
    )
  assert 'max_batches' in _error(data.eval_segments, tokens, seq_len=2, batch_size=1, max_batches=0)
  assert 'integer' in _error(data.eval_segments, np.ones(40, np.float32), seq_len=2, batch_size=1)
