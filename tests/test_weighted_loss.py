"""A user's model as it is: a loss averaged over the valid tokens of a padded batch, and bool and
int leaves (a mask, positions) travelling between stages. Every schedule forms the gradient of
the whole batch's weighted mean (`StagedModel.loss_weight`, `ring.loss_shares`), however
unevenly the padding falls over its micro-batches and replicas; Ouroboros forms, for each item,
that of its own batch's, as the slow reference does. And the one-line errors such a user meets
first: a batch without targets, a schedule named by a string."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from ouroboros_jax import staged
from ouroboros_jax.schedules import ScheduleConfig, build_schedule, reference
from ouroboros_jax.schedules.compensation import Compensation

from helpers import max_abs_diff, raises_for_cli, run_schedule

ROWS, SEQ, WIDTH, VOCAB, PAD = 8, 6, 8, 11, 0


def masked_model(weighted: bool = True) -> staged.StagedModel:
  """Activations {'h': float, 'valid': bool, 'pos': int32}; the stages read the mask and the
  positions and pass them on; the loss is the mean over the valid (non-pad) targets."""

  def embed(p, inputs_BxL, rng):
    del rng
    pos_BxL = jnp.broadcast_to(jnp.arange(inputs_BxL.shape[1], dtype=jnp.int32), inputs_BxL.shape)
    return {'h': p['table'][inputs_BxL], 'valid': inputs_BxL != PAD, 'pos': pos_BxL}

  def stage(p, x, stage_index, rng):
    del stage_index, rng
    h = x['h'] + jnp.tanh(x['h'] @ p['w'] + 0.1 * x['pos'][..., None]) * x['valid'][..., None]
    return {**x, 'h': h}

  def loss(head, embed_p, x, targets_BxL):
    del embed_p
    logp = jax.nn.log_softmax(x['h'] @ head['out'])
    nll_BxL = -jnp.take_along_axis(logp, targets_BxL[..., None], axis=-1)[..., 0]
    valid_BxL = targets_BxL != PAD
    mean = jnp.sum(nll_BxL * valid_BxL) / jnp.maximum(valid_BxL.sum(), 1)
    return mean, {'loss': mean}

  weight = (lambda targets: jnp.sum(targets != PAD)) if weighted else None
  return staged.StagedModel(embed, stage, loss, tied_embedding=False, loss_weight=weight)


def masked_params(groups: int):
  keys = jax.random.split(jax.random.key(0), 3)
  return {
    'embed': {'table': jax.random.normal(keys[0], (VOCAB, WIDTH))},
    'stages': {'w': 0.5 * jax.random.normal(keys[1], (groups, WIDTH, WIDTH))},
    'head': {'out': jax.random.normal(keys[2], (WIDTH, VOCAB))},
  }


def padded_batches(num: int, seed: int = 0):
  """Row r keeps its first 1 + (r * 5 + t) % SEQ targets: the valid tokens fall unevenly over
  any cut of the rows into micro-batches or replicas (and the inputs are padded alike)."""
  rng = np.random.default_rng(seed)
  batches = []
  for t in range(num):
    tokens = rng.integers(1, VOCAB, (ROWS, SEQ + 1))
    keep = 1 + (np.arange(ROWS)[:, None] * 5 + t) % SEQ
    tokens[:, 1:] = np.where(np.arange(SEQ)[None] < keep, tokens[:, 1:], PAD)
    batches.append({'inputs': jnp.asarray(tokens[:, :-1]), 'targets': jnp.asarray(tokens[:, 1:])})
  return batches


EXACT = [
  ('data_parallel', 1, {'data_parallel': 2}),
  ('model_parallel', 2, {}),
  ('model_parallel', 2, {'data_parallel': 2}),
  ('gpipe', 2, {'microbatches': 4}),
  ('gpipe', 2, {'microbatches': 2, 'data_parallel': 2}),
  ('1f1b', 2, {'microbatches': 4}),
  ('zb_h1', 2, {'microbatches': 4}),
  ('interleaved', 2, {'microbatches': 4}),
  ('zb_v', 2, {'microbatches': 4}),
  ('ouroboros', 1, {'microbatches': 4}),
  ('ouroboros', 1, {'microbatches': 2, 'data_parallel': 2}),
]


@pytest.mark.parametrize(
  'name, devices, fields', EXACT, ids=[f'{n}-{d}-{sorted(f.items())}' for n, d, f in EXACT]
)
def test_every_exact_schedule_equals_backprop_with_uneven_padding(name, devices, fields):
  model, batches, tx = masked_model(), padded_batches(3), optax.sgd(0.5)
  config = ScheduleConfig(name=name, num_stages=devices, **fields)
  params = masked_params(config.stage_groups)
  want, want_losses = run_schedule(ScheduleConfig(name='backprop'), model, tx, params, batches)
  got, losses = run_schedule(config, model, tx, params, batches)
  assert max_abs_diff(params, want.params) > 1e-2  # the steps moved the weights
  assert max_abs_diff(got.params, want.params) < 1e-6
  np.testing.assert_allclose(losses, want_losses, rtol=1e-6)


def test_the_unweighted_mean_of_micro_batch_means_is_what_the_weight_corrects():
  """Without `loss_weight` a pipeline averages its micro-batches' means: not the batch's mean
  over its valid tokens, so the parameters part from backprop's (what the weight is for)."""
  batches, tx = padded_batches(2), optax.sgd(0.5)
  model = masked_model(weighted=False)
  params = masked_params(2)
  want, _ = run_schedule(ScheduleConfig(name='backprop'), model, tx, params, batches)
  config = ScheduleConfig(name='1f1b', num_stages=2, microbatches=4)
  got, _ = run_schedule(config, model, tx, params, batches)
  assert max_abs_diff(got.params, want.params) > 1e-2


