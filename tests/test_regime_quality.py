"""experiments/regime_quality.py (issue 62): its settings are the region's, and time to quality
counts the slowest seed and nothing that was not reached."""

from __future__ import annotations

import math

from helpers import experiment


def test_the_settings_are_the_regions_each_with_its_gradient_age():
  """G in {8, 16}, M in {G/2, G, 2G}, locked and pipelined, a layer per stage, streamed; the age
  is the lag over M rounded up (lag G locked, 2G pipelined); backprop at each depth."""
  rq = experiment('regime_quality')
  ouroboros = lambda n: rq.SETTINGS[n]['schedule'] == 'ouroboros' and '+' not in n
  rings = {n: rq.SETTINGS[n] for n in rq.SETTINGS if ouroboros(n) and n not in rq.BEYOND}
  assert len(rings) == 12 and {'backprop-8l', 'backprop-16l'} <= set(rq.SETTINGS)
  assert rq.age(rq.SETTINGS['pipelined-g8-m2']) == 8  # the layout map's B < N cells
  for name, o in rings.items():
    G, M = o['stages'], o['microbatches']
    assert o['num_layers'] == G and M in (G // 2, G, 2 * G) and o['flow'] == 'stream'
    lag = 2 * G if o['forward'] == 'pipelined' else G
    assert rq.age(o) == math.ceil(lag / M), name
    assert rq.reference_of(name) == f'backprop-{G}l'


def _rows(curves):
  return [
    dict(setting=name, corpus='default', seed=seed, rate=0.02, step=step, bpb=bpb)
    for (name, seed), curve in curves.items()
    for step, bpb in curve
  ]


def test_time_to_quality_is_to_the_worse_of_the_two_and_takes_the_seed_worst_for_the_ring():
  rq = experiment('regime_quality')
  backprop = {('backprop-16l', s): [(500, 2.6), (1000, 2.4)] for s in (0, 1)}
  ahead = [(500, 2.5), (1000, 2.3)]  # reaches backprop's 2.4 half-way between 500 and 1000
  behind = [(500, 2.7), (1000, 2.5)]  # backprop reaches its 2.5 at 750
  rows = _rows({**backprop, ('locked-g16-m16', 0): ahead})
  assert rq.to_common_quality(rows, 'locked-g16-m16', 'default') == (2.4, 750, 1000)
  rows = _rows({**backprop, ('locked-g16-m16', 0): ahead, ('locked-g16-m16', 1): behind})
  assert rq.to_common_quality(rows, 'locked-g16-m16', 'default') == (2.5, 1000, 750)
  assert rq.to_common_quality(rows, 'pipelined-g16-m8', 'default') is None


def test_fsdp_keeps_what_the_fastest_ring_keeps(tmp_path):
  """Like with like: each line's fastest fitting step comes with what it keeps, and the FSDP
  column is predicted keeping that (a replay stash recomputes everything: 'nothing')."""
  rq = experiment('regime_quality')
  assert [rq.kept(p) for p in ('graph/dots', 'graph/all', 'replay', 'nothing')] == [
    'dots',
    'all',
    'nothing',
    'nothing',
  ]
  head = 'hardware,G,M,line,policy,step_s,fits\n'
  rows = ['h,16,32,ouroboros pipelined,graph/nothing,0.9,True']
  rows += ['h,16,32,ouroboros pipelined,graph/dots,0.7,True', 'h,16,32,zb_h1,dots,0.6,False']
  rows += ['h,16,32,zb_h1,all,0.8,True', 'h,16,32,ouroboros pipelined,graph/all,0.5,False']
  path = tmp_path / 'regime.csv'
  path.write_text(head + '\n'.join(rows) + '\n')
  best = rq.fastest_steps(str(path))
  assert best == {
    ('h', 16, 32, 'ouroboros pipelined'): (0.7, 'dots'),
    ('h', 16, 32, 'exact'): (0.8, 'all'),
  }
  assert rq.fsdp_step_s('nvlink-300GBps', 16, 'dots') < rq.fsdp_step_s(
    'nvlink-300GBps', 16, 'nothing'
  )


def test_the_age_table_gathers_every_run_of_an_age_and_leaves_the_levers_out():
  """Each age's row spans its runs' gaps to backprop at their depth (every seed), their mean and
  how many are within the 2% target; a lever's run is not a setting's."""
  rq = experiment('regime_quality')
  refs = {(f'backprop-{d}l', s): [(1000, 2.0)] for d in (8, 16) for s in (0, 1)}
  runs = {
    ('locked-g16-m16', 0): [(1000, 1.99)],  # age 1: -0.5%
    ('locked-g16-m16', 1): [(1000, 2.01)],  # +0.5%
    ('locked-g8-m8', 0): [(1000, 2.03)],  # age 1: +1.5%
    ('locked-g16-m8', 0): [(1000, 2.05)],  # age 2: +2.5%
    ('pipelined-g8-m4+dc4', 0): [(1000, 1.5)],  # a lever: left out
  }
  table = rq.age_table(_rows({**refs, **runs}), {}, 'nvlink-300GBps')
  assert table[2:] == [
    '| 1 | 3 | -0.50% to +1.50% | +0.50% | 3 of 3 |  |  |',
    '| 2 | 1 | +2.50% | +2.50% | 0 of 1 |  |  |',
  ]


def test_the_age_table_times_each_setting_to_its_quality_against_the_exact_pipeline_and_fsdp():
  """A ring that reaches backprop's last bpb at step 954.5 (interpolated) with a 1.0 s step,
  against the exact pipeline's 1.5 s and FSDP's predicted step for backprop's 1000 steps."""
  rq = experiment('regime_quality')
  rows = _rows({
    ('backprop-16l', 0): [(500, 2.2), (1000, 2.0)],
    ('locked-g16-m16', 0): [(500, 2.1), (1000, 1.99)],
  })  # fmt: skip
  hw = 'nvlink-300GBps'
  steps_s = {(hw, 16, 16, 'ouroboros locked'): (1.0, 'dots'), (hw, 16, 16, 'exact'): (1.5, 'all')}
  ring_steps = 500 + 500 * 0.1 / 0.11
  fsdp = 1000 * rq.fsdp_step_s(hw, 16, 'dots') / ring_steps
  assert rq.age_table(rows, steps_s, hw)[2:] == [
    f'| 1 | 1 | -0.50% | -0.50% | 1 of 1 | {1500 / ring_steps:.2f}x | {fsdp:.2f}x |'
  ]
