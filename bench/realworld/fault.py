"""The benchmark's faults in the corpus programs of ours: the wall-clock time the fault strikes goes
to $FAULT_MARK (where bench/realworld.py measures the alert's latency from), then a hang."""
import os
import time


def strikes() -> None:
    if os.environ.get("FAULT_MARK"):
        with open(os.environ["FAULT_MARK"], "w") as f:
            f.write(str(time.time()))
    while True:
        time.sleep(1)
