"""The head's mean next-token cross-entropy without the float32 logits: chunked over tokens and
fused with its own gradient (`chunked_cross_entropy`; `model.head_loss` runs it when
`ModelConfig.loss_chunk_tokens` > 0).

The unchunked head (`model.output_projection`, then `jax.nn.log_softmax` and a gather) makes
float32 logits [B, L, V] and a float32 gradient of the same size: at GPT-2-small's vocabulary
(50257) and 64 x 1024 tokens, 13 GB each, written and read several times (memory traffic, not
matmul). Here the B x L tokens are cut into chunks and each chunk's logits live only inside its
iteration of a loop:

    logits = x_c @ W^T                          compute dtype, accumulated in float32
    nll    = logsumexp(logits) - logits[target]         float32
    g      = (softmax(logits) - onehot(target)) / T      float32, cast to the compute dtype
    dx_c   = g @ W        dW += g^T @ x_c               compute-dtype matmuls, float32 sums

The loss is a scalar, so its gradient for any cotangent is the gradient for cotangent 1 times
the cotangent: under differentiation the forward computes (dx, dW) chunk by chunk as it goes
and keeps them as the residuals, and the backward only scales them. No chunk's logits are
computed twice (recomputing them in the backward would add a fourth matmul to the head's three),
and the residuals are dx (x's size) and dW (W's). Outside differentiation (evaluation) the loop
computes the loss alone.

Shape letters as in `model.py`; here T counts tokens (B x L), Q the chunks, U the tokens of one.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def chunk_layout(tokens: int, chunk_tokens: int) -> tuple[int, int]:
  """(Q chunks, U tokens each) for T = `tokens` in chunks of at most `chunk_tokens`: Q = ceil(T /
  chunk_tokens) chunks of the same size U = ceil(T / Q), so that the padded tail Q x U - T is
  shorter than Q. One chunk (no loop) when chunk_tokens is 0 or at least T."""
  if chunk_tokens <= 0 or chunk_tokens >= tokens:
    return 1, tokens
  chunks = -(-tokens // chunk_tokens)
  return chunks, -(-tokens // chunks)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def chunked_cross_entropy(
  x_BxLxD, weight_VxD, targets_BxL, chunk_tokens: int, vocab: int | None = None
):
  """Mean next-token NLL (nats, float32) of the logits x @ W^T, `chunk_tokens` tokens at a time
  (0, or at least B x L: one chunk). x in the compute dtype (the matmuls run in it, with float32
  accumulation); W in any dtype (cast to x's where used; its gradient comes back in its own
  dtype); integer targets. vocab: the real vocabulary when W's rows are padded beyond it (the
  padded logits are masked out: the loss and gradients are those of W[:vocab], and the padded
  rows' gradient is zero); None: every row. Equals `output_projection` + `log_softmax` + the
  gather in value and gradient, to float32 rounding (bf16: the same bf16 products)."""
  return _loss_and_grads(x_BxLxD, weight_VxD, targets_BxL, chunk_tokens, vocab, grads=False)[0]


def _forward(x_BxLxD, weight_VxD, targets_BxL, chunk_tokens, vocab):
  loss, dx_BxLxD, dw_VxD = _loss_and_grads(
    x_BxLxD, weight_VxD, targets_BxL, chunk_tokens, vocab, grads=True
  )
  return loss, (dx_BxLxD, dw_VxD)


def _backward(chunk_tokens, vocab, residuals, g):
  """The forward's gradient (for cotangent 1) times the cotangent g; no gradient for targets."""
  dx_BxLxD, dw_VxD = residuals
  return (g * dx_BxLxD).astype(dx_BxLxD.dtype), (g * dw_VxD).astype(dw_VxD.dtype), None


chunked_cross_entropy.defvjp(_forward, _backward)


def _loss_and_grads(
  x_BxLxD, weight_VxD, targets_BxL, chunk_tokens: int, real_vocab: int | None, grads: bool
):
  """(loss, dx, dW) for cotangent 1 (dx, dW None unless `grads`)."""
  b, l, d = x_BxLxD.shape
  vocab = weight_VxD.shape[0]
  # The padded rows' logits are -inf: no probability, no gradient.
  padded_V = None if real_vocab is None or real_vocab >= vocab else jnp.arange(vocab) >= real_vocab
  tokens = b * l
  chunks, per_chunk = chunk_layout(tokens, chunk_tokens)
  w_VxD = weight_VxD.astype(x_BxLxD.dtype)
  rows = _token_rows(x_BxLxD, targets_BxL, chunks * per_chunk)
  chunk = functools.partial(_chunk, w_VxD, padded_V, grads)
  if chunks == 1:
    out = chunk(*rows)
    nll_T, dx_TxD, dw_VxD = out if grads else (out, None, None)
  else:
    nll_T, dx_TxD, dw_VxD = _over_chunks(chunk, rows, chunks, per_chunk, grads)
  loss = nll_T[:tokens].sum() / tokens
  if not grads:
    return loss, None, None
  dx_BxLxD = dx_TxD[:tokens].reshape(b, l, d)
  return loss, dx_BxLxD, dw_VxD.astype(weight_VxD.dtype)


