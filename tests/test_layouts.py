"""experiments/layouts.py (issue 61): the layouts it tries for N chips and a batch, and its map's
verdict per cell, on cells of 8 and 64 chips (a few seconds)."""

from __future__ import annotations

import csv
import pathlib

import pytest

from ouroboros_jax.perf import plan

from helpers import experiment

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_the_layouts_of_a_cell_split_every_chip_and_no_sequence():
  """FSDP only where every chip gets a whole sequence (B >= N); a pipeline at each G of the
  factorisations whose R replicas split the batch, M = B / R one-sequence micro-batches."""
  layouts = experiment('layouts')
  few = layouts.layouts(64, 16, num_layers=24, policy='dots')
  assert not [s for s in few if s.name == 'data_parallel']  # 16 sequences on 64 chips
  assert {(s.num_stages, s.data_parallel, s.num_microbatches) for s in few} == {
    (4, 16, 1),
    (8, 8, 2),
    (16, 4, 4),
  }
  assert {s.stash_policy for s in few} == {'dots'}
  # every pipeline also with its optimizer state, and all its state, sharded over its replicas
  # (each G here has R > 1)
  assert sum(s.fsdp for s in few) == sum(s.shard_update for s in few) == len(few) // 3 == 3 * 6
  assert not [
    s
    for s in layouts.layouts(8, 32, num_layers=24, policy='dots')
    if (s.fsdp or s.shard_update) and s.name != 'data_parallel' and s.data_parallel == 1
  ]
  update = layouts.layouts(64, 16, num_layers=24, policy='dots', shardings=('update',))
  assert update and all(s.shard_update for s in update)
  many = layouts.layouts(8, 32, num_layers=24, policy='dots')
  assert [s.label for s in many[:2]] == ['data_parallel fsdp keep=dots', 'data_parallel keep=dots']


def test_a_cell_is_the_plans_prediction_and_the_map_names_its_fastest():
  """The 1B cell at N = 8, B = 32 is `plan`'s prediction for each layout: the saved plans' FSDP
  and G = 8 ring steps (m-fsdp-1b, p-1b); the rendered map names the fastest line and
  Ouroboros' ratio to the best other line."""
  layouts = experiment('layouts')
  saved = lambda path, label: next(
    r['step_s'] for r in plan.load(str(ROOT / 'docs/results' / path))['rows'] if r['label'] == label
  )
  rows = layouts.cell_rows('1b', 8, 32, 'dots')
  by_label = {r['setting']: r for r in rows}
  fsdp = by_label['data_parallel fsdp keep=dots']['step_s']
  ring = by_label['ouroboros M=32 stream pipelined/graph/dots']['step_s']
  exact = min(r['step_s'] for r in rows if r['line'] in layouts.PIPELINES)
  assert fsdp == pytest.approx(
    saved('layouts/fsdp_1b_v5e_2x4.json', 'data_parallel fsdp keep=dots')
  )
  assert ring == pytest.approx(
    saved('plan_1b_v5e_2x4_remat.json', 'ouroboros M=32 pipelined/graph/dots')
  )
  line = layouts._cell_line(8, 32, rows)
  fastest = 'ouroboros' if ring < fsdp else 'fsdp'
  # Not judged here (no compile): the fastest that fits is unknown, '?'.
  assert f'| {fastest} | ? | {min(fsdp, exact) / ring:.2f}x (time alone) |' in line
  assert rows[0]['hardware'] == plan.TPU_V5E.name and rows[0]['slices'] == 1


GIB = 2**30
HBM = 15.75 * GIB  # a v5e's usable memory, as the compiler reports it


def _row(line, chips, batch, G, R, M, step_s):
  row = dict(model='1b', hardware='tpu-v5e', chips=chips, slices=1, batch=batch, line=line)
  return row | dict(setting=f'{line} G={G}', G=G, R=R, M=M, policy='dots', step_s=step_s)


def _compiled(line, G, batch, M, peak, state=0.0, oom=False):
  """A cache row as `compile_memory` saves it (the bytes per chip of the compiled shape)."""
  shape = dict(model='1b', line=line, G=G, batch=batch, M=M, policy='dots')
  got = dict(shape, peak_bytes=peak * GIB, params_bytes=state * GIB * 2 / 3)
  got.update(opt_state_bytes=state * GIB / 3, hbm_bytes=HBM, error='out of memory' if oom else '')
  return tuple(str(v) for v in shape.values()), got


