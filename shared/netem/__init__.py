"""Network tools: link emulation (``link_proxy``) for tests, benchmarks and ``neuroshard link``."""
