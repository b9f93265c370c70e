"""The README's bring-your-own-model example runs as written and learns."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

README = pathlib.Path(__file__).resolve().parent.parent / 'README.md'


def test_readme_example_runs_and_learns(tmp_path):
  text = README.read_text()
  block = re.search(
    r'<!-- example:begin -->\n```python\n(.*?)```\n<!-- example:end -->', text, re.S
  )
  assert block, 'the README lost its example block'
  script = tmp_path / 'example.py'
  script.write_text(block.group(1))
  # Its own process: the example sets the simulated device count before JAX starts. Of the test
  # suite's XLA_FLAGS only its compile-speed settings (conftest.py) go with it, as to the
  # notebooks: a user's environment otherwise.
  compile_speed_flags = [
    f
    for f in os.environ.get('XLA_FLAGS', '').split()
    if not f.startswith('--xla_force_host_platform_device_count')
  ]
  result = subprocess.run(
    [sys.executable, str(script)],
    capture_output=True,
    text=True,
    timeout=300,
    env={
      'XLA_FLAGS': ' '.join(compile_speed_flags),
      'PATH': '/usr/bin:/bin',
      'HOME': str(tmp_path),
    },
  )
  assert result.returncode == 0, result.stderr[-2000:]
  loss = float(re.search(r'loss of batch 49: ([0-9.]+)', result.stdout).group(1))
  assert loss < 4.0  # started at log(256) = 5.55; a 16-symbol toy corpus is learnable