def test_fsdp_is_extrapolated_from_d8_and_pipelines_compiled_at_their_per_chip_shape():
  """FSDP on 64 chips with B = 128 is compiled at D = 8 with 16 sequences (2 a chip, the same),
  its state shard then shrinking from 1 / 8 to 1 / 64 of the model's: a 16.5 GiB peak at D = 8
  (out of memory there) with 1.5 GiB of state a chip (12 GiB in all) is 16.5 - 1.5 + 12 / 64 =
  15.1875 GiB at N = 64, which fits 15.75. A pipeline G = 8 x R = 8 holds one stage of a replica
  of 16 sequences: compiled as 8 stages x 1 replica of 16, in the same M."""
  layouts = experiment('layouts')
  fsdp = _row('fsdp', 64, 128, 1, 64, 1, 0.4)
  ring = _row('ouroboros pipelined', 64, 128, 8, 8, 16, 0.45)
  assert layouts.per_chip(fsdp) | {'model': '1b'} == dict(
    model='1b', line='fsdp', policy='dots', G=8, batch=16, M=1
  )
  assert (layouts.per_chip(ring)['G'], layouts.per_chip(ring)['batch']) == (8, 16)
  memory = dict([_compiled('fsdp', 8, 16, 1, 16.5, state=1.5, oom=True)])
  memory.update([_compiled('ouroboros pipelined', 8, 16, 16, 16.0)])
  got = layouts.verdict(fsdp, memory)
  assert got['peak_gib'] == pytest.approx(16.5 - 1.5 + 12 / 64, abs=1e-3)
  assert got['fits'] and got['memory'] == 'extrapolated from D = 8'
  assert layouts.extrapolated_peak(10.0, 1.5, 8) == 10.0  # at D = 8 itself: the compile's
  ring_verdict = layouts.verdict(ring, memory)
  assert ring_verdict == dict(peak_gib=16.0, fits=False, memory='compiled at the per-chip shape')
  # The same FSDP compile at N = 8 (B = 16) is the compile itself: out of memory, no fit.
  assert layouts.verdict(_row('fsdp', 8, 16, 1, 8, 1, 0.4), memory)['fits'] is False


def test_a_pipeline_sharded_over_its_replicas_is_extrapolated_from_its_compile_without():
  """A ring G = 8 x R = 8 with --fsdp holds what the ring without it does, its state shard 1 / 8
  of a stage's: its compile as 8 stages x 1 replica (16.0 GiB, 2.0 GiB of state, out of memory)
  gives 16.0 - 2.0 * 7 / 8 = 14.25 GiB, which fits; the map's cell names it with fsdp."""
  layouts = experiment('layouts')
  ring = _row('ouroboros pipelined', 64, 128, 8, 8, 16, 0.45) | dict(fsdp='True')
  memory = dict([_compiled('ouroboros pipelined', 8, 16, 16, 16.0, state=2.0, oom=True)])
  assert layouts.per_chip(ring)['G'] == 8 and layouts.per_chip(ring)['batch'] == 16
  got = layouts.verdict(ring, memory)
  assert got == dict(
    peak_gib=pytest.approx(14.25, abs=1e-3), fits=True, memory='extrapolated from R = 1'
  )
  assert layouts.verdict(ring | dict(fsdp='False'), memory)['fits'] is False
  # --shard-update splits the optimizer state alone (2.0 / 3 GiB of the 2.0 here): 16.0 - 2/3 *
  # 7 / 8 = 15.42 GiB, which fits too; and the cell names it zero1
  zero1 = ring | dict(fsdp='False', shard_update='True')
  got = layouts.verdict(zero1, memory)
  assert got == dict(
    peak_gib=pytest.approx(16.0 - 2 / 3 * 7 / 8, abs=1e-3), fits=True, memory=got['memory']
  )
  assert got['memory'] == 'extrapolated from R = 1' and ' zero1' in layouts._short(zero1)
  assert 'pipelined G=8 M=16 fsdp, 1 old' in layouts._short(ring)


