"""The `--help` line of every config-field flag (`config.fields()`): what it does, its choices and
its default, the choices and the defaults read from where they are defined (the dataclasses, the
presets, `choices.py` and the modules' constants), never restated here.

`field_help(name)` is the one line; `DESCRIPTIONS` says what each flag does in words alone (no
value that is defined elsewhere, no measured result: those are rows of docs/results/README.md).
"""

from __future__ import annotations

from ouroboros_jax import choices as named
from ouroboros_jax import optimizers
from ouroboros_jax.models import attention
from ouroboros_jax.models.model import ARCHS, DTYPES
from ouroboros_jax.schedules import config as schedule_config
from ouroboros_jax.schedules import tables
from ouroboros_jax.schedules.compensation import COMPENSATIONS
from ouroboros_jax.training import config, presets

# What each flag does; `field_help` adds its choices and its default.
DESCRIPTIONS = {
  # ModelConfig
  'vocab_size': 'vocabulary size (a word-level corpus needs its own: docs/guides/data.md)',
  'd_model': 'width of the residual stream',
  'num_heads': 'attention heads (they divide --d-model)',
  'num_layers': 'Transformer layers',
  'd_ff': 'width of the MLP',
  'seq_len': 'tokens per training window (Transformer-XL: per segment)',
  'dropout': 'dropout rate on the residual branches',
  'pre_ln': 'pre-LN (GPT-2) blocks; false: the original post-LN blocks',
  'tie_embeddings': 'the output projection is the input embedding, transposed',
  'init_std': 'standard deviation of the initial weights',
  'layer_unroll': 'layers per iteration of the layer scan; 0 unrolls the stack (faster, longer '
  'compiles for deep models)',
  'model': 'architecture (transformer-xl: relative positions; with --mem-len, segment recurrence)',
  'mem_len': 'transformer-xl: hidden states each layer keeps from the previous segments (0: none); '
  'the training batches then continue each other row by row',
  'clamp_len': 'transformer-xl: relative distances beyond this share its encoding (0: off)',
  'attn_dropout': 'transformer-xl: dropout on the attention probabilities',
  'untie_r': "transformer-xl: every layer its own biases u, v (the reference code's --untie_r); "
  'false: one global pair, as the paper writes it',
  'dtype': 'compute dtype of activations, stashes, ring buffers and transfers (logits, loss and '
  'norm statistics stay float32)',
  'param_dtype': 'dtype of the parameters (the master weights; the optimizer state that '
  "--state-dtype does not store, such as Adam's second moment, follows it)",
  'attention': "attention kernel: auto picks the target's fused one (cuDNN on GPU, Pallas on "
  'TPU) or the blockwise one; xla materialises L x L',
  'attention_block': 'blockwise attention: keys (and queries) per block',
  'loss_chunk_tokens': "tokens per chunk of the head's cross-entropy, computed with its "
  'gradient one chunk at a time, so the float32 logits [batch, length, vocabulary] are never held '
  'whole (less memory and memory traffic, the same loss and gradient); 0: all the logits at once',
  'vocab_multiple': 'the token embedding (and an untied output projection) hold the vocabulary '
  'rounded up to a multiple of this many rows, the extra logits masked out (the same loss and '
  'gradients; aligned matmuls); 1: no padding',
  # ScheduleConfig
  'schedule': 'how the model is placed and trained (docs/guides/schedules.md)',
  'stages': 'pipeline stages G: devices the layers are cut over (model_parallel, gpipe, the exact '
  'pipelines, ouroboros)',
  'data_parallel': 'data replicas D (each of G stages): the run uses G x D devices',
  'fsdp': 'shard the parameters, gradients and optimizer state over the D data replicas '
  '(FSDP): data_parallel alone, XLA gathering each layer where it runs; a stage schedule with '
  'D > 1, each stage over its replicas, gathered one layer at a time',
  'shard_update': 'split the optimizer state and its update over the D > 1 data replicas '
  '(ZeRO-1), the weights whole on each replica, gathered once a step after the update: 1/D of '
  "the state and of Muon's orthogonalisation a device, for one gather a step (--fsdp also splits "
  'the weights, gathering each layer where it runs)',
  'clip_norm': 'clip the global gradient norm to this before the update (0 or none: off)',
  'microbatches': 'micro-batches per data replica (gpipe, the exact pipelines, ouroboros; the '
  'others step on the whole batch)',
  'chunks': 'interleaved: model chunks per device, v (zb_v always runs its own); the layers are '
  'cut into --stages x v groups',
  'stash': 'ouroboros: what waits for the delayed backward: graph (the VJP) or replay (the input, '
  'the forward run again)',
  'stash_policy': "what a layer group's forward keeps for its backward, the rest recomputed "
  '(all: every residual, dots: matmul outputs, nothing: the input); every schedule (backprop and '
  'data_parallel per layer, the others per group; not the replay stash); less kept: less memory, '
  'more recompute, same gradient; auto: nothing on ouroboros, all elsewhere',
  'stash_memory': "ouroboros: where the stash and the forward's weights wait (pinned_host: less "
  'device memory, a transfer each way per step; balanced: a deep group lends its older slots to '
  'its mirror group G - 1 - s, about half the slots a device, an item each way per round)',
  'forward': "ouroboros: locked (the paper's forward) or pipelined (one hop per step)",
  'flow': "ouroboros: a step's micro-batches go round the ring as one batch (the paper's delays) "
  'or stream across updates (PipeDream-2BW style, smaller delays; docs/algorithm.md)',
  'sync_warmup_steps': 'ouroboros: train this many first steps with plain backprop over the ring',
  'tied_grad': "ouroboros: the tied embedding's two gradients (input and output ends) summed or "
  'averaged',
  # TrainConfig
  'preset': 'starting point; the field flags given override its values',
  'data': "corpus: 'default' (embedded Shakespeare), 'text:PATH[,PATH]', 'tfds:NAME[:FEATURE]', "
  "'enwik8:PATH', 'text8:PATH' or 'wikitext103:DIR' (docs/guides/data.md)",
  'data_dir': 'TFDS data directory',
  'download': 'tfds: let TFDS download and prepare a dataset that is not prepared yet (false: '
  'never touch the network, fail in seconds)',
  'batch_size': 'sequences per step (all data replicas together)',
  'steps': 'optimizer steps to train',
  'learning_rate': 'peak learning rate (linear warmup, then cosine decay)',
  'warmup_steps': 'steps of linear warmup to the peak rate',
  'min_lr_ratio': 'the cosine decay ends at this fraction of the peak rate',
  'weight_decay': 'decoupled weight decay (on the kernels only)',
  'log_every': 'steps between log lines (also how often the loss is checked for NaN/Inf)',
  'eval_every': 'steps between validation evaluations (the last step always evaluates)',
  'eval_batches': 'validation batches per evaluation',
  'test_batches': 'test batches evaluated at the end of the run (none: the whole test split)',
  'eval_mem_len': 'transformer-xl: memory length when evaluating',
  'data_order': 'training batches as shuffled windows, or as B contiguous segment streams (as '
  'Transformer-XL trains)',
  'checkpoint_every': 'steps between checkpoints (the last step always saves)',
  'keep_checkpoints': 'checkpoints kept in OUT (the oldest are removed)',
  'drain': "ouroboros: before the run's last checkpoint (at --steps or a stop signal) the ring "
  'applies every gradient in flight, so that --resume may change the layout (G, D, M, the '
  "schedule, the forward, the stash); --steps at a checkpoint's step drains it at once",
  'fresh_optimizer': "with --resume: the optimizer's state starts again from its init, so that "
  '--optimizer, --state-dtype or --compensation may change (the parameters, the step and the '
  'data position resume as saved)',
  'seed': 'seed of the parameters, the data order and dropout',
  'out': 'output directory: metrics, TensorBoard logs, checkpoints',
  'layers_per_stage': "layers of each stage (or group), e.g. '2,4,4,4'",
  'optimizer': 'the optimizer (muon: orthogonalised momentum on the layer kernels, Adam at '
  '--learning-rate elsewhere; nadamw: Nesterov; docs/results/README.md#q-muon)',
  'muon_learning_rate': 'muon: peak rate of the layer kernels',
  'momentum': "the optimizer's first-moment decay (AdamW/NAdamW b1, Muon's beta)",
  'state_dtype': 'stored precision of the per-weight optimizer and compensation state (the '
  "optimizer's first moment, DC-ASGD's running mean, weight prediction's latest update), computed "
  'in float32 either way; docs/results/README.md#p-state-dtype',
  'dc_lambda': 'dc: the strength lambda_0 of DC-ASGD-a',
  'shrink': 'shrink: factor on delayed gradients, in (0, 1]',
  'pipemare_steps': 'pipemare: steps to reach the full rate (0: a quarter of --steps)',
  'predict_horizon': 'predict: the forward runs at w + HORIZON * gap * (latest update); 1: the '
  'gap itself',
  'pld': 'progressive layer dropping, THETA_BAR,GAMMA (or default): layer l kept with probability '
  '1-(l/L)(1-theta(t)), theta(t) = (1-theta_bar)exp(-gamma t)+theta_bar; pre-LN GPT only '
  '(docs/guides/accelerators.md)',
  'growth': 'MSLT / progressive stacking plan, METHOD:DEPTHxSTEPS,...[,all:STEPS][,init=copy_top|'
  'random][,embed=train], METHOD mslt or stacking, e.g. mslt:1x300,2x300,4x*; backprop only '
  '(docs/guides/accelerators.md)',
  'vcycle': 'multi-level V-cycle plan, down=N[/N..],coarse=N[,up=N[/N..]][,levels=K][,alpha=A]'
  '[,width=W][,depth=D][,lr_scale=S][,opt=carry|reset], e.g. down=200,coarse=400 '
  '(docs/guides/accelerators.md)',
  'std_loss': 'weight of the standardization loss on the GELU pre-activations (0: off)',
  'std_loss_layers': "layers the standardization loss regularises: 'all' or 0-based indices, e.g. "
  "'0,2'",
}


