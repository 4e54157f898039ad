"""Checks every rollout engine's tests share: the trainer's log-probs of a generation, and stop-token semantics."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def one_torch_thread():
    """torch on one thread for a test module (the CPU is shared with other test runs); a module takes it with
    `pytestmark = pytest.mark.usefixtures("one_torch_thread")` after importing it."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def teacher_forced_logprobs(model, prompt: list[int], tokens: list[int], temperature: float = 1.0) -> torch.Tensor:
    """log_softmax(logits / temperature)[token] of each of `tokens` after `prompt`: what the trainer computes."""
    with torch.no_grad():
        logits_TV = model(input_ids=torch.tensor([prompt + tokens])).logits[0].float()
    logp_TV = torch.log_softmax(logits_TV / temperature, dim=-1)
    return logp_TV[len(prompt) - 1 : -1].gather(-1, torch.tensor(tokens).unsqueeze(-1)).squeeze(-1)


def assert_cut_at_first_stop(free, stopped, stop_id: int) -> None:
    """Each generation made with `stop_id` is the one made without it, ended just after its first `stop_id`."""
    for a, b in zip(free, stopped):
        if stop_id in a.token_ids:
            cut = a.token_ids.index(stop_id) + 1
            assert b.token_ids == a.token_ids[:cut] and b.finish_reason == "stop"
        else:
            assert b.token_ids == a.token_ids and b.finish_reason == "length"
