"""Exact pipeline schedules as data: the tables against the published bubbles and memory, a table
that reads too early, and the input / weight split of a stage's backward."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from ouroboros_jax import staged
from ouroboros_jax.errors import ConfigError
from ouroboros_jax.schedules import tables

from helpers import max_abs_diff, raises_for_cli, random_batches, tiny_transformer

GRID = [(2, 2), (2, 4), (4, 4), (4, 8), (4, 16), (8, 16)]  # interleaved needs m % p == 0
UNEVEN = [(4, 6), (3, 5)]  # the others take any m


def published_bubble(name, p, m, v=1):
  """Idle over busy device time with F = B = W (Huang et al.; Narayanan et al.; Qi et al.)."""
  return {
    'gpipe': (p - 1) / m,
    '1f1b': (p - 1) / m,
    'interleaved': (p - 1) / (v * m),
    'zb_h1': (p - 1) / (3 * m),
    # ZB-V's published bubble is ~0 across steps (no optimizer barrier); with one barrier per
    # step the least possible is the last device's p - 1 half-stage ticks before its first input
    'zb_v': (p - 1) / (6 * m),
  }[name]


@pytest.mark.parametrize(
  'name, v, p, m',
  [
    (name, v, p, m)
    for name, v in [
      ('gpipe', 1),
      ('1f1b', 1),
      ('interleaved', 2),
      ('interleaved', 3),
      ('zb_h1', 1),
      ('zb_v', 2),
    ]
    for p, m in GRID + (UNEVEN if name != 'interleaved' else [])
  ],
)
def test_bubbles_from_the_tables_equal_the_published_formulas(name, v, p, m):
  table = tables.place(tables.build(name, p, m, v))
  tables.check(table)
  assert tables.bubble(table) == pytest.approx(published_bubble(name, p, m, v))
  assert all(sum(op is not None for op in row) == 3 * m * v for row in table.grid)


@pytest.mark.parametrize('p, m', GRID)
def test_peak_stash_gpipe_holds_every_microbatch_1f1b_and_zb_h1_p(p, m):
  peak = lambda name, v=1: tables.peak_stash(tables.place(tables.build(name, p, m, v)))
  assert peak('gpipe') == [m] * p
  assert peak('1f1b') == [min(p - s, m) for s in range(p)]
  assert max(peak('zb_h1')) == min(p, m)  # ZB-H1 keeps 1F1B's peak
  # Megatron: device s holds (p - s - 1) 2 + (v - 1) p + 1 chunks (1/v of a stage each)
  assert peak('interleaved', 2) == [min((p - s - 1) * 2 + p + 1, 2 * m) for s in range(p)]
  assert max(peak('1f1b')) < max(peak('gpipe')) or m <= p
  assert peak('zb_v', 2) == [min(2 * p, 2 * m)] * p  # 2p half-stage chunks: 1F1B's memory


@pytest.mark.parametrize('name', tables.PIPELINES)
@pytest.mark.parametrize('p, m', [(2, 4), (4, 8), (3, 6)])
def test_the_program_keeps_each_value_until_its_last_read_in_the_fewest_slots(name, p, m):
  """Replaying the program's slots: every read finds the value the table says, no value is
  overwritten before its last read, and the stash needs exactly the table's peak."""
  table = tables.place(tables.build(name, p, m))
  program, pipeline = tables.program(table), table.pipeline
  assert program.stash_slots == max(tables.peak_stash(table))
  f = program.fields
  stash = [[None] * program.stash_slots for _ in range(p)]
  inbox = {
    tables.ACTIVATIONS: [[None] * program.activation_slots for _ in range(p)],
    tables.GRADIENTS: [[None] * program.gradient_slots for _ in range(p)],
  }
  for t in range(program.ticks):
    for d in range(p):
      kind, i, k = f['kind'][d][t], f['microbatch'][d][t], f['stage'][d][t]
      if kind == tables.KIND_CODES['F']:
        if k > 0:
          assert inbox[tables.ACTIVATIONS][d][f['inbox_slot'][d][t]] == ('act', i, k)
        stash[d][f['stash_slot'][d][t]] = (i, k)
      elif kind in (tables.KIND_CODES['B'], tables.KIND_CODES['W']):
        assert stash[d][f['stash_slot'][d][t]] == (i, k)
        assert inbox[tables.GRADIENTS][d][f['inbox_slot'][d][t]] == ('grad', i, k)
    for d in range(p):  # the tick's transfers land
      for o in program.channels:
        store, slot = f[f'store_{o}'][d][t], f[f'slot_{o}'][d][t]
        if store == tables.NOWHERE:
          continue
        source = (d - o) % p
        i, k = f['microbatch'][source][t], f['stage'][source][t]
        if f['kind'][source][t] == tables.KIND_CODES['F']:
          value = ('act', i, k + 1) if k < pipeline.last_stage else ('grad', i, k)
        else:
          value = ('grad', i, k - 1)
        inbox[store][d][slot] = value


