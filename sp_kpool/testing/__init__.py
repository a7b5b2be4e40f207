"""Importable test helpers: problem generators, invariant checks, reference comparison,
and a launcher for multi-rank runs from pytest or the CLI.

Nothing here is imported by ``import sp_kpool``.
"""
