"""The one publish protocol (autoshard.checkpoint_io.Publisher) in one process and its forks: staging names unique
to each writer, the destination's lock, recovery of an interrupted save whatever its writer's name, what --force
may replace, the writability probe, and how rank 0's error reaches the other ranks.

The writers themselves (consolidate, convert, Lightning saves, autoshard-deepspeed saves) under these rules, with
real processes: tests/test_bad_inputs_writes.py.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import time
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import autoshard.checkpoint_io as cio
from autoshard.checkpoint import (
    CheckpointFormatError,
    check_integrity,
    finish_interrupted_commit,
    prepare_staging,
    resolve_for_load,
)
from autoshard.engine.ranks import RankZeroTraceback, error_payload, on_rank0, rebuild_error
from tests.test_checkpoint_formats import as_autoshard_save

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
    pytest.mark.filterwarnings("ignore:autoshard.*has no manifest"),
]
FORK = multiprocessing.get_context("fork")


def write_dcp(path: Path, step: int) -> Path:
    """A real Lightning-layout DCP checkpoint (torch.distributed.checkpoint in this process), trainer state in meta.pt."""
    import torch.distributed.checkpoint as dcp

    net = nn.Linear(4, 2)
    dcp.save({"state_dict": net.state_dict()}, storage_writer=dcp.FileSystemWriter(str(path)), no_dist=True)
    torch.save({"global_step": step}, path / "meta.pt")
    return path


# -- staging names -------------------------------------------------------------------------------------------------
def test_each_writer_stages_under_a_name_of_its_own(tmp_path: Path) -> None:
    target = tmp_path / "last.ckpt"
    a, b = cio.Publisher(target), cio.Publisher(target)
    assert a.staged != b.staged and a.token != b.token and a.token.startswith(f"{os.getpid()}-")
    for staged in (a.staged, b.staged, cio.lock_path(target)):
        # hidden, beside it (same filesystem: the rename is atomic), never ModelCheckpoint's last*.ckpt
        assert staged.parent == tmp_path and staged.name.startswith(".last.ckpt.") and staged.suffix != ".ckpt"
    a.staged.mkdir()
    b.staged.write_bytes(b"x")
    cio.staging_path(target).mkdir()  # the single name of autoshard before tokens: found too
    (tmp_path / ".last.ckpt.autoshard-tmpfoo").mkdir()  # not a staging of last.ckpt
    assert sorted(cio.staged_siblings(target)) == sorted([a.staged, b.staged, cio.staging_path(target)])
    assert cio.token_of(a.staged, target) == a.token and cio.token_of(cio.staging_path(target), target) == ""


# -- recovery of an interrupted save, whatever its writer's name --------------------------------------------------
def test_a_save_killed_between_its_renames_is_recovered_under_its_unique_name(tmp_path: Path) -> None:
    target = tmp_path / "last.ckpt"
    write_dcp(cio.aside_path(target), step=3)  # the old one, moved aside
    older = write_dcp(cio.staging_path(target, "111-aaaa"), step=5)  # a complete staging of an earlier dead writer
    os.utime(older, (time.time() - 60, time.time() - 60))
    newest = as_autoshard_save(write_dcp(cio.staging_path(target, "222-bbbb"), step=9))  # killed between its two renames
    partial = cio.staging_path(target, "333-cccc")
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"torn")  # a live-looking but partial one: never picked
    with pytest.warns(UserWarning, match="a save to it was interrupted"):
        assert resolve_for_load(target) == newest
    assert finish_interrupted_commit(target) == newest
    assert torch.load(target / "meta.pt")["global_step"] == 9
    assert prepare_staging(target, "444-dddd") == cio.staging_path(target, "444-dddd")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]  # dead writers' stagings and the aside cleared


def test_a_full_files_manifest_follows_its_own_writers_file(tmp_path: Path) -> None:
    """Killed after the file's rename, before its manifest's: the staged manifest of the same token describes it;
    another writer's complete staged pair is not mistaken for it."""
    target = tmp_path / "model.ckpt"
    for token, step in (("1-aa", 1), ("2-bb", 2)):
        torch.save({"global_step": step}, cio.staging_path(target, token))
        cio.stage_sidecar(target, token)
    os.replace(cio.staging_path(target, "2-bb"), target)  # writer 2's first rename; killed here
    assert check_integrity(target)  # checked against writer 2's staged manifest, not writer 1's
    finish_interrupted_commit(target)
    assert json.loads(cio.sidecar_path(target).read_text())["files"]["model.ckpt"]["size"] == target.stat().st_size
    prepare_staging(target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.ckpt", "model.ckpt.autoshard-manifest.json"]


# -- the lock --------------------------------------------------------------------------------------------------------
def _take_lock(path: str, started: object, queue: object, hold: float = 0.0) -> None:
    started.set()  # type: ignore[attr-defined]
    with cio.Publisher(path):
        got = time.monotonic()
        time.sleep(hold)
        queue.put((got, time.monotonic()))  # type: ignore[attr-defined]


def waiting_on(process: multiprocessing.process.BaseProcess, lock: Path) -> None:
    """Until ``process`` has the lock file open (it then blocks in flock: the lock is held)."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        fds = Path(f"/proc/{process.pid}/fd")
        try:
            if any(os.readlink(fd).startswith(str(lock)) for fd in fds.iterdir()):
                time.sleep(0.2)  # from open() to flock()
                return
        except OSError:
            pass
        time.sleep(0.05)
    raise AssertionError("the second writer never opened the lock file")


def test_the_lock_is_exclusive_names_its_holder_and_leaves_nothing(tmp_path: Path) -> None:
    target = tmp_path / "out.pt"
    holder = cio.Publisher(target).acquire()
    assert cio.lock_path(target).read_text().startswith(f"pid {os.getpid()} on ")
    started, queue = FORK.Event(), FORK.Queue()
    waiter = FORK.Process(target=_take_lock, args=(str(target), started, queue))
    waiter.start()
    started.wait(10)
    waiting_on(waiter, cio.lock_path(target))
    time.sleep(0.3)
    assert queue.empty()  # still waiting
    released = time.monotonic()
    holder.release()
    got, _ = queue.get(timeout=10)
    waiter.join(10)
    assert waiter.exitcode == 0 and got >= released
    assert list(tmp_path.iterdir()) == []  # the lock file is removed by whoever releases it


def test_a_writer_waiting_on_a_removed_lock_file_locks_the_new_one(tmp_path: Path) -> None:
    """The holder removes the lock file when it releases; a writer that was waiting on the old file must not think
    it holds the lock while a third writer holds the new file: the three hold it one after the other."""
    target = tmp_path / "out.pt"
    first = cio.Publisher(target).acquire()
    started, queue = FORK.Event(), FORK.Queue()
    waiter = FORK.Process(target=_take_lock, args=(str(target), started, queue, 0.5))
    waiter.start()
    started.wait(10)
    waiting_on(waiter, cio.lock_path(target))  # the waiter has opened the old lock file and blocks on it
    held = [(0.0, time.monotonic())]
    first.release()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "is being written by": when the waiter was quicker, this one waits
        third = cio.Publisher(target).acquire()  # a new lock file (or the waiter's, after it)
    got = time.monotonic()
    time.sleep(0.5)
    held.append((got, time.monotonic()))
    third.release()
    held.append(queue.get(timeout=10))
    waiter.join(10)
    assert waiter.exitcode == 0
    held.sort()
    assert all(earlier[1] <= later[0] for earlier, later in zip(held, held[1:])), held  # never two holders at once


def test_an_error_inside_removes_this_writers_staging_and_releases(tmp_path: Path) -> None:
    target = tmp_path / "out.pt"
    with pytest.raises(OSError, match="disk full"):
        with cio.Publisher(target) as publisher:
            publisher.staged.write_bytes(b"half")
            raise OSError("disk full")
    assert list(tmp_path.iterdir()) == []


# -- what --force may replace ------------------------------------------------------------------------------------------
def test_foreign_content_says_what_autoshard_did_not_write(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"w")
    assert cio.foreign_content(out, "k") == "autoshard did not write it (no autoshard-manifest.json in it)"
    cio.write_manifest(out / cio.MANIFEST, cio.describe_files(out, ["model.safetensors"]), "k")
    assert cio.foreign_content(out, "k") is None
    assert cio.foreign_content(out, "other") == "it was written by 'k', not by 'other' (its autoshard-manifest.json says so)"
    (out / "notes").mkdir()
    (out / "notes" / "todo.txt").write_text("mine")
    assert "it also holds notes/todo.txt, which its autoshard-manifest.json does not list" in (cio.foreign_content(out, "k") or "")
    weights = tmp_path / "w.pt"
    weights.write_bytes(b"PK\x03\x04 weights")
    assert cio.foreign_content(weights, "k") == "autoshard did not write it (no w.pt.autoshard-manifest.json beside it)"
    cio.write_manifest(cio.sidecar_path(weights), cio.describe_files(tmp_path, ["w.pt"]), "k")
    assert cio.foreign_content(weights, "k") is None
    weights.write_bytes(b"PK\x03\x04 replaced by hand, longer")
    assert "it was changed after autoshard wrote it" in (cio.foreign_content(weights, "k") or "")
    link = tmp_path / "link"
    link.symlink_to(out)
    assert "symlink" in (cio.foreign_content(link, "k") or "")


def test_unwritable_tries_for_real(tmp_path: Path) -> None:
    assert cio.unwritable(tmp_path / "a" / "b" / "out.pt") is None and not (tmp_path / "a").exists()
    (tmp_path / "file").write_text("x")
    assert cio.unwritable(tmp_path / "file" / "out.pt") == f"{str(tmp_path / 'file')!r} is a file, not a directory"
    assert "cannot be created" in (cio.unwritable(tmp_path / "file" / "sub" / "out.pt") or "")
    assert list(tmp_path.iterdir()) == [tmp_path / "file"]  # the probe is gone


# -- rank 0's error on the other ranks (2 real gloo ranks: tests/test_bad_inputs_writes.py::test_47) ---------------
class NeedsTwo(Exception):
    def __init__(self, what: str, count: int) -> None:
        super().__init__(f"{what} x{count}")


def fail(exc: Exception) -> None:
    raise exc


@pytest.mark.parametrize(
    "exc",
    [
        FileNotFoundError(2, "No such file or directory", "/ckpt/x"),
        KeyError("state_dict"),
        CheckpointFormatError("refusing to save over '/x': ... Fix: save to a new path"),
        ValueError("bad value"),
    ],
    ids=["oserror-with-filename", "keyerror", "autoshard-error", "valueerror"],
)
def test_rank0_error_keeps_its_type_text_and_traceback(exc: Exception) -> None:
    with pytest.raises(type(exc)) as raised:
        fail(exc)
    rebuilt = rebuild_error(error_payload(raised.value), rank=1)
    assert type(rebuilt) is type(exc) and str(rebuilt) == str(exc)
    assert isinstance(rebuilt.__cause__, RankZeroTraceback)
    cause = str(rebuilt.__cause__)
    assert cause.startswith("rank 0's traceback (re-raised on rank 1):\nTraceback") and "in fail\n" in cause


def test_an_error_that_cannot_be_rebuilt_falls_back_to_runtime_error_with_its_name() -> None:
    with pytest.raises(NeedsTwo) as raised:
        fail(NeedsTwo("shards", 2))
    payload = error_payload(raised.value)
    rebuilt = rebuild_error(payload, rank=3)  # NeedsTwo("shards x2") would not construct
    assert type(rebuilt) is RuntimeError and str(rebuilt) == "rank 0 failed while checkpointing: NeedsTwo: shards x2"
    unknown = rebuild_error({**payload, "module": "a_module_this_process_never_imported"}, rank=3)
    assert type(unknown) is RuntimeError and "in fail" in str(unknown.__cause__)


def test_one_process_raises_its_own_exception() -> None:
    error = FileExistsError(17, "File exists", "/x")
    with pytest.raises(FileExistsError) as raised:
        on_rank0(lambda: fail(error), rank=0, world_size=1, broadcast=lambda obj: obj)
    assert raised.value is error
    assert on_rank0(lambda: 7, rank=0, world_size=1, broadcast=lambda obj: obj) == 7
