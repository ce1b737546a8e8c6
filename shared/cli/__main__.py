"""``python -m shared.cli``: the ``neuroshard`` command (local clusters start daemons so)."""

from shared.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
