"""The chunked cross-entropy head (`cross_entropy.chunked_cross_entropy`, `model.head_loss` with
`loss_chunk_tokens` > 0): the loss and its gradients are the plain log-softmax's, in float32 and
in bf16, whatever the chunks (a padded tail, one chunk, more chunks than needed); a schedule
trains with it as with the unchunked head; the compiled program's scratch memory falls."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ouroboros_jax.errors import ConfigError
from ouroboros_jax.models import cross_entropy
from ouroboros_jax.models import model as transformer
from ouroboros_jax.schedules import ScheduleConfig

from helpers import max_abs_diff, random_batches, run_schedule, tiny_transformer

B, L, D, V = 3, 16, 32, 200  # 48 tokens


def _inputs(dtype=jnp.float32, batch=B):
  k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
  x_BxLxD = jax.random.normal(k1, (batch, L, D), jnp.float32).astype(dtype)
  weight_VxD = 0.3 * jax.random.normal(k2, (V, D), jnp.float32)  # logits O(1), as trained
  targets_BxL = jax.random.randint(k3, (batch, L), 0, V)
  return x_BxLxD, weight_VxD, targets_BxL


def _plain(x_BxLxD, weight_VxD, targets_BxL):
  """The unchunked head's loss: float32 logits, log-softmax, the targets' mean NLL."""
  logits_BxLxV = transformer.output_projection(x_BxLxD, weight_VxD)
  logp_BxLxV = jax.nn.log_softmax(logits_BxLxV)
  return -jnp.take_along_axis(logp_BxLxV, targets_BxL[..., None], axis=-1).mean()


def _value_and_grads(loss, *args):
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(*args)


def test_the_chunk_layout_pads_less_than_one_token_per_chunk():
  assert cross_entropy.chunk_layout(48, 5) == (10, 5)  # 50 slots: 2 padded
  assert cross_entropy.chunk_layout(48, 16) == (3, 16)
  assert cross_entropy.chunk_layout(48, 48) == (1, 48)
  assert cross_entropy.chunk_layout(48, 1000) == (1, 48)
  assert cross_entropy.chunk_layout(48, 0) == (1, 48)
  assert cross_entropy.chunk_layout(64 * 1024, 2048) == (32, 2048)
  assert cross_entropy.chunk_layout(5000, 2048) == (3, 1667)  # not 3 x 2048: 1 padded


@pytest.mark.parametrize('chunk', [5, 16, 47, 48, 1000])
def test_float32_loss_and_gradients_equal_the_plain_log_softmax(chunk):
  """48 tokens in chunks of 5 (a padded tail), 16 (three), 47 (two, one nearly empty), 48 and
  1000 (one chunk, no loop). The same float32 products summed in another order: the loss, a
  mean of 48 values of ~6, within a few float32 ulps (2^-24 relative each); the gradients, sums
  of 200 (dx) or 48 (dW) products of size <= 1/48, within 1e-6 relative to their largest entry."""
  args = _inputs()
  want_loss, want = _value_and_grads(_plain, *args)
  got_loss, got = _value_and_grads(
    lambda x, w, t: cross_entropy.chunked_cross_entropy(x, w, t, chunk), *args
  )
  np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
  for g, w in zip(got, want):
    assert g.dtype == w.dtype and g.shape == w.shape
    np.testing.assert_allclose(g, w, rtol=0, atol=1e-6 * float(jnp.abs(w).max()))
  # Outside differentiation (evaluation) the loop computes the loss alone: the same value.
  evaluated = jax.jit(lambda *a: cross_entropy.chunked_cross_entropy(*a, chunk))(*args)
  np.testing.assert_allclose(evaluated, want_loss, rtol=1e-6)


@pytest.mark.parametrize('chunk', [5, 48])
def test_bf16_compute_equals_the_unchunked_bf16_head_and_float32_within_bf16_rounding(chunk):
  """bf16 x, float32 W (the default recipe: float32 master weights, bf16 compute). Against the
  unchunked bf16 head, the same bf16 products: the loss to float32 rounding; the gradients'
  bf16 g = (softmax - onehot) / T can round differently where the two softmaxes differ in their
  last float32 bit, one bf16 step (2^-8 relative) of one entry, so within 2^-8 of the largest
  entry. Against float32 throughout (on the same bf16-valued x): W rounded to bf16 (2^-9) in the
  logits and again in dx, g rounded (2^-9), dx's output rounded (2^-9): four roundings, each of
  sums of absolute terms that can exceed the largest entry, so within 2^-6 of it (a wrong
  gradient is off by O(1)); the loss (~5.5, logits O(1) moved by 2^-9): within 2^-8."""
  x_BxLxD, weight_VxD, targets_BxL = _inputs(jnp.bfloat16)
  chunked = lambda x, w, t: cross_entropy.chunked_cross_entropy(x, w, t, chunk)
  got_loss, (dx, dw) = _value_and_grads(chunked, x_BxLxD, weight_VxD, targets_BxL)
  assert dx.dtype == jnp.bfloat16 and dw.dtype == jnp.float32 and got_loss.dtype == jnp.float32
  want_loss, want = _value_and_grads(_plain, x_BxLxD, weight_VxD, targets_BxL)
  np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
  for g, w in zip((dx, dw), want):
    g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
    np.testing.assert_allclose(g, w, rtol=0, atol=2**-8 * np.abs(w).max())
  f32_loss, f32 = _value_and_grads(_plain, x_BxLxD.astype(jnp.float32), weight_VxD, targets_BxL)
  np.testing.assert_allclose(got_loss, f32_loss, rtol=2**-8)
  for g, w in zip((dx, dw), f32):
    g, w = np.asarray(g, np.float32), np.asarray(w)
    np.testing.assert_allclose(g, w, rtol=0, atol=2**-6 * np.abs(w).max())


def _head_grads(cfg, params, x_BxLxD, targets_BxL, jit=True):
  def loss(head, embed, x):
    return transformer.head_loss(cfg, head, embed, x, targets_BxL)[0]

  grads = jax.value_and_grad(loss, argnums=(0, 1, 2))
  return (jax.jit(grads) if jit else grads)(params['head'], params['embed'], x_BxLxD)


@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
@pytest.mark.parametrize('tied', [True, False], ids=['tied', 'untied'])
def test_head_loss_chunked_equals_unchunked_tied_and_untied(tied, dtype):
  """model.head_loss through the final LayerNorm and the tied embedding (gradient into
  embed/token) or the untied kernel [D, V] (head/unembed): the chunked head (7 tokens a chunk:
  48 tokens, a padded tail) against the unchunked one, float32 parameters. float32: the same
  products in another order, 1e-6 of the largest entry; bf16 compute: one bf16 step of g may
  differ (see above), 2^-8 of the largest entry."""
  cfg = transformer.ModelConfig(
    vocab_size=V,
    d_model=D,
    num_heads=2,
    num_layers=1,
    d_ff=64,
    seq_len=L,
    tie_embeddings=tied,
    dtype=dtype,
    loss_chunk_tokens=7,
  )
  params = transformer.init_params(cfg, jax.random.key(1))
  x_BxLxD, _, targets_BxL = _inputs(cfg.compute_dtype)
  got_loss, got = _head_grads(cfg, params, x_BxLxD, targets_BxL)
  plain = dataclasses.replace(cfg, loss_chunk_tokens=0)
  # Op by op: XLA:CPU (jaxlib 0.10.2) compiles the unchunked untied bf16 head's kernel gradient
  # into a dot it cannot run ('Unsupported element type for DotThunk::Execute: BF16 x BF16 =
  # F32'); the chunked head's dots run compiled.
  want_loss, want = _head_grads(plain, params, x_BxLxD, targets_BxL, jit=False)
  np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
  bound = 1e-6 if dtype == 'float32' else 2**-8
  weight = ('embed', 'token', 'embedding') if tied else ('head', 'unembed', 'kernel')
  assert float(jnp.abs(_at(got, weight)).max()) > 0  # the projection's weight gets a gradient
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert g.dtype == w.dtype
    g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
    np.testing.assert_allclose(g, w, rtol=0, atol=bound * np.abs(w).max())


def _at(grads, path):
  head, embed, _ = grads
  tree = {'head': head, 'embed': embed}
  for key in path:
    tree = tree[key]
  return tree


def test_it_runs_under_vmap():
  """vmapped over a leading axis of two batches: each batch's loss and gradients."""
  x_BxLxD, weight_VxD, targets_BxL = _inputs()
  x_2xBxLxD = jnp.stack([x_BxLxD, -x_BxLxD])
  targets_2xBxL = jnp.stack([targets_BxL, targets_BxL[::-1]])
  fn = jax.value_and_grad(lambda x, w, t: cross_entropy.chunked_cross_entropy(x, w, t, 5))
  losses, dx = jax.jit(jax.vmap(fn, in_axes=(0, None, 0)))(x_2xBxLxD, weight_VxD, targets_2xBxL)
  for i in range(2):
    loss, want = jax.value_and_grad(_plain)(x_2xBxLxD[i], weight_VxD, targets_2xBxL[i])
    np.testing.assert_allclose(losses[i], loss, rtol=1e-6)
    np.testing.assert_allclose(dx[i], want, rtol=0, atol=1e-6 * float(jnp.abs(want).max()))


