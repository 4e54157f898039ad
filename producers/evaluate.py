"""Measure what the warm start is for: does the quickstart model leave RL something to learn, and can it learn it?

Samples the model on fresh arithmetic questions at the rollout temperature, running the calculator itself (int ops on
the parsed operands, no eval) and reports:
- tool_rate: how often the first turn calls the tool (should be about half);
- tool_ok: of those, the call is well-formed JSON naming `calculator` with the question's expression AND the final
  answer copies the tool result (should be >= 0.9: RL can then reach >= 0.85 by always calling);
- direct_mul_acc / direct_add_acc: direct answers that are right (multiplication should be mostly wrong);
- reward: share of questions answered right (the initial mean reward of RL, about 0.4-0.6).

    .venv/bin/python -m rlbus.producers.evaluate MODEL_DIR [--num 256]
"""

from __future__ import annotations

import argparse
import json
import random
import sys

import msgspec
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from rlbus.common.chat import ANSWER_END, ANSWER_START, TOOL_CALL_END, TOOL_CALL_START, encode_chat
from rlbus.common.model.demos import arithmetic_problem, evaluate_expression, prompt_messages, question_expression
from rlbus.common.model.tokenizer import generation_prompt, render_message
from rlbus.producers.engines.base import SamplingParams
from rlbus.producers.engines.hf import sample


class WarmStartEval(msgspec.Struct, kw_only=True):
    num_questions: int
    tool_rate: float
    tool_ok: float  # well-formed call and the answer copies the tool result, among tool-choosing questions
    direct_mul_acc: float  # correct direct answers among direct multiplications (nan when none)
    direct_add_acc: float
    reward: float  # correct final answers, all questions


def _between(text: str, start: str, end: str) -> str | None:
    head, sep, rest = text.partition(start)
    if not sep:
        return None
    inner, sep, _ = rest.partition(end)
    return inner if sep else None


def _tool_result(call_text: str) -> tuple[str, str | None]:
    """(tool output, the expression called or None when the call is malformed)."""
    try:
        call = json.loads(call_text)
        expression = call["arguments"]["expression"]
        if call["name"] != "calculator" or not isinstance(expression, str):
            return "error: unknown tool or bad arguments", None
    except (json.JSONDecodeError, KeyError, TypeError):
        return "error: malformed tool call", None
    value = evaluate_expression(expression)
    return (str(value) if value is not None else "error: unsupported expression"), expression


def _ratio(num: int, den: int) -> float:
    return num / den if den else float("nan")


@torch.no_grad()
def evaluate_tool_use(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    *,
    num_questions: int = 256,
    seed: int = 1234,
    temperature: float = 1.0,
    batch_size: int = 64,
    max_new_tokens: int = 48,
) -> WarmStartEval:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    problems = [arithmetic_problem(rng) for _ in range(num_questions)]
    params = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens, stop_token_ids=(tokenizer.eos_token_id,))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    n_tool = n_tool_ok = n_correct = 0
    direct = {"*": [0, 0], "+": [0, 0]}  # op -> [correct, total]
    for start in range(0, num_questions, batch_size):
        chunk = problems[start : start + batch_size]
        prompts = [encode_chat(tokenizer, prompt_messages(q), add_generation_prompt=True) for q, _ in chunk]
        first = [tokenizer.decode(g.token_ids) for g in sample(model, prompts, params, pad_token_id=pad, generator=gen)]
        # Second turn for those that called the tool: prompt + call + tool result + generation prompt.
        followups: list[tuple[int, list[int], str | None]] = []
        for i, ((question, truth), text) in enumerate(zip(chunk, first)):
            call = _between(text, TOOL_CALL_START, TOOL_CALL_END)
            if text.startswith(TOOL_CALL_START):
                n_tool += 1
                output, expression = _tool_result(call or "")
                ids = prompts[i] + tokenizer.encode(text, add_special_tokens=False)
                ids += tokenizer.encode("\n" + render_message("tool", output) + generation_prompt(), add_special_tokens=False)
                ok_call = expression == question_expression(question) and output == truth
                followups.append((i, ids, output if ok_call else None))
            else:
                answer = _between(text, ANSWER_START, ANSWER_END)
                op = "*" if "*" in question else "+"
                direct[op][1] += 1
                if answer == truth:
                    direct[op][0] += 1
                    n_correct += 1
        if followups:
            seconds = sample(model, [ids for _, ids, _ in followups], params, pad_token_id=pad, generator=gen)
            for (i, _, expected), g in zip(followups, seconds):
                answer = _between(tokenizer.decode(g.token_ids), ANSWER_START, ANSWER_END)
                if answer == chunk[i][1]:
                    n_correct += 1
                if expected is not None and answer == expected:
                    n_tool_ok += 1
    return WarmStartEval(
        num_questions=num_questions,
        tool_rate=n_tool / num_questions,
        tool_ok=_ratio(n_tool_ok, n_tool),
        direct_mul_acc=_ratio(*direct["*"]),
        direct_add_acc=_ratio(*direct["+"]),
        reward=n_correct / num_questions,
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rlbus.producers.evaluate", description=__doc__.splitlines()[0])
    ap.add_argument("model_dir")
    ap.add_argument("--num", type=int, default=256, help="questions to sample")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--temperature", type=float, default=1.0)
    args = ap.parse_args(argv)
    tok = AutoTokenizer.from_pretrained(args.model_dir)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32).eval()
    result = evaluate_tool_use(model, tok, num_questions=args.num, seed=args.seed, temperature=args.temperature)
    print(json.dumps(msgspec.to_builtins(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
