"""Jobs: the registry, admission and the scheduler.

The registry of submitted jobs, admission of a spec against the operator's limits, and the
scheduler that runs them (docs/architecture.md, "Jobs").
"""
