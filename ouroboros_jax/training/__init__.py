"""Training runs: configuration, the loop, checkpoints, metrics and sampling (the data they read:
the `ouroboros_jax.data` package).

config      TrainConfig: its checks and resolution, the flat namespace of its fields
presets     the named presets (`get_preset`)
field_flags the fields as flags: `override` by flat name (the CLI's flags), `train_flags`
migrations  older runs' saved configs read in today's layout (`TrainConfig.from_dict`)
optimizer_setup  a run's learning-rate schedule and Optax optimizer from its config
recipe      `recipe(...)`: the resolved schedule settings and optimizer of `ouroboros train`,
            in Python
assemble    a run's model and schedule from its config, without its data (compile, plan, bench)
loop        `train(cfg)`: one run end to end, into its output directory
sizing      whether a run's state can fit the devices, decided before anything is built
phased      growth and V-cycle runs, one phase after another
metrics     what a run reports: the clock, counters, rows and summary
resume      resuming a run from its checkpoint and its config
checkpoint  Orbax checkpoints with checksums; resume, fall back, set aside
rundir      one run per output directory; stopping between steps on a signal
sample      text from a checkpoint
compare     the training accelerators side by side (docs/results/accelerators.md)
"""

from __future__ import annotations

from ouroboros_jax import moved

# The data modules moved to ouroboros_jax.data: the old paths warn (moved.MOVED).
__getattr__ = moved.module_getattr(__name__)
