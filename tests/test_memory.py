"""Per-device memory of the stash modes, from the compiled step."""

from __future__ import annotations

from ouroboros_jax.models import model as transformer
from ouroboros_jax.perf import memory
from ouroboros_jax.schedules import ScheduleConfig
from ouroboros_jax.schedules.compensation import Compensation


def test_replay_ring_is_inputs_only_and_graph_ring_is_larger():
  cfg = transformer.ModelConfig(d_model=32, num_heads=2, num_layers=4, d_ff=64, seq_len=16)
  batch, stages = 4, 2
  replay = memory.memory_report(
    cfg,
    ScheduleConfig(
      name='ouroboros', compensation=Compensation(), num_stages=stages, stash='replay'
    ).resolve('cpu', batch),
    batch,
    (2, 2),
  )
  graph = memory.memory_report(
    cfg,
    ScheduleConfig(
      name='ouroboros',
      compensation=Compensation(),
      num_stages=stages,
      stash='graph',
      stash_policy='all',
    ).resolve('cpu', batch),
    batch,
    (2, 2),
  )
  depth = stages + 1
  activation = batch * cfg.seq_len * cfg.d_model * 4
  tokens = batch * cfg.seq_len * 4
  window = 2 * 4  # [first, end): the items the ring takes, two int32
  # replay keeps G+1 inputs, token ids and targets per device, plus the in-flight error gradient
  assert replay['ring_bytes'] == depth * (activation + 2 * tokens) + activation + window
  # graph keeps every residual of two layers per slot: many activations' worth
  assert graph['ring_bytes'] > 5 * replay['ring_bytes']
  assert replay['params_bytes'] == graph['params_bytes']
  if 'temp_bytes' in graph:
    assert graph['argument_bytes'] > replay['argument_bytes']
  text = memory.format_table([replay, graph])
  assert 'replay' in text and 'graph' in text
