"""Training jobs on the coordinator.

The sync parameter server, DiLoCo, allreduce generations, aggregation, evaluation, history
and checkpoints (docs/architecture.md, "Training").
"""
