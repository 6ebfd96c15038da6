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


CEILING = "independent_2x1"
# TensorFlow's oneDNN kernels, per --onednn value: the environment a configuration's process gets.
# ``as_set`` leaves the environment as it is (TensorFlow's rule, or tfpar's choice for tfpar's
# configurations); a cap (``avx2``) runs oneDNN's kernels for that extension on a wider CPU, as
# on a CPU that has no more.
ONEDNN = {"as_set": {}, "off": {"TF_ENABLE_ONEDNN_OPTS": "0"},
          "on": {"TF_ENABLE_ONEDNN_OPTS": "1"},
          "avx2": {"TF_ENABLE_ONEDNN_OPTS": "1", "ONEDNN_MAX_CPU_ISA": "AVX2"},
          "avx": {"TF_ENABLE_ONEDNN_OPTS": "1", "ONEDNN_MAX_CPU_ISA": "AVX"},
          # An AVX2 CPU as tfpar runs it (oneDNN capped at AVX: tfpar.host.onednn.AVX2_CHOICE),
          # and as TensorFlow alone runs it (Eigen's kernels, built for AVX).
          "avx2_cpu": {"TF_ENABLE_ONEDNN_OPTS": "1", "ONEDNN_MAX_CPU_ISA": "AVX"},
          "avx2_cpu_eigen": {"TF_ENABLE_ONEDNN_OPTS": "0"}}
# PyTorch's settings where they differ from TensorFlow's: on an AVX2 CPU its oneDNN and MKL run
# their AVX2 kernels.
PEER_ONEDNN = {setting: {"ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
               for setting in ("avx2_cpu", "avx2_cpu_eigen")}
# What a configuration's DTYPE=auto would mean: only tfpar's own configurations take it
# (``tfpar.training.recommend``); a peer has no such choice.
TAKES_AUTO = ("tfpar_",)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", choices=("lenet", "resnet18"))
    parser.add_argument("batch_size", help="global batch")
    parser.add_argument("steps", help="steps per timed fit: make a round last seconds")
    parser.add_argument("rounds", type=int)
    parser.add_argument("output", help="JSON file for every round")
    parser.add_argument("--only", help="comma list of configuration names, each at every "
                                       "--dtype, or NAME@DTYPE for one of them")
    parser.add_argument("--dtype", default="float32",
                        help="comma list of float32, bfloat16 and auto (tfpar's configurations "
                             "only: what tfpar.training.recommend chooses); several are paired "
                             "in the same rounds")
    parser.add_argument("--steps_per_execution", default="1",
                        help="steps per compiled call of every TensorFlow configuration; auto: "
                             "what tfpar.training.recommend chooses for tfpar's (plain Keras "
                             "and the ceiling then take 1)")
    parser.add_argument("--onednn", default="as_set",
                        help="comma list of " + ", ".join(ONEDNN) + ": each configuration "
                             "under each of TensorFlow's oneDNN settings, paired in the same "
                             "rounds (names then end in %%off, ...)")
    args = parser.parse_args()
    onednn = args.onednn.split(",")
    if not set(onednn) <= set(ONEDNN):
        parser.error(f"--onednn={args.onednn}: each must be one of {', '.join(ONEDNN)}")
    if not (args.steps_per_execution == "auto" or args.steps_per_execution.isdigit()):
        parser.error(f"--steps_per_execution={args.steps_per_execution}: an integer or auto")
    dtypes = args.dtype.split(",")
    if not set(dtypes) <= {"float32", "bfloat16", "auto"}:
        parser.error(f"--dtype={args.dtype}: each must be float32, bfloat16 or auto")
    configs = configurations(args.model, args.batch_size, args.steps)
    only = args.only.split(",") if args.only else []
    if only:  # A name, or a name@dtype for that precision alone.
        configs = {k: v for k, v in configs.items()
                   if any(o.split("@")[0] == k for o in only)}
    runs = {(f"{name}@{dtype}" if len(dtypes) > 1 else name)
            + (f"%{setting}" if len(onednn) > 1 else ""):
            (command, {**extra, **ONEDNN[setting],
                       **(PEER_ONEDNN.get(setting, {}) if name.startswith("torch") else {})},
             dtype)
            for setting in onednn
            for dtype in dtypes for name, (command, extra) in configs.items()
            if (dtype != "auto" or name.startswith(TAKES_AUTO))
            and (not only or name in only or f"{name}@{dtype}" in only)}
    names = list(runs)
    rates: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(args.rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            command, extra, dtype = runs[name]
            done = subprocess.run(command, capture_output=True, text=True, timeout=1800,
                                  env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3",
                                       "DTYPE": dtype,
                                       "STEPS_PER_EXECUTION": args.steps_per_execution,
                                       **extra})
            found = re.findall(r"img/s ([0-9.]+)", done.stdout)
            if not found:
                print(f"{name} failed:\n{done.stdout[-300:]}{done.stderr[-600:]}",
                      file=sys.stderr)
            rates[name].append(float(found[-1]) if found else float("nan"))
            print(f"round {round_index} {name}: {rates[name][-1]}", flush=True)

    def paired(name: str, other: str) -> float | None:
        ratios = [a / b for a, b in zip(rates[name], rates.get(other, []))
                  if a == a and b == b]
        return statistics.median(ratios) if ratios else None

    def same_dtype(base: str, name: str) -> str:
        dtype = runs[name][2]
        setting = f"%{name.rsplit('%', 1)[1]}" if len(onednn) > 1 else ""
        return (f"{base}@{'bfloat16' if dtype == 'auto' else dtype}" if len(dtypes) > 1
                else base) + setting

    reference = (REFERENCE if len(dtypes) == 1 else f"{REFERENCE}@{dtypes[0]}") + (
        f"%{onednn[0]}" if len(onednn) > 1 else "")
    reference = reference if reference in rates else names[0]
    summary = {}
    for name in names:
        ceiling = same_dtype(CEILING, name)
        summary[name] = {"dtype": runs[name][2],
                         "median": statistics.median([v for v in rates[name] if v == v]
                                                     or [float("nan")]),
                         "vs_" + reference: paired(name, reference),
                         "vs_ceiling": paired(name, ceiling),
                         "rounds": rates[name]}
        print(f"{name:44s} {summary[name]['median']:9.1f} img/s  vs {reference}: "
              f"{_ratio(summary[name]['vs_' + reference])}  vs {ceiling}: "
              f"{_ratio(summary[name]['vs_ceiling'])}")
    with open(args.output, "w", encoding="utf-8") as f:
        json.dump({"model": args.model, "global_batch": args.batch_size, "steps": args.steps,
                   "dtypes": dtypes, "onednn": onednn,
                   "steps_per_execution": args.steps_per_execution,
                   "summary": summary}, f, indent=1)


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


if __name__ == "__main__":
    main()
