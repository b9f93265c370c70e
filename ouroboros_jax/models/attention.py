"""Attention without an L x J score matrix in memory, behind one entry point per attention kind.

`causal_attention` (the GPT model's causal self-attention) and `relative_attention`
(Transformer-XL's relative attention over [memory, segment] keys) each run one implementation:

- 'xla': the plain formulas, materialising the [B, H, L, J] scores (the reference);
- 'blockwise': flash attention in pure JAX (Dao et al., 2022, "FlashAttention: Fast and
  Memory-Efficient Exact Attention with IO-Awareness"; Rabe & Staats, 2021, "Self-attention Does
  Not Need O(n^2) Memory"): an online softmax over key blocks, one query block at a time, with a
  custom VJP that recomputes each block's probabilities from q, k, v and the saved log-sum-exp.
  Memory grows linearly with L, and key blocks a query block cannot see are skipped. For
  Transformer-XL a (query block, key block) pair spans only Q + J - 1 relative distances: their
  positional scores are computed from that window of r and shifted into place per block;
- 'cudnn': `jax.nn.dot_product_attention(implementation='cudnn')` (GPU, bf16/fp16, causal only);
- 'pallas': the Pallas TPU splash-attention kernel (causal only);
- 'auto': whatever `resolve` picks for the platform, dtype and length.

Scores, softmax statistics and accumulators are float32 whatever the input dtype; outputs come
back in q's dtype. Shape letters as in `model.py` (J: key positions, M = J - L memory positions);
inside one block pair Q counts its queries, J its keys and W = Q + J - 1 its distances.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from ouroboros_jax.errors import ConfigError, field_ref

IMPLEMENTATIONS = ('auto', 'xla', 'blockwise', 'cudnn', 'pallas')
_MASKED = float(jnp.finfo(jnp.float32).min)  # the masked score (finite: no inf - inf = nan)


def check(name: str, dtype, *, relative: bool = False) -> None:
  """One-line ConfigError for an implementation that cannot run this attention in this dtype."""
  if name not in IMPLEMENTATIONS:
    raise ConfigError(
      f'unknown {field_ref("attention", name)}; choose one of {", ".join(IMPLEMENTATIONS)}.'
    )
  if relative and name in ('cudnn', 'pallas'):
    raise ConfigError(
      f'{field_ref("attention", name)} has no relative positions (Transformer-XL); use '
      'blockwise, xla or auto.'
    )
  if name == 'cudnn' and not _half(dtype):
    raise ConfigError(
      f'cuDNN attention needs bfloat16 or float16 inputs, got {jnp.dtype(dtype).name}; use '
      f'{field_ref("dtype", "bfloat16")} or {field_ref("attention", "blockwise")}.'
    )


def resolve(
  name: str, platform: str, dtype, seq_len: int, block: int, *, relative: bool = False
) -> str:
  """The implementation `name` runs as on `platform` ('auto' picked, the others checked).

  seq_len: the key positions J (the longest side of the score matrix); relative: Transformer-XL
  attention, which only 'xla' and 'blockwise' compute (fused kernels take no relative positions).
  """
  check(name, dtype, relative=relative)
  if name == 'auto':
    if platform == 'gpu' and _half(dtype) and not relative:
      return 'cudnn'
    if platform == 'tpu' and not relative:
      return 'pallas'  # compiles fwd + bwd for TPU targets (see tests/test_attention.py)
    return 'blockwise' if seq_len > block else 'xla'  # one block: plain, without bookkeeping
  return name  # traced on the host's backend, maybe for another target: `check_platform` is apart


def check_platform(name: str, platform: str) -> None:
  """One-line ConfigError for a fused kernel asked for on a platform that lacks it (a run checks
  its own backend; `ouroboros compile` compiles for its target)."""
  kernel_platform = {'cudnn': 'gpu', 'pallas': 'tpu'}.get(name)
  if kernel_platform and platform != kernel_platform:
    raise ConfigError(
      f'{field_ref("attention", name)} runs on {kernel_platform.upper()}s only and this run is '
      f'on {platform}; use {field_ref("attention", "auto")}.'
    )


def _half(dtype) -> bool:
  return jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


class Kernel(NamedTuple):
  """Which implementation computes attention (IMPLEMENTATIONS; 'auto' picks by platform, dtype and
  length, `resolve`) and the block size of the blockwise and Pallas kernels."""

  implementation: str = 'xla'
  block: int = 512


class Relative(NamedTuple):
  """Transformer-XL's relative-position inputs: the projected encodings of the distances J-1 .. 0
  (`r_net(pos_JxD)`), the content and position biases u and v, and each row's first valid key
  (key_start = M - the filled memory slots)."""

  r_JxHxK: jax.Array
  content_bias_HxK: jax.Array
  position_bias_HxK: jax.Array
  key_start_B: jax.Array


class Dropout(NamedTuple):
  """Attention dropout on the probabilities: off unless rate > 0 and there is an rng."""

  rate: float = 0.0
  rng: jax.Array | None = None

  @property
  def on(self) -> bool:
    return self.rate > 0.0 and self.rng is not None


def causal_attention(q_BxLxHxK, k_BxLxHxK, v_BxLxHxK, kernel: Kernel = Kernel()):
  """softmax(q k^T / sqrt(K) + causal mask) v, as `jax.nn.dot_product_attention(is_causal=True)`."""
  platform, block = jax.default_backend(), kernel.block
  impl = resolve(kernel.implementation, platform, q_BxLxHxK.dtype, k_BxLxHxK.shape[1], block)
  if impl == 'blockwise':
    return blockwise_attention(q_BxLxHxK, k_BxLxHxK, v_BxLxHxK, block=block)
  if impl == 'pallas':
    return pallas_causal_attention(q_BxLxHxK, k_BxLxHxK, v_BxLxHxK, block=block)
  return jax.nn.dot_product_attention(
    q_BxLxHxK, k_BxLxHxK, v_BxLxHxK, is_causal=True, implementation=impl
  )


def relative_attention(
  q_BxLxHxK,
  k_BxJxHxK,
  v_BxJxHxK,
  relative: Relative,
  kernel: Kernel = Kernel(),
  dropout: Dropout = Dropout(),
):
  """Transformer-XL attention of L queries over J = M + L keys ([memory, segment]):

      score[i, j] = ((q_i + u) . k_j + (q_i + v) . r[J - 1 - (i + M - j)]) / sqrt(K)

  with r, u, v and the key starts from `relative`: query i sees key j iff
  key_start_B[b] <= j <= i + M. Attention dropout needs the probabilities themselves: 'auto' then
  runs 'xla', and an explicit 'blockwise' raises ConfigError.
  """
  if kernel.implementation == 'auto' and dropout.on:
    impl = 'xla'
  else:
    platform, keys = jax.default_backend(), k_BxJxHxK.shape[1]
    impl = resolve(
      kernel.implementation, platform, q_BxLxHxK.dtype, keys, kernel.block, relative=True
    )
  if impl == 'xla':
    return plain_relative_attention(q_BxLxHxK, k_BxJxHxK, v_BxJxHxK, relative, dropout)
  if dropout.on:
    raise ConfigError(
      f'blockwise attention has no attention dropout; use {field_ref("attention", "xla")} (or '
      f'auto) or {field_ref("attn_dropout", 0)}.'
    )
  return blockwise_attention(q_BxLxHxK, k_BxJxHxK, v_BxJxHxK, relative, block=kernel.block)


# ---------------------------------------------------------------------------------------------
# The plain references (materialise L x J).


def rel_shift(x_BxHxLxJ):
  """The relative shift: row i of x holds scores for distances J-1 .. 0 (column c is distance
  J-1-c); the result's [i, j] is the score at distance i + M - j, M = J - L (meaningful where
  j <= i + M, the rest is masked). Done as in the reference code: pad a zero column in front,
  read the rows as J+1 long, drop the first, read back."""
  b, h, l, j = x_BxHxLxJ.shape
  padded = jnp.pad(x_BxHxLxJ, ((0, 0), (0, 0), (0, 0), (1, 0)))
  return padded.reshape(b, h, j + 1, l)[:, :, 1:].reshape(b, h, l, j)


def relative_mask(seq_len: int, num_keys: int, key_start_B):
  """[B, 1, L, J] bool: query i sees key j iff key_start_B[b] <= j <= i + M, M = J - L."""
  i_1xLx1 = jnp.arange(seq_len)[None, :, None]
  j_1x1xJ = jnp.arange(num_keys)[None, None]
  start_Bx1x1 = jnp.asarray(key_start_B).reshape(-1, 1, 1)
  return ((j_1x1xJ <= i_1xLx1 + num_keys - seq_len) & (j_1x1xJ >= start_Bx1x1))[:, None]


def plain_relative_attention(
  q_BxLxHxK, k_BxJxHxK, v_BxJxHxK, relative: Relative, dropout: Dropout = Dropout()
):
  """`relative_attention` as txl.py's RelBlock computed it: [B, H, L, J] scores, rel_shift."""
  r_JxHxK, content_bias_HxK, position_bias_HxK, key_start_B = relative
  l, j, k = q_BxLxHxK.shape[1], k_BxJxHxK.shape[1], q_BxLxHxK.shape[3]
  f32 = jnp.float32  # scores accumulate and come out in float32 whatever the inputs' dtype
  content_BxHxLxJ = jnp.einsum(
    'blhk,bjhk->bhlj', q_BxLxHxK + content_bias_HxK, k_BxJxHxK, preferred_element_type=f32
  )
  position_BxHxLxJ = rel_shift(
    jnp.einsum('blhk,jhk->bhlj', q_BxLxHxK + position_bias_HxK, r_JxHxK, preferred_element_type=f32)
  )
  score_BxHxLxJ = (content_BxHxLxJ + position_BxHxLxJ) * k**-0.5
  score_BxHxLxJ = jnp.where(relative_mask(l, j, key_start_B), score_BxHxLxJ, _MASKED)
  prob_BxHxLxJ = jax.nn.softmax(score_BxHxLxJ, axis=-1).astype(q_BxLxHxK.dtype)
  if dropout.on:  # inverted dropout, as model.dropout
    keep = jax.random.bernoulli(dropout.rng, 1.0 - dropout.rate, prob_BxHxLxJ.shape)
    prob_BxHxLxJ = jnp.where(keep, prob_BxHxLxJ / (1.0 - dropout.rate), 0)
  return jnp.einsum('bhlj,bjhk->blhk', prob_BxHxLxJ, v_BxJxHxK)


