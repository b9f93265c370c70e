"""Transformer-XL (txl.py): relative attention, the relative shift, segment recurrence."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ouroboros_jax.models import attention, txl
from ouroboros_jax.models import model as gpt

from helpers import raises_for_cli

CFG = gpt.ModelConfig(
  arch='transformer-xl', vocab_size=32, d_model=32, num_heads=4, num_layers=2, d_ff=64, seq_len=8
)


def _memoryless(cfg, params, tokens):
  x = txl.embed(cfg, params['embed'], tokens)
  return txl.layers(cfg, params['layers'], x)[0]


@pytest.mark.parametrize('pre_ln', [True, False])
def test_output_does_not_depend_on_later_inputs(pre_ln):
  cfg = dataclasses.replace(CFG, pre_ln=pre_ln)
  params = txl.init_params(cfg, jax.random.key(0))
  x = txl.embed(cfg, params['embed'], jnp.arange(16).reshape(2, 8) % 32)
  memory = txl.init_memory(cfg, 2, 2, 4)
  t = 3
  grad = jax.grad(lambda x: txl.layers(cfg, params['layers'], x, memory)[0][:, t].sum())(x)
  assert float(jnp.abs(grad[:, t + 1 :]).max()) == 0.0
  assert float(jnp.abs(grad[:, : t + 1]).max()) > 0.0


def test_rel_shift_puts_each_distance_in_place():
  b, h, l, m = 1, 2, 3, 4
  j = l + m
  raw = jax.random.normal(jax.random.key(1), (b, h, l, j))  # column c: distance j - 1 - c
  shifted = attention.rel_shift(raw)
  for i in range(l):
    for k in range(i + m + 1):  # the unmasked keys
      distance = i + m - k
      np.testing.assert_array_equal(shifted[:, :, i, k], raw[:, :, i, j - 1 - distance])


@pytest.mark.parametrize('pre_ln', [True, False])
def test_memory_equals_one_long_segment(pre_ln):
  """Segment 2 with segment 1's memory = the last half of one run over both segments."""
  cfg = dataclasses.replace(CFG, pre_ln=pre_ln)
  params = txl.init_params(cfg, jax.random.key(0))
  tokens = jax.random.randint(jax.random.key(2), (2, 16), 0, 32)
  whole = _memoryless(dataclasses.replace(cfg, seq_len=16), params, tokens)
  memory = txl.init_memory(cfg, cfg.num_layers, 2, 8)
  x1 = txl.embed(cfg, params['embed'], tokens[:, :8])
  first, memory = txl.layers(cfg, params['layers'], x1, memory)
  np.testing.assert_array_equal(memory['filled'], [8, 8])
  x2 = txl.embed(cfg, params['embed'], tokens[:, 8:])
  second, memory = txl.layers(cfg, params['layers'], x2, memory)
  # float32 attention over a memory split in two against one whole window: sums in another order,
  # ~1e-6 relative on O(1) hidden states; 2e-5 is 20x, and a mask off by one slot moves them by
  # O(0.1).
  np.testing.assert_allclose(first, whole[:, :8], atol=2e-5, rtol=2e-5)
  np.testing.assert_allclose(second, whole[:, 8:], atol=2e-5, rtol=2e-5)


def test_a_partly_filled_memory_masks_its_empty_slots():
  """A memory longer than what was seen: the unfilled slots do not change the result."""
  params = txl.init_params(CFG, jax.random.key(0))
  tokens = jax.random.randint(jax.random.key(2), (2, 16), 0, 32)
  x1 = txl.embed(CFG, params['embed'], tokens[:, :8])
  x2 = txl.embed(CFG, params['embed'], tokens[:, 8:])
  results = []
  for mem_len in (8, 12):
    memory = txl.init_memory(CFG, CFG.num_layers, 2, mem_len)
    memory['hidden'] = memory['hidden'] + 7.0  # garbage in the unfilled slots
    _, memory = txl.layers(CFG, params['layers'], x1, memory)
    results.append(txl.layers(CFG, params['layers'], x2, memory)[0])
  # As above: unfilled slots are masked to exp(-inf) = 0, so the garbage adds nothing.
  np.testing.assert_allclose(results[0], results[1], atol=2e-5, rtol=2e-5)


