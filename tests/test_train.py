"""The training loop, its metrics, checkpoints and exact resume (tiny models, CPU)."""

from __future__ import annotations

import json
import math
import os
import pathlib
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

from ouroboros_jax import cli_parsers, data, placement, staged
from ouroboros_jax.errors import ConfigError
from ouroboros_jax.training import (
  checkpoint,
  config,
  field_flags,
  loop,
  metrics,
  presets,
  resume,
  sample,
)

from helpers import assert_trees_equal, host_tree, restore_run, tiny_config, unfinish

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent

METRIC_KEYS = {'step', 'split', 'loss', 'bpb', 'tokens_per_s', 'wall_s'}


def read_rows(out) -> list[dict]:
  with open(os.path.join(out, 'metrics.jsonl')) as f:
    return [json.loads(line) for line in f]


@pytest.fixture(scope='module')
def short_run(tmp_path_factory, prepared_data_dir):
  """100 steps of a tiny model; the state after the last step is kept for comparisons."""
  out = tmp_path_factory.mktemp('short_run')
  cfg = tiny_config(out, prepared_data_dir, steps=100, eval_every=25, checkpoint_every=50)
  final = {}

  def keep_last(step, state):
    if step == cfg.steps:
      final['state'] = host_tree(state)

  summary = loop.train(cfg, quiet=True, on_step=keep_last)
  return cfg, summary, final['state']


def test_short_run_lowers_validation_loss(short_run):
  cfg, summary, _ = short_run
  rows = read_rows(cfg.out_dir)
  val = [r for r in rows if r['split'] == 'validation']
  assert [r['step'] for r in val] == [25, 50, 75, 100]
  initial = rows[0]['loss']  # step 1's loss: the initial parameters, ~ln 256
  assert rows[0]['step'] == 1 and initial > 0.95 * math.log(256)
  assert val[-1]['loss'] < initial - 2.0
  assert val[-1]['loss'] < val[0]['loss']
  assert summary['val_bpb'] == pytest.approx(val[-1]['bpb'])
  assert summary['step'] == 100 and summary['tokens_per_s'] > 0 and summary['compile_s'] > 0


def test_the_final_test_evaluation_reads_test_batches_of_the_split(short_run):
  """--test-batches N: the test row is the mean loss of the split's first N batches (the tests
  run with N = 2; the default, None, reads the whole split)."""
  cfg, summary, state = short_run
  assert cfg.test_batches == 2 and config.TrainConfig().test_batches is None
  schedule, _, _ = loop.build(cfg.resolved())
  splits, _ = loop.open_data(cfg)
  shape = dict(seq_len=cfg.model.seq_len, batch_size=cfg.batch_size)
  assert len(list(data.eval_batches(splits['test'], **shape, max_batches=None))) > 2
  loss = loop.evaluate(schedule, state['params'], splits['test'], cfg, 2)
  # The same program on the same parameters and batches: the same float32 losses and mean.
  assert summary['test_bpb'] == pytest.approx(loss / math.log(2), rel=1e-12)
  with pytest.raises(ConfigError, match='test_batches'):
    field_flags.override(cfg, {'test_batches': 0}).validate()


def test_metrics_rows_and_files(short_run):
  cfg, summary, _ = short_run
  rows = read_rows(cfg.out_dir)
  assert {r['split'] for r in rows} == {'train', 'validation', 'test'}
  for r in rows:
    assert METRIC_KEYS <= set(r), r
    # bpb = loss / ln 2 in float64: exact to rel 1e-12.
    assert r['bpb'] == pytest.approx(r['loss'] / math.log(2), rel=1e-12)
    assert math.isfinite(r['loss']) and r['wall_s'] >= 0
  train_rows = [r for r in rows if r['split'] == 'train']
  assert [r['step'] for r in train_rows] == list(range(1, 101))
  # backprop reports the loss of the batch it just consumed: batch t is consumed by step t + 1.
  assert all(r['loss_batch'] == r['step'] - 1 for r in train_rows)
  test_rows = [r for r in rows if r['split'] == 'test']
  assert len(test_rows) == 1 and summary['test_bpb'] == pytest.approx(test_rows[0]['bpb'])
  events = [f for f in os.listdir(os.path.join(cfg.out_dir, 'tb')) if 'tfevents' in f]
  assert events and os.path.getsize(os.path.join(cfg.out_dir, 'tb', events[0])) > 0
  with open(os.path.join(cfg.out_dir, 'config.json')) as f:
    # The resolved run: every auto spelled out (`TrainConfig.resolved`), the balanced layer
    # split written out.
    saved = config.TrainConfig.from_dict(json.load(f))
    assert saved == field_flags.override(cfg.resolved('cpu'), {'layers_per_stage': '2'})
    assert 'auto' not in {saved.optimizer, saved.compensation, saved.model.attention}
  with open(os.path.join(cfg.out_dir, 'summary.json')) as f:
    assert json.load(f)['val_bpb'] == summary['val_bpb']