@pytest.mark.parametrize('check_vma', [False, True])
def test_it_runs_inside_a_shard_map(check_vma):
  """Two devices, each with half the batch (x and the targets split over 'data', W the same on
  both), the whole batch's mean as the mean of the halves' means; check_vma=False as every
  schedule here runs its shard_map. With check_vma=True a W the same on every device must be
  cast to varying first (its gradient varies; so must the unchunked head's), and then the
  chunks' sum of dW varies from its first chunk on. float32 rounding: 1e-6 relative."""
  mesh = jax.make_mesh((2,), ('data',))
  x_BxLxD, weight_VxD, targets_BxL = _inputs(batch=4)
  split, same = NamedSharding(mesh, P('data')), NamedSharding(mesh, P())

  def local(x, w, t):
    def half_loss(x, w):
      if check_vma:  # the gradient of the cast is the sum over 'data': the same on both
        w = jax.lax.pcast(w, ('data',), to='varying')
      return cross_entropy.chunked_cross_entropy(x, w, t, 5)

    loss, (dx, dw) = jax.value_and_grad(half_loss, argnums=(0, 1))(x, w)
    return jax.lax.pmean(loss, 'data'), dx / 2, dw / 2 if check_vma else jax.lax.pmean(dw, 'data')

  sharded = jax.shard_map(
    local,
    mesh=mesh,
    in_specs=(P('data'), P(), P('data')),
    out_specs=(P(), P('data'), P()),
    check_vma=check_vma,
  )
  loss, dx, dw = jax.jit(sharded)(
    jax.device_put(x_BxLxD, split),
    jax.device_put(weight_VxD, same),
    jax.device_put(targets_BxL, split),
  )
  want_loss, (want_dx, want_dw) = _value_and_grads(_plain, x_BxLxD, weight_VxD, targets_BxL)
  np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
  for g, w in ((dx, want_dx), (dw, want_dw)):
    np.testing.assert_allclose(g, w, rtol=0, atol=1e-6 * float(jnp.abs(w).max()))


