"""The errors a user can fix, in one place.

Every one of them carries a one-line message that names the problem and the fix; the `ouroboros`
command prints it as `error: <message>` and exits with the error's `exit_code`, never with a
traceback. Anything else that escapes is a bug and keeps its traceback.

    UserError                 base class (exit status 2)
      ConfigError             a setting that cannot work (flags, shapes, plans, combinations)
        CheckpointError       nothing to resume, or a checkpoint that does not fit the flags
          CorruptCheckpointError   a checkpoint that does not read back whole
      DataError               missing, unreadable or unsuitable data
      NonFiniteLossError      the loss became NaN/Inf (exit status 3; names the last checkpoint)
"""

from __future__ import annotations


class UserError(Exception):
  """A problem the user can fix; str(error) is one line."""

  exit_code = 2


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


class NonFiniteLossError(UserError, RuntimeError):
  """The loss became NaN/Inf; the message names the step and the last good checkpoint."""

  exit_code = 3


def _one_line(text: str, limit: int = 400) -> str:
  text = ' '.join(str(text).split())
  return text if len(text) <= limit else text[: limit - 3] + '...'
