"""The device check's one-screen summary, from the files its steps wrote into one folder.

    python experiments/device_summary.py WORK > summary.md

Reads what experiments/device_check.sh leaves in WORK (each part optional: a step that did not
run or failed is reported as such) and prints Markdown:

    versions, devices        versions.json, smoke.csv (device_smoke.py)
    steps                    steps.csv: each step's seconds and exit status
    GPU correctness          gpu_tests.xml (pytest's junit report of tests/test_gpu.py)
    MFU                      mfu_b*/bench.csv: backprop's bf16 MFU at GPT-2-small, largest batch;
    MFU levers               mfu_lever_*/bench.csv: the same step once per lever of the script's
                             MFU_LEVERS (a default off, cuBLAS GEMMs, Muon), against its default;
                             mfu_unchunked_b*/bench.csv: the same with the unchunked head
    layer costs              layer_costs/layer_costs.csv (layer_costs.py)
    real concurrency         cpu_g*/bench.csv: each schedule's step, measured / ideal and the
                             simulator's error, and Ouroboros against ZB-V; where a bench was cut
                             short, the rows its log printed
"""

from __future__ import annotations

import csv
import glob
import json
import os
import re
import sys
import xml.etree.ElementTree as ET


def _csv(path: str) -> list[dict]:
  if not os.path.exists(path):
    return []
  with open(path, newline='') as f:
    return list(csv.DictReader(f))


def versions(work: str) -> list[str]:
  path = os.path.join(work, 'versions.json')
  if not os.path.exists(path):
    return ['versions: not recorded (the smoke step did not run)']
  found = json.load(open(path))
  devices = sorted(set(found.pop('devices', [])))
  packages = ', '.join(f'{k} {v}' for k, v in found.items() if v and k not in ('cpu_devices',))
  lines = [f'- devices: {", ".join(devices)}', f'- {packages}']
  smoke = _csv(os.path.join(work, 'smoke.csv'))
  if smoke:
    lines.append(
      '- smoke: '
      + '; '.join(f'{r["path"]} ({r["platform"]}) {r["seconds"]} s {r["status"]}' for r in smoke)
    )
  return lines


def steps(work: str) -> list[str]:
  rows = _csv(os.path.join(work, 'steps.csv'))
  lines = ['| step | seconds | exit |', '|---|---|---|']
  lines += [f'| {r["step"]} | {r["seconds"]} | {r["status"]} |' for r in rows]
  return lines


def gpu_tests(work: str) -> list[str]:
  path = os.path.join(work, 'gpu_tests.xml')
  if not os.path.exists(path):
    return ['GPU correctness: not run (no GPU, or the step failed before pytest reported)']
  lines = ['| test | result |', '|---|---|']
  for case in ET.parse(path).getroot().iter('testcase'):
    outcome = 'passed'
    for tag in ('failure', 'error', 'skipped'):
      found = case.find(tag)
      if found is not None:
        message = (found.get('message') or '').strip().splitlines()
        outcome = f'{tag}: {message[0][:120] if message else ""}'
    lines.append(f'| {case.get("name")} | {outcome} |')
  return lines


def mfu(work: str) -> list[str]:
  best = None
  for path in sorted(glob.glob(os.path.join(work, 'mfu_b*', 'bench.csv'))):
    for r in _csv(path):
      if r['schedule'] == 'backprop' and r.get('mfu') not in (None, '', 'nan'):
        batch = int(re.search(r'mfu_b(\d+)', path).group(1))
        if best is None or batch > best[0]:
          best = (batch, float(r['mfu']), float(r['step_time_s']), float(r['tokens_per_s']))
  if best is None:
    return ['MFU: not measured (no GPU, or no batch fitted)']
  batch, value, step, tokens = best
  lines = [
    f'backprop, GPT-2-small shape (vocab 50257), bf16, cuDNN attention, batch {batch} x 1024: '
    f'**MFU {value:.1%}**, {step * 1e3:.1f} ms/step, {tokens:,.0f} tokens/s'
  ]
  # The same batch with the unchunked head (--loss-chunk-tokens 0), when it ran and fitted.
  plain = [
    r
    for r in _csv(os.path.join(work, f'mfu_unchunked_b{batch}', 'bench.csv'))
    if r['schedule'] == 'backprop' and r.get('mfu') not in (None, '', 'nan')
  ]
  if plain:
    plain_step = float(plain[0]['step_time_s'])
    lines.append(
      f'- the unchunked head (--loss-chunk-tokens 0, the float32 logits whole), batch {batch}: '
      f'MFU {float(plain[0]["mfu"]):.1%}, {plain_step * 1e3:.1f} ms/step; the default '
      f'(chunked) head runs at {plain_step / step:.2f}x its throughput'
    )
  else:
    lines.append(f'- the unchunked head (--loss-chunk-tokens 0), batch {batch}: not measured')
  return lines


