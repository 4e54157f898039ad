"""The TRL side of `bench/agentic.py --arms trl`: TRL's GRPOTrainer on an agentic workload, through TRL's own
tool-calling path, one process, timed.

Run only by the TRL venv's python (`.bench/trl-venv`, made by `bench/peer_trl.py --setup`), which has no rlbus: from
this repository it imports bench/agentic_latency.py and loads rlbus's calculator (producers/tools/calculator.py) and
math reward (producers/rewards/math.py) by path, both standard library only. bench/agentic.py writes SETTINGS (the
run's config as rlbus resolved it, and the prompts file: the run's training prompts as rlbus's feeder loads them)
and sets the latency variables (RLBUS_TOOL_* or RLBUS_ENV_*) as it does for the rlbus arms.

    .bench/trl-venv/bin/python bench/agentic_trl.py SETTINGS.json OUT.json

How TRL 1.16 runs the tool. `GRPOTrainer(tools=[calculator])`: after each generation it parses every completion with
the tokenizer's `response_template` (transformers' response parsing); for each sample with tool calls, one sample
after another, it calls the tool (a synchronous one in the trainer's thread; an async one awaited before the next
sample), appends the tool message's tokens (the chat template's rendering) with mask 0, and generates the next turns
of those samples in one batch, `max_tool_calling_iterations` times at most. Two things TRL needs that the
quickstart's tokenizer lacks, set here without changing the model or any token it sees:

- a response template: TRL ships none for an unknown chat template (`add_response_schema` raises); its Qwen3 template
  (`<tool_call>{json}</tool_call>` after `<|im_start|>assistant\\n`) parses the quickstart model's calls as they are;
- a chat template that renders an assistant message's `tool_calls` (TRL refuses one that drops them,
  `supports_tool_calling`): the shipped template plus `<tool_call>{"name": ..., "arguments": ...}</tool_call>` for
  each call, exactly the text the model writes. The prompts and the tool response render as before (checked at the
  start: same token ids as the shipped template).

B3's environment is TRL's `environment_factory` (experimental in 1.16): one environment per sample, reset with the
row's answer; its `calculator` method is the tool (each call waits the env step's latency, as StragglerEnv's step
does); the turn that ends the episode is stepped by the reward function (the wait, then the math reward's score of
that turn, 0 for a turn still calling the tool). TRL has no episode timeout: a step that hangs waits the run's
rollout.episode_timeout_s and then fails (a tool error the model reads, or reward 0 for the last turn; counted as
`timeouts`), rather than hanging the trainer for an hour. TRL has no redundant samples.

Writes OUT.json after every step (a run stopped at its timeout keeps what it did): the stamps of the process start,
imports and trainer built, and per rlbus-sized step (mini_batches optimizer updates on one generation batch) its
end (time.time()), mean reward and TRL's tool-call metrics; the env steps that timed out.
"""

from __future__ import annotations

import time

T_START = time.time()

import importlib.util  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # for bench.agentic_latency

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402
from trl.chat_template_utils import qwen3_template  # noqa: E402

from bench.agentic_latency import Lognormal, StepLatency  # noqa: E402

T_IMPORTED = time.time()


