"""Muon reads every kernel as the matrix it is (issue 39, item 3): a DenseGeneral layout is one
(inputs) x (outputs) matrix per stacked layer, a matrix not named 'kernel' is never given to Adam
silently, and the built-in model's optimizer is what it was."""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from ouroboros_jax import optimizers
from ouroboros_jax.models import model as transformer
from ouroboros_jax.models import partition
from ouroboros_jax.optimizers import MuonDimsWarning, kernel_dims

G, N, D, H, K = 2, 2, 8, 2, 4  # stages, layers per stage, width, heads, head width


class GeneralBlock(nn.Module):
  """q [D, H, K] and the output projection [H, K, D], as DenseGeneral lays them out."""

  @nn.compact
  def __call__(self, x):
    q = nn.DenseGeneral((H, K), name='query')(x)
    return x + nn.DenseGeneral(D, axis=(-2, -1), name='out')(jnp.tanh(q))


class DenseBlock(nn.Module):
  """The same block with 2-D kernels [D, H*K] and [H*K, D]."""

  @nn.compact
  def __call__(self, x):
    q = nn.Dense(H * K, name='query')(x)
    return x + nn.Dense(D, name='out')(jnp.tanh(q))


def stacked_general_params():
  """{'layers': ...} with every leaf stacked [G, N, ...], of GeneralBlock."""
  x = jnp.zeros((1, D))
  keys = jax.random.split(jax.random.key(0), G * N)
  per_layer = [GeneralBlock().init(k, x)['params'] for k in keys]
  stack = jax.tree.map(
    lambda *leaves: jnp.stack(leaves).reshape(G, N, *leaves[0].shape), *per_layer
  )
  return {'layers': stack}


def to_dense(params):
  """The DenseGeneral parameters as DenseBlock's: the same values, reshaped."""
  layers = params['layers']
  return {
    'layers': {
      'query': {
        'kernel': layers['query']['kernel'].reshape(G, N, D, H * K),
        'bias': layers['query']['bias'].reshape(G, N, H * K),
      },
      'out': {
        'kernel': layers['out']['kernel'].reshape(G, N, H * K, D),
        'bias': layers['out']['bias'],
      },
    }
  }


def loss_of(block):
  def loss(params, x, y):
    for g in range(G):
      for n in range(N):
        layer = jax.tree.map(lambda leaf: leaf[g, n], params['layers'])
        x = block.apply({'params': layer}, x)
    return jnp.mean((x - y) ** 2)

  return loss


def train(tx, loss, params, steps=4):
  rng = np.random.default_rng(1)
  state = tx.init(params)
  for _ in range(steps):
    x = jnp.asarray(rng.normal(size=(16, D)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(16, D)), jnp.float32)
    grads = jax.grad(loss)(params, x, y)
    updates, state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)
  return params


def muon(**kw):
  return optimizers.make_optimizer('muon', 1e-2, weight_decay=0.1, muon_learning_rate=0.05, **kw)


GENERAL_DIMS = {
  '*/query/kernel': kernel_dims(in_axes=1, out_axes=2),
  '*/out/kernel': kernel_dims(2, 1),
}


def max_difference(a, b):
  return max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_dense_general_kernels_take_the_steps_of_their_2d_matrices():
  general = stacked_general_params()
  dense = to_dense(general)
  with warnings.catch_warnings():
    warnings.simplefilter('error', MuonDimsWarning)  # the mapping places every kernel
    got = train(muon(muon_dims=GENERAL_DIMS), loss_of(GeneralBlock()), general)
    want = train(muon(muon_dims={'*/kernel': kernel_dims()}), loss_of(DenseBlock()), dense)
  # float32: the same matrices through Newton-Schulz as DenseGeneral (several contracting axes)
  # and as Dense kernels, sums in another order; the quintic (coefficients ~3.4, 4.8, 2.0) amplifies
  # that over 5 iterations x 4 steps at lr 0.05: 6e-7 seen, so 1e-5 (was 2e-6, 3x what was seen); a
  # kernel orthogonalised over the wrong axes moves the parameters by O(lr) = 5e-2.
  assert max_difference(to_dense(got), want) < 1e-5
  assert max_difference(want, dense) > 1e-2  # the steps moved the parameters


def test_the_rule_alone_warns_on_a_dense_general_kernel_and_misreads_it():
  """Without the mapping, [G, N, D, H, K] reads as G*N*D matrices H x K: a warning names it."""
  general = stacked_general_params()
  with pytest.warns(MuonDimsWarning, match=r"'layers/query/kernel'.*muon_dims"):
    guessed = train(muon(), loss_of(GeneralBlock()), general)
  want = train(
    muon(muon_dims={'*/kernel': kernel_dims()}), loss_of(DenseBlock()), to_dense(general)
  )
  assert max_difference(to_dense(guessed), want) > 1e-3


