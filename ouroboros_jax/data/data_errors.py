"""How a data failure becomes one DataError line: what failed, why, and the fix."""

from __future__ import annotations

import contextlib

from ouroboros_jax.errors import DataError


def one_line(text: str, limit: int = 400) -> str:
  """text with its whitespace runs as single spaces, cut to limit characters."""
  text = ' '.join(str(text).split())
  return text if len(text) <= limit else text[: limit - 3] + '...'


def first_line(exc: BaseException) -> str:
  """'TypeName: the first non-empty line of the message'."""
  lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
  return f'{type(exc).__name__}: {lines[0] if lines else ""}'.rstrip(': ')


@contextlib.contextmanager
def as_data_error(what: str, fix: str):
  """Any failure inside becomes one DataError line: what failed, why (the error's first line)
  and the fix. A DataError passes through as it is."""
  try:
    yield
  except DataError:
    raise
  except Exception as e:  # pylint: disable=broad-exception-caught
    raise DataError(f'{what} ({first_line(e)}); {fix}') from None
