"""Goodput and stragglers: where one agent's wall time went, per-rank step timing, slow-rank detection."""