def test_checkpoint_round_trip(short_run):
  cfg, summary, final_state = short_run
  assert checkpoint.latest_step(cfg.out_dir) == 100
  schedule, params, layers_per_stage = loop.build(cfg)
  fresh = placement.onto_mesh(schedule.init(params, loop.example_batch(cfg)), schedule.mesh)
  manager = checkpoint.make_manager(cfg.out_dir, read_only=True)
  try:
    assert manager.all_steps() == [50, 100]
  finally:
    manager.close()
  state, data_state, meta = restore_run(cfg)
  assert isinstance(state, staged.TrainState)
  assert int(state.step) == 100
  assert_trees_equal(host_tree(state), final_state)
  # The restored leaves sit where a fresh state of the schedule would.
  for restored, new in zip(jax.tree.leaves(state), jax.tree.leaves(fresh)):
    assert restored.sharding.is_equivalent_to(new.sharding, restored.ndim)
  # The data position: a fresh iterator advanced by 100 batches is where the saved one is.
  splits = data.load_splits(cfg.data, data_dir=cfg.data_dir)
  it = data.make_train_iterator(
    splits['train'], seq_len=cfg.model.seq_len, batch_size=cfg.batch_size, seed=cfg.seed
  )
  crc = 0
  for _ in range(100):
    crc = metrics.batch_crc32(next(it), crc)
  assert data_state == {'iterator': it.get_state(), 'crc32': crc}
  assert crc == summary['data_crc32']
  assert meta['layers_per_stage'] == list(layers_per_stage)
  assert meta['schedule'] == 'backprop' and meta['stages'] == 1
  assert config.TrainConfig.from_dict(meta['config']) == field_flags.override(
    cfg.resolved('cpu'), {'layers_per_stage': '2'}
  )


def test_interrupted_save_is_never_the_latest(short_run, tmp_path):
  cfg, _, _ = short_run
  out = tmp_path / 'run'
  shutil.copytree(cfg.out_dir, out)
  ckpts = out / 'checkpoints'
  # What an interrupted save leaves: Orbax writes '<step>.orbax-checkpoint-tmp*' and renames it
  # to '<step>' only once it is complete.
  partial = ckpts / '150.orbax-checkpoint-tmp'
  shutil.copytree(ckpts / '100', partial)
  shutil.rmtree(partial / 'state')
  assert checkpoint.latest_step(out) == 100
  resumed = field_flags.override(cfg, {'out': os.fspath(out), 'steps': 104})
  summary = loop.train(resumed, resume=True, quiet=True)
  assert summary['step'] == 104
  assert checkpoint.latest_step(out) == 104
  assert not partial.exists()  # the writer cleaned it up


def _run_cli(*args, timeout=120):
  return subprocess.run(
    [sys.executable, '-m', 'ouroboros_jax', *args],
    cwd=REPO_ROOT,
    capture_output=True,
    text=True,
    timeout=timeout,
  )


