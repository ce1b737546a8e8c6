"""The ``neuroshard`` command line: ``main`` (the entry point and the daemon commands),
``data``, ``memory``, ``security`` (certs, tokens), ``output`` (tables and progress) and
``local_cluster`` (``up``/``demo``: daemons as child processes)."""
