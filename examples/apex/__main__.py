"""``python -m examples.apex``: one Ape-X run against a cluster (see examples/apex/run.py)."""

from examples.apex.run import main

main()
