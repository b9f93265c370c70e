"""A user's stage that branches on its `stage_index` (issue 39, item 6): 3 real layers cut into
groups padded with one layer, which the stage skips exactly by its index, trains under every
schedule. The exact ones give backprop's parameters on the unpadded 3 layers; Ouroboros runs.

The pipelines once sized their stash by tracing the stage with the Python int 0 as its index while
the real forward passed a traced one: `jnp.where(stage_index * L + i < 3, ...)` is a Python bool
in the one trace and an array in the other, so the two kept different residuals and the step
failed with a pytree structure error."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from ouroboros_jax import ScheduleConfig, StagedModel, build_schedule
from ouroboros_jax.errors import ConfigError

from helpers import EXACT_ON_TWO_DEVICES, max_abs_diff, random_batches, run_schedule

VOCAB, WIDTH, LAYERS, STEPS, BATCH = 32, 8, 3, 3, 8
ATOL = 1e-5  # float32: an exact schedule only reorders sums (measured below 1e-6)


def embed(p, tokens, rng):
  del rng
  return p['table'][tokens]


def loss(head, embed_p, x, targets):
  logp = jax.nn.log_softmax(x @ embed_p['table'].T + head['bias'])
  return -jnp.take_along_axis(logp, targets[..., None], -1).mean(), {}


def padded_model(layers_per_group: int) -> StagedModel:
  """Groups of `layers_per_group` residual tanh-MLP layers; layer i of group s is real layer
  s * layers_per_group + i, and the ones from LAYERS on are pads, skipped by the index."""

  def stage(p, x, stage_index, rng):
    del rng
    for i in range(layers_per_group):
      y = x + jnp.tanh(x @ p['w_in'][i]) @ p['w_out'][i]
      x = jnp.where(stage_index * layers_per_group + i < LAYERS, y, x)
    return x

  return StagedModel(embed=embed, stage=stage, loss=loss)


@functools.cache
def layers():
  """The real layers' parameters, [LAYERS, ...] per leaf, and the embedding and head."""
  k_embed, k_in, k_out = jax.random.split(jax.random.key(0), 3)
  return {
    'embed': {'table': 0.3 * jax.random.normal(k_embed, (VOCAB, WIDTH))},
    'layers': {
      'w_in': 0.3 * jax.random.normal(k_in, (LAYERS, WIDTH, WIDTH)),
      'w_out': 0.3 * jax.random.normal(k_out, (LAYERS, WIDTH, WIDTH)),
    },
    'head': {'bias': jnp.zeros(VOCAB)},
  }


def padded_params(groups: int):
  """The real layers, one pad layer (of nonzero weights, so only the skip hides it) after them,
  cut into `groups` stacked groups: leaves [groups, layers_per_group, ...]."""
  p = layers()
  per_group = (LAYERS + 1) // groups
  pad = lambda a: jnp.concatenate([a, a[:1] + 1.0]).reshape(groups, per_group, *a.shape[1:])
  return {'embed': p['embed'], 'stages': jax.tree.map(pad, p['layers']), 'head': p['head']}


def real_layers(params):
  """(the real layers' parameters as [LAYERS, ...], the pad layer's) of padded params."""
  flat = jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), params['stages'])
  real = {**params, 'stages': jax.tree.map(lambda a: a[:LAYERS], flat)}
  return real, jax.tree.map(lambda a: a[LAYERS:], flat)


def sgd():
  return optax.sgd(0.5)


def batches():
  return random_batches(STEPS, batch=BATCH, vocab=VOCAB)


@functools.cache
def backprop():
  """Backprop on the 3 real layers, one per group and nothing skipped: the reference."""
  p = layers()
  params = {
    'embed': p['embed'],
    'stages': jax.tree.map(lambda a: a[:, None], p['layers']),
    'head': p['head'],
  }
  state, losses = run_schedule(ScheduleConfig(), padded_model(1), sgd(), params, batches())
  squeezed = {**state.params, 'stages': jax.tree.map(lambda a: a[:, 0], state.params['stages'])}
  return squeezed, losses


# 3 layers pad to 2 groups x 2 (one group per device) or to 4 groups x 1 (interleaved, zb_v).
EXACT = EXACT_ON_TWO_DEVICES


@pytest.mark.parametrize('name, fields, groups', EXACT, ids=[e[0] for e in EXACT])
def test_an_exact_schedule_skipping_a_pad_layer_by_its_stage_index_gives_backprops_parameters(
  name, fields, groups
):
  config = ScheduleConfig(name=name, **fields)
  assert name == 'backprop' or config.stage_groups == groups  # backprop: any number
  model = padded_model((LAYERS + 1) // groups)
  state, losses = run_schedule(config, model, sgd(), padded_params(groups), batches())
  got, pad = real_layers(state.params)
  want, want_losses = backprop()
  diff = max_abs_diff(got, want)
  print(f'{name}: max |params - backprop| = {diff:.2e}')
  assert diff < ATOL, (name, diff)
  start = {'embed': layers()['embed'], 'stages': layers()['layers'], 'head': layers()['head']}
  assert max_abs_diff(want, start) > 1e-2  # training moved them
  # Losses ~5.5: abs 1e-5, ~20 float32 ulps; a wrong stage index moves them by > 1e-2.
  assert losses == pytest.approx(want_losses, abs=1e-5)
  assert max_abs_diff(pad, real_layers(padded_params(groups))[1]) == 0  # the pad: no gradient


@pytest.mark.parametrize('name', ['interleaved', 'zb_v'])
def test_two_chunk_schedules_refuse_two_groups_on_two_devices(name):
  """interleaved and zb_v on 2 devices run 4 groups: the 2 x 2 padding is a clear error."""
  config = ScheduleConfig(name=name, num_stages=2, microbatches=2)
  schedule = build_schedule(config, padded_model(2), sgd())
  with pytest.raises(
    ConfigError, match=r'needs 4 \(one slice per stage group\).*from_layers\(\.\.\., num_stages=4\)'
  ):
    schedule.init(padded_params(2), batches()[0])


def test_ouroboros_skipping_a_pad_layer_by_its_stage_index_runs():
  config = ScheduleConfig(name='ouroboros', num_stages=2)
  state, losses = run_schedule(config, padded_model(2), sgd(), padded_params(2), batches())
  assert np.all(np.isfinite(losses)), losses
  leaves = jax.tree.leaves(jax.device_get(state.params))
  assert all(np.all(np.isfinite(a)) for a in leaves)
  _, pad = real_layers(state.params)
  assert max_abs_diff(pad, real_layers(padded_params(2))[1]) == 0
