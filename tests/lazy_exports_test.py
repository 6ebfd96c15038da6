"""Tests of the package's namespaces: every module and public name reachable, lazily."""

import os
import subprocess
import sys

import tensorflow as tf

import tfpar

# The programs (each defines its flags: one per process) and the modules they read before they
# import TensorFlow (flags, --help, listings).
PROGRAMS = ("tfpar.cli.train", "tfpar.cli.benchmark", "tfpar.cli.launch", "tfpar.cli.env")
TENSORFLOW_FREE = ("tfpar.strategies", "tfpar.allreduce.options", "tfpar.cluster.spec",
                   "tfpar.cluster.launcher", "tfpar.strategies.multi_worker_options",
                   "tfpar.training.config", "tfpar.data.catalog", "tfpar.benchmark.runner",
                   "tfpar.benchmark.report", "tfpar.benchmark.config", "tfpar.env",
                   "tfpar.config_fields", "tfpar.cli.config_flags",
                   "tfpar.strategies.cross_device_ops",
                   # pytest loads it in every run: TensorFlow only when devices are asked for.
                   "tfpar.testing.pytest_plugin")


def run(code: str) -> list[str]:
    """The words ``code`` prints, run in a fresh process (it must succeed)."""
    return "\n".join(run_lines(code)).split()


def run_lines(code: str) -> list[str]:
    """The lines ``code`` prints, run in a fresh process (it must succeed)."""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.splitlines()


class LazyExportsTest(tf.test.TestCase):

    def test_import_tfpar_imports_no_tensorflow_and_reaches_every_module_and_name(self):
        lines = run(
            "import importlib, importlib.util, pkgutil, sys, tfpar\n"
            "print('tensorflow' in sys.modules)\n"
            "for m in pkgutil.walk_packages(tfpar.__path__, 'tfpar.'):\n"
            f"    if m.name in {PROGRAMS!r}:\n"
            "        continue\n"
            # An optional extra's module: reached where its extra is installed.
            "    if m.name == 'tfpar.ray' and importlib.util.find_spec('ray') is None:\n"
            "        continue\n"
            "    module = tfpar\n"
            "    for part in m.name.split('.')[1:]:\n"
            "        module = getattr(module, part)\n"  # tfpar.a.b as attributes.
            "    for public in getattr(module, '__all__', ()):\n"
            "        getattr(module, public)\n"
            "    print(m.name)\n")
        self.assertEqual(lines[0], "False")
        for module in ("tfpar.strategies.registry", "tfpar.allreduce.step",
                       "tfpar.callbacks.batchnorm_statistics", "tfpar.benchmark.worker",
                       "tfpar.data.pipelines", "tfpar.cluster.private_network",
                       "tfpar.training.building", "tfpar.cli.train_report"):
            self.assertIn(module, lines)

    def test_the_command_line_modules_import_no_tensorflow(self):
        for program in PROGRAMS:
            lines = run("import importlib, sys\n"
                        f"for name in {(program, *TENSORFLOW_FREE)!r}:\n"
                        "    importlib.import_module(name)\n"
                        "from tfpar import strategies\n"
                        "strategies.available(), strategies.entry('allreduce').options()\n"
                        "print('tensorflow' in sys.modules)\n")
            self.assertEqual(lines, ["False"], program)

    def test_a_missing_optional_extra_is_named_in_one_line(self):
        # Ray stood in for by a module that cannot be imported.
        result = subprocess.run([sys.executable, "-c", "import sys; sys.modules['ray'] = None\n"
                                 "import tfpar.ray"], capture_output=True, text=True, timeout=120)
        self.assertEqual(result.returncode, 1)
        self.assertEqual(result.stderr.strip().splitlines()[-1],
                         "ImportError: " + 'tfpar.ray needs Ray Train, which is not installed: '
                         f'install tfpar with its ray extra (pip install "tfpar-{tfpar.__version__}'
                         '-py3-none-any.whl[ray]", or pip install -e ".[ray]" in a checkout).')

    def test_a_name_that_does_not_exist(self):
        import tfpar.data

        with self.assertRaisesRegex(AttributeError, "module 'tfpar.data' has no attribute 'lod'"):
            tfpar.data.lod  # noqa: B018