# What each of --compensation's terms does (COMPENSATIONS names them).
COMPENSATION_TERMS = {
  'predict': 'forward at w + gap x last update',
  'pipemare': 'rate / gap^(1-t/T)',
  'dc': 'DC-ASGD-a, graph stash',
  'shrink': 'delayed gradients x --shrink',
}
DESCRIPTIONS['compensation'] = (
  "ouroboros staleness compensation: auto, none (the paper's AdamW) or a comma list of "
  + ', '.join(f'{n} ({COMPENSATION_TERMS[n]})' for n in COMPENSATIONS)
  + '; docs/results/README.md#q-stream'
)


def _choices() -> dict[str, tuple[str, ...]]:
  return {
    'model': ARCHS,
    'dtype': DTYPES,
    'param_dtype': DTYPES,
    'attention': attention.IMPLEMENTATIONS,
    'schedule': named.SCHEDULES,
    'stash': named.STASH_MODES,
    'stash_policy': (schedule_config.AUTO, *named.STASH_POLICY_NAMES),
    'stash_memory': named.STASH_MEMORIES,
    'forward': named.FORWARD_MODES,
    'flow': named.FLOW_MODES,
    'tied_grad': named.TIED_GRAD_MODES,
    'preset': tuple(presets.PRESETS),
    'data_order': config.DATA_ORDERS,
    'optimizer': (schedule_config.AUTO, *optimizers.OPTIMIZERS),
    'state_dtype': (schedule_config.AUTO, *optimizers.STATE_DTYPES),
  }


