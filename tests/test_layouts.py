"""experiments/layouts.py (issue 61): the layouts it tries for N chips and a batch, and its map's
verdict per cell, on cells of 8 and 64 chips (a few seconds)."""

from __future__ import annotations

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
  many = layouts.layouts(8, 32, num_layers=24, policy='dots')
  assert [s.label for s in many[:2]] == ['data_parallel fsdp keep=dots', 'data_parallel keep=dots']


def test_a_cell_is_the_plans_prediction_and_the_map_names_its_fastest():
  """The 1B cell at N = 8, B = 32 is `plan`'s prediction for each layout (FSDP 873.5 ms, the
  ring at G = 8 873.3 ms, m-fsdp-1b); the rendered map names the fastest line and Ouroboros'
  ratio to the best other line."""
  layouts = experiment('layouts')
  rows = layouts.cell_rows('1b', 8, 32, 'dots')
  by_label = {r['setting']: r for r in rows}
  fsdp = by_label['data_parallel fsdp keep=dots']['step_s']
  ring = by_label['ouroboros M=32 stream pipelined/graph/dots']['step_s']
  exact = min(r['step_s'] for r in rows if r['line'] in layouts.PIPELINES)
  assert fsdp == pytest.approx(0.8735, abs=5e-4) and ring == pytest.approx(0.8733, abs=5e-4)
  line = layouts._cell_line(8, 32, rows)
  fastest = 'ouroboros' if ring < fsdp else 'fsdp'
  assert f'| {fastest} | {min(fsdp, exact) / ring:.2f}x |' in line
  assert rows[0]['hardware'] == plan.TPU_V5E.name and rows[0]['slices'] == 1
