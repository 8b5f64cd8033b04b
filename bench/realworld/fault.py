"""The benchmark's faults in the corpus programs of ours: the wall-clock time a fault strikes goes to
$FAULT_MARK, where bench/realworld.py measures the alert's latency from. The hang itself stays in the
program's own function (the alert must name that function, not this module)."""
import os
import time


def mark() -> None:
    if os.environ.get("FAULT_MARK"):
        with open(os.environ["FAULT_MARK"], "w") as f:
            f.write(str(time.time()))
