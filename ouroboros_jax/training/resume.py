"""Resuming a run: which settings must match the checkpoint, and restoring the newest readable
one (moving newer, unreadable ones aside)."""

from __future__ import annotations

import json
import os
import shutil

import jax

from ouroboros_jax.errors import CheckpointError
from ouroboros_jax.models import model as transformer
from ouroboros_jax.schedules import compensation
from ouroboros_jax.training import checkpoint, config, field_flags, metrics, relayout
from ouroboros_jax.training.config import TrainConfig

# Settings that fix the shape of the TrainState or the data stream (with every ModelConfig
# field): resuming needs them unchanged. Flat names, as the flags spell them.
RESUME_FIELDS = (
  'schedule',
  'stages',
  'data_parallel',
  'stash',
  'stash_policy',
  'stash_memory',
  'forward',
  'flow',
  'microbatches',
  'batch_size',
  'seed',
  'data',
  'data_order',
  'pld',
  'std_loss',
  'std_loss_layers',
  'optimizer',
  'compensation',
  'state_dtype',
)


# What --fresh-optimizer lets a resume change: the optimizer state restarts from its init.
OPTIMIZER_FIELDS = ('optimizer', 'state_dtype', 'compensation')


# The layout of Ouroboros' ring buffers, recorded with every checkpoint: the stash in micro-batch
# slots (delays.Timing.stash_slots; issue 58). A checkpoint without it kept whole steps.
RING_LAYOUT = 'micro-batch slots, window'
# The layout before the ring kept the window of items it takes (issue 63's drain): converted.
RING_LAYOUT_WITHOUT_WINDOW = 'micro-batch slots'
# What a stash in host memory holds (--stash-memory pinned_host): the stash alone, the forward's
# weights' versions on the device. A checkpoint without it kept both in host memory.
HOST_LAYOUT = 'stash only'


def run_meta(cfg: TrainConfig, layers_per_stage) -> dict:
  """What every checkpoint records besides the state: the resolved config and the layout."""
  return {
    'schedule': cfg.schedule.name,
    'stages': cfg.schedule.num_stages,
    'layers_per_stage': list(layers_per_stage),
    'ring_layout': RING_LAYOUT,
    'state_form': relayout.PER_LAYER,
    'host_layout': HOST_LAYOUT,
    'config': cfg.to_dict(),
  }


def _check_host_layout(saved: dict, saved_cfg: TrainConfig, where: str) -> None:
  """A CheckpointError for an Ouroboros checkpoint whose host memory held the weights too."""
  in_host = (
    saved_cfg.schedule.name == 'ouroboros' and saved_cfg.schedule.stash_memory == 'pinned_host'
  )
  if in_host and saved.get('host_layout') != HOST_LAYOUT:
    raise CheckpointError(
      f"the checkpoint in {where} was made by an Ouroboros whose host memory held the forward's "
      "weights' versions beside the stash (before they moved to the device): its ring buffers "
      'have another layout and cannot be resumed; finish that run with the version that made '
      'it, or choose another --out.'
    )


def _check_format(saved: dict, where: str) -> None:
  """A CheckpointError for an Ouroboros checkpoint whose ring buffers have an older layout."""
  if _ring_predates_microbatches(saved['config']):
    raise CheckpointError(
      f'the checkpoint in {where} was made by an Ouroboros whose ring stepped on the whole batch '
      '(before micro-batches, and so before --stash-memory): its ring buffers have another layout '
      'and cannot be resumed; finish that run with the version that made it, or choose another '
      '--out.'
    )
  layouts = (RING_LAYOUT, RING_LAYOUT_WITHOUT_WINDOW)
  if saved['schedule'] == 'ouroboros' and saved.get('ring_layout') not in layouts:
    raise CheckpointError(
      f'the checkpoint in {where} was made by an Ouroboros whose stash kept whole steps (before '
      'its stash held micro-batch slots): its ring buffers have another layout and cannot be '
      'resumed; finish that run with the version that made it, or choose another --out.'
    )


