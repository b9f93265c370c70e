"""Transformer-XL (Dai et al., ACL 2019), as the same three pure pieces as `model.py`.

What differs from the GPT-style model:
- **No absolute positions.** Attention scores are the paper's four terms, written as two:

      score[i, j] = (q_i + u) . k_j  +  (q_i + v) . W_R R[i + M - j]

  with R the sinusoid of the relative distance, u and v learned biases (one global pair, as the
  paper writes it; `untie_r` gives every layer its own, as the reference code's flag), and the
  second term computed for every distance at once and moved into place by the
  *relative shift*. `clamp_len` > 0 gives every distance beyond it the encoding of `clamp_len`.
- **Segment-level recurrence.** Each layer also attends to a memory of the last `mem_len`
  hidden states that entered it during the previous segments (M positions before the segment's
  L). The memory is read under `stop_gradient` (no gradient crosses a segment boundary) and the
  new memory is the last M of [memory, layer input]. Until M positions have been seen the
  memory is only partly filled: `filled` says how many of its last positions are real, and the
  others are masked, which is what the reference code's growing memory computes.
- Token embeddings are scaled by sqrt(D); dropout on the embedding, the positional encoding,
  the attention probabilities (`attn_dropout`) and both residual branches.

The memory of one stack of N layers is a dict {'hidden': [B, N, M, D], 'filled': int32 [B]}
(the batch leads every leaf, so schedules can split it into micro-batches and data replicas):
`init_memory` makes an empty one. `layers(cfg, params, x, memory, rng)` returns (y, new memory);
`memory=None` runs without one (M = 0). The head (final LayerNorm of pre-LN models, tied output
projection, cross-entropy) is `model.head_loss`. Shape letters as in `model.py`; J counts key
positions (M + L) and also relative distances.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from ouroboros_jax import staging
from ouroboros_jax.models import attention as attention_kernels
from ouroboros_jax.models import model as gpt
from ouroboros_jax.models.model import ModelConfig, Params, dropout

ARCH = 'transformer-xl'


class Embedder(nnx.Module):
  """Token embedding V (shared with the output projection when tied), no positions."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    init = nnx.initializers.normal(cfg.init_std)
    self.token = nnx.Embed(  # looked up in float32, as model.Embedder's (its gradient's sums)
      cfg.padded_vocab, cfg.d_model, embedding_init=init, param_dtype=cfg.weight_dtype, rngs=rngs
    )


