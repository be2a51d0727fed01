"""The agent's Prometheus metrics: definitions, the HTTP exporter, and the observer that records agent events."""
