"""The agent loops' pure logic, on the real quickstart tokenizer and a scripted engine.

The engine here is a small in-memory fake on purpose: it replays predetermined assistant turns, so every token,
mask bit and log-prob of a trajectory is known in advance. The real engine is exercised by
tests/integration/test_rollout_dry_run.py.
"""

from __future__ import annotations

import asyncio
from typing import Mapping

import pytest

from rlbus.producers.agent_loops import Trajectory, make_agent_loop
from rlbus.producers.agent_loops.tool_parser import parse_tool_calls
from rlbus.producers.engines.base import Generation, RolloutEngine, SamplingParams
from rlbus.common.model.demos import QUICKSTART_SYSTEM_PROMPT, answer_text, tool_call_text
from rlbus.common.model.tokenizer import build_tokenizer
from rlbus.producers.rewards import load_reward
from rlbus.producers.tools import load_tools
from rlbus.schemas.config import ModelConfig, OpenAIAgentConfig, RolloutConfig, RunConfig
from rlbus.schemas.wire import ChatMessage, PromptTask

LOGP = -0.5  # every scripted token's log-prob: non-zero, so a 0.0 can only come from the mask


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


class ScriptedEngine(RolloutEngine):
    """Sample i of a group speaks `behaviours[i]`, one turn per call; the version goes up by one per call.

    Samples are told apart by the order of their first turns (each sample's episode starts in order) and by their
    first turn afterwards (the loop gives no other identity), so behaviours must differ in their first turn when a
    test needs to tell them apart. `log` records, per call, (behaviour, turn, time): when each sample's turn ran.
    """

    def __init__(self, tokenizer, behaviours: list[list[str]]):
        self.tok = tokenizer
        self.turns = [[tokenizer.encode(t, add_special_tokens=False) + [tokenizer.eos_token_id] for t in b]
                      for b in behaviours]
        self.served = [0] * len(behaviours)
        self.calls: list[tuple[int, SamplingParams]] = []
        self.prompt_len: int | None = None
        self.started = 0  # first turns served
        self.log: list[tuple[int, int, float]] = []
        self._version = 0

    @property
    def version(self) -> int:
        return self._version

    def _which(self, prompt: list[int]) -> int:
        if len(prompt) == self.prompt_len:
            self.started += 1
            return self.started - 1  # first turn: the samples come in order
        tail = prompt[self.prompt_len:]
        matches = [i for i, b in enumerate(self.turns) if tail[: len(b[0])] == b[0]]
        assert len(matches) == 1, "scripted behaviours must differ in their first turn"
        return matches[0]

    async def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        if self.prompt_len is None:
            self.prompt_len = len(prompts[0])
        self.calls.append((len(prompts), params))
        out = []
        for prompt in prompts:
            i = self._which(prompt)
            self.log.append((i, self.served[i], asyncio.get_running_loop().time()))
            ids = self.turns[i][self.served[i]]
            self.served[i] += 1
            finish = "stop"
            if len(ids) > params.max_new_tokens:
                ids, finish = ids[: params.max_new_tokens], "length"
            assert params.stop_token_ids == (self.tok.eos_token_id,)
            out.append(Generation(token_ids=ids, log_probs=[LOGP] * len(ids), finish_reason=finish,
                                  version=self._version))
        self._version += 1
        return out

    async def load_weights(self, state_dict: Mapping, version: int) -> None:
        raise NotImplementedError("not used by these tests")


def _task(question: str = "What is 17*23?", truth: str = "391", n: int = 1) -> PromptTask:
    prompt = [ChatMessage(role="system", content=QUICKSTART_SYSTEM_PROMPT), ChatMessage(role="user", content=question)]
    return PromptTask(task_id="t0", prompt=prompt, ground_truth=truth, n=n)


def _loop(tok, behaviours: list[list[str]], tools: list[str] = ("calculator",), **rollout):
    cfg = RunConfig(model=ModelConfig(path="unused"), rollout=RolloutConfig(**rollout))
    engine = ScriptedEngine(tok, behaviours)
    return make_agent_loop(cfg, engine, tok, load_tools(list(tools)), load_reward(cfg.rollout)), engine


