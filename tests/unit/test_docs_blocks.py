"""Every fenced code block of README.md and docs/*.md is run or checked here, or says why it is not.

    .venv/bin/python -m pytest -q tests/unit/test_docs_blocks.py

One test per page; the page's blocks run in order in a workspace of their own (a temporary directory, `configs/`
linked in), so a block may use what an earlier one wrote. What each kind of block gets:

- `python`: run as a script there (a subprocess; the workspace is on its path, as a script's own directory is).
- `bash` / `sh` / `shell`: every command checked. `rlbus ...` is parsed by the real CLI (a subcommand that owns its
  flags, by its own parser) and a config it names is loaded with its overrides, so a wrong key fails; `rlbus config
  ...` and `rlbus rollout ...` run for real, the rollout with the config's model swapped for a random-weights one of
  the quickstart's tokenizer (the plumbing is the same; the answers are noise) and with the command's own
  environment (`PYTHONPATH=.`: the `rlbus` command, like this test, does not put the current directory on the
  path). `python -m rlbus.X ...` and `python bench/X.py ...` (or `examples/X.py`) are parsed by that module's
  parser; `make T` needs a target T in the Makefile; `pip install ... '.[E]'` an extra E in pyproject.toml. Any other
  command needs the block marked.
- `yaml`: parsed; a run config fragment (top-level keys that are config sections) is validated as a config.
- `json`: parsed.

Marks, the line before a fence: `<!-- file: PATH -->` writes the block to PATH in the workspace (a `.py` file is
compiled, and run by the commands after it; a `.yaml` config is validated); `<!-- not run: REASON -->` skips it,
for the reason given. A block with neither that this test cannot run fails.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import inspect
import io
import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")
MARK = re.compile(r"^\s*<!--\s*(not run|file):\s*(.*?)\s*-->\s*$")
SHELL = {"bash", "sh", "shell", "console"}
ROLLOUT_TIMEOUT_S = 180


@dataclass
class Block:
    page: str
    line: int  # 1-based line of the opening fence
    lang: str
    text: str
    mark: str = ""  # "not run" / "file" / ""
    arg: str = ""  # the reason, or the path

    def where(self) -> str:
        return f"{self.page}:{self.line} ({self.lang or 'no language'})"


def blocks(path: Path) -> list[Block]:
    """The fenced blocks of a Markdown page, with the mark on the closest non-blank line before each."""
    lines = path.read_text().splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m.groups()
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            j += 1
        body = "\n".join(line[len(indent):] if line.startswith(indent) else line.lstrip() for line in lines[i + 1 : j])
        k = i - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        mark = MARK.match(lines[k]) if k >= 0 else None
        out.append(Block(str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name, i + 1, lang.lower(), body + "\n",
                         mark.group(1) if mark else "", mark.group(2) if mark else ""))
        i = j + 1
    return out


# ---------------------------------------------------------------------------------------------------------------
# shared set-up


@pytest.fixture(scope="module")
def random_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The quickstart's tokenizer and architecture with random weights (a few seconds to build)."""
    from rlbus.common.model.init_model import init_model

    return init_model(tmp_path_factory.mktemp("docs-model") / "tiny", steps=0, check_target=0, num_threads=1,
                      log=lambda *_: None)


def _extras() -> set[str]:
    # The table setup.py makes the project's optional-dependencies from (pyproject.toml says why).
    return set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["rlbus"]["optional-dependencies"])


def _make_targets() -> set[str]:
    return set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), flags=re.M))


class _Parsed(Exception):
    """Raised by the patched parser once a command line parsed: nothing after the parse runs."""


@contextlib.contextmanager
def _parse_only():
    originals = argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_intermixed_args

    def stop(original):
        def parse(self, args=None, namespace=None):
            raise _Parsed(original(self, args, namespace))

        return parse

    argparse.ArgumentParser.parse_args = stop(originals[0])
    argparse.ArgumentParser.parse_intermixed_args = stop(originals[1])
    try:
        yield
    finally:
        argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_intermixed_args = originals


def _parse_with(main, argv: list[str], what: str) -> argparse.Namespace:
    """`main(argv)`'s own parse of argv, and nothing more; a parse error fails with argparse's message."""
    err = io.StringIO()
    with _parse_only(), contextlib.redirect_stderr(err):
        try:
            main(argv)
        except _Parsed as parsed:
            return parsed.args[0]
        except SystemExit as e:
            pytest.fail(f"{what}: refused by its parser (exit {e.code}): {err.getvalue().strip()}")
    pytest.fail(f"{what}: its main() returned without parsing arguments")


def _script_main(relative: str):
    """The `main` of a script of the repository, imported from its file (sys.path as it was, whatever it does)."""
    saved = list(sys.path)
    try:
        spec = importlib.util.spec_from_file_location(f"_docs_{Path(relative).stem}", ROOT / relative)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = saved
    return module.main


