"""Failure diagnostics: causes, OOM evidence, hang verdicts, stacks, the flight recorder, what the agent records."""
