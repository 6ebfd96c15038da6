"""Checks the cluster recipes of examples/ as a user would meet them: the SLURM script and the
Kubernetes manifests use flags that exist and give the cluster that is tested, and the Ray
example says in one line what is missing. (The Ray example trains in tests/ray_test.py.)"""

import os
import re
import shlex
import subprocess
import sys

import tensorflow as tf
import yaml

from tfpar.cluster import kubernetes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(ROOT, "examples")


def train_flags() -> set[str]:
    listing = subprocess.run([sys.executable, "-c", "import tfpar.cli.train; from absl import "
                              "flags; print(' '.join(flags.FLAGS))"], capture_output=True,
                             text=True, timeout=60)
    return set(listing.stdout.split())


class ExamplesTest(tf.test.TestCase):

    def manifests(self) -> dict[str, dict]:
        with open(os.path.join(EXAMPLES, "kubernetes", "tfpar-train.yaml")) as f:
            return {document["kind"]: document for document in yaml.safe_load_all(f)}

    def test_the_kubernetes_manifests_give_the_tested_cluster(self):
        manifests = self.manifests()
        self.assertEqual(sorted(manifests), ["Job", "NetworkPolicy", "Service"])
        job, service = manifests["Job"], manifests["Service"]
        pod = job["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        env = {item["name"]: item["value"] for item in container["env"]}
        self.assertEqual(job["spec"]["completionMode"], "Indexed")
        self.assertEqual(job["spec"]["completions"], int(env["TFPAR_NUM_WORKERS"]))
        self.assertEqual(job["spec"]["parallelism"], int(env["TFPAR_NUM_WORKERS"]))
        self.assertEqual(pod["subdomain"], service["metadata"]["name"])
        self.assertEqual(env["TFPAR_SERVICE"], service["metadata"]["name"])
        self.assertEqual(service["spec"]["clusterIP"], "None")
        self.assertEqual(service["spec"]["selector"],
                         {"batch.kubernetes.io/job-name": job["metadata"]["name"]})
        self.assertEqual(service["spec"]["ports"][0]["port"], int(env["TFPAR_PORT"]))
        self.assertEqual(container["ports"][0]["containerPort"], int(env["TFPAR_PORT"]))
        self.assertEqual(manifests["NetworkPolicy"]["spec"]["ingress"][0]["ports"][0]["port"],
                         int(env["TFPAR_PORT"]))
        # What pod 1 computes from what Kubernetes and the manifest give it.
        spec = kubernetes.cluster_spec({**env, "JOB_COMPLETION_INDEX": "1"},
                                       f"{job['metadata']['name']}-1")
        self.assertEqual(spec, ({"worker": ["tfpar-train-0.tfpar-workers:2222",
                                            "tfpar-train-1.tfpar-workers:2222"]}, "worker", 1))
        command = container["command"]
        self.assertEqual(command[0], "tfpar-train")
        self.assertIn("--cluster=kubernetes", command)
        self.assert_flags_exist(" ".join(command[1:]))

    def test_the_sbatch_script_runs_the_train_command_under_srun(self):
        with open(os.path.join(EXAMPLES, "slurm", "train.sbatch")) as f:
            script = f.read().replace("\\\n", " ")
        (step,) = re.findall(r"^srun (.*)$", script, re.M)
        arguments = shlex.split(step)
        self.assertEqual(arguments[:2], ["python", "scripts/train.py"])
        self.assertIn("--cluster=slurm", arguments)
        self.assert_flags_exist(step)
        result = subprocess.run(["bash", "-n", os.path.join(EXAMPLES, "slurm", "train.sbatch")],
                                capture_output=True, text=True)
        self.assertEqual(result.returncode, 0, result.stderr)

    def assert_flags_exist(self, arguments: str) -> None:
        defined = train_flags()
        named = re.findall(r"--(\w+)", arguments)
        self.assertNotEmpty(named)
        for flag in named:
            self.assertIn(flag, defined, f"the train command has no --{flag}")

    def test_the_ray_example_without_ray_says_which_extra_in_one_line(self):
        code = ("import runpy, sys\n"
                "sys.modules['ray'] = None\n"  # Ray not installed.
                f"sys.argv = [{os.path.join(EXAMPLES, 'ray', 'train.py')!r}, '--epochs=1']\n"
                "runpy.run_path(sys.argv[0], run_name='__main__')\n")
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                timeout=120, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
        self.assertEqual(result.returncode, 1)
        self.assertEqual(result.stderr.strip().splitlines()[-1],
                         'Ray Train is not installed: pip install "tfpar[ray]" (or pip install '
                         '-e ".[ray]" in a checkout).')
        self.assertEqual(result.stdout, "")
