"""The accelerator flags (--pld, --growth, --vcycle, --std-loss): parsing, the combinations that
are refused, one-line CLI errors, and short end-to-end runs through `loop.train`."""

from __future__ import annotations

import dataclasses
import json
import os
import re

import forked_cli
import numpy as np
import pytest

from ouroboros_jax import costs
from ouroboros_jax.accelerators import growth, pld, vcycle
from ouroboros_jax.models.model import ConfigError
from ouroboros_jax.training import compare, field_flags, presets

from helpers import assert_one_line_error, cli_message


def test_pld_flag():
  assert pld.parse('0.3,0.01') == (0.3, 0.01)
  assert pld.parse('default') == (pld.DEFAULT_THETA_BAR, pld.DEFAULT_GAMMA)
  for bad, words in [
    ('0.5', 'THETA_BAR,GAMMA'),
    ('a,b', 'THETA_BAR,GAMMA'),
    ('0,0.1', 'theta_bar'),
    ('1.5,0.1', 'theta_bar'),
    ('0.5,-1', 'gamma'),
  ]:
    with pytest.raises(ConfigError, match=words):
      pld.parse(bad)


def test_growth_flag():
  plan = growth.parse_plan('mslt:1x250,2x250,4x*,all:100', 4, 1000)
  assert (plan.depths, plan.steps, plan.final_steps, plan.method, plan.init) == (
    (1, 2, 4),
    (250, 250, 400),
    100,
    'mslt',
    'copy_top',
  )
  assert [frozen for _, _, frozen in plan.phases()] == [0, 1, 2, 0]
  plan = growth.parse_plan('stacking:2x300,4x700,init=random', 4, 1000)
  assert (plan.depths, plan.steps, plan.method, plan.init) == (
    (2, 4),
    (300, 700),
    'stacking',
    'random',
  )
  assert growth.parse_plan('mslt:2x5,4x5,embed=train', 4, 10).train_embedding
  for bad, words in [
    ('mslt', 'mslt: or stacking:'),
    ('grow:2x5,4x5', 'mslt: or stacking:'),
    ('mslt:2x5,4x6', 'take 11 steps but --steps is 10'),
    ('mslt:2x5,3x*', 'num-layers'),
    ('mslt:4x5,2x*', 'increasing'),
    ('mslt:2x*,4x*', 'only one'),
    ('stacking:2x5,4x*,all:2', 'belongs to mslt'),
    ('mslt:2x5,4x*,init=zeros', 'copy_top or random'),
    ('mslt:2x5,4x*,speed=2', 'unknown option'),
    ('mslt:2y5', 'DEPTHxSTEPS'),
  ]:
    with pytest.raises(ConfigError, match=words):
      growth.parse_plan(bad, 4, 10)


def test_vcycle_flag():
  plan, lr_scale = vcycle.parse_plan('down=200,coarse=400', 1000)
  assert (
    plan.levels,
    plan.down_steps,
    plan.coarse_steps,
    plan.up_steps,
    plan.alpha,
    plan.width,
    plan.depth,
    lr_scale,
  ) == (2, (200,), 400, (400,), 0.5, True, True, 1.0)
  assert vcycle.level_steps(plan) == [600, 400]
  plan, lr_scale = vcycle.parse_plan(
    'levels=3,down=100/50,coarse=200,alpha=0.25,depth=0,lr_scale=2,opt=reset', 1000
  )
  assert (plan.down_steps, plan.up_steps, plan.alpha, plan.depth, plan.opt_state, lr_scale) == (
    (100, 50),
    (600, 50),
    0.25,
    False,
    'reset',
    2.0,
  )
  for bad, words in [
    ('down=200', 'coarse=N'),
    ('down=600,coarse=600', 'take 1200'),
    ('down=1,coarse=1,up=1', 'add up'),
    ('down=1,coarse=1,alpha=2', 'alpha'),
    ('down=1,coarse=1,width=0,depth=0', 'width or depth'),
    ('down=1,coarse=1,levels=1', 'levels'),
    ('down=x,coarse=1', 'number'),
    ('down=1,coarse=1,nu=3', 'unknown option'),
  ]:
    with pytest.raises(ConfigError, match=words):
      vcycle.parse_plan(bad, 1000)


def test_combinations_that_are_refused():
  tiny = field_flags.override(presets.get_preset('tiny'), {'num_layers': 4, 'steps': 100})
  ok = [
    {'pld': '0.5,0.01', 'schedule': 'ouroboros', 'stages': 2},
    {'pld': 'default', 'schedule': 'gpipe', 'stages': 2},
    {'std_loss': 0.01, 'schedule': 'ouroboros', 'stages': 2, 'std_loss_layers': '1,3'},
    {'growth': 'mslt:2x50,4x*'},
    {'vcycle': 'down=20,coarse=20', 'schedule': 'ouroboros', 'stages': 2},
  ]
  for overrides in ok:
    field_flags.override(tiny, overrides).validate()
  refused = [
    ({'growth': 'mslt:2x50,4x*', 'schedule': 'ouroboros', 'stages': 2}, 'backprop only'),
    ({'pld': '0.5,0.01', 'growth': 'mslt:2x50,4x*'}, 'cannot be combined'),
    ({'pld': '0.5,0.01', 'std_loss': 0.1}, 'cannot be combined'),
    ({'pld': '0.5,0.01', 'pre_ln': False}, 'pre-LN'),
    (
      {'vcycle': 'down=20,coarse=20', 'schedule': 'ouroboros', 'stages': 3},
      '--stages 3 cuts the model into 3 groups',
    ),
    ({'vcycle': 'down=20,coarse=20', 'num_heads': 1, 'd_model': 128}, 'odd'),
    ({'std_loss': 0.1, 'std_loss_layers': '4'}, 'outside'),
    ({'std_loss': -1.0}, 'weight'),
    ({'growth': 'mslt:2x50,4x*', 'sync_warmup_steps': 5}, 'sync-warmup'),
  ]
  for overrides, words in refused:  # as the command line prints them
    with pytest.raises(ConfigError) as error:
      field_flags.override(tiny, overrides).validate()
    assert re.search(words, cli_message(error.value)), cli_message(error.value)


