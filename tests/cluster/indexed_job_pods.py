"""The pods of a Kubernetes Indexed Job behind a headless Service, emulated on this machine.

What a worker's pod has in a cluster, each pod here has too: its own network (a namespace with
an address of its own on a private link between the pods, so every pod's server listens on the
same port, as in a cluster), the hostname Kubernetes gives it (``<job>-<index>``, in a UTS
namespace), the Service's names of every pod (``<job>-<index>.<service>``, which the cluster's
DNS answers; here the pod's own ``/etc/hosts``, in a mount namespace) and the variables an
Indexed Job and tfpar's manifests set (``JOB_COMPLETION_INDEX``, ``TFPAR_NUM_WORKERS``,
``TFPAR_SERVICE``). The pods share this machine's files, as pods share a volume. Nothing reaches
another machine: the link joins the pods' namespaces only.

What is not emulated: the cluster's DNS server and kube-proxy (the names are in ``/etc/hosts``),
a pod restarted by its Job, and the scheduler.
"""

from __future__ import annotations

import os
import subprocess
import time

_NAMESPACES = ["--user", "--net", "--uts", "--mount", "--preserve-credentials"]


def _address(index: int) -> str:
    """Pod ``index``'s address on the pods' private link."""
    return f"10.77.0.{index + 1}"


class IndexedJobPods:
    """``count`` pods of the Indexed Job ``job`` behind the headless Service ``service``.

    Use as a context manager; :meth:`popen` starts a command in a pod.
    """

    def __init__(self, directory: str, count: int = 2, job: str = "tfpar-train",
                 service: str = "tfpar-workers"):
        self.directory, self.count, self.job, self.service = directory, count, job, service
        self._holders: list[subprocess.Popen] = []
        self._pids: list[int] = []
        self._switch = 0

    def hostname(self, index: int) -> str:
        return f"{self.job}-{index}"

    def environment(self, index: int) -> dict[str, str]:
        """What Kubernetes and the manifest set in pod ``index``."""
        return {"JOB_COMPLETION_INDEX": str(index), "TFPAR_NUM_WORKERS": str(self.count),
                "TFPAR_SERVICE": self.service, "HOSTNAME": self.hostname(index)}


    def __enter__(self) -> IndexedJobPods:
        # One user namespace owns the others (so no privilege is needed where the kernel allows
        # user namespaces); a switch's namespace holds the bridge every pod's link joins. Neither
        # unshare nor nsenter forks here: each holder's pid is its namespaces'.
        user = self._hold(["unshare", "--user", "--map-root-user", "sleep", "infinity"])
        joined = ["nsenter", "-t", str(user), "--user", "--preserve-credentials", "unshare",
                  "--net", "--uts", "--mount", "--propagation", "private", "sleep", "infinity"]
        self._switch = self._hold(joined)
        self._pids = [self._hold(joined) for _ in range(self.count)]
        names = "".join(f"{_address(i)} {self.hostname(i)}.{self.service}\n"
                        for i in range(self.count))
        hosts = os.path.join(self.directory, "hosts")
        with open(hosts, "w") as f:
            f.write(f"127.0.0.1 localhost\n{names}")
        self._run(self._switch, ["ip", "link", "add", "pods", "type", "bridge"])
        for i, pid in enumerate(self._pids):
            self._run(self._switch, ["ip", "link", "add", f"pod{i}", "master", "pods", "type",
                                     "veth", "peer", "name", "eth0", "netns",
                                     f"/proc/{pid}/ns/net"])
            self._run(self._switch, ["ip", "link", "set", f"pod{i}", "up"])
            self._run(pid, ["sh", "-ec", f"ip link set lo up && ip link set eth0 up && "
                                         f"ip addr add {_address(i)}/24 dev eth0 && "
                                         f"hostname {self.hostname(i)} && "
                                         f"mount --bind {hosts} /etc/hosts"])
        self._run(self._switch, ["ip", "link", "set", "pods", "up"])
        return self

    def _hold(self, command: list[str]) -> int:
        holder = subprocess.Popen(command)
        self._holders.append(holder)
        for _ in range(200):  # Until its namespaces are made (its command is running).
            with open(f"/proc/{holder.pid}/cmdline", "rb") as f:
                if f.read().split(b"\0")[0] == b"sleep":
                    return holder.pid
            time.sleep(0.02)
        raise RuntimeError(f"{command} did not start")

    @staticmethod
    def _run(pid: int, command: list[str]) -> None:
        subprocess.run(["nsenter", "-t", str(pid), *_NAMESPACES, "--", *command], check=True,
                       capture_output=True, timeout=30)

    def popen(self, index: int, command: list[str], env: dict[str, str],
              **kwargs) -> subprocess.Popen:
        """Starts ``command`` in pod ``index``, with ``env`` and the pod's variables."""
        return subprocess.Popen(["nsenter", "-t", str(self._pids[index]), *_NAMESPACES, "--",
                                 *command],
                                env={**env, **self.environment(index)}, **kwargs)

    def __exit__(self, *exc_info) -> None:
        for holder in reversed(self._holders):
            holder.kill()
            holder.wait()

