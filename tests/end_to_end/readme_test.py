"""Runs the code blocks of README.md exactly as written, each in a fresh process."""

import os
import re
import subprocess
import sys

import tensorflow as tf
from absl.testing import parameterized

from tfpar import strategies

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def readme_block(name: str) -> str:
    """Returns the python block that follows ``<!-- test: name -->`` in README.md."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    match = re.search(rf"<!-- test: {name} -->\n```python\n(.*?)```", text, re.DOTALL)
    assert match, f"README.md has no block marked {name}"
    return match.group(1)


def run_python(code: str, cwd: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})


class ReadmeTest(tf.test.TestCase, parameterized.TestCase):

    def test_user_code_under_every_single_process_strategy(self):
        code = readme_block("user_code")
        self.assertIn('"mirrored", devices=2', code)
        # One process runs the block once per strategy (one-device entries on one device).
        runs = []
        for name, entry in ((n, strategies.entry(n)) for n in strategies.available()):
            if entry.multi_process:
                continue
            devices = 1 if entry.max_devices == 1 else 2
            runs.append(code.replace('"mirrored", devices=2', f'"{name}", devices={devices}')
                        .replace("epochs=2", "epochs=1"))
        result = run_python("\n".join(runs), self.get_temp_dir())
        self.assertEqual(result.returncode, 0, result.stderr[-3000:])
        self.assertLen(re.findall(r"'accuracy': ", result.stdout), len(runs))

    def test_testing_example(self):
        path = os.path.join(self.get_temp_dir(), "my_model_test.py")
        with open(path, "w", encoding="utf-8") as f:
            f.write(readme_block("testing_example"))
        result = subprocess.run([sys.executable, path], capture_output=True, text=True,
                                timeout=300)
        self.assertEqual(result.returncode, 0, result.stderr[-3000:])
        self.assertRegex(result.stderr, r"OK \(skipped=\d+\)")


if __name__ == "__main__":
    tf.test.main()
