"""The transformers rollout engine on a tiny random Qwen2 model (built by init_model with no warm start):

- its per-token log-probs are what a teacher-forced forward of the same weights gives (the trainer's computation);
- with the same seed it samples token for token what transformers' `model.generate` samples (TRL's sampler);
- a batch of prompts of different lengths behaves like each prompt alone (stop tokens, finish reasons, tokens);
- loading new weights changes what it generates and stamps the new version;
- generate runs off the event loop, and reports each token as it is sampled when asked to (streaming).

    .venv/bin/python -m pytest -q tests/integration/test_hf_engine.py
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlbus.producers.engines import make_engine
from rlbus.producers.engines.base import SamplingParams
from rlbus.producers.engines.hf import HFEngine
from rlbus.common.model.demos import prompt_messages
from rlbus.common.model.init_model import init_model
from rlbus.common.model.tiny import TinyModelSpec, tiny_model
from rlbus.common.chat import encode_chat
from rlbus.schemas.config import HFEngineConfig
from rlbus.schemas.config_io import from_dict
from rlbus.schemas.errors import WeightLoadError
from tests.support.engines import assert_cut_at_first_stop, teacher_forced_logprobs
from tests.support.engines import one_torch_thread  # noqa: F401 - a fixture (pytestmark below)
from tests.support.loop_gaps import loop_gaps

#: Wider and deeper than the quickstart's model: at random init the quickstart's tied-embedding 2-layer model greedily
#: repeats the prompt's last token whatever its seed, and generates too fast to time the event loop against.
ENGINE_SPEC = TinyModelSpec(hidden_size=128, intermediate_size=384, num_hidden_layers=4)

QUESTIONS = ["What is 17*23?", "What is 5+38?", "What is 9*9? Please show the steps and be careful.", "Hi"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return init_model(tmp_path_factory.mktemp("tiny") / "model", steps=0, spec=ENGINE_SPEC, log=lambda _: None)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    out = [encode_chat(tokenizer, prompt_messages(q), add_generation_prompt=True) for q in QUESTIONS]
    out.append(out[0][:3])  # a very short prompt next to long ones: lots of left padding
    assert len({len(p) for p in out}) == len(out)
    return out


@pytest.mark.parametrize("temperature,top_p,top_k", [(1.0, 1.0, 0), (0.7, 0.9, 0), (1.3, 1.0, 20)])
async def test_logprobs_match_teacher_forced_forward(model_dir, prompts, temperature, top_p, top_k):
    engine = HFEngine(str(model_dir), HFEngineConfig(max_batch_size=8), seed=0)
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=24, seed=1)
    gens = await engine.generate(prompts, params)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    max_diff = 0.0
    for prompt, gen in zip(prompts, gens):
        assert len(gen.token_ids) == len(gen.log_probs) == 24 and gen.finish_reason == "length"
        expected = teacher_forced_logprobs(reference, prompt, gen.token_ids, temperature)
        max_diff = max(max_diff, (expected - torch.tensor(gen.log_probs)).abs().max().item())
    assert max_diff < 1e-4, f"engine vs teacher-forced log-probs: max |diff| = {max_diff:.3g}"
    print(f"max |engine - teacher-forced| log-prob difference (T={temperature}, top_p={top_p}, top_k={top_k}): {max_diff:.3g}")


async def test_top_k_restricts_sampling_but_not_logprobs(model_dir, prompts):
    engine = HFEngine(str(model_dir), HFEngineConfig(), seed=0)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    params = SamplingParams(temperature=1.0, top_k=2, max_new_tokens=16, seed=3)
    for prompt, gen in zip(prompts, await engine.generate(prompts, params)):
        with torch.no_grad():
            logits_TV = reference(input_ids=torch.tensor([prompt + gen.token_ids])).logits[0]
        top2_TK = logits_TV[len(prompt) - 1 : -1].topk(2, dim=-1).indices
        assert all(t in top2_TK[i].tolist() for i, t in enumerate(gen.token_ids))


async def test_batch_equals_each_prompt_alone_with_stop_tokens(model_dir, prompts):
    engine = HFEngine(str(model_dir), HFEngineConfig(max_batch_size=3), seed=0)  # 5 prompts -> chunks of 3 + 2
    greedy = SamplingParams(temperature=1e-4, max_new_tokens=12)
    free = await engine.generate(prompts, greedy)
    # Stop on the 4th token the first prompt generates: it must end there, others wherever that id first appears.
    stop_id = free[0].token_ids[3]
    with_stop = await engine.generate(prompts, SamplingParams(temperature=1e-4, max_new_tokens=12, stop_token_ids=(stop_id,)))
    assert_cut_at_first_stop(free, with_stop, stop_id)
    assert with_stop[0].finish_reason == "stop" and len(with_stop[0].token_ids) <= 4
    # Each prompt alone gives what it gave inside the batch.
    for prompt, batched in zip(prompts, with_stop):
        (alone,) = await engine.generate([prompt], SamplingParams(temperature=1e-4, max_new_tokens=12, stop_token_ids=(stop_id,)))
        assert alone.token_ids == batched.token_ids and alone.finish_reason == batched.finish_reason
        assert alone.log_probs == pytest.approx(batched.log_probs, abs=1e-4)


async def test_load_weights_changes_generation_and_stamps_version(model_dir, prompts):
    engine = HFEngine(str(model_dir), HFEngineConfig(), version=0, seed=0)
    greedy = SamplingParams(temperature=1e-4, max_new_tokens=16)
    before = await engine.generate(prompts, greedy)
    assert {g.version for g in before} == {0}

    new_model = tiny_model(AutoTokenizer.from_pretrained(model_dir), seed=123, spec=ENGINE_SPEC)
    await engine.load_weights(new_model.state_dict(), version=7)
    assert engine.version == 7
    after = await engine.generate(prompts, greedy)
    assert {g.version for g in after} == {7}
    assert [g.token_ids for g in after] != [g.token_ids for g in before]
    # ... and it is exactly the new model: its log-probs are the new model's teacher-forced ones.
    new_model.eval()
    for prompt, gen in zip(prompts, after):
        expected = teacher_forced_logprobs(new_model, prompt, gen.token_ids, 1e-4)
        assert torch.allclose(expected, torch.tensor(gen.log_probs), atol=1e-2)

    # A state dict without the tied lm_head loads too; one with a wrong shape is refused with the names.
    state = {k: v for k, v in new_model.state_dict().items() if k != "lm_head.weight"}
    await engine.load_weights(state, version=8)
    bad = dict(state)
    bad["model.norm.weight"] = torch.ones(3)
    with pytest.raises(WeightLoadError, match="model.norm.weight"):
        await engine.load_weights(bad, version=9)
    assert engine.version == 8


async def test_a_load_copies_aside_and_pauses_generation_only_to_swap(model_dir, prompts):
    engine = HFEngine(str(model_dir), HFEngineConfig(share_weights=False), version=0, seed=0)
    new_model = tiny_model(AutoTokenizer.from_pretrained(model_dir), seed=7, spec=ENGINE_SPEC)
    source = {k: v.clone() for k, v in new_model.state_dict().items()}
    engine._lock.acquire()  # a generation chunk in flight
    try:
        t0 = time.perf_counter()
        load = asyncio.create_task(engine.load_weights(source, version=3))
        await asyncio.sleep(0.3)
        assert not load.done() and engine.version == 0  # the chunk in flight keeps its weights
    finally:
        engine._lock.release()
    await load
    took = time.perf_counter() - t0
    assert engine.version == 3
    # The copy was made while the chunk ran; holding generation took only the swap.
    assert engine.last_load_pause_s < 0.05 < took
    model = engine.model
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
    for name, w in model.state_dict().items():
        assert torch.equal(w, source[name]), name
        assert w.data_ptr() != source[name].data_ptr(), name  # the engine's own copy, not the sender's buffer
    source["model.norm.weight"].add_(1.0)
    assert not torch.equal(model.model.norm.weight, source["model.norm.weight"])
    # The next load copies into the tensors this one swapped out (memory already touched), then swaps again.
    first_ptr = model.model.norm.weight.data_ptr()
    newer = tiny_model(AutoTokenizer.from_pretrained(model_dir), seed=8, spec=ENGINE_SPEC).state_dict()
    await engine.load_weights(newer, version=4)
    for name, w in model.state_dict().items():
        assert torch.equal(w, newer[name]), name
    assert model.model.norm.weight.data_ptr() not in (first_ptr, newer["model.norm.weight"].data_ptr())
    await engine.load_weights(source, version=5)
    assert model.model.norm.weight.data_ptr() == first_ptr and torch.equal(model.model.norm.weight,
                                                                          source["model.norm.weight"])


async def test_a_shared_load_reads_the_weight_store_object_in_place(model_dir, prompts, ray_config):
    from rlbus.bus.ray_store import teardown
    from rlbus.bus.weight_store import WeightStore

    run = f"t-shared-{uuid.uuid4().hex[:8]}"
    ws = WeightStore.connect(run, ray_config)
    try:
        new_model = tiny_model(AutoTokenizer.from_pretrained(model_dir), seed=9, spec=ENGINE_SPEC)
        info = await ws.put(1, new_model.state_dict())
        fetched = await ws.get(1, expect=info.checksum)  # read-only views of the store's object
        shared = HFEngine(str(model_dir), HFEngineConfig(), version=0, seed=0)
        copied = HFEngine(str(model_dir), HFEngineConfig(share_weights=False), version=0, seed=0)
        for engine in (shared, copied):
            await engine.load_weights(fetched, version=1)
        for name, w in shared.model.state_dict().items():
            assert torch.equal(w, fetched[name]), name
        in_store = fetched["model.norm.weight"].data_ptr()
        assert shared.model.model.norm.weight.data_ptr() == in_store  # nothing copied
        assert copied.model.model.norm.weight.data_ptr() != in_store
        assert shared.model.lm_head.weight is shared.model.model.embed_tokens.weight  # still tied
        greedy = SamplingParams(temperature=1e-4, max_new_tokens=12)
        a, b = await shared.generate(prompts, greedy), await copied.generate(prompts, greedy)
        assert [g.token_ids for g in a] == [g.token_ids for g in b]
        # Another dtype cannot be read in place: it is converted into the engine's own memory, and from then on
        # loads copy again (never into the store's object).
        half = {k: v.to(torch.bfloat16) for k, v in tiny_model(AutoTokenizer.from_pretrained(model_dir), seed=10,
                                                               spec=ENGINE_SPEC).state_dict().items()}
        await shared.load_weights(half, version=2)
        assert shared.model.model.norm.weight.data_ptr() != in_store
        assert shared.model.model.norm.weight.dtype == torch.float32
        assert torch.equal(fetched["model.norm.weight"], new_model.state_dict()["model.norm.weight"])
        await shared.load_weights(fetched, version=3)
        assert shared.model.model.norm.weight.data_ptr() == in_store
    finally:
        teardown(run, ray_config)


async def test_concurrent_calls_are_merged_into_one_batch(model_dir, prompts):
    n = len(prompts)
    engine = HFEngine(str(model_dir), HFEngineConfig(max_batch_size=2 * n - 1), seed=0)
    greedy = SamplingParams(temperature=1e-4, max_new_tokens=6)
    alone = [await engine.generate([p], greedy) for p in prompts]
    batches: list[int] = []
    run = engine._generate_sync
    engine._generate_sync = lambda ps, *rest: (batches.append(len(ps)), run(ps, *rest))[1]  # type: ignore[method-assign]
    calls = [engine.generate([p], greedy) for p in prompts] + [engine.generate(prompts, greedy)]
    other = SamplingParams(temperature=2e-4, max_new_tokens=3)  # another temperature: a batch of its own
    together = await asyncio.gather(*calls, engine.generate(prompts[:1], other))
    # Queued together: the n single prompts go as one batch; the n-prompt call would pass max_batch_size (2n - 1)
    # with them, so it goes next; the call with other parameters goes alone.
    assert batches == [n, n, 1], batches
    for one, merged in zip(alone, together[: len(prompts)]):
        assert one[0].token_ids == merged[0].token_ids
    assert [g.token_ids for g in together[len(prompts)]] == [g[0].token_ids for g in alone]
    assert len(together[-1][0].token_ids) <= 3


async def test_calls_with_their_own_limits_and_seeds_share_a_batch(model_dir, prompts):
    """Episodes ask for what is left of their own budget, and a seeded run seeds each call: such calls still merge,
    each cut at its own max_new_tokens, and a seeded call samples the same tokens merged as alone."""
    engine = HFEngine(str(model_dir), HFEngineConfig(max_batch_size=16), seed=0)
    limits = [2, 5, 9, 9]
    params = [SamplingParams(temperature=1.0, max_new_tokens=k, seed=100 + i) for i, k in enumerate(limits)]
    alone = [(await engine.generate([p], sp))[0] for p, sp in zip(prompts, params)]
    batches: list[int] = []
    run = engine._generate_sync
    engine._generate_sync = lambda ps, *rest: (batches.append(len(ps)), run(ps, *rest))[1]  # type: ignore[method-assign]
    merged = await asyncio.gather(*(engine.generate([p], sp) for p, sp in zip(prompts, params)))
    assert batches == [len(limits)]
    for one, (together,), limit in zip(alone, merged, limits):
        assert together.token_ids == one.token_ids
        assert len(together.token_ids) <= limit and len(together.log_probs) == len(together.token_ids)
        assert together.finish_reason == ("stop" if len(together.token_ids) < limit else one.finish_reason)


async def test_tokens_are_reported_as_they_are_sampled(model_dir, prompts):
    """on_tokens hears of every token right after the decode step that sampled it, on the event loop, rows
    numbered within their own call: also when calls are merged into one batch and a call is cut into chunks
    (max_batch_size 2); what it heard adds up to each generation."""
    engine = HFEngine(str(model_dir), HFEngineConfig(max_batch_size=2), seed=0)
    params = SamplingParams(temperature=1.0, max_new_tokens=12)
    loop_thread = threading.get_ident()
    heard: dict[tuple[int, int], list] = {}

    def sink_of(call: int):
        def sink(i: int, ids: list[int], log_probs: list[float]) -> None:
            assert threading.get_ident() == loop_thread and len(ids) == len(log_probs) == 1
            got = heard.setdefault((call, i), [[], []])
            got[0] += ids
            got[1] += log_probs
        return sink

    calls = [engine.generate(prompts[:1], params, sink_of(0)), engine.generate(prompts[1:2], params, sink_of(1)),
             engine.generate(prompts, params, sink_of(2)), engine.generate(prompts[2:3], params)]
    results = await asyncio.gather(*calls)
    for call, gens in enumerate(results[:3]):
        for i, gen in enumerate(gens):
            assert heard[(call, i)] == [gen.token_ids, gen.log_probs]
    assert len(heard) == 1 + 1 + len(prompts)  # the call without a sink was not reported
    await engine.close()


async def test_generate_does_not_block_the_event_loop(model_dir, prompts):
    engine = HFEngine(str(model_dir), HFEngineConfig(), seed=0)
    async with loop_gaps(0.01) as gaps:
        start = time.perf_counter()
        await engine.generate(prompts * 4, SamplingParams(max_new_tokens=64))
        took = time.perf_counter() - start
    assert took > 0.2, "generation too quick to say anything about the loop"
    assert len(gaps) >= took / 0.1, f"loop ticked {len(gaps)} times in {took:.2f}s"
    assert max(gaps) < 0.25, f"event loop stalled {max(gaps):.3f}s during generate"


async def test_make_engine_builds_hf(model_dir, prompts):
    cfg = from_dict({"model": {"path": str(model_dir)}, "rollout": {"engine": {"type": "hf", "max_batch_size": 2}}})
    engine = make_engine(cfg, version=5)
    assert isinstance(engine, HFEngine) and engine.version == 5
    (gen,) = await engine.generate(prompts[:1], SamplingParams(max_new_tokens=3))
    assert len(gen.token_ids) == 3 and gen.version == 5
    await engine.close()


def test_sampling_draws_the_tokens_transformers_generate_draws(model_dir, tokenizer):
    """Same weights, same prompts, same seed: the engine's sampler picks token for token what `model.generate` (what
    TRL's GRPOTrainer samples with) picks, so the rollout distribution is transformers' own, not an approximation.
    Equal-length prompts (no padding) and plain temperature-1 sampling, as the peer bench's one-digit sums are."""
    from rlbus.producers.engines.hf import sample

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompt = encode_chat(tokenizer, prompt_messages("What is 3+4?"), add_generation_prompt=True)
    prompts = [prompt] * 16
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    ours = sample(model, prompts, SamplingParams(temperature=1.0, max_new_tokens=12, stop_token_ids=(eos,)),
                  pad_token_id=pad, generator=torch.Generator().manual_seed(7))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        ids = torch.tensor(prompts)
        theirs = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0,
                                top_k=0, top_p=1.0, max_new_tokens=12, eos_token_id=eos, pad_token_id=pad)
    for gen, row in zip(ours, theirs[:, len(prompt):].tolist(), strict=True):
        expected = row[:row.index(eos) + 1] if eos in row else row
        assert gen.token_ids == expected
    assert len({tuple(g.token_ids) for g in ours}) > 1  # sampled, not one greedy answer
