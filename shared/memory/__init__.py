"""The memory store's vocabulary, shared by the client, the coordinator and the workers.

``slots`` (hashing ids to slots), ``validation`` (input checks and ``MemoryInputError``),
``stats`` (``Quality`` and the exact merges of per-worker answers) and ``files`` (reading
memories from ``.npz``/``.npy`` files). Nothing here loads numba, torch or daemon code.
"""
