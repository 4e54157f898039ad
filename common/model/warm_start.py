"""The supervised warm start of the quickstart model: a short pass over fresh synthetic demonstrations.

Loss only on what the model itself would write (assistant contents and their closing `<|im_end|>`); prompts, chat
markers and tool results are context. Sequences are laid out exactly as the agent loop builds them at rollout time:
prompt ids (with the generation prompt), then the assistant's ids, then the tool turn and the next generation
prompt, ... so the warm-started model sees at rollout the token boundaries it was trained on.

The build ends with a check of what it is for (`tool_copy_check`: does the model copy the question's expression
into its call and the tool's result into its answer?); whether those copies form within the schedule depends on the
CPU's float kernels, so a build that falls short trains again on another demonstration stream.

Run by `rlbus init-model OUT_DIR` (common/model/init_model.py); on its own:
`.venv/bin/python -m rlbus.common.model.warm_start` (trains a fresh model and prints the loss curve).
"""

from __future__ import annotations

import copy
import math
import random
import time
from typing import Callable

import msgspec
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rlbus.common.model.demos import Message, answer_text, arithmetic_problem, demonstration, tool_call_text
from rlbus.common.model.tokenizer import IM_END, generation_prompt, render_message
from rlbus.common.threads import refresh


class WarmStartConfig(msgspec.Struct, kw_only=True, frozen=True):
    # The copies form abruptly, and where depends on the demonstration stream and on the CPU that trains (its float
    # kernels). On an AMD EPYC, a schedule of 1000 steps ended at tool_ok 0.979 for seed 0 and 0.966 for seed 1, while
    # seed 2 never learned to copy the question's operator (tool_ok 0.47), the failure the check below retries; 1200
    # and 1800 steps ended at 0.977 and 0.990 for seed 0. (Before the build's attention and loss were made cheaper, at
    # 1200 steps an Intel Xeon's model reached 0.96 and its quickstart runs ended 0.915 on average against 0.978 from
    # 1800 steps: docs/benchmarks-history.md, "Quickstart on another CPU".) No step count is past every such edge on
    # every CPU: the check below is what makes the build dependable.
    steps: int = 1000  # optimizer steps (each on a fresh batch of demonstrations)
    batch_size: int = 16
    lr: float = 1e-2  # high for a transformer, fine for one of 0.12M parameters
    warmup_steps: int = 30
    min_lr_ratio: float = 0.05  # cosine floor
    weight_decay: float = 0.01
    tool_fraction: float = 0.5  # share of demonstrations that call the calculator
    drill_batch_size: int = 32  # copy drills per step (0 = none); see copy_drill
    seed: int = 0
    log_every: int = 50
    # The build's acceptance check (tool_copy_check): the expected tool_ok the trained model must reach, 0 = none.
    # Whether the copy forms at all is chaotic in the CPU's float kernels: on one AMD EPYC, seed 0's 1800 steps
    # never learned to copy the question's operator into the call (it guessed * or + at 50/50; tool_ok 0.45) while
    # 2400 and 3000 steps learned it by step 600. A build that falls short is trained again from the same initial
    # weights on another demonstration stream, up to `max_attempts` times; the best attempt is kept.
    check_target: float = 0.95
    max_attempts: int = 6
    check_every: int = 0  # also log the check every N steps (0 = only at the end): where a copy forms, or not

    def __post_init__(self) -> None:
        if not 0 <= self.check_target <= 1:
            raise ValueError(f"check_target: a probability in [0, 1] (0 = no check), got {self.check_target}")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts: must be >= 1, got {self.max_attempts}")
        if not self.lr > 0:
            raise ValueError(f"lr: must be > 0, got {self.lr}")
        if self.check_every < 0:
            raise ValueError(f"check_every: must be >= 0, got {self.check_every}")


#: Share of copy drills that copy a tool result into an answer (the harder copy; the rest copy a tool call).
ANSWER_DRILL_FRACTION = 0.75


