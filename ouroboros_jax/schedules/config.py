"""`ScheduleConfig`: how a schedule places and runs the model (every schedule reads this one)."""

from __future__ import annotations

import dataclasses
import functools
import math

from ouroboros_jax.choices import (
  DEFAULT_STASH_POLICY,
  EXACT_PIPELINES,
  FLOW_MODES,
  FORWARD_MODES,
  MICROBATCHED,
  SCHEDULES,
  STASH_MEMORIES,
  STASH_MODES,
  STASH_POLICY_NAMES,
  TIED_GRAD_MODES,
)
from ouroboros_jax.errors import ConfigError, field_ref
from ouroboros_jax.schedules.compensation import Compensation, check_fits, parse
from ouroboros_jax.schedules.delays import unit_gap_microbatches

DEFAULT_MICROBATCHES = 4  # gpipe and the exact pipelines without --microbatches
# Ouroboros without --microbatches, as one batch: the whole batch at once on CPU, where memory is
# plentiful and small chunks only add steps; on an accelerator up to 8 micro-batches
# (`ScheduleConfig.resolve`): chunked and streamed, GPT-2-small at batch 32 fits four v5e chips in a
# fraction of what the whole batch needs (the TPU compiler's numbers:
# docs/results/README.md#m-like-with-like-gpt2). Streamed (the recipe's flow), at least enough
# micro-batches that every gradient is one update old (G locked, 2G pipelined:
# `delays.unit_gap_microbatches`; where the 8 above are fewer, the fewest such that divide the
# replica's batch, else one sequence a micro-batch): the best time to quality measured, since the
# gap to backprop follows the gradient's age (age 1 within 2% in every run, age 4 3.9-5.7%
# behind) while the ring's predicted step does not grow with M (docs/results/README.md#q-regime).
OUROBOROS_MICROBATCHES = 1
OUROBOROS_ACCELERATOR_MICROBATCHES = 8

# The compensation 'auto' (ScheduleConfig's default, and --compensation's) gives a delayed ring,
# Ouroboros with G > 1 (`ScheduleConfig.resolve_compensation`): weight prediction for the forward
# and DC-ASGD's delay compensation, the best recipe measured (docs/results/README.md#q-stream).
# DC needs the graph stash; with replay the recipe is Muon + prediction. Without delay 'auto' is
# none. The paper's method is `Compensation()`.
AUTO = 'auto'
RECIPE_COMPENSATION = 'predict,dc'
RECIPE_COMPENSATION_REPLAY = 'predict'


