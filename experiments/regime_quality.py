"""Where Ouroboros is fast, does it train? (issue 62): quality in the regime of few micro-batches.

The regime table (docs/results/regime.md) puts Ouroboros ahead of every exact pipeline at G = 16
with M / G = 0.5-2 and at G = 8 with M / G = 2-4. There the streamed ring's gradients are
ceil(lag / M) updates old (`delays.gradient_age`: lag G locked, 2G pipelined), older than any
measured before. This trains every setting of that region on the `tiny` preset made G layers
deep (a layer per stage), G in {8, 16}, M in {G/2, G, 2G}, locked and pipelined, with the
library's Ouroboros recipe (Muon at 0.02 + weight prediction + DC-ASGD, `--optimizer auto
--compensation auto`), against backprop with Muon at the same depth, on the same batches from the
same initialisation; stage devices simulated on the CPU (proven equal to the slow reference in
tests/test_stream_ring.py).

Writes one row per evaluation to --csv (setting, corpus, seed, rate, step, bpb; appended as each
run ends, so an interrupted campaign continues with the same command) and prints the tables:

    python experiments/regime_quality.py                             # every setting, seed 0
    python experiments/regime_quality.py --settings pipelined-g16-m8,backprop-16l --seeds 0,1 \
        --data text:experiments/corpora/austen_shelley.txt.gz
    python experiments/regime_quality.py --render docs/results/regime_quality.csv

Time to quality (the render): the steps a setting needs to reach backprop's final validation bpb
on the same corpus and seed (interpolated between evaluations), times the step `ouroboros plan`
predicts for it at the regime's 1.61B shape (docs/results/regime.csv, its fastest stash that
fits), beside the best exact pipeline's 1000 steps at its fastest setting that fits there.
"""

from __future__ import annotations

import argparse
import csv
import functools
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lr_sweep  # noqa: E402  (experiments/ is not a package)

from ouroboros_jax.schedules import delays  # noqa: E402

RECIPE = dict(optimizer='muon', compensation='predict,dc')  # the library's Ouroboros recipe
BACKPROP_RATE, OUROBOROS_RATE = 0.04, 0.02  # each one's best at 1000 steps (q-stream, q-stream-g8)
STAGES = (16, 8)
FIELDS = ['setting', 'corpus', 'seed', 'rate', 'step', 'bpb']


