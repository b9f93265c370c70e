"""What several test files share: tiny models and batches, runs of a schedule, tree comparisons,
the CLI in a subprocess, a tiny training config."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ouroboros_jax import errors, staged
from ouroboros_jax.models import model as transformer
from ouroboros_jax.models import partition
from ouroboros_jax.schedules import build_schedule

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
BATCH, SEQ = 4, 8

# ----------------------------------------------------------------------------- models and batches


def random_batches(num, seed=0, batch=BATCH, seq=SEQ, vocab=256):
  rng = np.random.default_rng(seed)
  return [
    {
      'inputs': jnp.asarray(rng.integers(0, vocab, (batch, seq)), jnp.int32),
      'targets': jnp.asarray(rng.integers(0, vocab, (batch, seq)), jnp.int32),
    }
    for _ in range(num)
  ]


def tiny_transformer(
  num_stages, *, pre_ln=True, num_layers=None, dropout=0.0, layers_per_stage=None, **model
):
  """(StagedModel, staged params) of a 16-wide Transformer with at least 3 layers (`model`:
  other ModelConfig fields, e.g. arch='transformer-xl', mem_len=8, or other sizes)."""
  sizes = dict(d_model=16, num_heads=2, d_ff=32, seq_len=SEQ) | model
  cfg = transformer.ModelConfig(
    num_layers=num_layers or max(num_stages, 3), pre_ln=pre_ln, dropout=dropout, **sizes
  )
  layers_per_stage = layers_per_stage or partition.balance_layers(cfg, num_stages)
  params = partition.to_staged(transformer.init_params(cfg, jax.random.key(0)), layers_per_stage)
  return partition.transformer_stages(cfg, layers_per_stage), params


def adam(learning_rate=1e-2, **kw):
  # eps 1e-6, not 1e-8: a parameter whose exact gradient is zero (the attention key bias) gets
  # float-noise gradients of ~1e-10 that Adam would scale up to the learning rate, so two correct
  # implementations would drift apart by ~lr on it for no reason the test cares about.
  return staged.adamw(learning_rate, eps=1e-6, **kw)


def run_schedule(config, model, tx, params, batches, schedule=None):
  """(final state, losses) of `build_schedule(config, ...)` over the batches; of `schedule`, when
  the test has built it already (its step is then traced once, not once a build)."""
  schedule = schedule or build_schedule(config, model, tx)
  state = schedule.init(params, batches[0])
  losses = []
  for batch in batches:
    state, metrics = schedule.step(state, batch)
    losses.append(float(metrics['loss']))
  return state, losses


# ----------------------------------------------------------------------------- trees


def max_abs_diff(a, b):
  a, b = jax.device_get((a, b))  # the two may live on different meshes
  return max(jax.tree.leaves(jax.tree.map(lambda x, y: float(np.max(np.abs(x - y))), a, b)))


def host_tree(tree):
  """A TrainState or restored dict as a dict of numpy arrays (dataclass -> dict like Orbax)."""
  if isinstance(tree, staged.TrainState):
    tree = {
      'step': tree.step,
      'params': tree.params,
      'opt_state': tree.opt_state,
      'ring': tree.ring,
    }
  return jax.tree.map(np.asarray, jax.device_get(tree))


def assert_trees_equal(a, b):
  """Same structure, shapes, dtypes and every bit (and not two empty trees)."""
  assert jax.tree.leaves(a), 'an empty tree proves nothing'
  chex.assert_trees_all_equal_structs(a, b)
  chex.assert_trees_all_equal_shapes_and_dtypes(a, b)
  chex.assert_trees_all_equal(a, b)


# ----------------------------------------------------------------------------- experiments


def experiment(name: str):
  """experiments/NAME.py as the module NAME, loaded once (a script's own `import NAME` of another
  finds it; dataclasses look their module up while the file runs)."""
  if name not in sys.modules:
    spec = importlib.util.spec_from_file_location(name, REPO_ROOT / 'experiments' / f'{name}.py')
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
  return sys.modules[name]


# ----------------------------------------------------------------------------- the CLI


# A small model for the CLI tests' runs: a few seconds of training on 2 CPU cores.
SMALL_CLI = [
  '--d-model',
  '32',
  '--num-heads',
  '2',
  '--num-layers',
  '2',
  '--d-ff',
  '64',
  '--seq-len',
  '32',
  '--batch-size',
  '8',
  '--eval-batches',
  '2',
  '--test-batches',  # the final test evaluation: 2 batches, not the whole split
  '2',
  '--quiet',
]


def guide_block(name: str) -> str:
  """The Python of docs/guides/own_model.md's block between `<!-- NAME:begin -->` and
  `<!-- NAME:end -->` (the tests run the guide's examples as written)."""
  text = (REPO_ROOT / 'docs' / 'guides' / 'own_model.md').read_text()
  found = re.search(rf'<!-- {name}:begin -->\n```python\n(.*?)```\n<!-- {name}:end -->', text, re.S)
  assert found, f'the guide lost its {name} example'
  return found.group(1)


# (schedule, its ScheduleConfig fields, its stage groups): every exact schedule on 2 devices.
# gpipe, 1f1b and zb_h1 run one group per device; interleaved and zb_v two chunks per device,
# so 4 groups.
EXACT_ON_TWO_DEVICES = [
  ('backprop', {}, 2),
  ('model_parallel', {'num_stages': 2}, 2),
  ('gpipe', {'num_stages': 2, 'microbatches': 2}, 2),
  ('1f1b', {'num_stages': 2, 'microbatches': 2}, 2),
  ('zb_h1', {'num_stages': 2, 'microbatches': 2}, 2),
  ('interleaved', {'num_stages': 2, 'microbatches': 2}, 4),
  ('zb_v', {'num_stages': 2, 'microbatches': 2}, 4),
]


def run_cli(*args, timeout=90, **kwargs):
  return subprocess.run(
    [sys.executable, '-m', 'ouroboros_jax', *map(str, args)],
    cwd=REPO_ROOT,
    capture_output=True,
    text=True,
    timeout=timeout,
    **kwargs,
  )


def cli_message(error: errors.UserError) -> str:
  """A user error as the command line prints it: its config fields as their flags."""
  from ouroboros_jax.training import field_flags

  return errors.render(error.marked, field_flags.field_flag)


@contextlib.contextmanager
def raises_for_cli(pattern: str):
  """The block raises a ConfigError that, as the command line prints it, matches `pattern`,
  and that, raised to a Python caller, names no command-line flag."""
  with pytest.raises(errors.ConfigError) as info:
    yield info
  assert re.search(pattern, cli_message(info.value)), cli_message(info.value)
  assert not re.search(r'(?<![\w-])--[a-z]', str(info.value)), str(info.value)


def assert_one_line_error(result, code: int, *words: str):
  assert result.returncode == code, (result.returncode, result.stderr)
  assert 'Traceback' not in result.stderr
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1, result.stderr
  assert lines[0].startswith('error: ')
  for word in words:
    assert word in lines[0], (word, lines[0])


# ----------------------------------------------------------------------------- training runs

TINY = dict(
  d_model=32,
  num_heads=2,
  num_layers=2,
  d_ff=128,
  seq_len=64,
  batch_size=16,
  learning_rate=1e-2,
  warmup_steps=5,
  eval_batches=4,
  # The run's final test evaluation reads 2 batches, not the whole test split (~260 batches of
  # the default corpus at this shape: most of a short run's time on simulated devices).
  test_batches=2,
  log_every=1,
)


def tiny_config(out, prepared_data_dir, **overrides):
  """The tiny preset made smaller, training on the prepared default corpus into `out`."""
  from ouroboros_jax.training import field_flags, presets

  values = dict(TINY, data_dir=prepared_data_dir, out=os.fspath(out))
  values.update(overrides)
  return field_flags.override(presets.get_preset('tiny'), values)


def save_and_restore(schedule, state, params, example_batch, directory, data_state):
  """A state through an Orbax checkpoint and back, restored onto the shapes `schedule.init`
  gives: (the restored state, the data state saved with it)."""
  from ouroboros_jax.training import checkpoint

  manager = checkpoint.make_manager(str(directory))
  checkpoint.save(manager, state, data_state, {'schedule': schedule.name})
  manager.wait_until_finished()
  abstract = checkpoint.abstract_like(schedule.init(params, example_batch))
  restored, restored_data, _ = checkpoint.restore(manager, abstract)
  manager.close()
  return restored, restored_data


def restore_run(cfg, step=None):
  """(state, data_state, meta) of a run's checkpoint (the newest, or `step`), restored as a
  resume restores it: from the per-layer form onto the run's own layout and shardings."""
  from ouroboros_jax import placement
  from ouroboros_jax.training import checkpoint, loop, resume

  schedule, params, layers = loop.build(cfg)
  fresh = placement.onto_mesh(schedule.init(params, loop.example_batch(cfg)), schedule.mesh)
  manager = checkpoint.make_manager(cfg.out_dir, read_only=True)
  metas = []

  def move(meta):  # with --fresh-optimizer, the fresh state's optimizer state, as the loop's
    metas.append(meta)
    return resume.move_for(meta, cfg, tuple(layers), fresh.opt_state)

  try:
    target = checkpoint.abstract_like(fresh)
    state, data_state, _, _ = checkpoint.restore_newest(manager, target, move, step=step)
  finally:
    manager.close()
  return state, data_state, metas[-1]


def straight_and_resumed(straight, out, resume_at: int):
  """Trains `straight`, copies its directory to `out` as a run stopped after its step-`resume_at`
  checkpoint would leave it, and resumes that copy from there to the end; returns (the config of
  the resumed run, the final saved states of both runs as host trees). (A copy resumed, not a
  second run stopped by a crash: one training fewer, 1/3 of such a test. Stopping a run mid-way
  is tests/test_cli.py's and tests/test_train.py's.)"""
  from ouroboros_jax.training import checkpoint, field_flags, loop

  loop.train(straight, quiet=True)
  shutil.copytree(straight.out_dir, out)
  unfinish(out)
  stopped = field_flags.override(straight, {'out': os.fspath(out)})
  loop.train(stopped, quiet=True, resume_from=resume_at)

  def final(out_dir):
    manager = checkpoint.make_manager(out_dir, read_only=True)
    try:
      return host_tree(checkpoint.restore_single_device(manager))
    finally:
      manager.close()

  return stopped, final(straight.out_dir), final(stopped.out_dir)


def unfinish(out) -> None:
  """OUT as a run stopped before its end leaves it: no summary.json, no final test row."""
  out = pathlib.Path(out)
  os.remove(out / 'summary.json')
  rows = [json.loads(line) for line in (out / 'metrics.jsonl').read_text().splitlines() if line]
  kept = ''.join(json.dumps(r) + '\n' for r in rows if r.get('split') != 'test')
  (out / 'metrics.jsonl').write_text(kept)
