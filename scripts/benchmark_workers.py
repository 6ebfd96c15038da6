"""Multi-worker scaling on this machine: N local workers of one core each against one.

    python scripts/benchmark_workers.py --model=resnet18 --workers=1,2 --rounds=3

The logic lives in tfpar.worker_benchmark and tfpar.cli.worker_benchmark.
"""

from tfpar.cli import worker_benchmark

if __name__ == "__main__":
    worker_benchmark.run()