def _template_ids(tok, messages: list[ChatMessage]) -> list[int]:
    out = tok.apply_chat_template([{"role": m.role, "content": m.content} for m in messages], tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def _check_invariants(tok, traj: Trajectory) -> None:
    n = len(traj.response_ids)
    assert len(traj.response_mask) == len(traj.log_probs) == len(traj.versions) == n
    for m, lp, v in zip(traj.response_mask, traj.log_probs, traj.versions):
        assert (lp == 0.0 and v == -1) if m == 0 else (lp == LOGP and v >= 0)
    if traj.finish_reason != "length":
        # The conversation as the chat template tokenizes it, minus the "\n" after the model's last <|im_end|>.
        full = _template_ids(tok, traj.messages)
        assert tok.decode(full[-1:]) == "\n"
        assert traj.prompt_ids + traj.response_ids == full[:-1]
        assert traj.response_ids[-1] == tok.eos_token_id and traj.response_mask[-1] == 1


async def test_handbook_example_calculator_call_then_answer(tok) -> None:
    loop, engine = _loop(tok, [[tool_call_text("17 * 23"), answer_text("391")]])
    [traj] = await loop.rollout_group(_task(), 1)

    assert traj.reward == 1.0
    assert (traj.finish_reason, traj.num_turns, traj.num_tool_calls) == ("stop", 2, 1)
    assert [(m.role, m.content) for m in traj.messages[2:]] == [
        ("assistant", tool_call_text("17 * 23")), ("tool", "391"), ("assistant", answer_text("391"))]
    _check_invariants(tok, traj)

    # The mask, segment by segment: the call (with its <|im_end|>) 1, the inserted tool turn 0, the answer 1.
    call = tok.encode(tool_call_text("17 * 23"), add_special_tokens=False) + [tok.eos_token_id]
    inserted = tok.encode("\n<|im_start|>user\n<tool_response>391</tool_response><|im_end|>\n<|im_start|>assistant\n",
                          add_special_tokens=False)
    answer = tok.encode(answer_text("391"), add_special_tokens=False) + [tok.eos_token_id]
    assert traj.response_ids == call + inserted + answer
    assert traj.response_mask == [1] * len(call) + [0] * len(inserted) + [1] * len(answer)
    # Weights changed between the turns: each generated token carries the version that produced it.
    assert traj.versions == [0] * len(call) + [-1] * len(inserted) + [1] * len(answer)
    assert [c[0] for c in engine.calls] == [1, 1]

    t = traj.tensors()
    assert set(t) == {"prompt_ids", "response_ids", "response_mask", "rollout_log_probs", "versions"}
    assert all(v.dim() == 1 for v in t.values()) and t["response_mask"].sum().item() == len(call) + len(answer)
    assert t["rollout_log_probs"][t["response_mask"] == 0].abs().sum().item() == 0.0
    meta = traj.sample_meta("t0/0")
    assert (meta.prompt_len, meta.response_len, meta.reward) == (len(traj.prompt_ids), len(traj.response_ids), 1.0)
    assert (meta.min_version, meta.max_version, meta.num_tool_calls, meta.num_turns) == (0, 1, 1, 2)


@pytest.mark.parametrize(
    ("bad_call", "error"),
    [
        ('<tool_call>{"name": "calculator", "arguments": {"expression": "17*23"}</tool_call>',
         "invalid tool call JSON"),
        ('<tool_call>{"name": "search", "arguments": {"q": "17*23"}}</tool_call>', "unknown tool 'search'"),
        ('<tool_call>["calculator"]</tool_call>', "a tool call must be"),
        ('<tool_call>{"name": "calculator", "arguments": 5}</tool_call>', "arguments must be an object"),
        ('<tool_call>{"name": "calculator", "arguments": {"expression": "17*', "unterminated"),
        ('<tool_call>{"name": "calculator", "arguments": {"expr": "1"}}</tool_call>', "missing argument"),
        ('<tool_call>{"name": "calculator", "arguments": {"expression": "1/0"}}</tool_call>', "division by zero"),
    ],
)
async def test_malformed_tool_calls_become_tool_errors(tok, bad_call: str, error: str) -> None:
    loop, _ = _loop(tok, [[bad_call, answer_text("391")]])
    [traj] = await loop.rollout_group(_task(), 1)
    tool_msg = traj.messages[3]
    assert tool_msg.role == "tool" and tool_msg.content.startswith("error: ") and error in tool_msg.content
    assert traj.finish_reason == "stop" and traj.reward == 1.0 and traj.num_tool_calls == 1
    _check_invariants(tok, traj)


def test_parse_tool_calls_accepts_any_json_whitespace_and_string_arguments() -> None:
    [call] = parse_tool_calls('<tool_call>\n{ "name" : "calculator",\n "arguments":"{\\"expression\\": \\"2*3\\"}" }\n'
                              "</tool_call>")
    assert (call.name, call.arguments, call.error) == ("calculator", {"expression": "2*3"}, "")
    assert parse_tool_calls("<answer>6</answer>") == []
    two = parse_tool_calls('<tool_call>{"name": "a"}</tool_call> then <tool_call>{"name": "b"}</tool_call>')
    assert [c.name for c in two] == ["a", "b"] and two[0].arguments == {}


async def test_max_turns_ends_a_tool_calling_episode(tok) -> None:
    call = tool_call_text("17*23")
    loop, engine = _loop(tok, [[call, call, call]], max_turns=2)
    [traj] = await loop.rollout_group(_task(), 1)
    assert (traj.finish_reason, traj.num_turns, traj.num_tool_calls) == ("max_turns", 2, 1)
    assert len(engine.calls) == 2
    assert traj.reward == 0.0
    _check_invariants(tok, traj)


async def test_turn_cut_by_max_new_tokens_is_length(tok) -> None:
    loop, _ = _loop(tok, [["thinking " * 30 + answer_text("391")]], max_new_tokens=10, max_response_tokens=100)
    [traj] = await loop.rollout_group(_task(), 1)
    assert traj.finish_reason == "length" and len(traj.response_ids) == 10
    assert all(m == 1 for m in traj.response_mask) and traj.response_ids[-1] != tok.eos_token_id
    assert traj.reward == 0.0
    _check_invariants(tok, traj)


async def test_max_response_tokens_bounds_all_turns(tok) -> None:
    call = tool_call_text("17*23")
    call_len = len(tok.encode(call, add_special_tokens=False)) + 1  # + <|im_end|>
    inserted_len = len(tok.encode("\n<|im_start|>user\n<tool_response>391</tool_response><|im_end|>\n"
                                  "<|im_start|>assistant\n", add_special_tokens=False))
    # Room for call, tool turn, call -- but not for the second tool turn, so a third turn can never start.
    budget = 2 * call_len + inserted_len + 2
    loop, engine = _loop(tok, [[call, call, answer_text("391")]], max_turns=5, max_new_tokens=call_len,
                         max_response_tokens=budget)
    [traj] = await loop.rollout_group(_task(), 1)
    assert traj.finish_reason == "length"
    assert len(traj.response_ids) == 2 * call_len + inserted_len <= budget
    assert traj.response_mask == [1] * call_len + [0] * inserted_len + [1] * call_len
    # The second call ran and its tool response was not inserted: there was no room left to read it.
    assert traj.num_turns == 2 and traj.num_tool_calls == 2 and traj.messages[-1].role == "assistant"
    assert len(engine.calls) == 2


async def test_generation_is_capped_by_what_is_left_of_the_response(tok) -> None:
    call = tool_call_text("17*23")
    call_len = len(tok.encode(call, add_special_tokens=False)) + 1
    loop, engine = _loop(tok, [[call, "thinking " * 40 + answer_text("391")]], max_new_tokens=100,
                         max_response_tokens=100)
    [traj] = await loop.rollout_group(_task(), 1)
    left = 100 - call_len - traj.response_mask.count(0)
    assert engine.calls[1][1].max_new_tokens == left
    assert traj.finish_reason == "length" and len(traj.response_ids) == 100
    _check_invariants(tok, traj)


class LongTool:
    name = "lorem"
    description = "Returns a long text."

    async def __call__(self, arguments: dict) -> str:
        return "lorem ipsum dolor sit amet " * 50


class BrokenTool:
    name = "broken"
    description = "Always raises."

    async def __call__(self, arguments: dict) -> str:
        raise RuntimeError("backend down")


async def test_tool_response_is_truncated_to_max_tool_response_tokens(tok) -> None:
    loop, _ = _loop(tok, [['<tool_call>{"name": "lorem", "arguments": {}}</tool_call>', answer_text("1")]],
                    tools=["calculator", f"{__name__}:LongTool"], max_tool_response_tokens=8, max_response_tokens=160)
    [traj] = await loop.rollout_group(_task(truth="1"), 1)
    content = traj.messages[3].content
    assert 0 < len(tok.encode(content, add_special_tokens=False)) <= 8
    assert ("lorem ipsum dolor sit amet " * 50).startswith(content)
    assert traj.reward == 1.0
    _check_invariants(tok, traj)


async def test_a_tool_that_raises_becomes_an_error_message(tok) -> None:
    loop, _ = _loop(tok, [['<tool_call>{"name": "broken", "arguments": {}}</tool_call>', answer_text("391")]],
                    tools=["calculator", f"{__name__}:BrokenTool"])
    [traj] = await loop.rollout_group(_task(), 1)
    assert traj.messages[3].content == "error: RuntimeError: backend down"
    _check_invariants(tok, traj)


class SlowTool:
    name = "slow"
    description = "Never answers in time."

    async def __call__(self, arguments: dict) -> str:
        await asyncio.sleep(30)
        return "too late"


async def test_a_tool_whose_service_never_answers_fails_the_episode_as_infrastructure(tok) -> None:
    """A timeout is the tool's service failing, not the model: retried, then the episode fails with
    InfrastructureError (the producer gives the task back), never an observation trained as a reward of 0."""
    from rlbus.producers.agent_loops.base import failure_kind
    from rlbus.schemas.errors import InfrastructureError

    loop, _ = _loop(tok, [['<tool_call>{"name": "slow", "arguments": {}}</tool_call>', answer_text("391")]],
                    tools=[f"{__name__}:SlowTool"], tool_timeout_s=0.05, tool_retries=1)
    with pytest.raises(InfrastructureError, match=r"tool slow: timed out after 0.05s \(2 attempt") as caught:
        await loop.rollout_group(_task(), 1)
    assert failure_kind(caught.value) == "infrastructure"
    assert loop.runner.infra_retries == 1


class FlakyTool:
    """Its service fails the first call of each argument, then answers."""

    name = "flaky"
    description = "Fails once, then works."
    seen: set

    def __init__(self):
        self.seen = set()

    def __call__(self, arguments: dict) -> str:  # synchronous: runs in the producer's worker pool
        from rlbus.schemas.errors import InfrastructureError

        key = arguments.get("x")
        if key not in self.seen:
            self.seen.add(key)
            raise InfrastructureError("flaky service", "connection reset")
        return f"ok {key}"


async def test_a_failed_tool_service_is_retried_and_its_answer_used(tok) -> None:
    loop, _ = _loop(tok, [['<tool_call>{"name": "flaky", "arguments": {"x": 1}}</tool_call>', answer_text("391")]],
                    tools=[f"{__name__}:FlakyTool"], max_tool_response_tokens=64)
    [traj] = await loop.rollout_group(_task(), 1)
    assert traj.messages[3].content == "ok 1" and traj.reward == 1.0
    assert loop.runner.infra_retries == 1
    _check_invariants(tok, traj)


class PausingTool:
    """Takes `arguments["s"]` seconds (a remote service's latency)."""

    name = "pause"
    description = "Sleeps."

    async def __call__(self, arguments: dict) -> str:
        await asyncio.sleep(float(arguments["s"]))
        return "done"


def _pause(seconds: float) -> str:
    return '<tool_call>{"name": "pause", "arguments": {"s": %s}}</tool_call>' % seconds


async def test_each_sample_advances_on_its_own(tok) -> None:
    """A slow tool call of one sample holds no other sample: the fast samples take their next turns, and finish,
    while it waits; the group is done when its last episode ends."""
    behaviours = [
        [_pause(0.6), answer_text("391")],  # one slow call
        [_pause(0.01), _pause("0.02"), answer_text("391")],  # two quick calls: three turns
        [answer_text("390")],  # answers at once
    ]
    loop, engine = _loop(tok, behaviours, tools=[f"{__name__}:PausingTool"], max_turns=3, max_response_tokens=300,
                         max_tool_response_tokens=64)
    t0 = asyncio.get_running_loop().time()
    trajs = await loop.rollout_group(_task(n=3), 3)
    when = {(i, turn): t - t0 for i, turn, t in engine.log}
    assert when[(1, 2)] < 0.3 < when[(0, 1)]  # sample 1's third turn ran before sample 0's tool answered
    assert [t.num_turns for t in trajs] == [2, 3, 1]
    assert [t.reward for t in trajs] == [1.0, 1.0, 0.0]
    assert trajs[0].tool_time_s >= 0.6 and trajs[1].tool_time_s < 0.3
    for t in trajs:
        _check_invariants(tok, t)


async def test_redundant_samples_publish_the_first_n_and_cancel_the_stragglers(tok) -> None:
    """rollout.redundant_samples: n + r episodes start, the group is the first n to finish (in the samples' order),
    and the stragglers are cancelled at once: the group does not wait for them, nor for the episode timeout."""
    behaviours = [
        [_pause(60), answer_text("391")],  # hangs (well past the test's patience)
        [_pause(0.01), answer_text("391")],
        [answer_text("390")],
        [_pause(30), answer_text("391")],  # straggles
        [_pause(0.02), answer_text("391")],
    ]
    loop, engine = _loop(tok, behaviours, tools=[f"{__name__}:PausingTool"], max_turns=3, max_response_tokens=300,
                         max_tool_response_tokens=64, n=3, redundant_samples=2, episode_timeout_s=120)
    t0 = asyncio.get_running_loop().time()
    trajs = await loop.rollout_group(_task(n=3), 3)
    assert asyncio.get_running_loop().time() - t0 < 5
    assert [t.num_turns for t in trajs] == [2, 1, 2]  # samples 1, 2, 4, in order
    assert [t.reward for t in trajs] == [1.0, 0.0, 1.0]
    assert loop.spares_cancelled == 2
    first_turns = [tok.encode(_pause(s), add_special_tokens=False) + [tok.eos_token_id] for s in (60, 30)]
    assert loop.spare_tokens_discarded == sum(map(len, first_turns))  # their first turns, the tool calls
    for t in trajs:
        _check_invariants(tok, t)


def test_redundant_samples_are_refused_for_the_openai_loop() -> None:
    with pytest.raises(ValueError, match="redundant_samples"):
        RolloutConfig(agent_loop="openai", openai=OpenAIAgentConfig(function="pkg.mod:fn"), redundant_samples=1)
    with pytest.raises(ValueError, match="redundant_samples"):
        RolloutConfig(redundant_samples=-1)


async def test_group_samples_take_one_engine_call_a_turn_each(tok) -> None:
    behaviours = [
        [answer_text("390")],  # answers at once, wrongly
        [tool_call_text("17*23"), answer_text("391")],  # one call, then the answer
        [tool_call_text("17 * 23"), tool_call_text("391*1"), answer_text("391")],  # two calls
    ]
    loop, engine = _loop(tok, behaviours, max_turns=3)
    trajs = await loop.rollout_group(_task(n=3), 3)
    # One call per sample and turn (the engine batches the calls that wait together).
    assert [c[0] for c in engine.calls] == [1] * 6
    assert sorted((i, turn) for i, turn, _ in engine.log) == [(0, 0), (1, 0), (1, 1), (2, 0), (2, 1), (2, 2)]
    assert [t.reward for t in trajs] == [0.0, 1.0, 1.0]
    assert [t.num_turns for t in trajs] == [1, 2, 3]
    assert [t.num_tool_calls for t in trajs] == [0, 1, 2]
    assert all(t.finish_reason == "stop" for t in trajs)
    assert [m.content for m in trajs[2].messages if m.role == "tool"] == ["391", "391"]
    for t in trajs:
        _check_invariants(tok, t)
    assert trajs[2].sample_meta("k").max_version >= 2


async def test_single_turn_loop_generates_once(tok) -> None:
    loop, engine = _loop(tok, [[answer_text("391")], [tool_call_text("17*23")]], agent_loop="single_turn")
    trajs = await loop.rollout_group(_task(n=2), 2)
    assert [c[0] for c in engine.calls] == [1, 1]
    assert [t.reward for t in trajs] == [1.0, 0.0]
    assert all(t.num_turns == 1 and t.num_tool_calls == 0 and t.finish_reason == "stop" for t in trajs)
    for t in trajs:
        _check_invariants(tok, t)


def test_bad_tool_path_is_a_config_error() -> None:
    from rlbus.schemas.errors import ConfigError

    with pytest.raises(ConfigError, match="rollout.tools.*cannot import module 'no_such_pkg.tools'"):
        load_tools(["calculator", "no_such_pkg.tools:SEARCH"])
    with pytest.raises(ConfigError, match="neither a built-in name"):
        load_tools(["abacus"])
    with pytest.raises(ConfigError, match="two tools are named 'calculator'"):
        load_tools(["calculator", "calculator"])
    with pytest.raises(ConfigError, match="is not a tool"):
        load_tools([f"{__name__}:_task"])
