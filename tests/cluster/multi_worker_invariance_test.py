"""World-size invariance across processes: ``multi_worker_allreduce`` with ``virtual_replicas=4``
on 2 workers of 1 device, 2 workers of 2 devices (logical CPU devices, as a worker's GPUs) and
4 workers of 1 ends bit for bit where one process of 4 devices ends, and so does a job that
shrinks from 4 workers to 2 inside an epoch and grows back, every variable of every replica
(``tests/allreduce/virtual_replicas_test.py`` has one process)."""

import io
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
from absl.testing import parameterized

from tfpar.cluster import launcher

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "virtual_replicas_worker.py")
PREEMPTED = 85


@pytest.mark.cluster  # Several processes for a while: `pytest -m cluster`.
class MultiWorkerInvarianceTest(tf.test.TestCase, parameterized.TestCase):

    def job(self, base: str, workers: int, local: int, stop_at: str = "",
            min_workers: int | None = None, api: str = "entry") -> tuple[int, str]:
        out = io.StringIO()
        command = [sys.executable, WORKER, str(local), "4", os.path.join(base, "state"),
                   os.path.join(base, "final"), stop_at or "-", api]
        status = launcher.launch(command, workers, out=out, min_workers=min_workers)
        return status, out.getvalue()

    def one_process(self, base: str) -> dict:
        one = os.path.join(base, "one_process")
        result = subprocess.run([sys.executable, WORKER, "4", "4", os.path.join(one, "state"),
                                 os.path.join(one, "final")], capture_output=True, text=True,
                                timeout=600, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
        self.assertEqual(result.returncode, 0, result.stderr[-3000:])
        return self.copies(one, 1)

    def copies(self, base: str, ranks: int) -> list[np.ndarray]:
        """Every replica's copy of every variable, in the order of the replicas' ids."""
        values: dict[str, list[np.ndarray]] = {}
        for rank in range(ranks):
            with np.load(os.path.join(base, f"final.{rank}.npz")) as data:
                for key in sorted(data.files):
                    place, _, path = key.split(" ", 2)
                    values.setdefault(f"{place} {path}", []).append(data[key])
        return values

    def assertSameBits(self, expected, actual):
        self.assertEqual(sorted(expected), sorted(actual))
        differ = []
        for name, copies in actual.items():
            reference = np.atleast_1d(expected[name][0]).view(np.uint8)
            differ += [f"{name} (replica {i})" for i, copy in enumerate(copies)
                       if not np.array_equal(np.atleast_1d(copy).view(np.uint8), reference)]
        self.assertEqual(differ, [])

    def test_the_same_weights_on_any_number_of_workers_through_a_shrink_and_a_growth(self):
        base = self.get_temp_dir()
        expected = self.one_process(base)
        for workers, local in ((2, 1), (2, 2), (4, 1)):
            with self.subTest(workers=workers, local=local):
                folder = os.path.join(base, f"{workers}x{local}")
                status, output = self.job(folder, workers, local)
                self.assertEqual(status, 0, output[-3000:])
                copies = self.copies(folder, workers)
                self.assertEqual({len(c) for c in copies.values()}, {workers * local})
                self.assertSameBits(expected, copies)
        # 4 workers stopped by a notice inside epoch 2, 2 go on and are stopped inside epoch 3,
        # 4 finish: the shards, and so the sums, are the same on each.
        elastic = os.path.join(base, "elastic")
        for workers, stop_at in ((4, "2:2"), (2, "3:1"), (4, "")):
            status, output = self.job(elastic, workers, 1, stop_at)
            self.assertEqual(status, PREEMPTED if stop_at else 0, output[-3000:])
        self.assertSameBits(expected, self.copies(elastic, 4))

    @parameterized.parameters("entry", "keras")
    def test_an_elastic_launch_that_loses_a_worker_shrinks_to_a_size_that_divides_and_grows(
            self, api):
        # 4 workers, at least 2; slot 2 dies inside epoch 2. 3 workers cannot cut 4 shards, so
        # slot 3 is set aside too: 2 go on from the end of epoch 1, and once they saved epoch 2
        # all 4 run again (unless the 2 end the job first). The weights are those of one process
        # on 4 devices, through the entry or through keras.distribution.DataParallel.
        base = self.get_temp_dir()
        expected = self.one_process(base)
        folder = os.path.join(base, "launched")
        status, output = self.job(folder, 4, 1, "kill", min_workers=2, api=api)
        self.assertEqual(status, 0, output[-3000:])
        self.assertIn("slot 2 is lost and slot 3 set aside with it (the job runs with 4 or 2 "
                      "workers)", output)
        self.assertIn("launcher: epoch 2 is saved; a notice to every worker to save and stop, "
                      "to try the lost slots again.", output)
        # The 2 may end the job before they take the notice in (a fast or idle machine).
        grown = "growing back to 4 workers" in output
        self.assertSameBits(expected, self.copies(folder, 4 if grown else 2))


if __name__ == "__main__":
    tf.test.main()
