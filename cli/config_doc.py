"""The config reference as Markdown, generated from schemas/config.py (field, default, the field's comment).

    rlbus config reference            # the table of docs/config.md is this output

Generated, not hand-written, so the docs cannot drift from the code (tests/unit/test_docs.py checks it).
"""

from __future__ import annotations

import inspect
import re

import msgspec

from rlbus.schemas import config as C
from rlbus.schemas import distill as D
from rlbus.schemas import env as E
from rlbus.schemas import judge as J
from rlbus.schemas import lora as L
from rlbus.schemas import sft as S
from rlbus.schemas import tinker as T

_FIELD = re.compile(r"^    (\w+): [^=]+?(?: = (.+?))?\s*(?:#\s*(.*))?$")

SECTIONS = {
    "bus": C.BusConfig, "ray": C.RayConfig, "model": C.ModelConfig, "model.lora": L.LoraConfig, "data": C.DataConfig,
    "rollout": C.RolloutConfig, "rollout.engine (type: hf)": C.HFEngineConfig,
    "rollout.engine (type: vllm)": C.VLLMEngineConfig, "rollout.engine (type: simulated)": C.SimulatedEngineConfig,
    "rollout.openai": C.OpenAIAgentConfig,
    "env (type: data)": E.DataEnvConfig, "env (type: reasoning_gym)": E.ReasoningGymEnvConfig,
    "env.tasks[]": E.ReasoningGymTask, "env (type: verifiers)": E.VerifiersEnvConfig,
    "env (type: gym)": E.GymEnvConfig,
    "algorithm": C.AlgorithmConfig, "algorithm.distill": D.DistillConfig,
    "trainer": C.TrainerConfig, "trainer.weight_sync": L.WeightSyncConfig,
    "trainer.sft": S.SftConfig,
    "critic": C.CriticConfig, "feeder": C.FeederConfig,
    "eval": C.EvalConfig,
    "logging": C.LoggingConfig, "launcher": C.LauncherConfig, "guard": C.GuardConfig, "judge": J.JudgeConfig,
    "tinker": T.TinkerConfig,
}


def _comments(cls: type) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in inspect.getsource(cls).splitlines():
        m = _FIELD.match(line)
        if m and m.group(3):
            out[m.group(1)] = m.group(3).strip()
    return out


def _default(cls: type, field: msgspec.structs.FieldInfo) -> str:
    if field.default is not msgspec.NODEFAULT:
        value = field.default
    elif field.default_factory is not msgspec.NODEFAULT:
        value = field.default_factory()
    else:
        return "(required)"
    if isinstance(value, msgspec.Struct) and value.__struct_config__.tag is None:
        return "(a section)"
    if isinstance(value, msgspec.Struct):
        return f"`{{type: {value.__struct_config__.tag}}}`"
    return f"`{msgspec.json.encode(value).decode()}`"


def reference_markdown() -> str:
    lines = ["| key | default | meaning |", "|---|---|---|", "| `name` | `\"rlbus\"` | run name: the bus "
             "namespace `rlbus.<name>.` and the default run directory `runs/<name>` |"]
    for section, cls in SECTIONS.items():
        notes = _comments(cls)
        prefix = section.split(" ")[0]
        for f in msgspec.structs.fields(cls):
            suffix = section[len(prefix):]
            meaning = notes.get(f.name, "")
            lines.append(f"| `{prefix}.{f.name}`{suffix} | {_default(cls, f)} | {meaning.replace('|', '/')} |")
    return "\n".join(lines) + "\n"
