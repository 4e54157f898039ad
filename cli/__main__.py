"""`python -m rlbus.cli ...`: the same as the `rlbus` command (how the launcher starts its children)."""

import sys

from rlbus.cli.main import main

sys.exit(main())
