"""What an agent loop produces (`Trajectory`) and the shared machinery of every loop (`AgentLoop`).

An agent loop turns one `PromptTask` into a GRPO group of n trajectories. Each sample's episode runs on its own
(generate a turn, call tools or step the environment, score), so no sample waits for another's slow tool, and each
turn is its own engine call: the engine batches the turns that are ready at the same time (the HF engine merges
waiting calls, vLLM batches its requests continuously). Per token, a trajectory records

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
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Mapping

from rlbus.common.chat import as_dicts, prompt_token_ids
from rlbus.producers.engines.base import Generation, RolloutEngine, SamplingParams
from rlbus.producers.inflight import EngineMeter
from rlbus.producers.rewards.registry import RewardFn
from rlbus.producers.tools.registry import Tool
from rlbus.schemas import staleness
from rlbus.schemas.config import RolloutConfig, TrainerConfig
from rlbus.schemas.errors import InfrastructureError, RlbusError
from rlbus.schemas.staleness import NO_VERSION, generated_span
from rlbus.schemas.wire import ChatMessage, PromptTask, SampleMeta

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

#: Times one sample may be restarted for staleness (partial rollout) before it is left to finish as it is (the
#: producer then judges its group as a whole, as without partial rollout): a bound, so no sample restarts forever.
MAX_RESTARTS = 3

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
    restarts: int = 0  # times the sample was begun again because its tokens grew too stale (partial rollout)
    num_prompt_messages: int = -1  # messages of the prompt (restart() keeps them); -1 = all of `messages`
    env_return: float = 0.0  # rewards an environment paid along the episode (gym: the sum of step rewards)

    def __post_init__(self) -> None:
        if self.num_prompt_messages < 0:
            self.num_prompt_messages = len(self.messages)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def oldest_version(self) -> int:
        """Version of the oldest generated token (NO_VERSION before the first)."""
        return generated_span(self.versions, self.response_mask)[0]

    def restart(self) -> int:
        """Back to the prompt: every token after it is dropped (the stale ones are the first generated, and all
        later turns were conditioned on them). Returns how many generated tokens were dropped."""
        dropped = sum(self.response_mask)
        self.response_ids, self.response_mask, self.log_probs, self.versions = [], [], [], []
        self.messages = self.messages[:self.num_prompt_messages]
        self.num_tool_calls = self.num_turns = 0
        self.env_return = 0.0
        self.finish_reason = None
        self.restarts += 1
        return dropped

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


class EpisodeTimeout(RlbusError):
    """A group's episodes ran past rollout.episode_timeout_s: the task fails (given back, or dead-lettered)."""


def failure_kind(error: BaseException) -> str:
    """Whose failure a failed rollout is: "infrastructure" (a tool's service, a sandbox or a judge that failed its
    retries, or episodes that ran past rollout.episode_timeout_s: retried, never trained as a reward) or
    "environment" (the environment, its reward or its agent raised or gave bad output). What the policy does wrong
    never fails a rollout: it is scored."""
    return "infrastructure" if isinstance(error, (InfrastructureError, EpisodeTimeout)) else "environment"


class ChatTemplateError(RlbusError):
    """The tokenizer's chat template cannot be extended turn by turn (rendering is not prefix-stable)."""


class StalenessWatch:
    """The trainer's version as a producer hears it, for partial rollouts (`rollout.partial_rollout`).

    A sample whose oldest generated token the staleness bound (schemas/staleness.py) no longer admits at the
    trainer's version would make its whole group be dropped. With a watch, the agent loop restarts just that sample
    from its prompt, on the newest weights, as soon as it is known: when a turn begins, when a new version arrives
    while the sample's turn is in flight (on an engine whose loads reach requests in flight: the engine aborts the
    request), and, for samples that finished early, when the version arrives. The rest of the group goes on, and a
    turn in flight on an engine
    that loads weights between decode steps (vLLM) simply continues on the new weights from its prefix.
    """

    cfg: TrainerConfig
    version: int  # the newest version whose weights the producer has loaded
    bound: int | None  # the staleness bound in force, as the trainer announced it (None: trainer.max_staleness)
    samples_restarted: int
    tokens_discarded: int  # generated tokens dropped by restarts (a turn cut short counts where the engine says)
    _changed: asyncio.Event

    def __init__(self, cfg: TrainerConfig, version: int = 0):
        self.cfg = cfg
        self.version = version
        self.bound = None
        self.samples_restarted = self.tokens_discarded = 0
        self._changed = asyncio.Event()

    def advance(self, version: int) -> None:
        """A new version is loaded: wake every turn in flight to re-judge its sample."""
        if version != self.version:
            self.version = version
            changed, self._changed = self._changed, asyncio.Event()
            changed.set()

    async def changed(self) -> None:
        await self._changed.wait()

    def too_stale(self, traj: Trajectory, in_flight_since: int = NO_VERSION) -> bool:
        """Whether `traj` (with a turn in flight since version `in_flight_since`, if any) should restart."""
        if traj.restarts >= MAX_RESTARTS:
            return False
        oldest = staleness.oldest((traj.oldest_version, in_flight_since))
        return staleness.too_stale(self.version, oldest, self.cfg, self.bound)

    def restart(self, traj: Trajectory, why: str) -> None:
        oldest = traj.oldest_version
        dropped = traj.restart()
        self.samples_restarted += 1
        self.tokens_discarded += dropped
        log.info("partial rollout: sample restarted (%s): %d generated token(s) from v%d dropped, trainer at v%d",
                 why, dropped, oldest, self.version)


