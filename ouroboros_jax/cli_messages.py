"""The `ouroboros` command's lines for a failure or a stop: a user error's exit status and its
message on one line (`exit_code`, `one_line`), memory that ran out with the sizes that fill it
and what spreads a step (`out_of_memory_message`), what a stopped run leaves to resume from
(`stopped_message`), and the line of a process the watchdog ends (`hard_stop_message`).
"""

from __future__ import annotations

import argparse
import os
import signal

from ouroboros_jax import errors
from ouroboros_jax.choices import MICROBATCHED
from ouroboros_jax.cli_parsers import EXIT_USAGE, config_from_args
from ouroboros_jax.runtime import watchdog
from ouroboros_jax.training import field_flags


def exit_code(exc: BaseException) -> int | None:
  """The exit status of a user error (2; 3 for a NaN/Inf loss), or None for a bug."""
  return exc.exit_code if isinstance(exc, errors.UserError) else None


def failure(args: argparse.Namespace, exc: BaseException) -> tuple[str | None, int | None]:
  """The line and exit status of a command that raised `exc`: a user error's (a lost peer
  included), or out of memory's (status 2); (None, None) for a bug."""
  from ouroboros_jax.runtime import distributed

  if distributed.is_peer_lost(exc):  # one line instead of XLA's traceback
    exc = errors.PeerLostError(distributed.peer_lost_message('its connection closed'))
  code = exit_code(exc)
  message = one_line(exc) if code is not None else None
  if code is None and out_of_memory(exc):
    message, code = out_of_memory_message(args, exc), EXIT_USAGE
  return message, code


def out_of_memory(exc: BaseException) -> bool:
  """Host or device memory ran out (a size the machine cannot hold, not a bug)."""
  text = str(exc)
  return isinstance(exc, MemoryError) or 'RESOURCE_EXHAUSTED' in text or ('Out of memory' in text)


def out_of_memory_message(args: argparse.Namespace, exc: BaseException) -> str:
  """The one line for `out_of_memory(exc)`: the sizes that fill memory, with their values, and
  what spreads a `train` step over more devices."""
  head = f'out of memory ({one_line(exc)[:200]})'
  try:
    cfg = config_from_args(args) if args.command in ('train', 'bench', 'compile', 'plan') else None
  except errors.UserError:
    cfg = None
  if cfg is None:
    return f'{head}; use a machine with more memory.'
  model, run = cfg.model, cfg.schedule_config()
  sizes = [f'--seq-len (now {model.seq_len}; attention memory grows with its square)']
  if model.mem_len:
    sizes.append(f'--mem-len (now {model.mem_len})')
  sizes += [
    f'{field_flags.flag(name)} (now {value})'
    for name, value in (
      ('batch_size', cfg.batch_size),
      ('d_model', model.d_model),
      ('d_ff', model.d_ff),
      ('num_layers', model.num_layers),
      ('vocab_size', model.vocab_size),
    )
  ]
  spread = []
  if args.command == 'train':
    if run.name in MICROBATCHED:
      spread.append(f'more --microbatches (now {run.num_microbatches})')
    if run.name in ('backprop', 'data_parallel'):
      spread.append('--schedule gpipe or ouroboros with --stages N (the layers cut over N devices)')
    elif run.num_stages < model.num_layers:
      spread.append(f'more --stages (now {run.num_stages})')
    if not run.replays and run.resolved_stash_policy != 'nothing':  # the least a forward keeps
      spread.append('--stash-policy nothing')
    if run.name == 'ouroboros':
      if run.stash_memory == 'device':
        spread.append('--stash-memory balanced or pinned_host')
      if run.stash == 'graph':
        spread.append('--stash replay')
  spread.append('more devices')
  return (
    f'{head}; lower {", ".join(sizes[:-1])} or {sizes[-1]}; or use {", ".join(spread)} '
    '(`ouroboros plan` lists what fits).'
  )


def hard_stop_message(args):
  """The line of a process the watchdog ends (`runtime/watchdog.py`): (signum, steady, signals)
  -> text.
  It runs on the watchdog's thread, which must not import or block: OUT is worked out now."""
  out = None
  if args.command == 'train':
    try:
      out = config_from_args(args).out_dir
    except Exception:  # pylint: disable=broad-exception-caught  (its own error comes later)
      out = None

  def message(signum: int, steady: bool, signals: int = 1) -> str:
    name = signal.Signals(signum).name
    what = 'interrupted' if signum == signal.SIGINT else f'stopped by {name}'
    if out is None:
      return f'{what} during set-up, while XLA was busy (compiling or allocating).'
    where = os.path.join(out, 'checkpoints')  # checkpoint.SUBDIR (importing it loads Orbax)
    try:
      saved = any(entry.isdigit() for entry in os.listdir(where))
    except OSError:
      saved = False
    if saved:
      then = f'continue from the latest checkpoint in {where} with --resume'
    elif not steady:  # no metrics row yet: the same OUT takes the run again
      then = f'no checkpoint in {where}: run it again'
    else:
      then = (
        f'no checkpoint in {where}: start again with another --out (or remove its metrics.jsonl '
        'and config.json)'
      )
    if not steady:
      return f'{what} during set-up, while XLA was busy (compiling or allocating); {then}.'
    why = (
      'a second signal came'
      if signals > 1
      else f'XLA held the run past {watchdog.STEADY_GRACE_S:g} s'
    )
    return f'{what} at once ({why}); the steps after the latest checkpoint are lost; {then}.'

  return message


def stopped_message(args, signum: int) -> str:
  """What a stopped command leaves behind: for `train`, the checkpoint to resume from."""
  what = 'interrupted' if signum == signal.SIGINT else f'stopped by {signal.Signals(signum).name}'
  if args.command != 'train':
    return f'{what}.'
  from ouroboros_jax.training import checkpoint

  try:
    out = config_from_args(args).out_dir
    step = checkpoint.latest_step(out)
  except Exception:  # pylint: disable=broad-exception-caught
    return f'{what}; check the checkpoints in --out before resuming.'
  where = checkpoint.checkpoint_dir(out)
  if step is None:
    logged = os.path.join(out, 'metrics.jsonl')
    if not (os.path.exists(logged) and os.path.getsize(logged)):  # nothing a new run would lose
      return f'{what} before the first checkpoint; nothing to resume in {where}: run it again.'
    return (
      f'{what} before the first checkpoint; nothing to resume in {where}: start again with '
      'another --out (or remove its metrics.jsonl and config.json).'
    )
  return (
    f'{what}; the latest complete checkpoint is step {step} in {where}; continue with --resume.'
  )


def one_line(exc: BaseException) -> str:
  """The error's message on one line; a user error's config fields as their flags."""
  if isinstance(exc, errors.UserError):
    return ' '.join(errors.render(exc.marked, field_flags.field_flag).split())
  return ' '.join(str(exc).split())
