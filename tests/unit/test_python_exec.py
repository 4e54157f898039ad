"""The `python` tool on the real sandbox: the model reads what its program printed, or why it failed; a sandbox that
is not there raises InfrastructureError (for the tool runner to retry), never an answer.

    .venv/bin/python -m pytest -q tests/unit/test_python_exec.py
"""

from __future__ import annotations

from pathlib import Path
from typing import AsyncIterator

import pytest

from rlbus.producers.sandbox import Sandbox, SandboxLimits, SandboxResult
from rlbus.producers.tools.python_exec import PythonTool, format_result
from rlbus.producers.tools.registry import load_tool
from rlbus.schemas.errors import InfrastructureError


@pytest.fixture(scope="module")
async def tool() -> AsyncIterator[PythonTool]:
    async with Sandbox(1, limits=SandboxLimits(memory_bytes=256 << 20)) as sandbox:
        yield PythonTool(sandbox, run_timeout_s=1.0)


async def test_the_model_reads_what_its_program_printed(tool: PythonTool) -> None:
    assert await tool({"code": "print(17 * 23)"}) == "391"
    assert await tool({"code": "x = 1"}) == "(no output)"


async def test_a_failing_program_is_an_answer_with_its_traceback(tool: PythonTool) -> None:
    answer = await tool({"code": "print('before')\n[][1]"})
    assert answer.startswith("before\nstderr:\nTraceback (most recent call last):")
    assert "IndexError: list index out of range" in answer
    assert answer.endswith("status: error (exit code 1; the program failed)")
    answer = await tool({"code": "while True:\n    pass"})
    assert answer == "status: timeout (exit code -9; the program was stopped: it ran past its time limit)"
    assert "status: memory" in await tool({"code": "b = bytearray(1 << 30)"})


async def test_bad_arguments_are_an_error_answer(tool: PythonTool) -> None:
    assert (await tool({})).startswith('error: missing argument "code"')
    assert (await tool({"code": 17})).startswith('error: missing argument "code"')


async def test_an_unavailable_sandbox_raises(tmp_path: Path) -> None:
    async with Sandbox(1, bwrap=str(tmp_path / "bwrap")) as sandbox:
        with pytest.raises(InfrastructureError, match="sandbox: no bwrap at"):
            await PythonTool(sandbox)({"code": "print(1)"})


def test_the_tool_loads_by_import_path_with_its_limits() -> None:
    tool = load_tool("rlbus.producers.tools.python_exec:PythonTool")
    assert isinstance(tool, PythonTool) and tool.name == "python"
    assert tool.parameters["required"] == ["code"]
    # What the tool runner reads: calls at once (the shared pool's workers), one attempt's limit, retries.
    assert tool.max_concurrency == 4 and tool.timeout_s > tool.run_timeout_s and tool.retries >= 1


def test_format_result_keeps_output_then_errors_then_status() -> None:
    r = SandboxResult(status="killed", exit_code=-11, stdout="a\n", stderr="b\n", wall_s=0.1)
    assert format_result(r) == "a\nstderr:\nb\nstatus: killed (exit code -11; the program was killed)"
