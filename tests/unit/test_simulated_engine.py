"""The simulated engine: long-tailed lengths within the cap, well-formed generations, overlapping sleeps, versions.

    .venv/bin/python -m pytest -q tests/unit/test_simulated_engine.py
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time

from rlbus.producers.engines import make_engine
from rlbus.producers.engines.base import SamplingParams
from rlbus.producers.engines.simulated import SimulatedEngine
from rlbus.schemas.config import SimulatedEngineConfig
from rlbus.schemas.config_io import from_dict


def test_lengths_are_long_tailed_around_the_median_and_capped():
    engine = SimulatedEngine(SimulatedEngineConfig(mean_tokens=100, tail_alpha=1.5))
    rng = random.Random(0)
    lengths = [engine.sample_length(rng, 10_000) for _ in range(20_000)]
    assert 90 <= statistics.median(lengths) <= 110
    # Long tail: the mean sits well above the median and the top 1% is many times the median.
    assert statistics.mean(lengths) > 1.5 * statistics.median(lengths)
    assert sorted(lengths)[int(0.99 * len(lengths))] > 10 * statistics.median(lengths)
    capped = [engine.sample_length(rng, 150) for _ in range(2000)]
    assert max(capped) == 150 and min(capped) >= 1


async def test_generations_are_well_formed_and_stamped():
    engine = SimulatedEngine(SimulatedEngineConfig(mean_tokens=8, seconds_per_token=0.0, vocab_size=32), version=3)
    params = SamplingParams(max_new_tokens=20, stop_token_ids=(5,), seed=1)
    gens = await engine.generate([[1, 2], [3], [4, 4, 4]] * 10, params)
    assert len(gens) == 30
    for g in gens:
        assert 1 <= len(g.token_ids) <= 20 and len(g.log_probs) == len(g.token_ids)
        assert all(lp <= 0 for lp in g.log_probs)
        assert all(0 <= t < 32 for t in g.token_ids)
        assert g.version == 3
        # a stop id ends a "stop" generation and appears nowhere else
        assert (g.finish_reason == "stop") == (g.token_ids[-1] == 5)
        assert 5 not in g.token_ids[:-1]
    assert {g.finish_reason for g in gens} == {"stop", "length"}
    # the same seed gives the same generations
    again = await engine.generate([[1, 2], [3], [4, 4, 4]] * 10, params)
    assert [g.token_ids for g in again] == [g.token_ids for g in gens]
    await engine.load_weights({}, version=4)
    assert engine.version == 4
    assert all(g.version == 4 for g in await engine.generate([[1]], params))


async def test_concurrent_generations_overlap():
    cfg = SimulatedEngineConfig(mean_tokens=50, tail_alpha=50.0, seconds_per_token=0.004)  # ~0.2 s each, no tail
    engine = SimulatedEngine(cfg)
    params = SamplingParams(max_new_tokens=50)
    start = time.perf_counter()
    one = await engine.generate([[1]], params)
    single = time.perf_counter() - start
    assert single >= 0.004 * len(one[0].token_ids) * 0.9
    start = time.perf_counter()
    await asyncio.gather(*(engine.generate([[1]], params) for _ in range(8)))
    together = time.perf_counter() - start
    assert together < 3 * single, f"8 concurrent calls took {together:.3f}s vs {single:.3f}s for one"


def test_make_engine_picks_simulated():
    cfg = from_dict({"model": {"path": "/nonexistent"}, "rollout": {"engine": {"type": "simulated", "mean_tokens": 4}}})
    engine = make_engine(cfg, version=2)
    assert isinstance(engine, SimulatedEngine) and engine.version == 2
