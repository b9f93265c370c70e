"""Issue 57's target: a model written as Flax's lm1b example writes it (shifted inputs, position
embeddings, a causal and padding mask, attention dropout and `nnx.Dropout`, a loss averaged over
the real tokens of a padded batch), staged from docs/guides/own_model.md's pieces as they are,
is exact under every exact schedule with dropout on.

With dropout on, two schedules agree exactly when they draw the same masks, i.e. when they cut
the batch alike: every schedule of one micro-batch draws batch t's key (backprop,
model_parallel, gpipe at M = 1), and every pipeline of M micro-batches draws micro-batch m's
(`ring.microbatch_key`), whatever its table. Each is held to its class's reference within 1e-6;
the two classes differ (the masks are really drawn)."""

from __future__ import annotations

import functools

import optax
import pytest
from flax import nnx

from ouroboros_jax import from_layers
from ouroboros_jax.schedules import ScheduleConfig

from helpers import guide_block, max_abs_diff, run_schedule

STEPS = 2


@functools.cache
def guide_pieces() -> dict:
  """The guide's lm1b block up to its training: the pieces, the padded batch, the loss."""
  pieces = guide_block('lm1b').split('\nrun = recipe(')[0]
  scope: dict = {}
  exec(compile(pieces, 'own_model.md', 'exec'), scope)
  return scope


@functools.cache
def four_groups():
  """The guide's pieces with 4 decoder blocks, one per stage group."""
  g = guide_pieces()
  blocks = [g['DecoderBlock'](g['WIDTH'], 4, nnx.Rngs(7 + i)) for i in range(4)]
  return from_layers(
    g['embed'],
    blocks[0],
    g['head'],
    layers=blocks,
    num_stages=4,
    context=g['context'],
    loss=g['padded_mean'],
    loss_weight=lambda targets_BxL: (targets_BxL > 0).sum(),
  )


@functools.cache
def trained(name: str, devices: int, microbatches: int):
  staging, batch = four_groups(), guide_pieces()['batch']
  config = ScheduleConfig(
    name=name, num_stages=devices, **({'microbatches': microbatches} if name != 'backprop' else {})
  )
  state, losses = run_schedule(
    config, staging.model, optax.sgd(0.1), staging.params, [batch] * STEPS
  )
  return state.params, losses


ONE_MICROBATCH = [('model_parallel', 4, 1), ('gpipe', 4, 1)]
TWO_MICROBATCHES = [('1f1b', 4, 2), ('zb_h1', 4, 2), ('interleaved', 2, 2), ('zb_v', 2, 2)]


@pytest.mark.parametrize('name, devices, microbatches', ONE_MICROBATCH)
def test_one_micro_batch_equals_backprop_with_dropout_and_padding(name, devices, microbatches):
  want, want_losses = trained('backprop', 1, 1)
  got, losses = trained(name, devices, microbatches)
  assert max_abs_diff(four_groups().params, want) > 1e-3  # the steps moved the weights
  assert max_abs_diff(got, want) < 1e-6
  assert max(abs(a - b) for a, b in zip(losses, want_losses)) < 1e-6


@pytest.mark.parametrize('name, devices, microbatches', TWO_MICROBATCHES)
def test_every_pipeline_of_two_micro_batches_equals_gpipe_with_dropout(name, devices, microbatches):
  want, want_losses = trained('gpipe', 4, 2)
  got, losses = trained(name, devices, microbatches)
  assert max_abs_diff(got, want) < 1e-6
  assert max(abs(a - b) for a, b in zip(losses, want_losses)) < 1e-6


def test_the_dropout_masks_are_really_drawn():
  """Two cuts of the batch draw other masks: without dropout (or with its keys ignored) GPipe
  at M = 2 would equal backprop, as the weighted loss makes it exact."""
  assert max_abs_diff(trained('gpipe', 4, 2)[0], trained('backprop', 1, 1)[0]) > 1e-4
