"""What each worker pays to save and restore the replicas' own copies, from 8 to 256 replicas.

Per-replica BatchNorm statistics differ between replicas inside an epoch, so a save made there
keeps every replica's copy (``tfpar.replica_copies``). This times that part of a save and of a
restore for one worker of a job of 8, 64 and 256 replicas, 8 replicas per worker (a machine of
8 GPUs), on ResNet-50's BatchNorm statistics (53,120 float32 values per replica), simulated: the
files every worker would write are written here, one worker's part is timed.

- **per worker** (``write``/``read``): the worker writes its own replicas' copies to a binary
  file of its own and, on the same number of replicas, reads back only that file; the one
  thing that grows with the job is the fingerprints gathered to find what differs (16 bytes
  per replica and variable).
- **on a changed number of replicas** (an elastic job): each worker reads every file and takes
  the mean (what a replica cannot have its own copy of).
- **tfpar 0.3** (``gather`` + JSON): every replica's copies gathered onto every worker, written
  as decimal JSON by the chief, and every worker parses the whole file back.

Usage (from a checkout with tfpar installed; about a minute on 2 cores)::

    python benchmarks/saved_state.py [--rounds=3] [--replicas=8,64,256] [--per_worker=8]

Rounds are interleaved (each round times every size once, in turn); the figures are medians.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
import warnings

import numpy as np


def batchnorm_shapes() -> list[tuple[int, ...]]:
    """The shapes of ResNet-50's BatchNorm moving means and variances."""
    import keras

    model = keras.applications.ResNet50(weights=None)
    return [tuple(v.shape) for v in model.non_trainable_variables
            if v.path.endswith(("moving_mean", "moving_variance"))]


def copies_of(shapes: list[tuple[int, ...]], replicas: int, seed: int) -> dict[int, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {place: rng.random((replicas, *shape), dtype=np.float32)
            for place, shape in enumerate(shapes)}


def folder_size(folder: str, names: list[str] | None = None) -> int:
    return sum(os.path.getsize(os.path.join(folder, name))
               for name in (names if names is not None else os.listdir(folder)))


def one_round(shapes: list[tuple[int, ...]], replicas: int, per_worker: int, root: str
              ) -> dict[str, float]:
    from tfpar import replica_copies
    from tfpar import replica_copy_files

    workers = replicas // per_worker
    folder = tempfile.mkdtemp(dir=root)
    try:
        # The other workers' files (not timed), then this worker's (the last one's).
        for worker in range(workers - 1):
            ids = list(range(worker * per_worker, (worker + 1) * per_worker))
            replica_copy_files.write_own(folder, ids, replicas,
                                         copies_of(shapes, per_worker, worker))
        ids = list(range((workers - 1) * per_worker, replicas))
        own = copies_of(shapes, per_worker, workers - 1)
        start = time.perf_counter()
        path = replica_copy_files.write_own(folder, ids, replicas, own)
        write_s = time.perf_counter() - start
        start = time.perf_counter()
        back = replica_copy_files.read_own(folder, ids)
        read_s = time.perf_counter() - start
        assert all(np.array_equal(back[p], own[p]) for p in own)
        start = time.perf_counter()
        replica_copy_files.read_mean(folder)
        elastic_s = time.perf_counter() - start
        result = {"write_s": write_s, "read_s": read_s, "elastic_read_s": elastic_s,
                  "own_bytes": os.path.getsize(path), "all_bytes": folder_size(folder),
                  "fingerprint_bytes": replicas * len(shapes) * 16}
        # tfpar 0.3: every replica's copies on every worker, JSON written by the chief.
        gathered = {p: np.concatenate([own[p]] * workers) for p in own}
        json_path = os.path.join(folder, "copies.json")
        start = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            text = json.dumps(replica_copies.encode(gathered))
        with open(json_path, "w", encoding="utf-8") as f:
            f.write(text)
        result["json_write_s"] = time.perf_counter() - start
        del text
        start = time.perf_counter()
        with open(json_path, encoding="utf-8") as f:
            replica_copy_files.decode_json(json.load(f))
        result["json_read_s"] = time.perf_counter() - start
        result["json_bytes"] = os.path.getsize(json_path)
        return result
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--replicas", default="8,64,256")
    parser.add_argument("--per_worker", type=int, default=8)
    args = parser.parse_args()
    sizes = [int(n) for n in args.replicas.split(",")]
    bad = [n for n in sizes if n < args.per_worker or n % args.per_worker]
    if bad or args.rounds < 1:
        parser.error(f"--replicas must be multiples of --per_worker={args.per_worker} "
                     f"(got {bad}) and --rounds at least 1")
    shapes = batchnorm_shapes()
    print(f"ResNet-50: {len(shapes)} BatchNorm statistics, "
          f"{sum(int(np.prod(s)) for s in shapes):,} values per replica; "
          f"{args.per_worker} replicas per worker")
    results: dict[int, list[dict[str, float]]] = {n: [] for n in sizes}
    with tempfile.TemporaryDirectory() as root:
        for _ in range(args.rounds):
            for n in sizes:
                results[n].append(one_round(shapes, n, args.per_worker, root))

    def median(n: int, key: str) -> float:
        return statistics.median(r[key] for r in results[n])

    mib = 2**20
    print("| replicas (workers) | per worker: writes | save | restore | fingerprints gathered "
          "| changed count: reads | restore | tfpar 0.3 (JSON): file | save | restore |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for n in sizes:
        print(f"| {n} ({n // args.per_worker}) | {median(n, 'own_bytes') / mib:.1f} MiB "
              f"| {median(n, 'write_s'):.3f} s | {median(n, 'read_s'):.3f} s "
              f"| {median(n, 'fingerprint_bytes') / 1024:.0f} KiB "
              f"| {median(n, 'all_bytes') / mib:.0f} MiB | {median(n, 'elastic_read_s'):.2f} s "
              f"| {median(n, 'json_bytes') / mib:.0f} MiB | {median(n, 'json_write_s'):.2f} s "
              f"| {median(n, 'json_read_s'):.2f} s |")


if __name__ == "__main__":
    main()
