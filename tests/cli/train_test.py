"""End-to-end runs of scripts/train.py in a subprocess, and its handling of bad flags."""

import contextlib
import io
import json
import os
import re
import signal
import subprocess
import sys
from unittest import mock

import numpy as np
import pytest
import quoted_output
import tensorflow as tf
from absl import flags
from absl.testing import parameterized

from tfpar import strategies
from tfpar import training
from tfpar.cli import common
from tfpar.cli import train as train_cli
from tfpar.cli import train_report
from tfpar.compat import onednn_state
from tfpar.errors import ClusterError
from tfpar.host import machine

FLAGS = flags.FLAGS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def train(*flags, timeout=300, python_options=()):
    return subprocess.run([sys.executable, *python_options, os.path.join(ROOT, "scripts",
                                                                         "train.py"), *flags],
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})


def imported_tensorflow(stderr: str) -> bool:
    """Whether a program run with ``python -X importtime`` imported TensorFlow."""
    return re.search(r"^import time:.*\|\s+tensorflow$", stderr, re.M) is not None


class TrainScriptTest(tf.test.TestCase, parameterized.TestCase):

    def test_virtual_replicas_give_the_same_weights_on_each_device_set(self):
        # A process on one device (all cores, unless pinned to one thread, as the program
        # does), another on two: the states saved after the epoch are the same, every
        # variable bit for bit.
        model_dir = self.get_temp_dir()
        for count in ("1", "2"):
            result = train("--strategy=allreduce", "--virtual_replicas=4", "--dataset=digits",
                           f"--num_devices={count}", "--epochs=1", "--model=lenet",
                           f"--model_dir={model_dir}", "--verbose=0")
            self.assertEqual(result.returncode, 0, result.stderr[-3000:])
            self.assertNotIn("intra-op thread", result.stderr)  # Pinned: nothing to warn of.
        states = [tf.train.load_checkpoint(tf.train.latest_checkpoint(
            os.path.join(model_dir, f"allreduce_{n}_devices"))) for n in (1, 2)]
        keys = sorted(k for k in states[0].get_variable_to_shape_map()
                      if k.startswith(("model_variables", "optimizer")))
        self.assertGreater(len(keys), 10)
        differ = [k for k in keys if not np.array_equal(
            np.atleast_1d(states[0].get_tensor(k)).view(np.uint8),
            np.atleast_1d(states[1].get_tensor(k)).view(np.uint8))]
        self.assertEqual(differ, [])

    @pytest.mark.cluster  # Three device sets of ten epochs: about 40 s.
    def test_the_world_size_invariance_guides_table_is_what_its_command_prints(self):
        result = subprocess.run(quoted_output.command("world_size_invariance", {}),
                                capture_output=True, text=True, timeout=600,
                                env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
        self.assertEqual(result.returncode, 0, result.stderr[-3000:])
        rows = re.findall(r"^allreduce  \[CPU.*$", result.stdout, re.M)
        self.assertLen(rows, 3)
        self.assertLen({row.split()[-4] for row in rows}, 1, rows)  # One test accuracy.
        cpu = machine.cpu()
        if (cpu["model"].startswith("AMD EPYC") and cpu["family_model"] == "25/17"
                and onednn_state.tensorflow_runs_onednn() is not False):
            quoted_output.assert_quoted("world_size_invariance", result.stdout, {})

    def test_output_to_a_file_has_a_plain_line_per_epoch(self):
        # A pipe, as a log file under Slurm, Kubernetes or nohup is: no progress bar redrawn
        # with carriage returns and escape codes, one line per epoch (Keras's verbose=2).
        result = train("--dataset=digits", "--epochs=2", "--model=lenet", "--batch_size=256")
        self.assertEqual(result.returncode, 0, result.stderr[-3000:])
        self.assertNotIn("\r", result.stdout)
        self.assertNotIn("\x1b[", result.stdout)
        self.assertLen(re.findall(r"^Epoch \d/2$", result.stdout, re.M), 2)
        self.assertLen(re.findall(r"^\d+/\d+ - \S+ - .*loss: ", result.stdout, re.M), 2)

    def test_reports_each_device_set_and_writes_json(self):
        output = os.path.join(self.get_temp_dir(), "results.json")
        result = train("--strategy=allreduce", "--dataset=digits", "--num_devices=1,2",
                       "--epochs=2", "--batch_size=128", "--scale_with_devices",
                       f"--output={output}", "--verbose=0")
        self.assertEqual(result.returncode, 0, result.stderr[-3000:])
        lines = re.findall(r"^test acc: \d\.\d\d, \d+\.\d sec/epoch on \[(.*)\] \(\d+ images/s\)$",
                           result.stdout, re.MULTILINE)
        self.assertEqual(lines, ["CPU:0", "CPU:0, CPU:1"])
        self.assertRegex(result.stdout, r"allreduce  \[CPU:0, CPU:1\]  256 +0\.1 ")
        with open(output, encoding="utf-8") as f:
            saved = json.load(f)
        self.assertEqual([r["devices"] for r in saved["results"]], [["CPU:0"], ["CPU:0", "CPU:1"]])
        self.assertEqual(saved["results"][1]["global_batch_size"], 256)
        self.assertGreater(saved["results"][0]["test_accuracy"], 0.5)
        self.assertLen(saved["results"][0]["epoch_seconds"], 2)
        # The strategy as its name and options, as the flags gave them.
        self.assertEqual(saved["config"]["strategy"], "allreduce")
        self.assertEqual(saved["config"]["strategy_options"]["algorithm"], "collective")
        self.assertEqual(saved["config"]["epochs"], 2)

    @parameterized.named_parameters(
        ("unknown_strategy", ["--strategy=mirroed"], r"Unknown strategy 'mirroed'\. Available"),
        ("unknown_allreduce", ["--strategy=allreduce", "--split_weights=1,x"],
         r"--split_weights takes a comma list of numbers"),
        ("zero_devices", ["--num_devices=0"], r"--num_devices takes positive integers"),
        ("non_numeric_devices", ["--num_devices=two"], r"--num_devices takes positive integers"),
        ("too_many_devices", ["--num_devices=100"], r"from 1 to 64\. Received: '100'"),
        ("missing_gpu", ["--devices=GPU:3"], r"No such GPU"),
        ("negative_lr", ["--lr=-1"], r"--lr must be a finite number > 0\. Received: --lr=-1"),
        ("zero_epochs", ["--epochs=0"], r"epochs must be an integer >= 1"),
        ("save_interval_word", ["--save_every_steps=often"],
         r"--save_every_steps must be an integer >= 0 \(0: at epochs' ends only\) or 'auto'\. "
         r"Received: --save_every_steps='often'"),
        ("save_budget_percent", ["--save_every_steps=auto", "--save_budget=2"],
         r"--save_budget must be a fraction of the training time from 0\.0001 to below 1 "
         r"\(0\.02: 2%\)\. Received: --save_budget=2"),
        ("save_budget_without_auto", ["--save_every_steps=10", "--save_budget=0.05"],
         r"--save_budget applies only with save_every_steps=auto\. Received: "
         r"save_every_steps=10\.$"),
        ("batch_below_replicas", ["--num_devices=4", "--batch_size=3"],
         r"global batch size \(3\) is smaller than the number of replicas \(4\)"),
        ("missing_data_dir", ["--dataset=mnist", "--data_dir=/no/such"],
         r"--data_dir '/no/such' does not exist"),
        ("output_folder_missing", ["--output=/no/such/r.json"], r"folder of output path .* does "
                                                                 r"not exist"),
        ("jit_on_cpu_replicas", ["--num_devices=2", "--jit_compile"],
         r"--jit_compile=True cannot run on 2 replicas with CPUs among them"),
        ("flag_for_other_strategy", ["--allreduce=ring"], r"--allreduce does not apply to "
                                                          r"strategy 'mirrored'"),
        ("negative_seed", ["--seed=-1"], r"seed must be an integer from 0 to 2\*\*32 - 1"),
        ("huge_seed", [f"--seed={2**32}"], r"seed must be an integer from 0 to 2\*\*32 - 1"),
        ("model_dir_is_a_file", [f"--model_dir={__file__}"], r"model_dir .* is a file; give a "
                                                              r"folder"),
        ("heartbeat_timeout_zero", ["--strategy=multi_worker", "--heartbeat_timeout=0"],
         r"--heartbeat_timeout must be a positive number of seconds\. Received: "
         r"--heartbeat_timeout=0"),
        ("heartbeat_timeout_for_one_process", ["--heartbeat_timeout=5"],
         r"--heartbeat_timeout does not apply to strategy 'mirrored'"),
        ("sync_batchnorm_without_batchnorm", ["--model=lenet", "--sync_batchnorm"],
         r"--sync_batchnorm needs a model with BatchNorm layers; --model=lenet has none"),
        # Past what the clocks and timers waiting on the budget hold (an OverflowError later).
        ("infinite_grace", ["--preemption_grace_seconds=inf"],
         r"--preemption_grace_seconds must be a finite number of seconds > 0 and at most 86400 "
         r"\(a day\)\. Received: inf\.$"),
        ("absurd_grace", ["--preemption_grace_seconds=1e10"],
         r"--preemption_grace_seconds must be a finite number of seconds > 0 and at most 86400 "
         r"\(a day\)\. Received: 10000000000\.0\.$"),
        ("bad_verbose", ["--verbose=3"], r"--verbose must be 0, 1, 2 or 'auto'\. "
                                          r"Received: --verbose=3\.$"),
        ("nan_grace", ["--preemption_grace_seconds=nan"],
         r"--preemption_grace_seconds must be a finite number .* Received: nan\.$"),
    )
    def test_bad_input_exits_with_one_clear_line(self, flags, message):
        # In-process (a subprocess per case would cost a TensorFlow start each); the
        # subprocess test below checks that no traceback reaches the user.
        argv = ["train.py", "--dataset=digits", "--epochs=1", "--verbose=0", *flags]
        stderr = io.StringIO()
        try:
            FLAGS(argv)
            with contextlib.redirect_stderr(stderr), self.assertRaises(SystemExit) as exit_:
                common.exit_cleanly(train_cli.main)(argv[:1])
        finally:
            FLAGS.unparse_flags()
        self.assertEqual(exit_.exception.code, 2)
        self.assertRegex(stderr.getvalue(), "^Error: .*" + message)

    def test_results_are_printed_when_the_output_cannot_be_written_at_the_end(self):
        output = os.path.join(self.get_temp_dir(), "r.json")
        argv = ["train.py", "--dataset=synthetic", "--epochs=1", "--verbose=0",
                "--batch_size=256", f"--output={output}"]
        stdout, stderr = io.StringIO(), io.StringIO()
        full = OSError(28, "No space left on device")
        try:
            FLAGS(argv)
            with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr), \
                    mock.patch.object(train_cli.atomic_io, "write_json", side_effect=full), \
                    self.assertRaises(SystemExit) as exit_:
                common.exit_cleanly(train_cli.main)(argv[:1])
        finally:
            FLAGS.unparse_flags()
        self.assertEqual(exit_.exception.code, 2)
        self.assertRegex(stderr.getvalue(), r"^Error: Could not write --output=.*r\.json \(No "
                                            r"space left on device\); the results are printed")
        printed = json.loads(stdout.getvalue()[stdout.getvalue().index("{"):
                                               stdout.getvalue().rindex("}") + 1])
        self.assertEqual(printed["results"][0]["dataset"], "synthetic")
        self.assertFalse(os.path.exists(output))

    def test_plot_of_the_curves(self):
        folder = self.get_temp_dir()
        output, plot = os.path.join(folder, "r.json"), os.path.join(folder, "curves.png")
        argv = ["train.py", "--dataset=synthetic", "--epochs=2", "--verbose=0",
                "--batch_size=256", "--num_devices=1,2", f"--output={output}", f"--plot={plot}"]
        before = signal.getsignal(signal.SIGTERM)
        try:
            FLAGS(argv)
            with contextlib.redirect_stdout(io.StringIO()):
                train_cli.main(argv[:1])
        finally:
            FLAGS.unparse_flags()
        # The program watched SIGTERM as a preemption notice while it ran, not after.
        self.assertIs(signal.getsignal(signal.SIGTERM), before)
        with open(plot, "rb") as f:
            header = f.read(24)
        self.assertEqual(header[:8], b"\x89PNG\r\n\x1a\n")
        size = (int.from_bytes(header[16:20], "big"), int.from_bytes(header[20:24], "big"))
        self.assertEqual(size, (1300, 400))
        with open(output, encoding="utf-8") as f:
            results = [training.RunResult(**r) for r in json.load(f)["results"]]
        figure = train_report.curves_figure(results)
        accuracy, loss, seconds = figure.axes
        for line, r in zip(accuracy.lines, results):
            self.assertAllClose(line.get_ydata(), r.history["test_accuracy"])
        for line, r in zip(loss.lines, results):
            self.assertAllClose(line.get_ydata(), r.history["loss"])
        self.assertAllClose([b.get_height() for b in seconds.patches],
                            [r.sec_per_epoch for r in results])

    def test_malformed_tf_config_under_mirrored_is_one_line(self):
        with mock.patch.dict(os.environ, {"TF_CONFIG": "{bad"}):
            with self.assertRaisesRegex(ClusterError, r"TF_CONFIG is not valid JSON"):
                strategies.get("mirrored", 1)

    def test_user_error_has_no_traceback(self):
        result = train("--strategy=mirroed")
        self.assertEqual(result.returncode, 2)
        self.assertIn("Error: Unknown strategy 'mirroed'. Available strategies:", result.stderr)
        self.assertNotIn("Traceback", result.stderr)

    def test_a_file_where_a_runs_folder_goes_is_named_before_training(self):
        model_dir = self.get_temp_dir()
        open(os.path.join(model_dir, "mirrored_2_devices"), "w").close()
        result = train("--dataset=digits", "--epochs=1", "--num_devices=1,2",
                       f"--model_dir={model_dir}")
        self.assertEqual(result.returncode, 2, result.stderr[-2000:])
        self.assertIn(f"Error: model_dir '{model_dir}/mirrored_2_devices' is a file; give a "
                      "folder", result.stderr)
        self.assertNotIn("Traceback", result.stderr)
        self.assertNotIn("test acc", result.stdout)  # Nothing trained, not even on 1 device.

    def test_positional_arguments_exit_2_with_one_line(self):
        result = train("extra")
        self.assertEqual(result.returncode, 2)
        self.assertIn("Error: Unexpected arguments: extra. The program takes flags only",
                      result.stderr)
        self.assertNotIn("Traceback", result.stderr)

    def test_bad_flag_value_is_rejected_by_absl(self):
        result = train("--lr=fast")
        self.assertEqual(result.returncode, 2)  # The same status as tfpar's own checks.
        self.assertIn("flag --lr=fast: could not convert string to float", result.stderr)
        self.assertNotIn("Traceback", result.stderr)

    @parameterized.named_parameters(
        ("too_many_devices", ["--num_devices=99"], r"--num_devices takes integers from 1 to 64"),
        ("missing_data_dir", ["--dataset=mnist", "--data_dir=/no/such"],
         r"--data_dir '/no/such' does not exist"),
        ("unknown_strategy", ["--strategy=mirroed"], r"Unknown strategy 'mirroed'"))
    def test_flag_errors_answer_before_tensorflow_is_imported(self, flags, message):
        result = train(*flags, python_options=("-X", "importtime"))
        self.assertEqual(result.returncode, 2)
        self.assertRegex(result.stderr, "(?m)^Error: " + message)
        self.assertRegex(result.stderr, r"(?m)^import time:.*\|\s+tfpar\.errors$")  # Listed.
        self.assertFalse(imported_tensorflow(result.stderr))

    def test_help_lists_the_flags(self):
        result = train("--help", python_options=("-X", "importtime"))
        self.assertEqual(result.returncode, 0)
        for flag in ("--strategy", "--num_devices", "--[no]scale_with_devices", "--allreduce",
                     "--split_weights", "--output", "--plot", "--logdir"):
            self.assertIn(flag, result.stdout)
        self.assertFalse(imported_tensorflow(result.stderr))  # TensorFlow never started.
        # Grouped: every flag of the program in exactly one group, groups in order.
        defined = {flag.name for flag in FLAGS.get_flags_for_module(train_cli.__name__)}
        grouped = [name for names in train_cli.HELP_GROUPS.values() for name in names]
        self.assertCountEqual(grouped, defined)
        positions = [result.stdout.index(f"\n{title}:\n") for title in train_cli.HELP_GROUPS]
        self.assertEqual(positions, sorted(positions))

    def test_helpfull_lists_absls_own_flags_too_in_every_program(self):
        # Each program's --help ends by pointing to --helpfull.
        for program, own in (("train", "--strategy"), ("launch", "--num_workers"),
                             ("benchmark", "--strategies"), ("env", "--[no]json")):
            result = subprocess.run(
                [sys.executable, "-X", "importtime", "-c",
                 f"import sys; sys.argv[0] = 'tfpar-{program}'; "
                 f"from tfpar.cli import {program}; {program}.run()", "--helpfull"],
                capture_output=True, text=True, timeout=120)
            self.assertEqual(result.returncode, 0, result.stderr[-2000:])
            self.assertIn(own, result.stdout, program)
            self.assertIn("--verbosity", result.stdout, program)  # absl's logging flag.
            self.assertFalse(imported_tensorflow(result.stderr), program)

    def test_flags_are_checked_before_tensorflow_is_imported(self):
        # --help and flag errors answer at once because the programs' modules import no
        # TensorFlow; tfpar's own checks of the simple flags run before it too.
        for program in ("benchmark", "env", "launch"):
            result = subprocess.run(
                [sys.executable, "-c", f"import sys; from tfpar.cli import {program}; "
                                       "print('tensorflow' in sys.modules)"],
                capture_output=True, text=True, timeout=120)
            self.assertEqual(result.stdout.strip(), "False", program + result.stderr[-2000:])
        code = ("import sys\n"
                "from tfpar.cli import train\n"
                "from absl import flags\n"
                "flags.FLAGS(['train.py', '--lr=-1'])\n"
                "try:\n"
                "    train.config_from_flags()\n"
                "except Exception as e:\n"
                "    print(type(e).__name__, e)\n"
                "print('tensorflow' in sys.modules)\n")
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                timeout=120)
        self.assertEqual(result.stdout.splitlines(),
                         ["ConfigError lr must be a finite number > 0. Received: lr=-1.0.",
                          "False"], result.stderr[-2000:])


class GpusGivenTest(tf.test.TestCase):

    def test_a_launched_worker_trains_on_the_gpus_it_was_given(self):
        given = {"TFPAR_WORKER_SLOT": "1", "CUDA_VISIBLE_DEVICES": "2,3"}
        with mock.patch.dict(os.environ, given):
            self.assertEqual(train_cli._gpus_given(), 2)
        with mock.patch.dict(os.environ, {**given, "CUDA_VISIBLE_DEVICES": ""}):
            self.assertEqual(train_cli._gpus_given(), 0)  # Given none: the CPU.
        # Not launched by tfpar: whatever CUDA shows is the user's to choose from.
        environment = {k: v for k, v in os.environ.items() if k != "TFPAR_WORKER_SLOT"}
        with mock.patch.dict(os.environ, {**environment, "CUDA_VISIBLE_DEVICES": "0,1"},
                             clear=True):
            self.assertEqual(train_cli._gpus_given(), 0)


if __name__ == "__main__":
    tf.test.main()
