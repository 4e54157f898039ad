"""rlbus: fully asynchronous, event-driven RL post-training for language models. The CLI lives in rlbus.cli."""

__version__ = "0.1.0"
