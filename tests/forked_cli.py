"""Many `ouroboros` command lines for one interpreter start-up (its ~1.5 s of imports each).

One subprocess imports the command and its training loop (JAX imported, no backend started, no
thread running), then forks a child per command line: each child is a process of its own, with
its own stdout, stderr and exit status, as `python -m ouroboros_jax ARGS` gives them (a bug's
traceback included), and whatever it sets up (JAX's devices, signal handlers, files) ends with
it.
"""

from __future__ import annotations

import json
import subprocess
import sys

from helpers import REPO_ROOT

# argv[1]: a JSON list of command lines; prints a JSON list of [status, stdout, stderr].
_FORK_EACH = """
import json, os, sys, tempfile, traceback
from ouroboros_jax.cli import main
from ouroboros_jax.training import loop  # what a train or sample child imports next

def run(argv):
  try:
    code = main(argv)
  except SystemExit as e:
    code = e.code
  except BaseException:
    traceback.print_exc()
    code = 1
  if code is not None and not isinstance(code, int):
    print(code, file=sys.stderr)
    code = 1
  return code or 0

results = []
for argv in json.loads(sys.argv[1]):
  out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
  pid = os.fork()
  if pid == 0:
    os.dup2(out.fileno(), 1)
    os.dup2(err.fileno(), 2)
    code = run(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
  status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
  read = lambda f: (f.seek(0), f.read().decode())[1]
  results.append([status, read(out), read(err)])
print(json.dumps(results))
"""


def run_each(*argvs, timeout=120, env=None) -> list[subprocess.CompletedProcess]:
  """Each command line of `argvs` (lists of arguments, as `helpers.run_cli` takes them) run in a
  process of its own, forked from one that has imported the command; their results in order.
  `env`: the processes' environment, as `subprocess.run` takes it (None: this one's)."""
  lines = [[str(a) for a in argv] for argv in argvs]
  run = subprocess.run(
    [sys.executable, '-c', _FORK_EACH, json.dumps(lines)],
    cwd=REPO_ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=timeout,
  )
  assert run.returncode == 0, run.stderr[-3000:]
  return [
    subprocess.CompletedProcess(argv, code, stdout, stderr)
    for argv, (code, stdout, stderr) in zip(lines, json.loads(run.stdout), strict=True)
  ]
