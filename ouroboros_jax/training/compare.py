"""Plain training against each training accelerator, on the same data and token budget.

    from ouroboros_jax.training import compare, config, field_flags, presets
    base = field_flags.override(presets.get_preset('tiny'), {'num_layers': 4, 'steps': 300})
    results = compare.compare(base, out_dir='runs/accelerators')
    print(compare.markdown_table(results))
    compare.plot(results, 'accelerators.png')

Every method is one `TrainConfig` (the same model, batches, optimizer and number of steps, hence
the same tokens), trained by `loop.train` exactly as `ouroboros train` with the method's flag
would. `methods(steps, num_layers)` gives the default plans, scaled to the run's length:

  plain      backprop, every layer every step
  pld        --pld 0.5,100/steps (the paper's heuristic gamma ~ 100 / T)
  mslt       --growth mslt:L/4 x T/4, L/2 x T/4, L x T/4, all:T/4 (each phase trains only the
             layers it added, the rest run forward only; a final all-layer stage)
  stacking   --growth stacking:L/4 x T/4, L/2 x T/4, L x rest (double, train everything)
  vcycle     --vcycle down=T/4,coarse=T/4 (half width and half depth for a quarter of the run)
  stdloss    --std-loss 1e-4 on every layer (a regulariser: no saving expected)

What is measured per run (`loop.py`, `metrics.jsonl`):
  wall_s     wall-clock of the training steps, compilation included, evaluation excluded
  compile_s  the part of it spent in the first step of each phase (compiling a new depth or
             width, growing, coalescing)
  cpu_s      the same in process CPU seconds (all threads): on a shared machine wall-clock
             depends on the neighbours' load, CPU time much less
  flops      model FLOPs actually spent, counted analytically per step from the layers actually
             computed: a trained layer 3F (forward + backward), a frozen (MSLT) layer F, a layer
             PLD dropped 0 (its gates re-drawn from the same keys), every level at its own size
             (V-cycle); plus 3H for embedding, head and loss (`costs.layer_flops`,
             `head_flops`). Matmuls and attention scores only; the optimizer is not counted.
  val_bpb    validation bits per byte of the final model (all layers, no dropout), on the same
             `eval_batches` validation batches for every method.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import os

from ouroboros_jax.training import config, field_flags

FIELDS = (
  'method',
  'flag',
  'wall_s',
  'compile_s',
  'cpu_s',
  'flops',
  'val_bpb',
  'test_bpb',
  'wall_saving',
  'cpu_saving',
  'flop_saving',
  'plain_bpb_same_flops',
  'plain_bpb_same_cpu',
)


def methods(steps: int, num_layers: int) -> dict[str, dict]:
  """{name: TrainConfig overrides} of every method, plans scaled to `steps` and the depth."""
  quarter = max(steps // 4, 1)
  d1, d2 = max(num_layers // 4, 1), max(num_layers // 2, 1)
  depths = sorted({d1, d2, num_layers})
  mslt = ','.join(f'{d}x{quarter}' for d in depths[:-1]) + f',{num_layers}x*,all:{quarter}'
  stacking_depths = [num_layers]
  while stacking_depths[0] % 2 == 0 and stacking_depths[0] > d1:
    stacking_depths.insert(0, stacking_depths[0] // 2)
  stacking = ','.join(f'{d}x{quarter}' for d in stacking_depths[:-1]) + f',{num_layers}x*'
  return {
    'plain': {},
    'pld': {'pld': f'0.5,{100.0 / steps:.4g}'},
    'mslt': {'growth': f'mslt:{mslt}'},
    'stacking': {'growth': f'stacking:{stacking}'},
    'vcycle': {'vcycle': f'down={quarter},coarse={quarter}'},
    'stdloss': {'std_loss': 1e-4},
  }


def flag_text(overrides: dict) -> str:
  return ' '.join(f'{field_flags.flag(k)} {v}' for k, v in overrides.items()) or '(none)'


def curves(out_dir: str) -> list[dict]:
  """The validation rows of a run's metrics.jsonl (step, bpb, train_s, cpu_s, flops)."""
  with open(os.path.join(out_dir, 'metrics.jsonl')) as f:
    rows = [json.loads(line) for line in f if line.strip()]
  return [r for r in rows if r['split'] == 'validation']


def compare(
  base: config.TrainConfig, out_dir: str, names=None, *, quiet: bool = True, log=print
) -> list[dict]:
  """Trains `base` with every method in `names` (default all) into out_dir/<method>.

  Returns one dict per method: FIELDS plus 'curve' (its validation rows). Savings are
  1 - method / plain (positive: the method spent less), when plain is among the runs.
  """
  from ouroboros_jax.training import loop

  table = methods(base.steps, base.model.num_layers)
  names = list(table) if names is None else list(names)
  unknown = [n for n in names if n not in table]
  if unknown:
    raise ValueError(f'unknown method {unknown[0]!r}; choose from {", ".join(table)}.')
  results = []
  for name in names:
    run_dir = os.path.join(out_dir, name)
    if os.path.isdir(run_dir):  # a fresh run every time
      import shutil

      shutil.rmtree(run_dir)
    cfg = field_flags.override(base, table[name])
    cfg = dataclasses.replace(cfg, out=run_dir, checkpoint_every=10**9, keep_checkpoints=1)
    cfg.validate()
    log(f'[{name}] {flag_text(table[name])}')
    summary = loop.train(cfg, quiet=quiet)
    compile_cpu = summary.get('compile_cpu_s') or 0.0
    results.append(
      {
        'method': name,
        'flag': flag_text(table[name]),
        'wall_s': (summary['compile_s'] or 0.0) + summary['train_s'],
        'compile_s': summary['compile_s'] or 0.0,
        'cpu_s': compile_cpu + summary['train_cpu_s'],
        'flops': summary['flops'],
        'val_bpb': summary['val_bpb'],
        'test_bpb': summary['test_bpb'],
        'curve': curves(run_dir),
      }
    )
    log(
      f'[{name}] val bpb {summary["val_bpb"]:.4f}, {results[-1]["wall_s"]:.1f} s wall, '
      f'{results[-1]["cpu_s"]:.1f} s CPU, {summary["flops"]:.3g} FLOPs'
    )
  return add_savings(results)


