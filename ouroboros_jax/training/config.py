"""Training configurations: one frozen `TrainConfig`, its checks and resolution, and the flat
namespace of its fields (`fields`, `flat`).

A run is fully described by a `TrainConfig`: the model shape (`ModelConfig`, in `cfg.model`), the
schedule settings (`ScheduleConfig`, in `cfg.schedule`) plus the data, optimizer, evaluation and
checkpoint settings. Presets are starting points (presets.py); every field of the three
dataclasses can be overridden by name (field_flags.py), which is how the CLI's flags work:

    from ouroboros_jax.training import field_flags, presets
    cfg = presets.get_preset('tiny')
    cfg = field_flags.override(cfg, {'d_model': 64, 'steps': 10, 'schedule': 'ouroboros'})
    cfg.validate()

The optimizer (`--optimizer auto`, `TrainConfig.resolved_optimizer`) is Muon for every schedule:
`optax.contrib.muon` on the layer kernels at their own rate (`DEFAULT_MUON_RATES`), Adam at
`learning_rate` on embeddings, norms and biases; AdamW (the paper's) for `--compensation none`,
`--growth` and `--vcycle` (optimizers.py has each). Linear warmup and cosine decay to
`learning_rate * min_lr_ratio` (`optimizer_setup.make_optimizer`); the schedule clips the global
gradient norm to `clip_norm` before the update. Older runs' saved configs read through
migrations.py (`TrainConfig.from_dict`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import typing
from typing import Any, Mapping

from ouroboros_jax import optimizers
from ouroboros_jax.choices import MICROBATCHED
from ouroboros_jax.errors import ConfigError, field_ref
from ouroboros_jax.models.model import ModelConfig
from ouroboros_jax.schedules.config import AUTO, ResolvedSchedule, ScheduleConfig
from ouroboros_jax.training import migrations


class Plans(typing.NamedTuple):
  """The plan-like flags of a TrainConfig, parsed once into typed values (`TrainConfig.plans`)."""

  layers_per_stage: tuple[int, ...]  # --layers-per-stage, or the balanced split
  pld: tuple[float, float] | None  # --pld: (theta_bar, gamma)
  growth: Any  # --growth: a growth.GrowthPlan
  vcycle: tuple[Any, float] | None  # --vcycle: (a vcycle.VCyclePlan, lr_scale)
  std_loss_layers: tuple[int, ...]  # --std-loss-layers, 0-based


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Everything a training run needs besides its output directory's contents."""

  model: ModelConfig = ModelConfig()
  preset: str = 'tiny'
  # Data: see `data.load_splits` for the spec syntax ('default' is the embedded Shakespeare).
  data: str = 'default'
  data_dir: str | None = None
  download: bool = False  # tfds: let TFDS download and prepare a dataset missing from
  # data_dir (network); off: read only prepared data, fail fast
  batch_size: int = 32
  steps: int = 2000
  # Optimizer: AdamW, linear warmup then cosine decay to learning_rate * min_lr_ratio.
  learning_rate: float = 5e-3
  warmup_steps: int = 50
  min_lr_ratio: float = 0.1
  weight_decay: float = 0.1
  # Evaluation, logging and checkpoints (every N steps; the last step always evaluates/saves).
  log_every: int = 20  # also how often the host checks the loss for NaN/Inf
  eval_every: int = 500
  eval_batches: int = 50  # validation batches per evaluation (in order, unshuffled)
  test_batches: int | None = None  # test batches evaluated at the end (None: the whole split)
  eval_mem_len: int | None = None  # transformer-xl: memory length when evaluating (None: mem_len)
  data_order: str = 'auto'  # windows (shuffled), segments (B contiguous streams, each row
  # continuing the previous batch's), auto: segments for a model with a memory
  checkpoint_every: int = 1000
  keep_checkpoints: int = 3
  # Ouroboros: the ring finishes what it holds before the run's last checkpoint (at --steps or a
  # stop signal), so that the checkpoint resumes on another layout (Schedule.drain).
  drain: bool = False
  # --resume with the optimizer's state started again from its init (the parameters, the step
  # and the data position resumed): so that --optimizer, --state-dtype or --compensation may
  # change.
  fresh_optimizer: bool = False
  seed: int = 0  # parameters, data order and dropout
  out: str | None = None  # None: runs/<preset>-<schedule>
  # How the model is cut and run: `ouroboros_jax.schedules.ScheduleConfig` (its flags are
  # --schedule, --stages, --data-parallel, --microbatches, --clip-norm, --stash, ...).
  schedule: ScheduleConfig = ScheduleConfig()
  layers_per_stage: str | None = None  # '2,4,4,4'; None: balanced by partition.balance_layers
  # Optimizer and staleness compensation (compensation.py).
  # 'auto': every schedule trains with the best measured optimizer, Muon (DEFAULT_OPTIMIZER), at
  # its own measured best rate (DEFAULT_MUON_RATES), and Ouroboros with G > 1 also with the
  # measured compensations (schedules.config.RECIPE_COMPENSATION); --compensation none is the
  # paper's AdamW.
  optimizer: str = 'auto'  # auto, adamw, nadamw (b1 0.99), muon (kernels; Adam elsewhere)
  # muon: the kernels' peak rate (--learning-rate: the rest); None: DEFAULT_MUON_RATES
  muon_learning_rate: float | None = None
  momentum: float | None = None  # b1 / Muon's beta; None: the optimizer's own (0.9, 0.99, 0.95)
  # The stored precision of the per-weight optimizer and compensation state (Muon's momentum,
  # Adam's first moment, DC-ASGD's running mean, prediction's latest update;
  # optimizers.STATE_DTYPES), computed in float32 either way; 'auto': `resolved_state_dtype`.
  state_dtype: str = AUTO
  # The flag's text: auto, none (the paper) or a comma list of predict, pipemare, dc, shrink
  # (ouroboros only); parsed once, with the strengths below, into the typed record
  # `resolved_compensation()` (what ScheduleConfig.compensation holds).
  compensation: str = AUTO
  dc_lambda: float = 1.0  # dc: DC-ASGD-a's strength lambda_0
  shrink: float = 0.5  # shrink: factor on delayed gradients
  pipemare_steps: int = 0  # pipemare: steps T to the full rate (0: a quarter of --steps)
  predict_horizon: float = 1.0  # predict: the forward at w + horizon * gap * (latest update)
  # Other training accelerators (docs/guides/accelerators.md; None / 0 = off).
  pld: str | None = None  # progressive layer dropping: 'THETA_BAR,GAMMA' or 'default'
  growth: str | None = None  # MSLT / progressive stacking plan, see growth.parse_plan
  vcycle: str | None = None  # multi-level V-cycle plan, see vcycle.parse_plan
  std_loss: float = 0.0  # weight of the standardization loss (0: off)
  std_loss_layers: str = 'all'  # the layers it regularises: 'all' or '0,2' (0-based)

  @property
  def out_dir(self) -> str:
    return self.out or f'runs/{self.preset}-{self.schedule.name}'

  @property
  def tokens_per_step(self) -> int:
    return self.batch_size * self.model.seq_len

  def validate(self) -> None:
    """Raises ConfigError (one line, naming the flag) for settings that cannot work. The checks
    run once per config: the CLI, `train` and `build_schedule` may all ask."""
    self._validated  # noqa: B018

  @functools.cached_property
  def _validated(self) -> bool:
    _check_types(self)  # before the model's checks compare numbers
    self.model.validate()
    self._check_values()
    self.check_compensation()  # before the schedule: an unknown --compensation names itself
    self._check_schedule()
    self.plans  # parses --layers-per-stage, --pld, --growth, --vcycle, --std-loss-layers
    self.check_accelerators()
    self.check_memory()
    return True

  def _check_values(self) -> None:
    """Each number finite and in range, each text given not empty."""
    for name, value in flat(self).items():  # nan and inf pass every comparison below
      if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f'{field_ref(name)} must be a finite number, got {value}.')
      if (
        isinstance(value, int)
        and not isinstance(value, bool)
        and name != 'seed'
        and abs(value) >= 2**31
      ):
        raise ConfigError(f'{field_ref(name, value)} is out of range (at most 2**31 - 1).')
    for name in ('out', 'compensation', 'data'):
      value = getattr(self, name)
      if value is not None and not value.strip():
        raise ConfigError(f'{field_ref(name)} is empty; give it a value or leave it out.')
    if self.seed >= 2**32:
      raise ConfigError(f'‹seed› must be below 2**32 (the PRNG keeps 32 bits), got {self.seed}.')
    for name in (
      'batch_size',
      'steps',
      'log_every',
      'eval_every',
      'eval_batches',
      'checkpoint_every',
      'keep_checkpoints',
    ):
      if getattr(self, name) <= 0:
        raise ConfigError(
          f'{field_ref(name)} must be a positive integer, got {getattr(self, name)}.'
        )
    if self.test_batches is not None and self.test_batches <= 0:
      raise ConfigError(
        f'{field_ref("test_batches")} must be a positive integer, got {self.test_batches}.'
      )
    for name in ('warmup_steps', 'seed'):
      if getattr(self, name) < 0:
        raise ConfigError(f'{field_ref(name)} must be >= 0, got {getattr(self, name)}.')
    if not self.learning_rate > 0:
      raise ConfigError(f'‹learning_rate› must be positive, got {self.learning_rate}.')
    if not 0.0 <= self.min_lr_ratio <= 1.0:
      raise ConfigError(f'‹min_lr_ratio› must be in [0, 1], got {self.min_lr_ratio}.')
    if self.weight_decay < 0:
      raise ConfigError(f'‹weight_decay› must be >= 0, got {self.weight_decay}.')

  def _check_schedule(self) -> None:
    """The schedule's own checks, and how it fits the run's steps, model and batch."""
    # Checked as on CPU: asking JAX for its backend here would start it before a multi-process
    # run joins its group (the accelerators' default micro-batches always divide the batch).
    self.schedule_config('cpu').validate()
    run = self.schedule
    if run.name == 'ouroboros' and run.sync_warmup_steps >= self.steps:
      raise ConfigError(
        f'{field_ref("sync_warmup_steps", run.sync_warmup_steps)} is not shorter than '
        f'{field_ref("steps", self.steps)}, so the whole run would be synchronous backprop; use '
        f'‹sync_warmup_steps› below {self.steps} (or more ‹steps›), or '
        f'{field_ref("schedule", "backprop")}.'
      )
    if run.name in ('backprop', 'data_parallel') and run.num_stages > 1:
      raise ConfigError(
        f'{field_ref("schedule", run.name)} runs every layer on each device, so '
        f'{field_ref("stages", run.num_stages)} does nothing; drop ‹stages› or choose a ‹schedule› '
        'of model_parallel, gpipe or ouroboros.'
      )
    if run.stage_groups > self.model.num_layers and run.stage_groups > run.num_stages:
      raise ConfigError(
        f'{field_ref("schedule", run.name)} cuts the layers into '
        f'{field_ref("stages", run.num_stages)} x '
        f'{run.stage_groups // run.num_stages} chunks = {run.stage_groups} groups, more than the '
        f"model's {self.model.num_layers} layers; use fewer ‹stages› or ‹chunks›, or more "
        '‹num_layers›.'
      )
    if self.batch_size % self.schedule.data_parallel:
      raise ConfigError(
        f'{field_ref("batch_size", self.batch_size)} is not divisible by '
        f'{field_ref("data_parallel", self.schedule.data_parallel)}; choose ‹batch_size› as a '
        'multiple of it.'
      )

  @property
  def segment_order(self) -> bool:
    """Whether training batches are contiguous streams (`data.make_segment_iterator`)."""
    if self.data_order == 'auto':
      return self.model.mem_len > 0
    return self.data_order == 'segments'

  @property
  def resolved_eval_mem_len(self) -> int:
    return self.model.mem_len if self.eval_mem_len is None else self.eval_mem_len

  def check_memory(self) -> None:
    """Transformer-XL's settings fit the run (one line naming the flag)."""
    if self.data_order not in DATA_ORDERS:
      raise ConfigError(
        f'unknown {field_ref("data_order", self.data_order)}; use {" or ".join(DATA_ORDERS)}.'
      )
    if self.eval_mem_len is not None and self.eval_mem_len < 0:
      raise ConfigError(f'‹eval_mem_len› must be >= 0, got {self.eval_mem_len}.')
    xl = self.model.arch == 'transformer-xl'
    if self.eval_mem_len is not None and not self.model.mem_len:
      raise ConfigError(
        f'‹eval_mem_len› needs a model with a memory; add {field_ref("model", "transformer-xl")} '
        'and a ‹mem_len›, or drop ‹eval_mem_len›.'
      )
    if not xl:
      return
    on = [field_ref(f) for f in ('pld', 'std_loss', 'growth', 'vcycle') if getattr(self, f)]
    if on:
      raise ConfigError(
        f'{on[0]} runs the GPT model only (it rewrites its layers); drop {on[0]} or use '
        f'{field_ref("model", "gpt")}.'
      )

  @functools.cached_property
  def plans(self) -> Plans:
    """Every plan-like flag parsed, once per config (one-line ConfigErrors naming the flag)."""
    from ouroboros_jax.accelerators import growth, pld, vcycle

    return Plans(
      layers_per_stage=self.resolved_layers_per_stage(),
      pld=pld.parse(self.pld) if self.pld else None,
      growth=(
        growth.parse_plan(self.growth, self.model.num_layers, self.steps) if self.growth else None
      ),
      vcycle=vcycle.parse_plan(self.vcycle, self.steps) if self.vcycle else None,
      std_loss_layers=self.std_loss_layer_ids(),
    )

  def schedule_config(self, platform: str | None = None) -> ResolvedSchedule:
    """The schedule as it runs on `platform` (default: JAX's backend): the run's seed, the
    resolved staleness compensation and the platform's default micro-batches
    (`ScheduleConfig.resolve`)."""
    if platform is None:
      import jax

      platform = jax.default_backend()
    run = dataclasses.replace(
      self.schedule, seed=self.seed, compensation=self.resolved_compensation()
    )
    return run.resolve(platform, self.batch_size)  # after the compensation: it picks the flow

  def resolved(self, platform: str | None = None) -> TrainConfig:
    """This run with every `auto` made explicit as it runs on `platform` (default: JAX's
    backend), the one resolution of its defaults: the optimizer and Muon's rate, the staleness
    compensation, Ouroboros' flow and micro-batches (`schedule_config`, `resolve`), the
    exact pipelines' micro-batches, the stash policy, the attention kernel, the data order and the
    optimizer state's stored precision. What config.json and the checkpoints store, and what a
    resume compares; resolving it again changes nothing."""
    if platform is None:
      import jax

      platform = jax.default_backend()
    run = self.schedule_config(platform)  # the seed and compensation: TrainConfig's own fields
    ring, spec = run.name == 'ouroboros', self.schedule
    schedule = dataclasses.replace(  # spelled as flags: only the fields the schedule takes
      spec,
      flow=run.flow if ring else spec.flow,
      microbatches=run.microbatches if run.name in MICROBATCHED else spec.microbatches,
      stash_policy=spec.stash_policy if run.replays else run.stash_policy,
    )
    optimizer = self.resolved_optimizer()
    return dataclasses.replace(
      self,
      schedule=schedule,
      optimizer=optimizer,
      muon_learning_rate=(
        self.resolved_muon_learning_rate() if optimizer == 'muon' else self.muon_learning_rate
      ),
      compensation=','.join(self.resolved_compensation().names()) or 'none',
      state_dtype=self.resolved_state_dtype(),
      model=dataclasses.replace(
        self.model,
        attention=self.attention_kind(platform),
        layer_unroll=self.model.unroll_for(platform),
      ),
      data_order='segments' if self.segment_order else 'windows',
    )

  def attention_kind(self, platform: str) -> str:
    """The model's attention on `platform` (`ModelConfig.attention_kind`), but that FSDP's step
    (data_parallel's) is partitioned by XLA, which cannot split the Pallas kernel: 'auto' there runs
    XLA's blockwise attention, and an explicit --attention pallas is refused in one line."""
    kind = self.model.attention_kind(platform)
    if kind != 'pallas' or not self.schedule.fsdp or self.schedule.name != 'data_parallel':
      return kind  # a stage schedule's shard_map runs the kernel on each device's share
    if self.model.attention != 'auto':
      raise ConfigError(
        f'{field_ref("attention", "pallas")} is a kernel XLA cannot split over '
        f"{field_ref('fsdp', True)}'s data axis; use {field_ref('attention', 'blockwise')} or "
        f'{field_ref("attention", "auto")} with it.'
      )
    return 'blockwise'

  def check_accelerators(self) -> None:
    """The accelerator flags parse, fit the model, and combine with the schedule (one-line
    ConfigErrors naming the flag). Which combinations work: docs/guides/accelerators.md."""
    from ouroboros_jax import costs
    from ouroboros_jax.accelerators import pld, vcycle

    on = [
      name
      for name, value in (
        ('--pld', self.pld),
        ('--growth', self.growth),
        ('--vcycle', self.vcycle),
        ('--std-loss', self.std_loss),
      )
      if value
    ]
    if len(on) > 1:
      raise ConfigError(
        f'{" and ".join(on)} cannot be combined yet (each one changes the step '
        'in its own way); use one of them per run.'
      )
    if self.pld:
      pld.check_config(self.model, *self.plans.pld)
    if self.std_loss and not self.std_loss > 0:
      raise ConfigError(f'‹std_loss› is a weight >= 0, got {self.std_loss}.')
    if self.growth:
      if self.schedule.name != 'backprop':
        raise ConfigError(
          f'‹growth› runs on {field_ref("schedule", "backprop")} only: MSLT and stacking change '
          f'the depth mid-run, which would change the layers of every stage of '
          f'{self.schedule.name!r} (and MSLT freezes whole stages); drop ‹schedule› '
          f'or ‹growth›.'
        )
    if self.vcycle:
      plan, _ = self.plans.vcycle
      for level_cfg in vcycle.level_configs(
        self.model, plan.levels, width=plan.width, depth=plan.depth
      ):
        level_cfg.validate()
        costs.check_stages(level_cfg.num_layers, self.schedule.num_stages)
      if self.layers_per_stage:
        raise ConfigError(
          '‹vcycle› cuts every level with the balanced split; drop ‹layers_per_stage›.'
        )
    if (self.growth or self.vcycle) and self.schedule.sync_warmup_steps:
      raise ConfigError('‹sync_warmup_steps› does not apply to ‹growth› / ‹vcycle› runs; drop it.')

  def check_compensation(self) -> None:
    """--optimizer and --compensation name known pieces that fit the schedule (one line)."""
    if self.optimizer not in ('auto', *optimizers.OPTIMIZERS):
      raise ConfigError(
        f'unknown {field_ref("optimizer", self.optimizer)}; use auto, '
        f'{", ".join(optimizers.OPTIMIZERS)}.'
      )
    if self.momentum is not None and not 0 <= self.momentum < 1:
      raise ConfigError(f'‹momentum› must be in [0, 1), got {self.momentum}.')
    if self.muon_learning_rate is not None and not self.muon_learning_rate > 0:
      raise ConfigError(f'‹muon_learning_rate› must be positive, got {self.muon_learning_rate}.')
    if (self.growth or self.vcycle) and self.resolved_optimizer() != 'adamw':
      raise ConfigError('‹growth› and ‹vcycle› runs use AdamW; drop ‹optimizer›.')
    optimizers.state_jnp_dtype(self.resolved_state_dtype())  # one line for an unknown dtype
    self.resolved_compensation()  # the flag's spelling, 'auto' included, and the strengths

  @property
  def delayed(self) -> bool:
    """Ouroboros with more than one group: gradients arrive late."""
    return self.schedule.delayed

  def resolved_optimizer(self) -> str:
    """--optimizer auto: Muon for every schedule; AdamW for the paper's method
    (--compensation none) and for --growth / --vcycle."""
    if self.optimizer != 'auto':
      return self.optimizer
    if self.compensation == 'none' or self.growth or self.vcycle:
      return 'adamw'
    return DEFAULT_OPTIMIZER

  def resolved_state_dtype(self) -> str:
    """--state-dtype auto: bfloat16 when the model computes in bfloat16 (--dtype), whose
    per-weight optimizer and compensation state then takes half the bytes; float32 otherwise, so
    a float32 run stores what it computes."""
    if self.state_dtype != AUTO:
      return self.state_dtype
    return 'bfloat16' if self.model.dtype == 'bfloat16' else 'float32'

  def resolved_muon_learning_rate(self) -> float:
    """--muon-learning-rate, or the rate measured best for this kind of schedule."""
    if self.muon_learning_rate is not None:
      return self.muon_learning_rate
    return DEFAULT_MUON_RATES['delayed' if self.delayed else 'exact']

  def resolved_compensation(self):
    """--compensation and its strengths as the typed record the schedules take
    (`ScheduleConfig.compensation`), parsed once per config: 'auto' as
    `ScheduleConfig.resolve_compensation` resolves it for every caller (none for --growth and
    --vcycle, which train with AdamW alone)."""
    return self._compensation

  @functools.cached_property
  def _compensation(self):
    spec = self.compensation
    if spec == AUTO and (self.growth or self.vcycle):
      spec = 'none'
    comp = self.schedule.resolve_compensation(
      spec,
      steps=self.steps,
      dc_lambda=self.dc_lambda,
      shrink=self.shrink,
      pipemare_steps=self.pipemare_steps,
      predict_horizon=self.predict_horizon,
    )
    if not comp.active:  # none stays Compensation(): the paper's method, nothing kept
      return comp
    return dataclasses.replace(comp, state_dtype=self.resolved_state_dtype())

  def std_loss_layer_ids(self) -> tuple[int, ...]:
    """--std-loss-layers -> 0-based layer indices ('all': every layer)."""
    if self.std_loss_layers.strip().lower() == 'all':
      return tuple(range(self.model.num_layers))
    try:
      ids = tuple(int(v) for v in self.std_loss_layers.split(','))
    except ValueError:
      raise ConfigError(
        f"‹std_loss_layers› takes 'all' or 0-based layer indices like 0,2; got "
        f'{self.std_loss_layers!r}.'
      ) from None
    if not ids or any(not 0 <= i < self.model.num_layers for i in ids):
      raise ConfigError(
        f"‹std_loss_layers› {self.std_loss_layers} is outside the model's "
        f'{self.model.num_layers} layers; choose from 0 .. '
        f'{self.model.num_layers - 1}.'
      )
    return ids

  def resolved_layers_per_stage(self) -> tuple[int, ...]:
    """Layers per stage: the explicit --layers-per-stage, else a FLOP-balanced split."""
    from ouroboros_jax.models import partition

    if self.layers_per_stage:
      return partition.parse_layers_per_stage(
        self.layers_per_stage, self.model.num_layers, self.schedule.stage_groups
      )
    return partition.balance_layers(self.model, self.schedule.stage_groups)

  def to_dict(self) -> dict[str, Any]:
    d = dataclasses.asdict(self)
    for name in _RESOLVED_SCHEDULE_FIELDS:  # TrainConfig's own fields give them
      d['schedule'].pop(name)
    return d

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> 'TrainConfig':
    """From `to_dict`'s output; also reads the configs older runs wrote
    (`migrations.upgrade`: the flat layout of runs written before the schedule settings were
    nested, runs written before --flow, ...)."""
    d = migrations.upgrade(d)
    model = ModelConfig(**d.pop('model', {}))
    schedule = d.pop('schedule')
    schedule = {k: v for k, v in schedule.items() if k not in _RESOLVED_SCHEDULE_FIELDS}
    return cls(model=model, schedule=ScheduleConfig(**schedule), **d)


