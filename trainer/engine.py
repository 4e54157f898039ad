"""The FSDP2 train engine: a Hugging Face causal LM, AdamW, an LR schedule, and one RL `train_step` per call.

The trainer service (`trainer/service.py`) owns the loop; this module owns the math of one step on one rank:

    engine = TrainEngine.from_config(cfg, model_path)   # seeded with trainer.seed
    metrics = engine.train_step(batch)       # batch: this rank's share (whole GRPO groups) as a TensorDict [B]
    weights = engine.full_state_dict()       # rank 0: HF-named full tensors on CPU; others: {}

With `algorithm.adv_estimator: gae` the engine also holds the critic (`trainer/critic.py`), whose values, GAE and
update run inside `train_step`; its state is part of `state_dict`. With `critic.backbone: shared` the critic is a
value head on the policy itself (`value_head`): one no-grad pass gives the values and the proximal log-probs, and
each update's forward gives log-probs and values, the value loss joining the policy loss.

With `model.lora` the policy is the base model with a peft adapter injected (trainer/lora.py), only the adapter
trains, `full_state_dict` merges it, and `publish_state_dict` (what a weight version holds) is the adapter alone.

Every rank must call `train_step`, `compute_log_probs` and `full_state_dict` together (they run collectives);
ranks may hold different numbers of sequences: the number of forward/backward passes is agreed by all-reduce and a
rank that runs out does empty passes. Tests: `pytest tests/integration/test_fsdp.py`.
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple

import torch
from tensordict import TensorDict
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from transformers import AutoModelForCausalLM

from rlbus.schemas.config import AlgorithmConfig, CriticConfig, RunConfig, TrainerConfig
from rlbus.schemas.lora import LoraConfig
from rlbus.trainer import algorithms as algo
from rlbus.trainer import batching, logprobs, lora, packing
from rlbus.trainer.batching import update_parts
from rlbus.trainer.critic import (
    VALUE_HEAD,
    Critic,
    SharedValueHead,
    attach_value_head,
    global_normaliser,
    micro_value_loss,
    value_loss_scale,
)
from rlbus.trainer.dist import DistInfo, all_reduce, init_distributed
from rlbus.trainer.logprobs import token_log_probs  # noqa: F401 - its users import it from here
from rlbus.trainer.memory import peak_rss_bytes, reset_peak_rss
from rlbus.trainer.optim import (  # noqa: F401 - lr_factor, make_optimizer: this module's names for their users
    clipped_step,
    load_train_state,
    lr_factor,
    make_optimizer,
    make_scheduler,
    train_state,
)
from rlbus.trainer.parallelize import compute_precision, parallelize
from rlbus.trainer.step_metrics import _Accumulator, correction_metrics

BATCH_KEYS = ("input_ids", "attention_mask", "position_ids", "response_mask", "rollout_log_probs",
              "token_level_rewards", "group_index")  # fmt: skip
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class TrainEngine:
    """One rank's share of the FSDP2-sharded policy (and frozen reference), optimizer and LR schedule."""

    info: DistInfo
    model: nn.Module
    ref_model: nn.Module | None
    optimizer: torch.optim.AdamW
    scheduler: torch.optim.lr_scheduler.LambdaLR
    num_updates: int  # optimizer updates done so far (mini-batches, not steps)
    model_path: str
    logits_chunk_bytes: int  # float32 logits made at once by the chunked output head (trainer/logprobs.py)
    fuse_proximal: bool  # take proximal log-probs from the update's forward when that is the same computation
    correction: algo.CorrectionSpec  # IS weights and rejection between behaviour and proximal (rollout_* fields)
    overlong: algo.OverlongSpec  # DAPO's overlong penalty and truncation mask (algorithm.overlong_*, mask_truncated)
    distill: algo.DistillSpec  # on-policy distillation: the teacher's reverse KL in the advantage (algorithm.distill)
    hidden_size: int  # the model's, for packing's cost model
    critic: Critic | None  # the value model of adv_estimator: gae, critic.backbone: separate (trainer/critic.py)
    value_head: SharedValueHead | None  # the value head on the policy of critic.backbone: shared
    critic_cfg: CriticConfig
    forward_positions: int  # token-positions run by this step's forwards so far

    def __init__(
        self,
        model_path: str,
        trainer_cfg: TrainerConfig,
        algo_cfg: AlgorithmConfig,
        temperature: float,
        *,
        dtype: str = "float32",
        gradient_checkpointing: bool = False,
        critic_cfg: CriticConfig | None = None,
        lora_cfg: LoraConfig | None = None,
        max_response_tokens: int = 0,
    ) -> None:
        self.cfg = trainer_cfg
        self.lora = lora_cfg or LoraConfig()
        self.algo = algo_cfg
        self.temperature = float(temperature)
        self.model_path = model_path
        self.dtype = dtype
        self.logits_chunk_bytes = logprobs.CHUNK_BYTES
        self.fuse_proximal = True
        self.correction = algo.CorrectionSpec.from_config(algo_cfg)
        self.overlong = algo.OverlongSpec.from_config(algo_cfg, max_response_tokens)  # L_max: rollout's budget
        self.distill = algo.DistillSpec.from_config(algo_cfg)
        self.info = init_distributed(trainer_cfg.device)
        self.critic_cfg = critic_cfg or CriticConfig()
        shared = algo_cfg.adv_estimator == "gae" and self.critic_cfg.backbone == "shared"
        torch.manual_seed(trainer_cfg.seed)
        self.model = self._load(model_path, dtype, gradient_checkpointing, value_head=shared, adapter=True)
        self.hidden_size = int(self.model.config.hidden_size)
        self.forward_positions = 0  # token-positions the forwards of this step ran (the metric perf/forward_positions)
        # Rows per recorded rank of the next step's batch (trainer/replay.py, for a run recorded on several ranks);
        # None: the batch is this rank's own.
        self.rank_rows: list[int] | None = None
        # What the last step computed from its batch that the batch cannot give back (the advantages its loss used;
        # GAE's values and returns), [B, T] in the batch's rows: recorded with logging.record=full for the inspector.
        self.computed: dict[str, torch.Tensor] = {}
        self.ref_model = None
        if algo_cfg.kl_coef > 0:
            self.ref_model = self._load(model_path, dtype, False)
            self.ref_model.requires_grad_(False)
        self.value_head = SharedValueHead(self.model, self.critic_cfg, trainer_cfg) if shared else None
        if self.value_head is not None:  # one AdamW, the head its second group (trainer/critic.py says why)
            self.optimizer = make_optimizer(self.value_head.param_groups(), trainer_cfg)
            self.scheduler = self.value_head.make_scheduler(self.optimizer)
        else:
            self.optimizer = make_optimizer([p for p in self.model.parameters() if p.requires_grad], trainer_cfg)
            # The schedule counts optimizer updates; a step makes `mini_batches` of them.
            self.scheduler = make_scheduler(self.optimizer, trainer_cfg, warmup_steps=trainer_cfg.warmup_steps)
        self.num_updates = 0
        self.critic = None
        if algo_cfg.adv_estimator == "gae" and not shared:
            self.critic = Critic(self.critic_cfg.path or model_path, self.critic_cfg, trainer_cfg,
                                 device=self.info.device, world_size=self.info.world_size, dtype=_DTYPES[dtype],
                                 gradient_checkpointing=gradient_checkpointing)  # fmt: skip

    @classmethod
    def from_config(cls, cfg: RunConfig, model_path: str | None = None) -> TrainEngine:
        """The engine of a run: the trainer builds it this way on every rank, and `rlbus replay` rebuilds it so.

        Weights from `model_path` (default `cfg.model.path`); torch is seeded with `trainer.seed` first.
        """
        return cls(model_path or cfg.model.path, cfg.trainer, cfg.algorithm, temperature=cfg.rollout.temperature,
                   dtype=cfg.model.dtype, gradient_checkpointing=cfg.model.gradient_checkpointing,
                   critic_cfg=cfg.critic, lora_cfg=cfg.model.lora,
                   max_response_tokens=cfg.rollout.max_response_tokens)  # fmt: skip

    def _load(self, path: str, dtype: str, gradient_checkpointing: bool, *, value_head: bool = False,
              adapter: bool = False) -> nn.Module:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=_DTYPES[dtype])
        model.config.use_cache = False
        logprobs.install(model)
        if adapter and self.lora.enabled:  # model.lora: the policy trains an adapter (the reference is the base)
            lora.apply_lora(model, self.lora)
        if value_head:  # critic.backbone: shared; before sharding, so that the root unit holds it
            attach_value_head(model)
        return parallelize(
            model,
            device=self.info.device,
            mixed_precision=self.cfg.mixed_precision,
            activation_checkpointing=gradient_checkpointing,
        )

    # -------------------------------------------------------------------------------------------------------------
    # forward passes

    def _forward(
        self,
        model: nn.Module,
        mb: dict[str, torch.Tensor] | None,
        *,
        with_entropy: bool,
        values: bool = False,
        value_grad: bool = True,
    ) -> _Scores:
        """Log-probs [b, T], entropy [b, T] (`with_entropy`), values [b, T] (`values`: the shared value head's V_t)
        and a zero scalar tied to the graph. `mb=None` is an empty pass.

        All are scored at the micro-batch's response positions only (0 elsewhere). The forward runs over the rows
        trimmed to the longest sequence, each group's shared prompt once where that is cheaper (trainer/packing.py).
        The output head runs in chunks inside the model's forward, so no [b, T, V] float32 logits exist
        (trainer/logprobs.py). `value_grad=False`: the values' gradient stops at the hidden states (the zero too).
        """
        device = self.info.device
        if mb is None:  # this rank ran out of sequences; FSDP still needs its all-gathers and reduce-scatters
            # One token, scored as a real pass is, so that its zero reaches the very parameters a real pass's loss
            # does (FSDP reduce-scatters the gradients that exist, and every rank must reduce the same ones).
            ids = torch.zeros(1, 1, dtype=torch.long, device=device)
            inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "position_ids": ids}
            src_N = targets_N = ids[0]
            at = None
        else:
            b, T = mb["input_ids"].shape
            rows_b = mb["pack_row"].cpu() if "pack_row" in mb else None  # micro_batch_tokens: the planned rows
            pack = packing.plan(mb["input_ids"].cpu(), mb["attention_mask"].sum(dim=-1).cpu(),
                                mb["group_index"].cpu(), mb["response_mask"].cpu(), hidden_size=self.hidden_size,
                                share=self.cfg.share_prefix, pack_row_b=rows_b)  # fmt: skip
            self.forward_positions += pack.num_positions
            sel = pack.select
            inputs = {"input_ids": pack.input_ids.to(device), "attention_mask": pack.attention_mask.to(device),
                      "position_ids": pack.position_ids.to(device)}  # fmt: skip
            src_N, targets_N = sel.src_N.to(device), sel.targets_N.to(device)
            at = (sel.dst_rows_N.to(device), sel.dst_pos_N.to(device))
        # Entropy of the distribution that produced token t (logits at t - 1, as for the log-probs); it carries a
        # gradient only when the loss has an entropy bonus.
        grad = with_entropy and self.algo.entropy_coeff > 0 and torch.is_grad_enabled()
        head = getattr(model, VALUE_HEAD) if values else None
        with logprobs.scoring(model, None, self.temperature, with_entropy=with_entropy, entropy_grad=grad,
                              chunk_bytes=self.logits_chunk_bytes, select=(src_N, targets_N), value_head=head,
                              value_grad=value_grad), \
                compute_precision(device, self.cfg.mixed_precision):  # fmt: skip
            # [N, 2 or 3]: (log-prob, entropy[, value]) of the scored positions only (trainer/logprobs.py)
            scores_N = model(**inputs).logits[0]
        zero = (scores_N if value_grad else scores_N[:, 2:]).sum() * 0.0
        if at is None:
            return _Scores(ids.float(), None, ids.float() if values else None, zero)
        put = lambda col: scores_N.new_zeros(b, T).index_put(at, scores_N[:, col])
        return _Scores(put(0), put(1) if with_entropy else None, put(2) if values else None, zero)

    def _micro_batches(self, rows: torch.Tensor,
                       data: dict[str, torch.Tensor] | None = None) -> list[torch.Tensor | None]:
        """Split row indices into micro-batches (by trainer.micro_batch_tokens given the batch's `data`, else by
        micro_batch_size: trainer/batching.py); pad with None to the largest count over all ranks."""
        local = batching.split_rows(rows, self.cfg, data, hidden_size=self.hidden_size)
        (num_global,) = all_reduce([float(len(local))], "max")
        return local + [None] * (int(num_global) - len(local))

    @torch.no_grad()
    def compute_log_probs(self, batch: TensorDict, *, model: nn.Module | None = None) -> torch.Tensor:
        """Log-probs [B, T] of `batch`'s tokens under the current policy (or `model`), micro-batched, no grad."""
        return self._no_grad_scores(self._tensors(batch), model if model is not None else self.model)[0]

    @torch.no_grad()
    def _no_grad_scores(
        self, data: dict[str, torch.Tensor], model: nn.Module, *, values: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(log-probs [B, T], the shared head's values [B, T] or None) of `data` under `model`, micro-batched."""
        logp_BT = torch.zeros(data["input_ids"].shape, dtype=torch.float32, device=self.info.device)
        values_BT = torch.zeros_like(logp_BT) if values else None
        for idx in self._micro_batches(torch.arange(data["input_ids"].shape[0], device=self.info.device), data):
            out = self._forward(model, None if idx is None else self._rows(data, idx), with_entropy=False,
                                values=values)  # fmt: skip
            if idx is not None:
                logp_BT[idx] = out.logp_bT
                if values_BT is not None:
                    values_BT[idx] = out.values_bT
        return logp_BT, values_BT

    def _tensors(self, batch: TensorDict) -> dict[str, torch.Tensor]:
        keys = BATCH_KEYS + self.overlong.batch_keys + self.distill.batch_keys  # consumers/collate.py makes them all
        missing = [k for k in keys if k not in batch.keys()]
        if missing:
            raise KeyError(f"train batch lacks {missing}; it must carry {list(keys)}")
        return {k: batch.get(k).to(self.info.device) for k in keys}

    @staticmethod
    def _rows(data: dict[str, torch.Tensor], idx: torch.Tensor) -> dict[str, torch.Tensor]:
        return {k: v[idx] for k, v in data.items()}

    # -------------------------------------------------------------------------------------------------------------
    # the step

    def train_step(self, batch: TensorDict) -> dict[str, float]:
        """One RL step on this rank's share of the batch; returns the same all-reduced metrics on every rank.

        Every GRPO group must be whole on this rank (advantages use the group's own baseline). The step: proximal
        log-probs (decoupled / none), reference log-probs (kl_coef > 0), KL-in-reward (use_kl_loss=False),
        advantages, the rollout correction (IS weights, rejection), then `mini_batches` optimizer updates, each over
        micro-batches of `micro_batch_size` sequences (or of at most `micro_batch_tokens` token-positions) with the
        loss normalised by whole-update token / sequence counts summed over all ranks.
        """
        t_step = time.perf_counter()
        reset_peak_rss()
        self.forward_positions = 0
        data = self._tensors(batch)
        mask_BT = data["response_mask"].float()
        behaviour_BT = data["rollout_log_probs"].float()
        timing: dict[str, float] = {}

        ref_BT = None
        if self.ref_model is not None:
            t = time.perf_counter()
            ref_BT = self.compute_log_probs(batch, model=self.ref_model)
            timing["timing/ref_s"] = time.perf_counter() - t
        # Proximal log-probs are those of the current weights. With one optimizer update per step every
        # micro-batch of that update runs at exactly those weights, so the update's own forward yields them
        # (detached, filled in per micro-batch below) and the separate pass would recompute the same tensors.
        # Not when something needs all of them before the first forward: the KL penalty in the reward (advantages).
        fused = self._proximal_from_update()
        proximal_BT = values_BT = None
        if self.value_head is not None:
            # The shared critic: one no-grad pass of the policy gives the values for GAE and, being a pass of the
            # current weights, the proximal log-probs.
            t = time.perf_counter()
            logp_BT, values_BT = self._no_grad_scores(data, self.model, values=True)
            proximal_BT = logp_BT if algo.needs_proximal(self.algo.off_policy) else None
            timing["timing/values_s"] = time.perf_counter() - t
        elif fused:
            proximal_BT = torch.zeros_like(behaviour_BT)
        elif algo.needs_proximal(self.algo.off_policy):
            t = time.perf_counter()
            proximal_BT = self.compute_log_probs(batch)
            timing["timing/proximal_s"] = time.perf_counter() - t

        old_BT = algo.old_log_probs_for(self.algo.off_policy, behaviour_BT, proximal_BT)
        # DAPO: the overlong penalty joins the reward; `kept_BT` is the mask less truncated samples (mask_truncated),
        # which leave the loss but keep their place in their group's baseline (the advantages below use mask_BT).
        rewards_BT, kept_BT = algo.shape_rewards(data, mask_BT, self.overlong)
        if ref_BT is not None and not self.algo.use_kl_loss:
            rewards_BT = algo.apply_kl_reward_penalty(
                rewards_BT, old_BT, ref_BT, mask_BT, kl_coef=self.algo.kl_coef, kl_type=self.algo.kl_type
            )
        # Advantages see every response token: a rejected token leaves the loss, not its sequence's score (as in
        # verl, where rejection masks the tokens and GRPO scores the unmasked rewards). Whitening estimators
        # (reinforce_plus_plus*, gae) whiten over the whole batch: their sums are all-reduced over ranks.
        acc = _Accumulator()
        reduce = lambda xs: all_reduce(xs, "sum")
        # The rows of each optimizer update, the critic's and the actor's alike.
        update_rows = update_parts(data["input_ids"].shape[0], self.cfg.mini_batches, self.info.device, self.rank_rows)
        if self.algo.adv_estimator == "gae":
            # GAE: the critic's values of this batch (the shared head's came with the proximal pass), advantages and
            # returns, then the separate critic's update (verl's order: the critic trains on the values the
            # advantages used, before the actor); the shared head's update is the actor's below.
            if self.critic is not None:
                t = time.perf_counter()
                values_BT = self.critic.values(data, self._micro_batches)
                timing["timing/values_s"] = time.perf_counter() - t
            adv_BT, returns_BT = algo.gae_advantages_returns(rewards_BT, values_BT, mask_BT, gamma=self.algo.gamma,
                                                             lam=self.algo.lam, reduce=reduce)  # fmt: skip
            actor_waits = self._actor_waits()
            if self.critic is not None:
                t = time.perf_counter()
                self.critic.update(data, self._micro_batches, update_rows, values_BT, returns_BT, mask_BT, acc)
                timing["timing/critic_update_s"] = time.perf_counter() - t
            sums = algo.ValueSums.of(values_BT, returns_BT, mask_BT).as_list()
            metrics_values = algo.ValueSums(*all_reduce(sums, "sum")).metrics()
        else:
            adv_BT = algo.compute_advantages(
                rewards_BT, mask_BT, data["group_index"], estimator=self.algo.adv_estimator,
                norm_by_std=self.algo.norm_adv_by_std, gamma=self.algo.gamma, reduce=reduce,
            )  # fmt: skip
            returns_BT, actor_waits, metrics_values = None, False, {}
        adv_BT = algo.mix_distill(adv_BT, data, mask_BT, self.distill, acc.add)  # (1 - w) A_env + w A_teacher
        self.computed = {"advantages": adv_BT.detach()}
        if returns_BT is not None:
            self.computed.update(values=values_BT.detach(), returns=returns_BT.detach())
        # The rollout correction between behaviour and proximal log-probs: IS weights and the response mask less
        # rejected tokens (`loss_mask_BT`, which also sets the loss normaliser). Fused: the weights are filled per
        # micro-batch like proximal_BT (they are per row). Bypass has no proximal policy: rejection and the
        # mismatch are measured against the policy being updated, per micro-batch (verl's bypass mode), and the
        # normaliser keeps every token, since the rejected ones are only known during the update.
        corr = None
        if proximal_BT is not None and not fused:
            corr = self._correct(proximal_BT, behaviour_BT, kept_BT)
        weights_BT = corr.weights_BT if corr is not None else None
        if fused and self.correction.is_level is not None:
            weights_BT = torch.zeros_like(behaviour_BT)
        loss_mask_BT = corr.mask_BT if corr is not None else kept_BT
        bypass_sums = algo.MismatchSums()
        # C of seq-mean-token-sum-norm: the configured constant (Dr.GRPO keeps one for the whole run), else the
        # longest response of the step over all ranks, fixed for the step.
        scale = self.algo.loss_scale_factor
        if not scale:
            (scale,) = all_reduce([float(mask_BT.sum(dim=-1).max().item()) if mask_BT.numel() else 1.0], "max")

        t_update = time.perf_counter()
        vh = self.value_head
        # During the critic's warm-up the actor waits: no update, no step of its LR schedule (verl's critic_warmup).
        # The shared head trains then on the value loss alone, the transformer under it untouched (trainer/critic.py).
        waits_alone = actor_waits and vh is None
        parts = [] if waits_alone else update_rows
        vscale = value_loss_scale(self.critic_cfg, mask_BT) if vh is not None else 1.0
        for part in parts:
            norm = global_normaliser(loss_mask_BT[part], scale)
            vnorm = global_normaliser(mask_BT[part], vscale) if vh is not None else None
            self.optimizer.zero_grad(set_to_none=True)
            update_loss = vf_loss = 0.0
            for idx in self._micro_batches(part, data):
                mb = None if idx is None else self._rows(data, idx)
                with lora.dropout_active(self.model, self.lora.dropout > 0):
                    out = self._forward(self.model, mb, with_entropy=not actor_waits, values=vh is not None,
                                        value_grad=not actor_waits)  # fmt: skip
                loss = out.zero
                if idx is not None and not actor_waits:
                    mask_bT = loss_mask_BT[idx]
                    if fused:
                        self._fill_proximal(idx, out.logp_bT.detach(), proximal_BT, weights_BT, behaviour_BT, mask_BT)
                    elif proximal_BT is None:  # bypass
                        c = algo.correct(out.logp_bT.detach(), behaviour_BT[idx], kept_BT[idx], self.correction)
                        bypass_sums, mask_bT = bypass_sums + c.sums, c.mask_BT
                    loss, pg_loss = self._micro_loss(idx, out.logp_bT, out.entropy_bT, old_BT, adv_BT, mask_bT,
                                                     weights_BT, ref_BT, norm, acc)  # fmt: skip
                    update_loss += pg_loss
                if idx is not None and vh is not None:
                    v_loss = micro_value_loss(self.critic_cfg, out.values_bT, returns_BT[idx], values_BT[idx],
                                              mask_BT[idx], vnorm, acc)  # fmt: skip
                    vf_loss += float(v_loss.detach())
                    loss = loss + self.critic_cfg.vf_coef * v_loss  # waiting: `loss` is the zero of the values
                # FSDP averages gradients over ranks; the normaliser is already global, so undo the average.
                (loss * self.info.world_size).backward()
            if not actor_waits:
                acc.add("actor/pg_loss", update_loss, 1.0)
            if vh is not None:
                acc.add("critic/vf_loss", vf_loss, 1.0)
                vh.step(self.optimizer, self.scheduler, acc, actor_waits=actor_waits)
            else:
                acc.add_update("actor", *clipped_step(self.model, self.optimizer, self.scheduler, self.cfg.grad_clip,
                                                      skip_zero=self.cfg.skip_zero_grad_updates))
            self.num_updates += 1
        self.optimizer.zero_grad(set_to_none=True)
        timing["timing/update_s"] = time.perf_counter() - t_update

        if fused and not actor_waits:  # the statistics of the weights the update used, now that all are known
            corr = algo.correct(proximal_BT, behaviour_BT, kept_BT, self.correction)
        acc.add("perf/num_tokens", float(data["attention_mask"].sum().item()), 0.0)
        acc.add("perf/forward_positions", float(self.forward_positions), 0.0)
        metrics = acc.reduce(num_updates=self.cfg.mini_batches)
        metrics.update(metrics_values)
        if actor_waits:
            metrics["actor/waiting"] = 1.0  # the critic's warm-up: the policy did not move this step
        elif corr is not None:
            metrics.update(correction_metrics(corr.sums, corr.values_N, self.correction))
        else:  # bypass: over every micro-batch of every update, token-weighted
            metrics.update(correction_metrics(bypass_sums, None, self.correction))
        timing["timing/step_s"] = time.perf_counter() - t_step
        timing["perf/peak_rss_gb"] = peak_rss_bytes() / 1024**3  # this step's peak, the largest over ranks
        # The intra-op threads the step ran on (rank 0's, the most): `rlbus replay` runs on as many, since CPU matrix
        # products reduce in a thread-dependent order.
        timing["perf/torch_threads"] = float(torch.get_num_threads())
        names = list(timing)
        metrics.update(zip(names, all_reduce([timing[n] for n in names], "max")))
        metrics["perf/tokens_per_s"] = metrics["perf/num_tokens"] / max(metrics["timing/step_s"], 1e-9)
        # the policy's updates (the shared head's warm-up updates moved the head alone)
        metrics["actor/num_updates"] = float(vh.actor_updates(self.num_updates) if vh is not None else self.num_updates)
        return metrics

    def _proximal_from_update(self) -> bool:
        """Whether this step takes its proximal log-probs from the update's forward instead of a separate pass (not
        with the shared critic: its values pass, which every step needs before the update, yields them)."""
        kl_in_reward = self.ref_model is not None and not self.algo.use_kl_loss
        return (self.fuse_proximal and algo.needs_proximal(self.algo.off_policy) and self.cfg.mini_batches == 1
                and not kl_in_reward and not self.correction.needs_whole_batch
                and self.value_head is None and not self.lora.dropout)  # fmt: skip

    def _actor_waits(self) -> bool:
        """verl's critic_warmup: the actor first updates at step critic.critic_warmup (steps count from 1)."""
        if self.value_head is not None:
            return self.value_head.actor_waits(self.num_updates)
        return self.critic_cfg.critic_warmup > self.critic.steps_done + 1

    def _correct(self, proximal_BT: torch.Tensor, behaviour_BT: torch.Tensor, mask_BT: torch.Tensor) -> algo.Correction:
        """The rollout correction of this rank's rows, with batch normalisation by the mean over all ranks."""
        corr = algo.correct(proximal_BT, behaviour_BT, mask_BT, self.correction)
        if self.correction.batch_normalize and corr.weights_BT is not None:
            sums = algo.MismatchSums.from_list(all_reduce(corr.sums.as_list(), "sum"))
            corr.weights_BT = corr.weights_BT / algo.batch_norm_factor(sums, self.correction)
        return corr

    def _fill_proximal(
        self,
        idx: torch.Tensor,
        logp_bT: torch.Tensor,
        proximal_BT: torch.Tensor,
        weights_BT: torch.Tensor | None,
        behaviour_BT: torch.Tensor,
        mask_BT: torch.Tensor,
    ) -> None:
        """Proximal log-probs of one micro-batch from its detached log-probs, and their IS weights (per row)."""
        proximal_BT[idx] = logp_bT
        if weights_BT is not None:
            weights_BT[idx] = algo.importance_weights(logp_bT - behaviour_BT[idx], mask_BT[idx], self.correction)[0]

    def _micro_loss(
        self,
        idx: torch.Tensor,
        logp_bT: torch.Tensor,
        entropy_bT: torch.Tensor | None,
        old_BT: torch.Tensor,
        adv_BT: torch.Tensor,
        mask_bT: torch.Tensor,
        weights_BT: torch.Tensor | None,
        ref_BT: torch.Tensor | None,
        norm: algo.LossNormaliser,
        acc: _Accumulator,
    ) -> tuple[torch.Tensor, float]:
        """The micro-batch's share of the update loss (policy + entropy bonus + KL loss) and its pg-loss value.

        `mask_bT` is the micro-batch's loss mask: the response mask less the tokens rejected by the correction.
        """
        mode = self.algo.loss_agg_mode
        out = algo.policy_loss(
            self.algo.loss_mode, logp_bT, old_BT[idx], adv_BT[idx], mask_bT, norm=norm, agg_mode=mode,
            **algo.policy_loss_kwargs(self.algo), token_weights_BT=None if weights_BT is None else weights_BT[idx],
        )  # fmt: skip
        loss = out.loss
        n = out.num_tokens
        acc.add("actor/clipfrac", out.clipfrac * n, n)
        acc.add("actor/dual_clipfrac", out.dual_clipfrac * n, n)
        acc.add("actor/approx_kl", out.approx_kl * n, n)
        if entropy_bT is not None:
            acc.add("actor/entropy", float((entropy_bT.detach() * mask_bT).sum()), n)
            if self.algo.entropy_coeff > 0:
                loss = loss - self.algo.entropy_coeff * algo.aggregate_loss(entropy_bT, mask_bT, mode, norm)
        if ref_BT is not None:
            kl_bT = algo.kl_estimate(logp_bT, ref_BT[idx], self.algo.kl_type)
            acc.add("actor/kl", float((kl_bT.detach() * mask_bT).sum()), n)
            if self.algo.use_kl_loss:
                loss = loss + self.algo.kl_coef * algo.aggregate_loss(kl_bT, mask_bT, mode, norm)
        return loss, float(out.loss.detach())

    # -------------------------------------------------------------------------------------------------------------
    # weights and state

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full (unsharded) policy parameters and buffers on CPU with Hugging Face names on rank 0; {} on other
        ranks. What producers load: the shared critic's value head is left out (`critic_full_state_dict()`).

        A collective: every rank must call it.
        """
        full = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.lora.enabled:  # the adapter merged into the base weights, under the plain model's names
            return lora.merged_state_dict(full, self.lora.scale) if full else {}
        if self.value_head is None:
            return full
        return {k: v for k, v in full.items() if not k.startswith(f"{VALUE_HEAD}.")}

    def publish_state_dict(self) -> dict[str, torch.Tensor]:
        """What a weight version publishes (rank 0; {} elsewhere): model.lora's adapter alone under `sync: adapter`,
        else the full weights (merged under `sync: merged`). A collective."""
        if self.lora.enabled and self.lora.sync == "adapter":
            return self.adapter_state_dict()
        return self.full_state_dict()

    def adapter_state_dict(self) -> dict[str, torch.Tensor]:
        """model.lora's adapter alone, whole, on CPU on rank 0 ({} elsewhere), in wire names
        (`...q_proj.lora_A.weight`; trainer/lora.py). A collective."""
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
        return lora.adapter_tensors(get_model_state_dict(self.model, options=opts))

    def critic_full_state_dict(self) -> dict[str, torch.Tensor]:
        """The critic's full weights on CPU on rank 0 ({} elsewhere): the separate value model's (Hugging Face names),
        or the shared head's (value_head.weight, value_head.bias). A collective."""
        if self.value_head is not None:
            return self.value_head.full_state_dict()
        if self.critic is None:
            raise ValueError("critic_full_state_dict: this engine has no critic (algorithm.adv_estimator is not gae)")
        return self.critic.full_state_dict()

    @torch.no_grad()
    def compute_values(self, batch: TensorDict) -> torch.Tensor:
        """V_t [B, T] of `batch`'s response tokens (0 elsewhere) under the current critic, as a step's GAE reads
        them. A collective."""
        data = self._tensors(batch)
        if self.value_head is not None:
            return self._no_grad_scores(data, self.model, values=True)[1]
        if self.critic is None:
            raise ValueError("compute_values: this engine has no critic (algorithm.adv_estimator is not gae)")
        return self.critic.values(data, self._micro_batches)

    def state_dict(self) -> dict[str, Any]:
        """Sharded trainer state for torch.distributed.checkpoint: model (with model.lora, the adapter alone: the
        base is model.path's), optimizer, LR schedule, update count, and the same four of the separate critic under
        "critic" (gae; the shared head is part of the model's and the optimizer's)."""
        keep = lora.is_adapter if self.lora.enabled else None
        state = train_state(self.model, self.optimizer, self.scheduler, self.num_updates, keep=keep)
        if self.critic is not None:
            state["critic"] = self.critic.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.num_updates = load_train_state(self.model, self.optimizer, self.scheduler, state,
                                            partial=self.lora.enabled)
        if self.critic is not None:
            self.critic.load_state_dict(state["critic"])


class _Scores(NamedTuple):
    """What one forward of `TrainEngine._forward` scores, each [b, T] at the response positions (0 elsewhere)."""

    logp_bT: torch.Tensor
    entropy_bT: torch.Tensor | None  # with_entropy
    values_bT: torch.Tensor | None  # values: the shared head's V_t
    zero: torch.Tensor  # 0, tied to the graph: an empty pass's loss
