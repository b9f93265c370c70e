"""The errors a user can fix, in one place.

Every one of them carries a one-line message that names the problem and the fix; the `ouroboros`
command prints it as `error: <message>` and exits with the error's `exit_code`, never with a
traceback. Anything else that escapes is a bug and keeps its traceback.

A message names a config field as ‹field› or ‹field=value› (`field_ref`). Raised
from a Python call, the error reads as Python (stash='graph'); the command line prints the same
error with its flags (--stash graph), through `render(error.marked, flag_of)`.

    UserError                 base class (exit status 2)
      ConfigError             a setting that cannot work (flags, shapes, plans, combinations)
        CheckpointError       nothing to resume, or a checkpoint that does not fit the flags
          CorruptCheckpointError   a checkpoint that does not read back whole
      DataError               missing, unreadable or unsuitable data
      DiskFullError           a write into the run's directory found no space (names it and the
                              space needed; what was written before is kept whole)
      CheckpointWriteError    a checkpoint could not be written (read-only, forbidden, a path too
                              long, an I/O error): names the path, the cause and the checkpoint
                              to resume from
      NonFiniteLossError      the loss became NaN/Inf (exit status 3; names the last checkpoint)
      PeerLostError           a process of a multi-process run was lost (killed, crashed): names
                              it, the step and the checkpoint to resume from
"""

from __future__ import annotations

import re
from typing import Any, Callable

_FIELD = re.compile(r'‹([a-z_][a-z0-9_]*)(?:=([^›]*))?›')


def field_ref(name: str, value: Any = ...) -> str:
  """A config field (and a value for it) as an error message marks it: ‹name› / ‹name=value›."""
  return f'‹{name}›' if value is ... else f'‹{name}={value!r}›'


def render(message: str, flag_of: Callable[[str], str | None] | None = None) -> str:
  """A message's field references as Python writes them, or with `flag_of` (a field's name ->
  its command-line flag, None for a name that is not a field) as the command line does."""

  def one(match):
    name, value = match.groups()
    flag = flag_of(name) if flag_of else None
    if flag is None:
      return name if value is None else f'{name}={value}'
    if value is None:
      return flag
    value = value.strip('\'"')
    return flag if value == 'True' else f'{flag} {value}'

  return _FIELD.sub(one, message)


class UserError(Exception):
  """A problem the user can fix; str(error) is one line. `marked`: the message with its field
  references (`render`)."""

  exit_code = 2

  def __init__(self, message: Any = ''):
    self.marked = str(message)
    super().__init__(render(self.marked))


class ConfigError(UserError, ValueError):
  """A model or training setting that cannot work; the message says which and how to fix it."""


class CheckpointError(ConfigError):
  """No checkpoint where one is needed, or one that does not fit the flags."""


class CorruptCheckpointError(CheckpointError):
  """A checkpoint that cannot be read back whole; the message names its step and why."""


class DataError(UserError, ValueError):
  """A data problem the user can fix."""

  def __init__(self, message: str):
    super().__init__(_one_line(message))


class DiskFullError(UserError):
  """A write into a run's directory found no space left; the message names the directory, the
  space the run needs there and the checkpoint to resume from."""


class CheckpointWriteError(UserError):
  """A checkpoint could not be written for another reason than space (a read-only or forbidden
  directory, a path too long, an I/O error); the message names the path, the cause and the
  checkpoint to resume from."""


class PeerLostError(UserError, RuntimeError):
  """A peer of a multi-process run was lost (killed, crashed, its host gone): the collectives
  cannot go on. The message names the process, the step and the checkpoint to resume from."""


class CompilerError(UserError, RuntimeError):
  """The XLA compiler refused a setting for another reason than memory (an operation it does
  not implement for that layout); the message gives its first line and the way round."""

  def __init__(self, message: str):
    super().__init__(_one_line(message))


class NonFiniteLossError(UserError, RuntimeError):
  """The loss became NaN/Inf; the message names the step and the last good checkpoint."""

  exit_code = 3


def _one_line(text: str, limit: int = 400) -> str:
  text = ' '.join(str(text).split())
  return text if len(text) <= limit else text[: limit - 3] + '...'
