"""FSDP (`data_parallel` with `fsdp=True`): backprop's parameters, its state 1/D per device.

ATOL: float32 after 3 Adam steps at lr 1e-2, the sums split over D devices in another order
(measured: <= 2.1e-6 at D = 2), the tolerance tests/test_schedules.py gives every schedule; a
wrong gradient (a replica's mean, another key) moves parameters by ~1e-2."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding

from ouroboros_jax import (
  ConfigError,
  ScheduleConfig,
  build_schedule,
  layer_shards,
  optimizers,
  placement,
)
from ouroboros_jax.placement import DATA, STAGE
from ouroboros_jax.schedules.fsdp import fsdp_spec
from ouroboros_jax.update import GroupedOptimizer

from helpers import adam, max_abs_diff, random_batches, run_schedule, tiny_transformer

ATOL = 2e-5


def _muon():
  return optimizers.make_optimizer('muon', 1e-2, muon_learning_rate=0.02)


@pytest.mark.parametrize(
  'replicas, tx, dropout, groups, layers',
  [(2, adam, 0.0, 2, 4), (4, adam, 0.1, 2, 4), (2, _muon, 0.0, 2, 4), (4, _muon, 0.0, 1, 6)],
  ids=['D=2 adamw', 'D=4 adamw dropout', 'D=2 muon', 'D=4 muon 6 layers'],
)
def test_fsdp_gives_backprops_parameters(replicas, tx, dropout, groups, layers):
  """Three steps of FSDP on D devices equal backprop's on the same batches, parameters and
  optimizer state, dropout included (the same keys), and Muon's whole-matrix update too, also
  where D does not divide the layers (6 layers over gcd(4, 6) = 2 groups of 2 replicas)."""
  model, params = tiny_transformer(groups, num_layers=layers, dropout=dropout)
  batches = random_batches(3, seed=5)
  fsdp = ScheduleConfig(name='data_parallel', data_parallel=replicas, fsdp=True)
  got, got_losses = run_schedule(fsdp, model, tx(), params, batches)
  want, want_losses = run_schedule(ScheduleConfig(name='backprop'), model, tx(), params, batches)
  assert max_abs_diff(want.params, params) > 1e-2  # training moved them
  assert max_abs_diff(got.params, want.params) < ATOL
  assert max_abs_diff(got.opt_state, want.opt_state) < ATOL
  assert got_losses == pytest.approx(want_losses, abs=ATOL)
  # The state really is split: a layer kernel's shard on one device is 1/D of it.
  kernel = got.params['stages']['mlp_in']['kernel']
  assert DATA in kernel.sharding.spec
  assert kernel.addressable_shards[0].data.size == kernel.size // replicas


def test_fsdp_state_per_device_falls_as_one_over_d():
  """The bytes of parameters and optimizer state each device holds, and the compiled step's
  arguments, fall with D as 1/D, but for the few leaves no axis of which D divides."""
  model, params = tiny_transformer(2, num_layers=4)
  batch = random_batches(1, batch=8)[0]

  def per_device(replicas):
    config = ScheduleConfig(name='data_parallel', data_parallel=replicas, fsdp=True)
    schedule = build_schedule(config, model, adam())
    state = schedule.init(params, batch)
    held = sum(
      s.data.nbytes
      for leaf in jax.tree.leaves(state)
      for s in leaf.addressable_shards
      if s.device == jax.devices()[0]
    )
    stats = schedule.step.lower(state, batch).compile().memory_analysis()
    return held, stats.argument_size_in_bytes if stats is not None else None

  one, one_args = per_device(1)
  two, two_args = per_device(2)
  four, four_args = per_device(4)
  assert 0.45 * one < two < 0.56 * one and 0.45 * two < four < 0.6 * two, (one, two, four)
  if one_args is not None:
    assert four_args < two_args < one_args


def test_fsdp_refuses_the_pallas_kernel_and_auto_runs_blockwise_there():
  """XLA partitions FSDP's step and cannot split a Pallas kernel: `auto` on a TPU runs XLA's
  blockwise attention there, and --attention pallas is one line."""
  from ouroboros_jax.training import field_flags, presets

  flags = {'schedule': 'data_parallel', 'data_parallel': 2, 'fsdp': True}
  cfg = field_flags.override(presets.get_preset('tiny'), flags)
  assert cfg.attention_kind('tpu') == 'blockwise' and cfg.attention_kind('cpu') != 'pallas'
  assert field_flags.override(cfg, {'fsdp': False}).attention_kind('tpu') == 'pallas'
  with pytest.raises(ConfigError, match=r'attention=.pallas. is a kernel XLA cannot split'):
    field_flags.override(cfg, {'attention': 'pallas'}).attention_kind('tpu')


def test_compile_reports_fsdps_own_layout():
  """`ouroboros compile` places the abstract state as the schedule's `layout` says: FSDP's
  parameters per device are 1/D of data_parallel's (where the old code laid every state out
  as the stage schedules do, replicated over `data`)."""
  from ouroboros_jax.perf import compile as compile_lib
  from ouroboros_jax.training import field_flags, presets

  flags = {'schedule': 'data_parallel', 'data_parallel': 4, 'batch_size': 8}
  plain = field_flags.override(presets.get_preset('tiny'), flags)
  sharded = compile_lib.compile_step(field_flags.override(plain, {'fsdp': True}))
  whole = compile_lib.compile_step(plain)
  assert 0.25 <= sharded['params_bytes'] / whole['params_bytes'] < 0.3, (sharded, whole)


def test_fsdp_splits_the_largest_axis_d_divides():
  assert fsdp_spec((8, 64, 32), 4) == jax.sharding.PartitionSpec(None, DATA, None)
  assert fsdp_spec((6, 6), 4) == jax.sharding.PartitionSpec()  # nothing 4 divides: replicated
  assert fsdp_spec((4, 4), 2) == jax.sharding.PartitionSpec(DATA, None)  # a tie: the first
  assert fsdp_spec((), 2) == jax.sharding.PartitionSpec()
  assert fsdp_spec((16,), 1) == jax.sharding.PartitionSpec()


def test_fsdp_labels_its_setting():
  label = ScheduleConfig(name='data_parallel', data_parallel=2, fsdp=True).label
  assert label == 'data_parallel fsdp'


@pytest.mark.parametrize(
  'config, tx',
  [
    (ScheduleConfig(name='zb_h1', num_stages=2, data_parallel=2, microbatches=2, fsdp=True), _muon),
    (ScheduleConfig(name='ouroboros', num_stages=1, data_parallel=2, fsdp=True), adam),
  ],
  ids=['zb_h1 G=2 D=2 muon', 'ouroboros G=1 D=2 adamw'],
)
def test_fsdp_inside_a_stage_schedule_gives_backprops_parameters_on_half_the_state(config, tx):
  """--fsdp on a stage schedule with D data replicas: each stage's parameters and optimizer
  state split over its replicas too (1/D of a stage's state a device), each layer gathered as
  it runs, and three steps equal backprop's (Ouroboros at G = 1 has no delay). ZB-H1's W is
  computed whole from the taps and reduce-scattered onto the shards; Muon orthogonalises the
  whole matrices."""
  model, params = tiny_transformer(config.num_stages, num_layers=4)
  batches = random_batches(3, seed=7)
  got, got_losses = run_schedule(config, model, tx(), params, batches)
  want, want_losses = run_schedule(ScheduleConfig(name='backprop'), model, tx(), params, batches)
  assert max_abs_diff(want.params, params) > 1e-2
  assert max_abs_diff(got.params, want.params) < ATOL
  assert got_losses == pytest.approx(want_losses, abs=ATOL)
  kernel = got.params['stages']['mlp_in']['kernel']  # [G, layers, d, d_ff]
  assert DATA in kernel.sharding.spec
  assert config.num_stages == 1 or kernel.sharding.spec[0] == STAGE
  assert kernel.addressable_shards[0].data.size == kernel.size // (config.num_stages * 2)
  moment = [
    leaf for leaf in jax.tree.leaves(got.opt_state['stages']) if leaf.shape == kernel.shape
  ][0]
  assert moment.addressable_shards[0].data.size == kernel.size // (config.num_stages * 2)


def test_fsdp_on_a_stage_schedule_needs_data_replicas():
  with pytest.raises(ConfigError, match='1f1b has one; give it data_parallel=2 or more'):
    ScheduleConfig(name='1f1b', num_stages=2, fsdp=True).validate()


def test_fsdp_leaves_a_delayed_ring_where_it_was():
  """Ouroboros at G = 2 on 2 data replicas, pipelined and streamed, with Muon: the same
  parameters with its state split over the replicas as without (only the layout changes; the
  update orthogonalises a layer a replica, only in the steps a stage is ready)."""
  model, params = tiny_transformer(2, num_layers=4)
  batches = random_batches(4, seed=9)
  ring = ScheduleConfig(
    name='ouroboros', num_stages=2, data_parallel=2, forward='pipelined', microbatches=2
  )
  got, got_losses = run_schedule(
    dataclasses.replace(ring, fsdp=True), model, _muon(), params, batches
  )
  want, want_losses = run_schedule(ring, model, _muon(), params, batches)
  assert max_abs_diff(want.params, params) > 1e-2
  assert max_abs_diff(got.params, want.params) < 1e-6
  assert got_losses == pytest.approx(want_losses, abs=1e-6)


@pytest.mark.parametrize(
  'config',
  [
    ScheduleConfig(name='1f1b', num_stages=2, data_parallel=2, microbatches=4, stash_policy='all'),
    ScheduleConfig(name='zb_h1', num_stages=2, data_parallel=2, microbatches=4, stash_policy='all'),
    ScheduleConfig(
      name='ouroboros', num_stages=2, data_parallel=2, forward='pipelined', microbatches=4
    ),
  ],
  ids=['1f1b keeping all', 'zb_h1 keeping all', 'ouroboros pipelined graph'],
)
def test_fsdp_in_a_stage_gathers_one_layer_at_a_time(config):
  """The compiled step's temporaries with --fsdp stay below those without: a stage's weights
  are gathered one layer at a time and never kept for the backward (the micro-batches in flight
  would otherwise each keep the whole stage: with the stage gathered whole, 1F1B's temporaries
  were 1.37x those without FSDP and the ring's 1.08x, measured at width 256 and 8 layers,
  docs/design.md). Its arguments are about half. ZB-H1's W reduce-scatters each layer's weight
  gradient as it makes it: 5.06 -> 4.58 MB here (1F1B 5.39 -> 4.51); made whole for the chunk
  first, they grew with FSDP, to 5.11 MB."""
  model, params = tiny_transformer(2, num_layers=4, d_model=128, d_ff=512, num_heads=4)
  batch = random_batches(1, batch=8)[0]

  def compiled(fsdp: bool):
    schedule = build_schedule(dataclasses.replace(config, fsdp=fsdp), model, adam())
    return schedule.step.lower(schedule.init(params, batch), batch).compile().memory_analysis()

  whole, sharded = compiled(False), compiled(True)
  assert sharded.temp_size_in_bytes < whole.temp_size_in_bytes, (sharded, whole)
  assert sharded.argument_size_in_bytes < 0.6 * whole.argument_size_in_bytes


@pytest.mark.parametrize('num_layers, at_most', [(4, 0.85), (2, 0.9)])
def test_muon_under_fsdp_orthogonalises_a_share_of_the_layers_on_each_replica(num_layers, at_most):
  """Under FSDP the stage group's Muon update runs on whole layers (`by_whole_layers`): with 4
  layers each of D = 4 replicas orthogonalises N/D = 1 layer's matrices; with 2 the layers go
  over gcd(4, 2) = 2 groups of 2 replicas, each layer's matrices split over its group. Left on
  the shards the compiler splits each Newton-Schulz product over all 4 and repeats the rest on
  every replica. The update is the same, for fewer operations a device (XLA's cost analysis of
  the compiled update: 0.76x for 4 layers, 0.84x for 2; 0.63x for the whole FSDP step of the 1B
  shape on v5e:2x4, docs/results/memory.md)."""
  model, params = tiny_transformer(1, num_layers=num_layers, d_model=64, d_ff=256)
  mesh = placement.make_mesh(1, 4)
  place = lambda tree: jax.tree.map(
    lambda a: jax.device_put(a, NamedSharding(mesh, fsdp_spec(a.shape, 4))), tree
  )
  grads = jax.tree.map(lambda a: 1e-2 * jnp.cos(jnp.arange(a.size).reshape(a.shape)), params)

  def update(layout):
    optimizer = GroupedOptimizer(_muon(), stage_layout=layout)
    args = place((params, optimizer.init(params), grads))
    compiled = jax.jit(optimizer.apply).lower(*args).compile()
    cost = compiled.cost_analysis()
    return compiled(*args)[0], (cost[0] if isinstance(cost, list) else cost)['flops']

  (on_shards, flops_on_shards), (on_layers, flops_on_layers) = (
    update(None),
    update(layer_shards.by_whole_layers(mesh)),
  )
  assert max_abs_diff(on_layers, on_shards) < 1e-6
  assert max_abs_diff(on_layers, params) > 1e-3
  assert flops_on_layers < at_most * flops_on_shards, (flops_on_layers, flops_on_shards)