def check_resumable(saved: dict, cfg: TrainConfig, layers_per_stage, where: str) -> list[str]:
  """One-line CheckpointError naming the flags to use when the checkpoint does not fit cfg.

  Returns the other settings that differ from the checkpoint's ('--steps 100 -> 200', ...): they
  are allowed (a longer run, another rate) but worth saying.
  """
  _check_format(saved, where)
  saved_cfg = TrainConfig.from_dict(saved['config'])
  _check_host_layout(saved, saved_cfg, where)
  # The resolved runs (`TrainConfig.resolved`), not the spellings: --optimizer auto of a recipe
  # run is muon, --compensation auto predict,dc, --flow auto stream, --attention auto xla here.
  want, have = config.flat(saved_cfg.resolved()), config.flat(cfg.resolved())
  model_fields = [n for n, f in config.fields().items() if f.owner is transformer.ModelConfig]
  # The stash policy shapes only Ouroboros' ring; elsewhere it trades memory for time.
  shaping = [n for n in RESUME_FIELDS if n != 'stash_policy' or have['schedule'] == 'ouroboros']
  names = model_fields + shaping
  wrong = [n for n in names if want[n] != have[n]]
  if tuple(saved['layers_per_stage']) != tuple(layers_per_stage):
    wrong.append('layers_per_stage')
    want['layers_per_stage'] = ','.join(map(str, saved['layers_per_stage']))
    have['layers_per_stage'] = ','.join(map(str, layers_per_stage))
  moved = [n for n in wrong if n in _movable(saved, want, have)]
  wrong = [n for n in wrong if n not in moved]

  def flags(values):
    return ' '.join(
      f'{field_flags.flag(n)} {"none" if values[n] is None else values[n]}' for n in wrong
    )

  if wrong:
    raise CheckpointError(
      f'the checkpoint in {where} was made with {flags(want)} but the flags '
      f"give {flags(have)}; resume with the checkpoint's flags or choose another --out"
      + _why_not_moved(saved, want, wrong)
    )
  ignored = (set(names) | {'out', 'layers_per_stage'}) - set(moved)
  spell = lambda v: 'none' if v is None else v  # as the flag takes it (--momentum none)
  return [
    f'{field_flags.flag(n)} {spell(want[n])} -> {spell(have[n])}'
    for n in have
    if n not in ignored and n in want and want[n] != have[n]
  ]


def move_for(
  saved: dict, cfg: TrainConfig, layers_per_stage: tuple, fresh_opt_state=None
) -> relayout.Move | None:
  """How the saved state becomes the run's (`check_resumable` has allowed it): from the
  per-layer form, re-staged as the run lays it out; an Ouroboros' ring restarted empty where its
  shape changes (nothing is in flight: drained, or an exact schedule's), or given the window it
  lacks (saved before the ring kept one); with --fresh-optimizer, the optimizer state
  `fresh_opt_state` (the run's at its init). None: a checkpoint from before the per-layer form,
  restored as it is."""
  saved_cfg = TrainConfig.from_dict(saved['config'])
  old_layers = tuple(saved['layers_per_stage'])
  want, have = config.flat(saved_cfg.resolved()), config.flat(cfg.resolved())
  # The layers per stage as the run splits them (the config may leave them to the split).
  fields = relayout.LAYOUT_FIELDS + relayout.RING_FIELDS
  shaping = [n for n in fields if n in have and n != 'layers_per_stage']
  ring = 'ouroboros' in (want['schedule'], have['schedule'])
  compensations = saved_cfg.resolved_compensation(), cfg.resolved_compensation()
  remap = compensation.parts(compensations[0]) != compensation.parts(compensations[1])
  changed = old_layers != layers_per_stage or any(want[n] != have[n] for n in shaping) or remap
  fresh = ring and changed
  add_window = not fresh and saved.get('ring_layout') == RING_LAYOUT_WITHOUT_WINDOW
  per_layer = saved.get('state_form') == relayout.PER_LAYER
  fresh_opt_state = fresh_opt_state if cfg.fresh_optimizer else None
  if not (changed or add_window or per_layer or fresh_opt_state is not None):
    return None
  return relayout.Move(
    old_layers,
    layers_per_stage,
    fresh=fresh,
    from_ring=want['schedule'] == 'ouroboros',
    to_ring=have['schedule'] == 'ouroboros',
    add_window=add_window,
    microbatches=cfg.resolved().schedule.microbatches or 1,
    warmup_steps=cfg.schedule.sync_warmup_steps,
    per_layer=per_layer,
    inner_paths=tuple(map(compensation.inner_path, compensations)),
    remap=remap,
    fresh_opt_state=fresh_opt_state,
  )


