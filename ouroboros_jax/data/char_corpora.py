"""``'enwik8:PATH'`` and ``'text8:PATH'``: the Transformer-XL paper's character corpora.

From local files only (never downloaded): PATH is the raw 100,000,000-byte file (``enwik8``,
``text8``) or the zip that holds it (``enwik8.zip``, ``text8.zip`` from
http://mattmahoney.net/dc/). The split is the canonical one of Transformer-XL's
``prep_enwik8.py``/``prep_text8.py``: train the first 90M bytes, validation the next 5M, test the
last 5M (see :data:`CANONICAL_BYTES` and :func:`canonical_split_ranges`). Tokens are the bytes;
text8 holds only ``a``-``z`` and space, kept as their byte values.
"""

from __future__ import annotations

import pathlib
import posixpath
import zipfile

import numpy as np

from ouroboros_jax.data.data_errors import as_data_error
from ouroboros_jax.errors import DataError

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


def corpus_path(spec_name: str, rest: str, what: str) -> pathlib.Path:
  """The path of a ``'NAME:PATH'`` spec (rest is PATH); DataError for an empty one."""
  rest = rest.strip()
  if not rest:
    raise DataError(
      f"empty path in '{spec_name}:' spec; use '{spec_name}:{what}' "
      f'(from {CORPUS_URLS[spec_name]}).'
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
  with as_data_error(f'cannot read {name} file {path}', f'check that it is readable; {fix_file}.'):
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


def load_enwik8(rest: str) -> dict[str, np.ndarray]:
  """The canonical splits of ``'enwik8:PATH'`` (rest is PATH)."""
  path = corpus_path('enwik8', rest, 'PATH/enwik8.zip')
  raw = _read_canonical('enwik8', path)
  if not raw.startswith(_ENWIK8_PREFIX):
    raise DataError(
      f'{path} does not start with {_ENWIK8_PREFIX.decode()!r} as enwik8 does (got'
      f' {raw[:16]!r}); pass enwik8 itself (text8 is text8:PATH).'
    )
  return _split_canonical(raw)


def load_text8(rest: str) -> dict[str, np.ndarray]:
  """The canonical splits of ``'text8:PATH'`` (rest is PATH)."""
  path = corpus_path('text8', rest, 'PATH/text8.zip')
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
