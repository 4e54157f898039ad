"""A failed task's ErrorRaised message (what `rlbus events RUN_DIR --kind errors` shows) names the task once.

    .venv/bin/python -m pytest -q tests/unit/test_task_errors.py
"""

from rlbus.producers.agent_loops.openai_agent import AgentFailed
from rlbus.producers.service import task_error_message


def test_an_error_that_names_its_task_is_not_prefixed_again():
    # The message the OpenAI agent loop raises when the user's agent fails (producers/agent_loops/openai_agent.py).
    error = AgentFailed("task e0-i7-a0: the agent mypkg.agent:rollout raised KeyError: 'expression'")
    assert task_error_message("e0-i7-a0", error) == (
        "task e0-i7-a0: the agent mypkg.agent:rollout raised KeyError: 'expression'")


def test_an_error_without_the_task_gets_it():
    assert task_error_message("e0-i7-a0", RuntimeError("engine said no")) == "task e0-i7-a0: engine said no"
    # Another task's id in the text is no reason to leave this one out.
    assert task_error_message("e0-i7-a0", RuntimeError("task e0-i8-a0: x")) == "task e0-i7-a0: task e0-i8-a0: x"
