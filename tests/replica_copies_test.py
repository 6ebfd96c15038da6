"""Tests of each replica's own copy of what replicas update apart: gathered, written, given back
per replica, and their mean where the number of replicas changed."""

import json
import os

import keras
import numpy as np
import tensorflow as tf

from tfpar import replica_copies
from tfpar import testing


def batchnorm_model():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3),
                              keras.layers.BatchNormalization(momentum=0.5),
                              keras.layers.Dense(2, trainable=False)])  # Frozen: not gathered.
    model.compile(optimizer="sgd", loss="mse")
    return model


def own_copies(variable):
    return [c.numpy() for c in variable.value.values]


class ReplicaCopiesTest(testing.StrategyTestCase):

    def trained(self, replicas):
        strategy = self.strategy("mirrored", replicas)
        with strategy.scope():
            model = batchnorm_model()
        x = np.random.default_rng(0).random((12, 4), dtype=np.float32)
        model.fit(x, np.ones((12, 2), np.float32), batch_size=12, epochs=1, shuffle=False,
                  verbose=0)
        return model

    def test_only_the_copies_that_differ_are_gathered_and_they_come_back_per_replica(self):
        model = self.trained(2)
        copies = replica_copies.gather(model)
        paths = sorted(model.variables[place].path.rsplit("/", 1)[1] for place in copies)
        self.assertEqual(paths, ["moving_mean", "moving_variance"])
        for place, saved in copies.items():
            self.assertEqual(saved.shape, (2, 3))
            self.assertNotAllClose(saved[0], saved[1])  # Each replica's shard differed.
            self.assertAllEqual(saved, np.stack(own_copies(model.variables[place])))
        # Given back to a fresh model of the same build, replica by replica.
        fresh = self.trained(2)
        replica_copies.scatter(fresh, copies)
        for place in copies:
            self.assertAllEqual(np.stack(own_copies(fresh.variables[place])), copies[place])

    def test_written_per_worker_in_binary_and_read_back_bit_for_bit(self):
        model = self.trained(2)
        copies = replica_copies.gather(model)
        folder = os.path.join(self.get_temp_dir(), "copies")
        replica_copies.write(model, folder)
        # One process holds both replicas: one file, binary.
        self.assertEqual(os.listdir(folder), ["replicas-00000-00001-of-00002.npz"])
        self.assertEqual(replica_copies.read_own(folder, [1, 0]).keys(), copies.keys())
        for place, rows in replica_copies.read_own(folder, [1, 0]).items():
            self.assertAllEqual(rows.view(np.uint32), copies[place][::-1].view(np.uint32))
        fresh = self.trained(2)
        self.assertTrue(replica_copies.read(fresh, folder))
        for place in copies:
            self.assertAllEqual(np.stack(own_copies(fresh.variables[place])), copies[place])
        # On 4 replicas: the mean of the saved copies, on each.
        four = self.trained(4)
        self.assertTrue(replica_copies.read(four, folder))
        for place, saved in copies.items():
            for copy in own_copies(four.variables[place]):
                self.assertAllClose(copy, saved.mean(axis=0), rtol=1e-6)

    def test_nothing_is_written_when_the_copies_agree_and_nothing_read(self):
        strategy = self.strategy("mirrored", 2)
        with strategy.scope():
            model = batchnorm_model()
        folder = os.path.join(self.get_temp_dir(), "agree")
        replica_copies.write(model, folder)
        self.assertFalse(os.path.exists(folder))
        self.assertFalse(replica_copies.read(model, folder))

    def test_files_that_do_not_cover_each_replica_once_are_refused(self):
        folder = os.path.join(self.get_temp_dir(), "torn")
        row = {3: np.zeros((2, 3), np.float32)}
        replica_copies.write_own(folder, [0, 1], 4, row)  # Replicas 2 and 3 never wrote.
        with self.assertRaisesRegex(ValueError, r"do not cover each replica once \("
                                    r"replicas-00000-00001-of-00004\.npz\)"):
            replica_copies.read(self.trained(2), folder)
        replica_copies.write_own(folder, [2, 3], 4, row)
        self.assertLen(replica_copies.read_own(folder, [2, 3])[3], 2)

    def test_the_mean_of_every_workers_file_is_summed_in_float64_in_replica_order(self):
        folder = os.path.join(self.get_temp_dir(), "mean")
        big, small = np.float32(2.0**24), np.float32(1.0)
        # Replicas 2**24, 1, 1, -2**24 (the second file written first): a float32 sum in
        # replica order drops both ones (2**24 + 1 rounds to 2**24) and gives 0.
        replica_copies.write_own(folder, [2, 3], 4, {5: np.array([[small], [-big]])})
        replica_copies.write_own(folder, [0, 1], 4, {5: np.array([[big], [small]])})
        mean = replica_copies.read_mean(folder)
        self.assertEqual(list(mean), [5])
        self.assertEqual(mean[5].dtype, np.float32)
        self.assertAllEqual(mean[5], [[0.5]])  # (2**24 + 1 + 1 - 2**24) / 4, exactly.

    def test_the_json_functions_are_deprecated_and_still_read_back_bit_for_bit(self):
        copies = replica_copies.gather(self.trained(2))
        with self.assertWarnsRegex(DeprecationWarning, "use tfpar.replica_copies.write"):
            data = json.loads(json.dumps(replica_copies.encode(copies)))
        with self.assertWarnsRegex(DeprecationWarning, "use tfpar.replica_copies.read"):
            decoded = replica_copies.decode(data)
        for place in copies:
            self.assertAllEqual(decoded[place], copies[place])

    def test_a_changed_number_of_replicas_gets_the_mean(self):
        copies = replica_copies.gather(self.trained(2))
        four = self.trained(4)
        with self.assertLogs(logger="absl", level="INFO") as logs:  # Whatever its verbosity.
            replica_copies.scatter(four, copies)
        self.assertIn("saved by 2 replicas; each of the 4 replicas now starts from their mean",
                      logs.output[0])
        for place, saved in copies.items():
            for copy in own_copies(four.variables[place]):
                self.assertAllClose(copy, saved.mean(axis=0), rtol=1e-6)

    def test_nothing_is_gathered_on_one_replica_or_when_copies_agree(self):
        self.assertEqual(replica_copies.gather(self.trained(1)), {})
        strategy = self.strategy("mirrored", 2)
        with strategy.scope():
            model = batchnorm_model()  # Not trained: every copy is the initial value.
        self.assertEqual(replica_copies.gather(model), {})

    def test_copies_that_differ_in_any_bit_are_gathered(self):
        # Sums of the values, their squares and their positions agree for each of these pairs.
        pairs = {"permuted": ([1, 0, 0, 1], [0, 1, 1, 0]),
                 "one_ulp_beside_a_large_value": (
                     [1e8, 1.0, 0, 0], [1e8, float(np.nextafter(np.float32(1), 2)), 0, 0]),
                 "signed_zero": ([0.0, 1, 2, 3], [-0.0, 1, 2, 3])}
        strategy = self.strategy("mirrored", 2)
        with strategy.scope():
            model = keras.Sequential([keras.Input((4,)), keras.layers.BatchNormalization()])
        (place,) = [i for i, v in enumerate(model.variables) if v.path.endswith("moving_mean")]
        mean = model.variables[place]
        for name, (first, second) in pairs.items():
            with self.subTest(name):
                for copy, values in zip(mean.value.values, (first, second)):
                    copy.assign(np.asarray(values, np.float32))
                copies = replica_copies.gather(model)
                self.assertIn(place, copies)
                self.assertAllEqual(
                    copies[place].view(np.uint32),
                    np.asarray([first, second], np.float32).view(np.uint32))

    def test_copies_that_do_not_fit_the_model_are_refused(self):
        model = self.trained(2)
        with self.assertRaisesRegex(ValueError, r"have shape \(5,\); the variable has \(3,\)"):
            replica_copies.scatter(model, {3: np.zeros((2, 5), np.float32)})
        with self.assertRaisesRegex(ValueError, r"are of variable 99; the model has"):
            replica_copies.scatter(model, {99: np.zeros((2, 3), np.float32)})
        with self.assertRaisesRegex(ValueError, "Not saved replicas' copies"):
            replica_copies.decode_json({"3": {"values": [1.0]}})


if __name__ == "__main__":
    tf.test.main()