class DeprecatedAliasesTest(tf.test.TestCase):
    """Moved modules still import, for one minor version, with a warning naming the new place."""

    def test_the_callback_module_that_shared_preemptions_name_moved_with_a_warning(self):
        code = ("import warnings\n"
                "with warnings.catch_warnings(record=True) as caught:\n"
                "    warnings.simplefilter('always', DeprecationWarning)\n"
                "    from tfpar.callbacks import preemption\n"
                "from tfpar.callbacks import SaveOnPreemption, save_on_preemption\n"
                "for w in caught:\n"
                "    print(w.message)\n"
                "print(preemption.SaveOnPreemption is save_on_preemption.SaveOnPreemption\n"
                "      is SaveOnPreemption)\n")
        self.assertEqual(run_lines(code), [
            "tfpar.callbacks.preemption is deprecated and will be removed in tfpar 0.5.0: use "
            "tfpar.callbacks.save_on_preemption (or tfpar.callbacks.SaveOnPreemption).",
            "True"])

    def test_a_script_importing_an_alias_sees_the_warning_under_pythons_default_filters(self):
        # Python shows a DeprecationWarning by default only where it is attributed to the
        # script (__main__): past the import system and the package's lazy __getattr__.
        script = os.path.join(self.get_temp_dir(), "user_script.py")
        for line in ("from tfpar.callbacks import preemption",
                     "import tfpar.callbacks.preemption",
                     "import tfpar.callbacks; tfpar.callbacks.preemption.SaveOnPreemption"):
            with open(script, "w", encoding="utf-8") as f:
                f.write(line + "\n")
            env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
            result = subprocess.run([sys.executable, script], capture_output=True, text=True,
                                    timeout=120, env=env)
            self.assertEqual(result.returncode, 0, result.stderr[-2000:])
            self.assertIn(f"{script}:1: DeprecationWarning: tfpar.callbacks.preemption is "
                          "deprecated and will be removed in tfpar 0.5.0: use "
                          "tfpar.callbacks.save_on_preemption", result.stderr, line)

    def test_the_aliases_due_in_0_4_0_are_gone_and_moved_modules_have_none(self):
        # 0.2.0 shipped tfpar.multiworker, tfpar.evaluation, tfpar.schedules and
        # tfpar.benchmark.configuration, aliased through 0.3.0 and removed in 0.4.0; the
        # modules added and moved within 0.3.0's development (tfpar.machine,
        # tfpar.thread_layouts, tfpar.multiworker.kubernetes and .slurm) never had aliases.
        code = ("import importlib\n"
                "for name in ('tfpar.multiworker', 'tfpar.multiworker.launcher',\n"
                "             'tfpar.evaluation', 'tfpar.schedules',\n"
                "             'tfpar.benchmark.configuration', 'tfpar.machine',\n"
                "             'tfpar.thread_layouts', 'tfpar.multiworker.slurm'):\n"
                "    try:\n"
                "        importlib.import_module(name)\n"
                "        print(name, 'imports')\n"
                "    except ImportError:\n"
                "        print(name, 'does not import')\n"
                "import tfpar, tfpar.benchmark\n"
                "print(sorted(set(dir(tfpar)) & {'machine', 'thread_layouts', 'evaluation',\n"
                "                                'schedules', 'multiworker', 'training'}))\n"
                "print(sorted(set(dir(tfpar.benchmark)) & {'configuration', 'measurements'}))\n")
        self.assertEqual(run_lines(code), [
            "tfpar.multiworker does not import", "tfpar.multiworker.launcher does not import",
            "tfpar.evaluation does not import", "tfpar.schedules does not import",
            "tfpar.benchmark.configuration does not import", "tfpar.machine does not import",
            "tfpar.thread_layouts does not import", "tfpar.multiworker.slurm does not import",
            "['training']", "['measurements']"])

    def test_aliases_are_left_out_of_dir_even_once_imported(self):
        code = ("import warnings\n"
                "warnings.simplefilter('ignore', DeprecationWarning)\n"
                "import tfpar.callbacks, tfpar.cluster\n"
                "import tfpar.callbacks.preemption, tfpar.cluster.protocol\n"
                "print(*sorted(set(dir(tfpar.callbacks)) & {'preemption',\n"
                "                                           'save_on_preemption'}))\n"
                "print(*sorted(set(dir(tfpar.cluster)) & {'protocol', 'launcher'}))\n"
                "print(tfpar.callbacks.preemption.SaveOnPreemption\n"
                "      is tfpar.callbacks.SaveOnPreemption)\n")
        self.assertEqual(run_lines(code), ["save_on_preemption", "launcher", "True"])


if __name__ == "__main__":
    tf.test.main()
