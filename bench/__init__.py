"""Benchmarks of kvxferd, run from the repository root as modules: ``python -m bench.<name>``.

:mod:`bench.studies` holds the one-off studies whose findings are written up in ``docs/``.
Nothing in ``kvxferd/`` or ``tests/`` imports this package; what benchmarks and tests share
(the owner process, the byte pattern, the plans) lives in :mod:`kvxferd.scenario`.
"""
