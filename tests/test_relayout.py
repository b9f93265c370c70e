"""Resuming on another layout (issue 63): an exact schedule's checkpoint continues on another
schedule or another number of stages as if it never moved; Ouroboros' moves once drained
(--drain), and is refused in one line before."""

from __future__ import annotations

import functools
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from ouroboros_jax import placement, staging
from ouroboros_jax.errors import CheckpointError
from ouroboros_jax.schedules import compensation
from ouroboros_jax.training import checkpoint, field_flags, loop, relayout, resume

from helpers import SMALL_CLI, assert_trees_equal, host_tree, restore_run, run_cli, tiny_config

# 4 layers, so 4 stages hold one each; a checkpoint at step 3, then 3 steps more.
LAYOUT = dict(num_layers=4, checkpoint_every=3, steps=6, eval_every=1000, optimizer='adamw')
# Float32: the schedules sum a batch's gradient in another order (micro-batches, stages), so a
# moved run and an unmoved one differ in the last bits. Measured: at most 3.2e-7 after six AdamW
# steps at 1e-2; the bound leaves a factor of 6.
ATOL = 2e-6
# Across processes the sums also cross gloo's all-reduce: measured 2.3e-6 after 9 steps.
PROCESS_ATOL = 2e-5


def layers_of(out) -> dict:
  """The saved run's parameters as the model's layers, {'embed', 'layers' [L, ...], 'head'}."""
  manager = checkpoint.make_manager(str(out), read_only=True)
  try:
    meta, step = checkpoint.read_meta(manager), manager.latest_step()
    params = host_tree(checkpoint.restore_single_device(manager))['params']
  finally:
    manager.close()
  return step, staging.from_staged(params, relayout.stored_layers(meta))


def stored(out) -> dict:
  """The params and optimizer state a run's newest checkpoint holds, as it holds them."""
  manager = checkpoint.make_manager(str(out), read_only=True)
  try:
    saved = host_tree(checkpoint.restore_single_device(manager))
  finally:
    manager.close()
  return {'params': saved['params'], 'opt_state': saved['opt_state']}


def moved_and_unmoved(tmp_path, prepared_data_dir, first: dict, then: dict, capsys):
  """(the parameters after 6 steps of `first`; after 3 of `first` and 3 of `then`, resumed from
  the first's step-3 checkpoint, the later one set aside; what the resume printed)."""
  unmoved = tiny_config(tmp_path / 'unmoved', prepared_data_dir, **LAYOUT, **first)
  loop.train(unmoved, quiet=True)
  shutil.copytree(unmoved.out_dir, tmp_path / 'moved')
  start = field_flags.override(unmoved, {'out': str(tmp_path / 'moved')})
  capsys.readouterr()
  loop.train(field_flags.override(start, then), quiet=True, resume_from=3)
  return layers_of(unmoved.out_dir), layers_of(start.out_dir), capsys.readouterr().out


@pytest.mark.parametrize(
  'first, then',
  [
    (dict(schedule='1f1b', stages=2, microbatches=4), dict(schedule='1f1b', stages=4)),
    (dict(schedule='interleaved', stages=2, microbatches=4),
      dict(schedule='data_parallel', stages=1, microbatches=None, data_parallel=2, fsdp=True)),
    (dict(schedule='1f1b', stages=4, microbatches=4),
      dict(schedule='zb_h1', stages=2, data_parallel=2, shard_update=True)),
  ],
  # backprop <-> 1F1B: the process test's
  ids=['1f1b-2to4', 'interleaved-to-fsdp', '1f1b-to-zero1'],
)  # fmt: skip
def test_an_exact_schedule_moves_exactly(tmp_path, prepared_data_dir, capsys, first, then):
  (steps_a, unmoved), (steps_b, moved), said = moved_and_unmoved(
    tmp_path, prepared_data_dir, first, then, capsys
  )
  assert steps_a == steps_b == 6
  # The checkpoints of both layouts hold one form: the same shapes, whatever G, D or schedule.
  assert jax.tree.map(np.shape, stored(tmp_path / 'unmoved')) == jax.tree.map(
    np.shape, stored(tmp_path / 'moved')
  )
  worst = max(
    float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
    for a, b in zip(jax.tree.leaves(unmoved), jax.tree.leaves(moved))
  )
  assert worst < ATOL, worst
  line = [s for s in said.splitlines() if s.startswith('resuming from step 3')]
  assert len(line) == 1 and 're-staged from' in line[0], said
  assert '--schedule ' in line[0] or '--stages ' in line[0], line