def _plain_bpb_at(plain: dict, key: str, value: float) -> float | None:
  """Plain training's validation bpb after spending `value` of `key` (linear in between its
  evaluations; None before its first one)."""
  xs = [row.get(key) for row in plain['curve']]
  ys = [row['bpb'] for row in plain['curve']]
  if not xs or any(x is None for x in xs) or value < xs[0]:
    return None
  for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
    if x0 <= value <= x1:
      return y0 + (y1 - y0) * (value - x0) / max(x1 - x0, 1e-12)
  return ys[-1]


def add_savings(results: list[dict]) -> list[dict]:
  """Adds to every result, against the 'plain' one: wall_saving, cpu_saving, flop_saving
  (1 - method / plain: positive = the method spent less) and plain_bpb_same_flops /
  plain_bpb_same_cpu (plain training's validation bpb after the FLOPs / CPU time the method
  spent in all: if it is higher than the method's, the method paid off)."""
  plain = next((r for r in results if r['method'] == 'plain'), None)
  for r in results:
    for key, field in (('wall', 'wall_s'), ('cpu', 'cpu_s'), ('flop', 'flops')):
      r[key + '_saving'] = (1.0 - r[field] / plain[field]) if plain and plain[field] else None
    r['plain_bpb_same_flops'] = plain and _plain_bpb_at(plain, 'flops', r['flops'])
    r['plain_bpb_same_cpu'] = plain and _plain_bpb_at(plain, 'cpu_s', r['cpu_s'])
  return results


def write_csv(results: list[dict], path: str) -> None:
  """One row per evaluation of every method: method, step, bpb, wall_s, cpu_s, flops."""
  with open(path, 'w', newline='') as f:
    writer = csv.writer(f)
    writer.writerow(['method', 'step', 'val_bpb', 'wall_s', 'cpu_s', 'flops'])
    for r in results:
      for row in r['curve']:
        writer.writerow(
          [
            r['method'],
            row['step'],
            f'{row["bpb"]:.5f}',
            f'{row["train_s"]:.2f}',
            f'{row.get("cpu_s", float("nan")):.2f}',
            f'{row["flops"]:.6g}',
          ]
        )


def markdown_table(results: list[dict]) -> str:
  def pct(x):
    return '-' if x is None else f'{100 * x:+.0f}%'

  def bpb(x):
    return '-' if x is None else f'{x:.3f}'

  lines = [
    '| method | flag | wall-clock s (compile) | CPU s | TFLOPs | val bpb | test bpb | '
    'wall saved | CPU saved | FLOPs saved | plain at same FLOPs | plain at same CPU |',
    '|---|---|---|---|---|---|---|---|---|---|---|---|',
  ]
  for r in results:
    lines.append(
      f'| {r["method"]} | `{r["flag"]}` | {r["wall_s"]:.0f} ({r["compile_s"]:.0f}) | '
      f'{r["cpu_s"]:.0f} | '
      f'{r["flops"] / 1e12:.2f} | {r["val_bpb"]:.3f} | {r["test_bpb"]:.3f} | '
      f'{pct(r["wall_saving"])} | {pct(r["cpu_saving"])} | {pct(r["flop_saving"])} | '
      f'{bpb(r.get("plain_bpb_same_flops"))} | {bpb(r.get("plain_bpb_same_cpu"))} |'
    )
  return '\n'.join(lines)


def plot(results: list[dict], path: str, title: str = '') -> None:
  """Validation bpb against training wall-clock, against process CPU time (robust to other jobs
  on a shared machine) and against FLOPs spent."""
  import matplotlib

  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  panels = [
    ('train_s', 1.0, 'training wall-clock (s, compilation included)'),
    ('cpu_s', 1.0, 'training CPU time (s, all threads)'),
    ('flops', 1e-12, 'model FLOPs spent (10^12)'),
  ]
  fig, axes = plt.subplots(1, len(panels), figsize=(15, 4.2), sharey=True)
  for r in results:
    ys = [row['bpb'] for row in r['curve']]
    style = dict(
      marker='o',
      markersize=3,
      label=r['method'],
      linewidth=2.2 if r['method'] == 'plain' else 1.4,
      color='black' if r['method'] == 'plain' else None,
    )
    for ax, (key, scale, _) in zip(axes, panels):
      ax.plot([row.get(key, float('nan')) * scale for row in r['curve']], ys, **style)
  for ax, (_, _, label) in zip(axes, panels):
    ax.set_xlabel(label)
    ax.grid(alpha=0.3)
  axes[0].set_ylabel('validation bits per byte')
  axes[-1].legend()
  if title:
    fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
