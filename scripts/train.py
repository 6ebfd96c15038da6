"""Trains a model on each device set and reports test accuracy and sec/epoch per device set.

    python scripts/train.py --strategy=mirrored --model=lenet --dataset=digits --num_devices=1,2

Run with --help for every flag. The logic lives in tfpar.cli.train (also `tfpar-train`).
"""

from tfpar.cli import train

if __name__ == "__main__":
    train.run()