def settings() -> dict[str, dict]:
  """name -> config overrides: backprop at each depth, then the region's ring settings."""
  table = {}
  for G in STAGES:
    table[f'backprop-{G}l'] = dict(schedule='backprop', optimizer='muon', num_layers=G)
  for G in STAGES:
    for forward in ('pipelined', 'locked'):
      for M in (G // 2, G, 2 * G):
        table[f'{forward}-g{G}-m{M}'] = dict(
          RECIPE, schedule='ouroboros', stages=G, num_layers=G, forward=forward,
          microbatches=M, flow='stream',
        )  # fmt: skip
  return table


# Levers (issue 62, item 2) on a setting more than 2% behind: the setting's overrides, changed.
# PipeMare scales each group's update down by its delay early in training (compensation.py).
# More momentum absorbs more staleness (Zmushko et al. 2026): Muon's beta 0.98 for its 0.95.
# DC-ASGD-a at a stronger lambda_0 (Zheng et al. 2017 use up to 4): a larger correction of the
# gradient by its Taylor term for an older gradient. The ring's weight prediction at a longer
# horizon (`--predict-horizon 2`): the forward at w + 2 * gap * u, the latest update
# extrapolated over twice the gap, and over half of it.
LEVERS = {
  'pipelined-g8-m4+pipemare': ('pipelined-g8-m4', dict(compensation='predict,dc,pipemare')),
  'pipelined-g8-m4+momentum98': ('pipelined-g8-m4', dict(momentum=0.98)),
  'pipelined-g8-m4+dc4': ('pipelined-g8-m4', dict(dc_lambda=4.0)),
  'pipelined-g8-m4+horizon2': ('pipelined-g8-m4', dict(predict_horizon=2.0)),
  'pipelined-g8-m4+horizon0.5': ('pipelined-g8-m4', dict(predict_horizon=0.5)),
}


# Beyond the region: the layout map's batch-limited cells (B < N, r-layouts) run the pipelined
# ring at M = G / 4, one sequence a micro-batch, where its gradients are 8 updates old.
BEYOND = {'pipelined-g8-m2': ('pipelined-g8-m4', dict(microbatches=2))}


def with_levers(table: dict) -> dict:
  changed = {**LEVERS, **BEYOND}
  return {
    **table,
    **{name: dict(table[base], **change) for name, (base, change) in changed.items()},
  }


SETTINGS = with_levers(settings())


def age(overrides: dict) -> int:
  """Updates between a gradient's forward weights and the weights it is applied to, oldest group."""
  if overrides['schedule'] != 'ouroboros':
    return 0
  return delays.gradient_age(
    overrides['stages'], overrides['forward'], overrides['microbatches'], overrides['flow']
  )


def corpus_name(data: str) -> str:
  return 'default' if data == 'default' else os.path.basename(data.split(':', 1)[1]).split('.')[0]


def run(names, seeds, data, args) -> None:
  """Train each (setting, seed) not yet in --csv; append its evaluations as it ends."""
  import jax

  from ouroboros_jax.runtime import host
  from ouroboros_jax.training import presets

  host.configure_cpu_runtime()
  jax.config.update('jax_num_cpu_devices', max(STAGES))
  base = presets.get_preset('tiny')
  corpus = corpus_name(data)
  done = {(r['setting'], r['corpus'], r['seed'], r['rate']) for r in read_csv(args.csv)}
  for seed in seeds:
    for name in names:
      overrides = dict(SETTINGS[name], data=data, test_batches=1)
      rate = BACKPROP_RATE if overrides['schedule'] == 'backprop' else args.rate
      if (name, corpus, seed, rate) in done:
        continue
      out = os.path.join(args.out, corpus, f'{name}@{rate:g}-seed{seed}')
      print(f'== {name} on {corpus}, seed {seed}, rate {rate:g}', flush=True)
      curve = lr_sweep.train_one(
        base, overrides, rate, args.steps, args.eval_every, args.eval_batches, out, True, seed
      )
      append_rows(args.csv, [
        dict(setting=name, corpus=corpus, seed=seed, rate=rate, step=step, bpb=bpb)
        for step, bpb in curve
      ])  # fmt: skip


def append_rows(path: str, rows: list[dict]) -> None:
  new = not os.path.exists(path)
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, 'a', newline='') as f:
    writer = csv.DictWriter(f, fieldnames=FIELDS)
    if new:
      writer.writeheader()
    writer.writerows(rows)


def read_csv(path: str) -> list[dict]:
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [
      dict(r, seed=int(r['seed']), rate=float(r['rate']), step=int(r['step']), bpb=float(r['bpb']))
      for r in csv.DictReader(f)
    ]


# ----------------------------------------------------------------------------- the tables


def _by_rate(rows) -> dict[tuple, list[tuple[int, float]]]:
  """(setting, corpus, seed, rate) -> [(step, validation bpb)] in step order."""
  out: dict[tuple, list] = {}
  for r in rows:
    key = (r['setting'], r['corpus'], r['seed'], r['rate'])
    out.setdefault(key, []).append((r['step'], r['bpb']))
  return {k: sorted(v) for k, v in out.items()}


def best_rates(rows) -> dict[tuple, float]:
  """(setting, corpus, seed) -> the rate of those run whose last validation bpb is lowest."""
  best: dict[tuple, tuple[float, float]] = {}
  for (name, corpus, seed, rate), curve in _by_rate(rows).items():
    key = (name, corpus, seed)
    if key not in best or curve[-1][1] < best[key][1]:
      best[key] = (rate, curve[-1][1])
  return {k: rate for k, (rate, _) in best.items()}


