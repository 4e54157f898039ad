"""The `python` tool: the model's program runs in the code sandbox, and what it printed is the tool's answer.

The model writes `<tool_call>{"name": "python", "arguments": {"code": "print(17 * 23)"}}</tool_call>` and sees "391".
Everything its program does to itself (an exception, an endless loop, a memory hog) comes back as text with the
status, an observation for the model; only a failure of the sandbox itself raises `InfrastructureError`, which the
tool runner retries (`retries`) and then hands to the producer, who gives the task back instead of scoring it.

Name it in a run config by import path: `rollout.tools: [rlbus.producers.tools.python_exec:PythonTool]`. Every
PythonTool of a process shares one sandbox of DEFAULT_WORKERS warm workers (producers/sandbox.py), and the tool
runner allows `max_concurrency` calls at once, as many as the pool has workers.

    .venv/bin/python -m pytest -q tests/unit/test_python_exec.py
"""

from __future__ import annotations

from typing import Any

from rlbus.producers.sandbox import DEFAULT_WORKERS, Sandbox, SandboxResult, shared_sandbox

#: Longest a program may run (seconds of wall clock); past it the model reads "status: timeout".
RUN_TIMEOUT_S = 10.0

_STATUS_NOTES = {
    "error": "the program failed",
    "timeout": "the program was stopped: it ran past its time limit",
    "memory": "the program was stopped: it ran out of memory",
    "killed": "the program was killed",
}


def format_result(result: SandboxResult) -> str:
    """A run as the model reads it: stdout, then stderr (a traceback), then the status unless it is ok."""
    parts = [result.stdout.rstrip("\n")] if result.stdout else []
    if result.stderr:
        parts.append("stderr:\n" + result.stderr.rstrip("\n"))
    if result.status != "ok":
        parts.append(f"status: {result.status} (exit code {result.exit_code}; {_STATUS_NOTES[result.status]})")
    return "\n".join(parts) if parts else "(no output)"


class PythonTool:
    """Runs `arguments["code"]` as a Python program (standard library only, no network, files in its working
    directory only) and answers with its output. Satisfies producers.tools.registry.Tool."""

    name = "python"
    description = ("Run a Python program (standard library only; no network; files only in its working directory) "
                   "and return what it prints. Use print() to see results.")
    parameters: dict[str, Any] = {
        "type": "object",
        "properties": {"code": {"type": "string", "description": "a complete Python program, e.g. print(17 * 23)"}},
        "required": ["code"],
    }
    #: Calls at once (the tool runner's bound): the shared sandbox's workers.
    max_concurrency = DEFAULT_WORKERS
    #: One attempt's limit in the tool runner: the program's own limit plus room for waiting and the worker's start.
    timeout_s = RUN_TIMEOUT_S + 20.0
    #: Attempts after the first when the sandbox fails (InfrastructureError); the program's own failures are answers.
    retries = 2

    def __init__(self, sandbox: Sandbox | None = None, *, run_timeout_s: float = RUN_TIMEOUT_S):
        self._sandbox = sandbox
        self.run_timeout_s = run_timeout_s

    async def __call__(self, arguments: dict[str, Any]) -> str:
        code = arguments.get("code")
        if not isinstance(code, str) or not code.strip():
            return 'error: missing argument "code" (a Python program, as a string)'
        sandbox = self._sandbox or shared_sandbox()
        return format_result(await sandbox.run(code, timeout_s=self.run_timeout_s))
