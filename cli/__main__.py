"""`python -m rlbus.cli ...`: the same as the `rlbus` command (how the launcher starts its children)."""

import sys

from rlbus.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