def test_memory_receives_no_gradient():
  params = txl.init_params(CFG, jax.random.key(0))
  x = txl.embed(CFG, params['embed'], jnp.ones((2, 8), jnp.int32))
  memory = txl.init_memory(CFG, 2, 2, 8)
  memory['hidden'] = jax.random.normal(jax.random.key(3), memory['hidden'].shape)
  memory['filled'] = jnp.full((2,), 8, jnp.int32)

  def loss(hidden):
    y, new = txl.layers(CFG, params['layers'], x, {**memory, 'hidden': hidden})
    return y.sum() + new['hidden'].sum()

  grad = jax.grad(loss)(memory['hidden'])
  assert float(jnp.abs(grad).max()) == 0.0
  # ... while the output does depend on the memory's values (pre-LN: not on their scale)
  y_a = txl.layers(CFG, params['layers'], x, memory)[0]
  y_b = txl.layers(CFG, params['layers'], x, {**memory, 'hidden': jnp.flip(memory['hidden'], -1)})[
    0
  ]
  assert float(jnp.abs(y_a - y_b).max()) > 1e-4


def test_clamp_len_shares_far_distances():
  cfg = dataclasses.replace(CFG, clamp_len=3)
  pos = txl.positional_encoding(cfg, 8)
  np.testing.assert_array_equal(pos[0], pos[4])  # distances 7 and 3
  assert float(jnp.abs(pos[4] - pos[5]).max()) > 0  # 3 and 2 differ


@pytest.mark.parametrize(
  'change, flag',
  [
    ({'mem_len': -1}, '--mem-len'),
    ({'clamp_len': -2}, '--clamp-len'),
    ({'arch': 'rnn'}, '--model'),
    ({'arch': 'gpt', 'mem_len': 4}, '--model transformer-xl'),
  ],
)
def test_bad_settings_name_the_flag(change, flag):
  with raises_for_cli(flag) as info:
    dataclasses.replace(CFG, **change).validate()
  assert '\n' not in str(info.value)


def test_dropout_only_with_a_key():
  cfg = dataclasses.replace(CFG, dropout=0.3, attn_dropout=0.2)
  params = txl.init_params(cfg, jax.random.key(0))
  batch = {'inputs': jnp.ones((2, 8), jnp.int32), 'targets': jnp.ones((2, 8), jnp.int32)}
  (plain, _), _ = txl.loss_fn(cfg, params, batch)
  (again, _), _ = txl.loss_fn(cfg, params, batch)
  (dropped, _), _ = txl.loss_fn(cfg, params, batch, rng=jax.random.key(1))
  assert float(plain) == float(again)
  assert abs(float(plain) - float(dropped)) > 1e-4


@pytest.mark.parametrize(
  'flags, words',
  [
    ({'pld': 'default'}, '--pld'),
    ({'eval_mem_len': -1}, '--eval-mem-len'),
    ({'data_order': 'random'}, '--data-order'),
  ],
)
def test_run_settings_that_cannot_work_name_the_flag(flags, words):
  from ouroboros_jax.training import field_flags, presets

  cfg = field_flags.override(presets.get_preset('txl-tiny'), {'mem_len': 64, **flags})
  with raises_for_cli(words) as info:
    cfg.validate()
  assert '\n' not in str(info.value)


def test_eval_mem_len_needs_a_memory():
  from ouroboros_jax.training import field_flags, presets

  cfg = field_flags.override(presets.get_preset('tiny'), {'eval_mem_len': 8})
  with raises_for_cli('--model transformer-xl'):
    cfg.validate()


def test_presets_of_the_paper_validate_and_order_segments():
  from ouroboros_jax.training import field_flags, presets

  for name in ('txl-enwik8-base', 'txl-wt103-base'):
    cfg = presets.get_preset(name)
    cfg.validate()
    assert cfg.model.arch == 'transformer-xl' and cfg.segment_order
  assert not presets.get_preset('tiny').segment_order
  assert not presets.get_preset('txl-tiny').segment_order  # no memory: shuffled windows
  with_memory = field_flags.override(presets.get_preset('txl-tiny'), {'mem_len': 64})
  assert with_memory.segment_order and with_memory.resolved_eval_mem_len == 64
