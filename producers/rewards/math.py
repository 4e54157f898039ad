"""The built-in `math` reward: extract the final answer from a response and compare it numerically.

Extraction order (the last occurrence wins in each form, since models restate and correct themselves):
`<answer>391</answer>`, else `\\boxed{391}`, else GSM8K's `#### 391`, else no answer (reward 0). Comparison is
numeric and tolerant of thousands separators, spaces, a trailing period, `$`, `%`, "391.0" and simple fractions;
non-numeric ground truths fall back to a normalised string match.

    .venv/bin/python -m pytest -q tests/unit/test_rewards.py
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_GSM8K_RE = re.compile(r"####\s*([^\n<]+)")
_BOXED = "\\boxed{"
#: Relative tolerance of the numeric comparison (391.0000001 == 391; 0.333333 != 1/3 at 1e-6 is deliberate).
REL_TOL = 1e-6
ABS_TOL = 1e-9


def _last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}`, honouring nested braces (`\\boxed{\\frac{1}{2}}`)."""
    start = text.rfind(_BOXED)
    if start < 0:
        return None
    depth, i = 1, start + len(_BOXED)
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None  # unbalanced: the response was cut off inside the box


def extract_answer(text: str) -> str | None:
    """The final answer a response commits to, or None when it gives none."""
    found = _ANSWER_RE.findall(text)
    if found:
        return found[-1].strip()
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    found = _GSM8K_RE.findall(text)
    if found:
        return found[-1].strip()
    return None


def _normalise(text: str) -> str:
    s = text.strip().strip("$").strip()
    s = s.replace(",", "").replace(" ", "").replace("\u00a0", "")
    s = s.removeprefix("\\$").rstrip(".")
    s = re.sub(r"^\\text\{(.*)\}$", r"\1", s)
    return s


def parse_number(text: str) -> float | None:
    """"1,234" -> 1234.0, "391.0" -> 391.0, "3/4" -> 0.75, "\\frac{3}{4}" -> 0.75, "50%" -> 50.0; else None."""
    s = _normalise(text).removesuffix("%")
    frac = re.fullmatch(r"\\d?frac\{(-?\d+)\}\{(-?\d+)\}", s)
    if frac:
        s = f"{frac.group(1)}/{frac.group(2)}"
    if re.fullmatch(r"[-+]?\d+/\d+", s):
        num, den = s.split("/")
        if int(den) == 0:
            return None
        return float(Fraction(int(num), int(den)))
    if not re.fullmatch(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?", s):
        return None
    value = float(s)
    return value if math.isfinite(value) else None


def answers_match(answer: str, ground_truth: str) -> bool:
    a, g = parse_number(answer), parse_number(ground_truth)
    if a is not None and g is not None:
        return math.isclose(a, g, rel_tol=REL_TOL, abs_tol=ABS_TOL)
    return _normalise(answer).lower() == _normalise(ground_truth).lower() != ""


def is_well_formed(response_text: str) -> bool:
    """True when the response ends its reasoning with an `<answer>` tag holding a number (the format we teach)."""
    found = _ANSWER_RE.findall(response_text)
    return bool(found) and parse_number(found[-1]) is not None


def compute_score(response_text: str, ground_truth: str, *, format_reward: float = 0.0) -> float:
    """1.0 for a correct final answer, else 0.0; plus `format_reward` when the answer is well formed."""
    answer = extract_answer(response_text)
    correct = answer is not None and answers_match(answer, ground_truth)
    bonus = format_reward if format_reward and is_well_formed(response_text) else 0.0
    return (1.0 if correct else 0.0) + bonus