def curves(rows) -> dict[tuple, list[tuple[int, float]]]:
  """(setting, corpus, seed) -> [(step, validation bpb)] at the setting's best rate of those run
  (`best_rates`): each setting at its own best rate."""
  by_rate = _by_rate(rows)
  return {k: by_rate[(*k, rate)] for k, rate in best_rates(rows).items()}


def rates(rows, name: str, corpus: str, seed: int) -> str:
  """The rates a setting ran at, the best marked with * where there are several."""
  tried = sorted(
    {r['rate'] for r in rows if (r['setting'], r['corpus'], r['seed']) == (name, corpus, seed)}
  )
  best = best_rates(rows).get((name, corpus, seed))
  return ', '.join(f'{t:g}*' if t == best and len(tried) > 1 else f'{t:g}' for t in tried)


def fastest_steps(regime_csv: str) -> dict[tuple, tuple[float, str]]:
  """(hardware, G, M, line) -> (the fastest predicted step (s) that fits, from regime.csv, and
  what it keeps for the backward: `kept`); line is 'ouroboros locked', 'ouroboros pipelined',
  'exact' (the best exact pipeline) or 'data_parallel'."""
  best: dict[tuple, tuple[float, str]] = {}
  with open(regime_csv) as f:
    for r in csv.DictReader(f):
      if r['fits'] != 'True' or not r['step_s'] or r['G'] == '1':
        continue
      line = r['line'] if r['line'].startswith(('ouroboros', 'data_parallel')) else 'exact'
      if line == 'exact' and r['line'] == 'model_parallel':
        continue
      key = (r['hardware'], int(r['G']), int(r['M']), line)
      best[key] = min(best.get(key, (math.inf, '')), (float(r['step_s']), kept(r['policy'])))
  return best


def kept(policy: str) -> str:
  """A regime.csv policy ('graph/dots', 'replay', 'dots', ...) as the recomputation policy it
  keeps for the backward: 'all', 'dots' or 'nothing' (the replay stash recomputes everything)."""
  return 'nothing' if policy == 'replay' else policy.split('/')[-1]


def final_gap(curve, reference) -> float:
  """A run's last validation bpb over the reference's, minus 1."""
  return curve[-1][1] / reference[-1][1] - 1


def reference_of(name: str) -> str:
  return f'backprop-{SETTINGS[name]["num_layers"]}l'


def quality_table(rows, corpus: str) -> list[str]:
  """Per setting: gradient age, each seed's last validation bpb, its gap to backprop at the same
  depth, and the steps it needs to reach backprop's last bpb."""
  runs = curves(rows)
  seeds = sorted({r['seed'] for r in rows if r['corpus'] == corpus})
  head = ['setting', 'age (updates)'] + [
    f'seed {s}: {what}'
    for s in seeds
    for what in ('rate', 'val bpb', 'vs backprop', "steps to backprop's")
  ]
  lines = ['| ' + ' | '.join(head) + ' |', '|' + '---|' * len(head)]
  for name in SETTINGS:
    cells = [name, str(age(SETTINGS[name]))]
    for seed in seeds:
      curve, ref = runs.get((name, corpus, seed)), runs.get((reference_of(name), corpus, seed))
      if not curve:
        cells += ['', '', '', '']
        continue
      steps = lr_sweep.steps_to_reach(curve, ref[-1][1]) if ref else None
      cells += [
        rates(rows, name, corpus, seed),
        f'{curve[-1][1]:.4f}',
        f'{final_gap(curve, ref):+.2%}' if ref else '',
        '' if not ref else f'{steps:.0f}' if steps is not None else 'not reached',
      ]
    if any(cells[2:]):
      lines.append('| ' + ' | '.join(cells) + ' |')
  return lines


