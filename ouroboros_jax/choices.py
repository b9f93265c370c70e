"""The named choices of the step interface, each listed once (standard library only, so the
simulator and the config can read them without JAX)."""

from __future__ import annotations

SCHEDULES = ('backprop', 'data_parallel', 'model_parallel', 'gpipe', 'ouroboros')
FORWARD_MODES = ('locked', 'pipelined')  # Ouroboros: the paper's forward, or one hop per step
STASH_MODES = ('graph', 'replay')  # Ouroboros: keep the VJP, or the input to replay it
TIED_GRAD_MODES = ('sum', 'mean')  # a tied embedding: sum or average its two gradients
