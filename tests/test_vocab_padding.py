"""The padded vocabulary (`ModelConfig.vocab_multiple`): the token embedding and an untied output
projection hold vocab_size rows rounded up to a multiple, and the padded logits are masked out of
the softmax. Checked against the unpadded model with the same real rows: the same loss and
gradients, with the chunked and the whole head, tied and untied, and no gradient into the
padded rows."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ouroboros_jax.models import model as transformer
from ouroboros_jax.models.model import ConfigError, ModelConfig

TINY = ModelConfig(vocab_size=250, d_model=32, num_heads=2, num_layers=2, d_ff=64, seq_len=16)


def test_the_vocabulary_rounds_up_to_its_multiple():
  assert TINY.padded_vocab == 256
  assert dataclasses.replace(TINY, vocab_size=256).padded_vocab == 256
  assert dataclasses.replace(TINY, vocab_size=50257).padded_vocab == 50304  # GPT-2's
  assert dataclasses.replace(TINY, vocab_multiple=1).padded_vocab == 250
  with pytest.raises(ConfigError, match='vocab_multiple'):
    dataclasses.replace(TINY, vocab_multiple=0).validate()


def _padded(params, cfg_real, cfg_pad, key):
  """The real model's parameters with random extra rows in the padded tables."""
  params = jax.tree.map(lambda x: x, params)
  extra = cfg_pad.padded_vocab - cfg_real.padded_vocab
  table = params['embed']['token']['embedding']
  rows = jax.random.normal(key, (extra, table.shape[1]), table.dtype)
  params['embed']['token']['embedding'] = jnp.concatenate([table, rows])
  if not cfg_real.tie_embeddings:
    kernel = params['head']['unembed']['kernel']
    cols = jax.random.normal(key, (kernel.shape[0], extra), kernel.dtype)
    params['head']['unembed']['kernel'] = jnp.concatenate([kernel, cols], axis=1)
  return params


@pytest.mark.parametrize('tied', [True, False])
@pytest.mark.parametrize('chunk_tokens', [0, 24])  # the whole head; chunks (two, a padded tail)
def test_the_padded_model_is_the_unpadded_one(tied, chunk_tokens):
  cfg_pad = dataclasses.replace(TINY, tie_embeddings=tied, loss_chunk_tokens=chunk_tokens)
  cfg_real = dataclasses.replace(cfg_pad, vocab_multiple=1)
  key_init, key_rows, key_data = jax.random.split(jax.random.key(0), 3)
  params_real = transformer.init_params(cfg_real, key_init)
  params_pad = _padded(params_real, cfg_real, cfg_pad, key_rows)
  assert params_pad['embed']['token']['embedding'].shape == (256, 32)
  # The padded init has the same tree as the one the model builds.
  shapes = jax.tree.map(jnp.shape, transformer.init_params(cfg_pad, key_init))
  assert jax.tree.map(jnp.shape, params_pad) == shapes
  tokens = jax.random.randint(key_data, (2, 17), 0, cfg_real.vocab_size)
  batch = {'inputs': tokens[:, :-1], 'targets': tokens[:, 1:]}

  def loss_and_grads(cfg, params):
    return jax.value_and_grad(lambda p: transformer.loss_fn(cfg, p, batch)[0])(params)

  loss_real, grads_real = loss_and_grads(cfg_real, params_real)
  loss_pad, grads_pad = loss_and_grads(cfg_pad, params_pad)
  np.testing.assert_allclose(loss_pad, loss_real, rtol=1e-6)
  table_pad = grads_pad['embed']['token']['embedding']
  np.testing.assert_allclose(table_pad[:250], grads_real['embed']['token']['embedding'], atol=1e-7)
  assert not np.any(table_pad[250:]), 'a padded row got a gradient'
  if not tied:
    kernel_pad = grads_pad['head']['unembed']['kernel']
    np.testing.assert_allclose(
      kernel_pad[:, :250], grads_real['head']['unembed']['kernel'], atol=1e-7
    )
    assert not np.any(kernel_pad[:, 250:]), 'a padded column got a gradient'
  for path in (('layers',), ('embed', 'position')):
    real, pad = grads_real, grads_pad
    for name in path:
      real, pad = real[name], pad[name]
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-7), pad, real)


def test_the_logits_cover_the_real_vocabulary_only():
  params = transformer.init_params(TINY, jax.random.key(0))
  x = transformer.embed(TINY, params['embed'], jnp.zeros((1, 16), jnp.int32))
  logits = transformer.logits(TINY, params['head'], params['embed'], x)
  assert logits.shape == (1, 16, 250)
