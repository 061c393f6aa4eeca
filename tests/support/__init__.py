"""Helpers the tests share (and the benchmarks may import): in-process galaxies, process bookkeeping."""
