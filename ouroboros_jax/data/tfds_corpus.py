"""``'tfds:NAME[:FEATURE]'``: a TFDS text dataset as one byte stream per split.

The dataset must already be prepared in ``data_dir`` (``array_record``) unless ``download=True``:
nothing reaches for the network otherwise. Documents are UTF-8 encoded and joined with ``b'\\n'``
in the data source's record order; the whole dataset is read into memory.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import tensorflow_datasets as tfds

from ouroboros_jax.data.byte_corpus import SPLITS, split_corpus
from ouroboros_jax.data.data_errors import as_data_error, first_line, one_line
from ouroboros_jax.errors import DataError

log = logging.getLogger(__name__)


@contextlib.contextmanager
def quiet_tfds() -> Iterator[None]:
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
      log.debug('tfds: %s', one_line(stdout.getvalue()))


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
      f'bad TFDS dataset name {name!r} ({first_line(e)}); use'
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
    with quiet_tfds():
      builder = tfds.builder(name, data_dir=data_dir, try_gcs=False)
      if builder.is_prepared():
        return builder
  except Exception as e:  # pylint: disable=broad-exception-caught
    fix = _tfds_fix(e, f'check the name and --data-dir, or prepare it with `{build_cmd}`')
    raise DataError(
      f'cannot load TFDS dataset {name!r} {where} ({first_line(e)}); {fix}.'
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
    with quiet_tfds():
      builder = tfds.builder(name, data_dir=data_dir, try_gcs=False, file_format='array_record')
      builder.download_and_prepare(file_format='array_record')
  except Exception as e:  # pylint: disable=broad-exception-caught
    fix = _tfds_fix(
      e, f'check the network and disk space, or prepare it yourself with `{build_cmd}`'
    )
    raise DataError(
      f'cannot download and prepare TFDS dataset {name!r} in {root} ({first_line(e)}); {fix}.'
    ) from None
  return builder


def load_tfds(rest: str, data_dir, download: bool) -> dict[str, np.ndarray]:
  """Reads a TFDS text dataset; see load_splits for how splits are chosen."""
  name, feature = _parse_tfds_spec(rest)
  builder = _tfds_builder(name, data_dir, download)
  log.info('Reading TFDS dataset %s from %s', name, builder.data_dir)
  fix = (
    f'rebuild it with `tfds build {name} --file_format=array_record --data_dir '
    f'{builder.data_dir_root}`.'
  )
  with quiet_tfds(), as_data_error(f'cannot read TFDS dataset {name!r} in {builder.data_dir}', fix):
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
