"""The allreduce strategy on a worker.

The servicer, per-job sessions, the training child process (torch DDP) and its pipe, and the
sealed rendezvous store (docs/architecture.md, "Training").
"""
