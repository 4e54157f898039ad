"""The quickstart's calculator task as a plain `openai`-client agent: the model may call `calculator` before it
answers, the same task the built-in tool loop runs (configs/quickstart.yaml), here driven through the producer's
OpenAI-compatible endpoint (configs/quickstart_openai.yaml).

    rlbus up configs/quickstart_openai.yaml

It returns None, so the run's reward function (`rollout.reward: math`) scores the conversation's answer.
"""

from __future__ import annotations

import json

import openai

from rlbus.producers.tools.calculator import evaluate

MODEL = "policy"  # rollout.openai.model
MAX_TURNS = 2  # model calls per rollout, as the quickstart's rollout.max_turns

CALCULATOR_TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression, e.g. 17*23.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}


def call_tool(name: str, arguments: str) -> str:
    """A tool call's result as the model reads it; a bad call is an "error: ..." result, not a crash."""
    if name != "calculator":
        return f"error: unknown tool {name!r}; available: calculator"
    try:
        expression = json.loads(arguments).get("expression", "")
    except (json.JSONDecodeError, AttributeError):
        return "error: tool call arguments are not a JSON object"
    return evaluate(str(expression))


async def rollout(client: openai.AsyncOpenAI, task) -> float | None:
    """One conversation; None: the run's reward function scores its answer."""
    messages = [{"role": m.role, "content": m.content} for m in task.prompt]
    for _ in range(MAX_TURNS):
        reply = (await client.chat.completions.create(model=MODEL, messages=messages, tools=[CALCULATOR_TOOL])).choices[
            0
        ]
        message = reply.message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": call.id,
                    "content": call_tool(call.function.name, call.function.arguments),
                }
            )
