"""Prompt data sets (JSONL, Parquet in verl's layout, synthetic arithmetic) and their conversion to PromptTasks."""

from rlbus.common.data.datasets import (
    DataError,
    Example,
    PromptDataset,
    example_to_task,
    load_dataset,
)

__all__ = ["DataError", "Example", "PromptDataset", "example_to_task", "load_dataset"]
