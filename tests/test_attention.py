"""attention.py: blockwise (flash) attention equals the plain formulas, values and gradients, for
GPT's causal attention and Transformer-XL's relative attention with memory; its temporaries grow
linearly with L; the dispatcher's choices; the Pallas TPU kernel."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ouroboros_jax.models import attention

from helpers import raises_for_cli

# float32 blockwise (online softmax, rescaled per block) against one-pass softmax: the same sums
# over <= 64 keys in another order, ~64 * 2^-24 ~ 4e-6 relative on O(1) values and gradients; 1e-4
# relative (2e-5 absolute near zero) is 25x that, and a wrong mask or shift moves outputs by O(0.1).
F32_TOL = dict(rtol=1e-4, atol=2e-5)


def _normal(seed, *shapes, dtype=jnp.float32):
  keys = jax.random.split(jax.random.key(seed), len(shapes))
  return [jax.random.normal(key, shape).astype(dtype) for key, shape in zip(keys, shapes)]


def _value_and_vjp(fn, args, cotangent):
  """fn(*args) and the gradients of <fn(*args), cotangent> w.r.t. every arg, in one program."""

  def run(*args):
    y, vjp = jax.vjp(fn, *args)
    return y, vjp(cotangent.astype(y.dtype))

  return jax.jit(run)(*args)


def _causal(implementation, block):
  return lambda q, k, v: attention.causal_attention(
    q, k, v, attention.Kernel(implementation, block)
  )


def _relative(implementation, block, key_start_B):
  return lambda q, k, v, r, u, pv: attention.relative_attention(
    q, k, v, attention.Relative(r, u, pv, key_start_B), attention.Kernel(implementation, block)
  )


def _relative_inputs(seed, b, l, m, h, k, dtype=jnp.float32):
  j = m + l
  shapes = [(b, l, h, k), (b, j, h, k), (b, j, h, k), (j, h, k), (h, k), (h, k), (b, l, h, k)]
  *args, cotangent = _normal(seed, *shapes, dtype=dtype)
  return args, cotangent


def _assert_close(got, want, **tol):
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert g.shape == w.shape
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), **tol)


def test_the_blockwise_shift_is_the_relative_shift_of_a_window():
  # Row a of a window holds distances dmax .. dmax - W + 1; key b sits at dmax - (Q-1-a) - b.
  q, j = 5, 3
  w = q + j - 1
  (x_2xQxW,) = _normal(0, (2, q, w))
  a_Qx1, b_1xJ = np.arange(q)[:, None], np.arange(j)[None]
  want = np.asarray(x_2xQxW)[:, a_Qx1, b_1xJ + q - 1 - a_Qx1]
  np.testing.assert_array_equal(attention._skew(x_2xQxW), want)
  # _unskew is its transpose: <skew(x), g> == <x, unskew(g)>.
  (g_2xQxJ,) = _normal(1, (2, q, j))
  transpose = jax.linear_transpose(attention._skew, x_2xQxW)
  # _unskew and the transpose move the same numbers (no sums of more than one term): float32 exact.
  np.testing.assert_allclose(attention._unskew(g_2xQxJ, w), transpose(g_2xQxJ)[0], rtol=1e-6)
  # One query per block (Q = 1) is a plain copy of the window.
  (x_1xJ,) = _normal(2, (1, j))
  np.testing.assert_array_equal(attention._skew(x_1xJ), x_1xJ)


@pytest.mark.parametrize('length,block', [(64, 16), (50, 16), (40, 64)])
def test_blockwise_causal_attention_equals_plain(length, block):
  """Values and gradients for q, k, v; L a multiple of the block, not one, and within a block."""
  q, k, v, cotangent = _normal(length, *[(2, length, 2, 8)] * 4)
  want = _value_and_vjp(_causal('xla', block), (q, k, v), cotangent)
  got = _value_and_vjp(_causal('blockwise', block), (q, k, v), cotangent)
  _assert_close(got, want, **F32_TOL)
  # The plain one is jax.nn.dot_product_attention's causal attention: check it against einsums.
  score = jnp.einsum('blhk,bjhk->bhlj', q, k) / np.sqrt(8)
  score = jnp.where(jnp.tril(jnp.ones((length, length), bool)), score, -jnp.inf)
  y = jnp.einsum('bhlj,bjhk->blhk', jax.nn.softmax(score, -1), v)
  _assert_close(want[0], y, **F32_TOL)


@pytest.mark.parametrize(
  'length,mem,block,key_start',
  [
    (32, 0, 8, [0, 0]),  # no memory: causal over the segment
    (32, 24, 8, [0, 0]),  # a full memory, J = 56 a multiple of the block
    (30, 21, 8, [5, 19]),  # partly filled memory (per row), J = 51 not a multiple of the block
    (30, 21, 16, [21, 3]),  # an empty memory in one row; key blocks wholly unfilled are skipped
    (7, 21, 16, [2, 0]),  # fewer queries than one block, keys over two
  ],
)
def test_blockwise_relative_attention_equals_plain(length, mem, block, key_start):
  """Transformer-XL: values and gradients for q, k, v, r, u and v."""
  args, cotangent = _relative_inputs(length + mem, 2, length, mem, 2, 8)
  key_start_B = jnp.asarray(key_start, jnp.int32)
  want = _value_and_vjp(_relative('xla', block, key_start_B), args, cotangent)
  got = _value_and_vjp(_relative('blockwise', block, key_start_B), args, cotangent)
  _assert_close(got, want, **F32_TOL)
  # Every gradient is exercised (a vanishing one would pass the comparison trivially).
  assert all(float(jnp.abs(g).max()) > 0.1 for g in want[1])


def test_the_relative_mask_hides_the_future_and_unfilled_memory():
  """Query i sees key j iff M - filled <= j <= i + M (M = 6 memory slots, L = 4 queries)."""
  filled_B = np.asarray([0, 3, 6])
  got = np.asarray(attention.relative_mask(4, 10, 6 - filled_B))
  for b, i, j in np.ndindex(3, 4, 10):
    assert got[b, 0, i, j] == (6 - filled_B[b] <= j <= i + 6), (b, i, j)


def test_bfloat16_inputs_agree_with_float32():
  """bf16 in, bf16 out; scores and statistics in fp32, so only bf16 rounding differs."""
  q, k, v, cotangent = _normal(7, *[(2, 40, 2, 16)] * 4)
  to_bf16 = lambda xs: [x.astype(jnp.bfloat16) for x in xs]
  args = to_bf16([q, k, v])
  want = _value_and_vjp(_causal('xla', 16), [x.astype(jnp.float32) for x in args], cotangent)
  got = _value_and_vjp(_causal('blockwise', 16), args, cotangent)
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(got))
  # bf16 in and out (2^-8 relative), O(1) values: the gradients sum 40 bf16-rounded products,
  # ~sqrt(40) * 2^-8 ~ 0.025; a wrong mask or a missing block moves them by O(1).
  _assert_close(got, want, rtol=0.05, atol=0.03)

  rel_args, cotangent = _relative_inputs(8, 2, 24, 16, 2, 16)
  rel_args = to_bf16(rel_args)
  key_start_B = jnp.asarray([3, 16], jnp.int32)
  upcast = [x.astype(jnp.float32) for x in rel_args]
  want = _value_and_vjp(_relative('xla', 16, key_start_B), upcast, cotangent)
  got = _value_and_vjp(_relative('blockwise', 16, key_start_B), rel_args, cotangent)
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(got))
  _assert_close(got, want, rtol=0.05, atol=0.05)


def _temp_bytes(fn, *shapes):
  """Temporary bytes of the compiled value_and_grad of sum(fn(...)**2) w.r.t. float args."""
  floats = tuple(i for i, s in enumerate(shapes) if s.dtype == jnp.float32)
  loss = lambda *args: jnp.sum(fn(*args) ** 2)
  compiled = jax.jit(jax.value_and_grad(loss, argnums=floats)).lower(*shapes).compile()
  return compiled.memory_analysis().temp_size_in_bytes


def test_blockwise_temporaries_grow_linearly_with_length():
  """Forward and backward: doubling L at most ~doubles the temporaries (the plain ones grow 4x,
  which shows the measurement can tell)."""
  f32, block = jnp.float32, 128
  spec = lambda *shape, dtype=f32: jax.ShapeDtypeStruct(shape, dtype)

  def gpt(implementation, l):
    fn = lambda q, k, v: attention.causal_attention(
      q, k, v, attention.Kernel(implementation, block)
    )
    return _temp_bytes(fn, *[spec(1, l, 2, 8)] * 3)

  def txl(implementation, l):  # M = L: J = 2L keys
    fn = lambda q, k, v, r, u, pv, start: attention.relative_attention(
      q, k, v, attention.Relative(r, u, pv, start), attention.Kernel(implementation, block)
    )
    kv = spec(1, 2 * l, 2, 8)
    shapes = (spec(1, l, 2, 8), kv, kv, spec(2 * l, 2, 8), spec(2, 8), spec(2, 8))
    return _temp_bytes(fn, *shapes, spec(1, dtype=jnp.int32))

  for name, measure in (('gpt', gpt), ('txl', txl)):
    blockwise = measure('blockwise', 2048) / measure('blockwise', 1024)
    plain = measure('xla', 2048) / measure('xla', 1024)
    print(f'{name}: temp bytes at 2L / at L: blockwise {blockwise:.2f}, plain {plain:.2f}')
    assert blockwise <= 2.5, (name, blockwise)
    assert plain > 3.5, (name, plain)


def test_resolve_picks_by_platform_dtype_and_length():
  bf16, f32 = jnp.bfloat16, jnp.float32
  assert attention.resolve('auto', 'gpu', bf16, 4096, 512) == 'cudnn'
  assert attention.resolve('auto', 'gpu', f32, 4096, 512) == 'blockwise'
  assert attention.resolve('auto', 'gpu', f32, 512, 512) == 'xla'
  assert attention.resolve('auto', 'gpu', bf16, 4096, 512, relative=True) == 'blockwise'
  assert attention.resolve('auto', 'tpu', f32, 128, 512) == 'pallas'
  assert attention.resolve('auto', 'tpu', bf16, 128, 512, relative=True) == 'xla'
  assert attention.resolve('auto', 'cpu', f32, 1024, 512) == 'blockwise'
  assert attention.resolve('auto', 'cpu', bf16, 64, 512) == 'xla'
  assert attention.resolve('blockwise', 'cpu', f32, 64, 512) == 'blockwise'
  with pytest.raises(ValueError, match='bfloat16 or float16'):
    attention.resolve('cudnn', 'gpu', f32, 64, 512)
  with pytest.raises(ValueError, match='relative positions'):
    attention.resolve('pallas', 'tpu', bf16, 64, 512, relative=True)
  with pytest.raises(ValueError, match='unknown attention'):
    attention.resolve('flash', 'cpu', f32, 64, 512)


def test_attention_dropout_runs_plain():
  """Blockwise has no attention dropout: explicit blockwise refuses it, auto runs the plain one
  (the same draws as before), and without an rng (evaluation) blockwise runs."""
  args, _ = _relative_inputs(3, 2, 16, 8, 2, 8)
  key_start_B, rng = jnp.asarray([0, 4], jnp.int32), jax.random.key(5)

  def run(impl, dropout_rate=0.0, key=None):
    fn = lambda q, k, v, r, u, pv, start: attention.relative_attention(
      q,
      k,
      v,
      attention.Relative(r, u, pv, start),
      attention.Kernel(impl, 8),
      attention.Dropout(dropout_rate, key),
    )
    return jax.jit(fn)(*args, key_start_B)

  with pytest.raises(ValueError, match='no attention dropout'):
    run('blockwise', dropout_rate=0.1, key=rng)
  dropped = run('auto', dropout_rate=0.5, key=rng)
  np.testing.assert_array_equal(dropped, run('xla', dropout_rate=0.5, key=rng))
  # dropout at rate 0.5 changes about half the outputs by O(1), far above 1e-3.
  assert not np.allclose(dropped, run('xla'), atol=1e-3)  # dropout did something
  _assert_close(run('blockwise', dropout_rate=0.5), run('xla'), **F32_TOL)


def test_pallas_kernel_equals_plain_in_the_interpreter():
  """The splash-attention path (padding L = 200 to two 128 blocks), run by the Pallas
  interpreter: values and gradients."""
  q, k, v, cotangent = _normal(11, *[(1, 200, 2, 32)] * 4)
  pallas = lambda q, k, v: attention.pallas_causal_attention(q, k, v, block=128, interpret=True)
  got = _value_and_vjp(pallas, (q, k, v), cotangent)
  _assert_close(got, _value_and_vjp(_causal('xla', 128), (q, k, v), cotangent), **F32_TOL)


_TPU_COMPILE = textwrap.dedent("""
  import jax, jax.numpy as jnp
  from jax.experimental import topologies
  from ouroboros_jax.models import attention
  device = topologies.get_topology_desc('v5e:2x2', 'tpu').devices[0]
  sharding = jax.sharding.SingleDeviceSharding(device)
  spec = jax.ShapeDtypeStruct((2, 1000, 4, 64), jnp.bfloat16, sharding=sharding)
  fn = lambda q, k, v: attention.causal_attention(q, k, v, attention.Kernel('pallas', 512))
  loss = lambda *a: jnp.sum(fn(*a).astype(jnp.float32) ** 2)
  for f in (fn, jax.value_and_grad(loss, argnums=(0, 1, 2))):
    compiled = jax.jit(f, in_shardings=(sharding,) * 3).lower(spec, spec, spec).compile()
    assert 'tpu_custom_call' in compiled.as_text(), 'no Pallas kernel in the TPU program'
  print('compiled')
