"""Tests of each replica's own copy of what replicas update apart: gathered, written, given back
per replica, and their mean where the number of replicas changed."""

import json
import os
import re
from unittest import mock

import keras
import numpy as np
import tensorflow as tf

from tfpar import replica_copies
from tfpar import replica_copy_files
from tfpar import testing
from tfpar.errors import DamagedStateError


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
        self.assertEqual(replica_copy_files.read_own(folder, [1, 0]).keys(), copies.keys())
        for place, rows in replica_copy_files.read_own(folder, [1, 0]).items():
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
        replica_copy_files.write_own(folder, [0, 1], 4, row)  # Replicas 2 and 3 never wrote.
        with self.assertRaisesRegex(DamagedStateError, r"do not cover each replica once \("
                                    r"replicas-00000-00001-of-00004\.npz\)"):
            replica_copies.read(self.trained(2), folder)
        replica_copy_files.write_own(folder, [2, 3], 4, row)
        self.assertLen(replica_copy_files.read_own(folder, [2, 3])[3], 2)

    def saved(self, replicas=2):
        """A trained model, the folder its copies were written to and the save's file list."""
        model = self.trained(replicas)
        folder = os.path.join(self.get_temp_dir(), f"listed_{replicas}")
        written = replica_copies.write_files(model, folder)
        return model, folder, written

    def test_the_save_lists_each_file_with_its_replicas_and_fingerprints(self):
        model, folder, written = self.saved()
        name = "replicas-00000-00001-of-00002.npz"
        self.assertEqual(written.path, os.path.join(folder, name))
        self.assertEqual(written.files["replicas"], 2)
        self.assertEqual(list(written.files["files"]), [name])
        entry = written.files["files"][name]
        self.assertEqual(entry["replica_ids"], [0, 1])
        copies = replica_copies.gather(model)
        self.assertEqual(sorted(entry["variables"]), sorted(str(p) for p in copies))
        for prints in entry["variables"].values():
            self.assertLen(prints, 2)
            self.assertNotEqual(prints[0], prints[1])  # Each replica's copy differed.
        json.dumps(written.files)  # A checkpoint holds it as JSON.
        # Held to the list, the file written reads back as it was.
        fresh = self.trained(2)
        self.assertTrue(replica_copies.read(fresh, folder, files=written.files))
        for place in copies:
            self.assertAllEqual(np.stack(own_copies(fresh.variables[place])), copies[place])
        # A save that wrote nothing reads nothing, whatever the folder holds.
        self.assertFalse(replica_copies.read(fresh, folder, files=None))

    def test_a_listed_file_that_is_missing_is_refused_naming_it(self):
        # Read as found, a missing file was no copies at all: every replica silently resumed
        # from the first replica's copy.
        _, folder, written = self.saved()
        os.remove(written.path)
        with self.assertRaises(DamagedStateError) as raised:
            replica_copies.read(self.trained(2), folder, files=written.files)
        self.assertEqual(str(raised.exception),
                         f"The replicas' copies file {written.path} saved with this state is "
                         "missing. A restore reads each file its save wrote, as written; start "
                         "over (resume=False), or use another model_dir. Received: no such "
                         "file.")
        self.assertEqual(raised.exception.exit_status, 2)
        with self.assertRaisesRegex(DamagedStateError, "saved with this state is missing"):
            replica_copy_files.read_mean(folder, written.files)  # On another number of replicas.

    def test_every_worker_refuses_a_listed_file_missing_not_only_its_owner(self):
        # Worker 1 of 2 lost its file: worker 0, which reads only its own, refuses too, so
        # the job stops as one (not worker 0 training on while worker 1 exits).
        _, folder, written = self.saved()
        files = {"replicas": 4, "files": {
            "replicas-00000-00001-of-00004.npz": {**written.files["files"][
                "replicas-00000-00001-of-00002.npz"], "replica_ids": [0, 1]},
            "replicas-00002-00003-of-00004.npz": {"replica_ids": [2, 3], "variables": {}}}}
        os.rename(written.path, os.path.join(folder, "replicas-00000-00001-of-00004.npz"))
        four = self.trained(4)
        with mock.patch.object(replica_copies._Gatherer, "replica_ids", return_value=[0, 1]):
            with self.assertRaisesRegex(DamagedStateError, re.escape(
                    os.path.join(folder, "replicas-00002-00003-of-00004.npz")) +
                    " saved with this state is missing"):
                replica_copies.read(four, folder, files=files)

    def test_another_saves_file_in_place_of_a_listed_one_is_refused(self):
        _, folder, written = self.saved()
        other = self.trained(2)
        (mean,) = [v for v in other.variables if v.path.endswith("moving_mean")]
        for copy in mean.value.values:  # Another generation's statistics.
            copy.assign(copy + 1.0)
        replica_copies.write_files(other, folder)  # Over the listed file.
        with self.assertRaisesRegex(DamagedStateError, re.escape(
                f"The replicas' copies file {written.path} is not the one its save wrote: its "
                "copies differ from those saved (another save's or another worker's file)")):
            replica_copies.read(self.trained(2), folder, files=written.files)

    def test_a_file_whose_replicas_are_not_those_of_its_name_is_refused(self):
        folder = os.path.join(self.get_temp_dir(), "renamed")
        row = {3: np.zeros((2, 3), np.float32)}
        replica_copy_files.write_own(folder, [0, 1], 4, row)
        replica_copy_files.write_own(folder, [2, 3], 4, row)
        first, second = (os.path.join(folder, f"replicas-{a}-of-00004.npz")
                         for a in ("00000-00001", "00002-00003"))
        # Worker 1's file copied over worker 0's: it was read as replicas 0 and 1.
        with open(second, "rb") as f, open(first, "wb") as g:
            g.write(f.read())
        with self.assertRaisesRegex(DamagedStateError, re.escape(
                f"The replicas' copies file {first} holds the copies of other replicas than "
                "its name says (0 to 1)") + ".*Received: replicas \\[2, 3\\]\\.$"):
            replica_copy_files.read_own(folder, [0, 1])

    def test_the_mean_refuses_files_that_hold_other_variables(self):
        # One file without variable 5: the mean divided the other file's partial sum by 4.
        folder = os.path.join(self.get_temp_dir(), "partial")
        replica_copy_files.write_own(folder, [0, 1], 4, {3: np.ones((2, 3), np.float32),
                                                      5: np.ones((2, 1), np.float32)})
        replica_copy_files.write_own(folder, [2, 3], 4, {3: np.ones((2, 3), np.float32)})
        with self.assertRaisesRegex(DamagedStateError, "holds other variables than the other "
                                                       "files of its save"):
            replica_copy_files.read_mean(folder)

    def test_a_truncated_or_empty_file_is_refused_naming_it(self):
        for damage, error in (("truncated", "BadZipFile"), ("emptied", "EOFError")):
            with self.subTest(damage):
                _, folder, written = self.saved()
                with open(written.path, "rb") as f:
                    data = f.read()
                with open(written.path, "wb") as f:
                    f.write(data[:len(data) // 2] if damage == "truncated" else b"")
                for files in (written.files, replica_copy_files.UNRECORDED):
                    with self.assertRaisesRegex(DamagedStateError, re.escape(
                            f"The replicas' copies file {written.path} is not readable. A "
                            "restore reads each file its save wrote, as written; start over "
                            f"(resume=False), or use another model_dir. Received: {error}")):
                        replica_copies.read(self.trained(2), folder, files=files)

    def test_the_mean_of_every_workers_file_is_summed_in_float64_in_replica_order(self):
        folder = os.path.join(self.get_temp_dir(), "mean")
        big, small = np.float32(2.0**24), np.float32(1.0)
        # Replicas 2**24, 1, 1, -2**24 (the second file written first): a float32 sum in
        # replica order drops both ones (2**24 + 1 rounds to 2**24) and gives 0.
        replica_copy_files.write_own(folder, [2, 3], 4, {5: np.array([[small], [-big]])})
        replica_copy_files.write_own(folder, [0, 1], 4, {5: np.array([[big], [small]])})
        mean = replica_copy_files.read_mean(folder)
        self.assertEqual(list(mean), [5])
        self.assertEqual(mean[5].dtype, np.float32)
        self.assertAllEqual(mean[5], [[0.5]])  # (2**24 + 1 + 1 - 2**24) / 4, exactly.

    def test_the_json_functions_are_deprecated_and_still_read_back_bit_for_bit(self):
        copies = replica_copies.gather(self.trained(2))
        with self.assertWarnsRegex(DeprecationWarning, r"removed in tfpar 0\.5\.0; use "
                                   r"tfpar\.replica_copies\.write"):
            data = json.loads(json.dumps(replica_copies.encode(copies)))
        with self.assertWarnsRegex(DeprecationWarning, r"removed in tfpar 0\.5\.0; use "
                                   r"tfpar\.replica_copies\.read"):
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
            replica_copy_files.decode_json({"3": {"values": [1.0]}})


if __name__ == "__main__":
    tf.test.main()
