"""The config fields as flags: a field's `ouroboros train` flag (`flag`, `field_flag`), a config
with fields replaced by flat name (`override`, how the CLI's flags work) and a schedule's own
flags (`train_flags`, `override`'s inverse).

TrainConfig's own fields and those of its nested ModelConfig and ScheduleConfig share one flat
namespace (`config.fields()`, `config.flat(cfg)`), the names these take:

    from ouroboros_jax.training import field_flags, presets
    cfg = field_flags.override(presets.get_preset('tiny'), {'d_model': 64, 'schedule': 'ouroboros'})
    cfg.validate()
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any, Mapping

from ouroboros_jax.errors import ConfigError, field_ref
from ouroboros_jax.models.model import ModelConfig
from ouroboros_jax.schedules.config import ScheduleConfig
from ouroboros_jax.training.config import NESTED, TrainConfig, fields, flat


def flag(name: str) -> str:
  return '--' + name.replace('_', '-')


def field_flag(name: str) -> str | None:
  """The command-line flag of a config field, by its flat name or its name in ModelConfig,
  ScheduleConfig or TrainConfig (`num_stages` -> --stages); None for a name that is not one."""
  by_attribute = {f.attribute: flat_name for flat_name, f in fields().items()}
  if name in fields():
    return flag(name)
  return flag(by_attribute[name]) if name in by_attribute else None


def override(cfg: TrainConfig, values: Mapping[str, Any]) -> TrainConfig:
  """A copy of cfg with settings replaced by flat name (`fields`); unknown names raise."""
  known = fields()
  changes = {cls: {} for cls in (ModelConfig, ScheduleConfig, TrainConfig)}
  for name, value in values.items():
    if name not in known:
      close = difflib.get_close_matches(name, known, n=1)
      hint = f'; did you mean {field_ref(close[0])}?' if close else ' (see `config.fields()`).'
      raise ConfigError(f'unknown field {field_ref(name)}{hint}')
    field = known[name]
    changes[field.owner][field.attribute] = value
  nested = {
    attr: dataclasses.replace(getattr(cfg, attr), **changes[cls]) for cls, attr in NESTED.items()
  }
  return dataclasses.replace(cfg, **nested, **changes[TrainConfig])


def train_flags(schedule: ScheduleConfig) -> dict[str, Any]:
  """Every setting of `schedule` by its `ouroboros train` flag's flat name (`fields()`:
  --schedule for `name`, --stages for `num_stages`, ...), as `override` takes them:
  `override(cfg, train_flags(s))` runs cfg on the schedule `s` (all of it but the seed and
  the compensation, which TrainConfig's own --seed and --compensation give)."""
  values = flat(dataclasses.replace(TrainConfig(), schedule=schedule))
  return {n: v for n, v in values.items() if fields()[n].owner is ScheduleConfig}
