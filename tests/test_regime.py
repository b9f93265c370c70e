"""experiments/regime.py (issue 40 item 4): its efficiency, its memory extrapolation and its
tables, on a small grid (G = 4, M in {2, 4, 8}; a few seconds)."""

from __future__ import annotations

import pathlib

import pytest

from ouroboros_jax.schedules import ScheduleConfig

from helpers import experiment

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope='module')
def rows():
  regime = experiment('regime')
  out = regime.time_rows(regime.base_config(), ('tpu-v5e',), (4,), (0.5, 1, 2))
  for row in out:
    row.update(fits=None, memory='not estimated')
  regime.mark_best(out)
  return out


def _step(rows, line, M, policy):
  (row,) = [r for r in rows if r['line'] == line and r['M'] == M and r['policy'] == policy]
  return row


def test_backprop_is_the_base_and_recomputing_costs_a_forward(rows):
  """Efficiency = backprop's step / (G x step): 1 for backprop keeping everything; keeping
  nothing re-runs the forward, 1/3 of its compute, so 3/4, a little above it since the head,
  the embedding and the optimizer's update (Muon's orthogonalisation, about 1 s of 18.5) are not
  re-run."""
  keep = _step(rows, 'backprop', '', 'all')
  assert keep['efficiency'] == 1.0 and keep['recompute'] == 0.0
  recompute = _step(rows, 'backprop', '', 'nothing')
  assert recompute['recompute'] == 1.0
  assert 0.75 < recompute['efficiency'] < 0.775


def test_exact_pipelines_fill_with_m_and_ouroboros_pipelined_does_not_need_to(rows):
  """The exact pipelines' bubble shrinks as M grows at fixed G; Ouroboros' pipelined ring has
  none at any M; no setting is above the ideal."""
  for line in ('1f1b', 'zb_h1', 'zb_v', 'gpipe'):
    effs = [_step(rows, line, M, 'all')['efficiency'] for M in (2, 4, 8)]
    assert effs[0] < effs[1] < effs[2] < 1.0, (line, effs)
  effs = {_step(rows, 'ouroboros pipelined', M, 'graph/all')['efficiency'] for M in (2, 4, 8)}
  assert max(effs) - min(effs) < 1e-6
  assert all(r['efficiency'] <= 1.0 + 1e-9 for r in rows if r['efficiency'] is not None)
  # interleaved needs M to be a multiple of G: a reason, no time
  skipped = _step(rows, 'interleaved', 2, 'all')
  assert skipped['step_s'] is None and 'multiple' in skipped['note']


def test_the_fastest_of_each_line_is_marked_once(rows):
  for M in (2, 4, 8):
    here = [r for r in rows if r['G'] == 4 and r['M'] == M]
    assert sum(r['best'] == '*' for r in here) == 1
    for line in {r['line'] for r in here if r['step_s'] is not None}:
      marked = [r for r in here if r['line'] == line and r['best']]
      assert len(marked) == 1
      assert marked[0]['step_s'] == min(
        r['step_s'] for r in here if r['line'] == line and r['step_s'] is not None
      )


def test_render_reads_back_the_csv(rows, tmp_path):
  regime = experiment('regime')
  path = tmp_path / 'regime.csv'
  regime.write_csv(path, rows)
  text = regime.render(regime.read_csv(path))
  assert '### tpu-v5e, G = 4' in text and '| zb_v |' in text
  assert '- (cannot run)' in text  # interleaved at M = 2


def test_the_temporaries_line_through_two_compiled_rows():
  """temps = a x params + c x activation units: two reference rows at two M give a and c back
  exactly; one row gives a = 1 (one float32 gradient) and c through it. A table pipeline keeping
  every residual scales with its stash slots, one that recomputes with one chunk (but ZB's)."""
  regime = experiment('regime')
  a, c, params = 2.0, 1000.0, 50

  def ref(M):
    setting = ScheduleConfig(name='1f1b', num_stages=8, microbatches=M, stash_policy='nothing')
    units = regime.activation_units(setting, 24, 32)
    return {'setting': setting, 'temp_bytes': a * params + c * units, 'params_bytes': params}

  assert regime.temps_model([ref(8), ref(16)], 24, 32) == pytest.approx((a, c))
  one_a, one_c = regime.temps_model([ref(8)], 24, 32)
  assert one_a == 1.0 and one_c == pytest.approx(c + (a - 1) * params / (3 * 4))
  keep = ScheduleConfig(name='1f1b', num_stages=8, microbatches=16)
  assert regime.in_flight(keep) == 8  # 1F1B's first stage holds G micro-batches
  assert regime.activation_units(keep, 32, 64) == 4 * 4 * 8
  chunked = ScheduleConfig(
    name='interleaved', num_stages=8, microbatches=16, stash_policy='nothing'
  )
  assert regime.activation_units(chunked, 32, 64) == 2 * 4  # one chunk (half the layers), 4 rows
  # the zero-bubble split's W keeps what B recorded for every micro-batch between them
  zb_h1 = ScheduleConfig(name='zb_h1', num_stages=8, microbatches=16, stash_policy='nothing')
  assert regime.activation_units(zb_h1, 32, 64) == 4 * 4 * regime.in_flight(zb_h1)
  # keeping the matmul outputs (dots) keeps them for every micro-batch in flight, as keeping all
  dots = ScheduleConfig(name='1f1b', num_stages=8, microbatches=16, stash_policy='dots')
  assert regime.activation_units(dots, 32, 64) == regime.activation_units(keep, 32, 64)


def test_dots_is_tried_between_all_and_nothing(rows):
  """Every exact pipeline is tried keeping the matmul outputs too, Ouroboros with its graph
  stash keeping them: a recompute share strictly between keeping all (0) and nothing (1), and a
  step between theirs."""
  for line, dots, keep, none in (
    ('zb_h1', 'dots', 'all', 'nothing'),
    ('1f1b', 'dots', 'all', 'nothing'),
    ('ouroboros locked', 'graph/dots', 'graph/all', 'graph/nothing'),
  ):
    d, a, n = (_step(rows, line, 4, p) for p in (dots, keep, none))
    assert 0 < d['recompute'] < 1
    assert a['step_s'] < d['step_s'] < n['step_s'], line
