"""The claims ledger, docs/results/README.md, is the one place a result's number lives.

- Every number the README keeps (its headline blocks, between `<!-- headline:begin -->` and
  `<!-- headline:end -->`) is in a ledger row that block links, so a number that drifts on either
  side fails here.
- Every link to a ledger row (`docs/results/README.md#id`, from anywhere in the repository, or
  `README.md#id` from a page beside it) names an id the ledger defines (`<a id="id"></a>`).
- Every file a ledger row links exists.
"""

from __future__ import annotations

import pathlib
import re
import subprocess

ROOT = pathlib.Path(__file__).resolve().parent.parent
LEDGER = ROOT / 'docs' / 'results' / 'README.md'

HEADLINE = re.compile(r'<!-- headline:begin -->(.*?)<!-- headline:end -->', re.S)
ANCHOR = re.compile(r'<a id="([\w-]+)"></a>')
# A link to a ledger row: docs/results/README.md#id, results/README.md#id (from docs/), or a bare
# README.md#id from a page in docs/results/.
ROW_LINK = re.compile(r'(?:^|[(/\s`\'"])((?:[\w./]*/)?results/README\.md|README\.md)#([\w-]+)')
# A measured number: a decimal or a percentage, a range included (1.5-2.5%, 3.1416, 12.5%).
NUMBER = re.compile(r'(?<![\w.])\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)?%|(?<![\w.])\d+\.\d+')
LINK_TARGET = re.compile(r'\]\(\s*<?([^)\s>]+)>?\s*\)')
TEXT_SUFFIXES = {'.md', '.py', '.toml', '.txt', '.sh', '.ipynb', '.cfg', '.yaml', '.yml'}


def ledger_rows() -> dict[str, str]:
  """Each row's id -> the row's line."""
  rows = {}
  for line in LEDGER.read_text().splitlines():
    found = ANCHOR.findall(line)
    if line.startswith('|') and found:
      assert len(found) == 1, f'one anchor a row: {line[:80]}'
      assert found[0] not in rows, f'ledger id {found[0]} defined twice'
      rows[found[0]] = line
  return rows


def test_ledger_has_rows_for_every_area():
  rows = ledger_rows()
  prefixes = {name.split('-')[0] for name in rows}
  # quality, speed, calibration, device, precision, memory, accelerators, Transformer-XL, regime
  assert prefixes >= {'q', 's', 'c', 'd', 'p', 'm', 'a', 'x', 'r'}, prefixes
  assert len(rows) >= 40, f'only {len(rows)} ledger rows: is the anchor pattern still right?'


def test_readme_headline_numbers_are_in_the_rows_they_link():
  rows = ledger_rows()
  blocks = HEADLINE.findall((ROOT / 'README.md').read_text())
  assert blocks, 'the README lost its headline markers (<!-- headline:begin/end -->)'
  checked = 0
  for block in blocks:
    linked = [anchor for _, anchor in ROW_LINK.findall(block)]
    assert linked, f'a headline block links no ledger row:\n{block}'
    text = ' '.join(rows[anchor] for anchor in linked if anchor in rows)
    for number in NUMBER.findall(block):
      checked += 1
      assert re.search(rf'(?<![\w.]){re.escape(number)}(?![\d])', text), (
        f'the README headline says {number}, which none of its ledger rows {linked} states'
      )
  assert checked >= 2, 'the headline keeps no number: is the number pattern still right?'


def _repository_text_files():
  listed = subprocess.run(
    ['git', 'ls-files', '--cached', '--others', '--exclude-standard'],
    cwd=ROOT,
    capture_output=True,
    text=True,
    check=True,
  ).stdout.split()
  for name in listed:
    path = ROOT / name
    if path.suffix in TEXT_SUFFIXES and path.is_file() and path != pathlib.Path(__file__):
      yield path


def test_every_ledger_link_resolves():
  ids = set(ledger_rows())
  checked, broken = 0, []
  for path in _repository_text_files():
    text = path.read_text(errors='replace')
    for target, anchor in ROW_LINK.findall(text):
      resolved = (path.parent / target).resolve()
      if target.startswith('docs/'):  # a repository path, as in code and the CHANGELOG
        resolved = (ROOT / target).resolve()
      if resolved != LEDGER.resolve():
        continue  # another README (colab/, experiments/)
      checked += 1
      if anchor not in ids:
        broken.append(f'{path.relative_to(ROOT)}: #{anchor}')
  assert checked >= 5, f'only {checked} links to the ledger found: is the link pattern right?'
  assert not broken, 'links to ledger rows that do not exist:\n' + '\n'.join(broken)


def test_every_file_the_ledger_links_exists():
  missing = []
  for line in ledger_rows().values():
    for target in LINK_TARGET.findall(line):
      if target.startswith(('http://', 'https://', '#')):
        continue
      if not (LEDGER.parent / target.split('#', 1)[0]).exists():
        missing.append(target)
  assert not missing, 'files the ledger links that do not exist:\n' + '\n'.join(missing)
