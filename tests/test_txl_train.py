"""Transformer-XL runs end to end: word-level data with perplexity, evaluation with a memory."""

from __future__ import annotations

import json
import math

import numpy as np

from ouroboros_jax import data
from ouroboros_jax.training import field_flags, loop, presets


def _wikitext(tmp_path, words=400, seed=0):
  """A WikiText-shaped directory of random sentences over a 30-word vocabulary."""
  rng = np.random.default_rng(seed)
  vocab = [f'w{i}' for i in range(30)]
  directory = tmp_path / 'wikitext-103'
  directory.mkdir()
  for split, n in (('train', 10 * words), ('validation', words), ('test', words)):
    lines = [' '.join(rng.choice(vocab, 12)) for _ in range(n // 12)]
    (directory / data.WIKITEXT_FILES[split]).write_text('\n'.join(lines) + '\n', encoding='utf-8')
  return directory


def _txl_config(tmp_path, **values):
  base = dict(
    d_model=32, num_heads=2, num_layers=2, d_ff=64, seq_len=8, mem_len=8, batch_size=4,
    steps=3, eval_every=3, eval_batches=2, log_every=1, checkpoint_every=3, warmup_steps=1,
    out=str(tmp_path / 'run'),
  )  # fmt: skip
  return field_flags.override(presets.get_preset('txl-tiny'), {**base, **values})


def test_word_level_run_reports_perplexity(tmp_path):
  directory = _wikitext(tmp_path)
  vocab_size = data.corpus_info(f'wikitext103:{directory}').vocab_size
  cfg = _txl_config(tmp_path, data=f'wikitext103:{directory}', vocab_size=vocab_size)
  assert cfg.segment_order
  summary = loop.train(cfg, quiet=True)
  # exp and log in float64 of float32-rounded summaries: rel 1e-6.
  assert math.isclose(summary['val_ppl'], math.exp(summary['val_bpb'] * math.log(2)), rel_tol=1e-6)
  assert 1 < summary['val_ppl'] < 2 * vocab_size  # a loss per word, not per byte
  with open(tmp_path / 'run' / 'metrics.jsonl') as f:
    rows = [json.loads(line) for line in f]
  evaluation = [r for r in rows if r['split'] == 'validation']
  assert evaluation and all(math.isclose(r['ppl'], math.exp(r['loss'])) for r in evaluation)


def test_evaluation_carries_a_memory_of_its_own_length(tmp_path, prepared_data_dir):
  cfg = _txl_config(tmp_path, data_dir=prepared_data_dir, eval_mem_len=16)
  schedule, params, _ = loop.build(cfg)
  splits = data.load_splits('default', data_dir=prepared_data_dir)
  longer = loop.evaluate(schedule, params, splits['validation'], cfg, 3)
  none = field_flags.override(cfg, {'eval_mem_len': 0})
  without = loop.evaluate(schedule, params, splits['validation'], none, 3)
  assert math.isfinite(longer) and math.isfinite(without)
  assert abs(longer - without) > 1e-4  # the memory is read