class AgentLoop(abc.ABC):
    """Rolls out prompt tasks on one engine. Subclasses define one episode's turn structure in `_episode`."""

    cfg: RolloutConfig
    engine: RolloutEngine
    tokenizer: Any  # a transformers tokenizer with the run's chat template
    tools: Mapping[str, Tool]
    reward_fn: RewardFn
    stop_token_id: int
    seed: int | None  # None: the engine's own random stream; else call k samples with seed + k (reproducible)
    staleness: StalenessWatch | None  # set by a producer under rollout.partial_rollout; None: no restarts
    meter: EngineMeter  # how much of the time the engine had a turn to work on
    spares_cancelled: int  # episodes cancelled because their group had its n (rollout.redundant_samples)
    spare_tokens_discarded: int  # the tokens those episodes had generated
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
        self.staleness = None
        self.meter = EngineMeter()
        self.spares_cancelled = self.spare_tokens_discarded = 0
        self._num_calls = 0

    async def close(self) -> None:
        """Release what the loop holds besides the engine (the openai loop's endpoint)."""

    async def rollout_group(self, task: PromptTask, n: int) -> list[Trajectory]:
        """Roll out `task` n times together and score every trajectory, within rollout.episode_timeout_s.

        With `rollout.redundant_samples` r > 0, n + r episodes start and the group is the first n to finish: the r
        slowest are cancelled (their tokens never trained), so a group no longer waits for a straggling or hung
        environment unless more than r of its episodes straggle. The price is r more episodes' generation, and a
        bias towards short episodes wherever an episode's duration depends on what the policy does (long answers,
        many tool calls): meant for environments and services that straggle on their own."""
        rollout = self.rollout_many([task], n, spare=self.cfg.redundant_samples)
        try:
            return (await asyncio.wait_for(rollout, self.cfg.episode_timeout_s))[0]
        except asyncio.TimeoutError:
            raise EpisodeTimeout(f"the episodes did not end within rollout.episode_timeout_s="
                                 f"{self.cfg.episode_timeout_s:g}s (a hung environment, tool or reward?)") from None

    async def rollout_many(self, tasks: list[PromptTask], n: int, *, spare: int = 0) -> list[list[Trajectory]]:
        """A group for each task (the evaluator's held-out set, a producer's task): every sample's episode runs on
        its own, and the engine batches the turns that are ready together. With `spare`, each group starts n +
        spare episodes and is the first n to finish."""
        groups = [self.start(task, n + spare) for task in tasks]
        return list(await asyncio.gather(*(self.run_episodes(task, g, keep=n) for task, g in zip(tasks, groups))))

    def _cancelled_spares(self, trajs: list[Trajectory], kept: list[Trajectory]) -> None:
        kept_ids = {id(t) for t in kept}
        cut = [t for t in trajs if id(t) not in kept_ids]
        self.spares_cancelled += len(cut)
        self.spare_tokens_discarded += sum(sum(t.response_mask) for t in cut)

    @abc.abstractmethod
    async def _episode(self, traj: Trajectory) -> None:
        """Run one sample to its end (the loop's turn structure), through `generate_turn`."""

    async def _episode_scored(self, task: PromptTask, traj: Trajectory) -> None:
        await self._episode(traj)
        await self.score_one(task, traj)

    async def run_episodes(self, task: PromptTask, trajs: list[Trajectory], keep: int | None = None
                           ) -> list[Trajectory]:
        """Each sample's episode on its own: generate, call tools or step the environment, score; no sample waits
        for another's tool call, environment step or reward. The engine batches whatever turns are ready at once
        (across samples, groups and tasks). The group is done when its last episode is, or, given `keep`, when
        `keep` episodes have finished: the others are cancelled. Returns the finished trajectories, in `trajs`' order.

        Under partial rollout a sample that finished, and that a newer version has since made too stale, begins
        again from its prompt as soon as that version is known, beside the group's stragglers, until every sample
        is fresh enough or out of restarts."""
        watch = self.staleness
        keep = len(trajs) if keep is None else keep
        running: dict[asyncio.Future, Trajectory] = {
            asyncio.ensure_future(self._episode_scored(task, t)): t for t in trajs}
        changed = asyncio.ensure_future(watch.changed()) if watch is not None else None
        finished: list[Trajectory] = []  # in the order they finished
        try:
            while len(finished) < keep:
                waiting = [*running] if changed is None else [*running, changed]
                done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                for future in done - {changed}:
                    finished.append(running.pop(future))
                    future.result()  # an engine, environment or infrastructure failure ends the group
                if watch is None:
                    continue
                if changed.done():
                    changed = asyncio.ensure_future(watch.changed())
                for traj in list(finished):
                    if watch.too_stale(traj):
                        watch.restart(traj, "finished early")
                        finished.remove(traj)
                        running[asyncio.ensure_future(self._episode_scored(task, traj))] = traj
            order = {id(t): i for i, t in enumerate(trajs)}
            kept = sorted(finished[:keep], key=lambda t: order[id(t)])
            if len(kept) < len(trajs):
                self._cancelled_spares(trajs, kept)
            return kept
        finally:
            rest = [*running] + ([changed] if changed is not None else [])
            for future in rest:
                future.cancel()
            await asyncio.gather(*rest, return_exceptions=True)

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

    async def generate_turn(self, traj: Trajectory) -> str:
        """One turn of `traj`: appends its tokens and returns the turn's text.

        Its own engine call, asking for what is left of the sample's budget; the engine merges it with the other
        turns ready at the same time. With a staleness watch (partial rollout), a sample the bound no longer admits
        restarts from its prompt first, and on an engine that loads weights between decode steps a version that
        arrives mid-turn can interrupt it (`_fresh_turn`). A turn cut off (by max_new_tokens, or by what is left of
        max_response_tokens) finishes the sample with "length"; otherwise the subclass decides.
        """
        watch = self.staleness
        if watch is not None and watch.too_stale(traj):
            watch.restart(traj, "stale at a turn's start")
        if watch is not None and self.engine.updates_in_flight:
            gen, elapsed = await self._fresh_turn(traj, watch)
        else:
            budget = self.cfg.max_response_tokens - len(traj.response_ids)
            params = self.sampling_params(min(self.cfg.max_new_tokens, budget))
            t0 = time.perf_counter()
            gens = await self._generate([traj.prompt_ids + traj.response_ids], params)
            if len(gens) != 1:
                raise RuntimeError(f"engine returned {len(gens)} generations for 1 prompt")
            gen, elapsed = gens[0], time.perf_counter() - t0
        budget = self.cfg.max_response_tokens - len(traj.response_ids)  # after any restart
        return self._take_turn(traj, gen, budget, elapsed)

    async def _generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        """engine.generate, metered (the producer sizes its tasks in flight from the engine's idle time)."""
        self.meter.begin()
        try:
            return await self.engine.generate(prompts, params)
        finally:
            self.meter.end()

    async def _fresh_turn(self, traj: Trajectory, watch: StalenessWatch) -> tuple[Generation, float]:
        """One sample's turn as its own engine call, interrupted (the engine aborts it) and begun again from the
        prompt on the newest weights if a version arrives that makes the sample too stale meanwhile."""
        while True:
            budget = self.cfg.max_response_tokens - len(traj.response_ids)
            params = self.sampling_params(min(self.cfg.max_new_tokens, budget))
            since = self.engine.version  # the turn's first token is of this version (or newer)
            t0 = time.perf_counter()
            call = asyncio.ensure_future(self._generate([traj.prompt_ids + traj.response_ids], params))
            try:
                while not call.done():
                    changed = asyncio.ensure_future(watch.changed())
                    await asyncio.wait([call, changed], return_when=asyncio.FIRST_COMPLETED)
                    changed.cancel()
                    if not call.done() and watch.too_stale(traj, since):
                        break
                else:
                    return call.result()[0], time.perf_counter() - t0
            finally:
                if not call.done():
                    call.cancel()
                    await asyncio.gather(call, return_exceptions=True)
            traj.gen_time_s += time.perf_counter() - t0
            watch.restart(traj, "interrupted in flight")

    def _take_turn(self, traj: Trajectory, gen: Generation, budget: int, elapsed: float) -> str:
        """Append one turn's generation (cut to the sample's budget) to `traj`; returns the turn's text."""
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
        return text

    def inserted_ids(self, messages: list[ChatMessage], new: list[ChatMessage]) -> list[int]:
        """Token ids the template puts between the model's closing eos and the next assistant turn's content, when
        the environment answers with `new` (tool responses, an observation): what gets inserted with mask 0."""
        before = self.render(messages, add_generation_prompt=False)
        after = self.render(messages + new, add_generation_prompt=True)
        if not after.startswith(before):
            raise ChatTemplateError(
                f"the chat template renders earlier turns differently once a {new[0].role} message follows; "
                "multi-turn rollouts need a prefix-stable template"
            )
        eos = self.tokenizer.eos_token
        end = before.rfind(eos)
        if end < 0:
            raise ChatTemplateError(f"the chat template does not end assistant turns with eos {eos!r}")
        # What the template writes after the eos the model generated (ChatML: "\n") is inserted too.
        return self.encode(before[end + len(eos):] + after[len(before):])

    async def score_one(self, task: PromptTask, traj: Trajectory) -> None:
        """Reward one finished trajectory (a reward may be an async call to a verifier or a judge)."""
        t0 = time.perf_counter()
        traj.reward = await self.reward_fn(self.decode(traj.response_ids), task.ground_truth, task=task)
        traj.reward_time_s = time.perf_counter() - t0
