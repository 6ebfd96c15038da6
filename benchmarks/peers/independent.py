"""The no-communication ceiling: N plain-Keras processes side by side, each training a
replica's share of the global batch with cores/N threads, nothing exchanged.

usage: python independent.py N lenet|resnet18 GLOBAL_BATCH STEPS   (env TF_PY: a python with
tfpar). Prints the summed ``img/s X``: the most N devices give on this machine.
"""

import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def main(count: int, model: str, batch: int, steps: str) -> None:
    threads = str(max(1, (os.cpu_count() or 1) // count))
    env = {**os.environ, "TF_NUM_INTRAOP_THREADS": threads, "TF_NUM_INTEROP_THREADS": threads}
    processes = [subprocess.Popen(
        [os.environ.get("TF_PY", sys.executable), os.path.join(HERE, "tfpar_user.py"), "keras",
         "1", model, str(batch // count), steps], stdout=subprocess.PIPE, text=True, env=env)
        for _ in range(count)]
    rates = [float(re.findall(r"img/s ([0-9.]+)", p.communicate()[0])[-1]) for p in processes]
    print(f"img/s {sum(rates):.2f}")


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4])
