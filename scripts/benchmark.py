"""Measures training images/s of strategies x device sets x models, interleaved, side by side.

    python scripts/benchmark.py --strategies=mirrored,allreduce --num_devices=1,2 --models=lenet

Run with --help for every flag. The logic lives in tfpar.benchmark and tfpar.cli.benchmark.
"""

from tfpar.cli import benchmark

if __name__ == "__main__":
    benchmark.run()
