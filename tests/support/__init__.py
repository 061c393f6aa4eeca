"""Helpers only tests use: two-rank clusters in threads, the allowlist test's stranger, the averager tests'
peers. What benchmarks share with tests lives in the package (open_diloco/outer/testing.py,
open_diloco/local_galaxy.py)."""
