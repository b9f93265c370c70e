"""Every relative link in the README, the changelog and docs/ points at a file or folder that
exists."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent

# [text](target) and ![alt](target); the text may span lines, the target may carry a "title".
LINK = re.compile(r'!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+"[^"]*")?\s*\)')
FENCE = re.compile(r'^(```|~~~).*?^\1', re.S | re.M)
EXTERNAL = ('http://', 'https://', 'mailto:')


def markdown_files():
  return [ROOT / 'README.md', ROOT / 'CHANGELOG.md', *sorted((ROOT / 'docs').rglob('*.md'))]


def relative_links(path):
  """(line, target) of every relative link in a markdown file, outside fenced code blocks."""
  text = FENCE.sub(lambda m: '\n' * m.group(0).count('\n'), path.read_text())
  for match in LINK.finditer(text):
    target = match.group(1)
    if target.startswith(EXTERNAL) or target.startswith('#'):
      continue
    yield text.count('\n', 0, match.start()) + 1, target


def test_relative_links_resolve():
  checked, broken = 0, []
  for path in markdown_files():
    assert path.exists(), f'{path.relative_to(ROOT)} is missing'
    for line, target in relative_links(path):
      checked += 1
      if not (path.parent / target.split('#', 1)[0]).exists():
        broken.append(f'{path.relative_to(ROOT)}:{line}: {target}')
  assert checked >= 20, f'only {checked} relative links found: is the link pattern still right?'
  assert not broken, 'broken relative links:\n' + '\n'.join(broken)
