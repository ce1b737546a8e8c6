"""Network awareness.

Per-link statistics, link probes and straggler handling (docs/architecture.md, "Network
awareness").
"""
