"""Pure training domain code shared by the coordinator and the workers (no gRPC)."""
