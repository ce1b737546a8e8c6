"""The ``neuroshard`` command line.

Modules: ``main`` (the entry point, the parser and the daemon and job commands), ``data``,
``memory``, ``security`` (TLS and token flags, ``certs``, ``token``), ``output`` (tables and
progress bars), ``local`` and ``local_cluster`` (``up``/``demo``: daemons as child
processes), ``common`` (exit codes, errors, reading job specs).
"""
