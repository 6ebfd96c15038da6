"""Each replica's own copy of the variables replicas update apart, kept across a save.

Under a mirrored strategy every replica holds a copy of every variable. Trainable variables and
the optimizer's state are updated identically everywhere, but a variable a layer assigns inside
the replica step without aggregation takes a value of its own on each replica: per-replica
BatchNorm's moving mean and variance drift apart within an epoch, each following its own shard
(until :class:`~tfpar.callbacks.AverageAtEpochEnd` averages them, if it runs). A checkpoint of a
mirrored variable holds one copy (the first replica's), so a run resumed from a state saved
inside an epoch would start every replica from that copy and lose the others' drift: the
resumed job would not end where the uninterrupted one ends.

:func:`gather` returns, for each model variable whose copies differ at that moment, every
replica's copy (of every worker, in the order of the replicas' ids); :func:`scatter` gives each
replica its own copy back. When the number of replicas changed between the save and the restore
(an elastic job shrank or grew), there is no copy per replica to give: each replica starts from
the mean of the saved copies, which is what averaging at the epoch's end gives when the
statistics are linear in their start (BatchNorm's moving averages are), within float32
rounding.

Savers beside a checkpoint use :func:`write` and :func:`read`, whose cost per worker does not
grow with the number of workers: each worker writes its own replicas' copies to a binary file
of its own (``replicas-FIRST-LAST-of-TOTAL.npz``, NumPy's format, every bit kept), as PyTorch's
distributed checkpoint has each rank write its shard, and a restore on the same number of
replicas opens only the file of its own replicas. Nothing is gathered across workers but the
fingerprints and one count of the workers that wrote.

Which variables differ is decided by comparing fingerprints (two hashes of each copy's raw
bytes, so copies that differ in any bit differ) gathered from every replica: one small
collective, so a frozen backbone's large non-trainable weights, equal everywhere, are never
gathered.
"""

from __future__ import annotations

import contextlib
import os
import re
import warnings
import weakref
from collections.abc import Mapping
from typing import Any

import keras
import numpy as np
import tensorflow as tf
from absl import logging

from tfpar import atomic_io

#: The copies of each differing variable, by the variable's place in ``model.variables`` (as
#: Keras's own checkpoints match variables: two builds of one model may name layers apart): an
#: array whose first axis is the replica (``num_replicas_in_sync`` long).
Copies = dict[int, np.ndarray]


def _components(variable: keras.Variable) -> Any:
    """The ``tf.Variable`` behind a Keras variable (a distributed one under a strategy)."""
    return getattr(variable, "value", variable)


# Two keys of SipHash (TensorFlow's ``to_hash_bucket_strong``): 126 bits of the copy's bytes.
_HASH_KEYS = ((0x7466706172, 0x636F70696573), (0x62697473, 0x666F72626974))
_HASH_BUCKETS = 2**63 - 1


def _fingerprint(value: tf.Tensor) -> tf.Tensor:
    """Two int64 hashes of a copy's raw bytes: copies that differ in any bit (a permutation,
    one ulp beside a large value, ``-0.0`` against ``+0.0``) differ here but with a chance of
    about 2**-126."""
    data = tf.io.serialize_tensor(value)  # The tensor's bytes, behind its dtype and shape.
    return tf.stack([tf.strings.to_hash_bucket_strong(data, _HASH_BUCKETS, key=list(key))
                     for key in _HASH_KEYS])


