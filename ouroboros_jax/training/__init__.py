"""Training runs: configuration, the loop, data, checkpoints, metrics and sampling.

config      TrainConfig, the presets and the flat field overrides the CLI uses
loop        `train(cfg)`: one run end to end, into its output directory
data        the byte corpora (embedded, text files, TFDS) as Grain iterators
checkpoint  Orbax checkpoints with checksums; resume, fall back, set aside
rundir      one run per output directory; stopping between steps on a signal
sample      text from a checkpoint
compare     the training accelerators side by side (docs/results/accelerators.md)
"""
