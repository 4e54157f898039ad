"""Agents written against the OpenAI API that rlbus trains through a producer's endpoint (`rollout.agent_loop:
openai`): plain `openai`-client code, nothing of rlbus inside but the task they are handed."""
