"""Distributed: the one-process-per-rank group (``procgroup``) and the collectives timed on it (``allreduce``)."""
