"""Reading the configs of older runs: config.json and checkpoint metadata written by earlier
versions, brought to today's layout before `TrainConfig.from_dict` builds them (`upgrade`).

    saved before --state-dtype           every state was float32
    the flat layout                      `schedule` a name, `stages`, `stash`, ... beside it
                                         (before the schedule settings were nested)
    saved before --flow                  the Ouroboros ring ran as one batch
    saved before --flow auto             'batch' stored as the other schedules' default
    settings nothing reads               the other schedules' tied gradient, the replay
                                         stash's policy (stored before they were refused)

Standard library only: a dict in, a dict out (the layout `TrainConfig.to_dict` writes).
"""

from __future__ import annotations

from typing import Any, Mapping

# The schedule settings the flat layout kept beside TrainConfig's own (`stages` and `schedule`,
# the name, besides them).
FLAT_SCHEDULE_FIELDS = (
  'data_parallel',
  'clip_norm',
  'microbatches',
  'chunks',
  'stash',
  'stash_policy',
  'stash_memory',
  'forward',
  'flow',
  'sync_warmup_steps',
  'tied_grad',
)


def upgrade(d: Mapping[str, Any]) -> dict[str, Any]:
  """A saved config (`TrainConfig.to_dict`'s output, or an older run's) in today's layout: a new
  dict, its `schedule` a new dict of the nested settings; `d` is left as it was."""
  d = dict(d)
  d.setdefault('state_dtype', 'float32')  # saved before --state-dtype: every state in float32
  schedule = nest_schedule(d)
  upgrade_flow(schedule)
  drop_unread(schedule)
  d['schedule'] = schedule
  return d


def nest_schedule(d: dict[str, Any]) -> dict[str, Any]:
  """The schedule settings of `d` as a new dict, moved out of `d` from the flat layout (runs
  written before the schedule settings were nested: `schedule` a name, `stages`, `stash`, ...
  beside it)."""
  schedule = d.get('schedule', {})
  if not isinstance(schedule, str):
    return dict(schedule)
  schedule = {'name': schedule, 'num_stages': d.pop('stages', 1)}
  for name in FLAT_SCHEDULE_FIELDS:
    if name in d:
      schedule[name] = d.pop(name)
  return schedule


def upgrade_flow(schedule: dict[str, Any]) -> None:
  """Runs written before --flow (the ring ran as one batch) and before --flow auto (the other
  schedules stored the default, 'batch')."""
  if schedule.get('name') == 'ouroboros':
    schedule.setdefault('flow', 'batch')  # saved before --flow: the ring ran as one batch
  elif schedule.get('flow') == 'batch':  # saved as the default before --flow auto
    del schedule['flow']  # (no other schedule has a flow)


def drop_unread(schedule: dict[str, Any]) -> None:
  """Settings saved before they were refused where nothing reads them (every config.json holds
  them, and the stash policy's default was 'all'): the other schedules' tied gradient and the
  replay stash's policy. The other schedules' policy is kept: it recomputes now, and a resume
  does not compare it there (resume.check_resumable)."""
  unread = ('tied_grad',) if schedule.get('name') != 'ouroboros' else ()
  if schedule.get('stash') == 'replay':
    unread = ('stash_policy', *unread)
  for name in unread:
    schedule.pop(name, None)