def _rules() -> dict[str, str]:
  """The defaults that are a rule rather than one value (None or 'auto' in the dataclass)."""
  m = schedule_config
  rates = config.DEFAULT_MUON_RATES
  return {
    'data': "'default'",
    'data_dir': '$OUROBOROS_DATA_DIR or ~/.cache/ouroboros_jax/tfds',
    'eval_mem_len': '--mem-len',
    'data_order': 'auto: segments for a model with a memory, else windows',
    'out': 'runs/<preset>-<schedule>',
    'layers_per_stage': 'balanced by FLOPs',
    'layer_unroll': 'unrolled (0) on GPU, 1 elsewhere',
    'microbatches': f'{m.DEFAULT_MICROBATCHES} for gpipe and the exact pipelines; ouroboros '
    f'{m.OUROBOROS_MICROBATCHES} on CPU, up to {m.OUROBOROS_ACCELERATOR_MICROBATCHES} on an '
    'accelerator, and streamed at least G locked, 2G pipelined',
    'chunks': ', '.join(f'{v} for {k}' for k, v in tables.DEFAULT_CHUNKS.items()),
    'flow': 'auto: stream under a --compensation, batch with --compensation none',
    'optimizer': f'auto: {config.DEFAULT_OPTIMIZER}; adamw with --compensation none, --growth or '
    '--vcycle',
    'muon_learning_rate': f'{rates["exact"]} for exact gradients, {rates["delayed"]} under '
    "ouroboros' delays",
    'momentum': "the optimizer's own: "
    + ', '.join(f'{k} {v}' for k, v in optimizers.DEFAULT_MOMENTUM.items()),
    'state_dtype': 'auto: bfloat16 with --dtype bfloat16, else float32',
    'compensation': f'auto: for ouroboros with G > 1 {m.RECIPE_COMPENSATION} (replay: '
    f'{m.RECIPE_COMPENSATION_REPLAY}), else none',
    'pld': 'off',
    'growth': 'off',
    'vcycle': 'off',
  }


def _value(value) -> str:
  if isinstance(value, bool):
    return str(value).lower()
  return 'none' if value is None else str(value)


def field_help(name: str) -> str:
  """The flag's one help line: `DESCRIPTIONS[name]`, its choices, its default. The default is
  the default preset's value (`TrainConfig.preset`, the preset `train` starts from), noted where
  the presets differ, or the rule that gives it."""
  text = DESCRIPTIONS[name]
  options = _choices().get(name)
  if options:
    text += f'; one of {", ".join(options)}'
  rule = _rules().get(name)
  if rule is not None:
    return f'{text} (default {rule})'
  default_preset = config.TrainConfig().preset
  values = {_value(config.flat(p)[name]) for p in presets.PRESETS.values()}
  value = _value(config.flat(presets.get_preset(default_preset))[name])
  if name == 'preset':
    return f'{text} (default {value})'
  if len(values) > 1:
    return f'{text} (default {value}, from --preset {default_preset})'
  return f'{text} (default {value})'
