"""The default corpus (``'default'``, ``'shakespeare'``): a TFDS dataset built without TensorFlow.

The embedded Shakespeare (``ouroboros_jax/corpus/shakespeare.txt.gz``) is split 90/5/5 by bytes
and prepared once, as :class:`ShakespeareBytes` (``array_record`` files), into ``data_dir``
(default ``$OUROBOROS_DATA_DIR`` or ``~/.cache/ouroboros_jax/tfds``); it is read back with
``builder.as_data_source()``.
"""

from __future__ import annotations

import logging
import os
import pathlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow_datasets as tfds
from etils import epath

from ouroboros_jax.data.byte_corpus import SPLITS, read_text_file, split_ranges
from ouroboros_jax.data.data_errors import as_data_error
from ouroboros_jax.data.tfds_corpus import quiet_tfds
from ouroboros_jax.errors import DataError

log = logging.getLogger(__name__)

DEFAULT_CORPUS_PATH = pathlib.Path(__file__).resolve().parents[1] / 'corpus' / 'shakespeare.txt.gz'
DEFAULT_DATA_DIR_ENV = 'OUROBOROS_DATA_DIR'
# Bytes per TFDS record of the default corpus; small enough to keep records
# cheap, large enough that there are only ~80 of them.
CHUNK_BYTES = 64 * 1024


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


def prepare_default_corpus(data_dir: str | os.PathLike[str] | None = None) -> ShakespeareBytes:
  """Builds the default corpus dataset once into data_dir; returns the builder.

  A dataset that is already prepared (by this or another process) is reused.
  TFDS writes into an ``incomplete.*`` directory and renames it at the end;
  if another process wins that rename, we reuse its result.
  """
  data_dir = pathlib.Path(data_dir).expanduser() if data_dir else None
  data_dir = data_dir or default_data_dir()
  fix = f'pass a writable --data-dir or set ${DEFAULT_DATA_DIR_ENV}.'
  with quiet_tfds(), as_data_error(f'cannot prepare the default corpus in {data_dir}', fix):
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


def load_default(data_dir) -> dict[str, np.ndarray]:
  """The default corpus's splits, prepared into data_dir first if need be."""
  builder = prepare_default_corpus(data_dir)
  with quiet_tfds():
    sources = builder.as_data_source()
  return {name: _read_chunked_split(sources[name], name, builder.data_dir) for name in SPLITS}
