"""Every state a run can save comes back from a checkpoint: every preset x schedule pair the docs
show, and a Transformer-XL Ouroboros run (whose graph stash holds zero-size arrays at `mem_len 0`)
that resumes bit for bit."""

from __future__ import annotations

import math

import jax
import pytest

from ouroboros_jax import schedules
from ouroboros_jax.training import checkpoint, field_flags, loop, presets

from helpers import assert_trees_equal, save_and_restore, straight_and_resumed

# The presets at test size: their model kind, attention, memory and layer norm placement stay.
SHRUNK = dict(d_model=16, num_heads=2, num_layers=4, d_ff=32, seq_len=8, batch_size=4)


def _shrunk(preset: str, schedule: str, **values):
  cfg = presets.get_preset(preset)
  stages = 1 if schedule in ('backprop', 'data_parallel') else 2
  shrunk = dict(
    SHRUNK,
    schedule=schedule,
    stages=stages,
    vocab_size=256,
    mem_len=min(cfg.model.mem_len, 8),
    layers_per_stage=None,
  )
  if schedule == 'data_parallel':
    shrunk['data_parallel'] = 2
  if schedule in ('gpipe', '1f1b', 'zb_h1'):
    shrunk['microbatches'] = 2
  return field_flags.override(cfg, {**shrunk, **values})


def _presets_by_model() -> list[str]:
  """The presets, those that shrink to the same model (and so the same states) joined by '+':
  tiny+small, enwik8-base+gpt2-small (dropout), txl-tiny, txl-enwik8-base+txl-wt103-base."""
  groups = {}
  for name in presets.PRESETS:
    groups.setdefault(_shrunk(name, 'backprop').model, []).append(name)
  return ['+'.join(names) for names in groups.values()]


# Schedules that lay a state out alike: synchronous_schedule's TrainState on the same (stage, data)
# mesh, with the same stage groups.
SAME_STATE = {'gpipe': 'model_parallel', '1f1b': 'model_parallel', 'zb_h1': 'model_parallel'}
SAME_STATE['zb_v'] = 'interleaved'  # two chunks a device
# Presets whose models differ only in dropout, which only Ouroboros' state shows.
DROPOUT_TWIN = {'enwik8-base+gpt2-small': 'tiny+small'}


def _cases() -> dict[tuple[str, str], list[tuple[str, str]]]:
  """{(presets, schedule): every (preset, schedule) pair whose state it stands for}: each pair
  once, so every preset x schedule is round-tripped or laid out as one that is."""
  cases = {}
  for names in _presets_by_model():
    for schedule in schedules.SCHEDULES:
      twin = names if schedule == 'ouroboros' else DROPOUT_TWIN.get(names, names)
      case = (twin, SAME_STATE.get(schedule, schedule))
      cases.setdefault(case, []).append((names.split('+')[0], schedule))
  return cases


CASES = _cases()


def _laid_out(cfg) -> tuple:
  """The state `init` builds for `cfg`, compiling nothing: its tree, and each leaf's shape, dtype
  and sharding (what a checkpoint writes and restores onto)."""
  sched, params, _ = loop.build(cfg)
  state = jax.eval_shape(sched.init, params, loop.example_batch(cfg))
  shardings = jax.tree.leaves(sched.layout(state))
  leaves = [(x.shape, x.dtype, s) for x, s in zip(jax.tree.leaves(state), shardings, strict=True)]
  return jax.tree.structure(state), leaves


# One round trip per state layout (36 cases before, every preset x schedule: 33 s of a 15-minute
# suite): the pairs a case stands for (CASES) are checked to lay their state out as it does.
@pytest.mark.parametrize('presets, schedule', list(CASES))
def test_every_preset_and_schedule_state_round_trips(tmp_path, presets, schedule):
  cfg_preset = presets.split('+')[0]
  cfg = _shrunk(cfg_preset, schedule)
  cfg.validate()
  others = [pair for pair in CASES[presets, schedule] if pair != (cfg_preset, schedule)]
  mine = _laid_out(cfg) if others else None
  for preset, other in others:
    assert _laid_out(_shrunk(preset, other)) == mine, (preset, other)
  sched, params, _ = loop.build(cfg)
  example = loop.example_batch(cfg)
  state = sched.init(params, example)
  restored, data_state = save_and_restore(sched, state, params, example, tmp_path, {'at': 1})
  assert data_state['at'] == 1
  assert_trees_equal(jax.device_get(restored), jax.device_get(state))


def test_a_saved_state_holds_no_zero_size_array():
  # A graph stash of every residual keeps the zero-size memory of mem_len 0 (the default stash,
  # which keeps nothing, no longer does): what Orbax refuses to write.
  cfg = _shrunk('txl-tiny', 'ouroboros', stash_policy='all')
  sched, params, _ = loop.build(cfg)
  state = sched.init(params, loop.example_batch(cfg))
  sizes = [math.prod(x.shape) for x in jax.tree.leaves(state)]
  assert 0 in sizes  # the memory of mem_len 0: what Orbax refuses to write
  assert 0 not in [math.prod(x.shape) for x in jax.tree.leaves(checkpoint.without_empty(state))]


def test_transformer_xl_ouroboros_resumes_bitwise(tmp_path, text_corpus):
  """The txl-tiny preset's defaults with Ouroboros (graph stash, policy `nothing`, mem_len 0): a
  run stopped after its first checkpoint and resumed ends equal to an uninterrupted one."""
  corpus = tmp_path / 'corpus.txt'  # small, so that the final test evaluation is short
  with open(text_corpus, 'rb') as f:
    corpus.write_bytes(f.read()[:20_000])
  values = dict(
    data=f'text:{corpus}',
    steps=4,
    checkpoint_every=2,
    eval_every=4,
    eval_batches=1,
    log_every=1,
    warmup_steps=1,
  )
  straight = _shrunk('txl-tiny', 'ouroboros', out=str(tmp_path / 'a'), **values)
  assert straight.model.mem_len == 0 and straight.schedule.stash == 'graph'
  _, a, b = straight_and_resumed(straight, tmp_path / 'b', resume_at=2)
  assert_trees_equal(a, b)


def test_orbax_s_warning_about_the_loop_s_own_wait_is_dropped_and_nothing_else(caplog):
  """The loop waits for each save to land before the next (and before a SIGTERM stop), and
  Orbax counts that wait as the next save's: its 'consider checkpointing less frequently' would
  be a second stderr line beside a stop's one-line message. Only that record is dropped."""
  import logging

  from ouroboros_jax.training import checkpoint

  checkpoint.quiet_own_wait()
  checkpoint.quiet_own_wait()  # once is enough: the filter is not added twice
  absl_logger = logging.getLogger('absl')
  assert absl_logger.filters.count(checkpoint._OWN_WAIT_RECORDS) == 1
  with caplog.at_level(logging.WARNING, logger='absl'):
    absl_logger.warning(
      'Waiting for previous save to complete took %f seconds. If this number is high, consider'
      ' checkpointing less frequently.',
      1.325,
    )
    absl_logger.warning('Waiting for something else took %f seconds.', 2.0)
  assert [r.getMessage() for r in caplog.records] == [
    'Waiting for something else took 2.000000 seconds.'
  ]
