"""`elastic-rt doctor`: pre-flight checks, and the hard checks the agent runs before joining."""
