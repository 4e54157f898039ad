"""Shared fixtures: a real nats-server per test module and a real local Ray per test session (tests/support/)."""

pytest_plugins = ["tests.support.nats_server", "tests.support.ray_cluster"]