def test_a_table_that_reads_before_the_value_exists_is_refused():
  table = tables.place(tables.build('1f1b', 2, 2))
  tables.check(table)
  row = list(table.grid[1])
  first_b = next(t for t, op in enumerate(row) if op and op.kind == 'B')
  row[0], row[first_b] = row[first_b], row[0]  # device 1 back-propagates before any forward
  bad = table._replace(grid=(table.grid[0], tuple(row)))
  with pytest.raises(ConfigError, match='device 1 runs B of micro-batch 0 at tick 0, before F'):
    tables.check(bad)


def test_bad_pipeline_settings_are_one_line_errors():
  with raises_for_cli('--microbatches 6 is not a multiple of --stages 4; use --microbatches 8'):
    tables.build('interleaved', 4, 6, 2)
  with pytest.raises(ConfigError, match='unknown pipeline'):
    tables.build('pipedream', 2, 2)
  with raises_for_cli('--chunks 2 needs --schedule interleaved'):
    tables.build('1f1b', 2, 2, 2)
  with pytest.raises(ConfigError, match='zb_v runs two chunks per device'):
    tables.build('zb_v', 2, 2, 3)


def test_interleaved_needs_two_chunks_and_zb_v_exactly_two():
  with raises_for_cli(r'interleaved 1F1B needs --chunks >= 2.*got 1.*--schedule 1f1b'):
    tables.build('interleaved', 2, 4, 1)
  with pytest.raises(ConfigError, match='zb_v runs two chunks per device'):
    tables.build('zb_v', 2, 4, 1)
  assert tables.build('interleaved', 2, 4, 3).chunks == 3 and tables.build('zb_v', 2, 4).chunks == 2


def stage_input_grad(model, params_s, x, stage_index, rng, delta):
  """B of the zero-bubble split without taps: a VJP in the stage's input only."""
  run = lambda h: model.stage(params_s, h, stage_index, rng)
  return jax.vjp(run, x)[1](delta)[0]


def stage_weight_grad(model, params_s, x, stage_index, rng, delta):
  """W of the zero-bubble split without taps: a VJP in the stage's weights only."""
  run = lambda p: model.stage(p, x, stage_index, rng)
  return jax.vjp(run, params_s)[1](delta)[0]


@pytest.mark.parametrize('stage_index', [0, 1])
def test_input_and_weight_grads_together_are_the_full_vjp(stage_index):
  model, params = tiny_transformer(2, dropout=0.1)
  params_s = jax.tree.map(lambda a: a[stage_index], params['stages'])
  batch = random_batches(1)[0]
  rng = staged.piece_rng(staged.batch_key(0, 3), stage_index)
  x = model.embed(params['embed'], batch['inputs'], None)
  delta = jax.random.normal(jax.random.key(1), x.shape)
  full = jax.vjp(lambda p, h: model.stage(p, h, stage_index, rng), params_s, x)[1](delta)
  dx = stage_input_grad(model, params_s, x, stage_index, rng, delta)
  dw = stage_weight_grad(model, params_s, x, stage_index, rng, delta)
  # The same VJP split into B and W, float32: a few ulps of O(1) gradients (sums over 64 tokens).
  assert max_abs_diff(dx, full[1]) < 1e-6 and max_abs_diff(dw, full[0]) < 1e-6
  assert float(np.abs(np.asarray(dx)).max()) > 0  # not two zero trees