def test_a_negative_chunk_is_refused():
  with pytest.raises(ConfigError, match='loss_chunk_tokens'):
    transformer.ModelConfig(loss_chunk_tokens=-1).validate()


def _temp_bytes(chunk: int, tokens: int = 2048, vocab: int = 8192, d: int = 64) -> int:
  """XLA:CPU's scratch memory of the head's loss and gradients at `tokens` x `vocab`."""
  x = jax.ShapeDtypeStruct((tokens // 512, 512, d), jnp.float32)
  w = jax.ShapeDtypeStruct((vocab, d), jnp.float32)
  t = jax.ShapeDtypeStruct((tokens // 512, 512), jnp.int32)
  loss = (lambda x, w, t: cross_entropy.chunked_cross_entropy(x, w, t, chunk)) if chunk else _plain
  compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(x, w, t).compile()
  return compiled.memory_analysis().temp_size_in_bytes


def test_chunks_cut_the_scratch_memory():
  """2048 tokens, vocabulary 8192: the unchunked head holds float32 logits [2048, 8192] (64 MiB)
  and their gradient (320 MiB of scratch in all); chunks of 256 tokens hold a few [256, 8192]
  float32 arrays (8 MiB each) and dW (2 MiB) at a time (17 MiB seen): under a tenth."""
  whole, chunked = _temp_bytes(0), _temp_bytes(256)
  assert whole > 64 * 2**20, whole
  assert chunked < 0.1 * whole, (chunked, whole)


# A schedule end to end: the tiny Transformer (vocab 256) trained with the chunked head (6
# tokens a chunk: 32 tokens a batch, 16 a micro-batch, padded tails) against the unchunked one.
SCHEDULES = [
  ('backprop', ScheduleConfig(name='backprop', num_stages=1)),
  ('1f1b', ScheduleConfig(name='1f1b', num_stages=2, microbatches=2)),
  ('ouroboros', ScheduleConfig(name='ouroboros', num_stages=2, microbatches=2)),
]


@pytest.mark.parametrize('config', [s[1] for s in SCHEDULES], ids=[s[0] for s in SCHEDULES])
def test_a_schedule_trains_with_the_chunked_head_as_with_the_unchunked_one(config):
  """Three SGD steps at 0.5: the losses and parameters equal the unchunked head's within float32
  rounding of another summation order (the head's sums over tokens and chunks: gradients ~1e-7
  apart, times 0.5, three steps); a wrong gradient of any piece moves them by more than 1e-3."""
  batches = random_batches(3)
  results = []
  for chunk in (6, 0):
    model, params = tiny_transformer(config.num_stages, num_layers=4, loss_chunk_tokens=chunk)
    state, losses = run_schedule(config, model, optax.sgd(0.5), params, batches)
    results.append((jax.device_get(state.params), losses))
  (got, got_losses), (want, want_losses) = results
  np.testing.assert_allclose(got_losses, want_losses, rtol=1e-6)
  assert max_abs_diff(got, want) < 1e-6