# ---------------------------------------------------------------------------------------------
# Blockwise (flash) attention, causal over [memory, segment] keys, optionally relative.


def blockwise_attention(
  q_BxLxHxK, k_BxJxHxK, v_BxJxHxK, relative: Relative | None = None, *, block=512
):
  """Flash attention: y_BxLxHxK, never an L x J array (forward or backward).

  Causal (relative None): query i (of L) sees key j (of J) iff j <= i + J - L. Transformer-XL
  (`relative`): the content queries q + u, the position queries q + v against the distance
  encodings r, and only keys from each row's key_start_B on. Gradients flow to q, k, v, r, u, v.
  """
  b, l, h, k = q_BxLxHxK.shape
  key_start_B = r_JxHxK = None
  qu_BxLxHxK = q_BxLxHxK
  if relative is not None:
    r_JxHxK, u_HxK, pv_HxK, key_start_B = relative
    qu_BxLxHxK = (q_BxLxHxK + u_HxK).astype(q_BxLxHxK.dtype)
    qv_BxLxHxK = (q_BxLxHxK + pv_HxK).astype(q_BxLxHxK.dtype)
  j = k_BxJxHxK.shape[1]
  if j < l:
    raise ValueError(f'blockwise attention needs at least as many keys as queries: {j} < {l}.')
  plan = _Plan(l, j, min(block, l), min(block, j), r_JxHxK is not None, k**-0.5)
  lp, jp = plan.num_q * plan.block_q, plan.num_k * plan.block_k

  # Head-major layout [H, B, L, K]: every block matmul (r's window too, shared by the batch) is
  # then a plain batched matmul, without transposes. Padded to whole blocks: padded keys are
  # masked, padded queries' outputs dropped (and their cotangents zero).
  def heads_first(x_BxNxHxK, n):
    x_HxBxNxK = jnp.transpose(x_BxNxHxK, (2, 0, 1, 3))
    return jnp.pad(x_HxBxNxK, ((0, 0), (0, 0), (0, n - x_BxNxHxK.shape[1]), (0, 0)))

  qv_HxBxLxK = r_HxRxK = None
  if plan.relative:
    qv_HxBxLxK = heads_first(qv_BxLxHxK, lp)
    # Padded so every block pair's window (`_window_start`) is in range: in front the distances
    # past J - 1 of padded queries, behind the negative ones of (masked) later keys.
    r_HxRxK = jnp.pad(jnp.swapaxes(r_JxHxK, 0, 1), ((0, 0), (lp - l, jp - plan.mem - 1), (0, 0)))
  if key_start_B is None:
    key_start_B = jnp.zeros((b,), jnp.int32)
  ops = _Operands(
    heads_first(qu_BxLxHxK, lp),
    heads_first(k_BxJxHxK, jp),
    heads_first(v_BxJxHxK, jp),
    qv_HxBxLxK,
    r_HxRxK,
  )
  y_HxBxLxK = _flash(plan, ops, jnp.asarray(key_start_B, jnp.int32))
  return jnp.transpose(y_HxBxLxK[:, :, :l], (1, 2, 0, 3))


