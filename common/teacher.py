"""A distillation teacher's contract with its student: the same tokenizer, so that it can score the student's ids.

On-policy distillation (algorithm.distill, docs/algorithms.md) has the teacher score each token id the student
sampled. That means something only if an id is the same piece of text to both: the teacher must tokenize exactly as
the student does. `check_teacher` compares the two tokenizers -- the vocabulary (every token and its id), the
special tokens, and the ids of a probe set of texts, which also catches a normaliser or pre-tokenizer that differs
under the same vocabulary -- and that the teacher's embedding has a row for every id. A mismatch is a ConfigError
naming `algorithm.distill.teacher` and what differs; the config check (`rlbus up`, cli/validate.py) and every
producer that loads the teacher (producers/teacher.py) call it. The chat template may differ: the teacher scores
the ids the student's template made.

    .venv/bin/python -m pytest -q tests/integration/test_distill.py -k tokenizer
"""

from __future__ import annotations

from pathlib import Path

from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerBase

from rlbus.schemas.errors import ConfigError

FIELD = "algorithm.distill.teacher"

#: Texts both tokenizers must encode to the same ids: digits, spacing, punctuation, code, non-ASCII, chat markers.
PROBES = (
    "What is 17*23? Answer: 391",
    "  leading spaces, trailing spaces  \n\n\ttabs and\r\nnewlines",
    "gcd(84, 36) = 12; 3.14159e-2 + 0x1F - 1,000,000",
    'def f(x):\n    return {"a": [1, 2], "b": None}  # comment',
    "naïve café – 東京 – Привет – 🙂",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "<tool_call>{\"name\": \"calculator\", \"arguments\": {\"expr\": \"2+2\"}}</tool_call>",
)


def _sample(names: list[str], k: int = 5) -> str:
    shown = ", ".join(repr(n) for n in names[:k])
    return shown + (f" and {len(names) - k} more" if len(names) > k else "")


def tokenizer_mismatch(student: PreTrainedTokenizerBase, teacher: PreTrainedTokenizerBase) -> str | None:
    """What makes `teacher` read the student's token ids differently, or None when nothing does."""
    sv, tv = student.get_vocab(), teacher.get_vocab()
    if sv != tv:
        only_s, only_t = sorted(set(sv) - set(tv)), sorted(set(tv) - set(sv))
        moved = sorted(t for t in set(sv) & set(tv) if sv[t] != tv[t])
        parts = [f"the vocabularies differ ({len(sv)} tokens in the student's, {len(tv)} in the teacher's)"]
        if only_s:
            parts.append(f"only the student's: {_sample(only_s)}")
        if only_t:
            parts.append(f"only the teacher's: {_sample(only_t)}")
        if moved:
            parts.append(f"other ids: {_sample(moved)}")
        return "; ".join(parts)
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        if getattr(student, name) != getattr(teacher, name):
            return f"{name} differs: {getattr(student, name)!r} (student) vs {getattr(teacher, name)!r} (teacher)"
    if sorted(student.all_special_tokens) != sorted(teacher.all_special_tokens):
        return (f"the special tokens differ: {sorted(student.all_special_tokens)} (student) vs "
                f"{sorted(teacher.all_special_tokens)} (teacher)")  # fmt: skip
    for text in PROBES:
        a, b = student.encode(text, add_special_tokens=False), teacher.encode(text, add_special_tokens=False)
        if a != b:
            return f"{text!r} encodes to {a} (student) but {b} (teacher)"
    return None


def check_teacher(teacher_dir: str | Path, student: PreTrainedTokenizerBase | str | Path | None) -> None:
    """Raise a ConfigError naming algorithm.distill.teacher unless `teacher_dir` is a model directory whose tokenizer
    is the student's (`student`: its tokenizer or the student's model directory; None: a student not built yet,
    whose tokenizer the producers compare once it is) and whose embedding covers it."""
    path = Path(teacher_dir)
    if not (path / "config.json").is_file() or not any(path.glob("*.safetensors")):
        raise ConfigError(FIELD, f"{path} holds no model (config.json + *.safetensors); a teacher is a Hugging Face "
                                 "model directory, e.g. a run's export (RUN_DIR/final_model)")
    try:
        teacher_tok = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ConfigError(FIELD, f"{path} holds no tokenizer the student's ids could be checked against: {e}") from None
    if student is None:
        return
    if not isinstance(student, PreTrainedTokenizerBase):
        student = AutoTokenizer.from_pretrained(student)
    why = tokenizer_mismatch(student, teacher_tok)
    if why is not None:
        raise ConfigError(FIELD, f"the teacher at {path} does not share the student's tokenizer: {why}. A teacher "
                                 "scores the student's token ids, so both must tokenize alike (same family of models)")
    rows = getattr(AutoConfig.from_pretrained(path), "vocab_size", None)
    if rows is not None and rows < len(student):
        raise ConfigError(FIELD, f"the teacher at {path} has {rows} embedding rows for the student's "
                                 f"{len(student)} token ids")


__all__ = ["FIELD", "PROBES", "check_teacher", "tokenizer_mismatch"]
