"""Fixtures for a real local Ray (filled in by the TransferQueue work)."""
