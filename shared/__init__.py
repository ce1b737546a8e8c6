"""Code both daemons and users import: what the coordinator and the workers share.

Generated gRPC code (``proto``), typed configuration (``config``), logging and metrics,
gRPC helpers and the tensor codec (``rpc``), the memory store's vocabulary (``memory``),
training data and models (``training``), tokens, TLS and trust boundaries (``security``),
the Python client (``client``) and the ``neuroshard`` command line (``cli``). It imports
neither daemon, except the CLI's one lazy import of each server.
"""
