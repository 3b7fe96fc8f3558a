"""Executors: UniProcExecutor (one rank, in-process) and MultiprocExecutor (a process per rank)."""