def to_common_quality(rows, name: str, corpus: str) -> tuple[float, float, float] | None:
  """(target bpb, the ring's steps to it, backprop's steps to it) for the seed least favourable
  to the ring: the target is the worse of the two runs' last validation bpb, so both reach it;
  None if nothing ran. The ring's cost ratio is its steps over backprop's."""
  runs, worst = curves(rows), None
  for (n, c, seed), curve in runs.items():
    ref = runs.get((reference_of(name), corpus, seed))
    if n != name or c != corpus or not ref:
      continue
    target = max(curve[-1][1], ref[-1][1])
    found = (target, lr_sweep.steps_to_reach(curve, target), lr_sweep.steps_to_reach(ref, target))
    if worst is None or found[1] / found[2] > worst[1] / worst[2]:
      worst = found
  return worst


@functools.cache
def fsdp_step_s(hardware: str, G: int, policy: str) -> float:
  """The predicted step of FSDP over the same G chips at the regime's shape, keeping what the
  ring keeps (`policy`, like with like: the compiler has not judged FSDP's memory at this
  shape; its state is 1/G a chip). Cached: every setting at one G shares it."""
  import regime

  from ouroboros_jax.perf import plan
  from ouroboros_jax.schedules import ScheduleConfig

  setting = ScheduleConfig(name='data_parallel', data_parallel=G, fsdp=True, stash_policy=policy)
  return regime._predicted(regime.base_config(), setting, plan.hardware_for(None, hardware))  # pylint: disable=protected-access


def time_row(rows, name: str, corpus: str, steps_s, hardware: str) -> dict | None:
  """Time to the same quality at the regime's 1.61B shape: the steps the ring and backprop need
  to reach the worse of their two last bpb (`to_common_quality`), each times its predicted step;
  the best exact pipeline and FSDP on the same G chips train as backprop does. None where the
  setting has not run or nothing fits at its G and M (docs/results/regime.md)."""
  o = SETTINGS[name]
  common = to_common_quality(rows, name, corpus) if o['schedule'] != 'backprop' else None
  ring = steps_s.get(
    (hardware, o.get('stages'), o.get('microbatches'), f'ouroboros {o.get("forward")}')
  )
  exact = steps_s.get((hardware, o.get('stages'), o.get('microbatches'), 'exact'))
  if common is None or ring is None or exact is None:
    return None
  (ring, policy), (exact, _) = ring, exact
  target, ring_steps, steps = common
  return dict(
    target=target, ring_steps=ring_steps, steps=steps, ring_s=ring_steps * ring,
    exact_s=steps * exact, fsdp_s=steps * fsdp_step_s(hardware, o['stages'], policy),
  )  # fmt: skip


def time_table(rows, corpus: str, steps_s, hardware: str) -> list[str]:
  """`time_row` of every setting that has one."""
  lines = [
    '| setting | target bpb | ring steps | backprop steps | ring time (s) | best exact (s) '
    '| exact / ring | FSDP (s) | FSDP / ring |',
    '|---|---|---|---|---|---|---|---|---|',
  ]
  for name in SETTINGS:
    t = time_row(rows, name, corpus, steps_s, hardware)
    if t is not None:
      lines.append(
        f'| {name} | {t["target"]:.4f} | {t["ring_steps"]:.0f} | {t["steps"]:.0f} '
        f'| {t["ring_s"]:.1f} | {t["exact_s"]:.1f} | {t["exact_s"] / t["ring_s"]:.2f}x '
        f'| {t["fsdp_s"]:.1f} | {t["fsdp_s"] / t["ring_s"]:.2f}x |'
      )
  return lines


def _span(values, form: str, unit: str = '') -> str:
  """'lo to hi' of `values` in `form`, each followed by `unit` (one value once; '' for none)."""
  lo, hi = min(values, default=None), max(values, default=None)
  if lo is None:
    return ''
  return f'{lo:{form}}{unit}' if lo == hi else f'{lo:{form}}{unit} to {hi:{form}}{unit}'