def _encoder(tokenizer: PreTrainedTokenizerBase) -> Callable[[str], list[int]]:
    """`tokenizer.encode(text, add_special_tokens=False)`; straight through the Rust tokenizer of a fast one (the same
    ids, without the wrapper's per-call work, which was most of the cost of making a batch)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return lambda text: tokenizer.encode(text, add_special_tokens=False)
    return lambda text: backend.encode(text, add_special_tokens=False).ids


def encode_demonstration(tokenizer: PreTrainedTokenizerBase, messages: list[Message]) -> tuple[list[int], list[int]]:
    """(token ids, loss mask) of a conversation, segmented as the agent loop builds it; mask 1 on assistant output."""
    encode = _encoder(tokenizer)
    ids: list[int] = []
    mask: list[int] = []
    context = ""  # text not written by the model, flushed before each assistant turn
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            context += render_message(m["role"], m["content"])
            continue
        context += generation_prompt()
        ctx_ids = encode(context)
        out_ids = encode(m["content"] + IM_END)
        ids += ctx_ids + out_ids
        mask += [0] * len(ctx_ids) + [1] * len(out_ids)
        context = "\n"  # the newline that closes the assistant turn is added by the loop, not generated
    return ids, mask


def copy_drill(rng: random.Random) -> list[Message]:
    """A short conversation whose only lesson is copying digits: a tool result into an answer (most drills), or a
    question's expression into a tool call.

    Demonstrations alone teach the format quickly but the copy only after many steps; these short, dense drills make
    it reliable within the warm start. Digits are only ten tokens and a result often repeats one ("3660"), so "copy
    what followed this digit last time" is ambiguous: the copy must go by position. The drills keep the tokens
    between tool result and answer exactly as at rollout time and the results 2-4 digits long, like the quickstart's
    sums and products, so the distance to copy from is the one the model meets later. They carry no system prompt
    and no tool *choice*, so they leave the tool-use rate of the quickstart prompt alone.
    """
    def digits(lo: int, hi: int) -> str:
        return "".join(rng.choice("0123456789") for _ in range(rng.randint(lo, hi))).lstrip("0") or "0"

    if rng.random() < ANSWER_DRILL_FRACTION:
        result = digits(2, 4)
        return [
            {"role": "tool", "content": result},
            {"role": "assistant", "content": answer_text(result)},
        ]
    expression = f"{digits(1, 3)}{rng.choice('*+')}{digits(1, 3)}"
    return [
        {"role": "user", "content": f"What is {expression}?"},
        {"role": "assistant", "content": tool_call_text(expression)},
    ]


def _segments(mask: list[int]) -> list[tuple[int, int]]:
    """[start, end) of each run of 1s in a loss mask: the assistant turns of an encoded conversation."""
    runs, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


def _pad_batch(seqs: list[tuple[list[int], list[int]]], pad: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-pad (ids, mask) pairs into (input_ids_BT, attention_mask_BT, labels_BT); labels -100 off-mask."""
    max_len = max(len(ids) for ids, _ in seqs)
    ids_rows = [ids + [pad] * (max_len - len(ids)) for ids, _ in seqs]
    mask_rows = [mask + [0] * (max_len - len(mask)) for _, mask in seqs]
    input_ids_BT = torch.tensor(ids_rows, dtype=torch.long)
    attn_BT = torch.tensor([[1] * len(ids) + [0] * (max_len - len(ids)) for ids, _ in seqs], dtype=torch.long)
    labels_BT = torch.where(torch.tensor(mask_rows, dtype=torch.bool), input_ids_BT, -100)
    return input_ids_BT, attn_BT, labels_BT


