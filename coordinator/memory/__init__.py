"""The memory store seen from the coordinator.

Bulk operations over every slot (decay, quality, top-k), the memory job, exports and the
access stream (docs/architecture.md, "Memory store").
"""