def test_resume_is_bitwise_identical_to_an_uninterrupted_run(tmp_path, prepared_data_dir):
  steps = 20
  straight = tiny_config(
    tmp_path / 'a', prepared_data_dir, steps=steps, checkpoint_every=10, eval_every=10, dropout=0.1
  )
  summary_a = loop.train(straight, quiet=True)

  # Run B stops (like a crash) two steps after its step-10 checkpoint...
  cfg_b = field_flags.override(straight, {'out': os.fspath(tmp_path / 'b')})

  def crash(step, state):
    if step == 12:
      raise KeyboardInterrupt

  with pytest.raises(KeyboardInterrupt):
    loop.train(cfg_b, quiet=True, on_step=crash)
  assert checkpoint.latest_step(cfg_b.out_dir) == 10
  # ... and a new process resumes it from the command line.
  assert (
    cli_parsers.config_from_args(
      cli_parsers.make_parser().parse_args(['train', *cli_parsers.to_flags(cfg_b)])
    )
    == cfg_b
  )
  result = _run_cli('train', '--resume', '--quiet', *cli_parsers.to_flags(cfg_b))
  assert result.returncode == 0, result.stderr
  assert result.stdout.strip().splitlines()[-1].startswith('done: val bpb')

  def final_state(out):
    manager = checkpoint.make_manager(out, read_only=True)
    try:
      assert manager.latest_step() == steps
      return checkpoint.restore_single_device(manager)
    finally:
      manager.close()

  assert_trees_equal(final_state(straight.out_dir), final_state(cfg_b.out_dir))
  # Same batches in the same order, and the same loss at every step.
  rows_a = [
    (r['step'], r['data_crc32'], r['loss'])
    for r in read_rows(straight.out_dir)
    if r['split'] == 'train'
  ]
  rows_b = [
    (r['step'], r['data_crc32'], r['loss'])
    for r in read_rows(cfg_b.out_dir)
    if r['split'] == 'train'
  ]
  # Every step logged once (the resume dropped the rows of the crashed steps 11-12), with the
  # same loss and the same data fingerprint as the uninterrupted run.
  assert rows_b == rows_a
  assert [r[0] for r in rows_a] == list(range(1, steps + 1))
  with open(os.path.join(cfg_b.out_dir, 'summary.json')) as f:
    summary_b = json.load(f)
  assert summary_b['data_crc32'] == summary_a['data_crc32']
  assert summary_b['val_bpb'] == summary_a['val_bpb']
  assert summary_b['test_bpb'] == summary_a['test_bpb']


def test_resume_with_different_flags_names_them(short_run, tmp_path):
  cfg, _, _ = short_run
  other = field_flags.override(cfg, {'d_model': 64, 'steps': 120})
  with pytest.raises(checkpoint.CheckpointError, match='--d-model 32.*--d-model 64'):
    loop.train(other, resume=True, quiet=True)
  # What a graph stash keeps fixes the shape of Ouroboros' saved ring buffers ...
  ring = field_flags.override(cfg, {'schedule': 'ouroboros', 'stages': 2})
  layers = ring.plans.layers_per_stage
  other = field_flags.override(ring, {'stash_policy': 'dots'})
  with pytest.raises(
    checkpoint.CheckpointError, match='--stash-policy nothing.*--stash-policy dots'
  ):
    resume.check_resumable(resume.run_meta(ring, layers), other, layers, 'OUT')
  # ... and nothing of backprop's, whose recomputation changes no state: it may change on resume.
  changed = resume.check_resumable(
    resume.run_meta(cfg, (cfg.model.num_layers,)),
    field_flags.override(cfg, {'stash_policy': 'dots'}),
    (cfg.model.num_layers,),
    'OUT',
  )
  assert changed == ['--stash-policy all -> dots']
  # an unset setting reads as the flag spells it, not as Python's None
  momentum = resume.check_resumable(
    resume.run_meta(cfg, (cfg.model.num_layers,)),
    field_flags.override(cfg, {'momentum': 0.5}),
    (cfg.model.num_layers,),
    'OUT',
  )
  assert momentum == ['--momentum none -> 0.5']


def test_fresh_run_refuses_an_out_dir_with_checkpoints(short_run):
  cfg, _, _ = short_run
  with pytest.raises(checkpoint.CheckpointError, match='--resume'):
    loop.train(cfg, quiet=True)


