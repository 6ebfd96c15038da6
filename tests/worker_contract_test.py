"""What launcher and workers agree on, on its own: exit statuses, the position record, the
worker spec, the stop record, and the deprecated names of the records they replaced (no
processes, no TensorFlow)."""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
from unittest import mock

from absl.testing import absltest

from tfpar import worker_contract
from tfpar.cluster import preemption
from tfpar.cluster import protocol
from tfpar.errors import ConfigError
from tfpar.errors import ExitStatus
from tfpar.worker_contract import Position


def write_index(folder: str, latest: str) -> None:
    """TensorFlow's checkpoint index naming ``latest``."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, worker_contract.CHECKPOINT_INDEX), "w",
              encoding="utf-8") as f:
        f.write(f'model_checkpoint_path: "{latest}"\nall_model_checkpoint_paths: "{latest}"\n')


def temporary_folder(test: absltest.TestCase) -> str:
    """A new folder, removed after ``test``."""
    folder = tempfile.mkdtemp()
    test.addCleanup(shutil.rmtree, folder, True)
    return folder


class WorkerContractTest(absltest.TestCase):

    def test_a_death_by_signal_is_128_plus_n(self):
        self.assertEqual(worker_contract.normalized(-signal.SIGKILL), 137)
        self.assertEqual(worker_contract.normalized(-signal.SIGTERM), 143)
        self.assertEqual(worker_contract.normalized(ExitStatus.PREEMPTED), 85)
        self.assertEqual(worker_contract.normalized(0), 0)

    def test_the_position_record_is_the_committed_saves_and_is_read_with_its_folder(self):
        folder = temporary_folder(self)
        self.assertIsNone(worker_contract.read_position(folder))
        write_index(folder, "ckpt-20")
        before = worker_contract.commits_made()
        worker_contract.commit_position(folder, Position(1, 5, "ckpt-20"))
        self.assertEqual(worker_contract.read_position(folder), Position(1, 5, "ckpt-20", folder))
        self.assertEqual(worker_contract.last_committed(before), Position(1, 5, "ckpt-20", folder))
        self.assertIsNone(worker_contract.last_committed(before + 1))
        self.assertEqual(Position(1, 5).words, "epoch 2 step 5")
        self.assertEqual(Position(2, 0, folder="/s").where, "the end of epoch 2 in /s")
        self.assertEqual(Position(2, 0).short, "epoch 2")

    def test_a_save_written_by_another_process_counts_once_its_writer_committed_it(self):
        # A worker that is not the chief saved its part (to a scratch folder) of the chief's
        # ckpt-4: until the chief commits it, what a rerun resumes from is the folder's record.
        folder = temporary_folder(self)
        write_index(folder, "ckpt-2")
        worker_contract.commit_position(folder, worker_contract.Position(1, 0, "ckpt-2"))
        worker_contract.commit_position(folder, worker_contract.Position(2, 0, "ckpt-4"),
                                        by_another=True)
        self.assertEqual(worker_contract.last_committed().pair, (1, 0))
        write_index(folder, "ckpt-4")  # The chief's commit: its index, then its record.
        worker_contract.commit_position(folder, worker_contract.Position(2, 0, "ckpt-4"))
        worker_contract.commit_position(folder, worker_contract.Position(2, 0, "ckpt-4"),
                                        by_another=True)
        self.assertEqual(worker_contract.last_committed(),
                         worker_contract.Position(2, 0, "ckpt-4", folder))

    def test_a_record_of_another_save_than_the_index_names_is_no_position(self):
        # A kill between TensorFlow's commit of ckpt-30 and the record: the record is the
        # save before's, which is not where the folder resumes.
        folder = temporary_folder(self)
        write_index(folder, "ckpt-20")
        worker_contract.commit_position(folder, Position(1, 0, "ckpt-20"))
        write_index(folder, "ckpt-30")
        self.assertIsNone(worker_contract.read_position(folder))
        # A folder without TensorFlow's index (a BackupAndRestore backup) reads as recorded.
        backup = temporary_folder(self)
        worker_contract.commit_position(backup, Position(3, 2))
        self.assertEqual(worker_contract.read_position(backup).pair, (3, 2))

    def test_a_damaged_record_is_no_position_and_never_an_error(self):
        folder = temporary_folder(self)
        path = os.path.join(folder, worker_contract.POSITION_FILE)
        for broken in ("", "{", "[1, 2]", '{"steps": 1}', '{"epochs": "x"}', "7"):
            with open(path, "w", encoding="utf-8") as f:
                f.write(broken)
            self.assertIsNone(worker_contract.read_position(folder), broken)
        # Valid JSON that is no position: an infinite number, arrays nested past the parser.
        for broken in ('{"epochs": 1e999}', '{"epochs": 1, "steps": -1}', "[" * 100000):
            with open(path, "w", encoding="utf-8") as f:
                f.write(broken)
            self.assertIsNone(worker_contract.read_position(folder), broken[:20])
            worker_contract.restored_position(folder, Position(0, 0))  # Rewritten, no error.
        os.remove(path)
        os.mkdir(path)  # A folder in its place.
        self.assertIsNone(worker_contract.read_position(folder))

    def test_a_folder_tfpar_0_3_saved_is_read_from_its_positions_file(self):
        folder = temporary_folder(self)
        write_index(folder, "ckpt-20")
        with open(os.path.join(folder, worker_contract.LEGACY_POSITIONS_FILE), "w",
                  encoding="utf-8") as f:
            json.dump({"ckpt-15": [1, 0], "ckpt-20": [1, 5]}, f)
        self.assertEqual(worker_contract.read_position(folder), Position(1, 5, "ckpt-20", folder))
        write_index(folder, "ckpt-25")  # Not listed.
        self.assertIsNone(worker_contract.read_position(folder))

    def test_a_restore_records_what_it_restored_without_a_commit(self):
        folder = os.path.join(temporary_folder(self), "fresh")
        before = worker_contract.commits_made()
        worker_contract.restored_position(folder, Position(0, 0))  # Nothing saved yet.
        self.assertEqual(worker_contract.read_position(folder).pair, (0, 0))
        write_index(folder, "ckpt-7")  # A kill after the commit of ckpt-7, before its record.
        worker_contract.restored_position(folder, Position(2, 0, "ckpt-7"))
        self.assertEqual(worker_contract.read_position(folder), Position(2, 0, "ckpt-7", folder))
        self.assertEqual(worker_contract.commits_made(), before)

    def test_the_worker_spec_is_written_where_the_launcher_asked(self):
        path = os.path.join(temporary_folder(self), "spec.json")
        with mock.patch.dict(os.environ, {worker_contract.WORKER_SPEC_ENV: path}):
            spec = worker_contract.declare(folder="state")
        self.assertEqual(spec.folder, os.path.abspath("state"))
        self.assertEqual(worker_contract.WorkerSpec.read(path), spec)
        for broken in ("", "{", "[1]", '"folder"', "[" * 100000):
            with open(path, "w", encoding="utf-8") as f:
                f.write(broken)
            self.assertIsNone(worker_contract.WorkerSpec.read(path), broken[:30])
        for field in ('"grace_seconds": 1e999', '"grace_seconds": -1',
                      '"replicas_per_worker": 0', '"virtual_replicas": "4"'):
            with open(path, "w", encoding="utf-8") as f:
                f.write(f'{{"folder": "/s", {field}}}')
            self.assertEqual(worker_contract.WorkerSpec.read(path),
                             worker_contract.WorkerSpec("/s"), field)  # That field dropped.
        with mock.patch.dict(os.environ, {worker_contract.WORKER_SPEC_ENV: "/no/such/d/s.json"}):
            worker_contract.declare(folder="state")  # Help for the launcher, not a need.

    def test_a_declaration_adds_to_the_ones_before(self):
        path = os.path.join(temporary_folder(self), "spec.json")
        with mock.patch.dict(os.environ, {worker_contract.WORKER_SPEC_ENV: path}), \
                mock.patch.dict(worker_contract._declared, clear=True):
            worker_contract.declare(grace_seconds=30)
            worker_contract.declare(replicas_per_worker=2, virtual_replicas=8)
            spec = worker_contract.declare(folder="/state")
        self.assertEqual(spec, worker_contract.WorkerSpec("/state", 30.0, 2, 8))
        self.assertEqual(worker_contract.WorkerSpec.read(path), spec)
        self.assertEqual(spec.worker_counts(1, 4), (1, 2, 4))

    def test_a_declaration_out_of_range_is_one_error_and_a_read_keeps_the_fields_it_can(self):
        with mock.patch.dict(worker_contract._declared, clear=True):
            for field, value in (("grace_seconds", 0), ("grace_seconds", -1),
                                 ("grace_seconds", 1e9), ("grace_seconds", float("nan")),
                                 ("replicas_per_worker", 0), ("replicas_per_worker", 1.5),
                                 ("virtual_replicas", -4), ("virtual_replicas", True)):
                with self.assertRaisesRegex(ConfigError, f"^A worker spec's {field} must be "):
                    worker_contract.declare(**{field: value})
            self.assertEqual(worker_contract._declared, {})
        path = os.path.join(temporary_folder(self), "spec.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump({"folder": 7, "grace_seconds": 1e9, "replicas_per_worker": 1,
                       "virtual_replicas": 4}, f)
        self.assertEqual(worker_contract.WorkerSpec.read(path),
                         worker_contract.WorkerSpec("", None, 1, 4))

    def test_a_reader_never_waits_on_a_file_that_is_not_a_regular_one(self):
        folder = temporary_folder(self)
        for name in ("spec.json", worker_contract.POSITION_FILE, worker_contract.CHECKPOINT_INDEX):
            os.mkfifo(os.path.join(folder, name))  # Opened for reading, it waits for a writer.
        self.assertIsNone(worker_contract.WorkerSpec.read(os.path.join(folder, "spec.json")))
        self.assertIsNone(worker_contract.read_position(folder))
        self.assertIsNone(worker_contract.committed_save(folder))

    def test_tfpars_strategies_and_notices_declare_their_part(self):
        path = os.path.join(temporary_folder(self), "spec.json")
        code = textwrap.dedent("""
            import signal
            import tensorflow as tf
            tf.config.set_logical_device_configuration(
                tf.config.list_physical_devices("CPU")[0],
                [tf.config.LogicalDeviceConfiguration()] * 2)
            from tfpar import strategies
            from tfpar.cluster import preemption
            preemption.NOTICE.watch([signal.SIGUSR1], 45)
            preemption.NOTICE.watch([signal.SIGUSR2], 5)
            preemption.NOTICE.unwatch()  # The outer budget, declared again.
            strategies.get("allreduce", 2, virtual_replicas=4)  # One process: not declared.
            strategies.choose("multi_worker_allreduce", virtual_replicas=4).build(2)
            strategies.get("mirrored", 1)  # A process's other strategy: not the job's shape.
            """)
        env = {**os.environ, worker_contract.WORKER_SPEC_ENV: path}
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                env=env, timeout=300)
        self.assertEqual(result.returncode, 0, result.stderr[-2000:])
        self.assertEqual(worker_contract.WorkerSpec.read(path),
                         worker_contract.WorkerSpec("", 45.0, 2, 4))

    def test_the_stop_record_round_trip(self):
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "worker-0.json")
            with mock.patch.dict(os.environ, {worker_contract.STOP_RECORD_ENV: path}):
                worker_contract.record_stop(ExitStatus.PREEMPTED, "Preempted (SIGTERM): ...",
                                            work_lost=True)
            record = worker_contract.StopRecord.read(path)
            self.assertEqual(record, worker_contract.StopRecord(
                85, "Preempted (SIGTERM): ...", (), True))
            # A record without the newer field (an older worker's) reads as no work lost; one
            # with the position tfpar 0.3 wrote reads without it.
            with open(path, "w", encoding="utf-8") as f:
                json.dump({"status": 69, "unresponsive": [2], "position": [1, 0]}, f)
            self.assertEqual(worker_contract.StopRecord.read(path),
                             worker_contract.StopRecord(69, "", (2,), False))
            for broken in ("", "{", '{"reason": "no status"}', "[1, 2]", '{"status": 1e999}',
                           "[" * 100000):
                with open(path, "w", encoding="utf-8") as f:
                    f.write(broken)
                self.assertIsNone(worker_contract.StopRecord.read(path), broken)
            self.assertIsNone(worker_contract.StopRecord.read(os.path.join(folder, "none.json")))

    def test_no_record_without_a_launcher_and_never_an_error(self):
        with mock.patch.dict(os.environ, {}, clear=True):
            worker_contract.record_stop(0)  # Not started by a launcher: nothing, no error.
        with mock.patch.dict(os.environ,
                             {worker_contract.STOP_RECORD_ENV: "/no/such/folder/r.json"}):
            worker_contract.record_stop(1, "crashed")  # An unwritable path: help, not a need.


class DeprecatedRecordsTest(absltest.TestCase):
    """The names of the records the position record and the worker spec replaced work for one
    minor version, each with a warning naming its replacement."""

    def test_the_protocol_module_names_warn_and_work(self):
        model_dir = temporary_folder(self)
        run = os.path.join(model_dir, "mirrored_2_devices")
        write_index(run, "ckpt-20")
        worker_contract.commit_position(run, Position(1, 5, "ckpt-20"))
        with self.assertWarnsRegex(DeprecationWarning, "worker_contract.read_position"):
            self.assertEqual(protocol.saved_position(run), (1, 5))
        with self.assertWarnsRegex(DeprecationWarning, "worker_contract.read_position"):
            self.assertEqual(protocol.last_saved_position(model_dir, ["", "mirrored_2_devices"]),
                             (1, 5))
        with self.assertWarnsRegex(DeprecationWarning, "worker_contract.run_folder_name"):
            self.assertEqual(protocol.run_folder_name("mirrored", 2), "mirrored_2_devices")
        with self.assertWarnsRegex(DeprecationWarning, "LEGACY_POSITIONS_FILE"):
            self.assertEqual(protocol.POSITIONS_FILE, "positions.json")
        path = os.path.join(model_dir, "stop.json")
        with mock.patch.dict(os.environ, {worker_contract.STOP_RECORD_ENV: path}), \
                self.assertWarnsRegex(DeprecationWarning, "worker_contract.record_stop"):
            protocol.record_stop(85, "Preempted", position=(1, 0))
        self.assertEqual(worker_contract.StopRecord.read(path).status, 85)
        with self.assertRaises(AttributeError):
            protocol.no_such_name  # noqa: B018

    def test_the_notices_saved_of_0_3_commits_the_position_it_names(self):
        for description, position, expected in (
                ("epoch 2 step 3 in /runs/x", (1, 3), "epoch 2 step 3 in /runs/x"),
                ("epoch 2 step 17 in /runs/y", None, "epoch 2 step 17 in /runs/y"),
                ("the end of epoch 2 in /runs/z", None, "the end of epoch 2 in /runs/z")):
            before = worker_contract.commits_made()
            with self.assertWarnsRegex(DeprecationWarning, "worker_contract.commit_position"):
                preemption.saved(description, position)
            self.assertEqual(worker_contract.last_committed(before).where, expected)

if __name__ == "__main__":
    absltest.main()