def test_a_matrix_not_named_kernel_warns_once_and_a_mapping_gives_it_muon():
  """The README's model: 'w_in', 'w_out' [STAGES, WIDTH, WIDTH] are matrices, not 'kernel'."""
  rng = np.random.default_rng(0)
  params = {
    'stages': {
      'w_in': jnp.asarray(rng.normal(size=(2, 8, 8)), jnp.float32),
      'w_out': jnp.asarray(rng.normal(size=(2, 8, 8)), jnp.float32),
    },
    'head': {'bias': jnp.zeros(8)},
  }
  grads = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), params)

  def steps(tx, params, grads):
    state = tx.init(params)
    for _ in range(3):
      updates, state = tx.update(grads, state, params)
      params = optax.apply_updates(params, updates)
    return params

  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter('always')
    steps(muon(), params, grads)
  messages = [str(w.message) for w in caught if issubclass(w.category, MuonDimsWarning)]
  assert len(messages) == 2, messages  # one per leaf, over init and three updates
  assert any("'stages/w_in'" in m and 'not named' in m and 'muon_dims' in m for m in messages)

  with warnings.catch_warnings():
    warnings.simplefilter('error', MuonDimsWarning)
    mapped = steps(muon(muon_dims={'stages/*': kernel_dims()}), params, grads)
  # Exactly the steps of the same matrices named 'kernel', weight decay included.
  as_kernels = steps(
    muon(muon_dims={'*/kernel': kernel_dims()}),
    {'stages': {'w_in': {'kernel': params['stages']['w_in']}}},
    {'stages': {'w_in': {'kernel': grads['stages']['w_in']}}},
  )
  # The same matrices under another name: the same operations in the same order, 1e-6 ~ a few ulps.
  np.testing.assert_allclose(
    mapped['stages']['w_in'], as_kernels['stages']['w_in']['kernel'], rtol=0, atol=1e-6
  )
  assert max_difference(mapped, params) > 1e-2

  # None in the mapping confirms Adam, without a warning.
  with warnings.catch_warnings():
    warnings.simplefilter('error', MuonDimsWarning)
    steps(muon(muon_dims={'stages/*': None}), params, grads)


def old_muon(weight_decay):
  """make_optimizer('muon') as it was before muon_dims: every 'kernel' [..., in, out]."""

  def dims(path, leaf):
    if getattr(path[-1], 'key', None) != 'kernel' or leaf.ndim < 2:
      return None
    return optax.contrib.MuonDimensionNumbers(leaf.ndim - 2, leaf.ndim - 1)

  return optax.contrib.muon(
    0.05,
    beta=0.95,
    weight_decay=weight_decay,
    weight_decay_mask=optimizers.kernel_mask,
    adam_learning_rate=1e-2,
    adam_b1=0.9,
    adam_b2=optimizers.B2,
    eps=optimizers.EPS,
    muon_weight_dimension_numbers=lambda tree: jax.tree_util.tree_map_with_path(dims, tree),
  )


@pytest.mark.parametrize('arch', ['gpt', 'transformer-xl'])
def test_the_built_in_models_steps_are_unchanged_and_silent(arch):
  cfg = transformer.ModelConfig(
    arch=arch, d_model=16, num_heads=2, num_layers=4, d_ff=32, seq_len=8, tie_embeddings=False
  )
  params = partition.to_staged(transformer.init_params(cfg, jax.random.key(0)), [2, 2])
  rng = np.random.default_rng(0)
  grads = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), p.dtype), params)
  with warnings.catch_warnings():
    warnings.simplefilter('error', MuonDimsWarning)
    new, old = muon(muon_dims=optimizers.LIBRARY_DIMS), old_muon(0.1)  # as the CLI's
    new_state, old_state = new.init(params), old.init(params)
    for _ in range(2):
      new_updates, new_state = new.update(grads, new_state, params)
      old_updates, old_state = old.update(grads, old_state, params)
      jax.tree.map(np.testing.assert_array_equal, new_updates, old_updates)


def test_a_users_module_named_like_the_librarys_is_not_placed_silently():
  """The built-in models' kernels are placed by the CLI's mapping (LIBRARY_DIMS), not by their
  names: a user's DenseGeneral q/k/v called 'qkv' [G, N, D, 3, H, K] gets the warning under
  `recipe`, which passes only the user's own muon_dims."""
  from ouroboros_jax import recipe

  stages = {'qkv': {'kernel': jnp.ones((2, 1, 8, 3, 2, 4))}}
  with pytest.warns(MuonDimsWarning, match="'qkv/kernel'"):
    recipe('ouroboros', 2, batch_size=8).optimizer.init(stages)
  with warnings.catch_warnings():
    warnings.simplefilter('error', MuonDimsWarning)
    placed = {'qkv/kernel': optimizers.kernel_dims(1, 3)}
    recipe('ouroboros', 2, batch_size=8, muon_dims=placed).optimizer.init(stages)
