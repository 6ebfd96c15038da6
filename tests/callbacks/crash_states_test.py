"""Every crash state of every save, held to one oracle (after ALICE, OSDI'14, and CrashMonkey,
OSDI'18).

Each save protocol (``EpochCheckpoint`` at an epoch's end and inside one, the ``BackupAndRestore``
fix, the position record, the worker spec, the stop record) makes every change to its files through
:mod:`tfpar.atomic_io`, which records them in order with the bytes written. A test here trains a
tiny model with per-replica BatchNorm on 2 replicas, records one save once, and then rebuilds in a
fresh folder each state the save can leave:

- **a kill at each operation**: the operations before it done, the one at it not done or, for a
  write that is not atomic, half done;
- **each file the save leaves damaged**: cut to half, emptied, deleted, replaced by the file of
  the save before (another generation's), and, for a replicas' copies file, by one holding other
  replicas' copies (another worker's), or with a copies file the save did not write beside it.

Every protocol's states are explored in the README's suite (about 150, in seconds); run with
``-s`` to see each protocol's count.

For each state it runs the restore in this process (and, for a checkpoint, the launcher's
reader of its position record, which must give where the restore resumes or none, and
after the restore where it resumed) and holds it to one oracle:
the restored state is bit for bit the state of a committed save (every variable of the model and
the optimizer, each replica's copy apart, the position, a mid-epoch save's metrics), or the
restore raises one :class:`~tfpar.errors.TfparError` whose one line names the damaged file (the
programs exit 2 on it). A kill is never allowed an error: a restart must resume. Any other
exception, or any other state, is a failure, listed with the state that gave it. The records
the launcher reads (position, spec, stop) have a reader that never raises: it must give the old
record, the new one, or (damaged) none.

A damaged file restores the last save, or is refused: restoring an earlier one silently would
throw training away. The states let through are printed: the file that commits a save (the
``checkpoint`` index, ``BackupAndRestore``'s metadata) replaced by the save before's restores
that save, as a kill just before the commit does; TensorFlow's ``checkpoint`` index deleted,
where TensorFlow finds no checkpoint and the run starts over (a kill before a first save's
index leaves the same files less the first one's, from which starting over is right; tfpar
cannot tell them apart); with ``double_checkpoint``, a damaged weights file resumes from the
save before, said in a warning.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import re
import shutil
from collections.abc import Callable
from unittest import mock

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfpar import atomic_io
from tfpar import testing
from tfpar import worker_contract
from tfpar.callbacks import checkpointing
from tfpar.errors import TfparError

TESTING_GUIDE = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "guide",
                             "testing.md")

#: States explored per protocol (a fixed sample of them); None: all (each protocol's take
#: seconds, so the README's suite explores all).
SAMPLE: int | None = None


def batchnorm_model() -> keras.Model:
    """Dense, per-replica BatchNorm (its replicas' statistics drift apart) and momentum."""
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3),
                              keras.layers.BatchNormalization(momentum=0.5),
                              keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss="mse",
                  metrics=["mae"])
    return model


def data():
    rng = np.random.default_rng(0)
    return rng.random((16, 4), dtype=np.float32), rng.random((16, 2), dtype=np.float32)


def state_of(model: keras.Model) -> dict[tuple[int, int], bytes]:
    """Every variable of the model and its optimizer, each replica's copy apart, as bytes."""
    values = {}
    for place, variable in enumerate([*model.variables, *model.optimizer.variables]):
        for replica, copy in enumerate(copies_of(variable)):
            values[(place, replica)] = np.asarray(copy.numpy()).tobytes()
    return values


def copies_of(variable) -> tuple:
    """The copies of a variable the replicas read (of the optimizer's step count, the first
    replica's only: the others are never read)."""
    tensor = getattr(variable, "value", variable)
    copies = tuple(getattr(tensor, "values", (tensor,)))
    if getattr(tensor, "aggregation", None) == tf.VariableAggregation.ONLY_FIRST_REPLICA:
        return copies[:1]
    return copies


