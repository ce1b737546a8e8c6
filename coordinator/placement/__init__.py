"""Placement: where each slot's two copies live.

Membership, failure detection and readmission, the slot map, which copies are trusted, and
the rebalancer that moves copies (docs/architecture.md, "Placement").
"""