class RelBlock(nnx.Module):
  """One Transformer-XL layer: relative multi-head attention over [memory, segment], then a ReLU
  MLP; pre-LN or post-LN (the paper's)."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    init = nnx.initializers.normal(cfg.init_std)
    d, f, h, k = cfg.d_model, cfg.d_ff, cfg.num_heads, cfg.head_dim
    linear = functools.partial(nnx.Linear, **gpt.precision(cfg), rngs=rngs)
    norm = functools.partial(nnx.LayerNorm, **gpt.precision(cfg), rngs=rngs)
    self.ln_attn = norm(d)
    self.qkv = linear(d, 3 * d, use_bias=False, kernel_init=init)
    self.r_net = linear(d, d, use_bias=False, kernel_init=init)
    self.r_w_bias = nnx.Param(init(rngs.params(), (h, k), cfg.weight_dtype))  # u: content bias
    self.r_r_bias = nnx.Param(init(rngs.params(), (h, k), cfg.weight_dtype))  # v: position bias
    self.attn_out = linear(d, d, use_bias=False, kernel_init=init)
    self.ln_mlp = norm(d)
    self.mlp_in = linear(d, f, kernel_init=init)
    self.mlp_out = linear(f, d, kernel_init=init)

  def attention(self, x_BxLxD, memory_BxMxD, key_start_B, pos_JxD, rng):
    cfg = self.cfg
    b, l, d = x_BxLxD.shape
    h, k = cfg.num_heads, cfg.head_dim
    both_BxJxD = jnp.concatenate([memory_BxMxD, x_BxLxD], axis=1)
    if cfg.pre_ln:
      both_BxJxD = self.ln_attn(both_BxJxD)
    qkv_BxJx3xHxK = self.qkv(both_BxJxD).reshape(b, -1, 3, h, k)
    q_BxLxHxK = qkv_BxJx3xHxK[:, -l:, 0]
    k_BxJxHxK, v_BxJxHxK = qkv_BxJx3xHxK[:, :, 1], qkv_BxJx3xHxK[:, :, 2]
    r_JxHxK = self.r_net(pos_JxD).reshape(-1, h, k)
    u_HxK, v_HxK = (p[...].astype(q_BxLxHxK.dtype) for p in (self.r_w_bias, self.r_r_bias))
    y_BxLxHxK = attention_kernels.relative_attention(
      q_BxLxHxK,
      k_BxJxHxK,
      v_BxJxHxK,
      attention_kernels.Relative(r_JxHxK, u_HxK, v_HxK, key_start_B),
      attention_kernels.Kernel(cfg.attention, cfg.attention_block),
      attention_kernels.Dropout(cfg.attn_dropout, rng),
    )
    return self.attn_out(y_BxLxHxK.reshape(b, l, d))

  def mlp(self, x_BxLxD, rng):
    hidden = dropout(jax.nn.relu(self.mlp_in(x_BxLxD)), self.cfg.dropout, rng)
    return self.mlp_out(hidden)

  def __call__(self, x_BxLxD, memory_BxMxD, key_start_B, pos_JxD, rng=None):
    rate = self.cfg.dropout
    rngs = [None] * 4 if rng is None else list(jax.random.split(rng, 4))
    attention = lambda x: dropout(
      self.attention(x, memory_BxMxD, key_start_B, pos_JxD, rngs[0]), rate, rngs[1]
    )
    mlp = lambda x: dropout(
      self.mlp(self.ln_mlp(x) if self.cfg.pre_ln else x, rngs[2]), rate, rngs[3]
    )
    if self.cfg.pre_ln:
      x_BxLxD = x_BxLxD + attention(x_BxLxD)
      return x_BxLxD + mlp(x_BxLxD)
    x_BxLxD = self.ln_attn(x_BxLxD + attention(x_BxLxD))
    return self.ln_mlp(x_BxLxD + mlp(x_BxLxD))


def positional_encoding(cfg: ModelConfig, num_keys: int, dtype=jnp.float32):
  """[J, D] sinusoids of the distances J-1 .. 0 (clamped to cfg.clamp_len when it is > 0)."""
  distance_J = jnp.arange(num_keys - 1, -1, -1, dtype=jnp.float32)
  if cfg.clamp_len > 0:
    distance_J = jnp.minimum(distance_J, cfg.clamp_len)
  inv_freq = 1.0 / (10000 ** (jnp.arange(0, cfg.d_model, 2, dtype=jnp.float32) / cfg.d_model))
  angle_JxC = distance_J[:, None] * inv_freq[None]
  return jnp.concatenate([jnp.sin(angle_JxC), jnp.cos(angle_JxC)], -1).astype(dtype)


def init_memory(
  cfg: ModelConfig, num_layers: int, batch_size: int, mem_len: int, dtype=jnp.float32
):
  """An empty memory for a stack of num_layers layers: {'hidden': [B, N, M, D], 'filled': [B]}."""
  return {
    'hidden': jnp.zeros((batch_size, num_layers, mem_len, cfg.d_model), dtype),
    'filled': jnp.zeros((batch_size,), jnp.int32),
  }


# The graph definitions depend only on the config; cached so tracing never rebuilds modules.
@functools.lru_cache(maxsize=32)
def _graphdefs(cfg: ModelConfig):
  return tuple(
    nnx.graphdef(nnx.eval_shape(lambda: cls(cfg, nnx.Rngs(0)))) for cls in (Embedder, RelBlock)
  )


def init_params(cfg: ModelConfig, key: jax.Array) -> Params:
  """Random initial parameters {'embed', 'layers' [N, ...], 'head'}, as `model.init_params`."""
  cfg.validate()
  params = gpt.init_modules(cfg, key, Embedder, RelBlock)
  if not cfg.untie_r:  # one global u, v: every layer holds the same copy (layer 0's draw)
    layers = params['layers']
    one_copy = {n: jnp.broadcast_to(layers[n][0], layers[n].shape) for n in SHARED}
    params['layers'] = {**layers, **one_copy}
  return params


gpt.register_arch(ARCH, init_params)


# The global biases: one parameter read by every layer. Each layer's params keep a copy (so a
# layer stays self-contained when the stack is cut into stages); the optimizer sums the copies'
# gradients and writes one value back to all of them (`update.GroupedOptimizer`).
SHARED = ('r_w_bias', 'r_r_bias')


def shared_leaves(cfg: ModelConfig) -> tuple[str, ...]:
  """The layer-parameter names that are one global parameter in this config."""
  return () if cfg.untie_r else SHARED


def embed(cfg: ModelConfig, embed_params: Params, tokens_BxL, rng=None):
  """Token ids -> x_BxLxD = sqrt(D) V[tokens], with dropout."""
  token = nnx.merge(_graphdefs(cfg)[0], embed_params).token
  x_BxLxD = (token(tokens_BxL) * cfg.d_model**0.5).astype(cfg.compute_dtype)
  return dropout(x_BxLxD, cfg.dropout, rng)


def layers(
  cfg: ModelConfig, layer_params: Params, x_BxLxD, memory=None, rng=None, *, active_N=None
):
  """A stack of N layers (params with a leading axis N) over x, by `lax.scan`.

  memory: {'hidden': [B, N, M, D], 'filled': [B]} (`init_memory`) or None (no recurrence).
  active_N: optional bool per layer; an inactive layer is skipped (uneven stages' padding) and its
    memory kept as it was.
  Returns (y_BxLxD, the new memory) (None without a memory).
  """
  block_def = _graphdefs(cfg)[1]
  num, (_, seq_len, _) = jax.tree.leaves(layer_params)[0].shape[0], x_BxLxD.shape
  batch = x_BxLxD.shape[0]
  if memory is None:
    hidden_N = jnp.zeros((num, batch, 0, cfg.d_model), x_BxLxD.dtype)
    filled_B, mem_len = jnp.zeros((batch,), jnp.int32), 0
  else:
    hidden_N = jnp.moveaxis(memory['hidden'], 1, 0).astype(x_BxLxD.dtype)  # [N, B, M, D]
    filled_B, mem_len = memory['filled'], memory['hidden'].shape[2]
  key_start_B = mem_len - filled_B  # unfilled memory slots come first and are masked
  pos_JxD = positional_encoding(cfg, mem_len + seq_len, x_BxLxD.dtype)

  def layer(params, x, layer_rng, hidden_BxMxD):
    pos_rng, block_rng = (None, None) if layer_rng is None else jax.random.split(layer_rng)
    pos = dropout(pos_JxD, cfg.dropout, pos_rng)
    read = jax.lax.stop_gradient(hidden_BxMxD)  # no gradient into a previous segment
    y = nnx.merge(block_def, params)(x, read, key_start_B, pos, block_rng).astype(x.dtype)
    kept = jnp.concatenate([read, jax.lax.stop_gradient(x)], axis=1)[:, seq_len:]
    return y, kept

  y_BxLxD, new_hidden_N = staging.scan_layers(
    layer,
    layer_params,
    x_BxLxD,
    rng,
    active_N=active_N,
    per_layer_N=hidden_N,
    skipped=lambda hidden_BxMxD: hidden_BxMxD,  # a skipped layer keeps its memory
    unroll=cfg.scan_unroll(),
  )
  if memory is None:
    return y_BxLxD, None
  new_memory = {
    'hidden': jnp.moveaxis(new_hidden_N, 0, 1).astype(memory['hidden'].dtype),
    'filled': jnp.minimum(filled_B + seq_len, mem_len).astype(jnp.int32),
  }
  return y_BxLxD, new_memory


def loss_fn(cfg: ModelConfig, params: Params, batch: dict, memory=None, rng=None):
  """Single-device embed -> all layers -> head: ((loss, metrics), new memory)."""
  rng_embed, rng_layers = (None, None) if rng is None else jax.random.split(rng)
  x_BxLxD = embed(cfg, params['embed'], batch['inputs'], rng_embed)
  x_BxLxD, memory = layers(cfg, params['layers'], x_BxLxD, memory, rng_layers)
  return gpt.head_loss(cfg, params['head'], params['embed'], x_BxLxD, batch['targets']), memory