class _Plan(NamedTuple):
  """The static layout of one blockwise call (hashable: the custom VJP's non-diff argument)."""

  length: int  # L queries, the last L of the J key positions
  keys: int  # J keys
  block_q: int
  block_k: int
  relative: bool  # Transformer-XL's positional term
  scale: float

  @property
  def mem(self) -> int:
    return self.keys - self.length

  @property
  def num_q(self) -> int:
    return -(-self.length // self.block_q)

  @property
  def num_k(self) -> int:
    return -(-self.keys // self.block_k)

  @property
  def window(self) -> int:
    return self.block_q + self.block_k - 1


def _skew(x_HxBxQxW):
  """Blockwise relative shift: row a of x holds a query's scores for the window's distances, in
  decreasing order (column w: distance dmax - w); key b of the block is at distance
  dmax - (Q - 1 - a) - b, so out[a, b] = x[a, b + Q - 1 - a]. As `rel_shift`, by reading the
  (padded) rows with another stride."""
  *lead, q, w = x_HxBxQxW.shape
  flat = jnp.pad(x_HxBxQxW, [(0, 0)] * len(lead) + [(0, 0), (0, 1)]).reshape(*lead, q * (w + 1))
  return flat[..., q - 1 : q - 1 + q * w].reshape(*lead, q, w)[..., : w - q + 1]


def _unskew(g_HxBxQxJ, w: int):
  """The transpose of `_skew`: each row's key gradients back into its window of distances."""
  *lead, q, j = g_HxBxQxJ.shape
  none = [(0, 0)] * len(lead)
  flat = jnp.pad(g_HxBxQxJ, none + [(0, 0), (0, w - j)]).reshape(*lead, q * w)
  flat = jnp.pad(flat, none + [(q - 1, 1)])
  return flat.reshape(*lead, q, w + 1)[..., :w]


def _window_start(plan: _Plan, qb, kb):
  """First row of the padded r (`blockwise_attention`) in the window of block pair (qb, kb): its
  largest distance is (qb + 1) Q - 1 + M - kb J, at row (Lp - L) + J - 1 - that."""
  return plan.num_q * plan.block_q - (qb + 1) * plan.block_q + kb * plan.block_k


class _Operands(NamedTuple):
  """What the blockwise kernel differentiates, head-major: the content queries qu [H, B, L, K],
  keys and values [H, B, J, K], and (relative, else None) the position queries qv [H, B, L, K]
  and the distance encodings r [H, R, K]; or one block pair's slices of them."""

  qu: jax.Array
  k: jax.Array
  v: jax.Array
  qv: jax.Array | None
  r: jax.Array | None


def _scores(plan: _Plan, qb, kb, blocks: _Operands, key_start_B):
  """Block pair (qb, kb): scaled float32 scores [H, B, Q, J] and where they are valid."""
  f32 = jnp.float32
  score = jnp.einsum('hbqd,hbjd->hbqj', blocks.qu, blocks.k, preferred_element_type=f32)
  if plan.relative:
    position = jnp.einsum('hbqd,hwd->hbqw', blocks.qv, blocks.r, preferred_element_type=f32)
    score = score + _skew(position)
  i_Qx1 = qb * plan.block_q + jnp.arange(plan.block_q)[:, None]
  j_1xJ = kb * plan.block_k + jnp.arange(plan.block_k)[None]
  valid_QxJ = (j_1xJ <= i_Qx1 + plan.mem) & (j_1xJ < plan.keys)
  valid_1xBxQxJ = valid_QxJ & (j_1xJ >= key_start_B[None, :, None, None])
  return score * plan.scale, valid_1xBxQxJ


def _slices(plan: _Plan, qb, kb, ops: _Operands) -> _Operands:
  """The blocks of pair (qb, kb): query rows, key rows and the window of distances."""
  bq, bk = plan.block_q, plan.block_k
  rows = lambda x, start, size: lax.dynamic_slice_in_dim(x, start, size, axis=2)
  qv_blk = rows(ops.qv, qb * bq, bq) if plan.relative else None
  r_win = None
  if plan.relative:
    r_win = lax.dynamic_slice_in_dim(ops.r, _window_start(plan, qb, kb), plan.window, axis=1)
  return _Operands(
    rows(ops.qu, qb * bq, bq), rows(ops.k, kb * bk, bk), rows(ops.v, kb * bk, bk), qv_blk, r_win
  )


def _add_rows(x, update, start, axis):
  """x with `update` added at `start` along `axis` (in place inside a loop)."""
  old = lax.dynamic_slice_in_dim(x, start, update.shape[axis], axis=axis)
  return lax.dynamic_update_slice_in_dim(x, old + update, start, axis=axis)


def _forward(plan: _Plan, ops: _Operands, key_start_B):
  """(y_HxBxLxK, lse_HxBxL): an online softmax over the key blocks each query block sees."""
  h, b, lp, d = ops.qu.shape
  bq, bk = plan.block_q, plan.block_k
  f32 = jnp.float32
  # Key blocks wholly before every row's first valid key (unfilled memory) are skipped.
  first_kb = jnp.clip(jnp.min(key_start_B) // bk, 0, plan.num_k)

  def query_block(qb, carry):
    y_HxBxLxK, lse_HxBxL = carry
    # Causal: this query block's last row sees keys up to (qb + 1) Q - 1 + M.
    last_kb = jnp.minimum(plan.num_k, ((qb + 1) * bq - 1 + plan.mem) // bk + 1)

    def key_block(kb, stats):
      max_HxBxQ, sum_HxBxQ, acc_HxBxQxK = stats
      blocks = _slices(plan, qb, kb, ops)
      score, valid = _scores(plan, qb, kb, blocks, key_start_B)
      score = jnp.where(valid, score, _MASKED)
      new_max = jnp.maximum(max_HxBxQ, score.max(-1))
      prob_HxBxQxJ = jnp.where(valid, jnp.exp(score - new_max[..., None]), 0.0)
      rescale = jnp.exp(max_HxBxQ - new_max)  # earlier blocks' terms, to the new maximum
      acc_HxBxQxK = acc_HxBxQxK * rescale[..., None] + jnp.einsum(
        'hbqj,hbjd->hbqd', prob_HxBxQxJ.astype(ops.v.dtype), blocks.v, preferred_element_type=f32
      )
      return new_max, sum_HxBxQ * rescale + prob_HxBxQxJ.sum(-1), acc_HxBxQxK

    init = (
      jnp.full((h, b, bq), _MASKED, f32),
      jnp.zeros((h, b, bq), f32),
      jnp.zeros((h, b, bq, d), f32),
    )
    max_HxBxQ, sum_HxBxQ, acc_HxBxQxK = lax.fori_loop(first_kb, last_kb, key_block, init)
    sum_HxBxQ = jnp.where(sum_HxBxQ > 0, sum_HxBxQ, 1.0)  # a row seeing no key gives 0
    y_blk = (acc_HxBxQxK / sum_HxBxQ[..., None]).astype(y_HxBxLxK.dtype)
    y_HxBxLxK = lax.dynamic_update_slice_in_dim(y_HxBxLxK, y_blk, qb * bq, axis=2)
    lse_blk = max_HxBxQ + jnp.log(sum_HxBxQ)
    return y_HxBxLxK, lax.dynamic_update_slice_in_dim(lse_HxBxL, lse_blk, qb * bq, axis=2)

  init = (jnp.zeros((h, b, lp, d), ops.qu.dtype), jnp.zeros((h, b, lp), f32))
  return lax.fori_loop(0, plan.num_q, query_block, init)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(plan: _Plan, ops: _Operands, key_start_B):
  return _forward(plan, ops, key_start_B)[0]


def _flash_fwd(plan: _Plan, ops: _Operands, key_start_B):
  y, lse = _forward(plan, ops, key_start_B)
  return y, (ops, key_start_B, y, lse)  # all linear in L: no probabilities kept


def _flash_bwd(plan: _Plan, residuals, dy_HxBxLxK):
  """Per key block, over the query blocks that see it: recompute the probabilities from the saved
  log-sum-exp, accumulate dk, dv for the block and add into dq (and dqv, dr) in place."""
  ops, key_start_B, y, lse_HxBxL = residuals
  qu, k = ops.qu, ops.k
  bq, bk, f32 = plan.block_q, plan.block_k, jnp.float32
  # D_i = sum_j P_ij dP_ij = dy_i . y_i: the softmax backward's row term, without P.
  delta_HxBxL = jnp.sum(dy_HxBxLxK.astype(f32) * y.astype(f32), -1)
  min_start = jnp.min(key_start_B)
  rows = lambda x, qb: lax.dynamic_slice_in_dim(x, qb * bq, bq, axis=2)

  def key_block(kb, grads):
    dqu, dk, dv, dqv, dr = grads
    # Query blocks before the first one whose last row reaches key kb J see none of its keys;
    # a block wholly in every row's unfilled memory is seen by none.
    first_qb = jnp.clip((kb * bk - plan.mem) // bq, 0, plan.num_q)
    first_qb = jnp.where((kb + 1) * bk <= min_start, plan.num_q, first_qb)

    def query_block(qb, carry):
      dk_HxBxJxK, dv_HxBxJxK, dqu, dqv, dr = carry
      blocks = _slices(plan, qb, kb, ops)
      qu_blk, k_blk, v_blk, qv_blk, r_win = blocks
      dy_blk = rows(dy_HxBxLxK, qb)
      score, valid = _scores(plan, qb, kb, blocks, key_start_B)
      prob = jnp.where(valid, jnp.exp(score - rows(lse_HxBxL, qb)[..., None]), 0.0)
      dv_HxBxJxK += jnp.einsum(
        'hbqj,hbqd->hbjd', prob.astype(dy_blk.dtype), dy_blk, preferred_element_type=f32
      )
      dprob = jnp.einsum('hbqd,hbjd->hbqj', dy_blk, v_blk, preferred_element_type=f32)
      # The gradient of the unscaled score (content + position), in the inputs' dtype for the
      # matmuls as flash attention does; accumulation stays float32.
      dscore = (prob * (dprob - rows(delta_HxBxL, qb)[..., None]) * plan.scale).astype(qu.dtype)
      dqu_blk = jnp.einsum('hbqj,hbjd->hbqd', dscore, k_blk, preferred_element_type=f32)
      dqu = _add_rows(dqu, dqu_blk, qb * bq, axis=2)
      dk_HxBxJxK += jnp.einsum('hbqj,hbqd->hbjd', dscore, qu_blk, preferred_element_type=f32)
      if plan.relative:
        dqv, dr = _relative_grads(plan, qb, kb, dscore, (qv_blk, r_win), (dqv, dr))
      return dk_HxBxJxK, dv_HxBxJxK, dqu, dqv, dr

    zeros = jnp.zeros(k.shape[:2] + (bk, k.shape[3]), f32)
    dk_blk, dv_blk, dqu, dqv, dr = lax.fori_loop(
      first_qb, plan.num_q, query_block, (zeros, zeros, dqu, dqv, dr)
    )
    dk = lax.dynamic_update_slice_in_dim(dk, dk_blk, kb * bk, axis=2)
    dv = lax.dynamic_update_slice_in_dim(dv, dv_blk, kb * bk, axis=2)
    return dqu, dk, dv, dqv, dr

  zeros_like = lambda x: None if x is None else jnp.zeros(x.shape, f32)
  init = tuple(zeros_like(x) for x in ops)
  grads = lax.fori_loop(0, plan.num_k, key_block, init)
  cast = lambda g, x: None if x is None else g.astype(x.dtype)
  return _Operands(*(cast(g, x) for g, x in zip(grads, ops))), None


def _relative_grads(plan: _Plan, qb, kb, dscore, blocks, grads):
  """`_flash_bwd`'s position term for query block qb and key block kb: the score gradient
  `dscore` unskewed to the window, added into dqv (rows of qb) and dr (the window's rows).
  `blocks`: (qv of the block, its window of r); `grads`: (dqv, dr). Returns (dqv, dr)."""
  (qv_blk, r_win), (dqv, dr), f32 = blocks, grads, jnp.float32
  dwindow = _unskew(dscore, plan.window)
  dqv_blk = jnp.einsum('hbqw,hwd->hbqd', dwindow, r_win, preferred_element_type=f32)
  dqv = _add_rows(dqv, dqv_blk, qb * plan.block_q, axis=2)
  # Over (b, q) as one axis: XLA:CPU otherwise transposes the [H, B, Q, W] window first.
  h, b, q, w = dwindow.shape
  dr_win = jnp.einsum(
    'hnw,hnd->hwd',
    dwindow.reshape(h, b * q, w),
    qv_blk.reshape(h, b * q, -1),
    preferred_element_type=f32,
  )
  dr = _add_rows(dr, dr_win, _window_start(plan, qb, kb), axis=1)
  return dqv, dr


_flash.defvjp(_flash_fwd, _flash_bwd)


# ---------------------------------------------------------------------------------------------
# Pallas (TPU).


def pallas_causal_attention(q_BxLxHxK, k_BxLxHxK, v_BxLxHxK, *, block=512, interpret=False):
  """Causal attention by the Pallas TPU splash-attention kernel (its own fused backward).

  The kernel takes blocks of a multiple of 128 positions: L is padded to whole blocks (padded keys
  come after every real query, so the causal mask hides them). interpret=True runs the kernel in
  the Pallas interpreter (any backend; for tests).
  """
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

  b, l, h, k = q_BxLxHxK.shape
  round_up = lambda n, m: -(-n // m) * m
  size = min(round_up(block, 128), round_up(l, 128))
  lp = round_up(l, size)
  kernel = splash.make_splash_mha(
    masks.MultiHeadMask([masks.CausalMask((lp, lp))] * h),
    head_shards=1,
    q_seq_shards=1,
    block_sizes=splash.BlockSizes(
      block_q=size,
      block_kv=size,
      block_kv_compute=size,
      block_q_dkv=size,
      block_kv_dkv=size,
      block_kv_dkv_compute=size,
      block_q_dq=size,
      block_kv_dq=size,
    ),
    interpret=interpret,
  )

  def heads_first(x_BxLxHxK):
    return jnp.pad(jnp.swapaxes(x_BxLxHxK, 1, 2), ((0, 0), (0, 0), (0, lp - l), (0, 0)))

  q = heads_first(q_BxLxHxK * jnp.asarray(k**-0.5, q_BxLxHxK.dtype))  # the kernel does not scale
  y_BxHxLxK = jax.vmap(kernel)(q, heads_first(k_BxLxHxK), heads_first(v_BxLxHxK))
  return jnp.swapaxes(y_BxHxLxK[:, :, :l], 1, 2)
