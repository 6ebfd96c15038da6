"""Tests of the package itself: every module reachable from ``import tfpar``, lazily."""

import subprocess
import sys

import tensorflow as tf


class PackageTest(tf.test.TestCase):

    def test_every_module_is_an_attribute_and_import_tfpar_imports_no_tensorflow(self):
        code = ("import sys, tfpar\n"
                "print('tensorflow' in sys.modules)\n"
                "for name in ('replica_statistics', 'flops', 'allreduce_strategy', 'env',\n"
                "             'config', 'dataset_catalog', 'cli', 'testing'):\n"
                "    getattr(tfpar, name)\n"
                "print('ok')\n")
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                timeout=120)
        self.assertEqual(result.stdout.split(), ["False", "ok"], result.stderr[-2000:])


if __name__ == "__main__":
    tf.test.main()
