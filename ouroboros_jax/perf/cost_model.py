"""What a training step's pieces cost, the simulator's input (`simulate.py`): `StageCosts`, the
seconds and bytes of each stage's forward, backward, head, embedding, update and transfers, and
the analytic model of a decoder-only Transformer on an accelerator (`transformer_costs`, with the
`ModelShape` and `Hardware` presets).

    costs = transformer_costs(GPT2_SMALL, NVLINK, num_stages=4)

Standard library only, as `simulate.py`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Sequence

from ouroboros_jax import costs

# ----------------------------------------------------------------------------- stage costs


@dataclasses.dataclass(frozen=True)
class StageCosts:
  """Seconds and bytes of one training step's pieces; every time is for the whole batch, except
  the measured micro-batch times.

  A schedule that cuts the batch into M equal micro-batches (gpipe, the table pipelines,
  Ouroboros with M > 1; data_parallel's D replicas, each on B / D rows) charges a stage's forward
  or backward of one micro-batch `microbatch_forward_s[M][s]` / `microbatch_backward_s[M][s]`
  where measured, else forward_s[s] / M (perfect scaling, which small micro-batches miss: a
  matmul of B / M rows rarely runs at the whole batch's rate).
  """

  forward_s: Sequence[float]  # per stage s: its layer group's forward
  backward_s: Sequence[float]  # per stage s: backward from a kept graph, no recompute
  head_s: float = 0.0  # device 0: final norm, output projection, loss; f + b
  embed_forward_s: float = 0.0  # device 0: embedding lookup
  embed_backward_s: float = 0.0  # device 0: embedding gradient
  activation_bytes: float = 0.0  # one batch's activation (= error gradient) between stages
  grad_bytes: float = 0.0  # every parameter's gradient (the data-parallel all-reduce)
  bandwidth: float = math.inf  # bytes / s, per link and direction
  latency: float = 0.0  # seconds per transfer
  microbatch_overhead_s: float = 0.0  # fixed cost added to every micro-batch task (M > 1)
  allreduce_s: float | None = None  # a measured all-reduce time; overrides the ring formula
  update_s: Sequence[float] = ()  # per stage s: the optimizer update of its parameters
  # (device 0's includes embedding and head); () = free
  batch_size: int | None = None  # when known, checked against R and M
  # M -> per stage s: one micro-batch of B / M rows, measured (M >= 2; an M not given: / M)
  microbatch_forward_s: Mapping[int, Sequence[float]] = dataclasses.field(default_factory=dict)
  microbatch_backward_s: Mapping[int, Sequence[float]] = dataclasses.field(default_factory=dict)
  # the fraction of a group's forward that its backward re-runs first (`recompute_fraction` of
  # the stash policy; 0: nothing recomputed, or backward_s measured with the recompute in it)
  recompute: float = 0.0
  # how many times longer a compute task takes while another device computes at the same time
  # (devices that share a memory bus and caches: the processes of one CPU), measured as the
  # stages' forward + backward timed on every device at once over the same timed alone; 1: none
  concurrent_slowdown: float = 1.0
  # a split (zero-bubble) backward's B over its B + W: the input gradient's share of the
  # backward, W (the weight gradient's matrix products) the rest. B also carries the attention's
  # and the norms' backward, so on a CPU it took 0.53-0.58 of a transformer layer's, not half
  # (docs/results/simulator_calibration.md); measured per micro-batch by
  # `calibration.measure_pieces`
  input_grad_share: float = 0.5
  # The collectives' network (FSDP's gathers and reductions, the data-parallel all-reduce):
  # per stage s, its layer group's parameters in bytes (what FSDP gathers; () = not known); the
  # rate at which a chip sends to its ring's next chip in a collective, over every link it drives
  # (None: `bandwidth`, one link); and where the chips span slices of `slice_chips` each (0: one
  # slice holds them all), the data-centre network's rate a chip, between slices.
  param_bytes: Sequence[float] = ()
  collective_bandwidth: float | None = None
  dcn_bandwidth: float = math.inf
  slice_chips: int = 0
  # Ouroboros' balanced stash (--stash-memory balanced): the bytes of one micro-batch's stash
  # item on a device, which a deep group sends to its mirror and gets back (0: not known, free)
  stash_item_bytes: float = 0.0
  # What a gradient reduction moves per byte that `grad_bytes` and `param_bytes` count (those
  # count the parameters at the width they are gathered and computed in): the stored parameters'
  # width over that. Float32 parameters computed in bfloat16: 2, since the TPU compiler gathers
  # them in bfloat16 but reduces their float32 gradients (docs/results/memory.md); 1: the same.
  reduce_scale: float = 1.0

  def __post_init__(self):
    object.__setattr__(self, 'forward_s', tuple(float(f) for f in self.forward_s))
    object.__setattr__(self, 'backward_s', tuple(float(b) for b in self.backward_s))
    object.__setattr__(self, 'update_s', tuple(float(u) for u in self.update_s))
    object.__setattr__(self, 'param_bytes', tuple(float(p) for p in self.param_bytes))
    for name in ('microbatch_forward_s', 'microbatch_backward_s'):
      table = {int(m): tuple(float(v) for v in values) for m, values in getattr(self, name).items()}
      for m, values in table.items():
        if m < 2 or len(values) != len(self.forward_s) or min(values, default=0.0) < 0:
          raise ValueError(
            f'{name}[{m}] needs M >= 2 and one time >= 0 per stage ({len(self.forward_s)}); '
            f'got {values}.'
          )
      object.__setattr__(self, name, table)
    for name in ('update_s', 'param_bytes'):
      if getattr(self, name) and len(getattr(self, name)) != len(self.forward_s):
        raise ValueError(f'{name} needs one entry per stage; got {len(getattr(self, name))}.')
    if not self.forward_s or len(self.forward_s) != len(self.backward_s):
      raise ValueError(
        f'forward_s and backward_s need one entry per stage; got '
        f'{len(self.forward_s)} and {len(self.backward_s)}.'
      )
    scalars = (
      self.head_s,
      self.embed_forward_s,
      self.embed_backward_s,
      self.activation_bytes,
      self.grad_bytes,
      self.latency,
      self.microbatch_overhead_s,
      self.slice_chips,
      *self.param_bytes,
    )
    rates = (self.bandwidth, self.collective_bandwidth or 1.0, self.dcn_bandwidth)
    if min(*self.forward_s, *self.backward_s, *self.update_s, *scalars) < 0 or min(rates) <= 0:
      raise ValueError('costs must be >= 0 and the bandwidths > 0.')
    if not self.reduce_scale > 0:
      raise ValueError(f'reduce_scale must be > 0, got {self.reduce_scale}.')
    if not self.concurrent_slowdown > 0:
      raise ValueError(f'concurrent_slowdown must be > 0, got {self.concurrent_slowdown}.')
    if not 0 < self.input_grad_share < 1:
      raise ValueError(f'input_grad_share must be in (0, 1), got {self.input_grad_share}.')

  @property
  def num_stages(self) -> int:
    return len(self.forward_s)

  def forward_of(self, s: int, microbatches: int = 1) -> float:
    """Stage s's forward of one of `microbatches` equal micro-batches: measured, or / M."""
    measured = self.microbatch_forward_s.get(microbatches) if microbatches > 1 else None
    return measured[s] if measured else self.forward_s[s] / microbatches

  def recompute_of(self, s: int, microbatches: int = 1) -> float:
    """What stage s's backward of one of `microbatches` micro-batches re-runs of its forward."""
    return self.recompute * self.forward_of(s, microbatches) if self.recompute else 0.0

  def backward_of(self, s: int, microbatches: int = 1) -> float:
    """Stage s's backward (from a kept graph) of one of `microbatches` equal micro-batches."""
    measured = self.microbatch_backward_s.get(microbatches) if microbatches > 1 else None
    return measured[s] if measured else self.backward_s[s] / microbatches

  def transfer_s(self, nbytes: float) -> float:
    """One message over one link."""
    return self.latency + nbytes / self.bandwidth

  def allreduce_time(self, replicas: int) -> float:
    """Ring all-reduce of every gradient over `replicas` devices (0 for one): a reduce-scatter
    and an all-gather (`collective_s`), unless measured (`allreduce_s`)."""
    if replicas == 1:
      return 0.0
    if self.allreduce_s is not None:
      return self.allreduce_s
    return 2 * self.reduce_s(self.grad_bytes, replicas)

  def reduce_s(self, nbytes: float, replicas: int) -> float:
    """One ring reduce-scatter over `replicas` chips of the gradients of parameters that
    gather as `nbytes` (`reduce_scale` times the bytes; `collective_s`)."""
    return self.collective_s(nbytes * self.reduce_scale, replicas)

  def collective_s(self, nbytes: float, replicas: int) -> float:
    """One ring all-gather of `nbytes`, each of `replicas` chips holding 1 / D of it (a
    reduce-scatter takes the same): each chip receives (D - 1) / D of it. Within a slice at
    `collective_bandwidth`; across k slices of D_s = `slice_chips` chips, first the chips of one
    index in every slice gather their shards ((k - 1) / k of nbytes / D_s each, at
    `dcn_bandwidth`), then each slice gathers its D_s chunks over its own links."""
    inside = min(self.slice_chips or replicas, replicas)
    if replicas % inside:
      raise ValueError(f'{replicas} chips do not fill slices of {inside}.')
    slices, rate = replicas // inside, self.collective_bandwidth or self.bandwidth
    seconds = (inside - 1) / inside * nbytes / rate + (inside - 1) * self.latency
    if slices > 1:
      seconds += (slices - 1) / slices * nbytes / inside / self.dcn_bandwidth
      seconds += (slices - 1) * self.latency
    return seconds

  @property
  def embedding_bytes(self) -> float:
    """The parameters outside the stages' layer groups (embedding, head, final norm)."""
    return max(self.grad_bytes - sum(self.param_bytes), 0.0)

  def total_compute_s(self) -> float:
    """One device doing everything: the backprop step."""
    return (
      self.embed_forward_s
      + sum(self.forward_s)
      + self.head_s
      + sum(self.backward_s)
      + self.embed_backward_s
      + sum(self.update_s)
    )


def backprop_time(costs: StageCosts) -> float:
  """Step time of plain backprop on one device, the reference of every speedup."""
  return costs.total_compute_s()


# The share of a layer group's forward that each stash policy (staging.STASH_POLICIES) leaves to be
# re-run in the backward. 'nothing' re-runs all of it. 'dots' keeps every matrix product's output
# and re-runs the rest (norms, activations, softmax, dropout, residual adds): few FLOPs, but
# memory-bound passes over the activations, estimated at DOTS_RECOMPUTE of the forward's time (an
# estimate, not a measurement). 'dots_no_batch' also re-runs attention's two batched products,
# QK^T and PV: their share of the FLOPs, L / (6d + L) with d_ff = 4d (`recompute_fraction`).
DOTS_RECOMPUTE = 0.2


def recompute_fraction(policy: str, seq_len: int = 0, d_model: int = 1) -> float:
  """The fraction of a group's forward that `policy`'s backward re-runs (see DOTS_RECOMPUTE)."""
  if policy == 'all':
    return 0.0
  if policy == 'nothing':
    return 1.0
  if policy == 'dots':
    return DOTS_RECOMPUTE
  if policy == 'dots_no_batch':
    return DOTS_RECOMPUTE + seq_len / (6 * d_model + seq_len)
  raise ValueError(f'unknown stash policy {policy!r}; choose all, dots, dots_no_batch or nothing.')


def first_stage(costs: StageCosts) -> StageCosts:
  """Stage 0's costs alone, as one device running its layer group with the embedding and the
  head, and no other device beside it: the pieces of a setting's step on one device."""
  first = lambda table: {m: values[:1] for m, values in table.items()}
  return dataclasses.replace(
    costs,
    forward_s=costs.forward_s[:1],
    backward_s=costs.backward_s[:1],
    update_s=costs.update_s[:1],
    microbatch_forward_s=first(costs.microbatch_forward_s),
    microbatch_backward_s=first(costs.microbatch_backward_s),
    concurrent_slowdown=1.0,
  )


def scaled(costs: StageCosts, factor: float) -> StageCosts:
  """`costs` with every compute time (forward, backward, micro-batch, head, embedding, update)
  `factor` times longer; transfers unchanged."""
  times = lambda values: [factor * v for v in values]
  return dataclasses.replace(
    costs,
    forward_s=times(costs.forward_s),
    backward_s=times(costs.backward_s),
    update_s=times(costs.update_s),
    head_s=factor * costs.head_s,
    embed_forward_s=factor * costs.embed_forward_s,
    embed_backward_s=factor * costs.embed_backward_s,
    microbatch_forward_s={m: times(v) for m, v in costs.microbatch_forward_s.items()},
    microbatch_backward_s={m: times(v) for m, v in costs.microbatch_backward_s.items()},
    microbatch_overhead_s=factor * costs.microbatch_overhead_s,
  )


# ----------------------------------------------------------------------------- a Transformer's


def transformer_costs(
  model: ModelShape,
  hardware: Hardware,
  num_stages: int,
  layers_per_stage: Sequence[int] | None = None,
  bytes_per_value: int = 2,
  param_bytes_per_value: int = 4,
  optimizer: str | None = None,
) -> StageCosts:
  """StageCosts of `model`, a decoder-only Transformer with tied embeddings, cut into
  `num_stages` groups, on `hardware`: activations and gathered weights `bytes_per_value` wide
  (the compute dtype's), gradients reduced `param_bytes_per_value` wide (the stored parameters').
  With an `optimizer` ('muon', 'adamw', 'nadamw') each stage's update is priced (`update_s`):
  Muon's orthogonalisation at the matmul rate, every optimizer's elementwise pass at
  `hardware.memory_bandwidth` (`_update_s`); None leaves the update free.

  `hardware.flops_per_s` is the *effective* rate (peak x utilisation). Backward = 2 x forward.
  The embedding's lookup and scatter-add gradient are memory-bound and tiny; they are counted as
  2 d_model FLOPs per token each, a placeholder that keeps them on device 0's timeline.
  """
  num_layers, d_model, flops_per_s = model.num_layers, model.d_model, hardware.flops_per_s
  costs.check_stages(num_layers, num_stages)
  tokens = model.batch * model.seq_len
  per_layer = costs.layer_flops(d_model, model.d_ff, model.seq_len) * tokens / flops_per_s
  head = costs.head_flops(d_model, model.vocab) * tokens / flops_per_s
  if layers_per_stage is None:
    # Forward costs on both sides: the backward is 2x either way, so the balance is the same.
    layers_per_stage = costs.balance_layers(num_layers, num_stages, per_layer, head)
  if len(layers_per_stage) != num_stages or sum(layers_per_stage) != num_layers:
    raise ValueError(
      f'layers_per_stage {tuple(layers_per_stage)} must give {num_stages} stages '
      f'summing to {num_layers} layers.'
    )
  embed = 2 * d_model * tokens / flops_per_s
  layer_bytes = (model.params - model.vocab * d_model) / num_layers * bytes_per_value
  layer_update, embed_update = _update_s(model, hardware, optimizer, param_bytes_per_value)
  update = [n * layer_update for n in layers_per_stage] if optimizer else []
  if update:
    update[0] += embed_update  # the tied embedding and head, on stage 0 as its gradient
  return StageCosts(
    forward_s=[n * per_layer for n in layers_per_stage],
    backward_s=[2 * n * per_layer for n in layers_per_stage],
    head_s=3 * head,
    embed_forward_s=embed,
    embed_backward_s=embed,
    activation_bytes=tokens * d_model * bytes_per_value,
    grad_bytes=model.params * bytes_per_value,
    bandwidth=hardware.bandwidth,
    latency=hardware.latency,
    batch_size=model.batch,
    param_bytes=[n * layer_bytes for n in layers_per_stage],
    collective_bandwidth=hardware.collective_bandwidth,
    dcn_bandwidth=hardware.dcn_bandwidth,
    reduce_scale=param_bytes_per_value / bytes_per_value,
    update_s=update,
  )


def _update_s(model, hardware, optimizer: str | None, param_bytes: int) -> tuple[float, float]:
  """(one layer's optimizer update, the embedding's) in seconds on `hardware`: the matmuls of
  `costs.layer_update_flops` (Muon's orthogonalisation) at `flops_per_s`, and the elementwise
  pass over every parameter (`costs.UPDATE_VALUES_PER_PARAM` values `param_bytes` wide) at
  `memory_bandwidth`. The embedding is Adam's (elementwise) under every optimizer."""
  if not optimizer:
    return 0.0, 0.0
  moved = costs.UPDATE_VALUES_PER_PARAM * param_bytes / hardware.memory_bandwidth
  embed_params = model.vocab * model.d_model
  layer_params = (model.params - embed_params) / model.num_layers
  matmuls = costs.layer_update_flops(optimizer, model.d_model, model.d_ff) / hardware.flops_per_s
  return matmuls + layer_params * moved, embed_params * moved


@dataclasses.dataclass(frozen=True)
class ModelShape:
  name: str
  num_layers: int
  d_model: int
  d_ff: int
  seq_len: int
  vocab: int
  batch: int

  @property
  def params(self) -> int:
    return self.num_layers * (4 * self.d_model**2 + 2 * self.d_model * self.d_ff) + (
      self.vocab * self.d_model
    )


@dataclasses.dataclass(frozen=True)
class Hardware:
  name: str
  flops_per_s: float  # effective: peak x utilisation
  bandwidth: float  # bytes / s per link direction
  latency: float  # seconds per message
  collective_bandwidth: float | None = None  # bytes / s a chip sends in a collective, every
  # link it has (None: one link's `bandwidth`)
  dcn_bandwidth: float = math.inf  # bytes / s a chip, between slices (the data-centre network)
  memory_bandwidth: float = math.inf  # bytes / s a chip's own memory (HBM): the optimizer's
  # elementwise pass (inf: free)


GPT2_SMALL = ModelShape(
  'gpt2-small', num_layers=12, d_model=768, d_ff=3072, seq_len=1024, vocab=50257, batch=32
)
ONE_B = ModelShape(
  '1b', num_layers=24, d_model=2048, d_ff=8192, seq_len=2048, vocab=50257, batch=32
)
# A 300 TFLOP/s (bf16) accelerator at 40% utilisation with an A100-80GB's 2.0 TB/s of HBM
# (NVIDIA's A100 datasheet), NVLink-class links or a 25 GB/s network.
NVLINK = Hardware(
  'nvlink-300GBps', flops_per_s=0.4 * 300e12, bandwidth=300e9, latency=5e-6, memory_bandwidth=2e12
)
NETWORK = Hardware(
  'network-25GBps', flops_per_s=0.4 * 300e12, bandwidth=25e9, latency=5e-6, memory_bandwidth=2e12
)
MODELS = {m.name: m for m in (GPT2_SMALL, ONE_B)}
HARDWARE = {h.name: h for h in (NVLINK, NETWORK)}
