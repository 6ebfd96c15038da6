"""A private loopback network for local multi-worker jobs (Linux network namespaces).

TensorFlow's gRPC server, which every multi-worker process starts, listens on *every*
interface: ``grpc_server_lib.cc`` binds ``0.0.0.0:<port>`` whatever host the cluster names,
and no option changes it. The server has no authentication, so on a shared or networked
machine anyone who can reach the port can talk to the workers.

For a job whose workers all run on this machine there is a clean way out: run them in a
network namespace of their own, in which the only interface is a private loopback. Their
servers still bind ``0.0.0.0``, but that address now means only that loopback; no process
outside the job (on this machine or another) can reach them, and no port they use can be
taken by another program. The price: the workers cannot reach the network (download datasets
beforehand, or run with the host's network and firewall the ports).

The namespace is made by a short-lived holder process (``unshare``: a user namespace too when
not root, so no privilege is needed where the kernel allows unprivileged user namespaces); the
launcher keeps file descriptors of its namespaces open, and each worker joins them (``setns``)
between ``fork`` and ``exec``.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import socket
import struct
import subprocess
import sys

from tfpar.errors import ConfigError

_CLONE_NEWUSER = 0x10000000
_CLONE_NEWNET = 0x40000000
_SIOCGIFFLAGS = 0x8913
_SIOCSIFFLAGS = 0x8914
_IFF_UP = 0x1


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _bring_loopback_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        request = struct.pack("16sH14s", b"lo", 0, b"")
        flags = struct.unpack("16sH", fcntl.ioctl(s, _SIOCGIFFLAGS, request)[:18])[1]
        fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack("16sH14s", b"lo", flags | _IFF_UP, b""))


def create_here() -> None:
    """Moves this (single-threaded) process into new namespaces: same ids, loopback up."""
    uid, gid = os.geteuid(), os.getegid()
    new_user = uid != 0  # root can make a network namespace without a user namespace.
    _check(_libc().unshare(_CLONE_NEWNET | (_CLONE_NEWUSER if new_user else 0)), "unshare")
    if new_user:  # Map our ids to themselves, so files and ownership look the same inside.
        _write("/proc/self/setgroups", "deny")
        _write("/proc/self/uid_map", f"{uid} {uid} 1")
        _write("/proc/self/gid_map", f"{gid} {gid} 1")
    _bring_loopback_up()


# The holder: a fresh (so single-threaded) interpreter that makes the namespaces, says so,
# and lives until the launcher has opened them.
_HOLDER = ("import sys\n"
           "try:\n"
           "    from tfpar.cluster import private_network\n"
           "    private_network.create_here()\n"
           "except OSError as e:\n"
           "    print('refused:', e.strerror or e, flush=True)\n"
           "    sys.exit(1)\n"
           "except Exception as e:\n"
           "    print('failed:', type(e).__name__, e, flush=True)\n"
           "    sys.exit(1)\n"
           "print('ready', flush=True)\n"
           "sys.stdin.read()\n")


class Namespace:
    """A private network namespace that worker processes can be started in.

    Use as a context manager (it closes the namespace's descriptors; the namespace itself
    ends with its last process); pass :meth:`enter` as each worker's ``preexec_fn``.

    Raises:
        ConfigError: If this system cannot make one (not Linux, or user namespaces are not
            allowed to this user).
    """

    def __init__(self):
        self._fds: list[tuple[int, int]] = []
        if not sys.platform.startswith("linux"):
            raise ConfigError("A private network for the workers needs Linux network "
                              f"namespaces; this is {sys.platform}. Run them on the host's "
                              "network instead (network 'host') and firewall their ports.")
        import tfpar  # Its parent folder: the helper imports this copy of tfpar.

        package_root = os.path.dirname(os.path.dirname(os.path.abspath(tfpar.__file__)))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [package_root] + [p for p in [os.environ.get("PYTHONPATH")] if p])}
        holder = subprocess.Popen([sys.executable, "-c", _HOLDER], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                                  text=True)
        assert holder.stdin is not None and holder.stdout is not None  # Both are pipes.
        try:
            said = holder.stdout.readline().strip()
            if said.startswith("refused: "):
                raise ConfigError("Cannot make a private network for the workers "
                                  f"({said[len('refused: '):]}): this system does not allow "
                                  "user namespaces to this user. Run them on the host's "
                                  "network instead (network 'host') and firewall their ports.")
            if said != "ready":  # A defect of tfpar's, not of the system: say what it was.
                raise RuntimeError("The helper process of the private network failed: "
                                   f"{said or 'no output'}.")
            kinds = [("net", _CLONE_NEWNET)]
            if os.geteuid() != 0:
                kinds.insert(0, ("user", _CLONE_NEWUSER))  # Joined first, then its network.
            for name, kind in kinds:
                self._fds.append((os.open(f"/proc/{holder.pid}/ns/{name}", os.O_RDONLY), kind))
        finally:
            holder.stdin.close()
            holder.stdout.close()
            holder.wait()

    def enter(self) -> None:
        """Joins the namespace; for a worker's ``preexec_fn`` (runs after fork, before exec)."""
        libc = _libc()
        for fd, kind in self._fds:
            _check(libc.setns(fd, kind), "setns")

    def close(self) -> None:
        """Closes the namespace's descriptors (running workers stay in it)."""
        for fd, _ in self._fds:
            os.close(fd)
        self._fds = []

    def __enter__(self) -> Namespace:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