@pytest.mark.parametrize('layers_per_stage', ['3,1'])  # padded, and L = 4 splits evenly
def test_the_per_layer_form_keeps_each_stage_on_its_devices(
  tmp_path, prepared_data_dir, layers_per_stage
):
  """What a checkpoint holds: every layer its own stage ([L, 1, ...]), sharded as the run's
  stages were where L divides evenly (each device its own layers' rows), and back to the run's
  layout and shardings bit for bit, padding (3 layers and 1) included."""
  cfg = tiny_config(
    tmp_path, prepared_data_dir, **LAYOUT, schedule='1f1b', stages=2, microbatches=2,
    layers_per_stage=layers_per_stage,
  )  # fmt: skip
  schedule, params, layers = loop.build(cfg)
  state = placement.onto_mesh(schedule.init(params, loop.example_batch(cfg)), schedule.mesh)
  form = relayout.stored(state, layers)
  for leaf in jax.tree.leaves((form.params['stages'], form.opt_state)):
    if leaf.ndim >= 2 and leaf.shape[:2] == (4, 1):  # a layer's leaf: two layers a device
      assert {s.data.shape[0] for s in leaf.addressable_shards} == {2}, leaf.sharding
  shapes = {leaf.shape[:2] for leaf in jax.tree.leaves(form.params['stages'])}
  assert shapes == {(4, 1)}
  back = relayout.Move(layers, layers, per_layer=True).apply(form, checkpoint.abstract_like(state))
  assert_trees_equal(host_tree(back), host_tree(state))
  for moved, leaf in zip(jax.tree.leaves(back), jax.tree.leaves(state)):
    assert moved.sharding.is_equivalent_to(leaf.sharding, leaf.ndim)


def test_moving_an_undrained_ring_is_refused_in_one_line(tmp_path, prepared_data_dir):
  ring = tiny_config(
    tmp_path / 'ring', prepared_data_dir, **dict(LAYOUT, steps=3), schedule='ouroboros', stages=2
  )
  loop.train(ring, quiet=True)
  for then in (dict(stages=4), dict(schedule='1f1b', stages=2)):
    with pytest.raises(CheckpointError, match='drain') as caught:
      loop.train(field_flags.override(ring, dict(then, steps=6)), quiet=True, resume=True)
    assert '\n' not in str(caught.value)
  # As the line says: resumed with its own flags and --drain at its step, it drains at once (the
  # undrained checkpoint set aside), and then it moves.
  loop.train(field_flags.override(ring, dict(drain=True)), quiet=True, resume=True)
  assert (tmp_path / 'ring' / checkpoint.SET_ASIDE / '3').is_dir()
  loop.train(field_flags.override(ring, dict(stages=4, steps=4)), quiet=True, resume=True)
  assert layers_of(ring.out_dir)[0] == 4