def _movable(saved: dict, want: dict, have: dict) -> tuple[str, ...]:
  """The settings a resume may change: the layout's where nothing is in flight (an exact
  schedule's state, or a drained ring: `--drain`); a drained ring's own settings and its
  compensations too (the optimizer's own state moves, the compensations' start again)."""
  names = (want['schedule'], have['schedule'])
  optimizer = OPTIMIZER_FIELDS if have.get('fresh_optimizer') else ()
  if 'ouroboros' not in names:
    return relayout.LAYOUT_FIELDS + optimizer
  if not (saved.get('drained') or want['schedule'] != 'ouroboros'):
    return ()
  return relayout.LAYOUT_FIELDS + relayout.RING_FIELDS + ('compensation',) + optimizer


def _why_not_moved(saved: dict, want: dict, wrong: list[str]) -> str:
  """The end of the refusal's line where a layout setting could not move: an undrained ring."""
  movable = relayout.LAYOUT_FIELDS + relayout.RING_FIELDS + ('compensation',)
  undrained = want['schedule'] == 'ouroboros' and not saved.get('drained')
  if not (undrained and any(n in movable for n in wrong)):
    if any(n in OPTIMIZER_FIELDS for n in wrong):
      return " (or pass --fresh-optimizer to start the optimizer's state again)."
    return '.'
  return (
    " (Ouroboros' ring holds work in flight, shaped by its layout: drain it first, resuming "
    'with its flags, --drain and --steps at its step, then move).'
  )


def _ring_predates_microbatches(saved_config: dict) -> bool:
  """An Ouroboros config saved before the ring had micro-batches: it has no stash_memory (the
  field came with them), flat or nested."""
  schedule = saved_config.get('schedule')
  fields = schedule if isinstance(schedule, dict) else saved_config
  name = schedule.get('name') if isinstance(schedule, dict) else schedule
  return name == 'ouroboros' and 'stash_memory' not in fields


def resume_state(
  cfg: TrainConfig, manager, target, layers_per_stage, resume_from, fresh_opt_state=None
):
  """(state, data state, manager) restored from the newest readable checkpoint (or resume_from).

  Newer checkpoints that are unreadable, or newer than resume_from, are moved aside (the run
  will write those steps again) and the manager is reopened on what is left. Says, in one line
  on stdout, the step it resumes from (and the settings that changed); the warnings about
  unreadable checkpoints go to stderr. `fresh_opt_state`: the run's optimizer state at its init,
  which --fresh-optimizer resumes with.
  """
  ckpt_dir = checkpoint.checkpoint_dir(cfg.out_dir)
  changed, moves = [], []

  def check(meta):
    changed[:] = check_resumable(meta, cfg, layers_per_stage, ckpt_dir)
    move = move_for(meta, cfg, tuple(layers_per_stage), fresh_opt_state)
    moves[:] = [move] if move is not None else []
    return moves[0] if moves else None

  state, data_state, step, unreadable = checkpoint.restore_newest(
    manager, target, check, step=resume_from
  )
  newer = [s for s in manager.all_steps() if s > step]
  if newer:
    manager.close()
    where = checkpoint.set_aside(cfg.out_dir, newer)
    logs = _set_aside_logs(cfg.out_dir, where, max(newer))
    print(
      f'moved the checkpoints of steps {sorted(newer)}{logs} to {where} (nothing was deleted).',
      flush=True,
    )
    manager = checkpoint.make_manager(cfg.out_dir, keep=cfg.keep_checkpoints)
  moved = moves[0].describe(target) if moves and moves[0].changed else ''
  line = resuming_line(
    step, ckpt_dir, newest_readable=bool(unreadable), changed=changed, moved=moved
  )
  print(line, flush=True)
  return state, data_state, manager


