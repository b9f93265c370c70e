"""A slow, single-device Ouroboros written straight from the equations (DESIGN.md, section 3).

A Python loop over steps and over modules, with explicit deques: `stashes[s]` holds what group s
kept of every batch still in flight, `inbox[s]` the error gradient for group s's output that
arrived during the previous step. Nothing is sharded, nothing is jitted: it exists so the tests
can check the real schedule (`ouroboros.py`) number for number. (The model's pieces and the
optimizer update are each jitted on their own, only so that the loop runs in seconds.)
"""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp

from ouroboros_jax import staged
from ouroboros_jax.ouroboros import staleness
from ouroboros_jax.staged import EMBED_PIECE


def expected_backward_batch(t: int, stage: int, num_stages: int, forward: str) -> int:
  """The batch group `stage` back-propagates at step t (derived in ouroboros.py's docstring)."""
  if num_stages == 1:
    return t
  if forward == 'pipelined':
    return t - 2 * num_stages + stage
  return t - staleness(num_stages)[stage]


def run(model: staged.StagedModel, tx, params, batches, *, stash: str = 'graph',
        forward: str = 'locked', clip_norm: float | None = 1.0, seed: int = 0,
        tied_grad: str = 'sum', sync_warmup_steps: int = 0):
  """Trains on `batches` in order; returns (params, losses, updated).

  losses[t] is the loss the head computed at step t (None while the pipe fills), updated[t] lists
  the groups ('embed', 0..G-1, 'head') that changed their weights at step t.

  forward='locked': batch t runs through every group at step t (the paper).
  forward='pipelined': at step t group 0 forwards batch t and group s > 0 forwards what group
  s - 1 produced at step t - 1; the head sees group G-1's output one step later.
  """
  num_stages = staged.stage_count(params)
  pipelined = forward == 'pipelined' and num_stages > 1
  model = staged.StagedModel(embed=jax.jit(model.embed), stage=jax.jit(model.stage),
                             loss=jax.jit(model.loss), tied_embedding=model.tied_embedding)
  apply_gradients = jax.jit(
      lambda *args, **kw: staged.apply_gradients(tx, *args, clip_norm=clip_norm, **kw))
  opt_state = staged.init_opt_state(tx, params)
  stashes = [collections.deque() for _ in range(num_stages)]  # (batch, VJP or input) in flight
  delta_inbox = [None] * num_stages   # error gradient for group s's output, sent last step
  act_inbox = [None] * num_stages     # pipelined: (batch, activation) for group s, sent last step
  head_inbox = None                   # pipelined: (batch, group G-1's output), sent last step
  losses, updated = [], []
  zeros = lambda tree: jax.tree.map(jnp.zeros_like, tree)
  stage_params = lambda p, s: jax.tree.map(lambda a: a[s], p['stages'])

  for t, batch in enumerate(batches):
    key_t = staged.batch_key(seed, t)
    if t < sync_warmup_steps:
      (loss, _), grads = jax.value_and_grad(model.forward_loss, has_aux=True)(params, batch, key_t)
      params, opt_state, _ = apply_gradients(params, opt_state, grads)
      losses.append(float(loss))
      updated.append(['embed', *range(num_stages), 'head'])
      continue

    # Forward with the current weights; every group keeps its VJP (graph) or its input (replay).
    new_act = [None] * num_stages
    carried = (t, model.embed(params['embed'], batch['inputs'],
                              staged.piece_rng(key_t, EMBED_PIECE)))
    for s in range(num_stages):
      if pipelined and s > 0:
        carried = act_inbox[s]
      if carried is None:             # pipelined: nothing has reached this group yet
        continue
      b, x = carried
      key_b = staged.batch_key(seed, b)
      run_s = lambda p, h, s=s, key_b=key_b: model.stage(p, h, s, staged.piece_rng(key_b, s))
      if stash == 'graph':
        y, vjp_fn = jax.vjp(run_s, stage_params(params, s), x)
        stashes[s].append((b, vjp_fn))
      else:
        y = run_s(stage_params(params, s), x)
        stashes[s].append((b, x))
      carried = (b, y)
      if pipelined:
        new_act[(s + 1) % num_stages] = carried
    head_input = head_inbox if pipelined else carried
    if pipelined:
      head_inbox, act_inbox = new_act[0], new_act

    # Module K: fresh loss and gradients of the batch that reached the head.
    g_head, g_embed = zeros(params['head']), zeros(params['embed'])
    delta_head = None
    if head_input is None:
      losses.append(None)
    else:
      b, x = head_input
      targets = batches[b]['targets']
      loss, head_vjp = jax.vjp(lambda hp, ep, h: model.loss(hp, ep, h, targets)[0],
                               params['head'], params['embed'], x)
      g_head, g_embed, delta_head = head_vjp(jnp.ones_like(loss))
      losses.append(float(loss))

    # Every group back-propagates the batch its delayed error gradient belongs to.
    new_inbox = [None] * num_stages
    g_stages = [zeros(stage_params(params, s)) for s in range(num_stages)]
    ready = [False] * num_stages
    for s in range(num_stages):
      delta = delta_head if num_stages == 1 else delta_inbox[s]
      if delta is None:
        continue
      b, kept = stashes[s].popleft()
      assert b == expected_backward_batch(t, s, num_stages, forward), (s, b, t)
      key_b = staged.batch_key(seed, b)
      if stash == 'graph':
        g_stages[s], dx = kept(delta)
      else:
        run_s = lambda p, h, s=s: model.stage(p, h, s, staged.piece_rng(key_b, s))
        g_stages[s], dx = jax.vjp(run_s, stage_params(params, s), kept)[1](delta)
      ready[s] = True
      if s > 0:
        new_inbox[s - 1] = dx
      else:  # module 1 ends at the embedding of batch b
        embed_b = lambda e: model.embed(e, batches[b]['inputs'],
                                        staged.piece_rng(key_b, EMBED_PIECE))
        g_stale = jax.vjp(embed_b, params['embed'])[1](dx)[0]
        g_embed = jax.tree.map(jnp.add, g_embed, g_stale)
        if tied_grad == 'mean' and model.tied_embedding and delta_head is not None:
          g_embed = jax.tree.map(lambda g: 0.5 * g, g_embed)
    if num_stages > 1:
      new_inbox[num_stages - 1] = delta_head
    delta_inbox = new_inbox

    grads = {'embed': g_embed, 'head': g_head,
             'stages': jax.tree.map(lambda *g: jnp.stack(g), *g_stages)}
    head_ready = delta_head is not None
    embed_ready = (model.tied_embedding and head_ready) or ready[0]
    params, opt_state, _ = apply_gradients(params, opt_state, grads, embed_ready=embed_ready,
                                           stages_ready_G=jnp.asarray(ready),
                                           head_ready=head_ready)
    updated.append((['embed'] if embed_ready else []) +
                   [s for s in range(num_stages) if ready[s]] + (['head'] if head_ready else []))
  return params, losses, updated