def test_fresh_run_refuses_an_out_dir_with_an_earlier_runs_metrics(tmp_path):
  """A run that stopped before its first checkpoint leaves metrics.jsonl and config.json; a new
  run there would overwrite them without a word. An empty or new OUT, or one whose run logged
  nothing, is fine."""
  from ouroboros_jax.training import resume

  out = tmp_path / 'run'
  cfg = field_flags.override(presets.get_preset('tiny'), {'out': os.fspath(out)})
  resume.check_out_dir(cfg, resume=False)  # not there yet
  out.mkdir()
  resume.check_out_dir(cfg, resume=False)  # empty
  (out / 'config.json').write_text(json.dumps(cfg.to_dict()))  # what a run writes first
  (out / 'metrics.jsonl').write_text('')
  resume.check_out_dir(cfg, resume=False)  # a run that logged nothing: nothing to lose
  (out / 'metrics.jsonl').write_text('{"step": 20, "split": "train", "loss": 3.1}\n')
  with pytest.raises(
    checkpoint.CheckpointError,
    match=r"holds an earlier run's metrics.jsonl and config.json but no checkpoint.*"
    r'choose another --out, or remove them',
  ):
    resume.check_out_dir(cfg, resume=False)


def test_resume_compares_what_the_settings_resolve_to_not_their_spelling():
  """A run saved with --optimizer auto --compensation auto (the recipe: muon, predict,dc) resumes
  with the explicit spelling; a real change is still refused. An Ouroboros run saved before its
  ring had micro-batches (it recorded --microbatches 4 and had no --stash-memory), or while its
  stash kept whole steps, has another ring layout: it is refused in one line that says so."""
  from ouroboros_jax.training import resume

  auto = field_flags.override(presets.get_preset('tiny'), {'schedule': 'ouroboros', 'stages': 2})
  saved = resume.run_meta(auto, (1, 1))
  explicit = field_flags.override(auto, {'optimizer': 'muon', 'compensation': 'dc,predict'})
  assert resume.check_resumable(saved, explicit, (1, 1), 'OUT') == []
  old = json.loads(json.dumps(saved))
  old['config']['schedule']['microbatches'] = 4  # what an ouroboros run recorded before
  del old['config']['schedule']['stash_memory']
  with pytest.raises(checkpoint.CheckpointError, match='before micro-batches.*another --out'):
    resume.check_resumable(old, auto, (1, 1), 'OUT')
  # ... and one saved while its stash kept whole steps (before micro-batch slots, issue 58)
  steps = {k: v for k, v in saved.items() if k != 'ring_layout'}
  with pytest.raises(checkpoint.CheckpointError, match='kept whole steps.*another --out'):
    resume.check_resumable(steps, auto, (1, 1), 'OUT')
  # ... and one whose host memory held the forward's weights beside the stash (before they moved
  # to the device: XLA's TPU compiler could not squeeze them there in bf16)
  host = field_flags.override(auto, {'stash_memory': 'pinned_host'})
  before = {k: v for k, v in resume.run_meta(host, (1, 1)).items() if k != 'host_layout'}
  with pytest.raises(checkpoint.CheckpointError, match="held the forward's weights.*another --out"):
    resume.check_resumable(before, host, (1, 1), 'OUT')
  assert resume.check_resumable(resume.run_meta(host, (1, 1)), host, (1, 1), 'OUT') == []
  assert resume.check_resumable(before | {'config': saved['config']}, auto, (1, 1), 'OUT') == []
  backprop = field_flags.override(presets.get_preset('tiny'), {})  # no ring: nothing to refuse
  assert (
    resume.check_resumable(
      {k: v for k, v in resume.run_meta(backprop, (2,)).items() if k != 'ring_layout'},
      backprop,
      (2,),
      'OUT',
    )
    == []
  )
  with pytest.raises(
    checkpoint.CheckpointError, match='--optimizer muon but the flags give --optimizer adamw'
  ):
    resume.check_resumable(saved, field_flags.override(auto, {'optimizer': 'adamw'}), (1, 1), 'OUT')
  # --flow auto of the recipe on CPU: streamed, 2 micro-batches (both gaps one update)
  streamed = field_flags.override(auto, {'flow': 'stream', 'microbatches': 2})
  assert resume.check_resumable(saved, streamed, (1, 1), 'OUT') == []
  # a run saved before --flow ran as one batch: resumed with today's defaults it is refused,
  # naming the flags that resume it
  before = json.loads(json.dumps(saved))
  del before['config']['schedule']['flow']
  with pytest.raises(
    checkpoint.CheckpointError,
    match='made with --flow batch --microbatches 1 but the flags give --flow stream '
    '--microbatches 2',
  ):
    resume.check_resumable(before, auto, (1, 1), 'OUT')
  as_before = field_flags.override(auto, {'flow': 'batch'})
  assert resume.check_resumable(before, as_before, (1, 1), 'OUT') == []


