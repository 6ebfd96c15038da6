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

Savers beside a checkpoint use :func:`write_files` and :func:`read`, whose cost per worker does
not grow with the number of workers: each worker writes its own replicas' copies to a file of
its own and a restore on the same number of replicas opens only its own; nothing is gathered
across workers but the fingerprints and one count of the workers that wrote. The files, the list
a save records of them and the checks a restore holds them to are
:mod:`tfpar.replica_copy_files`'.

Which variables differ is decided by comparing fingerprints (two hashes of each copy's raw
bytes, so copies that differ in any bit differ) gathered from every replica: one small
collective, so a frozen backbone's large non-trainable weights, equal everywhere, are never
gathered.

Why one module of this length: what differs is found, written and given back through one
model's compiled gathering functions (``_Gatherer``), built once per model and strategy and
shared by the save and the restore; the files themselves are :mod:`tfpar.replica_copy_files`'.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
import weakref
from collections.abc import Mapping
from typing import Any

import keras
import numpy as np
import tensorflow as tf
from absl import logging

from tfpar.replica_copy_files import UNRECORDED
from tfpar.replica_copy_files import Copies
from tfpar.replica_copy_files import FileList
from tfpar.replica_copy_files import damaged
from tfpar.replica_copy_files import decode_json
from tfpar.replica_copy_files import file_name
from tfpar.replica_copy_files import fingerprint
from tfpar.replica_copy_files import fingerprint_text
from tfpar.replica_copy_files import read_mean
from tfpar.replica_copy_files import read_own
from tfpar.replica_copy_files import saved_layout
from tfpar.replica_copy_files import write_own


def _components(variable: keras.Variable) -> Any:
    """The ``tf.Variable`` behind a Keras variable (a distributed one under a strategy)."""
    return getattr(variable, "value", variable)


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

        #: The fingerprints of every replica's copy at the last :meth:`differing`
        #: ([replicas, variables, 2]) and each replica's worker's first and last replica id.
        self.prints: np.ndarray | None = None
        self.ranges: np.ndarray | None = None
        self._fingerprints: Any = None

    def fingerprints(self) -> tuple[np.ndarray, np.ndarray]:
        """Every replica's fingerprints of each variable, and its worker's replica range, in
        the order of the replicas' ids (a collective)."""
        if self._fingerprints is None:
            strategy = self.strategy
            tensors = [_components(v) for v in self.variables]
            ids = self.replica_ids()
            own_range = tf.constant([[min(ids), max(ids)]], tf.int64)

            @tf.function
            def fingerprints():
                def replica_fingerprints():
                    # In a replica context, reading a mirrored variable gives this replica's
                    # copy.
                    prints = tf.stack([fingerprint(tf.identity(t)) for t in tensors])
                    context = tf.distribute.get_replica_context()
                    return (context.all_gather(prints[None], axis=0),
                            context.all_gather(own_range, axis=0))

                prints, ranges = strategy.run(replica_fingerprints)
                return (strategy.experimental_local_results(prints)[0],
                        strategy.experimental_local_results(ranges)[0])

            self._fingerprints = fingerprints
        prints, ranges = self._fingerprints()
        return prints.numpy(), ranges.numpy()

    def differing(self) -> list[int]:
        """Indices into ``variables`` of those whose copies differ between replicas."""
        if not self.variables:
            return []
        self.prints, self.ranges = self.fingerprints()
        prints = self.prints  # [replicas, variables, 2]
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


@dataclasses.dataclass(frozen=True)
class Written:
    """What :func:`write_files` wrote.

    Attributes:
        path: The file this worker wrote (``None``: none was needed).
        files: The list of every worker's file, the same on every worker (``None``: no file
            was written, every replica's copy was the same): each file's name, its replicas'
            ids and the fingerprints of each copy it holds. A restore given it
            (:func:`read`'s ``files``) reads exactly these files and refuses any that is
            missing or differs from what was written.
    """

    path: str | None
    files: FileList | None


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
    return write_files(model, folder, strategy).path