def _set_aside_logs(out_dir: str, where: str, newest: int) -> str:
  """Keeps the metrics rows and the summary a resume from an earlier step will train over, beside
  the checkpoints it set aside (metrics-until-step-N.jsonl, summary-step-N.json; process 0).
  Returns what it kept, for the line that says so."""
  if jax.process_index() != 0:
    return ''
  kept = []
  for name, kept_as, move in (
    ('metrics.jsonl', f'metrics-until-step-{newest}.jsonl', False),
    ('summary.json', f'summary-step-{newest}.json', True),
  ):
    path = os.path.join(out_dir, name)
    if os.path.exists(path):
      (shutil.move if move else shutil.copyfile)(path, os.path.join(where, kept_as))
      kept.append(name)
  return f', and the {" and ".join(kept)} they belong to,' if kept else ''


def resuming_line(
  step: int, ckpt_dir: str, *, newest_readable: bool, changed: list[str], moved: str = ''
) -> str:
  """'resuming from step 20 in OUT/checkpoints[, the newest readable checkpoint][, with changed
  settings: --steps 30 -> 40][; what a move to another layout did].'"""
  line = f'resuming from step {step} in {ckpt_dir}'
  if newest_readable:
    line += ', the newest readable checkpoint'
  if changed:
    line += f', with changed settings: {"; ".join(changed)}'
  return line + (f'; {moved}.' if moved else '.')


def finished_summary(cfg: TrainConfig, resume_from: int | None) -> dict | None:
  """The summary of the run in OUT when it is finished and `--resume` has nothing to train: its
  summary.json belongs to its newest checkpoint and --steps asks for no more steps. Says so in
  one line, and warns if that checkpoint does not read back; nothing in OUT is written. None
  otherwise (a larger --steps trains on; --resume-from an earlier step trains again from
  there). A finished run whose summary.json is missing or unreadable (its metrics.jsonl holds
  the final test row) is a CheckpointError: evaluating it again would log that row twice."""
  path = os.path.join(cfg.out_dir, 'summary.json')
  try:
    with open(path) as f:
      summary = json.load(f)
    step, damage = int(summary['step']), None
  except (OSError, ValueError, KeyError, TypeError) as e:
    summary, step = None, _tested_step(cfg.out_dir)
    damage = 'is missing' if isinstance(e, FileNotFoundError) else 'does not read back'
  if step is None or checkpoint.latest_step(cfg.out_dir) != step or cfg.steps > step:
    return None
  if resume_from is not None and resume_from != step:
    return None
  if cfg.drain and not _drained(cfg.out_dir, step):  # --drain on a finished run: drain it
    return None
  if summary is None:
    raise CheckpointError(
      f'{cfg.out_dir} holds a run finished at step {step} (metrics.jsonl holds its test row), '
      f'but its {path} {damage}; nothing to resume: put summary.json back, or pass '
      f'{field_flags.flag("steps")} above {step} to train on.'
    )
  print(
    f'{cfg.out_dir} holds a run finished at step {step} ({path}); nothing to resume and '
    f'nothing changed: pass {field_flags.flag("steps")} above {step} to train on.',
    flush=True,
  )
  _warn_if_unreadable(cfg.out_dir, step)
  return summary


def _drained(out_dir: str, step: int) -> bool:
  """Whether the checkpoint of `step` was saved drained (--drain); False if it does not read."""
  manager = checkpoint.make_manager(out_dir, read_only=True)
  try:
    return bool(checkpoint.read_meta(manager, step).get('drained'))
  except Exception:  # pylint: disable=broad-exception-caught  (the resume reports it)
    return False
  finally:
    manager.close()


