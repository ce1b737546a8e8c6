"""The worker daemon: slot store, kernels, replication, training executor, servicers."""
