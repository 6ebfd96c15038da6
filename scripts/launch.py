"""Runs a command as N local worker processes with TF_CONFIG set, supervising them.

    python scripts/launch.py --num_workers=2 -- python scripts/train.py --strategy=multi_worker

Run with --help for every flag. The logic lives in tfpar.cluster.launcher and tfpar.cli.launch.
"""

from tfpar.cli import launch

if __name__ == "__main__":
    launch.run()
