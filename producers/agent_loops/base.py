"""What an agent loop produces (`Trajectory`) and the shared machinery of every loop (`AgentLoop`).

An agent loop turns one `PromptTask` into a GRPO group of n trajectories. The n samples run together: each turn,
one `engine.generate` call covers every sample still active, so a batched engine sees n sequences at once instead
of n calls of one. Per token, a trajectory records

    response_ids       every token after the prompt: the model's turns and the tokens the environment inserted
    response_mask      1 where the model generated the token (its closing <|im_end|> included), 0 where the
                       environment inserted it (tool responses, turn headers): only mask-1 tokens enter the loss
    rollout_log_probs  behaviour log-prob of each generated token; exactly 0.0 where the mask is 0
    versions           weight version that generated each token (weights may change between turns); -1 where
                       the mask is 0

and prompt_ids + response_ids is the chat template's tokenization of the conversation up to the model's last
<|im_end|> (the template's newline after it is never generated, so it is not there) -- provided the model's own
tokens are the canonical encoding of its text, which the loop cannot and must not change.

    .venv/bin/python -m pytest -q tests/unit/test_agent_loop.py
"""

from __future__ import annotations

import abc
import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Mapping

from rlbus.common.chat import as_dicts, prompt_token_ids
from rlbus.producers.engines.base import Generation, RolloutEngine, SamplingParams
from rlbus.producers.rewards.registry import RewardFn
from rlbus.producers.tools.registry import Tool
from rlbus.schemas.config import RolloutConfig, RunConfig
from rlbus.schemas.staleness import generated_span
from rlbus.schemas.wire import ChatMessage, PromptTask, SampleMeta

if TYPE_CHECKING:
    import torch

FinishReason = Literal["stop", "length", "max_turns"]


@dataclass
class Trajectory:
    """One sample of a group: tokens, masks, behaviour log-probs, versions, reward and what happened."""

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    reward: float = 0.0
    num_tool_calls: int = 0
    num_turns: int = 0
    finish_reason: FinishReason | None = None  # None while the episode is still running
    messages: list[ChatMessage] = field(default_factory=list)
    gen_time_s: float = 0.0
    tool_time_s: float = 0.0
    reward_time_s: float = 0.0

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def add_generated(self, token_ids: list[int], log_probs: list[float], versions: list[int]) -> None:
        """Tokens the model sampled, each with its log-prob and the weight version that sampled it."""
        if not len(token_ids) == len(log_probs) == len(versions):
            raise ValueError(f"{len(token_ids)} tokens, {len(log_probs)} log-probs, {len(versions)} versions")
        self.response_ids += token_ids
        self.response_mask += [1] * len(token_ids)
        self.log_probs += log_probs
        self.versions += versions

    def add_inserted(self, token_ids: list[int]) -> None:
        """Tokens the environment put in the context (tool output, turn headers): mask 0, log-prob 0, version -1."""
        self.response_ids += token_ids
        self.response_mask += [0] * len(token_ids)
        self.log_probs += [0.0] * len(token_ids)
        self.versions += [-1] * len(token_ids)

    def tensors(self) -> dict[str, "torch.Tensor"]:
        """1-D tensors, as the TransferQueue stores them."""
        import torch

        return {
            "prompt_ids": torch.tensor(self.prompt_ids, dtype=torch.long),
            "response_ids": torch.tensor(self.response_ids, dtype=torch.long),
            "response_mask": torch.tensor(self.response_mask, dtype=torch.long),
            "rollout_log_probs": torch.tensor(self.log_probs, dtype=torch.float32),
            "versions": torch.tensor(self.versions, dtype=torch.long),
        }

    def sample_meta(self, key: str) -> SampleMeta:
        oldest, newest = generated_span(self.versions, self.response_mask)
        return SampleMeta(
            key=key,
            prompt_len=len(self.prompt_ids),
            response_len=len(self.response_ids),
            reward=self.reward,
            num_tool_calls=self.num_tool_calls,
            num_turns=self.num_turns,
            finish_reason=self.finish_reason or "stop",
            min_version=oldest,
            max_version=newest,
            gen_time_s=self.gen_time_s,
            tool_time_s=self.tool_time_s,
            reward_time_s=self.reward_time_s,
        )


