"""The memory store's wire side on a worker.

The servicer, the node of one map epoch, the primary's and replica's roles, replication to
the peer and slot copies (docs/architecture.md, "Memory store").
"""
