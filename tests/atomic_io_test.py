"""Tests of atomic writes: a failure mid-write leaves the previous file and no debris."""

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
        with mock.patch.object(atomic_io.os, "access", return_value=False):
            with self.assertRaisesRegex(ConfigError, "is not writable"):
                atomic_io.check_writable(os.path.join(folder, "r.json"))


if __name__ == "__main__":
    tf.test.main()
