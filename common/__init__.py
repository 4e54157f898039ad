"""What more than one role uses: data sets, chat rendering, the quickstart model, staleness rules, logging set-up.

Neutral ground: every role may import it, and it imports no role (docs/architecture.md, "Rooms and arrows").
"""
