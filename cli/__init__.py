"""The `rlbus` command (`cli/main.py`): each subcommand imports its heavy modules at its door, so `--help` is instant.

    rlbus --help
    python -m rlbus.cli up configs/quickstart.yaml
"""

import os

# Torch's OpenMP threads wait for work asleep, not spinning, unless the user chose otherwise. On a machine whose
# cores something else also wants (a second run, a test suite, a build), spinning threads take turns burning each
# other's time slices: 60 warm-start steps of the quickstart model took 126 s spinning against 12.5 s asleep, on 2
# cores with a load of 5. Set here, before anything imports torch: OpenMP reads it once, at its start.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