@pytest.mark.parametrize(
  'first, then',
  [
    (dict(optimizer='auto'), dict(stages=4)),  # the defaults: Muon, the recipe's compensations
    (dict(optimizer='auto'), dict(schedule='1f1b', stages=2, microbatches=2)),  # none after
    (dict(schedule='backprop', stages=1), dict(schedule='ouroboros', stages=2)),  # none before
  ],
  ids=['ouroboros-2to4', 'ouroboros-to-1f1b', 'backprop-to-ouroboros'],
)
def test_a_drained_ring_moves(tmp_path, prepared_data_dir, capsys, first, then):
  """--drain applies what the ring holds before the last checkpoint; that checkpoint resumes on
  another layout, the ring restarting empty, and the run trains on from the moved weights. An
  exact schedule's checkpoint moves onto the ring the same way (nothing of it is in flight).
  Between the ring (the recipe's compensations) and an exact schedule (none) the optimizer's own
  state moves as it is, and the compensations' start from zero."""
  ring = tiny_config(
    tmp_path / 'ring', prepared_data_dir,
    **{**LAYOUT, 'steps': 3, 'schedule': 'ouroboros', 'stages': 2, 'drain': True, **first},
  )  # fmt: skip
  loop.train(ring, quiet=False)
  said = capsys.readouterr().out
  assert 'drained the ring at step 3' in said or ring.schedule.name != 'ouroboros', said
  step, drained = layers_of(ring.out_dir)
  moved = field_flags.override(ring, dict(then, steps=6))
  summary = loop.train(moved, quiet=False, resume=True)
  said = capsys.readouterr().out
  line = [s for s in said.splitlines() if s.startswith('resuming from step 3')]
  assert len(line) == 1 and 're-staged from ' in line[0], said
  assert ('the ring drained before' in line[0]) == (ring.schedule.name == 'ouroboros'), line
  to_ring = moved.schedule.name == 'ouroboros'
  assert ('the ring restarts empty' in line[0]) == to_ring, line
  comps = [c.resolved_compensation() for c in (ring, moved)]
  assert ("the compensations' (" in line[0]) == (comps[0] != comps[1]), line
  assert step == 3 and layers_of(ring.out_dir)[0] == 6
  assert np.isfinite(summary['val_bpb'])
  assert summary['val_bpb'] < 8.0  # bytes: a uniform guess is 8 bits
  # The optimizer's own state (the embedding's group: no stage axis) moved as it was saved.
  own = lambda tree, comp: functools.reduce(
    lambda node, key: getattr(node, key) if hasattr(node, '_fields') else node[key],
    compensation.inner_path(comp),
    tree,
  )
  manager = checkpoint.make_manager(str(ring.out_dir), read_only=True)
  try:
    saved = host_tree(checkpoint.restore_single_device(manager, 3))['opt_state']['embed']
  finally:
    manager.close()
  restored = host_tree(restore_run(moved, step=3)[0].opt_state['embed'])
  sums = lambda tree: sorted(
    float(np.sum(np.asarray(a, np.float64))) for a in jax.tree.leaves(tree)
  )
  assert sums(own(restored, comps[1])) == sums(own(saved, comps[0]))
  assert any(sums(own(saved, comps[0])))  # (not all zero: a state trained for 3 steps)


def test_a_run_moves_between_process_counts(tmp_path, prepared_data_dir):
  """Backprop in 1 process for 3 steps, 1F1B on 2 stages in 2 processes for 3, backprop in 1
  again for 3 (1 -> 2 -> 1 processes): the parameters of a run that never moved. A constant
  rate (no warmup, no decay) lets each leg's --steps end it without changing the schedule."""
  flags = [*SMALL_CLI, '--data-dir', prepared_data_dir, '--optimizer', 'adamw',
           '--warmup-steps', '0', '--min-lr-ratio', '1', '--checkpoint-every', '3',
           '--eval-every', '1000']  # fmt: skip
  out = tmp_path / 'moved'
  straight = run_cli('train', *flags, '--steps', 9, '--out', tmp_path / 'straight')
  first = run_cli('train', *flags, '--steps', 3, '--out', out)
  assert straight.returncode == first.returncode == 0, first.stderr
  pipelined = ['--schedule', '1f1b', '--stages', 2, '--microbatches', 2, '--steps', 6]
  two = run_cli('launch', '--processes', 2, '--', 'train', *flags, *pipelined, '--out', out,
                '--resume', timeout=120)  # fmt: skip
  assert two.returncode == 0 and two.stdout.count('re-staged from 1 stage(s) to 2') == 2, two
  one = run_cli('train', *flags, '--steps', 9, '--out', out, '--resume')
  assert one.returncode == 0 and 're-staged from 2 stage(s) to 1' in one.stdout, one.stderr
  (_, unmoved), (steps, moved) = layers_of(tmp_path / 'straight'), layers_of(out)
  worst = max(
    float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
    for a, b in zip(jax.tree.leaves(unmoved), jax.tree.leaves(moved))
  )
  assert steps == 9 and worst < PROCESS_ATOL, worst


