"""Benchmarks: each module runs as a script (`python bench/<name>.py`) and writes bench/results/<name>.json."""
