"""docs/results/memory.md's recomputation tables: `ouroboros plan` one schedule and one M at a time.

Each unit (a schedule at one --try-microbatches; backprop, data_parallel and model_parallel
once) is one `ouroboros plan ... --try-schedules S --json` process, its rows appended to one JSON
per shape, with the commit they were compiled at (`measured_at`). A re-run skips the units the
file holds, so a cut-off loses one unit at most; `--redo` compiles them again. A unit's rows
replace the file's rows of the same label (compiled before) and leave the others. 'fastest' and
'fastest_by_schedule' are derived again over all rows (`plan.mark_fastest`), so the file is a
saved plan: `ouroboros plan --render FILE` prints it too.

    python experiments/plan_tables.py 1b             # docs/results/plan_1b_v5e_2x4_remat.json
    python experiments/plan_tables.py gpt2-small --microbatches 8
    python experiments/plan_tables.py 7b-v5p --microbatches 16 --schedules zb_v --redo  # again
    python experiments/plan_tables.py 1b --microbatches 8,16,32 --schedules ouroboros \
        --stashes graph/dots,graph/all --memories balanced   # the balanced stash's rows
    python experiments/plan_tables.py --render docs/results/plan_1b_v5e_2x4_remat.json  # markdown
    python experiments/plan_tables.py --repredict  # every saved plan's step times by today's
                                                   # simulator (no compile)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

SHAPES = {  # name: (the run's flags, the JSON)
  '1b': (
    '--preset gpt2-small --d-model 2048 --num-layers 24 --num-heads 16 --d-ff 8192 --seq-len 2048 '
    '--batch-size 32 --dtype bfloat16 --topology v5e:2x4',
    'docs/results/plan_1b_v5e_2x4_remat.json',
  ),
  # 7B-class (issue 40's target): d 4096, 32 layers, 32 heads, d_ff 4 x d, seq 2048, byte-level
  # vocabulary: 6.45B parameters. G = 8 on v5p (95 GiB a chip) and on v5e (16 GiB).
  '7b-v5p': (
    '--preset gpt2-small --d-model 4096 --num-layers 32 --num-heads 32 --d-ff 16384 --seq-len 2048 '
    '--batch-size 32 --dtype bfloat16 --topology v5p:2x2x2',
    'docs/results/plan_7b_v5p_2x2x2_remat.json',
  ),
  '7b-v5e': (
    '--preset gpt2-small --d-model 4096 --num-layers 32 --num-heads 32 --d-ff 16384 --seq-len 2048 '
    '--batch-size 32 --dtype bfloat16 --topology v5e:2x4',
    'docs/results/plan_7b_v5e_2x4_remat.json',
  ),
  'gpt2-small': (
    '--preset gpt2-small --batch-size 32 --dtype bfloat16 --topology v5e:2x2',
    'docs/results/plan_gpt2_small_v5e_2x2_remat.json',
  ),
}
# Plans of a shape saved elsewhere (`ouroboros plan <its flags> ... --json`): path -> its shape
SAVED_ELSEWHERE = {
  'docs/results/layouts/fsdp_1b_v5e_2x4.json': '1b',
  'docs/results/layouts/hybrid_1b_v5e_2x4.json': '1b',
}
POLICIES = 'all,nothing'
STASHES = 'graph/nothing,replay'
UNBATCHED = ('backprop', 'data_parallel', 'model_parallel')
SCHEDULES = (*UNBATCHED, 'gpipe', '1f1b', 'interleaved', 'zb_h1', 'zb_v', 'ouroboros')


def run(
  shape, microbatches, schedules, policies=POLICIES, stashes=STASHES, redo=False, memories='device'
) -> None:
  from ouroboros_jax.perf import plan

  flags, path = SHAPES[shape]
  out = json.load(open(path)) if os.path.exists(path) else {'rows': [], 'skipped': [], 'done': []}
  commit = subprocess.check_output(['git', 'rev-parse', '--short', 'HEAD'], text=True).strip()
  for m in microbatches:
    for name in schedules:
      unit = name if name in UNBATCHED else f'{name} M={m}'
      unit += f' ({policies})' if policies != POLICIES and name != 'ouroboros' else ''
      unit += f' ({stashes})' if stashes != STASHES and name == 'ouroboros' else ''
      unit += f' [{memories}]' if memories != 'device' and name == 'ouroboros' else ''
      if unit in out['done'] and not redo:
        continue
      cmd = (
        f'ouroboros plan {flags} --try-policy {policies} --try-stash {stashes} '
        f'--try-stash-memory {memories} --try-schedules {name} --try-microbatches {m} --json'
      )
      start = time.time()
      done = subprocess.run(cmd.split(), capture_output=True, text=True)
      if done.returncode not in (0, 1):  # 1: nothing fits, still a plan
        sys.exit(f'{unit}: {cmd} failed:\n{done.stderr[-3000:]}')
      result = json.loads(done.stdout)
      seconds = time.time() - start
      for row in result['rows']:
        row.update(measured_at=commit, unit_seconds=round(seconds, 1))
      out.update({k: result[k] for k in ('topology', 'devices', 'hardware')})
      # every unit's G (an unbatched schedule's unit tries none: data_parallel's [])
      out['stages'] = sorted({*out.get('stages', []), *result['stages']})
      # a label compiled again replaces its older row (and its older skip)
      labels = {r['label'] for r in result['rows'] + result['skipped']}
      out['rows'] = [r for r in out['rows'] if r['label'] not in labels] + result['rows']
      out['skipped'] = [s for s in out['skipped'] if s['label'] not in labels] + result['skipped']
      out['done'] += [] if unit in out['done'] else [unit]
      out['fastest'], out['fastest_by_schedule'] = plan.mark_fastest(out['rows'])
      with open(path + '.tmp', 'w') as f:
        json.dump(out, f, indent=1)
      os.replace(path + '.tmp', path)
      print(f'{unit}: {len(result["rows"])} rows in {seconds:.0f} s', flush=True)
      print(done.stderr.strip(), flush=True)


def saved_plans() -> dict[str, str]:
  """Every saved plan this script knows: path -> the flags of its shape's run."""
  return {
    **{path: flags for flags, path in SHAPES.values()},
    **{path: SHAPES[shape][0] for path, shape in SAVED_ELSEWHERE.items()},
  }


