"""What launcher and workers agree on, on its own: exit statuses, the state layout and its
reader, the stop record (no processes, no TensorFlow)."""

import json
import os
import signal
import tempfile
from unittest import mock

from absl.testing import absltest

from tfpar.cluster import protocol
from tfpar.errors import ExitStatus


def saved_state(folder: str, latest: str, positions: dict) -> None:
    """A state folder as ``EpochCheckpoint`` leaves it: TensorFlow's index and the positions."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, protocol.CHECKPOINT_INDEX), "w", encoding="utf-8") as f:
        f.write(f'model_checkpoint_path: "{latest}"\nall_model_checkpoint_paths: "{latest}"\n')
    with open(os.path.join(folder, protocol.POSITIONS_FILE), "w", encoding="utf-8") as f:
        json.dump(positions, f)


class ProtocolTest(absltest.TestCase):

    def test_a_death_by_signal_is_128_plus_n(self):
        self.assertEqual(protocol.normalized(-signal.SIGKILL), 137)
        self.assertEqual(protocol.normalized(-signal.SIGTERM), 143)
        self.assertEqual(protocol.normalized(ExitStatus.PREEMPTED), 85)
        self.assertEqual(protocol.normalized(0), 0)

    def test_the_position_of_the_latest_checkpoint_and_the_furthest_of_several_runs(self):
        with tempfile.TemporaryDirectory() as model_dir:
            run = os.path.join(model_dir, protocol.run_folder_name("mirrored", 2))
            self.assertEqual(os.path.basename(run), "mirrored_2_devices")
            saved_state(run, "ckpt-20", {"ckpt-15": [1, 0], "ckpt-20": [1, 5]})
            self.assertEqual(protocol.saved_position(run), (1, 5))
            other = os.path.join(model_dir, protocol.run_folder_name("mirrored", 1))
            saved_state(other, "ckpt-30", {"ckpt-30": [2, 0]})
            self.assertEqual(protocol.last_saved_position(
                model_dir, ["", "mirrored_2_devices", "mirrored_1_devices"]), (2, 0))
            self.assertEqual(protocol.last_saved_position(model_dir, ["mirrored_2_devices"]),
                             (1, 5))
            self.assertEqual(protocol.last_saved_position(model_dir), (0, 0))  # None there.

    def test_a_state_without_tfpars_positions_has_no_position(self):
        with tempfile.TemporaryDirectory() as folder:
            saved_state(folder, "ckpt-3", {"ckpt-2": [2, 0]})  # The latest is not listed.
            self.assertIsNone(protocol.saved_position(folder))
            os.remove(os.path.join(folder, protocol.POSITIONS_FILE))
            self.assertIsNone(protocol.saved_position(folder))

    def test_the_stop_record_round_trip(self):
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "worker-0.json")
            with mock.patch.dict(os.environ, {protocol.STOP_RECORD_ENV: path}):
                protocol.record_stop(ExitStatus.PREEMPTED, "Preempted (SIGTERM): ...",
                                     position=(1, 0), work_lost=True)
            record = protocol.StopRecord.read(path)
            self.assertEqual(record, protocol.StopRecord(85, "Preempted (SIGTERM): ...", (),
                                                         (1, 0), True))
            # A record without the newer field (an older worker's) reads as no work lost.
            with open(path, "w", encoding="utf-8") as f:
                json.dump({"status": 69, "unresponsive": [2]}, f)
            self.assertEqual(protocol.StopRecord.read(path),
                             protocol.StopRecord(69, "", (2,), None, False))
            for broken in ("", "{", '{"reason": "no status"}', "[1, 2]"):
                with open(path, "w", encoding="utf-8") as f:
                    f.write(broken)
                self.assertIsNone(protocol.StopRecord.read(path), broken)
            self.assertIsNone(protocol.StopRecord.read(os.path.join(folder, "none.json")))

    def test_no_record_without_a_launcher_and_never_an_error(self):
        with mock.patch.dict(os.environ, {}, clear=True):
            protocol.record_stop(0)  # Not started by a launcher: nothing, no error.
        with mock.patch.dict(os.environ, {protocol.STOP_RECORD_ENV: "/no/such/folder/r.json"}):
            protocol.record_stop(1, "crashed")  # An unwritable path: help, not a need.


if __name__ == "__main__":
    absltest.main()
