"""The optimizer step every schedule shares.

An Optax transformation is applied *per module group* ('embed', each stage, 'head'), after one
global-norm clip over the whole gradient, so every schedule clips identically. Each stage has its
own optimizer state (vmapped over the stage axis), as each device of a ring has its own
optimizer. A group that has no gradient yet (Ouroboros' first K - k steps) is left exactly as it
is. Each group's version gap reaches tx as the Optax extra argument `delay` (the staleness
compensations of schedules/compensation.py read it; plain transformations ignore it).

A parameter that every layer uses (`StagedModel.shared`: Transformer-XL's global u, v) is stored
as one copy per layer slot, all equal. `_with_shared_group` turns those copies into one more
group, 'shared', with one optimizer state; `_write_shared` writes its new value back to every
slot. The generic update only sees groups.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

PyTree = Any
GROUPS = ('embed', 'stages', 'head')


@dataclasses.dataclass(frozen=True)
class GroupedOptimizer:
  """`tx` applied per module group after one global-norm clip at `clip_norm` (None: no clip);
  `shared` names the stage leaves that are one parameter of every layer; `stage_layout`, if
  given, lays out the stage group's parameters, state and gradients for the update of an
  optimizer that orthogonalises whole matrices, and its results (FSDP's
  `layer_shards.by_whole_layers`)."""

  tx: optax.GradientTransformation
  clip_norm: float | None = None
  shared: tuple[str, ...] = ()
  stage_layout: Callable[[PyTree], PyTree] | None = None

  def init(self, params: PyTree) -> PyTree:
    """One Optax state per module group, and one for the shared stage leaves if there are any."""
    opt_state = {
      'embed': self.tx.init(params['embed']),
      'stages': jax.vmap(self.tx.init)(params['stages']),
      'head': self.tx.init(params['head']),
    }
    if self.shared:
      opt_state['shared'] = self.tx.init(shared_params(params, self.shared))
    return opt_state

  def apply(self, params, opt_state, grads, ready=None, delay=None):
    """(params, opt_state, grad_norm) after one step of every ready group.

    `ready` and `delay` are {'embed', 'stages' [G], 'head'} trees: whether each group has a
    gradient this step (None: all have), and its version gap (None: no delay anywhere)."""
    num_stages = jax.tree.leaves(params['stages'])[0].shape[0]
    ready = ready or {'embed': True, 'stages': jnp.ones((num_stages,), bool), 'head': True}
    delay = delay or dict.fromkeys(GROUPS)
    groups = dict(params=params, grads=dict(grads), ready=dict(ready), delay=dict(delay))
    if self.shared:
      groups = _with_shared_group(groups, self.shared)
    grads, grad_norm = clip_by_global_norm(groups['grads'], self.clip_norm)

    def update(p, s, g, is_ready, gap):
      new_p, new_s = update_group(self.tx, p, s, g, gap)
      keep = lambda new, old: jnp.where(is_ready, new, old)
      return jax.tree.map(keep, new_p, p), jax.tree.map(keep, new_s, s)

    new_params, new_opt_state = {}, {}
    for group in grads:
      run = jax.vmap(update) if group == 'stages' else update
      layout = self._update_layout(group, opt_state[group])
      params_state_grads = layout((groups['params'][group], opt_state[group], grads[group]))
      new_params[group], new_opt_state[group] = layout(
        run(*params_state_grads, groups['ready'][group], groups['delay'][group])
      )
    if self.shared:
      new_params = _write_shared(new_params, self.shared)
    return new_params, new_opt_state, grad_norm

  def _update_layout(self, group: str, opt_state) -> Callable[[PyTree], PyTree]:
    """How `group`'s update lays out its trees: `stage_layout` for the stage group of an
    optimizer that orthogonalises whole matrices (Muon), else as they are."""
    if group == 'stages' and self.stage_layout and orthogonalises(opt_state):
      return self.stage_layout
    return lambda tree: tree


def orthogonalises(opt_state) -> bool:
  """Whether an Optax state holds Muon's (`optax.contrib.MuonState`, at any depth): its update
  orthogonalises whole matrices."""
  is_muon = lambda node: isinstance(node, optax.contrib.MuonState)
  return any(is_muon(node) for node in jax.tree.leaves(opt_state, is_leaf=is_muon))


def shared_params(params: PyTree, shared: tuple[str, ...]) -> dict:
  """{name: value} of each shared stage leaf; every layer slot holds it, stage 0's first (always
  a real layer) is read."""
  return {name: params['stages'][name][0, 0] for name in shared}


def _with_shared_group(groups: dict, shared: tuple[str, ...]) -> dict:
  """`groups` (params, grads, ready, delay by group) with the shared leaves as one more group.

  Its gradient is the sum over every layer of the ready stages (the chain rule for a parameter
  every layer reads), and the stages' copies get none. It is ready when any stage is. Its delay
  is the largest among the ready stages: its gradient mixes contributions of every stage's
  delay, and the oldest is the one a compensation must not under-correct."""
  grads_stages, ready_G = groups['grads']['stages'], groups['ready']['stages']
  summed = {}
  for name in shared:
    g_GxN = grads_stages[name]
    ready = ready_G.reshape((-1,) + (1,) * (g_GxN.ndim - 1))
    summed[name] = jnp.sum(jnp.where(ready, g_GxN, 0), axis=(0, 1))
  zeroed = {name: jnp.zeros_like(grads_stages[name]) for name in shared}
  delay = groups['delay']['stages']
  if delay is not None:
    delay = jnp.max(jnp.where(ready_G, jnp.asarray(delay), 0))
  add = lambda tree, value: {**tree, 'shared': value}
  return {
    'params': add(groups['params'], shared_params(groups['params'], shared)),
    'grads': add({**groups['grads'], 'stages': {**grads_stages, **zeroed}}, summed),
    'ready': add(groups['ready'], jnp.any(ready_G)),
    'delay': add(groups['delay'], delay),
  }


def _write_shared(new_params: dict, shared: tuple[str, ...]) -> dict:
  """The groups' new params with the shared group's value written to every layer slot."""
  new_params = dict(new_params)
  one = new_params.pop('shared')
  stages = new_params['stages']
  every_slot = {name: jnp.broadcast_to(one[name], stages[name].shape) for name in shared}
  return {**new_params, 'stages': {**stages, **every_slot}}


def clip_by_global_norm(grads, clip_norm: float | None):
  """(grads scaled so their global norm is at most clip_norm (None: unchanged), the norm)."""
  grad_norm = optax.tree.norm(grads)
  if clip_norm:
    scale = jnp.minimum(1.0, clip_norm / (grad_norm + 1e-6))
    grads = jax.tree.map(lambda g: g * scale.astype(g.dtype), grads)
  return grads, grad_norm


def update_group(tx, params, opt_state, grads, delay=None):
  """One optimizer step of one module group: (new params, new optimizer state). `delay` is
  passed to tx as the Optax extra argument."""
  updates, opt_state = optax.with_extra_args_support(tx).update(
    grads, opt_state, params, delay=delay
  )
  return optax.apply_updates(params, updates), opt_state
