"""The multi-turn tool agent loop: the model may call tools between turns until it answers.

`rollout.agent_loop: tool` (the default). Each sample's episode runs on its own: it generates a turn until
`<|im_end|>` or max_new_tokens (the engine batches it with the other turns ready at the time), and a turn holding
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (or another form real models write: tool_parser.py) runs
the tool(s) through producers/tools/runner.py (each tool's concurrency limit, timeout and retries; synchronous tools
in a worker pool) while the group's other samples go on; then the environment inserts the tool response and the
next assistant header -- tokenized from the chat template's own rendering, with mask 0. A turn with no tool call,
or with an `<answer>`, ends the episode ("stop"); so do a tool call in the last allowed turn ("max_turns") and running out of response tokens ("length").
A malformed call (bad JSON, unknown tool, a tool that refuses its arguments) becomes an "error: ..." tool response
for the model to read: the rollout never fails because of what the model wrote. A tool whose service fails (it
raises InfrastructureError, or times out) on every retry ends the episode with InfrastructureError instead: the task
is rolled out again, never trained on the outage.

    .venv/bin/python -m pytest -q tests/unit/test_agent_loop.py
"""

from __future__ import annotations

import time
from typing import Any

from rlbus.common.chat import ANSWER_START
from rlbus.producers.agent_loops.base import AgentLoop, ChatTemplateError, Trajectory
from rlbus.producers.agent_loops.tool_parser import ToolCall, parse_tool_calls
from rlbus.producers.tools.runner import ToolRunner
from rlbus.schemas.wire import ChatMessage


__all__ = ["ChatTemplateError", "ToolAgentLoop", "ToolCall", "parse_tool_calls"]


class ToolAgentLoop(AgentLoop):
    runner: ToolRunner  # calls the tools with each one's concurrency limit, timeout and retries

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.runner = ToolRunner(self.tools, self.cfg)

    async def _episode(self, traj: Trajectory) -> None:
        while not traj.done:
            text = await self.generate_turn(traj)
            if traj.done:  # cut off by a token limit
                return
            calls = parse_tool_calls(text)
            if not calls or ANSWER_START in text:
                traj.finish_reason = "stop"
            elif traj.num_turns >= self.cfg.max_turns:
                traj.finish_reason = "max_turns"
            else:
                await self._run_tools(traj, calls)

    async def _run_tools(self, traj: Trajectory, calls: list[ToolCall]) -> None:
        t0 = time.perf_counter()
        results = [await self._call(c) for c in calls]  # in order: a later call may depend on an earlier one
        traj.tool_time_s += time.perf_counter() - t0
        traj.num_tool_calls += len(calls)
        tool_msgs = [ChatMessage(role="tool", content=self._truncate(r)) for r in results]
        inserted = self.inserted_ids(traj.messages, tool_msgs)
        if len(traj.response_ids) + len(inserted) >= self.cfg.max_response_tokens:
            traj.finish_reason = "length"  # no room left for even one more generated token
            return
        traj.messages += tool_msgs
        traj.add_inserted(inserted)

    async def _call(self, call: ToolCall) -> str:
        if call.error:
            return call.error
        return await self.runner.call(call.name, call.arguments or {})

    def _truncate(self, text: str) -> str:
        """Cut a tool response to max_tool_response_tokens tokens (re-encoding stays within the cap)."""
        cap = self.cfg.max_tool_response_tokens
        ids = self.encode(text)
        k = cap
        while len(ids) > cap and k > 0:
            cut = self.decode(ids[:k])
            # A cut inside a multi-byte character decodes to U+FFFD, which may re-encode longer: back off.
            if len(self.encode(cut)) <= cap:
                return cut
            k -= 1
        return text if len(ids) <= cap else ""