def set_state(model: keras.Model, values: dict[tuple[int, int], bytes]) -> None:
    """Gives every copy of every variable its value in ``values`` (from :func:`state_of`)."""
    for place, variable in enumerate([*model.variables, *model.optimizer.variables]):
        for replica, copy in enumerate(copies_of(variable)):
            dtype = np.dtype(copy.dtype.as_numpy_dtype)
            copy.assign(np.frombuffer(values[(place, replica)], dtype).reshape(copy.shape))


@dataclasses.dataclass(frozen=True)
class Committed:
    """A committed save: its position, every variable's copies, a mid-epoch save's metrics."""

    position: tuple[int, int]
    state: dict[tuple[int, int], bytes]
    metrics: tuple[bytes, ...] = ()


@dataclasses.dataclass
class Recorded:
    """One save, recorded: the files under ``root`` before it and its operations."""

    root: str
    before: dict[str, bytes]
    folders: list[str]
    operations: list[atomic_io.Operation]

    @classmethod
    def of(cls, root: str, save: Callable[[], object]) -> Recorded:
        before, folders = files_under(root)
        with atomic_io.recording() as operations:
            save()
        recorded = cls(root, before, folders, list(operations))
        # The operations rebuild exactly what the save left.
        with scratch_folder() as rebuilt:
            recorded.build(rebuilt, len(operations))
            assert files_under(rebuilt)[0] == files_under(root)[0], (
                "the recorded operations do not rebuild the save's files")
        return recorded

    def build(self, folder: str, cut: int, half: bool = False) -> None:
        """The files a kill at operation ``cut`` leaves in ``folder`` (the operation half done
        where ``half``)."""
        for relative in self.folders:
            os.makedirs(os.path.join(folder, relative), exist_ok=True)
        for relative, content in self.before.items():
            write(os.path.join(folder, relative), content)
        for operation in self.operations[:cut]:
            self.apply(folder, operation)
        if half:
            operation = self.operations[cut]
            write(self.moved(folder, operation.path),
                  operation.data[:len(operation.data) // 2])

    def moved(self, folder: str, path: str) -> str:
        return os.path.join(folder, os.path.relpath(path, self.root))

    def apply(self, folder: str, operation: atomic_io.Operation) -> None:
        path = self.moved(folder, operation.path)
        if operation.kind == "write":
            write(path, operation.data)
        elif operation.kind == "rename":
            os.replace(path, self.moved(folder, operation.target))
        elif operation.kind == "remove":
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
        elif operation.kind == "remove_dir":
            shutil.rmtree(path, ignore_errors=True)
        elif operation.kind == "make_dirs":
            os.makedirs(path, exist_ok=True)
        else:
            raise AssertionError(f"unknown operation {operation.kind}")

    def left(self) -> dict[str, bytes]:
        """The files the save wrote that it leaves (relative path: bytes)."""
        with scratch_folder() as folder:
            self.build(folder, len(self.operations))
            after, _ = files_under(folder)
        touched = {os.path.relpath(o.path if o.kind != "rename" else o.target, self.root)
                   for o in self.operations}
        return {path: data for path, data in after.items() if path in touched}


def files_under(root: str) -> tuple[dict[str, bytes], list[str]]:
    files, folders = {}, []
    for folder, _, names in os.walk(root):
        folders.append(os.path.relpath(folder, root))
        for name in names:
            path = os.path.join(folder, name)
            with open(path, "rb") as f:
                files[os.path.relpath(path, root)] = f.read()
    return files, folders


def write(path: str, content: bytes) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(content)


_scratch = [0]


@contextlib.contextmanager
def scratch_folder():
    folder = os.path.join(os.environ.get("TEST_TMPDIR", "/tmp"), f"crash-state-{os.getpid()}-"
                          f"{_scratch[0]}")
    _scratch[0] += 1
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def other_workers_copies(content: bytes) -> bytes | None:
    """A replicas' copies file with the same name and replica ids whose rows are other
    replicas' copies (what a file written by another worker puts under this name)."""
    import io

    try:
        with np.load(io.BytesIO(content)) as loaded:
            arrays = {key: loaded[key] for key in loaded.files}
    except Exception:  # noqa: BLE001 - not a NumPy file: no such damage.
        return None
    swapped = {key: (value[::-1] if key.startswith("variable_") else value)
               for key, value in arrays.items()}
    buffer = io.BytesIO()
    np.savez(buffer, **swapped)
    return buffer.getvalue()


@dataclasses.dataclass(frozen=True)
class State:
    """One state to restore from: a kill (``cut``, ``half``) or a damaged file."""

    cut: int
    half: bool = False
    damage: str = ""
    file: str = ""
    content: bytes | None = None  # The damaged file's content (None: deleted).
    added: bool = False  # The file is one the save did not write.

    def describe(self, recorded: Recorded) -> str:
        if self.damage:
            return f"{self.file} {self.damage}"
        if self.cut == len(recorded.operations):
            return "after the save"
        operation = recorded.operations[self.cut]
        what = os.path.relpath(operation.path, recorded.root)
        return (f"killed {'halfway through' if self.half else 'before'} operation "
                f"{self.cut} ({operation.by} {operation.kind} {what})")


ROLLED_BACK = "replaced by the save before's"


def states(recorded: Recorded, generation: Callable[[str], str | None]) -> list[State]:
    """Every state: a kill at each operation, and each file the save leaves damaged."""
    found = []
    for cut, operation in enumerate(recorded.operations):
        found.append(State(cut))
        if operation.kind == "write" and not operation.atomic and operation.data:
            found.append(State(cut, half=True))
    end = len(recorded.operations)
    found.append(State(end))
    for path, content in sorted(recorded.left().items()):
        found.append(State(end, damage="cut to half", file=path,
                           content=content[:len(content) // 2]))
        found.append(State(end, damage="emptied", file=path, content=b""))
        found.append(State(end, damage="deleted", file=path, content=None))
        before = generation(path)
        other = recorded.before.get(before if before is not None else path)
        if other is not None and other != content:
            found.append(State(end, damage=ROLLED_BACK, file=path, content=other))
        if path.endswith(".npz"):
            swapped = other_workers_copies(content)
            if swapped is not None:
                found.append(State(end, damage="replaced by other replicas' copies",
                                   file=path, content=swapped))
                # A file the save did not write, beside those it did (a worker's of another
                # job size): never read, or refused naming it.
                extra = os.path.join(os.path.dirname(path), "replicas-00000-00000-of-00001.npz")
                found.append(State(end, damage="added beside the save's files", file=extra,
                                   content=content, added=True))
    return found


def build(recorded: Recorded, state: State, folder: str) -> None:
    recorded.build(folder, state.cut, state.half)
    if state.damage:
        path = os.path.join(folder, state.file)
        if state.content is None:
            os.remove(path)
        else:
            write(path, state.content)


def names_the_file(message: str, file: str) -> bool:
    """Whether an error's line names the damaged file (a checkpoint's own files by their
    checkpoint)."""
    name = os.path.basename(file)
    prefix = re.match(r"^(ckpt-\d+)\.", name)
    # The name as a path's last part: "checkpoint", the index's name, is a word of nearly
    # every line about a checkpoint, which so passed for naming it.
    return (re.search(rf"/{re.escape(name)}(?![\w.-])", message) is not None
            or (prefix is not None and f"{prefix[1]}.index" in message))


REPORTED: list[str] = []
"""This test's counts, for the test summary ("crash states" lines)."""


def say(line: str) -> None:
    """Prints ``line`` (seen with ``-s``) and reports it in the test summary."""
    print(line)
    REPORTED.append(line)


class CrashStatesCase(testing.StrategyTestCase):

    @pytest.fixture(autouse=True)
    def _report(self, record_property):
        REPORTED.clear()
        yield
        for line in REPORTED:
            record_property("crash states", line)

    def explore(self, name: str, recorded: Recorded, committed: list[Committed],
                restore: Callable[[str], Committed],
                generation: Callable[[str], str | None] = lambda path: None,
                earlier_allowed: Callable[[State], bool] = lambda state: False) -> None:
        """Restores from each state (a sample in the README's suite) and holds it to the
        oracle; prints how many states there are and how many were explored."""
        everything = states(recorded, generation)
        explored = everything
        if SAMPLE is not None and len(everything) > SAMPLE:
            explored = random.Random(0).sample(everything, SAMPLE)
        failures, earlier = [], []
        for state in explored:
            with scratch_folder() as folder:
                build(recorded, state, folder)
                failure = self.judge(state, folder, committed, restore)
            if failure.startswith("earlier ") and state.damage and earlier_allowed(state):
                earlier.append(f"{state.describe(recorded)}: {failure}")
            elif failure:
                failures.append(f"{state.describe(recorded)}: {failure}")
        say(f"crash states of {name}: {len(everything)} ({len(recorded.operations)} "
              f"operations), explored {len(explored)}")
        self.assertDocumented(name, len(recorded.operations), len(everything))
        for line in earlier:
            say(f"  allowed, restored an earlier save: {line}")
        self.assertGreater(len(recorded.operations), 0)
        self.assertGreater(len(explored), 0)
        self.assertEqual(failures, [], f"{len(failures)} of {len(explored)} states of {name} "
                                       "failed the oracle")

    def assertDocumented(self, name: str, operations: int, states: int) -> None:
        """The testing guide's table gives this protocol's counts as this run found them."""
        with open(TESTING_GUIDE, encoding="utf-8") as f:
            rows = re.findall(r"^\| ([^|]+?) \| (\d+) \| (\d+) \|$", f.read(), re.M)
        found = {row[0].replace("`", ""): (int(row[1]), int(row[2])) for row in rows}
        self.assertEqual(found.get(name), (operations, states),
                         f"docs/guide/testing.md's row for {name!r}")

    def trained_from(self) -> tuple:
        """The strategy (2 replicas), a model with BatchNorm built under it with its optimizer,
        the data, and the model's initial state."""
        strategy = self.strategy("mirrored", 2)
        with strategy.scope():
            model = batchnorm_model()
            model.optimizer.build(model.trainable_variables)
        return strategy, model, data(), state_of(model)

    def judge(self, state: State, folder: str, committed: list[Committed],
              restore: Callable[[str], Committed]) -> str:
        """What is wrong with the restore from ``folder`` ("" where nothing is)."""
        try:
            restored = restore(folder)
        except TfparError as e:
            line = str(e)
            if not state.damage:
                return f"a kill left a state the restore refuses: {line}"
            if "\n" in line or not names_the_file(line, state.file):
                return f"the error does not name {state.file} in one line: {line!r}"
            return ""
        except Exception as e:  # noqa: BLE001 - any other exception fails the oracle.
            return f"{type(e).__name__}: {e}"
        for save in committed[::-1]:
            if restored == save:
                # A kill restores the save or the one before (committed); a damaged file the
                # save, unless the protocol allows an earlier one.
                return ("" if save in committed[-1 if state.damage else -2:]
                        else f"earlier position {save.position} restored")
        positions = [save.position for save in committed]
        same = [save for save in committed if save.position == restored.position]
        if not same:
            return f"restored position {restored.position}, saved {positions}"
        differ = [key for key, value in restored.state.items()
                  if same[0].state.get(key) != value]
        return (f"silently different: at position {restored.position}, {len(differ)} of "
                f"{len(restored.state)} (variable, replica) values differ"
                + (", and the metrics" if restored.metrics != same[0].metrics else ""))


class EpochCheckpointCrashStatesTest(CrashStatesCase):
    """``EpochCheckpoint``: the state after an epoch, and inside one (a preemption notice)."""

    def run_protocol(self, inside_epoch: bool) -> None:
        root = self.get_temp_dir()
        directory = os.path.join(root, "model")
        spec = os.path.join(root, "spec.json")
        strategy, model, (x, y), initial = self.trained_from()
        committed = [Committed((0, 0), initial)]
        with mock.patch.dict(os.environ, {worker_contract.WORKER_SPEC_ENV: spec}):
            checkpoint = checkpointing.EpochCheckpoint(directory, model, strategy)
            checkpoint.set_model(model)
            for epoch in range(2):  # Two saves before: the one recorded removes the first.
                model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
                checkpoint.on_epoch_end(epoch, {"loss": 1.0})
                checkpoint.wait()  # Written in the background: committed before recording.
                committed.append(Committed((epoch + 1, 0), state_of(model)))
            if inside_epoch:  # One step of epoch 3, saved there.
                model.fit(x[:8], y[:8], batch_size=8, epochs=1, shuffle=False, verbose=0)
                recorded = Recorded.of(root, lambda: checkpoint.save_inside_epoch(2, 1))
                metrics = tuple(np.asarray(v.numpy()).tobytes()
                                for v in model.metrics_variables)
                committed.append(Committed((2, 1), state_of(model), metrics))
            else:
                model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
                recorded = Recorded.of(root, lambda: (checkpoint.on_epoch_end(2, {"loss": 1.0}),
                                                      checkpoint.wait()))
                committed.append(Committed((3, 0), state_of(model)))
        self.assertNotEqual(committed[-1].state, committed[-2].state)
        # The copies differed between the replicas: the save wrote their file.
        self.assertTrue(any(o.path.endswith(".npz") for o in recorded.operations))

        def restore(folder: str) -> Committed:
            # What the launcher reads of the state: where the restore resumes, or none.
            state = os.path.join(folder, "model")
            read = worker_contract.read_position(state)
            set_state(model, initial)
            with mock.patch.dict(os.environ, {worker_contract.WORKER_SPEC_ENV:
                                              os.path.join(folder, "spec.json")}):
                fresh = checkpointing.EpochCheckpoint(state, model, strategy)
                epochs = fresh.restore()
            position = (epochs, fresh.resume_step)
            if read is not None and read.pair != position:
                raise AssertionError(f"the launcher reads position {read.pair}, the restore "
                                     f"resumes at {position}")
            after = worker_contract.read_position(state)  # The restore's record of it.
            if after is None or after.pair != position:
                raise AssertionError(f"after the restore the launcher reads {after}")
            metrics = tuple(np.asarray(m).tobytes() for m in fresh._resume_metrics)
            return Committed(position, state_of(model), metrics)

        def generation(path: str) -> str | None:
            """The same file of the save before (ckpt-N is numbered by the step count)."""
            numbers = sorted({int(n) for n in re.findall(r"ckpt-(\d+)",
                                                         " ".join(recorded.before))})
            return re.sub(r"ckpt-\d+", f"ckpt-{numbers[-1]}", path) if numbers else None

        self.assertEqual(restore(root), committed[-1])  # The save itself restores.
        self.explore("EpochCheckpoint " + ("inside an epoch" if inside_epoch else
                                           "at an epoch's end"),
                     recorded, committed, restore, generation,
                     lambda state: state.file == "model/checkpoint"
                     and state.damage in ("deleted", ROLLED_BACK))

    def test_every_crash_state_of_the_save_at_an_epochs_end(self):
        self.run_protocol(inside_epoch=False)

    def test_every_crash_state_of_the_save_inside_an_epoch(self):
        self.run_protocol(inside_epoch=True)


class Around(keras.callbacks.Callback):
    """Calls ``action(batch)`` at each batch's end (placed before or after another callback)."""

    def __init__(self, action):
        super().__init__()
        self.action = action

    def on_train_batch_end(self, batch, logs=None):
        self.action(batch)


class BackupAndRestoreCrashStatesTest(CrashStatesCase):
    """The ``BackupAndRestore`` fix's save (a generation, committed by its metadata's rename)."""

    def test_every_crash_state_of_a_backup(self):
        self.run_protocol(double_checkpoint=False)

    def test_every_crash_state_of_a_backup_that_keeps_the_one_before(self):
        self.run_protocol(double_checkpoint=True)

    def run_protocol(self, double_checkpoint: bool) -> None:
        root = self.get_temp_dir()
        backup = os.path.join(root, "backup")
        strategy, model, (x, y), initial = self.trained_from()
        committed = [Committed((0, 0), initial)]
        stack = contextlib.ExitStack()
        recording: list = []

        def before(batch):
            if batch == 2:  # The third save: the first generation goes.
                recording.append(files_under(root))
                recording.append(stack.enter_context(atomic_io.recording()))

        def after(batch):
            # Saved after each step; after the epoch's last, as the next epoch's start.
            committed.append(Committed((1, 0) if batch == 3 else (0, batch + 1),
                                       state_of(model)))
            if batch == 2:
                stack.close()

        callback = keras.callbacks.BackupAndRestore(backup, save_freq=1,
                                                    double_checkpoint=double_checkpoint)
        model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0,
                  callbacks=[Around(before), callback, Around(after)])
        (files, folders), operations = recording
        recorded = Recorded(root, files, folders, list(operations))
        self.assertTrue(any(o.path.endswith(".npz") for o in recorded.operations))
        self.assertTrue(any(o.by == "keras" for o in recorded.operations))
        committed = committed[:4]  # Up to the save recorded.

        def restore(folder: str) -> Committed:
            set_state(model, initial)
            fresh = keras.callbacks.BackupAndRestore(os.path.join(folder, "backup"),
                                                     double_checkpoint=double_checkpoint)
            fresh.set_model(model)
            model._initial_epoch = 0
            fresh.on_train_begin()
            try:
                with open(fresh._training_metadata_path, encoding="utf-8") as f:
                    metadata = json.load(f)
            except (OSError, ValueError):
                metadata = {}
            position = (int(metadata.get("epoch", 0)), int(metadata.get("tfpar_next_step", 0)))
            return Committed(position, state_of(model))

        def generation(path: str) -> str | None:
            path = re.sub(r"generation-\d+", "generation-2", path)
            return re.sub(r"replica_copies/\d+", "replica_copies/2", path)

        # With double_checkpoint, a damaged weights file resumes from the save before, said in
        # a warning.
        self.explore(f"BackupAndRestore{' (double_checkpoint)' * double_checkpoint}", recorded,
                     committed, restore, generation,
                     lambda state: (state.file == "backup/training_metadata.json"
                                    and state.damage == ROLLED_BACK)
                     or (double_checkpoint and state.file.endswith(".weights.h5")))


class LauncherRecordsCrashStatesTest(CrashStatesCase):
    """The records the launcher reads: their reader gives the old record, the new one, or
    (damaged) none, and never raises."""

    def check(self, name: str, path: str, save: Callable[[], object],
              read: Callable[[str], object]) -> None:
        root = os.path.dirname(path)
        old = read(path)
        recorded = Recorded.of(root, save)
        new = read(path)
        self.assertNotEqual(old, new)
        everything = states(recorded, lambda path: None)
        failures = []
        for state in everything:
            with scratch_folder() as folder:
                build(recorded, state, folder)
                try:
                    found = read(os.path.join(folder, os.path.basename(path)))
                except Exception as e:  # noqa: BLE001 - the reader must never raise.
                    failures.append(f"{state.describe(recorded)}: {type(e).__name__}: {e}")
                    continue
            allowed = [old, new] + ([None] if state.damage else [])
            if found not in allowed:
                failures.append(f"{state.describe(recorded)}: read {found!r}")
        say(f"crash states of the {name}: {len(everything)} ({len(recorded.operations)} "
              f"operations), explored {len(everything)}")
        self.assertDocumented(f"the {name}", len(recorded.operations), len(everything))
        self.assertGreater(len(everything), 0)
        self.assertEqual(failures, [])

    def test_every_crash_state_of_the_position_record(self):
        # A folder without TensorFlow's index (a backup's): the record is read as written.
        folder = os.path.join(self.get_temp_dir(), "state")
        os.makedirs(folder)
        worker_contract.commit_position(folder, worker_contract.Position(1, 0))
        self.check("position record", os.path.join(folder, worker_contract.POSITION_FILE),
                   lambda: worker_contract.commit_position(folder,
                                                           worker_contract.Position(2, 5)),
                   lambda path: getattr(worker_contract.read_position(os.path.dirname(path)),
                                        "pair", None))

    def test_every_crash_state_of_the_worker_spec(self):
        path = os.path.join(self.get_temp_dir(), "records", "spec.json")
        os.makedirs(os.path.dirname(path))
        with mock.patch.dict(os.environ, {worker_contract.WORKER_SPEC_ENV: path}):
            worker_contract.declare(folder="/state")
            self.check("worker spec", path,
                       lambda: worker_contract.declare(folder="/other"),
                       worker_contract.WorkerSpec.read)

    def test_every_crash_state_of_the_stop_record(self):
        path = os.path.join(self.get_temp_dir(), "stops", "stop.json")
        os.makedirs(os.path.dirname(path))
        with mock.patch.dict(os.environ, {worker_contract.STOP_RECORD_ENV: path}):
            worker_contract.record_stop(85, "Preempted (SIGTERM): state saved")
            self.check("stop record", path,
                       lambda: worker_contract.record_stop(74, "Could not save", work_lost=True),
                       worker_contract.StopRecord.read)


if __name__ == "__main__":
    tf.test.main()
