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
replica its own copy back. Savers store what :func:`gather` returns beside their checkpoint
(:func:`encode`, :func:`decode`); restorers call :func:`scatter` after restoring it. When the
number of replicas changed between the save and the restore (an elastic job shrank or grew),
there is no copy per replica to give: each replica starts from the mean of the saved copies,
which is what averaging at the epoch's end gives when the statistics are linear in their start
(BatchNorm's moving averages are), within float32 rounding.

Which variables differ is decided by comparing fingerprints (two hashes of each copy's raw
bytes, so copies that differ in any bit differ) gathered from every replica: one small
collective, so a frozen backbone's large non-trainable weights, equal everywhere, are never
gathered.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

import keras
import numpy as np
import tensorflow as tf
from absl import logging

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
    own: list[tuple[Any, np.ndarray]] = []  # Variables whose replicas get their own copies.
    for place, saved in copies.items():
        if not 0 <= place < len(variables):
            raise ValueError(f"The saved replicas' copies are of variable {place}; the model "
                             f"has {len(variables)}.")
        variable = variables[place]
        path = variable.path
        if tuple(saved.shape[1:]) != tuple(variable.shape):
            raise ValueError(f"The saved replicas' copies of {path} have shape "
                             f"{tuple(saved.shape[1:])}; the variable has "
                             f"{tuple(variable.shape)}.")
        if saved.shape[0] == replicas and replicas > 1:
            own.append((_components(variable), saved))
            continue
        if saved.shape[0] != replicas:
            logging.info("The replicas' own copies of %s were saved by %d replicas; each of the "
                         "%d replicas now starts from their mean.", path, saved.shape[0],
                         replicas)
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


def encode(copies: Mapping[int, np.ndarray]) -> dict[str, Any]:
    """``copies`` as JSON-ready data that :func:`decode` reads back bit for bit."""
    return {str(place): {"dtype": str(value.dtype), "shape": list(value.shape),
                         "values": value.ravel().tolist()} for place, value in copies.items()}


def decode(data: Mapping[str, Any]) -> Copies:
    """The copies :func:`encode` wrote.

    Raises:
        ValueError: If ``data`` is not what :func:`encode` writes.
    """
    try:
        return {int(place): np.asarray(entry["values"], dtype=entry["dtype"]).reshape(
            entry["shape"]) for place, entry in data.items()}
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"Not saved replicas' copies ({type(e).__name__}: {e}).") from None
