"""Hand-written all-reduce algorithms for the data-parallel loop, run inside a replica context.

Every algorithm returns, on every replica, the element-wise sum over replicas of each input:

* ``collective``: TensorFlow's own, ``ReplicaContext.all_reduce`` (NCCL, ring or reduction to
  one device, as the strategy's cross-device ops decide; the only one that crosses workers).
* ``naive``: the textbook all-reduce: every replica's tensor is copied to the first device
  and summed there, then the sum is copied back to every device.
* ``ring``: reduce-scatter then all-gather. The tensor is cut into one slice per device; the
  partial sum of slice ``c`` travels around the ring of devices starting at device ``c``,
  each adding its own slice, so every device reduces a different slice with the same traffic;
  the reduced slices are then gathered onto every device (each device aggregates different
  parameters).

Tensors are first packed into buckets of at most ``bytes_per_pack`` bytes (one flat tensor per
bucket and dtype), so the number of reductions does not grow with the number of variables;
``bytes_per_pack=0`` reduces every tensor on its own. Buckets are reduced one by one in the
order of the tensors given, each as soon as its own tensors exist: given the gradients from
the last layer to the first, the reductions overlap the rest of the backward pass (PyTorch
DDP's reverse-order buckets; TensorFlow orders the collectives of a step as they are issued).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from collections.abc import Sequence

import tensorflow as tf

from tfpar.allreduce.options import ALGORITHMS  # noqa: F401  (documented here)
from tfpar.allreduce.options import DEFAULT_BYTES_PER_PACK
from tfpar.allreduce.options import check_algorithm
from tfpar.errors import OptionValueError


def pack(tensors: Sequence[tf.Tensor], bytes_per_pack: int) -> list[list[int]]:
    """Groups tensor indices into buckets of one dtype and at most ``bytes_per_pack`` bytes.

    Consecutive tensors of a dtype share a bucket until it would exceed the limit; a tensor
    larger than the limit gets a bucket of its own. ``bytes_per_pack <= 0`` gives one bucket
    per tensor.

    Args:
        tensors: Tensors with static shapes.
        bytes_per_pack: Bucket size limit in bytes.

    Returns:
        Lists of indices into ``tensors``, each one bucket.
    """
    if bytes_per_pack <= 0:
        return [[i] for i in range(len(tensors))]
    open_buckets: dict[tf.DType, tuple[list[int], int]] = {}
    buckets = []
    for i, t in enumerate(tensors):
        size = t.shape.num_elements() * t.dtype.size
        indices, used = open_buckets.get(t.dtype, ([], 0))
        if indices and used + size > bytes_per_pack:
            buckets.append(indices)
            indices, used = [], 0
        open_buckets[t.dtype] = (indices + [i], used + size)
    buckets.extend(indices for indices, _ in open_buckets.values() if indices)
    return sorted(buckets)


_communicating = [True]


@contextlib.contextmanager
def without_communication() -> Iterator[None]:
    """Steps traced inside reduce nothing: each replica keeps its own tensors.

    For measurement only (the benchmark times a step with and without its all-reduce): the
    replicas' weights drift apart, so nothing trained this way is meaningful.
    """
    _communicating.append(False)
    try:
        yield
    finally:
        _communicating.pop()


def all_reduce_sum(tensors: Sequence[tf.Tensor], algorithm: str = "collective",
                   bytes_per_pack: int = DEFAULT_BYTES_PER_PACK) -> list[tf.Tensor]:
    """Sums each tensor over all replicas; call it in a replica context (``strategy.run``).

    Args:
        tensors: This replica's tensors (static shapes).
        algorithm: One of :data:`ALGORITHMS`.
        bytes_per_pack: Bucket size for packing; 0 reduces each tensor separately.

    Returns:
        The sums, in the order and shapes of ``tensors``, identical on every replica.

    Raises:
        OptionValueError: If ``algorithm`` is unknown, or is not ``collective`` across
            workers.
    """
    check_algorithm(algorithm)
    tensors = list(tensors)
    context = tf.distribute.get_replica_context()
    if not tensors or context.num_replicas_in_sync == 1 or not _communicating[-1]:
        return tensors
    buckets = pack(tensors, bytes_per_pack)
    # Flattening is free (no copy); concatenating a bucket is one copy. Each bucket is its own
    # reduction, issued in the order of `tensors` and depending only on its own tensors, so it
    # can run as soon as they exist (while, for gradients, the backward pass goes on).
    flats = [tf.concat([tf.reshape(tensors[i], [-1]) for i in bucket], axis=0)
             if len(bucket) > 1 else tf.reshape(tensors[bucket[0]], [-1]) for bucket in buckets]
    totals = [total for flat in flats for total in _reduce([flat], algorithm, context)]
    reduced = [None] * len(tensors)
    for bucket, total in zip(buckets, totals):
        parts = tf.split(total, [tensors[i].shape.num_elements() for i in bucket]) \
            if len(bucket) > 1 else [total]
        for i, part in zip(bucket, parts):
            reduced[i] = tf.reshape(part, tensors[i].shape)
    return reduced


def _reduce(flats: list[tf.Tensor], algorithm: str, context: tf.distribute.ReplicaContext
            ) -> list[tf.Tensor]:
    if algorithm == "collective":
        return context.all_reduce(tf.distribute.ReduceOp.SUM, flats)
    strategy = context.strategy
    if len(strategy.extended.worker_devices) != strategy.num_replicas_in_sync:
        raise OptionValueError(f"All-reduce algorithm {algorithm!r} works within one process; "
                            "across workers use 'collective'.")
    merge = _naive if algorithm == "naive" else _ring
    return context.merge_call(lambda strategy, *parts: [merge(strategy, p) for p in parts],
                              args=tuple(flats))


def _devices_and_parts(strategy: tf.distribute.Strategy, per_replica):
    return list(strategy.extended.worker_devices), list(strategy.experimental_local_results(
        per_replica))


def _broadcast(strategy: tf.distribute.Strategy, make_value) -> tf.distribute.DistributedValues:
    # Runs make_value(replica_id) under each replica's device and returns the per-replica result,
    # which merge_call hands to each replica as its own component.
    return strategy.experimental_distribute_values_from_function(
        lambda ctx: make_value(ctx.replica_id_in_sync_group))


def _naive(strategy: tf.distribute.Strategy, per_replica) -> tf.distribute.DistributedValues:
    devices, parts = _devices_and_parts(strategy, per_replica)
    with tf.device(devices[0]):
        total = tf.add_n([tf.identity(p) for p in parts])
    return _broadcast(strategy, lambda _: tf.identity(total))


def _ring(strategy: tf.distribute.Strategy, per_replica) -> tf.distribute.DistributedValues:
    devices, parts = _devices_and_parts(strategy, per_replica)
    k = len(devices)
    n = parts[0].shape.num_elements()
    # Slice boundaries: slice sizes differ by at most one when n does not divide by k.
    bounds = [n * c // k for c in range(k + 1)]
    slices = [[part[bounds[c]:bounds[c + 1]] for c in range(k)] for part in parts]
    reduced = []
    for c in range(k):  # Reduce-scatter: slice c's sum travels c, c+1, ..., c-1 (mod k).
        acc = slices[c][c]
        for step in range(1, k):
            d = (c + step) % k
            with tf.device(devices[d]):
                acc = acc + slices[d][c]
        reduced.append(acc)
    # All-gather: every device concatenates the reduced slices.
    return _broadcast(strategy, lambda _: tf.concat([tf.identity(r) for r in reduced], axis=0))
