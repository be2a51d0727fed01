"""`elastic-rt report`: a run's timeline, restarts, goodput and stragglers, from the agents' goodput journals."""
