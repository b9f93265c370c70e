"""`python -m ouroboros_jax ...` is the `ouroboros` command (see cli.py)."""

import sys

from ouroboros_jax.cli import main

if __name__ == '__main__':
  sys.exit(main())
