"""`ouroboros export` (issue 63): a run's model as one plain parameter tree that Orbax alone reads
and the model's own forward takes, giving the library's evaluation; `sample` reads it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import orbax.checkpoint as ocp
import pytest

from ouroboros_jax.models import model as transformer
from ouroboros_jax.training import assemble, loop

from helpers import (
  REPO_ROOT,
  assert_one_line_error,
  random_batches,
  restore_run,
  run_cli,
  tiny_config,
)


@pytest.fixture(scope='module')
def pipelined_run(tmp_path_factory, prepared_data_dir):
  """4 steps of 1F1B on 2 stages with uneven layers (2 + 1): a staged, padded layout."""
  out = tmp_path_factory.mktemp('run')
  cfg = tiny_config(
    out, prepared_data_dir, schedule='1f1b', stages=2, microbatches=2, num_layers=3,
    layers_per_stage='2,1', steps=4, checkpoint_every=4, eval_every=1000,
  )  # fmt: skip
  loop.train(cfg, quiet=True)
  return cfg


def test_the_models_own_forward_gives_the_librarys_evaluation(pipelined_run, tmp_path):
  to = tmp_path / 'exported'
  result = run_cli('export', '--ckpt', pipelined_run.out_dir, '--to', to)
  assert result.returncode == 0, result.stderr
  assert result.stdout.strip().startswith(f'exported step 4 of {pipelined_run.out_dir}')
  with ocp.StandardCheckpointer() as reader:  # Orbax alone, no ouroboros_jax in between
    params = reader.restore(os.fspath(to / 'params'))
  with open(to / 'export.json') as f:
    model_cfg = transformer.ModelConfig(**json.load(f)['model'])
  assert jax.tree.leaves(params['layers'])[0].shape[0] == 3  # every layer once, no padding
  schedule, _, _ = assemble.build(pipelined_run)
  staged_params = restore_run(pipelined_run)[0].params  # as the run lays it out
  batch = random_batches(1, batch=4, seq=model_cfg.seq_len)[0]
  library = float(schedule.evaluate(staged_params, batch))
  own, _ = transformer.loss_fn(model_cfg, params, batch)
  assert abs(float(own) - library) < 1e-5, (float(own), library)


def test_sample_reads_an_export_as_it_reads_the_run(pipelined_run, tmp_path):
  to = tmp_path / 'exported'
  assert run_cli('export', '--ckpt', pipelined_run.out_dir, '--to', to).returncode == 0
  flags = ['--length', '24', '--seed', '3', '--prompt', 'To be']
  sample = lambda ckpt: subprocess.run(  # bytes: an untrained model's are not UTF-8
    [sys.executable, '-m', 'ouroboros_jax', 'sample', '--ckpt', os.fspath(ckpt), *flags],
    cwd=REPO_ROOT, capture_output=True, timeout=90,
  )  # fmt: skip
  from_run, from_export = sample(pipelined_run.out_dir), sample(to)
  assert from_run.returncode == from_export.returncode == 0, from_export.stderr
  assert from_export.stdout == from_run.stdout and len(from_run.stdout) > 24


def test_an_export_never_overwrites(pipelined_run, tmp_path):
  to = tmp_path / 'taken'
  to.mkdir()
  (to / 'notes.txt').write_text('mine')
  result = run_cli('export', '--ckpt', pipelined_run.out_dir, '--to', to)
  assert_one_line_error(result, 2, f'--to {to} exists', 'name a new one')
  assert (to / 'notes.txt').read_text() == 'mine' and sorted(os.listdir(to)) == ['notes.txt']
