"""Input pipelines: batches of the *global* batch size, per-epoch orders, distribution.

:func:`pipeline` caches, shuffles, batches and prefetches; :func:`epoch_stream` and
:func:`epoch_batches` give each epoch an order that depends only on ``(seed, epoch)`` (so a
resumed run sees the batches an uninterrupted one sees); :func:`distribute` shards batches over
a strategy's replicas.
"""

from __future__ import annotations

import tensorflow as tf


def pipeline(dataset: tf.data.Dataset, global_batch_size: int, *, shuffle: bool = False,
             seed: int | None = None) -> tf.data.Dataset:
    """Caches, optionally shuffles, batches by the global batch size and prefetches.

    Args:
        dataset: Unbatched ``(image, label)`` examples.
        global_batch_size: Examples per step over all replicas.
        shuffle: Reshuffle every epoch.
        seed: Shuffle seed (for reproducible runs).

    Returns:
        The batched dataset.
    """
    dataset = dataset.cache()
    if shuffle:
        dataset = dataset.shuffle(10_000, seed=seed, reshuffle_each_iteration=True)
    return dataset.batch(global_batch_size).prefetch(tf.data.AUTOTUNE)


def _epoch_of_batches(images: tf.Tensor, labels: tf.Tensor, global_batch_size: int, seed: int,
                      epoch: tf.Tensor) -> tf.data.Dataset:
    """The batches of one epoch: a stateless index shuffle of ``(seed, epoch)``, then batched."""
    num_examples = images.shape[0]
    order = tf.random.experimental.index_shuffle(
        tf.range(num_examples, dtype=tf.int64),
        seed=tf.stack([tf.cast(seed, tf.int64), tf.cast(epoch, tf.int64)]),
        max_index=tf.constant(num_examples - 1, tf.int64))
    return (tf.data.Dataset.from_tensor_slices(order).batch(global_batch_size)
            .map(lambda i: (tf.gather(images, i), tf.gather(labels, i))))


def epoch_stream(dataset: tf.data.Dataset, num_examples: int, global_batch_size: int, *,
                 seed: int, first_epoch: int = 0) -> tf.data.Dataset:
    """Batches of every epoch from ``first_epoch`` on, each epoch a fresh permutation.

    Epoch ``e``'s order is a pure function of ``(seed, e)`` (a stateless index shuffle), not
    of how many iterators were made before, so a run resumed at epoch ``e`` sees exactly the
    batches an uninterrupted run sees from epoch ``e`` on. Every epoch ends with its own
    partial batch. The stream never ends: train on it with ``steps_per_epoch`` a multiple of
    ``steps_per_execution`` (else use :func:`epoch_batches`). The examples are held in memory
    (the datasets here are small).

    Args:
        dataset: Unbatched ``(image, label)`` examples.
        num_examples: Their number.
        global_batch_size: Examples per step over all replicas.
        seed: Shuffle seed.
        first_epoch: The first epoch to produce.

    Returns:
        An endless dataset of batches.
    """
    images, labels = dataset.batch(num_examples).get_single_element()
    return (tf.data.Dataset.counter(first_epoch)
            .flat_map(lambda e: _epoch_of_batches(images, labels, global_batch_size, seed, e))
            # flat_map hides that the stream is endless. Declared, it spares every step of a
            # multi-worker job a collective: on a dataset that may end, tf.distribute first
            # all-reduces across the workers whether any has a batch left.
            .apply(tf.data.experimental.assert_cardinality(tf.data.INFINITE_CARDINALITY))
            .prefetch(tf.data.AUTOTUNE))


def epoch_batches(dataset: tf.data.Dataset, num_examples: int, global_batch_size: int, *,
                  seed: int) -> tuple[tf.data.Dataset, tf.Variable]:
    """One epoch's batches, in the order :func:`epoch_stream` gives that epoch.

    Iterating the dataset gives the batches of the epoch held by the returned variable at
    that moment (set it before each epoch, e.g. in a callback's ``on_epoch_begin``). The
    dataset *ends* with the epoch, so however many steps one compiled call runs, no epoch
    runs a step of the next. The price: Keras makes a new iterator every epoch (slow for short
    epochs), so prefer :func:`epoch_stream` where it is exact.

    Args:
        dataset: Unbatched ``(image, label)`` examples.
        num_examples: Their number.
        global_batch_size: Examples per step over all replicas.
        seed: Shuffle seed.

    Returns:
        The dataset (its cardinality is the epoch's number of batches) and the epoch
        variable (int64) it reads.
    """
    images, labels = dataset.batch(num_examples).get_single_element()
    with tf.init_scope():  # A plain variable, outside any strategy's scope.
        epoch = tf.Variable(0, dtype=tf.int64, trainable=False, name="data_epoch")
    steps = -(-num_examples // global_batch_size)
    batched = (tf.data.Dataset.from_tensors(0)
               .flat_map(lambda _: _epoch_of_batches(images, labels, global_batch_size, seed,
                                                     epoch.read_value()))
               .apply(tf.data.experimental.assert_cardinality(steps))
               .prefetch(tf.data.AUTOTUNE))
    return batched, epoch


def distribute(strategy: tf.distribute.Strategy, dataset: tf.data.Dataset
               ) -> tf.distribute.DistributedDataset:
    """Splits each global batch over the strategy's replicas.

    Sharding across workers is by data (every worker reads the same input and keeps its part
    of every batch), set explicitly so TensorFlow does not try, and warn about, file sharding.

    Args:
        strategy: The strategy.
        dataset: A dataset batched by the global batch size.

    Returns:
        The distributed dataset.
    """
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    return strategy.experimental_distribute_dataset(dataset.with_options(options))
