"""The rollout engine interface every backend implements (hf, vllm on CPU or GPU, simulated for benchmarks).

An engine turns a batch of prompt token ids into sampled continuations with the log-prob of each sampled token,
computed as log_softmax(logits / temperature) -- exactly what the trainer recomputes -- and stamps every
generation with the weight version that produced it. `generate` and `load_weights` are serialised by the engine:
a weight load waits for the chunk in flight and the next chunk runs on the new weights (no work is dropped).
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Callable, Literal, Mapping

import msgspec

if TYPE_CHECKING:
    import torch


class SamplingParams(msgspec.Struct, kw_only=True, frozen=True):
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_new_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()  # generation ends after any of these (the stop token is kept)
    seed: int | None = None


class Generation(msgspec.Struct, kw_only=True):
    token_ids: list[int]  # new tokens only, the stop token included when one ended it
    log_probs: list[float]  # one per token in token_ids: log_softmax(logits / temperature)[token]
    finish_reason: Literal["stop", "length"]
    version: int  # weight version that generated the first token (every token, unless token_versions says else)
    # Per-token versions when weights changed inside this generation (an engine that loads weights between decode
    # steps, as vLLM does); empty when one version made every token.
    token_versions: list[int] = []

    def versions(self) -> list[int]:
        """The weight version of every token in token_ids."""
        if self.token_versions:
            return list(self.token_versions)
        return [self.version] * len(self.token_ids)


#: Where an engine reports tokens as it samples them: (index of the prompt in the call, new token ids, their
#: log-probs). Called on the event loop's thread, in order per prompt; the ids of one prompt's calls add up to its
#: Generation's token_ids. Used to stream a reply while it is sampled (producers/endpoint.py).
TokenSink = Callable[[int, list[int], list[float]], None]


class RolloutEngine(abc.ABC):
    """One model replica that generates. Implementations: producers.engines.hf.HFEngine, .vllm.VLLMEngine, ..."""

    @property
    @abc.abstractmethod
    def version(self) -> int:
        """Weight version currently loaded."""

    @abc.abstractmethod
    async def generate(
        self, prompts: list[list[int]], params: SamplingParams, on_tokens: TokenSink | None = None
    ) -> list[Generation]:
        """Sample one continuation per prompt (batched). Never blocks the event loop. `on_tokens`: told of the
        tokens as they are sampled (an engine that samples a call whole tells it once per prompt at the end)."""

    @abc.abstractmethod
    async def load_weights(self, state_dict: Mapping[str, "torch.Tensor"], version: int, *,
                           partial: bool = False) -> None:
        """Load a full state dict (names as in the Hugging Face model) and hold `version` from the next chunk on.
        `partial` (an engine whose `loads_partial` is True): `state_dict` holds some tensors, the rest stay."""

    @property
    def loads_partial(self) -> bool:
        """Whether `load_weights(..., partial=True)` replaces the tensors given and keeps the others."""
        return False

    @property
    def updates_in_flight(self) -> bool:
        """Whether a weight load reaches generations in flight (their later tokens are of the new version), as
        with vLLM; False for an engine that finishes the chunk in flight on the weights it began with."""
        return False

    @property
    def alive(self) -> bool:
        """False once the engine can generate no more (its process died); the producer then stops."""
        return True

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release the engine's resources."""
