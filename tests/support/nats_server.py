"""Fixtures for a real nats-server (filled in by the bus work)."""
