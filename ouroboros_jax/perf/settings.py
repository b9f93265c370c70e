"""The settings `plan` and `bench` try: one record of what to try (`Tries`, the --try-* flags of
both, its defaults stated here once), one list of the settings it gives (`settings`) and one way
to pick some by label (`select`, --only).

    tries = Tries(microbatches=(4, 8), stashes=('graph/nothing',), flows=('batch', 'stream'))
    for setting in settings(8, tries, num_layers=24):  # ScheduleConfigs, as flags spell them
      print(setting.label)                             # 'ouroboros G=4xR=2 M=8 stream locked/graph'

A setting is a ScheduleConfig (its `auto`s unresolved): `plan` resolves each as the run it
compiles does (`TrainConfig.schedule_config`), `bench` on its own devices
(`ScheduleConfig.resolve`).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from ouroboros_jax.choices import (
  EXACT_PIPELINES,
  FLOW_MODES,
  FORWARD_MODES,
  SCHEDULES,
  STASH_MEMORIES,
  STASH_POLICY_NAMES,
)
from ouroboros_jax.errors import ConfigError
from ouroboros_jax.schedules import ScheduleConfig
from ouroboros_jax.schedules.config import AUTO

# Every policy of the graph stash (as every other schedule may recompute), and the replay stash.
STASH_SETTINGS = (*(f'graph/{p}' for p in STASH_POLICY_NAMES), 'replay')
DEFAULT_STASH = ('graph/nothing', 'replay', 'graph/all')
DEFAULT_MICROBATCHES = (8,)
# What the other schedules' forward keeps (--stash-policy): every residual, or the group's (the
# layer's, for backprop) input with the forward re-run in the backward. Like with like: each
# schedule gets the recomputation Ouroboros' default stash has.
DEFAULT_POLICIES = ('all', 'nothing')
# How data_parallel, and a stage schedule on several replicas, keep their state: whole on every
# replica, its optimizer state and update split over them (--shard-update, ZeRO-1), or all of it
# split over them (--fsdp). `sharding_fields` turns one into the ScheduleConfig's fields.
SHARDINGS = ('replicated', 'update', 'fsdp')


def sharding_fields(sharding: str) -> dict:
  """The ScheduleConfig fields of one of SHARDINGS."""
  return {'fsdp': sharding == 'fsdp', 'shard_update': sharding == 'update'}


@dataclasses.dataclass(frozen=True)
class Tries:
  """The settings to try (the --try-* flags of `plan` and `bench`): each count of
  `microbatches`, each of `stashes` (STASH_SETTINGS, Ouroboros'), each of `policies`
  (staging.STASH_POLICIES, every other schedule's), the `schedules` (None: all), each of
  `memories` (where Ouroboros' stash waits), each of Ouroboros' `forwards` and `flows` (None:
  the run's own --flow), each G of `stages` (None: `default_stages`) and each of data_parallel's
  `shardings` (SHARDINGS)."""

  microbatches: tuple[int, ...] = DEFAULT_MICROBATCHES
  stashes: tuple[str, ...] = DEFAULT_STASH
  policies: tuple[str, ...] = DEFAULT_POLICIES  # the other schedules' --stash-policy
  schedules: tuple[str, ...] | None = None
  memories: tuple[str, ...] = ('device',)
  forwards: tuple[str, ...] = FORWARD_MODES
  flows: tuple[str, ...] | None = None
  stages: tuple[int, ...] | str | None = None  # 'all': every factorisation (`factorisations`)
  shardings: tuple[str, ...] = SHARDINGS


def default_stages(num_devices: int, num_layers: int | None = None) -> int:
  """The G tried without --try-stages: every device in one ring, or, where the model has fewer
  layers than devices, the most stages that divide the devices and hold a layer each (the other
  devices data replicas)."""
  if num_layers is None or num_layers >= num_devices:
    return num_devices
  return max(g for g in range(1, num_devices + 1) if num_devices % g == 0 and g <= num_layers)


def factorisations(num_devices: int, num_layers: int | None = None) -> tuple[int, ...]:
  """Every G of a D x G layout of `num_devices` (G stages, D = num_devices / G data replicas)
  whose G stages a model of `num_layers` fills, G >= 2; a ConfigError where there is none."""
  found = tuple(
    g
    for g in range(2, num_devices + 1)
    if num_devices % g == 0 and (num_layers is None or g <= num_layers)
  )
  if not found:
    layers = f' with {num_layers} layers' if num_layers is not None else ''
    raise ConfigError(
      f'{num_devices} devices cannot be cut into stages of a model{layers}: no G >= 2 divides '
      'them that the layers fill; try data_parallel (--try-schedules) or other devices.'
    )
  return found


# ScheduleConfig's fields that Ouroboros alone reads: the other schedules' settings keep their
# defaults, so a run's --flow or --tied-grad applies to the Ouroboros rows and refuses no other.
_OUROBOROS_ONLY = ('stash', 'stash_memory', 'forward', 'flow', 'sync_warmup_steps', 'tied_grad')


def _check_choices(flag: str, given: Sequence, known: Sequence, what: str) -> None:
  """One line for the first value of `given` that is not one of `known`."""
  unknown = [v for v in given if v not in known]
  if unknown:
    raise ConfigError(
      f'unknown {what} {unknown[0]!r}; choose {flag} from {", ".join(map(str, known))}.'
    )


def _check_tries(tries: Tries, num_devices: int, stages: Sequence[int]) -> None:
  """A ConfigError naming the --try-* flag of the first value of `tries` it cannot try."""
  for g in stages:
    if g < 1 or num_devices % g:
      raise ConfigError(
        f'--try-stages {g} does not divide the {num_devices} devices into data replicas; '
        f'choose divisors of {num_devices}.'
      )
  _check_choices('--try-stash-memory', tries.memories, STASH_MEMORIES, 'stash memory')
  _check_choices('--try-schedules', tries.schedules or (), SCHEDULES, 'schedule')
  _check_choices('--try-stash', tries.stashes, STASH_SETTINGS, 'stash setting')
  _check_choices('--try-policy', tries.policies, STASH_POLICY_NAMES, 'stash policy')
  _check_choices('--try-forward', tries.forwards, FORWARD_MODES, 'forward')
  _check_choices('--try-flow', tries.flows or (), FLOW_MODES, 'flow')
  _check_choices('--try-sharding', tries.shardings, SHARDINGS, 'sharding')


def _stash_fields(stash: str) -> dict[str, str]:
  """A --try-stash setting ('graph/POLICY' or 'replay') as ScheduleConfig's stash fields."""
  mode, _, policy = stash.partition('/')
  return dict(stash=mode, stash_policy=policy or AUTO)


def settings(
  num_devices: int,
  tries: Tries = Tries(),
  base: ScheduleConfig = ScheduleConfig(),
  num_layers: int | None = None,
) -> list[ScheduleConfig]:
  """Every setting of `tries` on `num_devices` devices, each the ScheduleConfig `base` (the run's
  own) with what the tries choose: backprop, data_parallel over every device, and at each G of
  tries.stages (None: `default_stages` for a model of `num_layers`; 'all': every
  factorisation), with num_devices / G data
  replicas, model_parallel, gpipe and the exact pipelines at each M and policy, Ouroboros at
  each M, forward, stash (and its policy), memory and flow. The Ouroboros-only fields of `base`
  go to the Ouroboros settings alone, its --chunks to the interleaved ones."""
  if tries.stages == 'all':
    stages = factorisations(num_devices, num_layers)
  else:
    stages = tries.stages or (default_stages(num_devices, num_layers),)
  _check_tries(tries, num_devices, stages)
  defaults = ScheduleConfig()

  def setting(name, **fields) -> ScheduleConfig:
    own = {} if name == 'ouroboros' else {f: getattr(defaults, f) for f in _OUROBOROS_ONLY}
    if name != 'interleaved':
      own['chunks'] = defaults.chunks
    fields = {'num_stages': 1, 'data_parallel': 1, 'microbatches': None, **fields}
    fields = {**sharding_fields('replicated'), **fields}
    return dataclasses.replace(base, **own, name=name, **fields)

  policies = tries.policies
  out = [setting('backprop', stash_policy=p) for p in policies]
  if num_devices > 1:
    out += [
      setting('data_parallel', data_parallel=num_devices, stash_policy=p, **sharding_fields(s))
      for s in tries.shardings
      for p in policies
    ]
  for g in (g for g in stages if g > 1):
    replicas = num_devices // g  # the state splits over a stage's replicas: only where there are
    for sharded in [s for s in tries.shardings if s == 'replicated' or replicas > 1]:
      on = dict(num_stages=g, data_parallel=replicas, **sharding_fields(sharded))
      out += [setting('model_parallel', **on, stash_policy=p) for p in policies]
      for name in ('gpipe', *EXACT_PIPELINES):
        out += [
          setting(name, **on, microbatches=m, stash_policy=p)
          for m in tries.microbatches
          for p in policies
        ]
      out += [setting('ouroboros', **on, **ring) for ring in _ring_fields(tries, base)]
  return [s for s in out if tries.schedules is None or s.name in tries.schedules]


def _ring_fields(tries: Tries, base: ScheduleConfig) -> list[dict]:
  """The Ouroboros fields of every ring `tries` asks for: forward x stash x memory x flow x M."""
  return [
    dict(forward=forward, stash_memory=memory, flow=flow, microbatches=m, **_stash_fields(stash))
    for forward in tries.forwards
    for stash in tries.stashes
    for memory in tries.memories
    for flow in tries.flows or (base.flow,)
    for m in tries.microbatches
  ]


def select(candidates: Sequence[ScheduleConfig], only: str | None) -> list[ScheduleConfig]:
  """The settings of `candidates` that --only names: comma-separated labels, each the label of
  one setting (that setting alone) or a prefix of several (all of them), in the order `only`
  names them (a run cut short has measured the settings named first); a name that matches none
  is a ConfigError listing the labels. None: every candidate."""
  if only is None:
    return list(candidates)
  labels = ', '.join(s.label for s in candidates)
  names = [p.strip() for p in only.split(',') if p.strip()]
  if not names:
    raise ConfigError(
      f'--only {only!r} names no setting; give comma-separated labels or label prefixes from: '
      f'{labels} (or drop --only to run them all).'
    )
  chosen = {name: _matching(candidates, name) for name in names}
  unknown = [name for name, matched in chosen.items() if not matched]
  if unknown:
    names = ', '.join(map(repr, unknown))
    raise ConfigError(
      f'--only {names} matches no setting; labels are: {labels} (--try-* flags try others).'
    )
  return list(dict.fromkeys(s for matched in chosen.values() for s in matched))


def _matching(candidates: Sequence[ScheduleConfig], name: str) -> list[ScheduleConfig]:
  """The setting labelled `name`, or else every setting whose label starts with it."""
  exact = [s for s in candidates if s.label == name]
  return exact or [s for s in candidates if s.label.startswith(name)]
