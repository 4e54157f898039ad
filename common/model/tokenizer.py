"""The quickstart tokenizer: a small byte-level BPE built offline with `tokenizers`, plus its ChatML chat template.

No tokenizer can be downloaded here, so `rlbus init-model` builds one. Choices, and why:

- byte-level: every string encodes and decodes back exactly (`decode(encode(x)) == x`), whatever its characters;
- digits are split one per token before BPE sees them, so "17*23" is `1 7 * 2 3` and arithmetic can generalise
  across numbers instead of memorising multi-digit tokens;
- the pipeline is exactly Qwen2's (NFC, Qwen2's pre-split regex, byte-level BPE): transformers 5 loads any
  directory whose config says `model_type: qwen2` with its own `Qwen2Tokenizer`, which rebuilds that pipeline
  around our vocabulary and merges whatever tokenizer.json says; matching it keeps the tokenizer the same however it
  is loaded (transformers 4 or 5, vLLM). Qwen2's regex also puts every digit in its own piece;
- a small BPE (vocab < 512) trained on the synthetic demonstrations, so the words of the prompts and of the tool-call
  JSON cost few tokens;
- the chat markers and tool tags are added (special) tokens: each is exactly one id and never merged into text.

Built and saved by `rlbus init-model OUT_DIR` (common/model/init_model.py); loaded with
`AutoTokenizer.from_pretrained(OUT_DIR)`. Try it: `.venv/bin/python -m rlbus.common.model.tokenizer`.
"""

from __future__ import annotations

from typing import Iterable

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from rlbus.common.chat import (
    ANSWER_END,
    ANSWER_START,
    TOOL_CALL_END,
    TOOL_CALL_START,
    TOOL_RESPONSE_END,
    TOOL_RESPONSE_START,
)
from rlbus.common.model.chatml import (  # noqa: F401 - the chat format, re-exported with the tokenizer it belongs to
    CHAT_TEMPLATE,
    ENDOFTEXT,
    IM_END,
    IM_START,
    generation_prompt,
    render_chat,
    render_message,
)

#: Control tokens (never produced by BPE merges): ids 0.. in this order.
CONTROL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
#: Tags the model writes or reads inside a turn; single ids as well.
TAG_TOKENS = (TOOL_CALL_START, TOOL_CALL_END, TOOL_RESPONSE_START, TOOL_RESPONSE_END, ANSWER_START, ANSWER_END)
SPECIAL_TOKENS = CONTROL_TOKENS + TAG_TOKENS

#: Qwen2's pre-tokenizer split (transformers' Qwen2Tokenizer uses this exact pattern).
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

#: Upper bound of the vocabulary (256 byte symbols + 9 special tokens + BPE merges).
VOCAB_SIZE = 448

def _default_corpus() -> list[str]:
    from rlbus.common.model.demos import demonstration_corpus  # lazy: building demonstrations is work

    return demonstration_corpus(num_examples=512, seed=0)


def build_tokenizer(corpus: Iterable[str] | None = None, *, vocab_size: int = VOCAB_SIZE) -> PreTrainedTokenizerFast:
    """Train the byte-level BPE on `corpus` (default: the synthetic demonstrations) and wrap it for transformers.

    Deterministic: the same corpus gives the same vocabulary and merges (no randomness, ties broken by the trainer
    in a fixed order).
    """
    if vocab_size >= 512:
        raise ValueError(f"vocab_size: must be < 512 for the quickstart tokenizer, got {vocab_size}")
    texts = list(_default_corpus() if corpus is None else corpus)

    tok = Tokenizer(models.BPE())
    # Qwen2's pipeline (see the module docstring): `\p{N}` alone in the regex makes each digit its own piece, which
    # no merge can cross.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # The special tokens must be known while training so that the corpus's chat markers are not split into bytes.
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.train_from_iterator(texts, trainer=trainer)

    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        unk_token=None,
        additional_special_tokens=list(TAG_TOKENS),
        clean_up_tokenization_spaces=False,  # exact round trip
        model_max_length=4096,
        padding_side="left",  # batched generation pads on the left
    )
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def _demo() -> None:
    tok = build_tokenizer()
    text = render_chat(
        [
            {"role": "user", "content": "What is 17*23?"},
            {"role": "assistant", "content": '<tool_call>{"name": "calculator", "arguments": {"expression": "17*23"}}</tool_call>'},
            {"role": "tool", "content": "391"},
        ],
        add_generation_prompt=True,
    )
    ids = tok.encode(text, add_special_tokens=False)
    print(f"vocab {len(tok)}; {len(ids)} tokens for {len(text)} chars")
    print(" | ".join(tok.convert_ids_to_tokens(ids)))


if __name__ == "__main__":
    _demo()