def test_sample_generates_the_requested_bytes(short_run):
  cfg, _, _ = short_run
  model_cfg, params, step = sample.load(cfg.out_dir)
  assert model_cfg == cfg.resolved('cpu').model and step == 100  # as the run resolved it
  # A prompt longer than the window makes the window slide.
  prompt = b'ROMEO:\n' * 12
  a = sample.generate(model_cfg, params, prompt, length=40, temperature=0.8, seed=1)
  b = sample.generate(model_cfg, params, prompt, length=40, temperature=0.8, seed=1)
  c = sample.generate(model_cfg, params, prompt, length=40, temperature=0.8, seed=2)
  assert len(a) == 40 and a == b and a != c
  greedy = sample.generate(model_cfg, params, b'', length=10, temperature=0.0)
  assert greedy == sample.generate(model_cfg, params, b'', length=10, temperature=0.0, seed=5)


def test_sampling_matches_the_models_own_next_byte(short_run):
  """Greedy generation equals argmax of the full model's logits, byte by byte."""
  cfg, _, _ = short_run
  model_cfg, params, _ = sample.load(cfg.out_dir)
  prompt = b'KING HENRY:\n'
  out = sample.generate(model_cfg, params, prompt, length=5, temperature=0.0)
  from ouroboros_jax.models import model as transformer

  @jax.jit
  def logits_L(tokens_L):  # causal: zeros after the last real token change nothing before it
    x = transformer.embed(model_cfg, params['embed'], tokens_L[None])
    x = transformer.layers(model_cfg, params['layers'], x)
    return transformer.logits(model_cfg, params['head'], params['embed'], x)[0]

  tokens = list(prompt)
  for _ in range(5):
    padded = np.zeros(model_cfg.seq_len, np.int32)
    padded[: len(tokens)] = tokens
    tokens.append(int(np.argmax(np.asarray(logits_L(padded)[len(tokens) - 1]))))
  assert out == bytes(tokens[len(prompt) :])


def test_ouroboros_state_round_trips_sharded(tmp_path, prepared_data_dir):
  """A 2-stage Ouroboros run: its sharded TrainState (ring buffers included) checkpoints and
  restores onto the same devices, and the run resumes."""
  cfg = tiny_config(
    tmp_path / 'ring',
    prepared_data_dir,
    steps=6,
    schedule='ouroboros',
    stages=2,
    checkpoint_every=3,
    eval_every=3,
    log_every=3,
  )
  final = {}
  loop.train(cfg, quiet=True, on_step=lambda s, st: final.update(state=host_tree(st)))
  schedule, params, _ = loop.build(cfg)
  fresh = placement.onto_mesh(schedule.init(params, loop.example_batch(cfg)), schedule.mesh)
  state, _, _ = restore_run(cfg)
  assert jax.tree.leaves(state.ring)
  assert_trees_equal(host_tree(state), final['state'])
  for restored, new in zip(jax.tree.leaves(state), jax.tree.leaves(fresh)):
    assert restored.sharding == new.sharding
  summary = loop.train(field_flags.override(cfg, {'steps': 8}), resume=True, quiet=True)
  assert summary['step'] == 8 and math.isfinite(summary['val_bpb'])


# ----------------------------------------------------------------------------- damaged runs


@pytest.fixture(scope='module')
def three_checkpoints(tmp_path_factory, prepared_data_dir):
  """30 steps with checkpoints at 10, 20 and 30; the state of step 30 as saved."""
  out = tmp_path_factory.mktemp('three_checkpoints')
  cfg = tiny_config(
    out, prepared_data_dir, steps=30, checkpoint_every=10, eval_every=30, log_every=5
  )
  loop.train(cfg, quiet=True)
  manager = checkpoint.make_manager(out, read_only=True)
  try:
    assert sorted(manager.all_steps()) == [10, 20, 30]
    return cfg, host_tree(checkpoint.restore_single_device(manager, 30))
  finally:
    manager.close()


