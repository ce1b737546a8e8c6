"""Training domain code shared by the coordinator and the workers (no gRPC).

``models`` builds a job's model with the same initial parameters in every process; ``data``
loads a job's data set and gives every worker the same, reproducible batches of its shard.
Both import torch or scikit-learn, so a client that does not train never imports them.
"""