class AgentLoop(abc.ABC):
    """Rolls out prompt tasks on one engine. Subclasses define the turn structure in `rollout_group`."""

    cfg: RolloutConfig
    engine: RolloutEngine
    tokenizer: Any  # a transformers tokenizer with the run's chat template
    tools: Mapping[str, Tool]
    reward_fn: RewardFn
    stop_token_id: int
    seed: int | None  # None: the engine's own random stream; else call k samples with seed + k (reproducible)
    _num_calls: int

    def __init__(self, cfg: RolloutConfig, engine: RolloutEngine, tokenizer: Any, tools: Mapping[str, Tool],
                 reward_fn: RewardFn, *, seed: int | None = None):
        if tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer has no eos token: an assistant turn could never stop")
        self.cfg = cfg
        self.engine = engine
        self.tokenizer = tokenizer
        self.tools = dict(tools)
        self.reward_fn = reward_fn
        self.stop_token_id = int(tokenizer.eos_token_id)
        self.seed = seed
        self._num_calls = 0

    @abc.abstractmethod
    async def rollout_group(self, task: PromptTask, n: int) -> list[Trajectory]:
        """Roll out `task` n times together and score every trajectory."""

    # -- shared steps -------------------------------------------------------------------------------------------

    def render(self, messages: list[ChatMessage], *, add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            as_dicts(messages), add_generation_prompt=add_generation_prompt, tokenize=False
        )

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, token_ids: list[int]) -> str:
        # Special tokens are kept: the tool and answer tags are special tokens of the quickstart tokenizer.
        return self.tokenizer.decode(token_ids, skip_special_tokens=False)

    async def rollout_many(self, tasks: list[PromptTask], n: int) -> list[list[Trajectory]]:
        """A group for each task (the evaluator's held-out set); loops that can batch across tasks override it."""
        return [await self.rollout_group(task, n) for task in tasks]

    def start(self, task: PromptTask, n: int) -> list[Trajectory]:
        prompt_ids = prompt_token_ids(self.tokenizer, task.prompt)
        return [Trajectory(prompt_ids=list(prompt_ids), messages=list(task.prompt)) for _ in range(n)]

    def sampling_params(self, max_new_tokens: int) -> SamplingParams:
        self._num_calls += 1
        return SamplingParams(
            seed=None if self.seed is None else self.seed + self._num_calls,
            temperature=self.cfg.temperature,
            top_p=self.cfg.top_p,
            top_k=self.cfg.top_k,
            max_new_tokens=max_new_tokens,
            stop_token_ids=(self.stop_token_id,),
        )

    async def generate_turn(self, active: list[Trajectory]) -> list[str]:
        """One batched generate call over `active`; appends each sample's tokens and returns each turn's text.

        A sample whose turn is cut off (by max_new_tokens, or by what is left of max_response_tokens) finishes
        with "length"; the others are left running for the subclass to decide.
        """
        budgets = [self.cfg.max_response_tokens - len(t.response_ids) for t in active]
        # One call for all: ask for the largest budget any sample has, then cut each to its own.
        params = self.sampling_params(min(self.cfg.max_new_tokens, max(budgets)))
        t0 = time.perf_counter()
        gens: list[Generation] = await self.engine.generate([t.prompt_ids + t.response_ids for t in active], params)
        elapsed = time.perf_counter() - t0
        if len(gens) != len(active):
            raise RuntimeError(f"engine returned {len(gens)} generations for {len(active)} prompts")
        texts = []
        for traj, gen, budget in zip(active, gens, budgets):
            ids, lps = list(gen.token_ids[:budget]), list(gen.log_probs[:budget])
            traj.add_generated(ids, lps, gen.versions()[:budget])
            traj.gen_time_s += elapsed
            traj.num_turns += 1
            stopped = gen.finish_reason == "stop" and bool(ids) and ids[-1] == self.stop_token_id
            body = ids[:-1] if stopped else ids
            text = self.decode(body)
            traj.messages.append(ChatMessage(role="assistant", content=text))
            if not stopped:
                traj.finish_reason = "length"
            texts.append(text)
        return texts

    async def score(self, task: PromptTask, trajs: list[Trajectory]) -> None:
        """Reward every trajectory (concurrently: a reward may be an async call to a verifier)."""

        async def one(traj: Trajectory) -> None:
            t0 = time.perf_counter()
            traj.reward = await self.reward_fn(self.decode(traj.response_ids), task.ground_truth, task=task)
            traj.reward_time_s = time.perf_counter() - t0

        await asyncio.gather(*(one(t) for t in trajs))


def make_agent_loop(cfg: RunConfig, engine: RolloutEngine, tokenizer: Any, tools: Mapping[str, Tool],
                    reward_fn: RewardFn, *, seed: int | None = None) -> AgentLoop:
    """The agent loop `rollout.agent_loop` names."""
    if cfg.rollout.agent_loop == "single_turn":
        from rlbus.producers.agent_loops.single_turn import SingleTurnAgentLoop

        return SingleTurnAgentLoop(cfg.rollout, engine, tokenizer, tools, reward_fn, seed=seed)
    from rlbus.producers.agent_loops.tool import ToolAgentLoop

    return ToolAgentLoop(cfg.rollout, engine, tokenizer, tools, reward_fn, seed=seed)