class _Gatherer:
    """The compiled functions that gather one model's copies under one strategy."""

    def __init__(self, model: keras.Model, strategy: tf.distribute.Strategy):
        self.strategy = strategy
        trainable = {id(v) for v in model.trainable_variables}
        #: (place in model.variables, variable) of each that may be updated apart.
        self.places = [(place, v) for place, v in enumerate(model.variables)
                       if id(v) not in trainable
                       and isinstance(_components(v), tf.distribute.DistributedValues)]
        self.variables = [v for _, v in self.places]
        self._gather_by_selection: dict[tuple[int, ...], Any] = {}
        self._replica_ids: list[int] | None = None
        self._count: Any = None

        tensors = [_components(v) for v in self.variables]

        @tf.function
        def fingerprints():
            def replica_fingerprints():
                # In a replica context, reading a mirrored variable gives this replica's copy.
                prints = tf.stack([_fingerprint(tf.identity(t)) for t in tensors])
                return tf.distribute.get_replica_context().all_gather(prints[None], axis=0)

            return strategy.experimental_local_results(strategy.run(replica_fingerprints))[0]

        self.fingerprints = fingerprints

    def differing(self) -> list[int]:
        """Indices into ``variables`` of those whose copies differ between replicas."""
        if not self.variables:
            return []
        prints = self.fingerprints().numpy()  # [replicas, variables, 2]
        return [i for i in range(len(self.variables))
                if not (prints[:, i] == prints[0, i]).all()]

    def replica_ids(self) -> list[int]:
        """The ids in sync group of this worker's replicas, in the order of its local results."""
        if self._replica_ids is None:
            strategy = self.strategy

            @tf.function
            def ids():
                return strategy.experimental_local_results(strategy.run(
                    lambda: tf.distribute.get_replica_context().replica_id_in_sync_group))

            self._replica_ids = [int(i) for i in ids()]
        return self._replica_ids

    def count(self, this_worker: bool) -> int:
        """The number of replicas whose worker passed ``this_worker`` true (a collective: it is
        also where every worker waits for the others)."""
        strategy = self.strategy
        if self._count is None:
            @tf.function
            def count(flag):
                def replica_count():
                    return tf.distribute.get_replica_context().all_reduce(
                        tf.distribute.ReduceOp.SUM, tf.identity(flag))

                return strategy.experimental_local_results(strategy.run(replica_count))[0]

            self._count = count
        return int(self._count(tf.constant(int(this_worker), tf.int64)))

    def gather(self, selection: tuple[int, ...]) -> list[np.ndarray]:
        """Every replica's copy of the selected variables."""
        if selection not in self._gather_by_selection:
            tensors = [_components(self.variables[i]) for i in selection]
            strategy = self.strategy

            @tf.function
            def run():
                def replica_copies():
                    context = tf.distribute.get_replica_context()
                    return [context.all_gather(tf.identity(t)[None], axis=0) for t in tensors]

                return [strategy.experimental_local_results(copies)[0]
                        for copies in strategy.run(replica_copies)]

            self._gather_by_selection[selection] = run
        return [np.asarray(copies) for copies in self._gather_by_selection[selection]()]


# Each model's gatherer (its functions are traced once per model and strategy).
_gatherers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _gatherer(model: keras.Model, strategy: tf.distribute.Strategy) -> _Gatherer:
    gatherer = _gatherers.get(model)
    if gatherer is None or gatherer.strategy is not strategy:
        gatherer = _gatherers[model] = _Gatherer(model, strategy)
    return gatherer


def gather(model: keras.Model, strategy: tf.distribute.Strategy | None = None) -> Copies:
    """Every replica's copy of each of ``model``'s variables whose copies differ now.

    Every worker of a multi-worker job must call it at the same point (it runs collectives).

    Args:
        model: A model built under ``strategy``.
        strategy: Its strategy (default: the model's ``distribute_strategy``).

    Returns:
        The copies by the variable's place in ``model.variables`` (empty when all replicas
        agree, or there is one replica).
    """
    strategy = strategy or model.distribute_strategy
    if strategy is None or strategy.num_replicas_in_sync == 1:
        return {}
    gatherer = _gatherer(model, strategy)
    selection = tuple(gatherer.differing())
    if not selection:
        return {}
    values = gatherer.gather(selection)
    return {gatherer.places[i][0]: value for i, value in zip(selection, values)}


