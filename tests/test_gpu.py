"""On a GPU: the kernels and steps that only a GPU runs, against the ones the CPU suite proves.

`experiments/device_check.sh` runs this file on the lent GPU machine with
`OUROBOROS_TEST_PLATFORMS=cuda,cpu` (the GPU first, the CPU beside it); on a machine without a
GPU every test here is skipped, and the rest of the suite proves the same kernels and schedules on
the CPU.

- cuDNN's fused attention (`jax.nn.dot_product_attention(implementation='cudnn')`, the default
  on a GPU in bf16) equals the XLA and blockwise kernels in value and in gradient;
- one bf16 backprop run on the GPU equals the same run on the CPU within the bf16 tolerance of
  tests/test_bf16.py (stated against how far training moves the parameters);
- Ouroboros with one stage equals backprop on the GPU (float32, as on the CPU).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from ouroboros_jax.models import attention, partition
from ouroboros_jax.schedules import ScheduleConfig, build_schedule

from helpers import max_abs_diff, random_batches, tiny_transformer


def _gpus():
  try:
    return jax.devices('gpu')
  except RuntimeError:  # no GPU backend on this machine
    return []


pytestmark = pytest.mark.skipif(
  not _gpus(),
  reason='needs a GPU: experiments/device_check.sh runs it with OUROBOROS_TEST_PLATFORMS=cuda,cpu',
)

BF16_ATOL = 5e-3  # tests/test_bf16.py: parameters after STEPS steps of SGD 0.5
STEPS = 4


def _attention(implementation, q, k, v, cotangent):
  """(output, dq, dk, dv) of causal attention by one kernel, in float32 for comparing."""
  kernel = attention.Kernel(implementation=implementation, block=64)
  fn = lambda q, k, v: attention.causal_attention(q, k, v, kernel)
  out, vjp = jax.vjp(fn, q, k, v)
  return [x.astype(jnp.float32) for x in (out, *vjp(cotangent.astype(out.dtype)))]


def test_cudnn_attention_equals_the_xla_and_blockwise_kernels():
  keys = jax.random.split(jax.random.key(0), 4)
  shape = (2, 256, 4, 64)  # B, L, H, K: four 64-key blocks for the blockwise kernel
  q, k, v, cotangent = (jax.random.normal(key, shape, jnp.float32) for key in keys)
  half = [x.astype(jnp.bfloat16) for x in (q, k, v)]
  exact = jax.jit(lambda *a: _attention('xla', *a))(q, k, v, cotangent)  # float32 reference
  scale = [float(jnp.max(jnp.abs(x))) for x in exact]
  for implementation in ('cudnn', 'xla', 'blockwise'):
    got = jax.jit(lambda *a, i=implementation: _attention(i, *a))(*half, cotangent)
    errors = [float(jnp.max(jnp.abs(g - w))) / s for g, w, s in zip(got, exact, scale)]
    print(implementation, 'relative error of out, dq, dk, dv:', np.round(errors, 4))
    assert max(errors) < 0.03, (implementation, errors)  # bf16 rounding: ~2^-8 per operation
  # The comparison can fail: attention without the causal mask is far off.
  full = jax.nn.dot_product_attention(*half, is_causal=False).astype(jnp.float32)
  assert float(jnp.max(jnp.abs(full - exact[0]))) / scale[0] > 0.1


def _train(name, device, dtype, num_stages=1):
  """Unstaged parameters after STEPS steps of one schedule on the tiny Transformer, on `device`."""
  config = ScheduleConfig(name=name, num_stages=num_stages)
  model, params = tiny_transformer(  # one kernel on both platforms ('auto' is cuDNN on a GPU)
    1, num_layers=4, layers_per_stage=(4,), dtype=dtype, attention='xla'
  )
  schedule = build_schedule(config, model, optax.sgd(0.5), devices=[device])
  batches = jax.device_get(random_batches(STEPS, batch=8))
  state = schedule.init(jax.device_put(params, device), batches[0])
  losses = []
  for batch in batches:
    state, metrics = schedule.step(state, batch)
    losses.append(float(metrics['loss']))
  return partition.from_staged(jax.device_get(state.params), (4,)), losses, params


def test_bf16_backprop_on_the_gpu_equals_the_same_run_on_the_cpu():
  gpu, cpu = _gpus()[0], jax.devices('cpu')[0]
  got, got_losses, initial = _train('backprop', gpu, 'bfloat16')
  want, want_losses, _ = _train('backprop', cpu, 'bfloat16')
  moved = max_abs_diff(want, partition.from_staged(jax.device_get(initial), (4,)))
  print(f'moved {moved:.4f}, GPU vs CPU {max_abs_diff(got, want):.5f}')
  assert moved > 0.05  # training moved the parameters far more than the tolerance
  assert max_abs_diff(got, want) < BF16_ATOL
  # bf16 on two machines: different matmul kernels (2^-8 relative per op), averaged over 64 tokens.
  np.testing.assert_allclose(got_losses, want_losses, rtol=2e-3)


def test_ouroboros_with_one_stage_is_backprop_on_the_gpu():
  gpu = _gpus()[0]
  with jax.default_matmul_precision('highest'):  # float32 as on the CPU, not TF32
    ouro, _, _ = _train('ouroboros', gpu, 'float32')
    plain, _, _ = _train('backprop', gpu, 'float32')
  print('G=1 vs backprop', max_abs_diff(ouro, plain))
  # float32, Adam at lr 1e-2: sums in another order move
  # parameters by <= ~5e-6 (Adam amplifies near-zero gradient coordinates; test_schedules.py's
  # docstring); 2e-5 is 4x that, a wrong or stale gradient moves them by > 1e-3.
  assert max_abs_diff(ouro, plain) < 2e-5
