"""Measuring in other processes, apart from the judge, handing on typed runs (its modules:
docs/development.md, Layout).
"""
