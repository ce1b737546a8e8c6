"""The coordinator daemon: control plane of a neuroshard cluster (membership, slot map, jobs)."""