BAD_FLAGS = [
  (['--pld', '0.5'], ['--pld', 'THETA_BAR,GAMMA']),
  (['--growth', 'mslt:1x10,2x10', '--steps', '30'], ['--growth', '20 steps', '--steps is 30']),
  (
    ['--vcycle', 'down=10,coarse=10', '--schedule', 'ouroboros', '--stages', '2'],
    ['--stages 2 cuts the model into 2 groups', 'only 1 layer;'],
  ),
]


def test_bad_accelerator_flags_fail_in_one_line_and_bench_refuses_them():
  """Each command line in a process of its own, forked from one that has imported the command
  (a subprocess each before: 7 s of a 15-minute suite, most of it imports of JAX)."""
  trains = [
    ['train', '--num-layers', '2', *args, '--out', os.devnull + '/x'] for args, _ in BAD_FLAGS
  ]
  *refused, bench = forked_cli.run_each(*trains, ['bench', '--pld', 'default'])
  for result, (_, words) in zip(refused, BAD_FLAGS, strict=True):
    assert_one_line_error(result, 2, *words)
  assert_one_line_error(bench, 2, '--pld', '`bench`')


SMALL = dict(
  d_model=16,
  num_heads=2,
  num_layers=2,
  d_ff=32,
  seq_len=16,
  batch_size=4,
  steps=4,
  eval_every=2,
  eval_batches=1,
  log_every=1,
  checkpoint_every=10**6,
  warmup_steps=1,
)


def test_methods_train_and_count_their_flops(tmp_path, text_corpus):
  """Four steps of plain training, PLD and MSLT through `loop.train` (the CLI's path): each
  logs validation rows with FLOPs and times; the accelerators spend fewer FLOPs than plain
  training, whose count is the analytic 3 (L F + H) per token, and PLD's is that of the layers
  its gates kept. (Stacking runs MSLT's driver, the standardization loss plain training's loop,
  the V-cycle is run below; the drivers' own tests check their FLOP logs.)"""
  from ouroboros_jax.training import loop

  base = field_flags.override(presets.get_preset('tiny'), {**SMALL, 'data': f'text:{text_corpus}'})
  names = ['plain', 'pld', 'mslt']
  results = {r['method']: r for r in compare.compare(base, str(tmp_path), names, log=lambda _: 0)}
  per_token = 3 * (2 * costs.model_flops(base.model)[0] + costs.model_flops(base.model)[1])
  # FLOP counts: the same formula in Python floats, equal to float64 rounding (default rtol 1e-7).
  np.testing.assert_allclose(results['plain']['flops'], 4 * base.tokens_per_step * per_token)
  pld_cfg = field_flags.override(base, compare.methods(4, 2)['pld'])
  np.testing.assert_allclose(results['pld']['flops'], loop.step_flops(pld_cfg, range(4)).sum())
  for name in names[1:]:
    assert results[name]['flops'] < results['plain']['flops'], name
    assert results[name]['flop_saving'] > 0
  for r in results.values():
    assert np.isfinite(r['val_bpb']) and r['val_bpb'] < 8.5
    assert [row['step'] for row in r['curve']] == [2, 4]
    assert r['curve'][-1]['cpu_s'] > 0 and r['wall_s'] > 0
  table = compare.markdown_table(list(results.values()))
  assert table.count('\n') == 4 and '| mslt |' in table
  compare.plot(list(results.values()), str(tmp_path / 'plot.png'))
  assert (tmp_path / 'plot.png').stat().st_size > 10_000


def test_vcycle_inside_ouroboros(tmp_path, text_corpus):
  """A width-only --vcycle under a 2-device Ouroboros ring, through `loop.train`: every level
  keeps the two layers the ring needs, the dip trains the half-width model."""
  from ouroboros_jax.training import loop

  cfg = field_flags.override(
    presets.get_preset('tiny'),
    {
      **SMALL,
      'data': f'text:{text_corpus}',
      'schedule': 'ouroboros',
      'stages': 2,
      'vcycle': 'down=1,coarse=2,depth=0',
    },
  )
  summary = loop.train(dataclasses.replace(cfg, out=str(tmp_path / 'v')), quiet=True)
  assert np.isfinite(summary['val_bpb'])
  with open(tmp_path / 'v' / 'metrics.jsonl') as f:
    rows = [json.loads(line) for line in f]
  assert [r['level'] for r in rows if r['split'] == 'train'] == [0, 1, 1, 0]