# ScheduleConfig fields TrainConfig fills in (`schedule_config`), and so has no flag or record of.
_RESOLVED_SCHEDULE_FIELDS = ('seed', 'compensation')


# The default optimizer of every schedule (`--optimizer auto`), the best measured: backprop with
# Muon against AdamW, each at its best rate (experiments/lr_sweep.py; tiny preset, 4 layers, 1000
# steps; the numbers: docs/results/README.md#q-muon); the exact pipelines give backprop's
# parameters, so the same. Its kernels' peak rate as measured best: 0.04 for exact gradients (grid
# 0.01-0.08), 0.02 under Ouroboros' delays. Here, with what resolves them
# (`TrainConfig.resolved_optimizer`, `resolved_muon_learning_rate`); optimizer_setup.py builds the
# optimizer they name.
DEFAULT_OPTIMIZER = 'muon'
DEFAULT_MUON_RATES = {'exact': 0.04, 'delayed': 0.02}
RECIPE_OPTIMIZER = DEFAULT_OPTIMIZER
# The compensations `--compensation auto` gives Ouroboros: schedules.config.RECIPE_COMPENSATION.


DATA_ORDERS = ('auto', 'windows', 'segments')


# ----------------------------------------------------------------------------- fields


@functools.lru_cache(maxsize=None)
def _hints(cls) -> dict[str, Any]:
  return typing.get_type_hints(cls)


