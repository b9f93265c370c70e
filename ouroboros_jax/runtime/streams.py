"""Standard output and error that outlive their reader.

A run whose output is piped into `head`, or whose terminal or ssh session closed, would die of the
first line it prints after (`BrokenPipeError`, or EIO for a gone terminal) and lose everything
since its last checkpoint. `outlive_readers()` makes such a stream swallow what it is given from
then on: the run goes on to its end (its rows are in OUT/metrics.jsonl, its summary in
OUT/summary.json, its checkpoints as usual), and says so once on the other stream if that one
still has a reader. `silence(stream)` points a stream's file descriptor at /dev/null, so that
nothing fails at exit either (what `sample` does when its reader goes: it stops, quietly, as a
Unix tool does).
"""

from __future__ import annotations

import errno
import os
import sys

# A reader that went away: a closed pipe, or a terminal that hung up.
_GONE = (errno.EPIPE, errno.EIO)


def reader_gone(error: BaseException) -> bool:
  """Whether `error` says a stream's reader went away (not a full disk or a bad descriptor)."""
  return isinstance(error, OSError) and error.errno in _GONE


def silence(stream) -> None:
  """`stream`'s file descriptor now writes to /dev/null (its buffer dropped, no error at exit)."""
  try:
    fd = stream.fileno()
  except (AttributeError, OSError, ValueError):
    return
  devnull = os.open(os.devnull, os.O_WRONLY)
  try:
    os.dup2(devnull, fd)
  finally:
    os.close(devnull)


class _Outliving:
  """A text stream that keeps working when its reader goes away: from then on what is written
  goes to /dev/null. Everything else is the wrapped stream's."""

  def __init__(self, stream, name: str, other: str):
    self._stream, self._name, self._other, self.gone = stream, name, other, False

  def _lost(self) -> None:
    self.gone = True
    silence(self._stream)
    other = getattr(sys, self._other)
    if not getattr(other, 'gone', False):
      try:
        print(
          f'ouroboros: {self._name} lost its reader (a closed pipe or terminal); the run goes on '
          'and prints nothing more there.',
          file=other,
          flush=True,
        )
      except OSError:
        pass

  def write(self, text: str) -> int:
    if self.gone:
      return len(text)
    try:
      return self._stream.write(text)
    except OSError as error:
      if not reader_gone(error):
        raise
      self._lost()
      return len(text)

  def flush(self) -> None:
    if self.gone:
      return
    try:
      self._stream.flush()
    except OSError as error:
      if not reader_gone(error):
        raise
      self._lost()

  def __getattr__(self, name):
    return getattr(self._stream, name)


def outlive_readers() -> None:
  """sys.stdout and sys.stderr outlive their readers (see the module docstring). Idempotent."""
  for name, other in (('stdout', 'stderr'), ('stderr', 'stdout')):
    stream = getattr(sys, name)
    if stream is not None and not isinstance(stream, _Outliving):
      setattr(sys, name, _Outliving(stream, name, other))