@pytest.mark.parametrize(
  'comp',
  [
    compensation.Compensation(predict=True, dc_lambda=1.0),  # the recipe's
    compensation.Compensation(predict=True),
    # every part (DC-ASGD without prediction keeps past weights: refused on a move)
    compensation.Compensation(shrink=0.5, predict=True, dc_lambda=1.0, pipemare_steps=10),
  ],
  ids=['predict-dc', 'predict', 'every-part'],
)
def test_the_optimizers_own_state_is_where_inner_path_says_and_the_rest_starts_at_zero(comp):
  """What a move between compensations relies on: `wrap`'s state holds tx's own state, as tx
  makes it, at `inner_path`, and every other leaf (each compensation's) is zero at its init."""
  tx, params = optax.adam(1e-3), {'w': jnp.ones((3, 2)), 'b': jnp.ones((2,))}
  wrapped = compensation.wrap(comp, tx, max_gap=1).init(params)
  path = compensation.inner_path(comp)
  own = functools.reduce(
    lambda node, key: getattr(node, key) if hasattr(node, '_fields') else node[key], path, wrapped
  )
  assert_trees_equal(own, tx.init(params))
  keys = lambda p: tuple(getattr(k, 'name', getattr(k, 'idx', None)) for k in p)
  others = [
    leaf for p, leaf in jax.tree_util.tree_leaves_with_path(wrapped) if keys(p)[: len(path)] != path
  ]
  assert others and all(not np.any(np.asarray(leaf)) for leaf in others)


def test_a_moved_dc_asgd_history_restarts_as_copies_of_the_weights(tmp_path, prepared_data_dir):
  """As one batch the ring's gradients are more than one update old, and DC-ASGD keeps a
  history of past weights, shaped by G and the lag. Moved (drained, G = 2 -> 4) it restarts as
  its init makes it: copies of the current weights; the resume line says so."""
  ring = tiny_config(
    tmp_path / 'ring', prepared_data_dir,
    **{**LAYOUT, 'steps': 3}, schedule='ouroboros', stages=2, flow='batch',
    compensation='predict,dc', drain=True,
  )  # fmt: skip
  loop.train(ring, quiet=True)
  moved = field_flags.override(ring, dict(stages=4, steps=6))
  state, _, meta = restore_run(moved, step=3)
  for group, axis in (('embed', 0), ('stages', 1)):  # a stage's [G', depth, N, ...]
    history = state.opt_state[group].inner[0].history  # DC-ASGD's state: the chain's first
    copies = jax.tree.map(
      lambda h, w: np.asarray(h) - np.expand_dims(np.asarray(w), axis), history,
      state.params[group],
    )  # fmt: skip
    assert jax.tree.leaves(history) and not any(np.any(d) for d in jax.tree.leaves(copies))
  schedule, params, layers = loop.build(moved)
  target = checkpoint.abstract_like(schedule.init(params, loop.example_batch(moved)))
  line = resume.move_for(meta, moved, tuple(layers)).describe(target)
  assert "DC-ASGD's history of past weights restarts" in line, line


def test_another_optimizer_resumes_only_when_asked_with_a_fresh_state(
  tmp_path, prepared_data_dir, capsys
):
  """--optimizer may change on --resume only with --fresh-optimizer (refused in one line that
  says so): the parameters, the step and the data position resume, the optimizer's state
  starts from its init, and the resume line says so. The model's shape may not change."""
  run = tiny_config(
    tmp_path / 'run', prepared_data_dir, **dict(LAYOUT, steps=3), schedule='1f1b', stages=2
  )
  loop.train(run, quiet=True)
  # A changed model is refused even between exact schedules (and with --fresh-optimizer).
  wider = dict(schedule='backprop', stages=1, d_model=64, steps=6, fresh_optimizer=True)
  with pytest.raises(CheckpointError, match='--d-model 32.*--d-model 64'):
    loop.train(field_flags.override(run, wider), quiet=True, resume=True)
  muon = field_flags.override(run, dict(optimizer='muon', steps=4))
  with pytest.raises(CheckpointError, match='--optimizer adamw.*--fresh-optimizer') as caught:
    loop.train(muon, quiet=True, resume=True)
  assert '\n' not in str(caught.value)
  fresh = field_flags.override(muon, dict(fresh_optimizer=True))
  state, _, _ = restore_run(fresh, step=3)
  schedule, params, _ = loop.build(fresh)
  init = schedule.init(params, loop.example_batch(fresh)).opt_state
  assert_trees_equal(host_tree(state.opt_state), host_tree(init))
  saved = layers_of(run.out_dir)[1]
  assert_trees_equal(staging.from_staged(host_tree(state.params), (2, 2)), saved)
  capsys.readouterr()
  loop.train(fresh, quiet=True, resume=True)
  said = capsys.readouterr().out
  assert "the optimizer's state starts again from its init" in said, said