def _damage(step_dir: pathlib.Path, how: str) -> None:
  state = step_dir / 'state'
  data_files = [p for p in state.rglob('*') if p.is_file() and p.parent.name == 'd']
  if how == 'truncated':
    for path in data_files:
      with open(path, 'r+b') as f:
        f.truncate(path.stat().st_size // 2)
  elif how == 'flipped':  # Orbax reads these back without complaint: the checksum catches them
    for path in data_files:
      raw = bytearray(path.read_bytes())
      for i in range(len(raw) // 3, len(raw) // 3 + 16):
        raw[i] ^= 0xFF
      path.write_bytes(bytes(raw))
  elif how == 'no_manifest':
    for path in state.rglob('manifest.ocdbt'):
      path.unlink()
  elif how == 'empty_metadata':
    (state / '_METADATA').write_text('')
  elif how == 'empty_meta':
    (step_dir / 'meta' / 'metadata').write_text('')


@pytest.mark.parametrize(
  'how', ['truncated', 'flipped', 'no_manifest', 'empty_metadata', 'empty_meta', 'resume_from']
)
def test_a_damaged_checkpoint_falls_back_and_resumes_exactly(
  three_checkpoints, tmp_path, how, capsys
):
  cfg, saved_30 = three_checkpoints
  out = tmp_path / 'run'
  shutil.copytree(cfg.out_dir, out)
  unfinish(out)
  with open(out / 'metrics.jsonl', 'a') as f:
    f.write('{"step": 31, "split": "tra')  # a crash in the middle of a metrics row
  resumed = field_flags.override(cfg, {'out': os.fspath(out)})
  if how == 'resume_from':
    loop.train(resumed, resume_from=10, quiet=True)
    moved = [20, 30]
  else:
    _damage(out / 'checkpoints' / '30', how)
    loop.train(resumed, resume=True, quiet=True)
    moved = [30]
    said = capsys.readouterr()
    assert 'warning: checkpoint step 30 in ' in said.err and 'warning' not in said.out
    assert 'resuming from step 20 in ' in said.out
    assert ', the newest readable checkpoint' in said.out
    assert 'dropped its torn last line' in said.out
  # Nothing deleted: the skipped checkpoints are set aside with the metrics rows they belong to,
  # the run wrote its own again...
  aside = sorted(os.listdir(out / checkpoint.SET_ASIDE))
  assert aside == [str(s) for s in moved] + [f'metrics-until-step-{moved[-1]}.jsonl']
  manager = checkpoint.make_manager(out, read_only=True)
  try:
    assert sorted(manager.all_steps()) == [10, 20, 30]
    # ... and its step 30 equals the uninterrupted run's, bit for bit.
    assert_trees_equal(host_tree(checkpoint.restore_single_device(manager, 30)), saved_30)
  finally:
    manager.close()
  rows = read_rows(out)  # every line parses again
  train_steps = [r['step'] for r in rows if r['split'] == 'train']
  assert train_steps == sorted(set(train_steps)) and train_steps[-1] == 30


def test_no_readable_checkpoint_is_one_clear_error(three_checkpoints, tmp_path):
  cfg, _ = three_checkpoints
  out = tmp_path / 'run'
  shutil.copytree(cfg.out_dir, out)
  unfinish(out)  # an unfinished run (a finished one has nothing to resume)
  for step in (10, 20, 30):
    _damage(out / 'checkpoints' / str(step), 'empty_meta')
  with pytest.raises(
    checkpoint.CorruptCheckpointError, match=r'no readable checkpoint .* steps \[10, 20, 30\]'
  ):
    loop.train(field_flags.override(cfg, {'out': os.fspath(out)}), resume=True, quiet=True)
  assert sorted(os.listdir(out / 'checkpoints')) == ['10', '20', '30']  # nothing moved
  with pytest.raises(checkpoint.CheckpointError, match='--resume-from 25: no checkpoint'):
    loop.train(field_flags.override(cfg, {'out': os.fspath(out)}), resume_from=25, quiet=True)