def _argv_main(main):
    """A bench script's main as `main(argv)`, whether it takes argv or reads sys.argv."""
    if inspect.signature(main).parameters:
        return main

    def with_argv(argv: list[str]):
        saved = sys.argv
        sys.argv = ["bench", *argv]
        try:
            return main()
        finally:
            sys.argv = saved

    return with_argv


def _config_path(name: str, ws: Path) -> Path | None:
    for base in (ws, ROOT):
        if (base / name).is_file():
            return base / name
    return None


def _check_config(config: str | None, overrides: list[str], ws: Path, what: str) -> None:
    """Load the config with its overrides (a placeholder like CONFIG: the overrides on a minimal config)."""
    from rlbus.schemas.config_io import apply_override, from_dict, load_config, parse_override
    from rlbus.schemas.errors import ConfigError

    try:
        if config is not None and not config.isupper():
            path = _config_path(config, ws)
            assert path is not None, f"{what}: config {config} does not exist"
            load_config(path, overrides)
        else:
            data: dict = {"model": {"path": "MODEL"}}
            for text in overrides:
                apply_override(data, *parse_override(text))
            from_dict(data)
    except ConfigError as e:
        pytest.fail(f"{what}: {e}")


# ---------------------------------------------------------------------------------------------------------------
# commands


def _run_rollout(argv: list[str], env: dict[str, str], ws: Path, model: Path, what: str) -> None:
    extra = [f"model.path={model}", "model.gguf=", "model.init_if_missing=false"]
    full_env = dict(os.environ, OMP_NUM_THREADS="1", **env)
    full_env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{full_env.get('PATH', '')}"
    if "PYTHONPATH" not in env:  # only what the command sets, as in a user's shell
        full_env.pop("PYTHONPATH", None)
    # -P: like the `rlbus` console script, the current directory is not put on the path.
    proc = subprocess.run([sys.executable, "-P", "-m", "rlbus.cli", *argv, *extra], cwd=ws, env=full_env,
                          capture_output=True, text=True, timeout=ROLLOUT_TIMEOUT_S)
    assert proc.returncode == 0, f"{what}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert "rollout summary" in proc.stdout, f"{what}: no summary\n{proc.stdout[-2000:]}"


def _check_rlbus(argv: list[str], env: dict[str, str], ws: Path, model_dir, what: str) -> None:
    from rlbus.cli import main as cli

    assert argv, f"{what}: no subcommand"
    if argv[0] in cli.PASSTHROUGH:
        main = {"init-model": "rlbus.common.model.init_model", "rollout": "rlbus.producers.rollout_dry_run",
                "events": "rlbus.cli.events", "replay": "rlbus.trainer.replay", "schema": "rlbus.cli.schema",
                "ui": "rlbus.cli.ui"}[argv[0]]
        args = _parse_with(importlib.import_module(main).main, argv[1:], what)
        if getattr(args, "overrides", None) is not None:
            _check_config(getattr(args, "config", None) if argv[0] == "rollout" else None, args.overrides, ws, what)
        if argv[0] == "rollout":
            _run_rollout(argv, env, ws, model_dir(), what)
        return
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            args = cli.build_parser().parse_args(argv)
        except SystemExit as e:
            pytest.fail(f"{what}: refused by the rlbus parser (exit {e.code}): {err.getvalue().strip()}")
    if hasattr(args, "config") and args.command != "config":
        _check_config(args.config, args.overrides, ws, what)
    if args.command == "config":  # cheap: run it
        if args.config_command == "show":
            _check_config(args.config, args.overrides, ws, what)
        with contextlib.redirect_stdout(io.StringIO()):
            assert args.func(args) == 0, what


def _check_command(line: str, ws: Path, model_dir) -> str | None:
    """Check one command line; the reason it cannot be checked here, or None when it was."""
    words = shlex.split(line, comments=True)
    if "|" in words:  # `rlbus events ... --json | head`: the first command is checked, the filters must be plain
        words, rest = words[: words.index("|")], words[words.index("|") + 1 :]
        if rest[:1] not in (["head"], ["tail"], ["less"], ["grep"], ["jq"]):
            return f"`{line.strip()}` pipes into a command this test cannot check"
    env: dict[str, str] = {}
    while words and re.fullmatch(r"[A-Za-z_]\w*=.*", words[0]):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    if not words:
        return None if env else "an empty command"
    what = f"`{line.strip()}`"
    head = words[0]
    if head == "rlbus":
        _check_rlbus(words[1:], env, ws, model_dir, what)
    elif head == "make":
        missing = set(words[1:]) - _make_targets()
        assert not missing, f"{what}: no Makefile target {sorted(missing)}"
    elif head == "pip" and words[1:2] == ["install"]:
        specs = [w for w in words[2:] if "[" in w]
        assert specs, f"{what}: only extras of this project are checked"
        for spec in specs:
            extras = set(spec.split("[", 1)[1].rstrip("]").split(","))
            assert extras <= _extras(), f"{what}: no extra {sorted(extras - _extras())} in pyproject.toml"
    elif head == "python" and words[1:2] == ["-m"] and words[2].startswith("rlbus."):
        _parse_with(importlib.import_module(words[2]).main, words[3:], what)
    elif head == "python" and re.fullmatch(r"(bench|examples)/\w+\.py", words[1]):
        _parse_with(_argv_main(_script_main(words[1])), words[2:], what)
    else:
        return f"{what} is not a command this test can check"
    return None