# Flag names that differ from the field's own name (the CLI predates the nesting).
_FLAG_NAMES = {
  (ScheduleConfig, 'name'): 'schedule',
  (ScheduleConfig, 'num_stages'): 'stages',
  (ModelConfig, 'arch'): 'model',
}
# Where each nested config sits in TrainConfig.
NESTED = {ModelConfig: 'model', ScheduleConfig: 'schedule'}


class Field(typing.NamedTuple):
  """One overridable setting: its type, whether None is allowed, where it lives."""

  kind: type
  optional: bool
  owner: type  # ModelConfig, ScheduleConfig or TrainConfig
  attribute: str  # its name in the owner


@functools.lru_cache(maxsize=None)
def fields() -> dict[str, Field]:
  """Every overridable setting by its flat (flag) name.

  TrainConfig's own fields and those of its nested ModelConfig and ScheduleConfig share one
  namespace (no name is in two of them); ScheduleConfig's seed and compensation are not in it
  (TrainConfig's --seed and --compensation give them).
  """
  out = {}
  for cls in (ModelConfig, ScheduleConfig, TrainConfig):
    for f in dataclasses.fields(cls):
      if (cls is TrainConfig and f.name in NESTED.values()) or (
        cls is ScheduleConfig and f.name in _RESOLVED_SCHEDULE_FIELDS
      ):
        continue
      hint = _hints(cls)[f.name]
      args = [a for a in typing.get_args(hint) if a is not type(None)]
      optional = type(None) in typing.get_args(hint)
      name = _FLAG_NAMES.get((cls, f.name), f.name)
      assert name not in out, name
      out[name] = Field(args[0] if optional else hint, optional, cls, f.name)
  return out


def _check_types(cfg: TrainConfig) -> None:
  """One-line ConfigError for a number field given something else (from Python: the command line
  parses its flags), e.g. learning_rate='fast'."""
  kinds = fields()
  for name, value in flat(cfg).items():
    kind = kinds[name].kind
    if value is None or kind not in (int, float):
      continue
    allowed = numbers.Integral if kind is int else numbers.Real
    if isinstance(value, bool) or not isinstance(value, allowed):
      what = 'an integer' if kind is int else 'a number'
      raise ConfigError(f'{field_ref(name)} must be {what}, got {value!r}.')


def flat(cfg: TrainConfig) -> dict[str, Any]:
  """Every setting by its flat name, as `override` takes them."""
  out = {}
  for name, field in fields().items():
    owner = cfg if field.owner is TrainConfig else getattr(cfg, NESTED[field.owner])
    out[name] = getattr(owner, field.attribute)
  return out
