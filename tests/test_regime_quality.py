"""experiments/regime_quality.py (issue 62): its settings are the region's, and time to quality
counts the slowest seed and nothing that was not reached."""

from __future__ import annotations

import math

import pytest

from helpers import experiment


def test_the_settings_are_the_regions_each_with_its_gradient_age():
  """G in {8, 16}, M in {G/2, G, 2G}, locked and pipelined, a layer per stage, streamed; the age
  is the lag over M rounded up (lag G locked, 2G pipelined); backprop at each depth."""
  rq = experiment('regime_quality')
  rings = {n: o for n, o in rq.SETTINGS.items() if o['schedule'] == 'ouroboros' and '+' not in n}
  assert len(rings) == 12 and {'backprop-8l', 'backprop-16l'} <= set(rq.SETTINGS)
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


def test_time_to_quality_takes_the_slowest_seed_and_none_if_one_never_arrives():
  rq = experiment('regime_quality')
  backprop = {('backprop-16l', s): [(500, 2.6), (1000, 2.4)] for s in (0, 1)}
  early = [(500, 2.5), (1000, 2.3)]  # reaches 2.4 half-way between 500 and 1000
  late = [(500, 2.7), (1000, 2.35)]  # reaches 2.4 at 500 + 500 * 0.3 / 0.35
  rows = _rows({**backprop, ('locked-g16-m16', 0): early, ('locked-g16-m16', 1): late})
  assert rq.steps_to_quality(rows, 'locked-g16-m16', 'default') == pytest.approx(
    500 + 500 * 0.3 / 0.35
  )
  never = [(500, 2.7), (1000, 2.45)]
  rows = _rows({**backprop, ('locked-g16-m16', 0): early, ('locked-g16-m16', 1): never})
  assert rq.steps_to_quality(rows, 'locked-g16-m16', 'default') is None