def _load(name: str, rel: str) -> Any:
    """A standard-library-only module of rlbus, loaded by path (rlbus itself is not installed here)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / rel)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


evaluate = _load("rlbus_calculator", "producers/tools/calculator.py").evaluate
compute_score = _load("rlbus_math_reward", "producers/rewards/math.py").compute_score

#: The shipped template, plus each assistant tool call rendered as the model writes it (json.dumps of {"name",
#: "arguments"} between the tags; transformers' `tojson` keeps json.dumps's separators and key order).
TOOL_CALL_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'tool' -%}"
    "{{- '<|im_start|>user\\n<tool_response>' + (message['content'] or '') + '</tool_response><|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') -}}"
    "{%- if message['tool_calls'] is defined and message['tool_calls'] -%}{%- for call in message['tool_calls'] -%}"
    "{%- set f = call['function'] if call['function'] is defined else call -%}"
    "{{- '<tool_call>{\"name\": ' + (f['name'] | tojson) + ', \"arguments\": ' + (f['arguments'] | tojson)"
    " + '}</tool_call>' -}}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
ASSISTANT = "<|im_start|>assistant\n"


def check_template(tokenizer: Any, prompt: list[dict[str, str]]) -> None:
    """The tool-call template renders the quickstart's prompt, and a calculator exchange, as the shipped one does."""
    call = {"name": "calculator", "arguments": {"expression": "17*23"}}
    shipped = [*prompt, {"role": "assistant", "content": f"<tool_call>{json.dumps(call)}</tool_call>"},
               {"role": "tool", "content": "391"}]
    parsed = [*prompt, {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": call}]},
              {"role": "tool", "name": "calculator", "content": "391"}]
    for old, new in ((prompt, prompt), (shipped, parsed)):
        a = tokenizer.apply_chat_template(old, add_generation_prompt=True, tokenize=False)
        b = tokenizer.apply_chat_template(new, add_generation_prompt=True, tokenize=False,
                                          chat_template=TOOL_CALL_TEMPLATE)
        if a != b:
            raise SystemExit(f"the tool-call chat template renders otherwise than the shipped one:\n{a!r}\n{b!r}")


class Budget:
    """What bounds a tool's output and an env step: max_tool_response_tokens, the episode timeout; counts timeouts."""

    def __init__(self, tokenizer: Any, max_tool_response_tokens: int, episode_timeout_s: float):
        self.tokenizer, self.cap, self.timeout_s = tokenizer, max_tool_response_tokens, episode_timeout_s
        self.timeouts = 0

    def truncate(self, text: str) -> str:
        """rlbus's tool loop cuts a tool response to max_tool_response_tokens; TRL does not, so the tool does."""
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return text if len(ids) <= self.cap else self.tokenizer.decode(ids[:self.cap])

    def wait(self, seconds: float) -> bool:
        """Sleep `seconds`, at most the episode timeout; False when the step hit it (a hang)."""
        if seconds >= self.timeout_s:
            time.sleep(self.timeout_s)
            self.timeouts += 1
            return False
        time.sleep(seconds)
        return True


def remote_calculator(latency: Lognormal, budget: Budget):
    """B1's tool for TRL: the calculator's answer after the lognormal wait (a synchronous function; TRL calls it in
    its own thread, and it would await an async one before the next sample's call all the same)."""

    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression with + - * / // % ** and parentheses.

        Args:
            expression: The expression, e.g. 17*23.
        """
        time.sleep(latency.draw())
        return budget.truncate(evaluate(expression))

    return calculator


def straggler_env(latency: StepLatency, budget: Budget):
    """B3's environment for TRL's environment_factory: StragglerEnv's steps as a tool method and a final step."""

    class StragglerEnv:
        def __init__(self) -> None:
            self.answer = ""

        def reset(self, truth: str = "", **row: Any) -> None:
            self.answer = truth  # the question is the row's prompt already (rlbus put reset's observation there)

        def calculator(self, expression: str) -> str:
            """Evaluate an arithmetic expression with + - * / // % ** and parentheses.

            Args:
                expression: The expression, e.g. 17*23.
            """
            if not budget.wait(latency.draw()):
                raise TimeoutError(f"environment step timed out after {budget.timeout_s:g} s")
            return budget.truncate(evaluate(expression))

        def _final_step(self, turn: str) -> float:
            """The step of the turn that ended the episode: its wait, then the score (0 for a call left unanswered,
            as StragglerEnv pays a calculator call)."""
            if not budget.wait(latency.draw()):
                return 0.0
            if "<tool_call>" in turn and "<answer>" not in turn:
                return 0.0
            return compute_score(turn, self.answer)

    return StragglerEnv


def lr_lambda(s: dict[str, Any]):
    """rlbus's LR schedule (trainer/optim.py lr_factor) over optimizer updates: linear warmup from 1/warmup, then
    constant or cosine down to min_lr_ratio; a step makes mini_batches updates."""
    warmup, total = s["warmup_steps"] * s["mini_batches"], s["steps"] * s["mini_batches"]

    def factor(update: int) -> float:
        if update < warmup:
            return (update + 1) / warmup
        if s["lr_schedule"] == "constant":
            return 1.0
        progress = min(1.0, (update - warmup) / max(1, total - warmup))
        return s["min_lr_ratio"] + (1.0 - s["min_lr_ratio"]) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


class StepStamps(TrainerCallback):
    """Stamps every rlbus-sized step (its mini_batches updates done) and keeps the reward TRL logged for its
    generation batch and TRL's tool metrics; rewrites OUT after each step."""

    def __init__(self, out: Path, mini_batches: int, budget: Budget, head: dict[str, Any]):
        self.out, self.mini_batches, self.budget, self.head = out, mini_batches, budget, head
        self.steps: list[dict[str, Any]] = []
        self.logged: list[dict[str, float]] = []  # one per generation batch

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "reward" in logs:
            self.logged.append({"reward": float(logs["reward"]),
                                "tool_calls": float(logs.get("tools/call_frequency", float("nan"))),
                                "tool_failures": float(logs.get("tools/failure_frequency", float("nan")))})

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % self.mini_batches == 0:
            self.steps.append({"step": state.global_step // self.mini_batches, "t": time.time()})
            self.write()

    def write(self, **extra: Any) -> None:
        steps = [{**s, **g} for s, g in zip(self.steps, self.logged)]
        self.out.write_text(json.dumps({**self.head, "steps": steps, "timeouts": self.budget.timeouts, **extra},
                                       indent=1) + "\n")


def main() -> int:
    settings_path, out_path = map(Path, sys.argv[1:3])
    s = json.loads(settings_path.read_text())
    torch.manual_seed(s["seed"])
    tokenizer = AutoTokenizer.from_pretrained(s["model"])
    model = AutoModelForCausalLM.from_pretrained(s["model"], dtype=torch.float32)
    rows = [json.loads(line) for line in Path(s["prompts"]).read_text().splitlines() if line.strip()]
    check_template(tokenizer, rows[0]["prompt"])
    tokenizer.chat_template = TOOL_CALL_TEMPLATE
    tokenizer.response_template = qwen3_template  # what TRL's add_response_schema sets for Qwen's templates
    budget = Budget(tokenizer, s["max_tool_response_tokens"], s["episode_timeout_s"])

    def last_turn(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=False).rsplit(ASSISTANT, 1)[-1]

    tools, env_factory = [], None
    if s["workload"] == "b1":
        tools = [remote_calculator(Lognormal.from_env("TOOL"), budget)]

        def reward(completion_ids, truth, **kwargs):  # rlbus's math reward on the decoded response, tags kept
            return [compute_score(tokenizer.decode(ids, skip_special_tokens=False), t,
                                  format_reward=s["format_reward"]) for ids, t in zip(completion_ids, truth)]
    elif s["workload"] == "b3":
        env_factory = straggler_env(StepLatency.from_env(), budget)

        def reward(completion_ids, environments, **kwargs):  # the step of each episode's last turn, one by one
            return [env._final_step(last_turn(ids)) for ids, env in zip(completion_ids, environments)]
    else:
        raise SystemExit(f"workload {s['workload']!r}: the TRL side runs b1 and b3")

    batch = s["groups_per_step"] * s["n"]
    config = GRPOConfig(
        output_dir=str(out_path.with_suffix("")) + "-trl-out", seed=s["seed"], data_seed=s["seed"],
        max_steps=s["steps"] * s["mini_batches"], learning_rate=s["lr"], weight_decay=s["weight_decay"],
        adam_beta1=s["betas"][0], adam_beta2=s["betas"][1], max_grad_norm=s["grad_clip"],
        per_device_train_batch_size=batch // s["mini_batches"], steps_per_generation=s["mini_batches"],
        gradient_accumulation_steps=1, num_generations=s["n"], max_completion_length=s["max_response_tokens"],
        generation_kwargs={"max_new_tokens": s["max_new_tokens"]}, max_tool_calling_iterations=s["max_turns"] - 1,
        temperature=s["temperature"], top_p=s["top_p"], top_k=s["top_k"], beta=s["kl_coef"], num_iterations=1,
        epsilon=s["clip_ratio_low"], epsilon_high=s["clip_ratio_high"], loss_type="dapo",
        scale_rewards="group" if s["norm_adv_by_std"] else "none", bf16=False, fp16=False,
        gradient_checkpointing=False, use_cpu=True, logging_steps=1, report_to="none", save_strategy="no",
        disable_tqdm=True, dataloader_num_workers=0, log_completions=False,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=s["lr"], betas=tuple(s["betas"]),
                                  weight_decay=s["weight_decay"])
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(s))
    head = {"t_start": T_START, "t_imported": T_IMPORTED, "pid": os.getpid(), "torch_threads": torch.get_num_threads(),
            "versions": {m: __import__(m).__version__ for m in ("trl", "transformers", "torch")}}
    stamps = StepStamps(out_path, s["mini_batches"], budget, head)
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # environment_factory's warning, said in the docstring
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, processing_class=tokenizer,
                          train_dataset=Dataset.from_list(rows), callbacks=[stamps], tools=tools or None,
                          environment_factory=env_factory, optimizers=(optimizer, scheduler))
    head["t_built"] = time.time()
    trainer.train()
    stamps.write(t_end=time.time())
    return 0


if __name__ == "__main__":
    sys.exit(main())
