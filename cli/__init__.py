"""The `rlbus` command (`cli/main.py`): each subcommand imports its heavy modules at its door, so `--help` is instant.

    rlbus --help
    python -m rlbus.cli up configs/quickstart.yaml
"""
