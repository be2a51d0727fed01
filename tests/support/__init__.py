"""Test machinery shared by tests and benchmarks: multi-process gloo worlds, checkpoint pause points."""
