"""Tests of input pipelines: global batches, per-epoch orders, distribution."""

import tensorflow as tf

from tfpar import data
from tfpar import testing


class PipelineTest(testing.StrategyTestCase):

    def test_batches_by_global_batch_size_keeping_the_remainder(self):
        dataset = tf.data.Dataset.range(10)
        sizes = [len(b) for b in data.pipeline(dataset, 4)]
        self.assertEqual(sizes, [4, 4, 2])

    def test_epoch_stream_permutes_each_epoch_and_resumes_exactly(self):
        examples = tf.data.Dataset.from_tensor_slices((tf.range(10), tf.range(10)))
        stream = data.epoch_stream(examples, 10, 4, seed=3)
        batches = [y.numpy().tolist() for _, y in stream.take(6)]
        self.assertEqual([len(b) for b in batches], [4, 4, 2, 4, 4, 2])
        epoch0, epoch1 = sum(batches[:3], []), sum(batches[3:], [])
        self.assertCountEqual(epoch0, range(10))
        self.assertCountEqual(epoch1, range(10))
        self.assertNotEqual(epoch0, epoch1)
        resumed = data.epoch_stream(examples, 10, 4, seed=3, first_epoch=1)
        self.assertEqual([y.numpy().tolist() for _, y in resumed.take(3)], batches[3:])
        # The epoch-ending form gives every epoch the same batches.
        batches_of, epoch = data.epoch_batches(examples, 10, 4, seed=3)
        epoch.assign(1)
        self.assertEqual([y.numpy().tolist() for _, y in batches_of], batches[3:])

    def test_epoch_stream_says_it_is_endless(self):
        # tf.distribute skips its per-step cross-worker check for a batch left only on a
        # dataset whose cardinality is infinite (flat_map alone reports it unknown).
        examples = tf.data.Dataset.from_tensor_slices((tf.range(10), tf.range(10)))
        stream = data.epoch_stream(examples, 10, 4, seed=3)
        self.assertEqual(int(stream.cardinality()), tf.data.INFINITE_CARDINALITY)

    def test_epoch_batches_permute_each_epoch_and_resume_exactly(self):
        examples = tf.data.Dataset.from_tensor_slices((tf.range(10), tf.range(10)))
        batches, epoch = data.epoch_batches(examples, 10, 4, seed=3)
        self.assertEqual(int(batches.cardinality()), 3)
        epochs = []
        for e in range(2):
            epoch.assign(e)
            epochs.append([y.numpy().tolist() for _, y in batches])
        self.assertEqual([[len(b) for b in bs] for bs in epochs], [[4, 4, 2]] * 2)
        epoch0, epoch1 = sum(epochs[0], []), sum(epochs[1], [])
        self.assertCountEqual(epoch0, range(10))
        self.assertCountEqual(epoch1, range(10))
        self.assertNotEqual(epoch0, epoch1)
        # A fresh pipeline (a resumed run) gives epoch 1 the same batches.
        resumed, resumed_epoch = data.epoch_batches(examples, 10, 4, seed=3)
        resumed_epoch.assign(1)
        self.assertEqual([y.numpy().tolist() for _, y in resumed], epochs[1])

    def test_distribute_splits_each_batch_over_replicas(self):
        strategy = self.strategy("mirrored", 2)
        batches = list(data.distribute(strategy, tf.data.Dataset.range(6).batch(6)))
        shards = strategy.experimental_local_results(batches[0])
        self.assertEqual([s.numpy().tolist() for s in shards], [[0, 1, 2], [3, 4, 5]])


if __name__ == "__main__":
    tf.test.main()