def mfu_levers(work: str) -> list[str]:
  """The mfu_levers part: backprop's step at batch 64 once per lever, against its own default."""
  rows = {}
  for path in sorted(glob.glob(os.path.join(work, 'mfu_lever_*', 'bench.csv'))):
    for r in _csv(path):
      if r['schedule'] == 'backprop' and r.get('mfu') not in (None, '', 'nan'):
        rows[re.search(r'mfu_lever_([^/]+)', path).group(1)] = r
  if not rows:
    return ['MFU levers: not measured']
  base = rows.get('default')
  lines = ['| lever | step ms | MFU | vs the default |', '|---|---|---|---|']
  for name, r in sorted(rows.items(), key=lambda kv: (kv[0] != 'default', -float(kv[1]['mfu']))):
    step = float(r['step_time_s'])
    speed = f'{float(base["step_time_s"]) / step:.2f}x' if base else '-'
    lines.append(f'| {name} | {step * 1e3:.1f} | {float(r["mfu"]):.1%} | {speed} |')
  return lines


def layer_costs(work: str) -> list[str]:
  rows = _csv(os.path.join(work, 'layer_costs', 'layer_costs.csv'))
  if not rows:
    return ['layer costs: not measured']
  lines = [
    '| model | rows | forward ms | backward ms | head ms | update ms (adamw / muon) | TFLOP/s |',
    '|---|---|---|---|---|---|---|',
  ]
  ms = lambda r, k: f'{float(r[k]) * 1e3:.3f}' if r.get(k) else '-'
  for r in rows:
    lines.append(
      f'| {r["model"]} | {r["rows"]} | {ms(r, "fwd_s_per_layer")} | {ms(r, "bwd_s_per_layer")} | '
      f'{ms(r, "head_s")} | {ms(r, "update_s_per_layer_adamw")} / '
      f'{ms(r, "update_s_per_layer_muon")} | {float(r["achieved_tflops"]):.1f} |'
    )
  return lines


_LOGGED = re.compile(r'(\S.*?)\s+([\d.]+) ms/step\s+\d+ tok/s\s+ideal\s+([\d.]+) ms')


def concurrency(work: str) -> list[str]:
  lines = []

  def run(path):  # cpu_g8.log: 8 processes, run 1; cpu_g2r2.log: 2 processes, run 2
    found = re.search(r'cpu_g(\d+)(?:r(\d+))?\.log$', path)
    return int(found.group(1)), int(found.group(2) or 1)

  for path in sorted(glob.glob(os.path.join(work, 'cpu_g*.log')), key=run):
    (g, k), name = run(path), os.path.basename(path)[: -len('.log')]
    rows = _csv(os.path.join(work, name, 'bench.csv'))
    lines.append(f'\n**{g} pinned processes, one core each**' + (f' (bench {k})' if k > 1 else ''))
    if rows:
      step = {r['label']: float(r['step_time_s']) for r in rows}
      lines += ['| setting | step ms | measured / ideal | simulator error |', '|---|---|---|---|']
      for r in rows:
        measured, predicted = float(r['step_time_s']), float(r['predicted_s'])
        lines.append(
          f'| {r["label"]} | {measured * 1e3:.1f} | {measured / float(r["ideal_s"]):.2f} | '
          f'{(predicted - measured) / measured:+.1%} |'
        )
    else:  # cut short: the rows its log printed (ideal only; no prediction there)
      step = {}
      for line in open(path, errors='replace'):  # process 0's lines: its step is the step
        found = line.startswith('[p0] ') and _LOGGED.search(line[5:])
        if found:
          step[found.group(1).strip()] = float(found.group(2)) / 1e3
      lines.append('bench.csv missing (cut short or failed); the settings its log printed:')
      lines += [f'- {label}: {s * 1e3:.1f} ms' for label, s in step.items()]
    zbv = next((s for label, s in step.items() if label.startswith('zb_v')), None)
    for label, s in step.items():
      if label.startswith('ouroboros') and zbv:
        lines.append(f'- {label}: {zbv / s:.2f}x the throughput of ZB-V')
  return lines or ['real concurrency: not measured']


def main(argv=None) -> int:
  work = (argv or sys.argv[1:])[0]
  sections = [
    ('Device check', versions(work)),
    ('Steps', steps(work)),
    ('GPU correctness (tests/test_gpu.py)', gpu_tests(work)),
    ('MFU', mfu(work)),
    ('MFU levers (batch 64)', mfu_levers(work)),
    ('Per-layer costs (layer_costs.py)', layer_costs(work)),
    ('Real concurrency (ouroboros launch --pin-cpus -- bench)', concurrency(work)),
  ]
  for title, lines in sections:
    print(f'## {title}\n')
    print('\n'.join(lines) + '\n')
  return 0


if __name__ == '__main__':
  sys.exit(main())
