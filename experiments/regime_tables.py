"""The markdown of the regime tables (`python experiments/regime.py --render CSV`), from the rows of
a regime.csv as `regime.read_csv` reads them: per hardware the headline (Ouroboros' fastest
setting that fits against the best exact pipeline's, and where it crosses over), then every line
at every (G, M), then the extrapolated peaks against the compiler's where compiled.

It holds the tables' order (HARDWARE, EXACT, LINES) and `fastest`, the row a cell shows.
regime.py, which computes the rows, is its one user: it imports HARDWARE, EXACT and `render` from
here, so `regime.render` and `python experiments/regime.py --render CSV` are as they were. This
module imports nothing from regime.py.
"""

from __future__ import annotations

from ouroboros_jax.choices import EXACT_PIPELINES

HARDWARE = ('nvlink-300GBps', 'tpu-v5e')  # regime.py's rates, in the tables' order
# The lines of the tables, in order: each schedule (Ouroboros' two forwards apart).
EXACT = ('gpipe', *EXACT_PIPELINES)
LINES = (*EXACT, 'model_parallel', 'ouroboros locked', 'ouroboros pipelined', 'data_parallel')


def fastest(rows, hardware, G, M, lines, fitting=True, policies=None) -> dict | None:
  """The fastest row of `lines` at (hardware, G, M): among those that fit (unknown counts), or
  among all; of `policies` only, if given."""
  candidates = [
    r
    for r in rows
    if r['hardware'] == hardware
    and r['G'] == G
    and r['M'] == M
    and r['line'] in lines
    and r['step_s'] is not None
    and (not fitting or r['fits'] is not False)
    and (policies is None or r['policy'] in policies)
  ]
  return min(candidates, key=lambda r: r['step_s']) if candidates else None


def _short(row: dict) -> str:
  """The setting without the schedule's name and M: 'keep=nothing', 'keep=dots', 'replay',
  'graph/all'."""
  if row['line'].startswith('ouroboros'):
    return row['policy']
  return f'keep={row["policy"]}'


def _gib(row) -> str:
  if row.get('peak_gib') is None:
    return '? GiB'
  mark = '' if row['memory'] == 'compiled' else '~'
  return f'{mark}{row["peak_gib"]:.1f} GiB'


def render(rows: list[dict]) -> str:
  """The markdown of the regime tables: per hardware the headline (Ouroboros against the best
  exact pipeline), then every line at every (G, M), then the extrapolation's error where
  compiled."""
  out = []
  hardware = [h for h in HARDWARE if any(r['hardware'] == h for r in rows)]
  stages = sorted({r['G'] for r in rows if r['G'] > 1})
  ratios = {G: sorted({r['M'] for r in rows if r['G'] == G}) for G in stages}
  # 1. The headline: Ouroboros' fastest fitting against the exact pipelines'.
  for hw in hardware:
    out += _headline_lines(rows, hw, stages, ratios)
  # 2. Every line at every (G, M).
  for hw in hardware:
    out += _line_tables(rows, hw, stages, ratios)
  # 3. The extrapolation against the compiler, where compiled.
  out += _extrapolation_lines(rows)
  return '\n'.join(out).rstrip() + '\n'


def _headline_lines(rows, hw, stages, ratios) -> list[str]:
  """The headline table of `hw` and its crossover lines: per (G, M), Ouroboros' fastest fitting
  setting against the best exact pipeline's, and like with like with memory ignored."""
  out = [
    f'### Ouroboros against the best exact pipeline, {hw} (each at its fastest setting that '
    'fits 15.75 GiB)',
    '',
    '| G | M | M/G | best exact pipeline | eff | best Ouroboros | eff | exact / Ouroboros step '
    '| memory ignored: both recompute | neither recomputes |',
    '|---|---|---|---|---|---|---|---|---|---|',
  ]
  for G in stages:
    for M in ratios[G]:
      exact = fastest(rows, hw, G, M, EXACT)
      ring = fastest(rows, hw, G, M, LINES[-3:-1])
      ratio = f'**{exact["step_s"] / ring["step_s"]:.2f}x**' if exact and ring else '-'
      like = []
      for policies in (('nothing', 'graph/nothing', 'replay'), ('all', 'graph/all')):
        a = fastest(rows, hw, G, M, EXACT, False, policies)
        b = fastest(rows, hw, G, M, LINES[-3:-1], False, policies)
        like.append(f'{a["step_s"] / b["step_s"]:.2f}x' if a and b else '-')
      out.append(
        f'| {G} | {M} | {M / G:g} | {_cell(exact, True)} | {_eff(exact)} | '
        f'{_cell(ring, True)} | {_eff(ring)} | {ratio} | {like[0]} | {like[1]} |'
      )
  return out + ['', *crossover_lines(rows, hw, stages, ratios), '']


