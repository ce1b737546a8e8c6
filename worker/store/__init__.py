"""The local store of a worker's slots.

The arrays and kernels (NumPy/numba/CuPy), the store thread, the journal and its group
commit, and dedup of retried writes (docs/architecture.md, "Memory store").
"""