def drill_batch(tokenizer: PreTrainedTokenizerBase, rng: random.Random, batch_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return _pad_batch([encode_demonstration(tokenizer, copy_drill(rng)) for _ in range(batch_size)], pad)


def demo_batch(
    tokenizer: PreTrainedTokenizerBase, rng: random.Random, batch_size: int, tool_fraction: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids_BT, attention_mask_BT, labels_BT) of fresh demonstrations, right-padded; labels -100 off-mask."""
    seqs = []
    for _ in range(batch_size):
        question, answer = arithmetic_problem(rng)
        seqs.append(encode_demonstration(tokenizer, demonstration(question, answer, use_tool=rng.random() < tool_fraction)))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return _pad_batch(seqs, pad)


def _lr_factor(step: int, cfg: WarmStartConfig) -> float:
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def _loss(model: PreTrainedModel, batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Next-token cross-entropy averaged over the supervised tokens of the batch. Logits are computed at those
    positions alone: about a fifth of a batch's, and the output layer is the model's widest."""
    input_ids_BT, attn_BT, labels_BT = batch
    hidden_BTH = model.base_model(input_ids=input_ids_BT, attention_mask=attn_BT).last_hidden_state
    target_BT = labels_BT[:, 1:]
    supervised_BT = target_BT != -100
    logits_NV = model.get_output_embeddings()(hidden_BTH[:, :-1][supervised_BT]).float()
    return torch.nn.functional.cross_entropy(logits_NV, target_BT[supervised_BT])


class ToolCopyCheck(msgspec.Struct, kw_only=True, frozen=True):
    """What the warm start is for, measured without sampling: on held-out calculator conversations, the model's own
    probability (temperature 1) of writing each turn exactly as demonstrated."""

    call: float  # of writing the question's call, once it has begun the call (its first token is the tool choice)
    answer: float  # of answering with the tool's result
    tool_ok: float  # of both in one conversation: the tool_ok that sampling (producers/evaluate.py) expects


#: Seed of the check's questions (not one the demonstration streams use) and how many.
CHECK_SEED = 7_000_003
CHECK_QUESTIONS = 256


@torch.no_grad()
def tool_copy_check(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, *, num: int = CHECK_QUESTIONS, seed: int = CHECK_SEED
) -> ToolCopyCheck:
    """Teacher-forced check of the two copies a calculator conversation needs: the question's expression into the
    call and the tool's result into the answer. Deterministic, one forward pass, so its value does not hinge on a
    sampling draw (256 sampled conversations put about +-3% of noise on tool_ok)."""
    rng = random.Random(seed)
    seqs, spans = [], []
    for _ in range(num):
        question, answer = arithmetic_problem(rng)
        ids, mask = encode_demonstration(tokenizer, demonstration(question, answer, use_tool=True))
        (call_start, call_end), (answer_start, answer_end) = _segments(mask)
        seqs.append((ids, mask))
        spans.append(((call_start + 1, call_end), (answer_start, answer_end)))  # the call's first token: the choice
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    input_ids_BT, attn_BT, _ = _pad_batch(seqs, pad)
    was_training = model.training
    model.eval()
    logits_BTV = model(input_ids=input_ids_BT, attention_mask=attn_BT).logits.float()
    model.train(was_training)
    # logprob_BT[b, t]: log p(token t | tokens < t); column 0 has no prediction.
    logprob_BT = torch.log_softmax(logits_BTV[:, :-1], dim=-1).gather(-1, input_ids_BT[:, 1:, None]).squeeze(-1)
    logprob_BT = torch.nn.functional.pad(logprob_BT, (1, 0))
    call_B = torch.stack([logprob_BT[b, s:e].sum() for b, ((s, e), _) in enumerate(spans)])
    answer_B = torch.stack([logprob_BT[b, s:e].sum() for b, (_, (s, e)) in enumerate(spans)])
    return ToolCopyCheck(call=call_B.exp().mean().item(), answer=answer_B.exp().mean().item(),
                         tool_ok=(call_B + answer_B).exp().mean().item())


class WarmStartResult(msgspec.Struct, kw_only=True):
    losses: list[float]  # per step, of the attempt kept
    checks: list[ToolCopyCheck]  # one per attempt (empty without a check)
    kept: int  # the attempt whose weights the model holds (0-based)
    passed: bool  # the kept attempt reached cfg.check_target (True without a check)


def _stream_seed(seed: int, attempt: int) -> int:
    """The demonstration stream of an attempt: the first is cfg.seed's own, so a build that passes first time is the
    one an unchecked warm start makes."""
    return seed + 1_000_003 * attempt


def warm_start(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    cfg: WarmStartConfig = WarmStartConfig(),
    *,
    log: Callable[[str], None] = print,
) -> WarmStartResult:
    """Train `model` in place on `cfg.steps` batches of demonstrations, then check it (`tool_copy_check`); a model
    below `cfg.check_target` is trained again from its initial weights on another demonstration stream, up to
    `cfg.max_attempts` attempts, and the best attempt is kept."""
    if not cfg.check_target:
        return WarmStartResult(losses=_train(model, tokenizer, cfg, random.Random(cfg.seed), log), checks=[], kept=0,
                               passed=True)
    initial = copy.deepcopy(model.state_dict())
    checks: list[ToolCopyCheck] = []
    best: tuple[int, list[float], dict[str, torch.Tensor]] | None = None
    for attempt in range(cfg.max_attempts):
        if attempt:
            model.load_state_dict(initial)
        losses = _train(model, tokenizer, cfg, random.Random(_stream_seed(cfg.seed, attempt)), log)
        checks.append(check := tool_copy_check(model, tokenizer))
        log(f"warm start check (attempt {attempt + 1}): call {check.call:.3f}, answer {check.answer:.3f}, "
            f"tool_ok {check.tool_ok:.3f} (target {cfg.check_target})")
        if best is None or check.tool_ok > checks[best[0]].tool_ok:
            best = (attempt, losses, copy.deepcopy(model.state_dict()))
        if check.tool_ok >= cfg.check_target:
            return WarmStartResult(losses=losses, checks=checks, kept=attempt, passed=True)
        if attempt + 1 < cfg.max_attempts:
            log("warm start: below target; training again from the initial weights on another demonstration stream")
    kept, losses, state = best
    model.load_state_dict(state)
    model.eval()
    log(f"warning: no warm-start attempt reached tool_ok {cfg.check_target}; keeping attempt {kept + 1} "
        f"(tool_ok {checks[kept].tool_ok:.3f}): RL starts from a model that miscopies")
    return WarmStartResult(losses=losses, checks=checks, kept=kept, passed=False)


def _train(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    cfg: WarmStartConfig,
    rng: random.Random,
    log: Callable[[str], None],
) -> list[float]:
    """One attempt: `cfg.steps` optimizer steps on batches drawn from `rng`; returns the per-step losses."""
    model.train()
    # Plain attention: at 4 heads of 16 over sequences under 100 tokens, torch's fused CPU kernel (sdpa) costs more
    # than the matrix products it replaces (a step took 49 ms against 61).
    attn_implementation = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.98))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _lr_factor(s, cfg))
        losses: list[float] = []
        start = time.perf_counter()
        for step in range(cfg.steps):
            refresh()  # this build's share of the CPUs, as rlbus processes start and end (common/threads.py)
            opt.zero_grad(set_to_none=True)
            loss = _loss(model, demo_batch(tokenizer, rng, cfg.batch_size, cfg.tool_fraction))
            loss.backward()
            if cfg.drill_batch_size:
                # A separate, short batch (not padded to the demonstrations' length); its loss counts as much again.
                _loss(model, drill_batch(tokenizer, rng, cfg.drill_batch_size)).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            losses.append(loss.item())
            if cfg.log_every and ((step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps):
                recent = losses[-cfg.log_every:]
                log(f"warm start {step + 1}/{cfg.steps}: loss {sum(recent) / len(recent):.4f} "
                    f"({time.perf_counter() - start:.1f}s)")
            if cfg.check_every and (step + 1) % cfg.check_every == 0:
                check = tool_copy_check(model, tokenizer)
                log(f"warm start {step + 1}/{cfg.steps}: check call {check.call:.3f}, answer {check.answer:.3f}, "
                    f"tool_ok {check.tool_ok:.3f}")
    finally:
        model.set_attn_implementation(attn_implementation)
        model.eval()
    return losses


if __name__ == "__main__":
    from rlbus.common.model.tiny import tiny_model
    from rlbus.common.model.tokenizer import build_tokenizer

    torch.set_num_threads(2)
    tok = build_tokenizer()
    warm_start(tiny_model(tok), tok, WarmStartConfig(steps=100, log_every=10))