def scatter(model: keras.Model, copies: Mapping[int, np.ndarray],
            strategy: tf.distribute.Strategy | None = None) -> None:
    """Gives each replica its own copy of the variables in ``copies`` (from :func:`gather`).

    Where the copies are of another number of replicas, each replica gets their mean. Runs no
    collective: each worker sets its own replicas.

    Args:
        model: A model built under ``strategy``, its variables restored from the same save.
        copies: The copies by the variable's place in ``model.variables``.
        strategy: Its strategy (default: the model's ``distribute_strategy``).

    Raises:
        ValueError: If a copy's place or shape is not one of the model's variables.
    """
    if not copies:
        return
    strategy = strategy or model.distribute_strategy
    variables = list(model.variables)
    replicas = strategy.num_replicas_in_sync if strategy is not None else 1
    _check_fit(model, copies)
    own: list[tuple[Any, np.ndarray]] = []  # Variables whose replicas get their own copies.
    for place, saved in copies.items():
        variable = variables[place]
        if saved.shape[0] == replicas and replicas > 1:
            own.append((_components(variable), saved))
            continue
        if saved.shape[0] != replicas:
            logging.info("The replicas' own copies of %s were saved by %d replicas; each of the "
                         "%d replicas now starts from their mean.", variable.path,
                         saved.shape[0], replicas)
        variable.assign(np.mean(saved.astype(np.float64), axis=0).astype(saved.dtype))
    if own:
        _assign_per_replica(own, strategy)


def _assign_per_replica(own: list[tuple[Any, np.ndarray]],
                        strategy: tf.distribute.Strategy) -> None:
    """Sets each replica's copy of each variable to its row of the saved copies."""
    targets = [target for target, _ in own]
    saved = [tf.constant(values) for _, values in own]

    @tf.function
    def assign():
        def own_copies():
            replica = tf.distribute.get_replica_context().replica_id_in_sync_group
            return [tf.gather(values, replica) for values in saved]

        per_replica = strategy.run(own_copies)
        for target, values in zip(targets, per_replica):
            strategy.extended.update(target, lambda var, x: var.assign(x), args=(values,),
                                     group=False)

    assign()


_FILE = re.compile(r"^replicas-(\d+)-(\d+)-of-(\d+)\.npz$")


def _file_name(first: int, last: int, total: int) -> str:
    return f"replicas-{first:05d}-{last:05d}-of-{total:05d}.npz"


def write(model: keras.Model, folder: str, strategy: tf.distribute.Strategy | None = None
          ) -> str | None:
    """Writes this worker's replicas' copies of each variable whose copies differ to ``folder``.

    Each worker writes one binary file of its own replicas (nothing when every replica agrees,
    or there is one): the cost per worker is that of its own replicas, however many workers
    there are. Every worker of a job must call it at the same point, with the same ``folder``
    (on storage they share), which should be empty: it runs two small collectives (the
    fingerprints, then the count of workers that wrote), so that it returns on every worker
    only once every worker's file is complete, or raises on every worker.

    Args:
        model: A model built under ``strategy``.
        folder: Where the files go (created if missing).
        strategy: Its strategy (default: the model's ``distribute_strategy``).

    Returns:
        The path of the file this worker wrote, or ``None`` when none was needed.

    Raises:
        OSError: If this worker, or another, could not write its file.
    """
    strategy = strategy or model.distribute_strategy
    if strategy is None or strategy.num_replicas_in_sync == 1:
        return None
    gatherer = _gatherer(model, strategy)
    selection = gatherer.differing()
    if not selection:
        return None
    total = strategy.num_replicas_in_sync
    error: OSError | None = None
    path = None
    try:
        own = {}
        for i in selection:
            place, variable = gatherer.places[i]
            own[place] = np.stack([np.asarray(copy) for copy in
                                   strategy.experimental_local_results(_components(variable))])
        path = write_own(folder, gatherer.replica_ids(), total, own)
    except OSError as e:
        error = e
    written = gatherer.count(error is None)
    if error is not None:
        raise error
    if written < total:
        raise OSError(f"the workers of {total - written} of the {total} replicas could not "
                      f"write their copies to {folder}")
    return path