def age_table(rows, steps_s, hardware: str) -> list[str]:
  """The finding by gradient age, over every corpus and seed run: the region's settings (and
  the layout map's age-8 one) at the recipe, levers left out. Each run's gap to backprop at its
  depth (best, worst, mean, how many within the 2% target) and, per setting and corpus with a
  time, the best exact pipeline's and FSDP's time to its quality over the ring's."""
  runs, gaps, ratios = curves(rows), {}, {}
  for (name, corpus, seed), curve in runs.items():
    ref = runs.get((reference_of(name), corpus, seed))
    if name in LEVERS or SETTINGS[name]['schedule'] == 'backprop' or not ref:
      continue
    gaps.setdefault(age(SETTINGS[name]), []).append(final_gap(curve, ref))
    t = time_row(rows, name, corpus, steps_s, hardware)
    if t is not None and (name, corpus) not in ratios:
      ratios[name, corpus] = (
        age(SETTINGS[name]),
        t['exact_s'] / t['ring_s'],
        t['fsdp_s'] / t['ring_s'],
      )
  lines = [
    '| age (updates) | runs | vs backprop | mean | within 2% | exact / ring | FSDP / ring |',
    '|---|---|---|---|---|---|---|',
  ]
  for a in sorted(gaps):
    exact, fsdp = ([r[i] for r in ratios.values() if r[0] == a] for i in (1, 2))
    lines.append(
      f'| {a} | {len(gaps[a])} | {_span(gaps[a], "+.2%")} | {sum(gaps[a]) / len(gaps[a]):+.2%} '
      f'| {sum(g <= 0.02 for g in gaps[a])} of {len(gaps[a])} '
      f'| {_span(exact, ".2f", "x")} | {_span(fsdp, ".2f", "x")} |'
    )
  return lines


def render(rows, steps_s) -> str:
  first = min({k[0] for k in steps_s}, default='')
  out = [
    f'By gradient age, every corpus and seed (time to quality per setting and corpus, `{first}`):',
    '',
    *age_table(rows, steps_s, first),
    '',
  ]
  for corpus in sorted({r['corpus'] for r in rows}):
    out += [f'Validation bpb at the last step, corpus {corpus}:', '', *quality_table(rows, corpus)]
    for hardware in sorted({k[0] for k in steps_s}):
      out += ['', f'Time to quality, corpus {corpus}, `{hardware}`:', '']
      out += time_table(rows, corpus, steps_s, hardware)
    out.append('')
  return '\n'.join(out)


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument(
    '--settings',
    default=','.join(SETTINGS),
    help=f'comma-separated subset of {", ".join(SETTINGS)}',
  )
  parser.add_argument('--seeds', default='0', help='comma-separated seeds (initialisation, order)')
  parser.add_argument(
    '--rate', type=float, default=OUROBOROS_RATE, help="the ring settings' rate (backprop: its own)"
  )
  parser.add_argument('--data', default='default', help='the corpus, as `train --data` takes it')
  parser.add_argument('--steps', type=int, default=1000)
  parser.add_argument('--eval-every', type=int, default=100)
  parser.add_argument(
    '--eval-batches', type=int, default=20, help='validation batches per evaluation (20: a '
    'second corpus of 1 MB has 28)',
  )  # fmt: skip
  parser.add_argument('--csv', default='docs/results/regime_quality.csv')
  parser.add_argument('--out', default='experiments/results/regime_quality')
  parser.add_argument('--regime', default='docs/results/regime.csv', help='predicted step times')
  parser.add_argument('--render', metavar='CSV', help='print the tables of a written CSV and stop')
  return parser.parse_args(argv)


def main(argv=None):
  args = parse_args(argv)
  if args.render:
    print(render(read_csv(args.render), fastest_steps(args.regime)))
    return
  names = [n for n in args.settings.split(',') if n]
  unknown = [n for n in names if n not in SETTINGS]
  if unknown:
    sys.exit(f'error: unknown setting(s) {unknown}; choose from {", ".join(SETTINGS)}.')
  run(names, [int(s) for s in args.seeds.split(',')], args.data, args)
  print(render(read_csv(args.csv), fastest_steps(args.regime)))


if __name__ == '__main__':
  main()