def write_files(model: keras.Model, folder: str,
                strategy: tf.distribute.Strategy | None = None) -> Written:
    """:func:`write`, also returning the list of every worker's file, for the save to record.

    Args:
        model: A model built under ``strategy``.
        folder: Where the files go (created if missing).
        strategy: Its strategy (default: the model's ``distribute_strategy``).

    Returns:
        This worker's file and the list of every worker's (see :class:`Written`).

    Raises:
        OSError: If this worker, or another, could not write its file.
    """
    strategy = strategy or model.distribute_strategy
    if strategy is None or strategy.num_replicas_in_sync == 1:
        return Written(None, None)
    gatherer = _gatherer(model, strategy)
    selection = gatherer.differing()
    if not selection:
        return Written(None, None)
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
    assert gatherer.prints is not None and gatherer.ranges is not None
    files: dict[str, Any] = {}
    for first, last in sorted({(int(a), int(b)) for a, b in gatherer.ranges}):
        files[file_name(first, last, total)] = {
            "replica_ids": list(range(first, last + 1)),
            "variables": {str(gatherer.places[i][0]): [
                fingerprint_text(gatherer.prints[replica, i])
                for replica in range(first, last + 1)]
                for i in selection}}
    return Written(path, {"replicas": total, "files": files})


def read(model: keras.Model, folder: str, strategy: tf.distribute.Strategy | None = None,
         files: FileList | None = UNRECORDED) -> bool:
    """Gives each replica its own copy of what :func:`write` saved in ``folder``.

    On the number of replicas that saved, each worker opens only the file of its own replicas;
    on another number (an elastic job shrank or grew), each replica gets the mean of all the
    saved copies, summed in the replicas' order (the same on every worker). Runs no collective.

    Args:
        model: A model built under ``strategy``, its variables restored from the same save.
        folder: The folder :func:`write` wrote.
        strategy: Its strategy (default: the model's ``distribute_strategy``).
        files: The save's list of its files (:attr:`Written.files`; ``None``: the save wrote
            none, and ``folder`` is not read): each file read must be there, readable and as
            written (its replicas and the fingerprints of its copies). :data:`UNRECORDED`
            (saves made before the list was kept): the files found in ``folder`` are read.

    Returns:
        Whether copies were saved there (none: every replica's copy was the same).

    Raises:
        DamagedStateError: If a file is missing, not readable, or not what was written (or,
            unrecorded, the files do not cover every replica once).
        ValueError: If the copies do not fit the model.
    """
    layout, saved_total = saved_layout(folder, files)
    if not layout:
        return False
    if files is not UNRECORDED:
        # Every worker sees a file missing, not only its owner: the job stops as one.
        for name in sorted(layout):
            if not os.path.exists(os.path.join(folder, name)):
                raise damaged(os.path.join(folder, name), "saved with this state is missing",
                               "no such file")
    strategy = strategy or model.distribute_strategy
    replicas = strategy.num_replicas_in_sync if strategy is not None else 1
    if replicas == saved_total:
        ids = _gatherer(model, strategy).replica_ids()
        copies = read_own(folder, ids, files)
        _check_fit(model, copies)
        _assign_own(model, copies, strategy)
        return True
    means = read_mean(folder, files)
    logging.info("The replicas' own copies in %s were saved by %d replicas; each of the %d "
                 "replicas now starts from their mean.", folder, saved_total, replicas)
    _check_fit(model, means)
    variables = list(model.variables)
    for place, mean in means.items():
        variables[place].assign(mean[0])
    return True


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
    warnings.warn("tfpar.replica_copies.encode is deprecated and will be removed in tfpar "
                  "0.5.0; use tfpar.replica_copies.write (a binary file per worker).",
                  DeprecationWarning, stacklevel=2)
    return {str(place): {"dtype": str(value.dtype), "shape": list(value.shape),
                         "values": value.ravel().tolist()} for place, value in copies.items()}


def decode(data: Mapping[str, Any]) -> Copies:
    """The copies :func:`encode` wrote.

    Deprecated: :func:`read` reads what :func:`write` saved.

    Raises:
        ValueError: If ``data`` is not what :func:`encode` writes.
    """
    warnings.warn("tfpar.replica_copies.decode is deprecated and will be removed in tfpar "
                  "0.5.0; use tfpar.replica_copies.read.", DeprecationWarning, stacklevel=2)
    return decode_json(data)


