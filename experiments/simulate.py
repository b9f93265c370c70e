"""Predicted step time and speedup of every schedule, from the performance simulator.

Runs `ouroboros_jax.perf.simulate` (a discrete-event model of each schedule's task graph; see
docs/algorithm.md for what is and is not modelled) for G in {1, 2, 4, 8, 16, 32, 64} devices,
capped at the model's layer count, for two model shapes on two interconnects:

    models     gpt2-small (12 layers, d 768, d_ff 3072, seq 1024, vocab 50257, batch 32)
               1b         (24 layers, d 2048, d_ff 8192, seq 2048, vocab 50257, batch 32)
    hardware   300 TFLOP/s at 40% utilisation with 300 GB/s NVLink-class links, or a 25 GB/s
               network; 5 us per message

and writes, under --out (default experiments/results/simulate):

    simulate.csv   model, hardware, label, schedule, devices, microbatches, stash, forward,
                   step_time_s, speedup, idle_fraction, backprop_step_s
    simulate.png   predicted speedup over backprop on one device against G (log2 axis), one
                   line per schedule, one panel per model and interconnect
    gantt.png      one steady-state stretch of four schedules at G = 4 (gpt2-small, NVLink)

and prints one table per model and interconnect. Speedup is throughput relative to backprop on
one device at the same batch per step; data_parallel uses D = G replicas.

    python experiments/simulate.py
    python experiments/simulate.py --stages 1,2,4 --models 1b --hardware nvlink-300GBps
    python experiments/simulate.py --measured bench.csv     # predicted vs measured
    python experiments/simulate.py --render docs/results/bench_2proc_cpu.csv  # a bench's table
    python experiments/simulate.py \
        --layer-costs docs/results/archive/device_h200/layer_costs/layer_costs.csv \
        --hardware nvlink-300GBps --stages 1,2,4,8     # from one layer's costs measured on a GPU

Measured CSV (`--measured`), written by a benchmark, one row per measured setting:

    schedule          backprop | data_parallel | model_parallel | gpipe | 1f1b | interleaved |
                      zb_h1 | zb_v | ouroboros
    stages            devices: G for the stage schedules, D for data_parallel, 1 for backprop
    microbatches      the pipelines' M (ignored elsewhere; may be empty)
    stash             graph | replay for ouroboros (ignored elsewhere; may be empty or '-')
    forward           locked | pipelined for ouroboros (ignored elsewhere; may be empty or '-')
    step_time_s       the measured step: median seconds over steady-state steps, compile excluded
    fwd_s_per_stage   forward seconds of each layer group on the step's whole batch, measured
                      alone: G values joined by ';', or one value meaning every stage. For
                      backprop / data_parallel, the groups of any split of the model (only their
                      sum is used; data_parallel divides it by D, the micro-batched schedules
                      each stage by M, unless fwd_s_per_stage_micro is given)
    bwd_s_per_stage   the same for the backward of each group from its kept graph (graph
                      mode: without replay's recomputed forward, which the simulator adds)
    head_s            device 0's extra work on the whole batch: head forward + backward, plus
                      the embedding lookup and gradient
    link_s            one hop of a whole batch's activation between neighbouring devices
                      (latency included); 0 or empty where nothing travels
  optional columns:
    link_latency_s    the fixed part of link_s, which every hop pays in full (a
                      micro-batch hop costs latency + (link_s - latency) / M): the bench
                      writes the collective's wait, `calibration.collective_wait_probe` (the
                      rounds' median); default 0
    allreduce_s       data_parallel: one all-reduce of every gradient; default 0
    update_s_per_stage   the optimizer update (clip + AdamW) of each stage's parameters (device
                      0's with the embedding and head), G values joined by ';'; default free
    microbatch_overhead_s   gpipe: fixed seconds added to every micro-batch task; default 0
    fwd_s_per_stage_micro   forward seconds of each layer group on ONE micro-batch of the row's
                      setting, B / M rows (M = microbatches; D for data_parallel, whose
                      replicas each compute B / D rows), measured alone, joined by ';' like
                      fwd_s_per_stage; empty or absent: fwd_s_per_stage / M (perfect scaling)
    bwd_s_per_stage_micro   the same for the backward (graph mode, as bwd_s_per_stage)
    concurrent_slowdown   how many times longer a compute task takes while another device
                      computes at once (the processes of one CPU share its memory bus):
                      the bench writes the setting's own program beside copies of itself
                      (`calibration.one_device_probe`) where it timed one, else the whole-batch
                      forward and backward's (`calibration.concurrent_slowdown_probe`), the rounds'
                      median; default 1 (devices independent)
    one_device_s      the setting's own step program timed on one device over the first
                      group (`calibration.one_device_probe`): every compute time is scaled by it
                      over the simulator's one-device step from the row's pieces
                      (`simulate.program_scale`); empty or absent: the pieces as timed alone

The table pipelines run tick by tick, as the library's executor runs them (`simulate`'s
`lockstep`).

It prints and writes (measured_vs_predicted.csv) the predicted step time next to the measured
one with the relative error (predicted - measured) / measured.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import math
import os
from collections.abc import Mapping

from ouroboros_jax import costs as cost_model
from ouroboros_jax.choices import MICROBATCHED
from ouroboros_jax.perf import cost_model as sim_costs
from ouroboros_jax.perf import simulate as sim
from ouroboros_jax.schedules import ScheduleConfig

STAGES = (1, 2, 4, 8, 16, 32, 64)


def _ring(**fields):
  """G -> the Ouroboros ScheduleConfig of `fields` on G stages, the batch as one micro-batch."""
  return lambda g: ScheduleConfig(name='ouroboros', num_stages=g, microbatches=1, **fields)


def _resolved(spec_at):
  """G -> the setting of `spec_at(G)` as the simulator takes it (resolved; no default of it
  depends on the platform or the batch)."""
  return lambda g: spec_at(g).resolve('cpu')


# A line of the plot across G -> the ScheduleConfig it runs at G. The names are the lines', not
# ScheduleConfig.label (which names one G's setting: 'ouroboros M=4 stream locked/graph').
VARIANTS = {
  'data_parallel': lambda g: ScheduleConfig(name='data_parallel', data_parallel=g),
  'model_parallel': lambda g: ScheduleConfig(name='model_parallel', num_stages=g),
  'gpipe M=4': lambda g: ScheduleConfig(name='gpipe', num_stages=g, microbatches=4),
  'gpipe M=8': lambda g: ScheduleConfig(name='gpipe', num_stages=g, microbatches=8),
  'zb_h1 M=8': lambda g: ScheduleConfig(name='zb_h1', num_stages=g, microbatches=8),
  'zb_v M=8': lambda g: ScheduleConfig(name='zb_v', num_stages=g, microbatches=8),
  'ouroboros locked': _ring(forward='locked'),
  'ouroboros locked replay': _ring(forward='locked', stash='replay'),
  'ouroboros pipelined': _ring(forward='pipelined'),
  'ouroboros pipelined replay': _ring(forward='pipelined', stash='replay'),
  # --flow stream runs the batch flow's step at the same M (only the indices differ), at the
  # smallest M that makes every gradient one update old: M = G locked, 2G pipelined.
  'ouroboros stream locked M=G': lambda g: ScheduleConfig(
    name='ouroboros', num_stages=g, microbatches=g, flow='stream'
  ),
  'ouroboros stream pipelined M=2G': lambda g: ScheduleConfig(
    name='ouroboros', num_stages=g, microbatches=2 * g, forward='pipelined', flow='stream'
  ),
}
VARIANTS = {label: _resolved(spec_at) for label, spec_at in VARIANTS.items()}
GANTT = ('model_parallel', 'gpipe M=4', 'ouroboros locked', 'ouroboros pipelined')  # gantt.png
COLUMNS = [
  'model',
  'hardware',
  'label',
  'schedule',
  'devices',
  'microbatches',
  'stash',
  'forward',
  'step_time_s',
  'speedup',
  'idle_fraction',
  'backprop_step_s',
]


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--out', default='experiments/results/simulate')
  parser.add_argument('--stages', default=','.join(map(str, STAGES)))
  parser.add_argument(
    '--models', default=','.join(sim_costs.MODELS), help=', '.join(sim_costs.MODELS)
  )
  parser.add_argument(
    '--hardware', default=','.join(sim_costs.HARDWARE), help=', '.join(sim_costs.HARDWARE)
  )
  parser.add_argument('--measured', metavar='CSV', help='compare with a benchmark CSV instead')
  parser.add_argument(
    '--render',
    metavar='CSV',
    help='print the markdown table of an `ouroboros bench` CSV (its own columns: step time, '
    'tokens/s, ideal and the prediction it wrote) and stop; simulates nothing',
  )
  parser.add_argument(
    '--simulated',
    action='store_true',
    help="with --render: the --measured table instead (the simulator's step from the CSV's own "
    'pieces beside the measured one, and the busiest CPU time against its pieces); writes nothing',
  )
  parser.add_argument(
    '--versus',
    default='backprop',
    help='with --render: comma-separated labels of rows to give a speedup column against',
  )
  parser.add_argument(
    '--layer-costs',
    metavar='CSV',
    help="one layer's measured costs (experiments/layer_costs.py) instead of a FLOP rate; "
    '--hardware then gives only the links',
  )
  parser.add_argument('--optimizer', default='adamw', help='--layer-costs: whose update times')
  parser.add_argument('--no-plot', action='store_true', help='CSV and table only')
  return parser.parse_args(argv)


# ----------------------------------------------------------------------------- predictions


def predict(
  model: sim_costs.ModelShape, hardware: sim_costs.Hardware, stages, costs_of=None
) -> tuple[list[dict], list]:
  """One row per (G, variant) that fits the model; and the G values that do not (G > layers).
  costs_of(G): the StageCosts at G (default: `sim_costs.transformer_costs` on `hardware`)."""
  costs_of = costs_of or (lambda g: sim_costs.transformer_costs(model, hardware, g))
  rows, skipped = [], [g for g in stages if g > model.num_layers]
  for num_stages in [g for g in stages if g <= model.num_layers]:
    costs = costs_of(num_stages)
    for label, config_at in VARIANTS.items():
      config = config_at(num_stages)
      result = sim.simulate(config, costs)
      ring = config.name == 'ouroboros'
      rows.append(
        {
          'model': model.name,
          'hardware': hardware.name,
          'label': label,
          'schedule': config.name,
          'devices': result.num_devices,
          'microbatches': config.microbatches if config.name in MICROBATCHED else '',
          'stash': config.stash if ring else '',
          'forward': config.forward if ring else '',
          'step_time_s': result.step_time,
          'speedup': result.speedup,
          'idle_fraction': result.idle_fraction,
          'backprop_step_s': result.backprop_time,
        }
      )
  return rows, skipped


def format_table(rows: list[dict]) -> str:
  """Variants down, G across: predicted speedup (and backprop's step time on top)."""
  stages = sorted({r['devices'] for r in rows})
  speedup = {(r['label'], r['devices']): r['speedup'] for r in rows}
  backprop_ms = rows[0]['backprop_step_s'] * 1e3
  lines = [
    ' | '.join(['speedup', *(f'G={g}' for g in stages)]),
    ' | '.join(['---'] * (len(stages) + 1)),
    ' | '.join([f'(backprop {backprop_ms:.1f} ms/step)', *('1.00' for _ in stages)]),
  ]
  for label in VARIANTS:
    lines.append(' | '.join([label, *(f'{speedup[label, g]:.2f}' for g in stages)]))
  return '\n'.join(lines)


def read_layer_costs(path: str) -> dict:
  """model -> (device, {rows: that row's costs as floats}) from experiments/layer_costs.py."""
  out = {}
  with open(path, newline='') as f:
    for row in csv.DictReader(f):
      device, rows = out.setdefault(row['model'], (row['device'], {}))
      rows[int(row['rows'])] = {
        k: float(v) for k, v in row.items() if k.endswith('_s') or '_s_' in k
      }
  return out


def measured_transformer_costs(
  model: sim_costs.ModelShape,
  hardware: sim_costs.Hardware,
  num_stages: int,
  layer_rows: Mapping[int, Mapping[str, float]],
  optimizer: str = 'adamw',
  bytes_per_value: int = 2,
) -> sim_costs.StageCosts:
  """The simulator's StageCosts of `model` cut into `num_stages` groups, from one layer's measured
  costs instead of a FLOP rate: `layer_rows` maps rows (the batch, or one micro-batch of it) to a
  row of experiments/layer_costs.py (fwd_s_per_layer, bwd_s_per_layer, head_s: embedding + head,
  f + b; update_s_per_layer_<optimizer>, update_s_embed_head_<optimizer>). A micro-batch size that
  was measured is charged as measured; the links are `hardware`'s."""
  whole = layer_rows[model.batch]
  per_layer = whole['fwd_s_per_layer'] + whole['bwd_s_per_layer']
  layers_per_stage = cost_model.balance_layers(
    model.num_layers, num_stages, per_layer, whole['head_s']
  )
  tokens = model.batch * model.seq_len
  update = [n * whole[f'update_s_per_layer_{optimizer}'] for n in layers_per_stage]
  update[0] += whole[f'update_s_embed_head_{optimizer}']
  micro = {
    model.batch // rows: row for rows, row in layer_rows.items() if rows < model.batch
  }  # M -> the row of one micro-batch of B / M rows
  return sim_costs.StageCosts(
    forward_s=[n * whole['fwd_s_per_layer'] for n in layers_per_stage],
    backward_s=[n * whole['bwd_s_per_layer'] for n in layers_per_stage],
    head_s=whole['head_s'],
    activation_bytes=tokens * model.d_model * bytes_per_value,
    grad_bytes=model.params * bytes_per_value,
    bandwidth=hardware.bandwidth,
    latency=hardware.latency,
    update_s=update,
    batch_size=model.batch,
    microbatch_forward_s={
      m: [n * row['fwd_s_per_layer'] for n in layers_per_stage] for m, row in micro.items()
    },
    microbatch_backward_s={
      m: [n * row['bwd_s_per_layer'] for n in layers_per_stage] for m, row in micro.items()
    },
  )


def write_csv(path: str, rows: list[dict], columns: list[str]) -> None:
  with open(path, 'w', newline='') as f:
    writer = csv.DictWriter(f, fieldnames=columns)
    writer.writeheader()
    writer.writerows(rows)


def plot_speedup(rows: list[dict], path: str) -> None:
  import matplotlib

  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  panels = sorted(
    {(r['hardware'], r['model']) for r in rows},
    key=lambda p: (list(sim_costs.HARDWARE).index(p[0]), list(sim_costs.MODELS).index(p[1])),
  )
  hardware = sorted({p[0] for p in panels}, key=list(sim_costs.HARDWARE).index)
  models = sorted({p[1] for p in panels}, key=list(sim_costs.MODELS).index)
  fig, axes = plt.subplots(
    len(hardware), len(models), squeeze=False, figsize=(5.5 * len(models), 4.2 * len(hardware))
  )
  for hw, model in panels:
    ax = axes[hardware.index(hw)][models.index(model)]
    mine = [r for r in rows if r['hardware'] == hw and r['model'] == model]
    stages = sorted({r['devices'] for r in mine})
    ax.plot(stages, stages, 'k:', label='ideal (G x)')
    for label in VARIANTS:
      points = sorted((r['devices'], r['speedup']) for r in mine if r['label'] == label)
      style = '-' if label.startswith('ouroboros') else '--'
      ax.plot(*zip(*points), style, marker='o', markersize=3, label=label)
    ax.set_xscale('log', base=2)
    ax.set_xticks(stages, [str(g) for g in stages])
    ax.set_xlabel('devices G')
    ax.set_ylabel('predicted speedup over backprop')
    ax.set_title(f'{model}, {hw}')
    ax.grid(alpha=0.3)
  axes[0][0].legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def plot_gantt(path: str, num_stages: int = 4, steps_shown: int = 3) -> None:
  """A steady-state stretch of model_parallel, gpipe, and both Ouroboros forwards."""
  import matplotlib

  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  costs = sim_costs.transformer_costs(sim_costs.GPT2_SMALL, sim_costs.NVLINK, num_stages)
  runs = [(label, VARIANTS[label](num_stages)) for label in GANTT]
  colors = {
    'fwd': 'tab:blue',
    'bwd': 'tab:orange',
    'head': 'tab:green',
    'embed_fwd': 'tab:gray',
    'embed_bwd': 'tab:gray',
    'act': 'tab:cyan',
    'grad': 'tab:red',
  }
  fig, axes = plt.subplots(len(runs), 1, figsize=(10, 2.2 * len(runs)))
  for ax, (title, config) in zip(axes, runs):
    result = sim.simulate(config, costs)
    t1 = result.step_ends[-1]
    t0 = result.step_ends[-1 - steps_shown]
    lanes = list(range(num_stages)) + sorted(
      {s.device for s in result.timeline if isinstance(s.device, str)}
    )
    for span in result.timeline:
      if span.end <= t0 or span.start >= t1 or span.end == span.start:
        continue
      row = lanes.index(span.device)
      ax.barh(
        row,
        (span.end - span.start) * 1e3,
        left=(span.start - t0) * 1e3,
        height=0.8,
        color=colors.get(span.kind, 'k'),
        edgecolor='white',
        linewidth=0.3,
      )
    ax.set_yticks(range(len(lanes)), [f'dev {l}' if isinstance(l, int) else l for l in lanes])
    ax.invert_yaxis()
    ax.set_xlim(0, (t1 - t0) * 1e3)
    ax.set_title(
      f'{title}: {result.step_time * 1e3:.1f} ms/step, speedup {result.speedup:.2f}', fontsize=9
    )
  axes[-1].set_xlabel(
    f'ms ({steps_shown} steady-state steps, gpt2-small, G={num_stages}, NVLink);'
    ' blue fwd, orange bwd, green head, cyan/red activation/gradient hops'
  )
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


# ----------------------------------------------------------------------------- measured


def _number(text, default: float = 0.0) -> float:
  text = (text or '').strip()
  return default if text in ('', '-') else float(text)


def _mode(text, default: str) -> str:
  text = (text or '').strip()
  return default if text in ('', '-') else text


def _per_stage(text: str, num_stages: int, schedule: str) -> list[float]:
  values = [float(v) for v in text.replace(',', ';').split(';') if v.strip()]
  if schedule in ('backprop', 'data_parallel'):
    return [sum(values)]  # only the whole model's time matters
  if len(values) == 1:
    return values * num_stages
  if len(values) != num_stages:
    raise ValueError(
      f'{schedule} with {num_stages} stages needs {num_stages} per-stage times '
      f'(or one), got {len(values)}: {text!r}.'
    )
  return values


def measured_setting(row: dict) -> tuple[ScheduleConfig, sim_costs.StageCosts]:
  """(the ScheduleConfig, its StageCosts) of one measured-CSV row."""
  schedule = row['schedule'].strip()
  devices = int(row['stages'])
  num_stages = 1 if schedule in ('backprop', 'data_parallel') else devices
  micro = int(_number(row.get('microbatches'), 1)) if schedule in MICROBATCHED else 1
  link, latency = _number(row.get('link_s')), _number(row.get('link_latency_s'))
  # the micro-batch size whose measured costs the row may carry: data_parallel's replicas too
  parts = devices if schedule == 'data_parallel' else micro
  measured_micro = {
    name: {parts: _per_stage(row[column], num_stages, schedule)}
    for name, column in (
      ('microbatch_forward_s', 'fwd_s_per_stage_micro'),
      ('microbatch_backward_s', 'bwd_s_per_stage_micro'),
    )
    if parts > 1 and (row.get(column) or '').strip() not in ('', '-')
  }
  costs = sim_costs.StageCosts(
    forward_s=_per_stage(row['fwd_s_per_stage'], num_stages, schedule),
    backward_s=_per_stage(row['bwd_s_per_stage'], num_stages, schedule),
    head_s=_number(row.get('head_s')),
    # One whole-batch hop costs link_s: a 1-"byte" activation at 1 / (link_s - latency) B/s.
    activation_bytes=1.0,
    latency=latency,
    bandwidth=1.0 / (link - latency) if link > latency else math.inf,
    allreduce_s=_number(row.get('allreduce_s')),
    microbatch_overhead_s=_number(row.get('microbatch_overhead_s')),
    update_s=(
      _per_stage(row['update_s_per_stage'], num_stages, schedule)
      if (row.get('update_s_per_stage') or '').strip()
      else ()
    ),
    **measured_micro,
    concurrent_slowdown=_number(row.get('concurrent_slowdown'), 1.0),
    input_grad_share=_number(row.get('input_grad_share'), sim_costs.StageCosts.input_grad_share),
  )
  ring = dict(stash=_mode(row.get('stash'), 'graph'), forward=_mode(row.get('forward'), 'locked'))
  config = ScheduleConfig(
    name=schedule,
    num_stages=num_stages,
    data_parallel=devices if schedule == 'data_parallel' else 1,
    microbatches=micro if schedule in MICROBATCHED else None,
    **(ring if schedule == 'ouroboros' else {}),
  ).resolve('cpu')
  return config, costs


def compare_measured(path: str) -> list[dict]:
  """Simulate every row of a measured CSV from its own per-stage times."""
  with open(path, newline='') as f:
    rows = list(csv.DictReader(f))
  out = []
  for row in rows:
    config, costs = measured_setting(row)
    # the pieces scaled to what one device's work costs inside the setting's step program,
    # where the bench timed that program on one device (`calibration.one_device_probe`)
    one_device_s = _number(row.get('one_device_s'))
    scale = sim.program_scale(config, costs, one_device_s) if one_device_s else math.nan
    in_program = sim_costs.scaled(costs, scale) if one_device_s else costs
    result = sim.simulate(config, in_program, lockstep=True)  # as the library's executor runs
    measured, ring = float(row['step_time_s']), config.name == 'ouroboros'
    out.append(
      {
        'schedule': config.name,
        'stages': int(row['stages']),
        'microbatches': config.num_microbatches if config.name in MICROBATCHED else '',
        'stash': config.stash if ring else '',
        'forward': config.forward if ring else '',
        'measured_s': measured,
        'predicted_s': result.step_time,
        'rel_error': (result.step_time - measured) / measured,
        'predicted_speedup': result.speedup,
        # CPU seconds a step of the busiest process spent (the bench's busy_s) against the
        # busiest simulated device's compute with the pieces timed alone (no slowdown): how much
        # work the simulator misses, apart from when it runs
        'busy_s': _number(row.get('busy_s'), math.nan),
        'pieces_busy_s': max(sim.simulate(config, unslowed(costs), lockstep=True).per_device_busy),
        'program_scale': scale,
      }
    )
  return out


def unslowed(costs: sim_costs.StageCosts) -> sim_costs.StageCosts:
  return dataclasses.replace(costs, concurrent_slowdown=1.0)


def format_comparison(rows: list[dict]) -> str:
  lines = [
    'schedule | G | M | stash | forward | measured ms | predicted ms | error '
    '| CPU s (busiest process) | pieces s (busiest device) | CPU / pieces | one device / pieces',
    '--- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | ---',
  ]
  for r in rows:
    scale = r.get('program_scale', math.nan)
    lines.append(
      f'{r["schedule"]} | {r["stages"]} | {r["microbatches"]} | {r["stash"]} | '
      f'{r["forward"]} | {r["measured_s"] * 1e3:.3f} | {r["predicted_s"] * 1e3:.3f} | '
      f'{r["rel_error"]:+.1%} | {r["busy_s"]:.2f} | {r["pieces_busy_s"]:.2f} | '
      f'{r["busy_s"] / r["pieces_busy_s"]:.2f} | {"" if math.isnan(scale) else f"{scale:.2f}"}'
    )
  return '\n'.join(lines)


def render_bench(path: str, versus=('backprop',)) -> str:
  """The markdown table of a bench CSV, every row in the CSV's order, from its own columns only:
  step ms, tokens/s, the speedup against each row of `versus` (its step time over this one's),
  the ideal step (free links), measured / ideal, and the error of the prediction the bench wrote
  (`predicted_s`, with the measured link times) against the measured step."""
  with open(path, newline='') as f:
    rows = list(csv.DictReader(f))
  by_label = {r['label']: float(r['step_time_s']) for r in rows}
  missing = [v for v in versus if v not in by_label]
  if missing:
    raise SystemExit(f'{path}: no row labelled {missing}; labels: {", ".join(by_label)}')
  head = ['setting', 'step ms', 'tokens/s', *(f'vs {v}' for v in versus)]
  head += ['ideal ms', 'measured / ideal', 'simulator error']
  lines = ['| ' + ' | '.join(head) + ' |', '|' + '---|' * len(head)]
  for r in rows:
    step, ideal = float(r['step_time_s']), _number(r.get('ideal_s'), math.nan)
    predicted = _number(r.get('predicted_s'), math.nan)
    cells = [r['label'], f'{step * 1e3:.0f}', f'{float(r["tokens_per_s"]):.0f}']
    cells += [f'{by_label[v] / step:.2f}x' for v in versus]
    cells += [f'{ideal * 1e3:.0f}', f'{step / ideal:.2f}', f'{(predicted - step) / step:+.1%}']
    lines.append('| ' + ' | '.join(cells) + ' |')
  return '\n'.join(lines)


# ----------------------------------------------------------------------------- main


def main(argv=None):
  args = parse_args(argv)
  if args.render and args.simulated:
    print(format_comparison(compare_measured(args.render)))
    return None
  if args.render:
    print(render_bench(args.render, [v for v in args.versus.split(',') if v]))
    return None
  os.makedirs(args.out, exist_ok=True)
  if args.measured:
    rows = compare_measured(args.measured)
    write_csv(os.path.join(args.out, 'measured_vs_predicted.csv'), rows, list(rows[0]))
    print(format_comparison(rows))
    return rows

  stages = [int(g) for g in args.stages.split(',') if g]
  measured = read_layer_costs(args.layer_costs) if args.layer_costs else None
  rows = []
  for model_name in [m for m in args.models.split(',') if m]:
    model = sim_costs.MODELS[model_name]
    for hw_name in [h for h in args.hardware.split(',') if h]:
      hardware, costs_of = sim_costs.HARDWARE[hw_name], None
      if measured is not None:
        device, layer_rows = measured[model_name]
        hardware = dataclasses.replace(hardware, name=f'{device} measured, {hardware.name} links')
        costs_of = lambda g, m=model, h=hardware, r=layer_rows: measured_transformer_costs(
          m, h, g, r, args.optimizer
        )
      mine, skipped = predict(model, hardware, stages, costs_of)
      rows += mine
      print(f'\n## {model.name} ({model.params / 1e6:.0f}M parameters), {hardware.name}\n')
      print(format_table(mine))
      if skipped:
        print(
          f'\nG = {", ".join(map(str, skipped))} not predicted: {model.name} has '
          f'{model.num_layers} layers, at most one stage per layer (prediction stops at '
          f'G = {model.num_layers}).'
        )
  write_csv(os.path.join(args.out, 'simulate.csv'), rows, COLUMNS)
  if not args.no_plot:
    plot_speedup(rows, os.path.join(args.out, 'simulate.png'))
    plot_gantt(os.path.join(args.out, 'gantt.png'))
  print(f'\nwrote {args.out}/simulate.csv' + ('' if args.no_plot else ', simulate.png, gantt.png'))
  return rows


if __name__ == '__main__':
  main()
