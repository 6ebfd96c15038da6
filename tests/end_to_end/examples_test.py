"""Checks the cluster recipes of examples/ as a user would meet them: the SLURM script and the
Kubernetes manifests use flags that exist and give the cluster that is tested, and the Ray
example says in one line what is missing. (The Ray example trains in tests/ray_test.py.)"""

import os
import re
import shlex
import signal
import subprocess
import sys
import time

import indexed_job_pods  # The pods of an Indexed Job, emulated.
import pytest
import tensorflow as tf
import yaml

import tfpar
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
        self.assertEqual(sorted(manifests),
                         ["Job", "NetworkPolicy", "PersistentVolumeClaim", "Service"])
        with open(os.path.join(EXAMPLES, "kubernetes", "tfpar-train.yaml")) as f:
            text = f.read()
        # The pods' job-completion-index label (the log command selects by it) is 1.28's.
        self.assertIn("Kubernetes 1.28+", text)
        job, service = manifests["Job"], manifests["Service"]
        name = job["metadata"]["name"]
        # The log command selects this Job's running worker 0, not another Job's or a
        # replaced pod.
        self.assertIn(f"--field-selector=status.phase=Running \\\n#       -l "
                      f"batch.kubernetes.io/job-name={name},"
                      "batch.kubernetes.io/job-completion-index=0", text)
        pod = job["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        env = {item["name"]: item["value"] for item in container["env"] if "value" in item}
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
            script = f.read()
        (step,) = re.findall(r"^\s*srun (.*?) &$", re.sub(r"\\\n\s*", " ", script), re.M)
        arguments = shlex.split(step)
        # Since Slurm 22.05 srun does not inherit --cpus-per-task.
        self.assertEqual(arguments[0], '--cpus-per-task=$SLURM_CPUS_PER_TASK')
        self.assertEqual(arguments[1], "tfpar-train")
        self.assertIn("--cluster=slurm", arguments)
        self.assertIn('--model_dir=$state', arguments)
        self.assert_flags_exist(" ".join(arguments[2:]))
        # One state folder per job id (kept across requeues), the notice before the time
        # limit, and a job that may go back to the queue.
        self.assertRegex(script, r'(?m)^state=.*/\$SLURM_JOB_ID"$')
        self.assertRegex(script, r"(?m)^#SBATCH --signal=USR1@\d+$")
        self.assertIn("--preemption_signal=SIGUSR1", arguments)
        self.assertRegex(script, r"(?m)^#SBATCH --requeue$")
        result = subprocess.run(["bash", "-n", os.path.join(EXAMPLES, "slurm", "train.sbatch")],
                                capture_output=True, text=True)
        self.assertEqual(result.returncode, 0, result.stderr)

    def stand_ins(self, srun_body: str) -> tuple[str, dict[str, str]]:
        """Stand-ins for srun and scontrol (recording what they were asked) and an empty
        environment to activate: the calls file and the environment sbatch would give."""
        base = self.get_temp_dir()
        bin_dir, venv = os.path.join(base, "bin"), os.path.join(base, "venv")
        os.makedirs(bin_dir, exist_ok=True)
        os.makedirs(os.path.join(venv, "bin"), exist_ok=True)
        open(os.path.join(venv, "bin", "activate"), "w").close()
        calls = os.path.join(base, "calls")
        if os.path.exists(calls):
            os.remove(calls)
        for name, body in (("srun", f'echo "srun $*" >> {shlex.quote(calls)}\n{srun_body}'),
                           ("scontrol", f'echo "scontrol $*" >> {shlex.quote(calls)}')):
            path = os.path.join(bin_dir, name)
            with open(path, "w") as f:
                f.write(f"#!/bin/bash\n{body}\n")
            os.chmod(path, 0o755)
        return calls, {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": base, "TFPAR_VENV": venv,
                       "SLURM_JOB_ID": "4242", "SLURM_CPUS_PER_TASK": "8"}

    def test_the_sbatch_script_requeues_a_preempted_job_only(self):
        # The script as sbatch runs it; the stand-in srun exits as the step would.
        for step_status, requeued, steps in ((85, True, 1), (0, False, 1), (1, False, 1),
                                             (2, False, 1), (75, False, 3)):
            calls, environ = self.stand_ins('exit "$STEP_STATUS"')
            result = subprocess.run(
                ["bash", os.path.join(EXAMPLES, "slurm", "train.sbatch")], capture_output=True,
                text=True, timeout=60, env={**environ, "STEP_STATUS": str(step_status)})
            self.assertEqual(result.returncode, step_status, result.stderr)
            with open(calls) as f:
                lines = f.read().splitlines()
            self.assertLen(lines, steps + requeued)
            for line in lines[:steps]:
                self.assertRegex(line, rf"^srun --cpus-per-task=8 tfpar-train .*--model_dir="
                                       rf"{re.escape(environ['HOME'])}/tfpar-state/4242 ")
            self.assertEqual(lines[steps:], ["scontrol requeue 4242"] if requeued else [])

    def test_the_sbatch_script_survives_the_preemptions_sigterm_and_requeues(self):
        # A preemption sends SIGTERM to the batch shell and to the tasks (Slurm signals each);
        # the tasks save and exit 85 a moment later. The shell must outlive its own SIGTERM to
        # requeue. Here the stand-in step waits until the test lets it exit 85.
        go = os.path.join(self.get_temp_dir(), "saved")
        calls, environ = self.stand_ins(f"while [ ! -e {shlex.quote(go)} ]; do sleep 0.05; "
                                        "done\nexit 85")
        shell = subprocess.Popen(["bash", os.path.join(EXAMPLES, "slurm", "train.sbatch")],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 env=environ)
        try:
            for _ in range(600):
                if os.path.exists(calls):
                    break
                time.sleep(0.05)
            time.sleep(0.2)  # The shell is in its wait for srun.
            shell.send_signal(signal.SIGTERM)
            time.sleep(0.2)
            open(go, "w").close()  # The tasks have saved.
            out, err = shell.communicate(timeout=60)
        finally:
            shell.kill()
        self.assertEqual(shell.returncode, 85, err)
        self.assertIn("sbatch: SIGTERM: waiting for the tasks to save", out)
        with open(calls) as f:
            self.assertEqual(f.read().splitlines()[1:], ["scontrol requeue 4242"])

    def test_the_kubernetes_image_is_built_from_the_dockerfile_with_a_fixed_tag(self):
        (container,) = self.manifests()["Job"]["spec"]["template"]["spec"]["containers"]
        image = container["image"]
        self.assertRegex(image, r":\d+\.\d+\.\d+$")  # Not :latest: every pod the same code.
        with open(os.path.join(EXAMPLES, "kubernetes", "Dockerfile")) as f:
            dockerfile = f.read()
        # The image installs the wheel it is given (the version built), copied in.
        wheel = f"tfpar-{tfpar.__version__}-py3-none-any.whl"
        self.assertRegex(dockerfile, rf"(?m)^ARG TFPAR_WHEEL={re.escape(wheel)}$")
        self.assertIn("COPY ${TFPAR_WHEEL} /tmp/", dockerfile)
        self.assertIn('pip install --no-cache-dir "/tmp/${TFPAR_WHEEL}${TFPAR_EXTRAS}"',
                      dockerfile)
        self.assertTrue(image.endswith(f":{tfpar.__version__}"), image)
        self.assertIn(f"tfpar-train:{tfpar.__version__}", dockerfile)
        # The state lives on the claim the manifest makes, in a folder of this Job's own.
        manifests = self.manifests()
        claim = manifests["PersistentVolumeClaim"]
        self.assertEqual(claim["spec"]["accessModes"], ["ReadWriteMany"])
        (volume,) = manifests["Job"]["spec"]["template"]["spec"]["volumes"]
        self.assertEqual(volume["persistentVolumeClaim"]["claimName"], claim["metadata"]["name"])
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        model_dir = f"--model_dir={mounts[volume['name']]}/$(TFPAR_JOB_UID)"
        self.assertIn(model_dir, container["command"])
        # The Dockerfile's comments name the folder the manifest uses, not another.
        self.assertEqual(re.findall(r"--model_dir=[\w/]+(?:\$\(\w+\))?", dockerfile),
                         [model_dir])
        (uid,) = [item for item in container["env"] if item["name"] == "TFPAR_JOB_UID"]
        self.assertEqual(uid["valueFrom"]["fieldRef"]["fieldPath"],
                         "metadata.labels['batch.kubernetes.io/controller-uid']")

    def test_the_kubernetes_job_retries_a_preempted_worker_and_fails_on_bad_input(self):
        job = self.manifests()["Job"]
        pod = job["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        rules = job["spec"]["podFailurePolicy"]["rules"]
        on_exit = {rule["action"]: rule["onExitCodes"]["values"] for rule in rules
                   if "onExitCodes" in rule}
        self.assertEqual(on_exit, {"FailJob": [2], "Ignore": [85]})
        self.assertIn({"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]},
                      rules)
        self.assertEqual(pod["restartPolicy"], "Never")  # What podFailurePolicy needs.
        grace = [float(a.split("=")[1]) for a in container["command"]
                 if a.startswith("--preemption_grace_seconds=")]
        self.assertLen(grace, 1)
        self.assertLess(grace[0], pod["terminationGracePeriodSeconds"])

    def pod_command(self, container: dict, volume: str, job_uid: str, epochs: int) -> list[str]:
        """The container's command as Kubernetes runs it (``$(NAME)`` from the container's
        variables), its volume at ``volume``, ``--epochs`` made short."""
        env = {item["name"]: item.get("value", job_uid) for item in container["env"]}
        mount = container["volumeMounts"][0]["mountPath"]
        command = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], argument)
                   .replace(f"={mount}/", f"={volume}/") for argument in container["command"]]
        command = [f"--epochs={epochs}" if a.startswith("--epochs=") else a for a in command]
        self.assertEqual(command[0], "tfpar-train")
        return [sys.executable, "-c", "from tfpar.cli import train; train.run()", *command[1:]]

    def run_pods(self, pods, command: list[str], env: dict[str, str],
                 notice_when: str | None = None) -> list[tuple[int, str]]:
        """Every pod's exit status and output; with ``notice_when`` (a path), pod 1 gets
        SIGTERM (as the kubelet sends at an eviction) once the path exists."""
        tasks = [pods.popen(i, command, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True) for i in range(pods.count)]
        try:
            if notice_when:
                deadline = time.monotonic() + 240
                while not os.path.exists(notice_when) and time.monotonic() < deadline:
                    time.sleep(0.1)
                tasks[1].send_signal(signal.SIGTERM)  # nsenter runs the command in its place.
            return [(task.wait(timeout=300), task.stdout.read()) for task in tasks]
        finally:
            for task in tasks:
                task.kill()

    @pytest.mark.cluster  # Two Jobs of two pods: `pytest -m cluster`.
    def test_the_kubernetes_job_runs_in_pods_and_resumes_after_an_eviction(self):
        # The manifest's Job, its pods emulated (each its own address, hostname and the
        # Service's names; tests/cluster/indexed_job_pods.py), its podFailurePolicy applied to
        # each pod's exit status as the Job controller applies it.
        job = self.manifests()["Job"]
        (container,) = job["spec"]["template"]["spec"]["containers"]
        rules = job["spec"]["podFailurePolicy"]["rules"]

        def action(status: int) -> str:
            for rule in rules:
                codes = rule.get("onExitCodes")
                if codes and (status in codes["values"]) == (codes["operator"] == "In"):
                    return rule["action"]
            return "Count" if status else "Succeeded"  # Against backoffLimit.

        volume = self.get_temp_dir()
        env = {key: value for key, value in os.environ.items()
               if key not in ("TF_CONFIG", "CUDA_VISIBLE_DEVICES")}
        env.update({item["name"]: item["value"] for item in container["env"] if "value" in item})
        command = self.pod_command(container, volume, "job-uid-1", epochs=3)
        with indexed_job_pods.IndexedJobPods(self.get_temp_dir(),
                                             count=int(job["spec"]["completions"])) as pods:
            # Bad input fails the Job at once, without a retry.
            ((status, output), *_) = self.run_pods(pods, [*command, "--epochs=0"], env)
            self.assertEqual(action(status), "FailJob", output[-2000:])
            # An eviction of pod 1 once epoch 1 is saved: every pod saves and exits 85, which
            # the Job ignores (new pods take their indexes) ...
            index = os.path.join(volume, "job-uid-1", "multi_worker_1_devices", "checkpoint")
            first = self.run_pods(pods, command, env, notice_when=index)
            self.assertEqual([action(status) for status, _ in first], ["Ignore", "Ignore"],
                             [output[-2000:] for _, output in first])
            # ... and the new pods resume where the job stopped and finish it.
            second = self.run_pods(pods, command, env)
            self.assertEqual([action(status) for status, _ in second],
                             ["Succeeded", "Succeeded"], [out[-2000:] for _, out in second])
        self.assertRegex(second[0][1], r"Resuming from .*/job-uid-1/multi_worker_1_devices/"
                                       r"ckpt-\d+ \((epoch 2 step \d+|the end of epoch 1)\)")
        self.assertIn("test acc: ", second[0][1])

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
                         "tfpar.ray needs Ray Train, which is not installed: install tfpar "
                         f'with its ray extra (pip install "tfpar-{tfpar.__version__}-py3-none-'
                         'any.whl[ray]", or pip install -e ".[ray]" in a checkout).')
        self.assertEqual(result.stdout, "")
