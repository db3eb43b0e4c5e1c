"""The benchmarks (`python bench.py WHICH`), one module per concern; common.py measures for all."""
