"""Benchmarks of kvxferd (run from the repository root: ``python -m bench.<name>``).

:mod:`bench.peer` is also the separate owner process the two-process tests spawn.
"""
