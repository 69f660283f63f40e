"""The benchmarks that ``scripts/bench.py`` runs: one module per benchmark, each with ``add_arguments``
and ``run``; ``common`` holds what they share. A directory of the repository, never installed."""
