"""The `algorithm.distill` section: on-policy distillation from a teacher model (docs/algorithms.md).

The student (the policy being trained) samples as in RL; each producer scores every sampled token with the teacher
(a Hugging Face model directory sharing the student's tokenizer, producers/teacher.py), the scores travel with the
sample, and the trainer turns the per-token reverse KL into the advantage (trainer/algorithms/distill.py):

    A_kl(t)  = -(log pi_behaviour(t) - log pi_teacher(t))      on each generated token, 0 elsewhere
    A(t)     = (1 - weight) * A_env(t) + weight * A_kl(t)       weight 1: pure distillation

    rlbus up configs/distill_smollm2.yaml
    rlbus config show configs/quickstart.yaml algorithm.distill.teacher=runs/quickstart/final_model
"""

from __future__ import annotations

import math
from typing import Any, Literal

import msgspec

from rlbus.schemas.sections import _need, _Section


class DistillConfig(_Section):
    teacher: str = ""  # the teacher's Hugging Face model directory (the student's tokenizer); "" = no distillation
    weight: float = 1.0  # w in A = (1 - w) A_env + w A_kl: 1 = pure distillation, 0 = off (no teacher loaded)
    discount: float = 0.0  # A_kl(t) summed over later tokens with this discount (tinker-cookbook's kl_discount_factor)
    kl_clamp: float = 0.0  # c > 0: each token's reverse KL clamped to [-c, c] (verl's loss_max_clamp); 0 = none
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # the teacher's weights on the producers
    device: str = ""  # torch device of the teacher; "" = the hf engine's device, else cuda when there is one, else cpu
    batch_size: int = 8  # sequences per teacher forward (a group is scored in chunks of this many)

    def __post_init__(self) -> None:
        _need(0.0 <= self.weight <= 1.0 and math.isfinite(self.weight), "weight",
              "must be in [0, 1] (0 = off, 1 = pure distillation)")
        _need(0.0 <= self.discount < 1.0, "discount", "must be in [0, 1) (0 = each token's own reverse KL)")
        _need(self.kl_clamp >= 0 and math.isfinite(self.kl_clamp), "kl_clamp", "must be finite and >= 0 (0 = none)")
        _need(self.batch_size >= 1, "batch_size", "must be >= 1")
        _need(self.weight == 0 or self.weight == 1 or bool(self.teacher), "weight",
              "mixes in a teacher's signal, but algorithm.distill.teacher is empty")
        _need(not self.teacher or self.teacher.strip() == self.teacher, "teacher", "has leading or trailing spaces")

    @property
    def enabled(self) -> bool:
        """Whether producers load the teacher and the trainer mixes its signal in."""
        return bool(self.teacher) and self.weight > 0


def check_distill(distill: DistillConfig, trainer: Any, engine: msgspec.Struct) -> None:
    """Refuse what on-policy distillation cannot be combined with (a ValueError naming the field); `trainer` is the
    run's TrainerConfig, `engine` its rollout.engine."""
    if not distill.enabled:
        return
    if trainer.dynamic_sampling and distill.weight == 1:
        raise ValueError("trainer.dynamic_sampling: it skips groups whose rewards are all equal, but under pure "
                         "distillation (algorithm.distill.weight: 1) every group carries the teacher's signal; "
                         "set dynamic_sampling: false")
    if engine.__struct_config__.tag == "simulated":
        raise ValueError("algorithm.distill.teacher: the simulated engine samples random ids, not the student's "
                         "tokens; a teacher has nothing to score (use rollout.engine.type hf or vllm)")
