"""Training runs: configuration, the loop, data, checkpoints, metrics and sampling.

config      TrainConfig, the presets and the flat field overrides the CLI uses
recipe      `recipe(...)`: the resolved schedule settings and optimizer of `ouroboros train`, in Python
assemble    a run's model and schedule from its config, without its data (compile, plan, bench)
loop        `train(cfg)`: one run end to end, into its output directory
data        the public face of the data: the corpora as Grain iterators, from
              corpora (which corpus, its splits and units), default_corpus (the embedded
              Shakespeare, a TFDS dataset), byte_corpus (text files), char_corpora (enwik8,
              text8), wikitext (WikiText-103 words), tfds_corpus (any TFDS text dataset),
              batching (the batch layout, strided batches), windows (random windows and
              evaluation batches), segments (Transformer-XL's contiguous segments)
checkpoint  Orbax checkpoints with checksums; resume, fall back, set aside
rundir      one run per output directory; stopping between steps on a signal
sample      text from a checkpoint
compare     the training accelerators side by side (docs/results/accelerators.md)
"""
