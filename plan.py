"""`python plan.py [--preset NAME] [--key=value ...] [--validate] [--help]`: the cluster planner
(planner/: which layouts fit on a trn1/trn2 cluster, fastest first)."""
import sys

from planner.report import main

if __name__ == "__main__":
    main(sys.argv[1:])
