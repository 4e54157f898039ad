"""The quickstart's calculator task written with the OpenAI Agents SDK (`pip install openai-agents`, or the
`agents` extra): an `Agent` with a `@function_tool` calculator, run by `Runner.run` on the client rlbus hands it
(`rollout_streamed`: by `Runner.run_streamed`, over server-sent events).
Nothing here knows about rlbus but the task; the SDK's own tool loop drives the producer's endpoint.

    rollout:
      agent_loop: openai
      openai: {function: rlbus.producers.agents.agents_sdk:rollout}

Tracing is switched off (it would export to OpenAI's servers). A run that reaches `MAX_TURNS` with a tool call
still pending ends there and is scored as it stands, as the built-in tool loop's "max_turns" episodes are.
"""

from __future__ import annotations

import openai
from agents import Agent, MaxTurnsExceeded, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled

from rlbus.producers.tools.calculator import evaluate

MODEL = "policy"  # rollout.openai.model
MAX_TURNS = 2  # model calls per rollout, as the quickstart's rollout.max_turns

set_tracing_disabled(True)


@function_tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression, e.g. 17*23."""
    return evaluate(expression)


def _agent(client: openai.AsyncOpenAI, task) -> tuple[Agent, list[dict]]:
    system = "\n".join(m.content for m in task.prompt if m.role == "system")
    agent = Agent(
        name="calculator",
        instructions=system or None,
        tools=[calculator],
        model=OpenAIChatCompletionsModel(model=MODEL, openai_client=client),
    )
    return agent, [{"role": m.role, "content": m.content} for m in task.prompt if m.role != "system"]


async def rollout(client: openai.AsyncOpenAI, task) -> float | None:
    """One run of the SDK's agent loop; None: the run's reward function scores the conversation's answer."""
    agent, turns = _agent(client, task)
    try:
        await Runner.run(agent, turns, max_turns=MAX_TURNS)
    except MaxTurnsExceeded:
        pass  # the last turn called the tool: the episode ends as the built-in loop's "max_turns" ones do
    return None


async def rollout_streamed(client: openai.AsyncOpenAI, task) -> float | None:
    """The same run with `Runner.run_streamed`: the SDK asks for `stream: true` and reads the endpoint's
    server-sent events (content deltas as they are sampled, tool calls whole)."""
    agent, turns = _agent(client, task)
    run = Runner.run_streamed(agent, turns, max_turns=MAX_TURNS)
    try:
        async for _ in run.stream_events():
            pass
    except MaxTurnsExceeded:
        pass
    return None
