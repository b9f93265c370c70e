"""The head's loss and gradients alone at GPT-2-small's head shape, per --loss-chunk-tokens.

    python experiments/head_chunks.py [BATCH] [CHUNK ...]     # default: 64 0 2048 1024 4096 8192

bf16 x [BATCH, 1024, 768], float32 W [50257, 768]: jit(value_and_grad) of the unchunked head
(chunk 0: `model.output_projection`, log-softmax) or `cross_entropy.chunked_cross_entropy`.
Prints per chunk the median of 10 timed calls, the head's matmul rate (6 x tokens x 768 x 50257
FLOPs), the compiled scratch memory, and how far its gradients are from the first chunk's.
"""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from ouroboros_jax.models import cross_entropy
from ouroboros_jax.models import model as transformer


def plain(x, w, t):
  logp = jax.nn.log_softmax(transformer.output_projection(x, w))
  return -jnp.take_along_axis(logp, t[..., None], axis=-1).mean()


def main(argv) -> None:
  b = int(argv[0]) if argv else 64
  chunks = [int(a) for a in argv[1:]] or [0, 2048, 1024, 4096, 8192]
  k = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(k[0], (b, 1024, 768)).astype(jnp.bfloat16)
  w = 0.02 * jax.random.normal(k[1], (50257, 768))
  t = jax.random.randint(k[2], (b, 1024), 0, 50257)
  first = None
  for c in chunks:
    f = (lambda x, w, t, c=c: cross_entropy.chunked_cross_entropy(x, w, t, c)) if c else plain
    g = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))
    try:
      temp = g.lower(x, w, t).compile().memory_analysis().temp_size_in_bytes / 2**20
      out = jax.block_until_ready(g(x, w, t))
      times = []
      for _ in range(10):
        start = time.perf_counter()
        jax.block_until_ready(g(x, w, t))
        times.append(time.perf_counter() - start)
    except Exception as e:  # noqa: BLE001  (one chunk that does not fit leaves the others)
      print(f'b{b} chunk={c}: FAILED {str(e)[:200]}', flush=True)
      continue
    first = first or out
    diff = max(
      float(jnp.abs(a.astype(jnp.float32) - b_.astype(jnp.float32)).max())
      for a, b_ in zip(out[1], first[1])
    )
    step = float(np.median(times))
    print(
      f'b{b} chunk={c}: {step * 1e3:.2f} ms (min {min(times) * 1e3:.2f}), '
      f'{6 * b * 1024 * 768 * 50257 / step / 1e12:.0f} TFLOP/s, temp {temp:.0f} MiB, '
      f'loss {float(out[0]):.5f}, max grad diff vs first {diff:.2e}',
      flush=True,
    )


if __name__ == '__main__':
  main(sys.argv[1:])