def write_own(folder: str, replica_ids: list[int], total: int,
              copies: Mapping[int, np.ndarray]) -> str:
    """Writes one worker's file: its replicas' copies (rows in the order of ``replica_ids``,
    contiguous ids of ``total``) by the variable's place; returns its path. What :func:`write`
    does on each worker after the fingerprints, without a strategy (for benchmarks of the
    cost at a number of replicas this machine cannot run)."""
    arrays: dict[str, Any] = {"replica_ids": np.asarray(replica_ids, np.int64)}
    arrays.update({f"variable_{place}": value for place, value in copies.items()})
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, _file_name(min(replica_ids), max(replica_ids), total))
    with atomic_io.atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)
    return path


def read_own(folder: str, replica_ids: list[int]) -> Copies:
    """One worker's copies from ``folder``, read from the files of its replicas only: each
    variable's rows in the order of ``replica_ids``.

    Raises:
        ValueError: If the files do not cover every replica once, or are not readable.
    """
    files, _ = _files(folder)
    wanted = set(replica_ids)
    own = [name for name, (first, last, _) in files.items()
           if first <= max(wanted) and last >= min(wanted)]
    return {place: np.stack([by_id[i] for i in replica_ids])
            for place, by_id in _rows(folder, own, wanted).items()}


def _files(folder: str) -> tuple[dict[str, tuple[int, int, int]], int]:
    """The files of ``folder`` by name (their first and last replica, and of how many), and
    the number of replicas that saved (0: none saved).

    Raises:
        ValueError: If the files do not cover every replica once.
    """
    files = {}
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        for name in os.listdir(folder):
            match = _FILE.match(name)
            if match:
                first, last, total = (int(group) for group in match.groups())
                files[name] = (first, last, total)
    if not files:
        return files, 0
    totals = {total for _, _, total in files.values()}
    covered = sorted(i for first, last, _ in files.values() for i in range(first, last + 1))
    if len(totals) != 1 or covered != list(range(next(iter(totals)))):
        raise ValueError(f"The replicas' copies in {folder} do not cover each replica once "
                         f"({', '.join(sorted(files))}).")
    return files, totals.pop()


def read(model: keras.Model, folder: str, strategy: tf.distribute.Strategy | None = None
         ) -> bool:
    """Gives each replica its own copy of what :func:`write` saved in ``folder``.

    On the number of replicas that saved, each worker opens only the file of its own replicas;
    on another number (an elastic job shrank or grew), each replica gets the mean of all the
    saved copies, summed in the replicas' order (the same on every worker). Runs no collective.

    Args:
        model: A model built under ``strategy``, its variables restored from the same save.
        folder: The folder :func:`write` wrote.
        strategy: Its strategy (default: the model's ``distribute_strategy``).

    Returns:
        Whether copies were saved there (none: every replica's copy was the same).

    Raises:
        ValueError: If the files do not cover every replica once, or do not fit the model.
    """
    files, saved_total = _files(folder)
    if not files:
        return False
    strategy = strategy or model.distribute_strategy
    replicas = strategy.num_replicas_in_sync if strategy is not None else 1
    if replicas == saved_total:
        ids = _gatherer(model, strategy).replica_ids()
        copies = read_own(folder, ids)
        _check_fit(model, copies)
        _assign_own(model, copies, strategy)
        return True
    means = read_mean(folder)
    logging.info("The replicas' own copies in %s were saved by %d replicas; each of the %d "
                 "replicas now starts from their mean.", folder, saved_total, replicas)
    _check_fit(model, means)
    variables = list(model.variables)
    for place, mean in means.items():
        variables[place].assign(mean[0])
    return True


