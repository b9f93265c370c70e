"""Where each device's Ouroboros stash slots live (`--stash-memory`).

Group s keeps what its backward needs of each item in flight in N_s micro-batch slots, item u in
slot u % N_s (`delays.Timing.group_stash_slots`: 2(G - s) + 1 pipelined and streamed). SPMD gives
every device one buffer shape, so with the stash on the device ('device', or 'pinned_host' in the
host's memory) every device holds the deepest group's N_0 slots, where group s uses N_s of them:
at G = 8 pipelined 8 x 17 = 136 slots for the 80 in use.

'balanced' pairs group s with its mirror m = G - 1 - s, whose needs sum to about the same for
every pair (2G + 4 pipelined and streamed), and gives every device

    K = max over s of ceil((N_s + N_m) / 2)        (G + 2 pipelined and streamed)

slots. A group with N_s <= K keeps every item at home. A deep group (N_s > K) keeps slots
0 .. K - 1 at home and lends its slots K .. N_s - 1 to its mirror, which holds them in its own
unused slots N_m .. K - 1 (N_s - K <= K - N_m by K's choice). An item in a lent slot goes to the
mirror at its forward and comes back in the round of its backward: one `ppermute` of an item each
way every round between the paired devices. Nothing else changes: the same items wait from the
same forward to the same backward, so the training is bit for bit the same.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from ouroboros_jax.schedules import ring as ring_lib
from ouroboros_jax.schedules.delays import Timing
from ouroboros_jax.staged import STAGE


@dataclasses.dataclass(frozen=True)
class SlotLayout:
  """The stash slots of a ring: what each group needs and what each device holds."""

  needs: tuple[int, ...]  # N_s: the slots group s needs (Timing.group_stash_slots)
  slots: int  # K: the slots every device holds
  balanced: bool  # whether deep groups lend slots to their mirrors

  @property
  def lenders(self) -> tuple[tuple[int, int], ...]:
    """(s, m): each deep group s and the mirror that holds its slots K .. N_s - 1."""
    last = len(self.needs) - 1
    return tuple((s, last - s) for s, n in enumerate(self.needs) if n > self.slots)

  def held_by(self, stage: int) -> int:
    """Slots device `stage` fills: its own group's up to K, and what its deep mirror lends."""
    mirror = len(self.needs) - 1 - stage
    own = min(self.needs[stage], self.slots)
    return own + (self.needs[mirror] - self.slots if (mirror, stage) in self.lenders else 0)


def layout(timing: Timing, stash_memory: str) -> SlotLayout:
  """The slot layout of a ring with this timing and `--stash-memory`."""
  needs = tuple(timing.group_stash_slots(s) for s in range(timing.num_stages))
  if stash_memory != 'balanced':
    return SlotLayout(needs, max(needs), balanced=False)
  last = len(needs) - 1
  pairs = max(math.ceil((n + needs[last - s]) / 2) for s, n in enumerate(needs))
  return SlotLayout(needs, pairs, balanced=True)


def _own_slot(plan: SlotLayout, item, stage):
  """Item's slot among group `stage`'s N_s (home below K, lent from K on)."""
  return item % jnp.asarray(plan.needs)[stage]


def _guest_slot(plan: SlotLayout, mirror_item, stage):
  """Where device `stage` holds its deep mirror's item: past its own N_s slots, clipped in
  range for a mirror that lends nothing (the value is then never used)."""
  mirror = len(plan.needs) - 1 - stage
  lent = _own_slot(plan, mirror_item, mirror) - plan.slots
  return jnp.clip(jnp.asarray(plan.needs)[stage] + lent, 0, plan.slots - 1), lent >= 0


def _swap(tree, perm):
  """`tree` sent along `perm` (pairs of stage indices); zeros where nothing arrives. PRNG keys
  travel as their raw data."""

  def send(a):
    if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
      data = jax.lax.ppermute(jax.random.key_data(a), STAGE, perm)
      return jax.random.wrap_key_data(data, impl=jax.random.key_impl(a))
    return jax.lax.ppermute(a, STAGE, perm)

  return jax.tree.map(send, tree)


def write(plan: SlotLayout, stash_K, kept, item, active, mirror_item, mirror_active, stage):
  """The stash after device `stage` keeps `kept` of `item` (where `active`), its forward of the
  round. Balanced, a deep group's item for a lent slot goes to its mirror, which stores it in
  the round its forward runs (`mirror_item`, `mirror_active`: the mirror group's forward)."""
  if not plan.balanced:
    return ring_lib.write_slot_where(stash_K, kept, item, plan.slots, active)
  slot = _own_slot(plan, item, stage)
  at_home = active & (slot < plan.slots)
  home = jnp.minimum(slot, plan.slots - 1)
  stash_K = ring_lib.write_slot_where(stash_K, kept, home, plan.slots, at_home)
  if not plan.lenders:
    return stash_K
  guest = _swap(kept, plan.lenders)
  guest_slot, lent = _guest_slot(plan, mirror_item, stage)
  return ring_lib.write_slot_where(stash_K, guest, guest_slot, plan.slots, mirror_active & lent)


def lent_back(plan: SlotLayout, stash_K, mirror_item, stage):
  """Balanced, on its way back to each deep group at the start of a round: the item its backward
  reads this round if it sits in a lent slot, read by the mirror as the round starts (its
  forward of the round never writes the slot its backward reads: `Timing.group_stash_slots`),
  so the transfer can overlap the forward. `mirror_item`: the mirror group's backward of the
  round. None where nothing is lent."""
  if not plan.balanced or not plan.lenders:
    return None
  guest_slot, _ = _guest_slot(plan, mirror_item, stage)
  lent = ring_lib.read_slot(stash_K, guest_slot, plan.slots)
  return _swap(lent, tuple((m, s) for s, m in plan.lenders))


def read(plan: SlotLayout, stash_K, item, back, stage):
  """What device `stage` kept of `item`, its backward of the round: from its own slots, or
  `back` (`lent_back`) for an item in a lent slot."""
  if not plan.balanced:
    return ring_lib.read_slot(stash_K, item, plan.slots)
  slot = _own_slot(plan, item, stage)
  home = ring_lib.read_slot(stash_K, jnp.minimum(slot, plan.slots - 1), plan.slots)
  return home if back is None else ring_lib.select(slot < plan.slots, home, back)