def _token_rows(x_BxLxD, targets_BxL, padded: int):
  """(x, targets, each token's share of the mean) one row per token, padded to `padded` rows."""
  b, l, d = x_BxLxD.shape
  tokens = b * l
  x_TxD = x_BxLxD.reshape(tokens, d)
  targets_T = targets_BxL.reshape(tokens)
  # Each token's share of the mean: 1/T, 0 on the padded tail (its gradient then adds nothing).
  scale_T = jnp.full((tokens,), 1.0 / tokens, jnp.float32)
  if padded > tokens:
    tail = padded - tokens
    x_TxD = jnp.pad(x_TxD, ((0, tail), (0, 0)))
    targets_T = jnp.pad(targets_T, (0, tail))
    scale_T = jnp.pad(scale_T, (0, tail))
  return x_TxD, targets_T, scale_T


def _chunk(w_VxD, padded_V, grads: bool, x_UxD, targets_U, scale_U):
  """One chunk's nll (and, with `grads`, its dx and its dW for cotangent 1)."""
  f32, vocab = jnp.float32, w_VxD.shape[0]
  logits_UxV = jnp.einsum('ud,vd->uv', x_UxD, w_VxD, preferred_element_type=f32)
  if padded_V is not None:
    logits_UxV = jnp.where(padded_V[None], -jnp.inf, logits_UxV)
  lse_U = jax.nn.logsumexp(logits_UxV, axis=-1)
  nll_U = lse_U - jnp.take_along_axis(logits_UxV, targets_U[:, None], axis=-1)[:, 0]
  if not grads:
    return nll_U
  p_UxV = jnp.exp(logits_UxV - lse_U[:, None])
  is_target_UxV = targets_U[:, None] == jnp.arange(vocab, dtype=targets_U.dtype)[None]
  g_UxV = (jnp.where(is_target_UxV, p_UxV - 1.0, p_UxV) * scale_U[:, None]).astype(x_UxD.dtype)
  dx_UxD = jnp.einsum('uv,vd->ud', g_UxV, w_VxD, preferred_element_type=f32)
  dw_VxD = jnp.einsum('uv,ud->vd', g_UxV, x_UxD, preferred_element_type=f32)
  return nll_U, dx_UxD.astype(x_UxD.dtype), dw_VxD


def _over_chunks(chunk, rows, chunks: int, per_chunk: int, grads: bool):
  """`chunk` over the Q chunks of the token rows in a loop: (nll per row, dx per row, the summed
  dW), dx and dW None unless `grads`."""
  x_TxD, targets_T, scale_T = rows
  padded, d = chunks * per_chunk, x_TxD.shape[1]
  x_QxUxD = x_TxD.reshape(chunks, per_chunk, d)
  xs = (x_QxUxD, targets_T.reshape(chunks, per_chunk), scale_T.reshape(chunks, per_chunk))
  if grads:

    def body(dw_VxD, chunk_inputs):
      nll_U, dx_UxD, dw_chunk_VxD = chunk(*chunk_inputs)
      return dw_VxD + dw_chunk_VxD, (nll_U, dx_UxD)

    # The first chunk's dW starts the sum: inside a shard_map it varies over the mesh axes x
    # and W vary over, as the loop's sum does (a carry of zeros would not: check_vma refuses).
    first = [a[0] for a in xs]
    nll_U, dx_UxD, dw_VxD = chunk(*first)
    dw_VxD, (nll_QxU, dx_QxUxD) = jax.lax.scan(body, dw_VxD, [a[1:] for a in xs])
    nll_QxU = jnp.concatenate([nll_U[None], nll_QxU])
    dx_TxD = jnp.concatenate([dx_UxD[None], dx_QxUxD]).reshape(padded, d)
  else:
    nll_QxU, dx_TxD, dw_VxD = jax.lax.map(lambda a: chunk(*a), xs), None, None
  return nll_QxU.reshape(padded), dx_TxD, dw_VxD