def _tested_step(out_dir: str) -> int | None:
  """The step of the last test row in OUT's metrics.jsonl (a run logs one when it finishes)."""
  try:
    rows = metrics.read_metrics(os.path.join(out_dir, 'metrics.jsonl'))
  except (OSError, ValueError, CheckpointError):
    return None
  steps = [r.get('step') for r in rows if isinstance(r, dict) and r.get('split') == 'test']
  return steps[-1] if steps else None


def _warn_if_unreadable(out_dir: str, step: int) -> None:
  """Says on stderr if the finished run's checkpoint does not read back whole (to train on from
  it, or to sample from it, would fail)."""
  manager = checkpoint.make_manager(out_dir, read_only=True)
  try:
    checkpoint.restore_single_device(manager, step)
  except CheckpointError as e:
    checkpoint.warn(f'{e}; it cannot be trained on from or sampled.')
  finally:
    manager.close()


def check_out_dir(cfg: TrainConfig, resume: bool) -> None:
  """OUT fits the request: --resume needs a checkpoint there, a fresh run an OUT without an
  earlier run's checkpoints, summary or metrics (an empty or new OUT, or one whose earlier run
  logged nothing)."""
  out_dir, found = cfg.out_dir, checkpoint.latest_step(cfg.out_dir)
  ckpt_dir = checkpoint.checkpoint_dir(out_dir)
  if resume and (cfg.growth or cfg.vcycle):
    raise CheckpointError(
      '--resume does not apply to --growth / --vcycle runs (they write no '
      'checkpoints mid-plan); start a new run.'
    )
  if resume and found is None:
    raise CheckpointError(
      f'--resume: no checkpoint in {ckpt_dir}; run without --resume to '
      'start, or point --out at an earlier run.'
    )
  if not resume and found is not None:
    raise CheckpointError(
      f'{out_dir} already holds checkpoints (latest step {found}); pass '
      '--resume to continue it, or choose another --out.'
    )
  if not resume and os.path.exists(os.path.join(out_dir, 'summary.json')):
    raise CheckpointError(
      f'{out_dir} already holds a finished run (summary.json); choose '
      'another --out, or remove it to train there again.'
    )
  config_path = os.path.join(out_dir, 'config.json')
  if not resume and os.path.lexists(config_path) and not _is_run_config(config_path):
    raise CheckpointError(
      f'{config_path} is not a config an ouroboros run wrote, and a new run would overwrite it; '
      'choose another --out, or move it away to train there.'
    )
  if not resume and _has_rows(os.path.join(out_dir, 'metrics.jsonl')):
    files = [
      f for f in ('metrics.jsonl', 'config.json') if os.path.exists(os.path.join(out_dir, f))
    ]
    raise CheckpointError(
      f"{out_dir} holds an earlier run's {' and '.join(files)} but no checkpoint to resume (it "
      'stopped before its first one); a new run would overwrite them: choose another --out, or '
      'remove them to train there again.'
    )


# Keys every config.json a run writes (`TrainConfig.to_dict`) holds, since the first release.
_RUN_CONFIG_KEYS = frozenset({'schedule', 'model', 'steps', 'batch_size', 'seed'})


def _is_run_config(path: str) -> bool:
  """Whether `path` is a config.json an earlier run wrote (a JSON object with a run's keys):
  only such a file may be replaced by a new run; a user's own is refused."""
  try:
    with open(path, encoding='utf-8') as f:
      saved = json.load(f)
  except (OSError, UnicodeDecodeError, ValueError):
    return False
  return isinstance(saved, dict) and _RUN_CONFIG_KEYS <= saved.keys()


def _has_rows(path: str) -> bool:
  """Whether a metrics.jsonl holds anything (an empty one, of a run that logged nothing, does
  not count)."""
  try:
    return os.path.getsize(path) > 0
  except OSError:
    return False
