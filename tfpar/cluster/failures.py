"""What a failed collective across workers means, in words a user can act on.

When a worker stops answering (killed, stopped, its machine down, the network cut),
TensorFlow's coordination service notices its missing heartbeats and aborts every collective
of the job; ``fit`` then raises a ``tf.errors.OpError`` whose text names the unhealthy tasks
(e.g. ``The following tasks are unhealthy (stopped sending heartbeats):
/job:worker/replica:0/task:1``). No TensorFlow at import.
"""

from __future__ import annotations

import re

# The phrases TensorFlow 2.16-2.21 use when a peer is lost (coordination service, collective
# executor, gRPC).
_ABORTED = ("unhealthy", "stopped sending heartbeats", "Collective ops is aborted")
_PEER_LOST = (*_ABORTED, "failed to connect to all addresses", "Socket closed",
              "Connection reset by peer", "connection refused")
_TASK = re.compile(r"/job:(\w+)/replica:\d+/task:(\d+)")
# gRPC's text names the peer that failed after "remote target"; the rest of an error's text
# names the reporting worker's own devices too (its nodes' placement).
_REMOTE = re.compile(r"remote target (/job:\w+/replica:\d+/task:\d+)")


def lost_peers(message: str) -> list[str] | None:
    """Returns the tasks a TensorFlow error says stopped answering (``["worker 1"]``; empty
    when it names none), or ``None`` when the error is not about a lost peer.

    Args:
        message: The text of a ``tf.errors.OpError``.
    """
    if not any(phrase.lower() in message.lower() for phrase in _PEER_LOST):
        return None
    remote = _REMOTE.findall(message)
    named = (message.split("unhealthy", 1)[1] if "unhealthy" in message
             else " ".join(remote) if remote else message)
    tasks = []
    for job, index in _TASK.findall(named):
        if f"{job} {index}" not in tasks:
            tasks.append(f"{job} {index}")
    return tasks


def collectives_aborted(message: str) -> bool:
    """Whether a TensorFlow error says the job's collectives were aborted (by the coordination
    service, for a task that stopped sending heartbeats), rather than only that a connection
    failed, which a storage service's can too."""
    lowered = message.lower()
    return any(phrase.lower() in lowered for phrase in _ABORTED)


def worker_indices(tasks: list[str]) -> tuple[int, ...]:
    """The indices of the ``worker`` tasks among ``tasks`` (from :func:`lost_peers`)."""
    return tuple(int(task.split()[1]) for task in tasks if task.split()[0] == "worker")


def peer_lost_message(tasks: list[str], saved: str) -> str:
    """The one line a worker prints when a peer stopped answering.

    Args:
        tasks: What :func:`lost_peers` returned.
        saved: Where the last finished epoch is, in words (or that nothing is saved).
    """
    who = " and ".join(tasks) if tasks else "A peer worker"
    return (f"{who[0].upper()}{who[1:]} stopped answering, so TensorFlow aborted the job's "
            "collectives. Check that every worker's process is still running (not stopped, "
            f"killed or out of memory) and the network between the workers. {saved}")