def _line_tables(rows, hw, stages, ratios) -> list[str]:
  """The tables of `hw`, one per G: every line's fastest fitting setting at each M."""
  out = []
  backprop = next(
    r for r in rows if r['hardware'] == hw and r['line'] == 'backprop' and r['policy'] == 'all'
  )
  for G in stages:
    out += [
      f'### {hw}, G = {G} (backprop on one device: {backprop["step_s"] * 1e3:.0f} ms a step)',
      '',
      '| schedule | ' + ' | '.join(f'M = {M}' for M in ratios[G]) + ' |',
      '|---|' + '---|' * len(ratios[G]),
    ]
    for line in LINES:
      cells = [_line_cell(rows, hw, G, M, line) for M in ratios[G]]
      name = f'{line} (reference)' if line == 'data_parallel' else line
      out.append(f'| {name} | ' + ' | '.join(cells) + ' |')
    out.append('')
  return out


def _line_cell(rows, hw, G, M, line) -> str:
  """The cell of `line` at (hw, G, M): its fastest fitting setting's efficiency, else why none
  (it cannot run, or the least memory it needs)."""
  best = fastest(rows, hw, G, M, (line,))
  if best is not None:
    return f'{best["efficiency"]:.2f} ({_cell(best)})'
  tried = [
    r for r in rows if r['hardware'] == hw and r['G'] == G and r['M'] == M and r['line'] == line
  ]
  if tried and all(r['step_s'] is None for r in tried):
    return '- (cannot run)'
  least = min((r for r in tried if r['peak_gib'] is not None), key=lambda r: r['peak_gib'])
  return f'no fit (least {_gib(least)}, {_short(least)})'


def _extrapolation_lines(rows) -> list[str]:
  """The table of the extrapolated peaks against the compiler's (none where nothing is
  compiled)."""
  checked = [r for r in rows if r['memory'] == 'compiled' and r['peak_extrapolated_gib']]
  if not checked:
    return []
  seen, lines = set(), []
  for r in checked:
    if (r['G'], r['M'], r['setting']) in seen:
      continue
    seen.add((r['G'], r['M'], r['setting']))
    error = (r['peak_extrapolated_gib'] - r['peak_gib']) / r['peak_gib']
    lines.append(
      f'| G={r["G"]} {r["setting"]} | {r["peak_gib"]:.2f} | {r["peak_extrapolated_gib"]:.2f} '
      f'| {error:+.1%} | {r["memory_from"]} |'
    )
  return [
    '### The extrapolation against the compiler (32-layer shape)',
    '',
    '| setting | compiled peak GiB | extrapolated GiB | error | extrapolated from (1B row) |',
    '|---|---|---|---|---|',
    *lines,
    '',
  ]


def _cell(row, name=False) -> str:
  if row is None:
    return 'none fits'
  what = f'{row["line"]} {_short(row)}' if name else _short(row)
  fit = ' ?' if row['fits'] is None else ''
  return f'{what}, {row["step_s"] * 1e3:.0f} ms, {_gib(row)}{fit}'


def _eff(row) -> str:
  return '-' if row is None else f'{row["efficiency"]:.2f}'


def crossover_lines(rows, hw, stages, ratios) -> list[str]:
  """Per G, where Ouroboros' fastest fitting setting is ahead of the best exact pipeline's
  (exact / Ouroboros step), where it is behind, and where only one side fits."""
  lines = []
  for G in stages:
    verdicts = {k: [] for k in ('ahead', 'behind', 'only Ouroboros fits', 'only exact fits',
                                'neither fits')}  # fmt: skip
    for M in ratios[G]:
      exact = fastest(rows, hw, G, M, EXACT)
      ring = fastest(rows, hw, G, M, LINES[-3:-1])
      where = f'{M / G:g}'
      if exact and ring:
        ratio = exact['step_s'] / ring['step_s']
        side = 'ahead' if ratio > 1 else 'behind'
        verdicts[side].append(f'{where} ({ratio:.2f}x)')
      else:
        side = 'only Ouroboros fits' if ring else 'only exact fits' if exact else 'neither fits'
        verdicts[side].append(where)
    names = {'ahead': 'Ouroboros ahead', 'behind': 'Ouroboros behind',
             'only exact fits': 'only an exact pipeline fits'}  # fmt: skip
    said = '; '.join(f'{names.get(k, k)} at M/G = {", ".join(v)}' for k, v in verdicts.items() if v)
    lines.append(f'- G = {G}: {said}.')
  return lines