def read_mean(folder: str) -> Copies:
    """The mean of every replica's saved copy of each variable in ``folder``, summed in float64
    in the replicas' order (the same on every worker), one row each: what each replica of
    another number of replicas starts from (an elastic job that shrank or grew).

    Raises:
        ValueError: If the files do not cover every replica once, or are not readable.
    """
    files, saved_total = _files(folder)
    rows = _rows(folder, sorted(files, key=lambda name: files[name][0]), None)
    means = {}
    for place, by_id in rows.items():
        total = np.zeros(next(iter(by_id.values())).shape, np.float64)
        for i in sorted(by_id):
            total += by_id[i]
        means[place] = (total / saved_total).astype(by_id[i].dtype)[None]
    return means


def _rows(folder: str, names: list[str], ids: set[int] | None) -> dict[int, dict[int, np.ndarray]]:
    """Each saved variable's copies in the files ``names``, by place and replica id (only the
    replicas in ``ids``, or all)."""
    rows: dict[int, dict[int, np.ndarray]] = {}
    for name in names:
        try:
            with np.load(os.path.join(folder, name), allow_pickle=False) as data:
                replica_ids = [int(i) for i in data["replica_ids"]]
                for key in data.files:
                    if not key.startswith("variable_"):
                        continue
                    copies = data[key]
                    for row, replica in enumerate(replica_ids):
                        if ids is None or replica in ids:
                            rows.setdefault(int(key[len("variable_"):]), {})[replica] = copies[row]
        except (OSError, KeyError, ValueError) as e:
            raise ValueError(f"The replicas' copies in {os.path.join(folder, name)} are not "
                             f"readable ({type(e).__name__}: {e}).") from None
    return rows


def _check_fit(model: keras.Model, copies: Mapping[int, np.ndarray]) -> None:
    variables = list(model.variables)
    for place, saved in copies.items():
        if not 0 <= place < len(variables):
            raise ValueError(f"The saved replicas' copies are of variable {place}; the model "
                             f"has {len(variables)}.")
        if tuple(saved.shape[1:]) != tuple(variables[place].shape):
            raise ValueError(f"The saved replicas' copies of {variables[place].path} have shape "
                             f"{tuple(saved.shape[1:])}; the variable has "
                             f"{tuple(variables[place].shape)}.")


def _assign_own(model: keras.Model, copies: Mapping[int, np.ndarray],
                strategy: tf.distribute.Strategy) -> None:
    """Sets each of this worker's replicas' copy of each variable to its row of ``copies``
    (rows in the order of the worker's local results)."""
    variables = list(model.variables)
    for place, rows in copies.items():
        for copy, row in zip(strategy.experimental_local_results(_components(variables[place])),
                             rows):
            copy.assign(row)


def encode(copies: Mapping[int, np.ndarray]) -> dict[str, Any]:
    """``copies`` as JSON-ready data that :func:`decode` reads back bit for bit.

    Deprecated: :func:`write` saves each worker's copies in a binary file of its own.
    """
    warnings.warn("tfpar.replica_copies.encode is deprecated; use tfpar.replica_copies.write "
                  "(a binary file per worker).", DeprecationWarning, stacklevel=2)
    return {str(place): {"dtype": str(value.dtype), "shape": list(value.shape),
                         "values": value.ravel().tolist()} for place, value in copies.items()}


def decode(data: Mapping[str, Any]) -> Copies:
    """The copies :func:`encode` wrote.

    Deprecated: :func:`read` reads what :func:`write` saved.

    Raises:
        ValueError: If ``data`` is not what :func:`encode` writes.
    """
    warnings.warn("tfpar.replica_copies.decode is deprecated; use tfpar.replica_copies.read.",
                  DeprecationWarning, stacklevel=2)
    return decode_json(data)


def decode_json(data: Mapping[str, Any]) -> Copies:
    """The copies of a save made before :func:`write` (tfpar 0.3's JSON), for its restore.

    Raises:
        ValueError: If ``data`` is not such copies.
    """
    try:
        return {int(place): np.asarray(entry["values"], dtype=entry["dtype"]).reshape(
            entry["shape"]) for place, entry in data.items()}
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"Not saved replicas' copies ({type(e).__name__}: {e}).") from None
