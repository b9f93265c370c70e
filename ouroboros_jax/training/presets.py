"""The named presets (`PRESETS`): starting points for a `TrainConfig`, chosen with `--preset`.

    from ouroboros_jax.training import field_flags, presets
    cfg = field_flags.override(presets.get_preset('tiny'), {'d_model': 64, 'steps': 10})

`PRESETS` below holds their values; docs/guides/cli.md#presets tabulates them:

    tiny             2 layers, 128 wide: a learned model in minutes on 2 CPU cores (the default)
    small            4 layers, 192 wide: ~25 min on 2 CPU cores
    enwik8-base      Transformer-XL's base enwik8 model's size, without its recurrence memory
    txl-tiny         Transformer-XL's relative attention (txl.py) at tiny's size and wall-clock
    txl-enwik8-base  Transformer-XL's enwik8 base model in the paper's settings (--data enwik8:PATH)
    txl-wt103-base   Transformer-XL's WikiText-103 base model, a word vocabulary (--data
                     wikitext103:DIR)
    gpt2-small       GPT-2 small's shape

Tokens are bytes (vocabulary 256) but for txl-wt103-base's words. `enwik8-base` is the size of
Transformer-XL's base enwik8 model (Dai et al. 2019: 12 layers, 512 wide, 8 heads, inner 2048,
target length 512, dropout 0.1, Adam at 2.5e-4 with cosine decay, batch 22, clip 0.25); point it
at enwik8 with `--data text:/path/to/enwik8`. `gpt2-small` has GPT-2 small's shape but GPT-2 uses
a 50257-token BPE vocabulary (124M parameters); here the vocabulary is 256 bytes, so it has ~86M
parameters.
"""

from __future__ import annotations

from ouroboros_jax.errors import ConfigError, field_ref
from ouroboros_jax.models.model import ModelConfig
from ouroboros_jax.schedules.config import ScheduleConfig
from ouroboros_jax.training.config import TrainConfig

# The flat layout's old path ouroboros_jax.presets (moved.MOVED, deprecated) gives this module;
# its documented presets.override(presets.get_preset(...), ...) works until the path goes.
from ouroboros_jax.training.field_flags import override  # noqa: F401

# A table, kept as one: `ruff format` would give every field its own line.
# fmt: off
PRESETS: dict[str, TrainConfig] = {
  # Tuned on a 2-core CPU: ~18k tokens/s, 2000 steps in ~4 minutes including compilation.
  # Two layers beat four there: at this budget more tokens matter more than depth. 2048 tokens
  # per step stays under the early critical batch; 1e-2 is close to where training stalls.
  'tiny': TrainConfig(
      model=ModelConfig(d_model=128, num_heads=4, num_layers=2, d_ff=512, seq_len=64),
      preset='tiny', batch_size=32, steps=2000, learning_rate=5e-3, warmup_steps=50,
      log_every=20, eval_every=500, eval_batches=125,  # 125: all of the default validation
      checkpoint_every=1000),
  'small': TrainConfig(
      model=ModelConfig(d_model=192, num_heads=6, num_layers=4, d_ff=768, seq_len=128),
      preset='small', batch_size=32, steps=1500, learning_rate=3e-3, warmup_steps=100,
      log_every=20, eval_every=250, eval_batches=60, checkpoint_every=500),
  # Transformer-XL's enwik8 base model size (Dai et al. 2019), without its recurrence memory.
  'enwik8-base': TrainConfig(
      model=ModelConfig(d_model=512, num_heads=8, num_layers=12, d_ff=2048, seq_len=512,
                        dropout=0.1),
      preset='enwik8-base', batch_size=22, steps=400_000, learning_rate=2.5e-4,
      warmup_steps=0, min_lr_ratio=0.0, weight_decay=0.0, schedule=ScheduleConfig(clip_norm=0.25),
      log_every=100, eval_every=4000, eval_batches=100, checkpoint_every=4000),
  # Transformer-XL's attention (txl.py) at tiny's size, with the steps that fill tiny's time, and
  # u, v per layer (the reference code's TF scripts' --untie_r). Against `tiny` in the same time:
  # docs/results/README.md#x-attention; at this size its memory does not pay for itself on 2 CPU
  # cores (--mem-len 64, segment order): docs/results/README.md#x-memory.
  'txl-tiny': TrainConfig(
      model=ModelConfig(arch='transformer-xl', d_model=128, num_heads=4, num_layers=2, d_ff=512,
                        seq_len=64, untie_r=True),
      preset='txl-tiny', batch_size=32, steps=2100, learning_rate=5e-3, warmup_steps=50,
      log_every=20, eval_every=500, eval_batches=125, checkpoint_every=1000),
  # Transformer-XL itself (txl.py), in the paper's settings: its enwik8 base model (12 layers,
  # post-LN, tgt_len 512, mem_len 512, Adam 2.5e-4 cosine, clip 0.25, batch 22; 1.06 bpc in the
  # paper) and its WikiText-103 base model (16 layers, d 410, tgt/mem 150; the paper's adaptive
  # softmax is a full softmax here). Point --data at the files: enwik8:PATH, wikitext103:DIR.
  'txl-enwik8-base': TrainConfig(
      model=ModelConfig(arch='transformer-xl', d_model=512, num_heads=8, num_layers=12,
                        d_ff=2048, seq_len=512, mem_len=512, dropout=0.1, pre_ln=False),
      preset='txl-enwik8-base', batch_size=22, steps=400_000, learning_rate=2.5e-4,
      warmup_steps=0, min_lr_ratio=0.0, weight_decay=0.0, schedule=ScheduleConfig(clip_norm=0.25),
      log_every=200, eval_every=4000, eval_batches=100, checkpoint_every=4000),
  'txl-wt103-base': TrainConfig(
      model=ModelConfig(arch='transformer-xl', vocab_size=267_735, d_model=410, num_heads=10,
                        num_layers=16, d_ff=2100, seq_len=150, mem_len=150, dropout=0.1,
                        pre_ln=False),
      preset='txl-wt103-base', batch_size=60, steps=200_000, learning_rate=2.5e-4,
      warmup_steps=0, min_lr_ratio=0.0, weight_decay=0.0, schedule=ScheduleConfig(clip_norm=0.25),
      log_every=200, eval_every=4000, eval_batches=100, checkpoint_every=4000),
  # GPT-2 small's shape (124M parameters with its 50257-token BPE vocabulary). This is a
  # byte-level model (vocabulary 256), so it has ~86M parameters and is not GPT-2's tokenizer.
  'gpt2-small': TrainConfig(
      model=ModelConfig(d_model=768, num_heads=12, num_layers=12, d_ff=3072, seq_len=1024,
                        dropout=0.1),
      preset='gpt2-small', batch_size=32, steps=100_000, learning_rate=6e-4,
      warmup_steps=2000, min_lr_ratio=0.1, weight_decay=0.1, log_every=100,
      eval_every=2000, eval_batches=50, checkpoint_every=2000),
}
# fmt: on


def get_preset(name: str) -> TrainConfig:
  if name not in PRESETS:
    raise ConfigError(f'unknown {field_ref("preset", name)}; choose one of {", ".join(PRESETS)}.')
  return PRESETS[name]
