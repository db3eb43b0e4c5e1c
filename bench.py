"""`python bench.py WHICH [--flags]`: every speed or memory figure nanotrn reports, as a ratio against
a reference run side by side (benchmarks/; `python bench.py --help` lists them)."""
import sys

from benchmarks.cli import main

if __name__ == "__main__":
    main(sys.argv[1:])
