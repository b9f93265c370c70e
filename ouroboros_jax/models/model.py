"""A decoder-only Transformer language model, written in Flax NNX and used functionally.

The model is defined with NNX modules (`Embedder`, `Block`, `Head`) but every training step sees
only plain pytrees of arrays: `init_params` returns a dict

    {'embed':  {...},            # token embedding V (tied with the output projection), positions
     'layers': {...},            # every Block's parameters stacked on a leading layer axis [N, ...]
     'head':   {...}}            # final LayerNorm (pre-LN only), untied output projection if any

and the model is called as three pure pieces, the ones a pipeline or an Ouroboros ring needs:

    x_BxLxD = embed(cfg, params['embed'], tokens_BxL, rng)
    x_BxLxD = layers(cfg, layer_slice, x_BxLxD, rng)     # any contiguous slice of the layer stack
    loss, stats = head_loss(cfg, params['head'], params['embed'], x_BxLxD, targets_BxL)

`layers` scans over the leading axis, so a contiguous slice `params['layers'][a:b]` is exactly a
pipeline stage of layers a..b-1. Attention is `attention.causal_attention`: a fused kernel where
the backend has one (cuDNN, Pallas), blockwise flash attention in pure JAX elsewhere.

Shape suffixes, used across the package (`x_BxLxD` is a [batch, length, width] array):

    B batch            L sequence length        D model width         F feed-forward width
    H attention heads  K width of one head      V vocabulary          C channels (any last axis)
    N layers (of a stack, or of one stage)      G stages (devices of the ring)
    M micro-batches    R data replicas    S slots of a ring buffer (the stash depth)
    T tokens sampled in one chunk               P prompt bytes        Z bytes of a corpus split
    L1 = L + 1 (a window with its next-token target); 1 a singleton axis
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from ouroboros_jax import staging
from ouroboros_jax.errors import (
  ConfigError,
  field_ref,
)  # re-exported: ouroboros_jax.models.model.ConfigError
from ouroboros_jax.models import attention as attention_kernels
from ouroboros_jax.models import cross_entropy

Params = dict[str, Any]


ARCHS = ('gpt', 'transformer-xl')
DTYPES = ('float32', 'bfloat16')  # --dtype (compute) and --param-dtype (master weights)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Shape of the Transformer LM. Byte-level by default (vocab 256)."""

  vocab_size: int = 256
  d_model: int = 128
  num_heads: int = 4
  num_layers: int = 4
  d_ff: int = 512
  seq_len: int = 128
  dropout: float = 0.0
  pre_ln: bool = True  # pre-LN (GPT-2) blocks; False gives the original post-LN blocks
  tie_embeddings: bool = True  # the output projection is V^T, V the input embedding
  init_std: float = 0.02
  # Layers per iteration of the layer scan; 0 unrolls the stack (faster, above all with PLD's
  # skipped layers; longer compiles for deep models). None: `unroll_for` picks by platform,
  # unrolled on GPU (faster on an H200: docs/results/README.md#d-mfu-levers), a scan of one
  # layer elsewhere (TPU compiles stay short).
  layer_unroll: int | None = None
  # Transformer-XL (txl.py; --model transformer-xl): relative positions, segment recurrence.
  arch: str = 'gpt'  # 'gpt' (this module) or 'transformer-xl'
  mem_len: int = 0  # hidden states each layer keeps from previous segments (0: no recurrence)
  clamp_len: int = 0  # relative distances beyond this share its encoding (0: no clamp)
  attn_dropout: float = 0.0  # dropout on the attention probabilities (transformer-xl)
  untie_r: bool = False  # transformer-xl: u, v per layer (the reference code's --untie_r);
  # False: one global pair shared by every layer, as the paper writes it
  # Precision: activations, stashes, ring buffers and every transfer in `dtype`; parameters in
  # `param_dtype` (master weights; the per-weight optimizer state in TrainConfig.state_dtype);
  # logits, softmax, loss and norm statistics always in float32.
  dtype: str = 'float32'
  param_dtype: str = 'float32'
  # Attention kernel (attention.py): auto picks the target's fused kernel (cuDNN on GPU, Pallas on
  # TPU) or the blockwise one for sequences longer than one block; xla materialises L x L.
  attention: str = 'auto'
  attention_block: int = 512  # blockwise: keys (and queries) per block
  # The head's cross-entropy over chunks of this many tokens, each chunk's gradient computed
  # with its loss, so the float32 logits are never held whole (cross_entropy.py); 0: the float32
  # logits [B, L, V] at once (`output_projection`, log-softmax). 2048: a chunk's float32 logits
  # are 393 MiB at GPT-2's vocabulary of 50257 (13 GB whole at 64 x 1024 tokens), and the
  # fastest of 1024 to 8192 on an H200 there (docs/results/README.md#d-head).
  loss_chunk_tokens: int = 2048
  # The token embedding (and an untied output projection) hold vocab_size rows padded up to a
  # multiple of this; the padded logits are masked out of the softmax, so loss and gradients are
  # the unpadded model's (the padded rows get none). 128 (GPT-2's 50257 -> 50304) is tensor-core
  # and TPU-lane aligned, and faster on an H200 (docs/results/README.md#d-mfu-levers). 1: no
  # padding.
  vocab_multiple: int = 128

  def validate(self) -> None:
    for name in ('vocab_size', 'd_model', 'num_heads', 'num_layers', 'd_ff', 'seq_len'):
      if getattr(self, name) <= 0:
        raise ConfigError(
          f'{field_ref(name)} must be a positive integer, got {getattr(self, name)}.'
        )
    if self.d_model % self.num_heads:
      raise ConfigError(
        f'{field_ref("d_model", self.d_model)} is not divisible by '
        f'{field_ref("num_heads", self.num_heads)}; choose {field_ref("d_model")} as a multiple '
        f'of {field_ref("num_heads")}.'
      )
    if self.vocab_multiple < 1:
      raise ConfigError(
        f'{field_ref("vocab_multiple")} must be >= 1 (1: no padding), got {self.vocab_multiple}.'
      )
    if self.layer_unroll is not None and self.layer_unroll < 0:
      raise ConfigError(
        f'{field_ref("layer_unroll")} must be >= 0 (0: unroll every layer), got '
        f'{self.layer_unroll}.'
      )
    if not 0.0 <= self.dropout < 1.0:
      raise ConfigError(f'{field_ref("dropout")} must be in [0, 1), got {self.dropout}.')
    self._validate_arch()
    for name, choices in (('dtype', DTYPES), ('param_dtype', DTYPES)):
      if getattr(self, name) not in choices:
        raise ConfigError(
          f'unknown {field_ref(name, getattr(self, name))}; choose one of {", ".join(choices)}.'
        )
    self._validate_attention()
    if self.loss_chunk_tokens < 0:
      raise ConfigError(
        f'{field_ref("loss_chunk_tokens")} must be >= 0 (0: the unchunked head), got '
        f'{self.loss_chunk_tokens}.'
      )
    if not 0.0 < self.init_std < float('inf'):
      raise ConfigError(f'{field_ref("init_std")} must be a positive number, got {self.init_std}.')

  def _validate_arch(self) -> None:
    """The architecture, and the Transformer-XL settings only it takes."""
    if self.arch not in ARCHS:
      raise ConfigError(f'unknown model {field_ref("arch", self.arch)}; use {" or ".join(ARCHS)}.')
    for name in ('mem_len', 'clamp_len'):
      if getattr(self, name) < 0:
        raise ConfigError(f'{field_ref(name)} must be >= 0 (0: off), got {getattr(self, name)}.')
    if not 0.0 <= self.attn_dropout < 1.0:
      raise ConfigError(f'{field_ref("attn_dropout")} must be in [0, 1), got {self.attn_dropout}.')
    if self.arch != 'transformer-xl':
      for name in ('mem_len', 'clamp_len', 'attn_dropout', 'untie_r'):
        if getattr(self, name):
          raise ConfigError(
            f'{field_ref(name)} is a Transformer-XL setting but the model is '
            f'{self.arch!r}; use {field_ref("arch", "transformer-xl")} or drop '
            f'{field_ref(name)}.'
          )

  def _validate_attention(self) -> None:
    """The attention kernel for this model and dtype, and its settings."""
    attention_kernels.check(
      self.attention, self.compute_dtype, relative=self.arch == 'transformer-xl'
    )
    if self.attention == 'blockwise' and self.attn_dropout:
      raise ConfigError(
        f'{field_ref("attention", "blockwise")} has no attention dropout; use '
        f'{field_ref("attention", "auto")} (it runs xla when dropping) or '
        f'{field_ref("attn_dropout", 0)}.'
      )
    if self.attention_block < 1:
      raise ConfigError(f'{field_ref("attention_block")} must be >= 1, got {self.attention_block}.')

  def unroll_for(self, platform: str | None = None) -> int:
    """Layers per scan iteration on `platform` (default: JAX's backend): layer_unroll, or for
    None, 0 (the whole stack unrolled) on GPU and 1 elsewhere."""
    if self.layer_unroll is not None:
      return self.layer_unroll
    return 0 if (platform or jax.default_backend()) == 'gpu' else 1

  def scan_unroll(self) -> int | bool:
    """`lax.scan`'s unroll for the layer stack on JAX's backend (True: every layer)."""
    return self.unroll_for() or True

  @property
  def padded_vocab(self) -> int:
    """Rows of the token embedding: vocab_size rounded up to a multiple of vocab_multiple."""
    return -(-self.vocab_size // self.vocab_multiple) * self.vocab_multiple

  @property
  def head_dim(self) -> int:
    return self.d_model // self.num_heads

  def attention_kind(self, platform: str | None = None) -> str:
    """The attention implementation this model runs on `platform` (default: JAX's backend;
    'tpu' when compiling for a TPU topology from a CPU machine)."""
    return attention_kernels.resolve(
      self.attention,
      platform or jax.default_backend(),
      self.compute_dtype,
      self.mem_len + self.seq_len,
      self.attention_block,
      relative=self.arch == 'transformer-xl',
    )

  @property
  def compute_dtype(self):
    return jnp.dtype(self.dtype)

  @property
  def weight_dtype(self):
    return jnp.dtype(self.param_dtype)


def precision(cfg: ModelConfig) -> dict:
  """The Flax modules' dtypes: compute in cfg.dtype, keep parameters in cfg.param_dtype (Flax
  casts each weight to the compute dtype where it is used, so its gradient comes back in the
  parameter's dtype, and LayerNorm computes its statistics in at least float32)."""
  return {'dtype': cfg.compute_dtype, 'param_dtype': cfg.weight_dtype}


def dropout(x, rate: float, rng):
  """Inverted dropout; a no-op when rate is 0 or there is no rng (evaluation)."""
  if rate == 0.0 or rng is None:
    return x
  keep = jax.random.bernoulli(rng, 1.0 - rate, x.shape)
  return jnp.where(keep, x / (1.0 - rate), jnp.zeros_like(x))


class Embedder(nnx.Module):
  """Token embedding V (shared with the output projection when tied) plus learned positions."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    # Looked up in the parameters' dtype, then cast: the gradient, a scatter-add of every token's
    # into its row, then accumulates in float32 (in bf16 it drifts by percents:
    # docs/results/README.md#p-bf16-sums).
    embedding = functools.partial(nnx.Embed, param_dtype=cfg.weight_dtype, rngs=rngs)
    init = nnx.initializers.normal(cfg.init_std)
    self.token = embedding(cfg.padded_vocab, cfg.d_model, embedding_init=init)
    self.position = embedding(cfg.seq_len, cfg.d_model, embedding_init=init)

  def __call__(self, tokens_BxL):
    positions_L = jnp.arange(tokens_BxL.shape[1])
    x_BxLxD = self.token(tokens_BxL) + self.position(positions_L)[None]
    return x_BxLxD.astype(self.cfg.compute_dtype)


class Block(nnx.Module):
  """One Transformer layer: causal self-attention and a GELU MLP, pre-LN or post-LN."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    init = nnx.initializers.normal(cfg.init_std)
    # Residual-branch outputs start smaller, as in GPT-2, so deep stacks start near identity.
    out_init = nnx.initializers.normal(cfg.init_std / (2 * cfg.num_layers) ** 0.5)
    d, f = cfg.d_model, cfg.d_ff
    linear = functools.partial(nnx.Linear, **precision(cfg), rngs=rngs)
    norm = functools.partial(nnx.LayerNorm, **precision(cfg), rngs=rngs)
    self.ln_attn = norm(d)
    self.qkv = linear(d, 3 * d, kernel_init=init)
    self.attn_out = linear(d, d, kernel_init=out_init)
    self.ln_mlp = norm(d)
    self.mlp_in = linear(d, f, kernel_init=init)
    self.mlp_out = linear(f, d, kernel_init=out_init)

  def attention(self, x_BxLxD, taps=None):
    b, l, _ = x_BxLxD.shape
    qkv_BxLxC = self.sublayer('qkv', x_BxLxD, taps)
    qkv_BxLx3xHxK = qkv_BxLxC.reshape(b, l, 3, self.cfg.num_heads, self.cfg.head_dim)
    q, k, v = (qkv_BxLx3xHxK[:, :, i] for i in range(3))
    kernel = attention_kernels.Kernel(self.cfg.attention, self.cfg.attention_block)
    y_BxLxHxK = attention_kernels.causal_attention(q, k, v, kernel)
    return self.sublayer('attn_out', y_BxLxHxK.reshape(b, l, -1), taps)

  def mlp(self, x_BxLxD, taps=None):
    return self.sublayer('mlp_out', jax.nn.gelu(self.sublayer('mlp_in', x_BxLxD, taps)), taps)

  def sublayer(self, name: str, x_BxLxC, taps=None):
    """The sub-layer `name` on x. With `taps` (a `Taps`, for the zero-bubble weight split) its
    zero tap is added to the output, so the tap's gradient is the gradient at this output, and the
    input is recorded: the weight gradient is made of the two (`tapped_weight_grads`)."""
    module = getattr(self, name)
    if name in NORMS and x_BxLxC.dtype != jnp.float32:
      # LayerNorm computes in float32, and its VJP would keep that float32 copy of x: recomputed
      # from the bf16 input instead (one cheap pass), which halves what the norm keeps.
      y_BxLxC = jax.checkpoint(lambda x: module(x))(x_BxLxC)
    else:
      y_BxLxC = module(x_BxLxC)
    if taps is None:
      return y_BxLxC
    taps.inputs[name] = x_BxLxC
    return y_BxLxC + taps.zeros[name]

  def __call__(self, x_BxLxD, rng=None, scale=1.0, taps=None):
    """`scale` multiplies both residual branches (progressive layer dropping uses 1/p)."""
    rate = self.cfg.dropout
    rng_attn, rng_mlp = (None, None) if rng is None else jax.random.split(rng)
    attention = lambda x: dropout(self.attention(x, taps), rate, rng_attn)
    mlp = lambda x: dropout(self.mlp(x, taps), rate, rng_mlp)
    norm = lambda name, x: self.sublayer(name, x, taps)
    if self.cfg.pre_ln:
      x_BxLxD = x_BxLxD + scale * attention(norm('ln_attn', x_BxLxD))
      return x_BxLxD + scale * mlp(norm('ln_mlp', x_BxLxD))
    x_BxLxD = norm('ln_attn', x_BxLxD + scale * attention(x_BxLxD))
    return norm('ln_mlp', x_BxLxD + scale * mlp(x_BxLxD))


@dataclasses.dataclass
class Taps:
  """One layer's zero taps (added to every linear and norm output) and, filled in as the layer
  runs, the inputs of those sub-layers."""

  zeros: dict
  inputs: dict = dataclasses.field(default_factory=dict)


TAPPED = ('ln_attn', 'qkv', 'attn_out', 'ln_mlp', 'mlp_in', 'mlp_out')  # the weighted sub-layers
NORMS = ('ln_attn', 'ln_mlp')


def tap_widths(cfg: 'ModelConfig') -> dict[str, int]:
  """The output width C of every tapped sub-layer."""
  d = cfg.d_model
  return {'ln_attn': d, 'qkv': 3 * d, 'attn_out': d, 'ln_mlp': d, 'mlp_in': cfg.d_ff, 'mlp_out': d}


class Head(nnx.Module):
  """Final LayerNorm (pre-LN models only) and, when untied, an output projection."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    if cfg.pre_ln:
      self.ln_final = nnx.LayerNorm(cfg.d_model, **precision(cfg), rngs=rngs)
    if not cfg.tie_embeddings:
      self.unembed = nnx.Linear(
        cfg.d_model,
        cfg.padded_vocab,
        use_bias=False,
        kernel_init=nnx.initializers.normal(cfg.init_std),
        **precision(cfg),
        preferred_element_type=jnp.float32,  # logits in float32
        rngs=rngs,
      )


# The graph definitions depend only on the config; cached so tracing never rebuilds modules.
@functools.lru_cache(maxsize=32)
def _graphdefs(cfg: ModelConfig):
  return tuple(
    nnx.graphdef(nnx.eval_shape(lambda: cls(cfg, nnx.Rngs(0)))) for cls in (Embedder, Block, Head)
  )


def _merge(graphdef, params: Params):
  return nnx.merge(graphdef, params)


# The initialiser of each architecture. Other architectures build on this module and register
# theirs when imported (txl.py; the package's __init__ imports it), so this module imports none.
_INITIALISERS: dict[str, Callable[[ModelConfig, jax.Array], Params]] = {}


def register_arch(arch: str, init: Callable[[ModelConfig, jax.Array], Params]) -> None:
  """Make `init_params` build the model `arch` names with `init(cfg, key)`."""
  _INITIALISERS[arch] = init


def init_params(cfg: ModelConfig, key: jax.Array) -> Params:
  """Random initial parameters, layer parameters stacked on a leading axis of size num_layers
  (of the model `cfg.arch` names: this module's, or `txl.py`'s)."""
  cfg.validate()
  if cfg.arch == 'gpt':
    return _init_params(cfg, key)
  return _INITIALISERS[cfg.arch](cfg, key)


def _init_params(cfg: ModelConfig, key: jax.Array) -> Params:
  return init_modules(cfg, key, Embedder, Block)


@functools.partial(jax.jit, static_argnums=(0, 2, 3))
def init_modules(cfg: ModelConfig, key: jax.Array, embedder: type, block: type) -> Params:
  """{'embed', 'layers' [N, ...], 'head'} from an embedding and a layer module class (this
  module's, or Transformer-XL's), the layers initialised as one vmapped stack."""
  key_embed, key_layers, key_head = jax.random.split(key, 3)

  @nnx.vmap(in_axes=0, out_axes=0)
  def stacked_blocks(k):
    return block(cfg, nnx.Rngs(k))

  def pure(module):
    return nnx.state(module, nnx.Param).to_pure_dict()

  return {
    'embed': pure(embedder(cfg, nnx.Rngs(key_embed))),
    'layers': pure(stacked_blocks(jax.random.split(key_layers, cfg.num_layers))),
    'head': pure(Head(cfg, nnx.Rngs(key_head))),
  }


def embed(cfg: ModelConfig, embed_params: Params, tokens_BxL, rng=None):
  """Token ids -> residual stream x_BxLxD (module 1's first piece)."""
  x_BxLxD = _merge(_graphdefs(cfg)[0], embed_params)(tokens_BxL)
  return dropout(x_BxLxD, cfg.dropout, rng)


class PerLayer(NamedTuple):
  """What a stack of N layers may change layer by layer (`layers`; None: nothing).

  active_N: bool per layer; an inactive layer is skipped by `lax.cond` (no FLOPs), which is how
    uneven pipeline stages are padded and how dropped layers cost nothing.
  scale_N: a multiplier of each layer's residual branches (1/keep-probability for PLD).
  taps_N: zero taps per layer ({name: [N, B, L, C]}, `zero_taps`); `layers` then also returns
    the tapped sub-layers' inputs per layer, for `tapped_weight_grads`.
  """

  active_N: Any = None
  scale_N: Any = None
  taps_N: Any = None


def layers(
  cfg: ModelConfig, layer_params: Params, x_BxLxD, rng=None, per_layer: PerLayer = PerLayer()
):
  """Runs a stack of N layers (params with a leading axis N) over x by `lax.scan`, with what
  `per_layer` changes layer by layer; (x, the tapped inputs) when it has taps.
  cfg.layer_unroll layers run per scan iteration (0: all of them, no loop).
  """
  active_N, scale_N, taps_N = per_layer
  block_def = _graphdefs(cfg)[1]
  num = jax.tree.leaves(layer_params)[0].shape[0]
  scale_N = jnp.ones((num,), x_BxLxD.dtype) if scale_N is None else scale_N

  def layer(params, x, layer_rng, scale_and_zeros):
    scale, zeros = scale_and_zeros
    taps = None if zeros is None else Taps(zeros)
    y = _merge(block_def, params)(x, layer_rng, scale, taps).astype(x.dtype)
    return y, (None if taps is None else taps.inputs)

  x_BxLxD, inputs_N = staging.scan_layers(
    layer,
    layer_params,
    x_BxLxD,
    rng,
    active_N=active_N,
    per_layer_N=(scale_N, taps_N),
    unroll=cfg.scan_unroll(),
  )
  return x_BxLxD if taps_N is None else (x_BxLxD, inputs_N)


def zero_taps(cfg: ModelConfig, num_layers: int, x_BxLxD) -> dict:
  """Zero taps for `layers(..., PerLayer(taps_N=...))`: {sub-layer: [N, B, L, C]}."""
  return {
    name: jnp.zeros((num_layers, *x_BxLxD.shape[:-1], width), x_BxLxD.dtype)
    for name, width in tap_widths(cfg).items()
  }


def tapped_weight_grads(cfg: ModelConfig, inputs_N: dict, tap_grads_N: dict) -> Params:
  """The layers' weight gradient from each tapped sub-layer's input and output gradient: a
  linear layer's kernel gets sum over tokens of input x gradient, its bias the summed gradient; a
  norm's scale gets the summed gradient times the normalised input, its bias the summed gradient.
  This is the zero-bubble W: matrix products only, no chain of input gradients."""
  f32 = jnp.float32  # sums over tokens accumulate in float32 whatever the compute dtype
  grads = {}
  for name in TAPPED:
    x_NxBxLxC, g_NxBxLxC = inputs_N[name], tap_grads_N[name]
    bias = g_NxBxLxC.sum(axis=(1, 2), dtype=f32)
    if name in NORMS:
      scale = (g_NxBxLxC.astype(f32) * _normalized(x_NxBxLxC.astype(f32))).sum(axis=(1, 2))
      grads[name] = {'scale': scale, 'bias': bias}
    else:
      kernel = jnp.einsum('nbli,nblo->nio', x_NxBxLxC, g_NxBxLxC, preferred_element_type=f32)
      grads[name] = {'kernel': kernel, 'bias': bias}
  return jax.tree.map(lambda g: g.astype(cfg.weight_dtype), grads)


def _normalized(x_BxLxC, epsilon: float = 1e-6):
  """LayerNorm without its scale and bias, as `nnx.LayerNorm` computes it (fast variance)."""
  mean = x_BxLxC.mean(-1, keepdims=True)
  var = jnp.maximum(0.0, (x_BxLxC * x_BxLxC).mean(-1, keepdims=True) - mean * mean)
  return (x_BxLxC - mean) * jax.lax.rsqrt(var + epsilon)


def logits(cfg: ModelConfig, head_params: Params, embed_params: Params, x_BxLxD):
  """Residual stream -> next-token logits [B, L, vocab_size] (float32), through V^T when the
  embedding is tied; the padded vocabulary's columns are computed and dropped."""
  logits_BxLxP = output_projection(*unembedding(cfg, head_params, embed_params, x_BxLxD))
  return logits_BxLxP[..., : cfg.vocab_size]


def unembedding(cfg: ModelConfig, head_params: Params, embed_params: Params, x_BxLxD):
  """(the final norm's output, the output projection's weight [V, D]): the logits are their
  product. The weight is the token embedding when tied, the head's kernel [D, V] transposed."""
  head = _merge(_graphdefs(cfg)[2], head_params)
  if cfg.pre_ln:
    x_BxLxD = head.ln_final(x_BxLxD)
  if cfg.tie_embeddings:
    return x_BxLxD, embed_params['token']['embedding']
  return x_BxLxD, head.unembed.kernel[...].T


@jax.custom_vjp
def output_projection(x_BxLxD, weight_VxD):
  """Logits x @ W^T in the compute dtype (x's), accumulated and returned in float32. The
  backward casts the float32 logits' cotangent to the compute dtype before its two matmuls, as
  every other layer's backward runs: left in float32 they ran far slower on an H200 at
  GPT-2-small's width, the largest single cost of a step (docs/results/README.md#d-head)."""
  weight_VxD = weight_VxD.astype(x_BxLxD.dtype)
  return jnp.einsum('bld,vd->blv', x_BxLxD, weight_VxD, preferred_element_type=jnp.float32)


def _output_projection_fwd(x_BxLxD, weight_VxD):
  return output_projection(x_BxLxD, weight_VxD), (x_BxLxD, weight_VxD)


def _output_projection_bwd(residuals, g_BxLxV):
  x_BxLxD, weight_VxD = residuals
  g_BxLxV = g_BxLxV.astype(x_BxLxD.dtype)
  f32 = jnp.float32
  dx_BxLxD = jnp.einsum(
    'blv,vd->bld', g_BxLxV, weight_VxD.astype(x_BxLxD.dtype), preferred_element_type=f32
  )
  dw_VxD = jnp.einsum('blv,bld->vd', g_BxLxV, x_BxLxD, preferred_element_type=f32)
  return dx_BxLxD.astype(x_BxLxD.dtype), dw_VxD.astype(weight_VxD.dtype)


output_projection.defvjp(_output_projection_fwd, _output_projection_bwd)


def head_loss(cfg: ModelConfig, head_params: Params, embed_params: Params, x_BxLxD, targets_BxL):
  """Module K: final norm, output projection and mean next-token cross-entropy (nats); over
  chunks of cfg.loss_chunk_tokens tokens with no float32 logits kept (`cross_entropy`), or, with
  0, through the float32 logits [B, L, V]."""
  if cfg.loss_chunk_tokens:
    x_BxLxD, weight_VxD = unembedding(cfg, head_params, embed_params, x_BxLxD)
    loss = cross_entropy.chunked_cross_entropy(
      x_BxLxD, weight_VxD, targets_BxL, cfg.loss_chunk_tokens, cfg.vocab_size
    )
    return loss, {'loss': loss}
  logits_BxLxV = logits(cfg, head_params, embed_params, x_BxLxD).astype(jnp.float32)
  logp_BxLxV = jax.nn.log_softmax(logits_BxLxV)
  nll_BxL = -jnp.take_along_axis(logp_BxLxV, targets_BxL[..., None], axis=-1)[..., 0]
  loss = nll_BxL.mean()
  return loss, {'loss': loss}


def loss_fn(cfg: ModelConfig, params: Params, batch: dict, rng=None):
  """Plain (single-device) composition embed -> all layers -> head, for backprop and eval."""
  rng_embed, rng_layers = (None, None) if rng is None else jax.random.split(rng)
  x_BxLxD = embed(cfg, params['embed'], batch['inputs'], rng_embed)
  x_BxLxD = layers(cfg, params['layers'], x_BxLxD, rng_layers)
  return head_loss(cfg, params['head'], params['embed'], x_BxLxD, batch['targets'])


def count_params(params: Params) -> int:
  return sum(x.size for x in jax.tree.leaves(params))