@pytest.mark.parametrize(
  'fields',
  [
    {'stash': 'graph', 'flow': 'batch', 'microbatches': 1},
    {'stash': 'replay', 'flow': 'batch', 'microbatches': 2},
    {'stash': 'graph', 'flow': 'stream', 'microbatches': 4},
    {'stash': 'graph', 'flow': 'stream', 'microbatches': 4, 'forward': 'pipelined'},
  ],
  ids=['graph-batch', 'replay-batch-M2', 'graph-stream-M4', 'graph-stream-M4-pipelined'],
)
def test_ouroboros_weights_each_item_by_its_own_batch_as_the_reference_does(fields):
  model, batches, tx = masked_model(), padded_batches(6), optax.sgd(0.5)
  params = masked_params(2)
  config = ScheduleConfig(name='ouroboros', num_stages=2, compensation=Compensation(), **fields)
  got, losses = run_schedule(config, model, tx, params, batches)
  want, want_losses, _ = reference.run(model, tx, params, batches, config)
  assert max_abs_diff(params, want) > 1e-2
  assert max_abs_diff(got.params, want) < 1e-6
  heads = [loss for loss in want_losses if loss is not None]
  np.testing.assert_allclose(losses[len(losses) - len(heads) :], heads, rtol=1e-5)


def test_a_batch_of_padding_only_moves_nothing():
  """A replica or a batch whose targets are all padding weighs 0: no NaN reaches the weights."""
  model, tx = masked_model(), optax.sgd(0.5)
  params = masked_params(2)
  empty = padded_batches(1)[0]
  empty = {**empty, 'targets': jnp.zeros_like(empty['targets'])}
  config = ScheduleConfig(name='gpipe', num_stages=2, microbatches=4)
  got, losses = run_schedule(config, model, tx, params, [empty])
  assert losses == [0.0]
  assert max_abs_diff(got.params, params) == 0.0


def test_a_batch_without_targets_is_refused_at_init():
  """lm1b's own batches carry only the tokens (the model shifts them): one line at `init`, not a
  KeyError at the first step."""
  for name, devices in (('backprop', 1), ('1f1b', 2), ('ouroboros', 2)):
    schedule = build_schedule(
      ScheduleConfig(name=name, num_stages=devices), masked_model(), optax.sgd(0.1)
    )
    with raises_for_cli(r"the batch has no 'targets' \(it has \['inputs'\]\).*same tokens as both"):
      schedule.init(masked_params(devices), {'inputs': padded_batches(1)[0]['inputs']})


def test_a_schedule_named_by_a_string_is_one_line():
  with raises_for_cli(r"build_schedule takes a ScheduleConfig, not 'ouroboros'; pass Schedule"):
    build_schedule('ouroboros', masked_model(), optax.sgd(0.1))
