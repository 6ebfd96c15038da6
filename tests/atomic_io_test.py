"""Tests of atomic writes (a failure mid-write leaves the previous file and no debris) and of the
recording of every file operation of a save (the crash-state explorer replays it:
``tests/callbacks/crash_states_test.py``)."""

import json
import os
from unittest import mock

import tensorflow as tf

from tfpar import atomic_io
from tfpar.errors import ConfigError


class AtomicIoTest(tf.test.TestCase):

    def test_write_json_replaces_the_file(self):
        path = os.path.join(self.get_temp_dir(), "r.json")
        atomic_io.write_json(path, {"a": 1})
        atomic_io.write_json(path, {"a": 2})
        with open(path, encoding="utf-8") as f:
            self.assertEqual(json.load(f), {"a": 2})

    def test_interrupted_write_keeps_the_previous_file(self):
        folder = self.get_temp_dir()
        path = os.path.join(folder, "r.json")
        atomic_io.write_json(path, {"complete": True})
        with self.assertRaises(KeyboardInterrupt):
            with atomic_io.atomic_path(path) as tmp:
                with open(tmp, "w", encoding="utf-8") as f:
                    f.write('{"half": ')
                raise KeyboardInterrupt
        with open(path, encoding="utf-8") as f:
            self.assertEqual(json.load(f), {"complete": True})
        self.assertEqual(sorted(os.listdir(folder)), ["r.json"])

    def test_check_writable_errors(self):
        folder = self.get_temp_dir()
        with self.assertRaisesRegex(ConfigError, r"folder of output path '/no/such/r\.json' does "
                                                 r"not exist: '/no/such'"):
            atomic_io.check_writable("/no/such/r.json")
        with self.assertRaisesRegex(ConfigError, "is a directory; give a file path"):
            atomic_io.check_writable(folder)
        # The check creates a file (root ignores permission bits); here creating one fails.
        with mock.patch.object(atomic_io.tempfile, "mkstemp",
                               side_effect=OSError(30, "Read-only file system")):
            with self.assertRaisesRegex(ConfigError, r"is not writable: .* \(Read-only file "
                                                     r"system\)"):
                atomic_io.check_writable(os.path.join(folder, "r.json"))
        self.assertEqual(os.listdir(folder), [])  # No probe file left behind.
        with self.assertRaisesRegex(ConfigError, "is not writable"):
            atomic_io.check_writable("/proc/r.json")

    def test_check_writable_dir(self):
        folder = os.path.join(self.get_temp_dir(), "new", "run")
        atomic_io.check_writable_dir(folder, "model_dir")
        self.assertEqual(os.listdir(folder), [])  # Created, and no probe left behind.
        a_file = os.path.join(self.get_temp_dir(), "a_file")
        open(a_file, "w").close()
        with self.assertRaisesRegex(ConfigError, r"model_dir '.*a_file' is a file; give a "
                                                 r"folder"):
            atomic_io.check_writable_dir(a_file, "model_dir")
        with self.assertRaisesRegex(ConfigError, r"profile_dir '/proc/x' cannot be written"):
            atomic_io.check_writable_dir("/proc/x", "profile_dir")

    def test_non_finite_numbers_are_written_as_null(self):
        path = os.path.join(self.get_temp_dir(), "r.json")
        atomic_io.write_json(path, {"loss": [1.5, float("nan"), float("inf")], "n": 2})
        with open(path, encoding="utf-8") as f:
            text = f.read()
        self.assertNotIn("NaN", text)
        # Strict parsing, as JSON.parse in other languages does.
        self.assertEqual(json.loads(text, parse_constant=lambda c: self.fail(c)),
                         {"loss": [1.5, None, None], "n": 2})


class RecordingTest(tf.test.TestCase):

    def test_each_operation_is_recorded_in_order_with_the_bytes_written(self):
        folder = self.get_temp_dir()
        path, moved = os.path.join(folder, "a", "r.txt"), os.path.join(folder, "b.txt")
        with atomic_io.recording() as operations:
            atomic_io.make_dirs(os.path.dirname(path))
            atomic_io.write_text(path, "one")
            atomic_io.replace(path, moved)
            atomic_io.write_text(path, "two")
            atomic_io.remove(moved)
            atomic_io.remove_tree(os.path.dirname(path))
        kinds = [(o.kind, os.path.relpath(o.path, folder), o.atomic) for o in operations]
        tmp_one, tmp_two = kinds[1][1], kinds[4][1]
        self.assertRegex(tmp_one, r"^a/\.r\.txt\..*\.tmp$")
        self.assertEqual(kinds, [
            ("make_dirs", "a", True),
            ("write", tmp_one, False), ("rename", tmp_one, True),  # The atomic write.
            ("rename", "a/r.txt", True),
            ("write", tmp_two, False), ("rename", tmp_two, True),
            ("remove", "b.txt", True),
            ("remove", "a/r.txt", True), ("remove_dir", "a", True)])
        self.assertEqual([o.data for o in operations if o.kind == "write"], [b"one", b"two"])
        self.assertEqual(operations[2].target, path)
        self.assertFalse(os.path.exists(os.path.dirname(path)))

    def test_a_librarys_writes_are_recorded_in_the_order_written_then_its_removals(self):
        folder = self.get_temp_dir()
        with open(os.path.join(folder, "old"), "w") as f:
            f.write("old")
        with atomic_io.recording() as operations:
            with atomic_io.external_writes(folder, "tensorflow", whole=lambda n: n == "b"):
                for name in ("b", "a"):  # Written b first.
                    with open(os.path.join(folder, name), "w") as f:
                        f.write(name)
                    os.utime(os.path.join(folder, name),
                             ns=(1, 1 if name == "b" else 2))
                os.remove(os.path.join(folder, "old"))
        self.assertEqual([(o.kind, os.path.basename(o.path), o.data, o.atomic, o.by)
                          for o in operations],
                         [("write", "b", b"b", True, "tensorflow"),
                          ("write", "a", b"a", False, "tensorflow"),
                          ("remove", "old", b"", True, "tensorflow")])

    def test_writes_whose_times_tie_are_recorded_in_the_librarys_order(self):
        folder = self.get_temp_dir()
        with atomic_io.recording() as operations:
            with atomic_io.external_writes(folder, "tensorflow",
                                           order=lambda name: {"b": 0, "c": 1, "a": 2}[name]):
                for name in ("a", "b", "c"):
                    with open(os.path.join(folder, name), "w") as f:
                        f.write(name)
                    os.utime(os.path.join(folder, name), ns=(1, 1))  # One clock tick.
        self.assertEqual([os.path.basename(o.path) for o in operations], ["b", "c", "a"])

    def test_nothing_is_recorded_outside_a_recording(self):
        folder = self.get_temp_dir()
        with atomic_io.recording() as operations:
            pass
        atomic_io.write_text(os.path.join(folder, "r.txt"), "x")
        with atomic_io.external_writes(folder, "keras"):
            atomic_io.remove(os.path.join(folder, "r.txt"))
        self.assertEqual(operations, [])


if __name__ == "__main__":
    tf.test.main()
