"""Times tfpar and what a user would pick instead, side by side: each configuration a fresh
process, configurations interleaved in rounds (A, B, C, then B, C, A, ...); prints each one's
median images/s and its paired ratio (median of per-round ratios) to tfpar ``mirrored`` on 2
devices, and writes every round to a JSON file.

Environment: ``TF_PY``, a python with tfpar installed; ``PEER_PY``, a python with the peers
(``pip install torch jax keras numpy`` in a virtual environment of their own: never tfpar's).
See README.md.
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
CHECKOUT = os.path.dirname(os.path.dirname(HERE))  # scripts/launch.py lives there.
REFERENCE = "tfpar_mirrored_2"


def configurations(model: str, batch: str, steps: str) -> dict[str, tuple[list[str], dict]]:
    """Name -> (command, extra environment)."""
    tf_py, peer_py = os.environ["TF_PY"], os.environ.get("PEER_PY", "")
    user = os.path.join(HERE, "tfpar_user.py")
    launch = [tf_py, os.path.join(CHECKOUT, "scripts", "launch.py"), "--num_workers=2", "--",
              tf_py, user]

    def jax(count: int) -> dict:
        return {"KERAS_BACKEND": "jax",
                "XLA_FLAGS": f"--xla_force_host_platform_device_count={count}"}

    return {
        "keras_1dev": ([tf_py, user, "keras", "1", model, batch, steps], {}),
        "tfpar_mirrored_1": ([tf_py, user, "mirrored", "1", model, batch, steps], {}),
        REFERENCE: ([tf_py, user, "mirrored", "2", model, batch, steps], {}),
        "tfpar_allreduce_2": ([tf_py, user, "allreduce", "2", model, batch, steps], {}),
        "tfpar_multi_worker_allreduce_2x1": (
            [*launch, "multi_worker_allreduce", "1", model, batch, steps], {}),
        "independent_2x1": ([tf_py, os.path.join(HERE, "independent.py"), "2", model, batch,
                             steps], {}),
        "torch_ddp_2x1": ([peer_py, os.path.join(HERE, "torch_ddp.py"), "2", "1", model, batch,
                           steps], {}),
        "torch_1x2": ([peer_py, os.path.join(HERE, "torch_ddp.py"), "1", "2", model, batch,
                       steps], {}),
        "keras_jax_dp_2": ([peer_py, os.path.join(HERE, "keras_jax_dp.py"), "2", model, batch,
                            steps], jax(2)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", choices=("lenet", "resnet18"))
    parser.add_argument("batch_size", help="global batch")
    parser.add_argument("steps", help="steps per timed fit: make a round last seconds")
    parser.add_argument("rounds", type=int)
    parser.add_argument("output", help="JSON file for every round")
    parser.add_argument("--only", help="comma list of configuration names")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = parser.parse_args()
    configs = configurations(args.model, args.batch_size, args.steps)
    if args.only:
        configs = {k: v for k, v in configs.items() if k in args.only.split(",")}
    names = list(configs)
    rates: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(args.rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            command, extra = configs[name]
            done = subprocess.run(command, capture_output=True, text=True, timeout=1800,
                                  env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3",
                                       "DTYPE": args.dtype, **extra})
            found = re.findall(r"img/s ([0-9.]+)", done.stdout)
            if not found:
                print(f"{name} failed:\n{done.stdout[-300:]}{done.stderr[-600:]}",
                      file=sys.stderr)
            rates[name].append(float(found[-1]) if found else float("nan"))
            print(f"round {round_index} {name}: {rates[name][-1]}", flush=True)
    reference = REFERENCE if REFERENCE in rates else names[0]
    summary = {}
    for name in names:
        ratios = [a / b for a, b in zip(rates[name], rates[reference]) if a == a and b == b]
        summary[name] = {"median": statistics.median([v for v in rates[name] if v == v]
                                                     or [float("nan")]),
                         "vs_" + reference: statistics.median(ratios) if ratios else None,
                         "rounds": rates[name]}
        print(f"{name:34s} {summary[name]['median']:9.1f} img/s  vs {reference}: "
              f"{summary[name]['vs_' + reference]}")
    with open(args.output, "w", encoding="utf-8") as f:
        json.dump({"model": args.model, "global_batch": args.batch_size, "steps": args.steps,
                   "dtype": args.dtype, "summary": summary}, f, indent=1)


if __name__ == "__main__":
    main()