@dataclasses.dataclass(frozen=True)
class ScheduleConfig:
  """How a schedule places and runs the model; fields a schedule does not use are ignored."""

  # The CLI names two fields differently: --schedule is `name`, --stages is `num_stages`.
  name: str = 'backprop'
  num_stages: int = 1
  data_parallel: int = 1
  clip_norm: float | None = 1.0  # global-norm clipping before the update; None or 0: off
  seed: int = 0  # dropout keys from (seed, batch index); TrainConfig sets it
  microbatches: int | None = None  # gpipe and the exact pipelines (MICROBATCHED): micro-batches
  # per replica's batch; None: DEFAULT_MICROBATCHES there (`num_microbatches`), 1 elsewhere
  chunks: int | None = None  # interleaved: model chunks per device (None: 2; zb_v: always 2)
  stash: str = 'graph'  # ouroboros: 'graph' (DDG) or 'replay' (Features Replay)
  stash_policy: str = AUTO  # every schedule: which residuals a layer group's forward keeps for
  # its backward, the rest recomputed (staging.STASH_POLICIES); 'auto': `resolved_stash_policy`
  stash_memory: str = 'device'  # ouroboros: where the stash waits (choices.STASH_MEMORIES)
  forward: str = 'locked'  # ouroboros: 'locked' (the paper) or 'pipelined'
  flow: str = 'auto'  # ouroboros: a step's micro-batches travel the ring as one batch ('batch',
  # the paper's delays) or stream across updates ('stream': ceil(lag / M) updates; delays.py);
  # 'auto': `resolved_flow`
  sync_warmup_steps: int = 0  # ouroboros: plain backprop over the ring first
  tied_grad: str = 'sum'  # ouroboros: 'sum' or 'mean' of the tied embedding's two grads
  compensation: Compensation | str = AUTO  # ouroboros: staleness compensation, a Compensation
  # record or 'auto', the recipe (`resolve_compensation`); Compensation(): none, the paper's method
  fsdp: bool = False  # parameters, gradients and optimizer state sharded over the data replicas,
  # gathered where a layer runs (data_parallel: schedules/fsdp.py; a stage schedule with
  # data_parallel > 1: layer_shards.py)
  shard_update: bool = False  # ZeRO-1: the optimizer state and its update split over the data
  # replicas, the weights whole on each (gathered once a step, after the update); fsdp does this
  # and also splits the weights (placement.sharded_update_shardings)

  def validate(self) -> None:
    """One-line ConfigError, naming the field, for a setting no schedule can run (checked once
    per config: `TrainConfig.validate` and `build_schedule` both ask)."""
    self._validated  # noqa: B018

  @functools.cached_property
  def _validated(self) -> bool:
    self._check_values()
    _check_compensation(self.compensation)
    if self.name == 'backprop' and self.data_parallel > 1:
      raise ConfigError(
        f'backprop runs on one device; for {self.data_parallel} replicas use '
        f'{field_ref("name", "data_parallel")}.'
      )
    if self.name != 'ouroboros':  # the Ouroboros-only settings must not pass silently
      self._check_no_ouroboros_settings()
    # Replay keeps the input alone, which is 'nothing' (how its resolved record spells it).
    if self.stash == 'replay' and self.stash_policy not in (AUTO, DEFAULT_STASH_POLICY):
      raise ConfigError(
        f'{field_ref("stash_policy", self.stash_policy)} chooses what '
        f'{field_ref("stash", "graph")} keeps, and {field_ref("stash", "replay")} keeps only '
        f'the input; drop it or use {field_ref("stash", "graph")}.'
      )
    self._check_sharding()
    if self.name not in MICROBATCHED and self.microbatches not in (None, 1):
      raise ConfigError(
        f'{field_ref("microbatches", self.microbatches)} applies to '
        f'{field_ref("name")} {", ".join(MICROBATCHED)} only, not {self.name} (it steps on the '
        'whole batch); drop it.'
      )
    if self.name in tables_names():
      from ouroboros_jax.schedules import tables

      tables.build(self.name, self.num_stages, self.num_microbatches, self.chunks)
    elif self.chunks not in (None, 1):
      raise ConfigError(
        f'{field_ref("chunks", self.chunks)} applies to {field_ref("name", "interleaved")} '
        f'only, not {self.name}; drop it.'
      )
    check_fits(self.resolved_compensation, self.stash)
    return True

  def _check_sharding(self) -> None:
    """fsdp and shard_update split state over the data replicas: they need some, and fsdp
    already splits the update."""
    if self.fsdp and self.shard_update:
      raise ConfigError(
        f'{field_ref("fsdp", True)} already splits the optimizer state and update over the '
        f'replicas (and the weights too); drop {field_ref("shard_update", True)}.'
      )
    for field in ('fsdp', 'shard_update'):
      single = self.data_parallel == 1 and (field == 'shard_update' or self.name != 'data_parallel')
      if getattr(self, field) and single:
        raise ConfigError(
          f'{field_ref(field, True)} splits the state over data replicas, and {self.name} has '
          f'one; give it {field_ref("data_parallel", 2)} or more, or drop it.'
        )

  def _check_values(self) -> None:
    """Each field alone: the counts in range, the named choices known."""
    for name in ('num_stages', 'data_parallel', 'microbatches'):
      if getattr(self, name) is not None and getattr(self, name) < 1:
        raise ConfigError(
          f'{field_ref(name)} must be >= 1, got {getattr(self, name)}; set it to a positive '
          'integer.'
        )
    if self.sync_warmup_steps < 0:
      raise ConfigError(
        f'{field_ref("sync_warmup_steps")} must be >= 0, got {self.sync_warmup_steps}.'
      )
    if self.clip_norm is not None and self.clip_norm < 0:
      raise ConfigError(
        f'{field_ref("clip_norm")} must be >= 0 (0 turns clipping off), got {self.clip_norm}.'
      )
    for name, choices in (
      ('name', SCHEDULES),
      ('stash', STASH_MODES),
      ('stash_policy', (AUTO, *STASH_POLICY_NAMES)),
      ('stash_memory', STASH_MEMORIES),
      ('forward', FORWARD_MODES),
      ('flow', FLOW_MODES),
      ('tied_grad', TIED_GRAD_MODES),
    ):
      if getattr(self, name) not in choices:
        raise ConfigError(
          f'unknown {field_ref(name, getattr(self, name))}; choose one of {", ".join(choices)}.'
        )

  def _check_no_ouroboros_settings(self) -> None:
    """Another schedule than Ouroboros: no Ouroboros-only field off its default, no compensation."""
    defaults = ScheduleConfig()
    # Every other schedule takes each batch as one: its resolved record spells flow 'batch'.
    also = {'flow': 'batch'}
    for name in ('stash', 'stash_memory', 'forward', 'flow', 'sync_warmup_steps', 'tied_grad'):
      if getattr(self, name) not in (getattr(defaults, name), also.get(name)):
        raise ConfigError(
          f'{field_ref(name, getattr(self, name))} applies to '
          f'{field_ref("name", "ouroboros")} only, not {self.name}; drop it or use '
          f'{field_ref("name", "ouroboros")}.'
        )
    if self.resolved_compensation.active:
      raise ConfigError(
        f'{field_ref("compensation", ",".join(self.resolved_compensation.names()))} compensates '
        f'delayed gradients, and {field_ref("name", self.name)} has none; use '
        f'{field_ref("name", "ouroboros")} or {field_ref("compensation", "none")}.'
      )

  @property
  def delayed(self) -> bool:
    """Ouroboros with more than one group: gradients arrive late."""
    return self.name == 'ouroboros' and self.num_stages > 1

  def resolve_compensation(
    self,
    spec: Compensation | str | None = None,
    *,
    steps: int = 0,
    dc_lambda: float = 1.0,
    shrink: float = 0.5,
    pipemare_steps: int = 0,
    predict_horizon: float = 1.0,
  ) -> Compensation:
    """The one resolution of a staleness compensation, for the Python API
    (`resolved_compensation`: this config's own) and the CLI (`TrainConfig.resolved_compensation`:
    --compensation and its strengths). `spec` (None: this config's ‹compensation›): a
    Compensation record is itself; 'auto' is the recipe on a delayed ring (RECIPE_COMPENSATION, or
    RECIPE_COMPENSATION_REPLAY with the replay stash, which cannot take dc) and none elsewhere;
    any other --compensation spec ('none', 'predict,dc') is parsed with the strengths
    (`compensation.parse`; pipemare_steps 0: a quarter of `steps`)."""
    spec = self.compensation if spec is None else spec
    if isinstance(spec, Compensation):
      return spec
    if spec == AUTO:
      spec = (
        'none'
        if not self.delayed
        else RECIPE_COMPENSATION
        if self.stash == 'graph'
        else RECIPE_COMPENSATION_REPLAY
      )
    return parse(
      spec,
      steps=steps,
      dc_lambda=dc_lambda,
      shrink=shrink,
      pipemare_steps=pipemare_steps,
      predict_horizon=predict_horizon,
    )

  @property
  def resolved_compensation(self) -> Compensation:
    """This config's ‹compensation› as the record the schedule applies ('auto' resolved)."""
    _check_compensation(self.compensation)
    return self.resolve_compensation()

  @property
  def replays(self) -> bool:
    """Ouroboros' replay stash (Features Replay): each group keeps only its input and re-runs
    its forward in the backward, so no stash policy applies to it. Decided here alone."""
    return self.name == 'ouroboros' and self.stash == 'replay'

  @property
  def stash_label(self) -> str:
    """What the forward keeps for its backward, as the reports print it: Ouroboros' stash and
    its policy ('graph/nothing', 'replay'), every other schedule's policy ('all': no
    recomputation)."""
    if self.name != 'ouroboros':
      return self.resolved_stash_policy
    return 'replay' if self.replays else f'graph/{self.resolved_stash_policy}'

  @property
  def resolved_stash_policy(self) -> str:
    """--stash-policy auto: DEFAULT_STASH_POLICY ('nothing': each group's input and weights,
    the forward recomputed in the backward) on Ouroboros, whose ring holds G batches' stashes;
    'all' (no recomputation) on every other schedule. Any policy applies to any schedule and
    changes memory and time, never the gradient: backprop and data parallelism recompute per
    layer, model_parallel and the table pipelines per layer group (docs/results/memory.md)."""
    if self.stash_policy != AUTO:
      return self.stash_policy
    return DEFAULT_STASH_POLICY if self.name == 'ouroboros' else 'all'

  @property
  def resolved_flow(self) -> str:
    """--flow auto: 'stream' under a staleness compensation (the recipe: every gradient one update
    old once M reaches the lag, docs/results/README.md#q-stream), 'batch' without one (the paper's
    method, bit for bit)."""
    if self.flow != 'auto':
      return self.flow
    return 'stream' if self.resolved_compensation.active else 'batch'

  def resolve(self, platform: str, batch_size: int | None = None) -> ResolvedSchedule:
    """This config as it runs on `platform` ('cpu', 'gpu', 'tpu') with batches of `batch_size`
    rows: the one resolution of its defaults, every `auto` and None written out (a
    `ResolvedSchedule`). The compensation becomes its record (`resolved_compensation`), the stash
    policy the schedule's own (`resolved_stash_policy`), Ouroboros' flow its `resolved_flow`
    (other schedules: 'batch'), the chunks the schedule's count, no clip 0.0, and the
    micro-batches `num_microbatches` except Ouroboros' without --microbatches, which cut each
    replica's batch: as one batch, into the largest power-of-two divisor of it up to
    OUROBOROS_ACCELERATOR_MICROBATCHES on an accelerator and not at all on CPU; streamed, into at
    least `delays.unit_gap_microbatches` (the smallest divisor of the batch that reaches it, or
    every row its own micro-batch). Checks this config first (`validate`). `batch_size` may be
    None where nothing depends on it (any schedule but Ouroboros without ‹microbatches› off CPU
    or streamed). The CLI resolves here (`TrainConfig.schedule_config`), and so does
    `build_schedule`, on the devices' platform and the batch it steps on; a resolved record
    resolves to itself."""
    self.validate()
    ouroboros = self.name == 'ouroboros'
    from ouroboros_jax.schedules import tables

    return ResolvedSchedule(
      **{
        **dataclasses.asdict(self),
        'compensation': self.resolved_compensation,
        'stash_policy': self.resolved_stash_policy,
        'flow': self.resolved_flow if ouroboros else 'batch',
        'chunks': self.chunks or tables.DEFAULT_CHUNKS.get(self.name, 1),
        'clip_norm': self.clip_norm or 0.0,
        'microbatches': self._resolved_microbatches(platform, batch_size),
      }
    )

  def _resolved_microbatches(self, platform: str, batch_size: int | None) -> int:
    """`resolve`'s micro-batches: the count given, or the schedule's default (above)."""
    if self.name != 'ouroboros' or self.microbatches is not None:
      return self.num_microbatches
    stream = self.resolved_flow == 'stream'
    if batch_size is None:
      if platform == 'cpu' and not stream:
        return OUROBOROS_MICROBATCHES
      raise ConfigError(
        f'Ouroboros without {field_ref("microbatches")} cuts the batch into micro-batches: '
        'resolve it with the batch size, or give the micro-batches.'
      )
    local = max(batch_size // self.data_parallel, 1)
    micro = (
      OUROBOROS_MICROBATCHES
      if platform == 'cpu'
      else math.gcd(OUROBOROS_ACCELERATOR_MICROBATCHES, local)
    )
    if stream:
      need = unit_gap_microbatches(self.num_stages, self.forward)
      if micro < need:
        micro = next((m for m in range(need, local + 1) if local % m == 0), local)
    return micro

  @property
  def num_microbatches(self) -> int:
    """Micro-batches per replica's batch: --microbatches (DEFAULT_MICROBATCHES if not given) on
    the schedules that cut the batch (MICROBATCHED), 1 on the others."""
    if self.name not in MICROBATCHED:
      return 1
    if self.microbatches is not None:
      return self.microbatches
    return OUROBOROS_MICROBATCHES if self.name == 'ouroboros' else DEFAULT_MICROBATCHES

  @property
  def label(self) -> str:
    """The setting in one short line, as `bench`, `plan` and their tables print it (and --only
    matches): the name; 'G=gxR=r' for a stage schedule on several data replicas; a micro-batched
    pipeline's 'M=m' (`num_microbatches`) and 'chunks=v' where given; Ouroboros' 'M=m' where it
    cuts the batch, 'stream' where the flow is asked to stream, 'forward/stash', the graph
    stash's policy where it is not the default ('locked/graph/all') and 'host' for a stash in
    host memory; another schedule's 'keep=POLICY' where it recomputes; e.g. 'gpipe M=4',
    '1f1b M=8 keep=nothing', 'ouroboros M=8 stream locked/graph', 'model_parallel G=2xR=2'. It
    leaves out the clip, the seed, the compensation, a flow left 'auto', the warm-up and the tied
    gradient."""
    parts = [self.name]
    if self.name not in ('backprop', 'data_parallel') and self.data_parallel > 1:
      parts.append(f'G={self.num_stages}xR={self.data_parallel}')
    if self.fsdp:
      parts.append('fsdp')
    if self.shard_update:
      parts.append('shard_update')
    if self.name == 'ouroboros':
      if self.microbatches not in (None, 1):
        parts.append(f'M={self.microbatches}')
      if self.flow == 'stream':
        parts.append('stream')
      policy = self.resolved_stash_policy
      policy = f'/{policy}' if self.stash == 'graph' and policy != DEFAULT_STASH_POLICY else ''
      parts.append(f'{self.forward}/{self.stash}{policy}')
      if self.stash_memory != 'device':
        parts.append({'pinned_host': 'host'}.get(self.stash_memory, self.stash_memory))
    else:
      if self.name in MICROBATCHED:
        parts.append(f'M={self.num_microbatches}')
      if self.resolved_stash_policy != 'all':
        parts.append(f'keep={self.resolved_stash_policy}')
    from ouroboros_jax.schedules import tables

    if self.chunks not in (None, tables.DEFAULT_CHUNKS.get(self.name, 1)):  # not the default
      parts.append(f'chunks={self.chunks}')
    return ' '.join(parts)

  @property
  def stage_groups(self) -> int:
    """How many groups the layers are cut into: --stages x the chunks each device holds."""
    if self.name not in EXACT_PIPELINES:
      return self.num_stages
    from ouroboros_jax.schedules import tables

    return self.num_stages * (self.chunks or tables.DEFAULT_CHUNKS.get(self.name, 1))


def _check_compensation(value) -> None:
  """One line for a ‹compensation› that is neither 'auto' nor a Compensation record."""
  if not isinstance(value, Compensation) and value != AUTO:
    raise ConfigError(
      f'{field_ref("compensation", value)} takes {AUTO!r} (the recipe) or a Compensation '
      "record: Compensation() for none, the paper's method, or e.g. "
      'Compensation(predict=True, dc_lambda=1.0); a comma list is for recipe(compensation=...) '
      'and TrainConfig.'
    )


@dataclasses.dataclass(frozen=True)
class ResolvedSchedule(ScheduleConfig):
  """A ScheduleConfig as it runs, from `ScheduleConfig.resolve` alone: no `auto` and no None
  (the micro-batches, chunks, stash policy, flow and compensation record written out, no clip
  0.0). Every schedule's builder, the simulator, `bench`, `plan`, `compile` and `memory` take
  this; questions such as `replays`, `stash_label` and `num_microbatches` read its fields."""

  def __post_init__(self):
    values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
    unresolved = [name for name, value in values.items() if value is None or value == AUTO]
    if unresolved or not isinstance(self.compensation, Compensation):
      raise TypeError(
        f'a ResolvedSchedule has no auto or None (got them in {", ".join(unresolved)}); make '
        'one with ScheduleConfig.resolve(platform, batch_size).'
      )

  @functools.cached_property
  def _validated(self) -> bool:
    """Checked as the ScheduleConfig it was resolved from; the tables once more, as written."""
    self._check_values()
    if self.name in tables_names():
      from ouroboros_jax.schedules import tables

      tables.build(self.name, self.num_stages, self.microbatches, self.chunks)
    return True

  def resolve(self, platform: str, batch_size: int | None = None) -> ResolvedSchedule:
    """Itself: resolved once."""
    del platform, batch_size
    return self


def tables_names() -> tuple[str, ...]:
  """The schedules that run from a tick table: gpipe and the exact pipelines."""
  return ('gpipe', *EXACT_PIPELINES)


def require_resolved(config: ScheduleConfig, user: str) -> ResolvedSchedule:
  """`config` if resolved, else one line telling the caller of `user` to resolve it first."""
  if not isinstance(config, ResolvedSchedule):
    raise ConfigError(
      f'{user} takes a resolved schedule; pass config.resolve(platform, batch_size) '
      "(TrainConfig.schedule_config() gives a run's)."
    )
  return config
