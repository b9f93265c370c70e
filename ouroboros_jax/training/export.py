"""The way out of the ring: `ouroboros export --ckpt OUT --to DIR` (issue 63).

A checkpoint holds the state as its schedule lays it out (stage leaves [G, N, ...], the
optimizer's moments, Ouroboros' ring). An export holds only the trained model, as one plain
parameter tree in the layout of the model's own code, whatever schedule and mesh trained it:

    DIR/params/      {'embed', 'layers' [L, ...], 'head'}: the arrays `models.model.loss_fn`
                     and `models.model.logits` take (Orbax's StandardCheckpointer format, so
                     `orbax.checkpoint.StandardCheckpointer().restore(DIR / 'params')` reads it
                     with Flax's own tools, no ouroboros_jax needed)
    DIR/export.json  {'format', 'model' (the ModelConfig fields), 'step', 'from' (OUT), 'schedule'}

`load(DIR)` returns (ModelConfig, params); `ouroboros sample --ckpt DIR` generates from an export
as from a run. A model given as layers (`staging.from_layers`) goes back to its own layout with
its `Staging.to_layers` instead (docs/guides/bring_your_own_model.md).
"""

from __future__ import annotations

import dataclasses
import json
import os

from ouroboros_jax.errors import CheckpointError
from ouroboros_jax.models.model import ModelConfig

FORMAT = 'ouroboros-export-1'
META = 'export.json'
PARAMS = 'params'


def is_export(path: str) -> bool:
  """Whether `path` is a directory `export` wrote."""
  return os.path.isfile(os.path.join(path, META))


def export(out_dir: str, to: str, step: int | None = None) -> str:
  """Writes the checkpoint's model (the newest readable, or `step`'s) to `to`; returns the line
  that says what was written. Refuses a `to` that is not empty, so nothing is overwritten."""
  import orbax.checkpoint as ocp

  if os.path.exists(to) and (not os.path.isdir(to) or os.listdir(to)):
    raise CheckpointError(f'--to {to} exists and is not an empty directory; name a new one.')
  model, params, step = load_run(out_dir, step, 'exporting')
  os.makedirs(to, exist_ok=True)
  with ocp.StandardCheckpointer() as writer:
    writer.save(os.path.abspath(os.path.join(to, PARAMS)), params)
  meta = {
    'format': FORMAT,
    'model': dataclasses.asdict(model),
    'step': step,
    'from': os.path.abspath(out_dir),
  }
  with open(os.path.join(to, META), 'w') as f:
    json.dump(meta, f, indent=2)
  count = sum(a.size for a in _leaves(params))
  return f"exported step {step} of {out_dir} to {to}: {count:,} parameters, the model's layout."


def load(path: str) -> tuple[ModelConfig, dict, int]:
  """(model config, params {'embed', 'layers', 'head'}, step) of an export."""
  import orbax.checkpoint as ocp

  with open(os.path.join(path, META)) as f:
    meta = json.load(f)
  if meta.get('format') != FORMAT:
    raise CheckpointError(
      f'{path} holds an export of format {meta.get("format")!r}, not {FORMAT!r}; export the run '
      'again with this version.'
    )
  with ocp.StandardCheckpointer() as reader:
    params = reader.restore(os.path.abspath(os.path.join(path, PARAMS)))
  return ModelConfig(**meta['model']), params, meta['step']


def load_run(
  out_dir: str, step: int | None = None, doing: str = 'sampling'
) -> tuple[ModelConfig, dict, int]:
  """(model config, unstaged params {'embed','layers','head'}, step) of a run's checkpoint (the
  step asked for, or the newest readable one), any model, whatever schedule trained it."""
  from ouroboros_jax.models import partition
  from ouroboros_jax.training import checkpoint, config, relayout

  if checkpoint.latest_step(out_dir) is None:
    raise checkpoint.CheckpointError(
      f'no checkpoint in {checkpoint.checkpoint_dir(out_dir)}; pass --ckpt the OUT directory '
      'of a training run.'
    )
  manager = checkpoint.make_manager(out_dir, read_only=True)
  try:
    # The step asked for, or the newest checkpoint that reads back whole, found and reported
    # as `train --resume` finds it (warnings on stderr, the same error when none reads).
    (meta, staged_params), step, unreadable = checkpoint.newest_readable(
      manager,
      lambda s: (
        checkpoint.read_meta(manager, s),
        checkpoint.restore_params_single_device(manager, s),
      ),
      step=step,
      step_flag='--step',
    )
    if unreadable:
      checkpoint.warn(f'{doing} from step {step}, the newest readable checkpoint.')
  finally:
    manager.close()
  cfg = config.TrainConfig.from_dict(meta['config'])
  return cfg.model, partition.from_staged(staged_params, relayout.stored_layers(meta)), step


def _leaves(tree):
  import jax

  return jax.tree.leaves(tree)
