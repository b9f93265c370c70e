"""The named choices of the step interface, each listed once (standard library only, so the
simulator and the config can read them without JAX)."""

from __future__ import annotations

# The exact pipelines run from their tables (schedules/tables.py, schedules/pipeline.py).
EXACT_PIPELINES = ('1f1b', 'interleaved', 'zb_h1', 'zb_v')
# The zero-bubble pipelines split a backward into B (the input gradient) and W (the weight's).
SPLIT_BACKWARD = ('zb_h1', 'zb_v')
MICROBATCHED = ('gpipe', *EXACT_PIPELINES, 'ouroboros')  # they cut a batch into micro-batches
SCHEDULES = ('backprop', 'data_parallel', 'model_parallel', 'gpipe', *EXACT_PIPELINES, 'ouroboros')
FORWARD_MODES = ('locked', 'pipelined')  # Ouroboros: the paper's forward, or one hop per step
# Ouroboros: micro-batches as one batch, or streamed (delays.py); auto: streamed under a
# compensation (the recipe), as one batch without (the paper's method)
FLOW_MODES = ('auto', 'batch', 'stream')
STASH_MODES = ('graph', 'replay')  # Ouroboros: keep the VJP, or the input to replay it
# Ouroboros' graph stash: which residuals it keeps (staging.STASH_POLICIES), by default 'nothing':
# each group's input and weights, the rest recomputed at the forward's weights
# (docs/results/memory.md).
# The one default of ScheduleConfig, make_stash, GraphStash and the benchmark's pieces.
DEFAULT_STASH_POLICY = 'nothing'
# The policies' names (staging.STASH_POLICIES maps each to its jax.checkpoint policy): what any
# schedule's forward keeps for its backward, the rest recomputed (--stash-policy).
STASH_POLICY_NAMES = ('all', 'dots', 'dots_no_batch', 'nothing')
# Ouroboros: where the stash waits: the device's memory, the host's (JAX memory kinds), or the
# devices', a deep group's older slots lent to its mirror's device (schedules/stash_layout.py)
STASH_MEMORIES = ('device', 'pinned_host', 'balanced')
TIED_GRAD_MODES = ('sum', 'mean')  # a tied embedding: sum or average its two gradients