""")


@pytest.mark.skipif(importlib.util.find_spec('libtpu') is None, reason='needs libtpu')
def test_pallas_kernel_compiles_for_a_tpu_without_one():
  """Forward and backward compile for a v5e topology (deviceless, in a fresh process: the TPU
  target must be chosen before JAX starts)."""
  env = {
    **os.environ,
    'JAX_PLATFORMS': 'cpu',
    'TPU_ACCELERATOR_TYPE': 'v5litepod-4',  # any type: it only quiets libtpu's host probing
    'TPU_WORKER_HOSTNAMES': 'localhost',
    'ALLOW_MULTIPLE_LIBTPU_LOAD': '1',  # other test processes may hold libtpu's lock
  }
  result = subprocess.run(
    [sys.executable, '-c', _TPU_COMPILE], env=env, capture_output=True, text=True, timeout=120
  )
  assert result.returncode == 0 and 'compiled' in result.stdout, result.stderr[-3000:]


def test_impossible_kernel_choices_are_one_line_config_errors():
  from ouroboros_jax.errors import ConfigError
  from ouroboros_jax.models import model as gpt

  with pytest.raises(ConfigError, match='runs on TPUs only and this run is on cpu'):
    attention.check_platform('pallas', 'cpu')
  with pytest.raises(ConfigError, match='runs on GPUs only'):
    attention.check_platform('cudnn', 'tpu')
  attention.check_platform('blockwise', 'cpu')  # portable: no error
  with pytest.raises(ConfigError, match='no relative positions'):
    gpt.ModelConfig(arch='transformer-xl', attention='pallas').validate()
  with raises_for_cli('--dtype bfloat16'):
    gpt.ModelConfig(attention='cudnn').validate()
  assert gpt.ModelConfig(seq_len=1024, attention_block=256).attention_kind('cpu') == 'blockwise'
  assert gpt.ModelConfig(dtype='bfloat16').attention_kind('gpu') == 'cudnn'
  with pytest.raises(ConfigError, match='no attention dropout'):
    gpt.ModelConfig(arch='transformer-xl', attention='blockwise', attn_dropout=0.1).validate()
