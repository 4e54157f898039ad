"""Shared fixtures: a real nats-server per test module, a real local Ray per test session, role processes."""

pytest_plugins = ["tests.support.nats_server", "tests.support.ray_cluster", "tests.support.runs",
                  "tests.support.real_model"]