def _commands(text: str) -> list[str]:
    return [line for line in text.replace("\\\n", " ").splitlines() if line.strip() and not line.lstrip().startswith("#")]


# ---------------------------------------------------------------------------------------------------------------
# blocks


def _sections() -> set[str]:
    from rlbus.schemas.config import RunConfig

    return {f.name for f in msgspec.structs.fields(RunConfig)}


def _check_yaml(text: str, what: str) -> str | None:
    from rlbus.schemas.config_io import from_dict
    from rlbus.schemas.errors import ConfigError

    data = yaml.safe_load(text)
    if not isinstance(data, dict) or not set(data) & _sections():
        return f"{what} is YAML but no run config"
    unknown = set(data) - _sections()
    assert not unknown, f"{what}: not config sections: {sorted(unknown)}"
    try:
        from_dict({"model": {"path": "MODEL"}} | data)
    except ConfigError as e:
        pytest.fail(f"{what}: {e}")
    return None


def _run_python(path: Path, ws: Path, what: str) -> None:
    proc = subprocess.run([sys.executable, str(path)], cwd=ws, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, f"{what}: exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"


def run_block(b: Block, ws: Path, model_dir) -> str | None:
    """Run or check one block; the reason it cannot be, or None."""
    what = b.where()
    if b.mark == "file":
        target = ws / b.arg
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(b.text)
        if target.suffix == ".py":  # compiled here; the commands after it run it
            compile(b.text, str(target), "exec")
            return None
        if target.suffix in (".yaml", ".yml"):
            return _check_yaml(b.text, what)
        if target.suffix in (".jsonl", ".json", ".txt"):
            return None
        return f"{what}: a file of a kind this test cannot check"
    if b.lang == "python":
        script = ws / f"_block_{b.line}.py"
        script.write_text(b.text)
        _run_python(script, ws, what)
        return None
    if b.lang in SHELL:
        for line in _commands(b.text):
            reason = _check_command(line, ws, model_dir)
            if reason:
                return reason
        return None
    if b.lang in ("yaml", "yml"):
        return _check_yaml(b.text, what)
    if b.lang == "json":
        try:
            json.loads(b.text)
        except json.JSONDecodeError as e:
            pytest.fail(f"{what}: not JSON: {e}")
        return None
    return f"{what}: a block of this kind is not run"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_block_is_run_or_says_why_not(page: Path, tmp_path: Path, request: pytest.FixtureRequest):
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "configs").symlink_to(ROOT / "configs")

    def model_dir() -> Path:
        return request.getfixturevalue("random_model")

    unrun = []
    for b in blocks(page):
        if b.mark == "not run":
            assert b.arg, f"{b.where()}: `<!-- not run: -->` needs its reason"
            continue
        reason = run_block(b, ws, model_dir)
        if reason:
            unrun.append(reason)
    assert not unrun, ("blocks neither run nor marked `<!-- not run: REASON -->`:\n  " + "\n  ".join(unrun))


# ---------------------------------------------------------------------------------------------------------------
# the checker itself


def test_blocks_are_found_with_their_marks(tmp_path: Path):
    page = tmp_path / "page.md"
    page.write_text("text\n\n<!-- not run: needs a GPU -->\n```bash\nrlbus up x\n```\n\n- item\n\n  <!-- file: a.py -->"
                    "\n  ```python\n  x = 1\n  ```\n\n```\nplain\n```\n")
    found = blocks(page)
    assert [(b.lang, b.mark, b.arg, b.text) for b in found] == [
        ("bash", "not run", "needs a GPU", "rlbus up x\n"), ("python", "file", "a.py", "x = 1\n"), ("", "", "", "plain\n")]


def test_a_wrong_command_or_key_fails_and_an_unknown_command_needs_a_mark(tmp_path: Path):
    def none():
        raise AssertionError("no model needed")

    with pytest.raises(pytest.fail.Exception, match="no_such_key"):
        _check_command("rlbus up configs/quickstart.yaml trainer.no_such_key=1", tmp_path, none)
    with pytest.raises(pytest.fail.Exception, match="refused"):
        _check_command("rlbus events RUN_DIR --no-such-flag", tmp_path, none)
    with pytest.raises(pytest.fail.Exception, match="refused"):
        _check_command("rlbus scale runs/quickstart three", tmp_path, none)
    with pytest.raises(AssertionError, match="no Makefile target"):
        _check_command("make no-such-target", tmp_path, none)
    assert _check_command("ray start --head", tmp_path, none) is not None
    assert _check_command("rlbus replay runs/quickstart --from-step 35 trainer.lr=5e-5", tmp_path, none) is None
    assert run_block(Block("p", 1, "text", "a diagram\n"), tmp_path, none) is not None
