"""--shard-update (ZeRO-1): the optimizer state and its update split over the data replicas, the
weights whole on each. The parameters equal the run without it (and backprop's where the
schedule is exact), the state per device falls, and Muon orthogonalises a share of the layers
on each replica.

ATOL as tests/test_fsdp.py: float32 after 3 steps, the sums split in another order."""

from __future__ import annotations

import dataclasses

import jax
import pytest

from ouroboros_jax import ConfigError, ScheduleConfig, build_schedule, optimizers
from ouroboros_jax.perf import compile as compile_lib
from ouroboros_jax.placement import DATA

from helpers import adam, max_abs_diff, random_batches, run_schedule, tiny_transformer

ATOL = 2e-5


def _muon():
  return optimizers.make_optimizer('muon', 1e-2, muon_learning_rate=0.02)


def _bytes_on_first_device(tree) -> int:
  return sum(
    s.data.nbytes
    for leaf in jax.tree.leaves(tree)
    for s in leaf.addressable_shards
    if s.device == jax.devices()[0]
  )


@pytest.mark.parametrize(
  'config, tx',
  [
    (ScheduleConfig(name='1f1b', num_stages=2, data_parallel=2, microbatches=2), _muon),
    (ScheduleConfig(name='zb_h1', num_stages=2, data_parallel=2, microbatches=2), adam),
    (ScheduleConfig(name='data_parallel', data_parallel=4), _muon),
  ],
  ids=['1f1b G=2 D=2 muon', 'zb_h1 G=2 D=2 adamw', 'data_parallel D=4 muon'],
)
def test_shard_update_gives_backprops_parameters_on_a_share_of_the_state(config, tx):
  """Three steps with --shard-update equal backprop's: parameters, losses, and the optimizer
  state. The weights stay whole on every replica; the stage group's optimizer state is split
  over the R replicas on its layer axis (1/R of it a device)."""
  even = (4 // config.num_stages,) * config.num_stages  # layers R divides on every stage
  model, params = tiny_transformer(config.num_stages, num_layers=4, layers_per_stage=even)
  batches = random_batches(3, seed=7)
  sharded = dataclasses.replace(config, shard_update=True)
  got, got_losses = run_schedule(sharded, model, tx(), params, batches)
  want, want_losses = run_schedule(ScheduleConfig(name='backprop'), model, tx(), params, batches)
  assert max_abs_diff(want.params, params) > 1e-2  # training moved them
  assert max_abs_diff(got.params, want.params) < ATOL
  assert max_abs_diff(got.opt_state, want.opt_state) < ATOL
  assert got_losses == pytest.approx(want_losses, abs=ATOL)
  kernel = got.params['stages']['mlp_in']['kernel']  # [G, layers, d, d_ff]
  assert DATA not in kernel.sharding.spec  # the weights whole on each replica
  moments = [
    leaf for leaf in jax.tree.leaves(got.opt_state['stages']) if leaf.shape == kernel.shape
  ]
  stage_share = kernel.size // config.num_stages
  assert moments and all(
    m.sharding.spec[1] == DATA
    and m.addressable_shards[0].data.size * config.data_parallel == stage_share
    for m in moments
  )


def test_shard_update_leaves_a_delayed_ring_where_it_was():
  """Ouroboros at G = 2 on 2 replicas, pipelined and streamed after a synchronous first step, with
  Muon: the same parameters and losses with --shard-update as without (only the gradients' sync
  and the update's layout change); its optimizer state a device is about half."""
  model, params = tiny_transformer(2, num_layers=4, layers_per_stage=(2, 2))
  batches = random_batches(4, seed=9)
  ring = ScheduleConfig(
    name='ouroboros',
    num_stages=2,
    data_parallel=2,
    forward='pipelined',
    microbatches=2,
    sync_warmup_steps=1,  # a first step locked: micro-batch gradients summed, then scattered
  )
  sharded = dataclasses.replace(ring, shard_update=True)
  got, got_losses = run_schedule(sharded, model, _muon(), params, batches)
  want, want_losses = run_schedule(ring, model, _muon(), params, batches)
  assert max_abs_diff(want.params, params) > 1e-2
  assert max_abs_diff(got.params, want.params) < 1e-6
  assert got_losses == pytest.approx(want_losses, abs=1e-6)
  assert _bytes_on_first_device(got.params) == _bytes_on_first_device(want.params)
  halved = _bytes_on_first_device(got.opt_state) / _bytes_on_first_device(want.opt_state)
  assert 0.45 < halved < 0.6, halved


def test_shard_update_splits_the_updates_work_over_the_replicas():
  """The compiled data_parallel step on R = 4 with Muon: XLA's operation count falls with
  --shard-update (each replica orthogonalises N / R = 1 of the stage's 4 layers, where each
  repeats all 4 without it), and the compiled arguments (the state) shrink. The gradients are
  reduce-scattered, not all-reduced, the embedding's and head's too (on FSDP's axis): what is
  left of the all-reduce is a few scalars."""
  model, params = tiny_transformer(1, num_layers=4, d_model=64, d_ff=256)
  batch = random_batches(1, batch=8)[0]
  config = ScheduleConfig(name='data_parallel', data_parallel=4)

  def compiled(shard_update: bool):
    run = dataclasses.replace(config, shard_update=shard_update)
    schedule = build_schedule(run, model, _muon())
    step = schedule.step.lower(schedule.init(params, batch), batch).compile()
    cost = step.cost_analysis()
    flops = (cost[0] if isinstance(cost, list) else cost)['flops']
    return flops, step.memory_analysis(), step.as_text()

  (flops_whole, memory_whole, hlo_whole) = compiled(False)
  (flops_shared, memory_shared, hlo_shared) = compiled(True)
  assert flops_shared < 0.9 * flops_whole, (flops_shared, flops_whole)
  stage_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(params['stages']))
  assert compile_lib.collective_bytes(hlo_whole, 'all-reduce') >= stage_bytes
  assert compile_lib.collective_bytes(hlo_whole, 'reduce-scatter') == 0
  all_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(params))
  assert compile_lib.collective_bytes(hlo_shared, 'all-reduce') < 4096  # the loss and a few scalars
  scattered = compile_lib.collective_bytes(hlo_shared, 'reduce-scatter')  # each replica's 1/R
  assert scattered == pytest.approx(all_bytes / 4, rel=0.05), (scattered, all_bytes)
  if memory_whole is not None:
    assert memory_shared.argument_size_in_bytes < memory_whole.argument_size_in_bytes


def test_shard_update_needs_replicas_and_is_not_fsdp():
  with pytest.raises(ConfigError, match='1f1b has one; give it data_parallel=2 or more'):
    ScheduleConfig(name='1f1b', num_stages=2, shard_update=True).validate()
  with pytest.raises(ConfigError, match='fsdp=True already splits the optimizer state'):
    ScheduleConfig(
      name='1f1b', num_stages=2, data_parallel=2, fsdp=True, shard_update=True
    ).validate()
  label = ScheduleConfig(name='1f1b', num_stages=2, data_parallel=2, shard_update=True).label
  assert label == '1f1b G=2xR=2 shard_update M=4'
