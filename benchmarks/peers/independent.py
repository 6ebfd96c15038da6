"""The no-communication ceiling: N plain-Keras processes side by side, each training a
replica's share of the global batch with cores/N threads, nothing exchanged.

usage: python independent.py N lenet|resnet18 GLOBAL_BATCH STEPS   (env TF_PY: a python with
tfpar). Prints ``img/s X``: the most N devices give on this machine. The processes warm up,
then start their timed runs together; X is all their images over the time from the first
start to the last end (a sum of separately timed rates would credit a process for the time
it ran alone).
"""

import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def main(count: int, model: str, batch: int, steps: str) -> None:
    threads = str(max(1, (os.cpu_count() or 1) // count))
    env = {**os.environ, "TF_NUM_INTRAOP_THREADS": threads, "TF_NUM_INTEROP_THREADS": threads,
           "START_ON_LINE": "1"}
    processes = [subprocess.Popen(
        [os.environ.get("TF_PY", sys.executable), os.path.join(HERE, "tfpar_user.py"), "keras",
         "1", model, str(batch // count), steps], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True, env=env) for _ in range(count)]
    for process in processes:
        while process.stdout.readline().strip() != "warm":
            if process.poll() is not None:
                sys.exit(f"a process exited with {process.returncode} before its timed run")
    for process in processes:
        process.stdin.write("go\n")
        process.stdin.flush()
    runs = [re.findall(r"images ([0-9]+) from ([0-9.]+) to ([0-9.]+)", p.communicate()[0])[-1]
            for p in processes]
    images = sum(int(n) for n, _, _ in runs)
    seconds = max(float(end) for _, _, end in runs) - min(float(start) for _, start, _ in runs)
    print(f"img/s {images / seconds:.2f}")


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4])