def test_the_map_names_the_fastest_layout_that_fits():
  """A cell whose fastest row (FSDP, 400 ms) does not fit: `judge` compiles each line's rows
  fastest first until one fits, a too-big G = 8 ring then the G = 4 one; the map names
  FSDP fastest, Ouroboros the fastest that fits, and its ratio to the best other that fits
  (1F1B's 600 ms, FSDP not fitting: 600 / 500 = 1.20x)."""
  layouts = experiment('layouts')
  cell = [
    _row('fsdp', 8, 16, 1, 8, 1, 0.4),
    _row('ouroboros pipelined', 8, 16, 8, 1, 16, 0.45),
    _row('ouroboros pipelined', 8, 16, 4, 2, 8, 0.5),
    _row('1f1b', 8, 16, 2, 4, 4, 0.6),
  ]
  peaks = {('fsdp', 8): 17.0, ('ouroboros pipelined', 8): 16.0}
  compiled = []

  def compile_fn(shape):
    compiled.append((shape['line'], shape['G']))
    peak = peaks.get((shape['line'], shape['G']), 9.0)
    return _compiled(shape['line'], shape['G'], shape['batch'], shape['M'], peak, state=1.0)[1]

  layouts.judge(cell, {}, compile_fn)
  # Breadth first: every line's fastest row, then the next of the line whose fastest overflows.
  first = [('fsdp', 8), ('ouroboros pipelined', 8), ('1f1b', 2)]
  assert compiled == first + [('ouroboros pipelined', 4)]
  assert [layouts.fits_of(r) for r in cell] == [False, False, True, True]
  line = layouts._cell_line(8, 16, cell)
  assert line.endswith('| fsdp | ouroboros | 1.20x |')
  assert '500.0 (pipelined G=4 M=8, ' in line and 'does not fit' in line
  # Not judged: the map does not know which fits, and compares the fastest rows (400 / 450).
  bare = [dict(r, fits=None, peak_gib=None) for r in cell]
  assert layouts._cell_line(8, 16, bare).endswith('| fsdp | ? | 0.89x (time alone) |')


def test_the_gap_to_fsdp_is_priced_term_by_term_and_the_simulator_restored():
  """experiments/layout_gap.py on the map's 1B, 64-chip, 64-sequence cell: its fastest
  Ouroboros simulated again as the map has it, then with the post-update gather free, then the
  update too, and it and FSDP with a collective's latency over a torus's hops; each what-if only
  lowers the step, and the simulator is itself again after."""
  gap = experiment('layout_gap')
  ring_latency = gap.cost_model.StageCosts.collective_s
  with open(ROOT / 'docs/results/layouts/layouts.csv') as f:
    cell = [
      r for r in csv.DictReader(f) if (r['model'], r['chips'], r['batch']) == ('1b', '64', '64')
    ]
  before = gap.simulate._updates
  row = gap.gap_row(cell)
  assert gap.simulate._updates is before
  assert 'shard_update' in row['setting'] and row['fsdp_s'] > 0
  assert row['update_free_s'] < row['gather_free_s'] < row['ouroboros_s']
  assert gap.cost_model.StageCosts.collective_s is ring_latency
  assert row['fsdp_torus_s'] < row['fsdp_s'] and row['ouroboros_torus_s'] < row['ouroboros_s']
  ring = gap.fastest(cell, 'ouroboros')  # the map's row, simulated again as it is
  assert gap.step_s('1b', 64, 64, gap.setting_of(ring)) == pytest.approx(row['ouroboros_s'])


def test_the_update_compiles_are_priced_as_the_simulator_charges_a_chip():
  """experiments/update_compiles.py: the layers whose update the simulator charges a chip, L/D
  under FSDP, L/(G R) under zero1, L/G on a replicated stage; and the rendered ratio."""
  compiles = experiment('update_compiles')
  assert compiles.priced_layers(24, 1, 64, 'fsdp') == 24 / 64
  assert compiles.priced_layers(24, 8, 8, 'update') == 3 / 8
  assert compiles.priced_layers(24, 8, 8, 'replicated') == 3
  row = dict(
    model='1b', topology='v5e:8x8', setting='s', layers_a_chip=0.375, priced_gflops=902,
    compiled_gflops=6999, all_gather_mb=1, all_reduce_mb=2, all_to_all_mb=0,
  )  # fmt: skip
  assert '| 7.76x |' in compiles.render([row])


def test_fsdps_update_layouts_split_as_named():
  """experiments/fsdp_update_layouts.py: on shards, a kernel over all 64 chips on its largest
  axis 64 divides; gcd, the layers over 8 groups and the kernel's larger axis over the 8 chips
  of each; whole layers, over the groups alone."""
  from jax.sharding import PartitionSpec as P

  layouts_ = experiment('fsdp_update_layouts')
  qkv, down = layouts_.MATRICES['qkv'], layouts_.MATRICES['down']
  assert layouts_.GROUPS == 8
  assert layouts_.spec('on shards', qkv) == P(None, None, ('group', 'chip'))
  assert layouts_.spec('on shards', down) == P(None, ('group', 'chip'), None)
  assert layouts_.spec('gcd', qkv) == P('group', None, 'chip')
  assert layouts_.spec('gcd', down) == P('group', 'chip', None)
  assert layouts_.spec('whole layers', qkv) == P('group', None, None)
