"""Training on a worker for the sync and DiLoCo strategies.

The servicer, the per-job sessions, the trainer, the shard fetcher and the compressed link
(docs/architecture.md, "Training").
"""
