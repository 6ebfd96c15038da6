"""What a preemption costs: a notice in the middle of an epoch, the stop, and the rerun.

Trains ResNet-18 (or LeNet) on the bundled digits on 2 logical devices with a state folder,
sends SIGTERM in the middle of a step of epoch 2 (a random moment, seeded), and reruns the same
program. Each round prints what the notice cost:

- seconds from the signal to the process's exit (the step in progress, the agreed stop, the
  save), and the status (85: preempted);
- steps the rerun redoes: steps the first run finished that the rerun trains again (0 when it
  resumes at the step after the last one finished; at most one compiled call of
  ``--steps_per_execution`` steps is the promise);
- seconds from the rerun's start to its first new step (TensorFlow's start, the model's build,
  the restore), and what an epoch-level resume would have redone instead.

Usage (from a checkout with tfpar installed; each round takes about a minute on 2 cores)::

    python benchmarks/preemption.py --model=resnet18 --rounds=3 [--steps_per_execution=2]

The child program is this file with ``--child``: tfpar's own training run
(``tfpar.training.train_on_devices``), with a callback that prints when each step ends.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

_STEP = re.compile(r"^step (\d+) (\d+) ([\d.]+)$")  # epoch (1-based), step (1-based), time
_SAVED = re.compile(r"state saved at epoch (\d+) step (\d+) ")


def child(args: argparse.Namespace) -> None:
    """Trains and prints ``step EPOCH STEP TIME`` after every step (the time since the epoch)."""
    from tfpar import devices

    devices.ensure_logical_cpus(2)
    import keras

    from tfpar import training

    class PrintSteps(keras.callbacks.Callback):
        epoch = 0

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch + 1

        def on_train_batch_end(self, batch, logs=None):
            print(f"step {self.epoch} {batch + 1} {time.time():.3f}", flush=True)

    from tfpar.cluster import preemption

    # As tfpar-train does: notices watched for the whole program, which ends at once once saved.
    preemption.NOTICE.watch(preemption.notice_signals("SIGUSR1"), exit_process=True)
    config = training.TrainConfig(strategy="mirrored", model=args.model, dataset="digits",
                                  batch_size=args.batch_size, epochs=3, verbose=0,
                                  steps_per_execution=args.steps_per_execution,
                                  model_dir=args.model_dir)
    training.train_on_devices(config, 2, callbacks=[PrintSteps()])


def one_round(args: argparse.Namespace, rng: random.Random) -> dict:
    """One preempted run and its rerun; returns what they measured."""
    model_dir = tempfile.mkdtemp(prefix="tfpar_preemption_")
    command = [sys.executable, __file__, "--child", f"--model={args.model}",
               f"--batch_size={args.batch_size}",
               f"--steps_per_execution={args.steps_per_execution}", f"--model_dir={model_dir}"]
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    errors = tempfile.TemporaryFile("w+")  # Read at the end: a pipe left unread would fill.
    first = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=errors, text=True, env=env)
    steps: list[tuple[int, int, float]] = []
    signalled = 0.0
    for line in first.stdout:
        match = _STEP.match(line.strip())
        if not match:
            continue
        steps.append((int(match[1]), int(match[2]), float(match[3])))
        if steps[-1][:2] == (2, args.signal_after):
            step_seconds = steps[-1][2] - steps[-2][2]
            time.sleep(rng.uniform(0.1, 0.9) * step_seconds)  # In the middle of the next step.
            signalled = time.time()
            first.send_signal(signal.SIGTERM)
            break
    rest = first.communicate(timeout=600)[0]
    exited = time.time()
    errors.seek(0)
    stderr = errors.read()
    for line in rest.splitlines():
        match = _STEP.match(line.strip())
        if match:
            steps.append((int(match[1]), int(match[2]), float(match[3])))
    saved = _SAVED.search(stderr)
    if first.returncode != 85 or not saved:
        raise RuntimeError(f"the preempted run ended with {first.returncode}:\n{stderr[-2000:]}")
    finished = [s for s in steps if s[0] == 2]
    # The stop comes before this program's callback prints the last step: the saved step is
    # the last one the run finished.
    done = int(saved[2])
    started = time.time()
    rerun = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
    if rerun.returncode:
        raise RuntimeError(f"the rerun failed:\n{rerun.stderr[-2000:]}")
    resumed = [(int(m[1]), int(m[2]), float(m[3])) for m in
               (_STEP.match(line.strip()) for line in rerun.stdout.splitlines()) if m]
    first_new = resumed[0]
    redone = sum(1 for epoch, step, _ in resumed if epoch == 2 and step <= done)
    epoch_seconds = [b[2] - a[2] for a, b in zip(finished, finished[1:])]
    return {"signal_to_exit": exited - signalled, "saved_step": done,
            "redone_steps": redone, "first_new_step": f"epoch {first_new[0]} step {first_new[1]}",
            "start_to_first_new_step": first_new[2] - started,
            "epoch_resume_would_redo": done,
            "epoch_resume_would_redo_seconds": sum(epoch_seconds) + (
                epoch_seconds[0] if epoch_seconds else 0.0)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model_dir", help=argparse.SUPPRESS)
    parser.add_argument("--model", default="resnet18", choices=("resnet18", "lenet"))
    parser.add_argument("--batch_size", type=int, default=128)
    parser.add_argument("--steps_per_execution", type=int, default=1)
    parser.add_argument("--signal_after", type=int, default=4,
                        help="Send the notice during the step after this one of epoch 2.")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    from tfpar import env

    print(f"Machine: {env.describe_cpu()}")
    rng = random.Random(args.seed)
    rounds = []
    for i in range(args.rounds):
        result = one_round(args, rng)
        rounds.append(result)
        print(f"round {i + 1}: exit {result['signal_to_exit']:.1f} s after the notice; saved at "
              f"epoch 2 step {result['saved_step']}; the rerun's first new step is "
              f"{result['first_new_step']}, {result['start_to_first_new_step']:.1f} s after it "
              f"started; steps redone: {result['redone_steps']} (an epoch-level resume: "
              f"{result['epoch_resume_would_redo']}, "
              f"{result['epoch_resume_would_redo_seconds']:.1f} s of training)", flush=True)
    print(f"median: {statistics.median(r['signal_to_exit'] for r in rounds):.1f} s from the "
          "notice to the exit, "
          f"{statistics.median(r['start_to_first_new_step'] for r in rounds):.1f} s from the "
          f"rerun's start to its first new step, "
          f"{max(r['redone_steps'] for r in rounds)} steps redone at most "
          f"({args.model}, batch {args.batch_size}, {args.steps_per_execution} step(s) per "
          "compiled call, 2 devices)")


if __name__ == "__main__":
    main()