def repredict(path: str) -> None:
  """A saved plan with its step times predicted again by today's simulator (`plan.repredict`:
  no compile), and the commit they were predicted at."""
  from ouroboros_jax import cli_parsers
  from ouroboros_jax.perf import plan

  flags = saved_plans()[path]
  args = cli_parsers.make_parser().parse_args(['plan', *flags.split()])
  result = plan.repredict(plan.load(path), cli_parsers.config_from_args(args))
  result['predicted_at'] = subprocess.check_output(
    ['git', 'rev-parse', '--short', 'HEAD'], text=True
  ).strip()
  with open(path + '.tmp', 'w') as f:
    json.dump(result, f, indent=1)
  os.replace(path + '.tmp', path)
  print(f'{path}: {len(result["rows"])} rows predicted again; fastest {result["fastest"]}')


def render(path: str) -> str:
  """The saved plan as a markdown table, plan.format_plan's columns and marks, the rows in
  SCHEDULES' order and by M."""
  from ouroboros_jax.perf import plan

  result = plan.load(path)
  backprop = next((r['step_s'] for r in result['rows'] if r['schedule'] == 'backprop'), None)
  # a plan saved before `plan` marked each schedule's fastest: derived from its rows
  by_schedule = result.get('fastest_by_schedule') or plan.mark_fastest(result['rows'])[1]
  best = set(by_schedule.values())
  lines = [
    '| setting | peak GiB per chip | fits | recompute | step ms | speedup over 1 chip |',
    '|---|---|---|---|---|---|',
  ]

  def order(r):
    return SCHEDULES.index(r['schedule']), r['microbatches'] or 0, 'keep=' in r['label']

  for r in sorted(result['rows'], key=order):
    label = r['label'] + (
      ' **\\***' if r['label'] == result['fastest'] else ' **+**' if r['label'] in best else ''
    )
    peak = plan._peak(r) + (' (out of memory)' if r['fits'] is False and 'error' not in r else '')
    step = '-' if r['step_s'] is None else f'{r["step_s"] * 1e3:.1f}'
    speedup = '-' if not (r['step_s'] and backprop) else f'{backprop / r["step_s"]:.2f}x'
    recompute = '-' if r.get('recompute') is None else f'{r["recompute"]:.2f}'  # older plans
    lines.append(f'| {label} | {peak} | {plan._verdict(r)} | {recompute} | {step} | {speedup} |')
  lines += [f'\n{r["label"]}: {r["error"]}' for r in result['rows'] if 'error' in r]
  lines += [f'\nskipped {s["label"]}: {s["reason"]}' for s in result.get('skipped', [])]
  return '\n'.join(lines)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('shape', nargs='?', choices=sorted(SHAPES))
  parser.add_argument('--microbatches', default='8,16', help='the Ms, one pass each (default 8,16)')
  parser.add_argument('--schedules', default=','.join(SCHEDULES), help='in this order')
  parser.add_argument('--policies', default=POLICIES, help=f'--try-policy (default {POLICIES})')
  parser.add_argument('--stashes', default=STASHES, help=f'--try-stash (default {STASHES})')
  parser.add_argument(
    '--memories', default='device', help='--try-stash-memory (Ouroboros; default device)'
  )
  parser.add_argument(
    '--redo', action='store_true', help='compile the units the file holds again (it skips them)'
  )
  parser.add_argument('--render', metavar='FILE', help='print FILE as a markdown table and stop')
  parser.add_argument(
    '--repredict',
    action='store_true',
    help='predict the step times of every saved plan again by the simulator, no compile',
  )
  args = parser.parse_args(argv)
  if args.render:
    print(render(args.render))
  elif args.repredict:
    for path in saved_plans():
      repredict(path)
  elif args.shape:
    counts = [int(m) for m in args.microbatches.split(',')]
    run(
      args.shape,
      counts,
      args.schedules.split(','),
      args.policies,
      args.stashes,
      args.redo,
      args.memories,
    )
  else:
    parser.error('give a shape or --render FILE')


if __name__ == '__main__':
  main()
