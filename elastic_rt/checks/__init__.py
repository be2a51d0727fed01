"""The health-check model shared by `elastic-rt doctor` and the agent's /livez and /readyz."""
