"""Deprecated since 0.4.0, removed in 0.5.0: use :mod:`tfpar.worker_contract`.

The launcher–worker contract moved to one module below the cluster package. A state folder's
position is read with :func:`tfpar.worker_contract.read_position` (its ``position.json``; a
folder tfpar 0.3 saved is read from its ``positions.json``); the stop record no longer holds
a position.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from typing import Any

from tfpar import worker_contract

_SAME = ("ExitStatus", "SIGNALLED", "TF_CONFIG_ENV", "SLOT_ENV", "ALL_OUTPUT_ENV",
         "PRIVATE_NETWORK_ENV", "STOP_RECORD_ENV", "VISIBLE_GPUS_ENV", "normalized",
         "CHECKPOINT_INDEX", "latest_in_index", "run_folder_name", "StopRecord")
_RENAMED = {"POSITIONS_FILE": "LEGACY_POSITIONS_FILE"}


def _saved_position(folder: str) -> tuple[int, int] | None:
    position = worker_contract.read_position(folder)
    return position.pair if position is not None else None


def _last_saved_position(model_dir: str, runs: Sequence[str] = ("",)) -> tuple[int, int]:
    positions = [_saved_position(os.path.join(model_dir, run)) for run in runs]
    return max([(0, 0), *(p for p in positions if p is not None)])


def _record_stop(status: int, reason: str = "", unresponsive: Sequence[int] = (),
                 position: tuple[int, int] | None = None, work_lost: bool = False) -> None:
    del position  # Read by nothing: a folder's position is its position record.
    worker_contract.record_stop(status, reason, unresponsive, work_lost)


_REPLACED: dict[str, tuple[Any, str]] = {
    "saved_position": (_saved_position, "tfpar.worker_contract.read_position"),
    "last_saved_position": (_last_saved_position, "tfpar.worker_contract.read_position"),
    "record_stop": (_record_stop, "tfpar.worker_contract.record_stop"),
}


def __getattr__(name: str) -> Any:
    if name in _SAME or name in _RENAMED:
        new = _RENAMED.get(name, name)
        value, replacement = getattr(worker_contract, new), f"tfpar.worker_contract.{new}"
    elif name in _REPLACED:
        value, replacement = _REPLACED[name]
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(f"tfpar.cluster.protocol.{name} is deprecated and will be removed in 0.5.0: "
                  f"use {replacement}.", DeprecationWarning, stacklevel=2)
    return value
