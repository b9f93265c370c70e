"""Sampling bytes from a trained run: `ouroboros sample --ckpt OUT`.

The latest checkpoint's parameters are restored onto one device (whatever schedule and mesh
trained them), un-staged with `partition.from_staged`, and text is generated one byte at a time.
Generation is one jitted `lax.fori_loop` over a fixed buffer: each step runs the full model over
a window of the last seq_len tokens (no KV cache; the model is small and the code stays simple)
and samples the next byte from the logits at the window's last filled position. Causal attention
means the zeros after that position never influence it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from ouroboros_jax import checkpoint, partition, presets
from ouroboros_jax import model as transformer
from ouroboros_jax.model import ModelConfig


def load(out_dir: str, step: int | None = None) -> tuple[ModelConfig, dict, int]:
  """(model config, unstaged params {'embed','layers','head'}, step) of a run's checkpoint."""
  if checkpoint.latest_step(out_dir) is None:
    raise checkpoint.CheckpointError(
        f'no checkpoint in {checkpoint.checkpoint_dir(out_dir)}; pass --ckpt the OUT directory '
        'of a training run.')
  manager = checkpoint.make_manager(out_dir, read_only=True)
  try:
    step = manager.latest_step() if step is None else step
    if step not in manager.all_steps():
      raise checkpoint.CheckpointError(f'no checkpoint for step {step} in {manager.directory} '
                                       f'(it has {list(manager.all_steps())}).')
    meta = checkpoint.read_meta(manager, step)
    staged_params = checkpoint.restore_params_single_device(manager, step)
  finally:
    manager.close()
  cfg = presets.TrainConfig.from_dict(meta['config'])
  return cfg.model, partition.from_staged(staged_params, meta['layers_per_stage']), step


@functools.partial(jax.jit, static_argnames=('cfg', 'prompt_len', 'length'))
def _generate(cfg: ModelConfig, params, buffer_T, prompt_len: int, length: int, temperature,
              key):
  """Fills buffer_T[prompt_len : prompt_len + length] with sampled tokens."""
  window = cfg.seq_len

  def next_token(i, buffer_T):
    pos = prompt_len + i                        # index of the token being generated
    start = jnp.maximum(0, pos - window)
    window_1xL = jax.lax.dynamic_slice(buffer_T, (start,), (window,))[None]
    x_1xLxD = transformer.embed(cfg, params['embed'], window_1xL)
    x_1xLxD = transformer.layers(cfg, params['layers'], x_1xLxD)
    logits_V = transformer.logits(cfg, params['head'], params['embed'], x_1xLxD)[0, pos - 1 - start]
    logits_V = logits_V.astype(jnp.float32)
    greedy = jnp.argmax(logits_V)
    scaled = logits_V / jnp.maximum(temperature, 1e-6)
    sampled = jax.random.categorical(jax.random.fold_in(key, i), scaled)
    token = jnp.where(temperature > 0, sampled, greedy).astype(buffer_T.dtype)
    return buffer_T.at[pos].set(token)

  return jax.lax.fori_loop(0, length, next_token, buffer_T)


def generate(cfg: ModelConfig, params: dict, prompt: bytes, *, length: int,
             temperature: float = 0.8, seed: int = 0) -> bytes:
  """`length` new bytes continuing `prompt` (an empty prompt starts from a newline)."""
  prompt = prompt or b'\n'
  if length < 0:
    raise transformer.ConfigError(f'--length must be >= 0, got {length}.')
  if temperature < 0:
    raise transformer.ConfigError(f'--temperature must be >= 0, got {temperature}.')
  prompt_P = np.frombuffer(prompt, np.uint8).astype(np.int32)
  # Room for the whole text, and at least one full window so the slice is always in bounds.
  buffer_T = np.zeros(max(len(prompt_P) + length, cfg.seq_len), np.int32)
  buffer_T[:len(prompt_P)] = prompt_P
  out_T = _generate(cfg, params, jnp.asarray(buffer_T), len(prompt_P), length,
                    jnp.float32(temperature), jax.random.key(seed))
  out_T = np.asarray(jax.device_get(out_T))
  return out_T[len(prompt_P):len(prompt_P) + length].astype(np.uint8).tobytes()


def sample(out_dir: str, *, prompt: str = '', length: int = 500, temperature: float = 0.8,
           seed: int = 0, step: int | None = None) -> str:
  """Prompt plus `length` sampled bytes from a run's checkpoint, decoded as UTF-8 (replace)."""
  cfg, params, _ = load(out_dir, step)
  prompt_bytes = prompt.encode('utf-8')
  text = generate(cfg, params, prompt_bytes, length=length, temperature=temperature, seed=seed)
  return (prompt_bytes + text).decode('utf-8', errors='replace')
