"""Saving never deletes what it did not write (gloo, world 2 and 4): what a
save may replace, refusals that leave the disk as it was, commit steps that
fail on one rank and fail on every rank, a rank that dies mid-save or
mid-load, leftovers of earlier saves, and load errors that name the file."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.checkpoint_at import save_at, saver
from tests.errors import error_of, raised, unchanged

MANIFEST = "z3kit_manifest.json"


def new_engine(ctx: Any, seed: int = 0) -> Any:
    from tests.zero3_models import MLP
    from z3kit_recipes import zero3

    torch.manual_seed(seed)
    return zero3.initialize(MLP(), torch.optim.Adam, {"zero_optimization": {"stage": 3,
                            "stage3_param_persistence_threshold": 0}}, ctx.group)


def snapshot(root: Path) -> dict[str, bytes]:
    """Every entry under ``root`` (hidden ones too), files with their bytes."""
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else b"<dir>" for p in sorted(root.rglob("*"))}


def outcome(fn: Any, *args: Any, **kwargs: Any) -> str:
    happened = raised(fn, *args, **kwargs)
    return "saved" if happened == "ok" else happened


def run_save(ctx: Any, method: str, path: str, seed: int = 0) -> str:
    return outcome(saver(new_engine(ctx, seed), method), path)


OTHER = {"save_checkpoint": "save_pretrained", "save_pretrained": "save_checkpoint"}


# --------------------------------------------------------------------------- #
# What a save may replace
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("method", ["save_checkpoint", "save_pretrained"])
@pytest.mark.parametrize("found", ["user folder", "file", "other kind", "earlier save with a user file", "symlink"])
def test_a_save_onto_what_it_did_not_write_is_refused_and_writes_nothing(
    pools: Any, world: int, method: str, found: str, tmp_path: Path
) -> None:
    target = tmp_path / "target"
    if found == "user folder":
        (target / "sub").mkdir(parents=True)
        (target / "notes.txt").write_text("mine")
        (target / "sub" / "data.bin").write_bytes(b"\0\1\2")
    elif found == "file":
        target.write_text("a file of mine")
    elif found == "symlink":
        (tmp_path / "real").mkdir()
        target.symlink_to(tmp_path / "real")  # even to an empty folder: replacing the link is not what was asked
    else:
        assert pools.run(world, run_save, OTHER[method] if found == "other kind" else method, str(target)) == ["saved"] * world
        if found != "other kind":
            (target / "notes.txt").write_text("mine")
    before = snapshot(tmp_path)
    errors = pools.run(world, run_save, method, str(target), timeout=120)
    assert len(set(errors)) == 1, errors  # the same error on every rank
    assert errors[0].startswith("SaveRefused: ") and f"{method}({str(target)!r}): refused, nothing was written" in errors[0]
    assert snapshot(tmp_path) == before  # nothing written, nothing moved, no staging folder left
    hint = {"user folder": "z3kit did not write", "file": "is a file", "other kind": "replaces only an earlier",
            "earlier save with a user file": "notes.txt", "symlink": "is a symbolic link"}[found]
    assert hint in errors[0], errors[0]


def run_replace(ctx: Any, method: str, path: str) -> dict[str, Any]:
    out = {"first": outcome(saver(new_engine(ctx, seed=1), method), path)}
    engine = new_engine(ctx, seed=2)
    out["second"] = outcome(saver(engine, method), path)
    out["want"] = engine.full_state_dict()
    if method == "save_checkpoint":
        loaded = new_engine(ctx, seed=3)
        loaded.load_checkpoint(path)
        out["got"] = loaded.full_state_dict()
    return out


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("method", ["save_checkpoint", "save_pretrained"])
@pytest.mark.parametrize("empty_first", [False, True])
def test_an_earlier_save_is_replaced_and_an_empty_folder_is_written(
    pools: Any, world: int, method: str, empty_first: bool, tmp_path: Path
) -> None:
    from safetensors.torch import load_file

    target = tmp_path / "target"
    if empty_first:
        target.mkdir()  # users often create the folder first: replacing an empty folder deletes nothing
    results = pools.run(world, run_replace, method, str(target), timeout=120)
    for r in results:
        assert r["first"] == r["second"] == "saved"
    got = results[0]["got"] if method == "save_checkpoint" else load_file(str(target / "model.safetensors"))
    assert unchanged(results[0]["want"], got)  # the second save's values
    assert sorted(p.name for p in tmp_path.iterdir()) == ["target"]  # no .partial- or .old- left


def run_in_folder(ctx: Any, folder: str, calls: list[tuple[str, str]]) -> list[str]:
    engine = new_engine(ctx)
    here = os.getcwd()
    os.chdir(folder)
    try:
        return [outcome(engine.save_checkpoint, save_dir, tag=tag, save_latest=False) for save_dir, tag in calls]
    finally:
        os.chdir(here)


def test_the_working_directory_and_paths_above_it_are_refused(pools: Any, tmp_path: Path) -> None:
    """A checkpoint goes to save_dir/tag: a tag naming the working directory from above is refused, and a
    tag that is not one folder name (".", "..", "", "a/b") cannot reach above it."""
    work = tmp_path / "work"
    work.mkdir()  # empty: were it replaced, nothing of it would be lost, but the process would lose its folder
    refused = [("..", "work"), (str(tmp_path), "work")]
    bad_tags = [(".", "."), (".", ".."), (".", ""), (".", "a/b")]
    before = snapshot(tmp_path)
    per_rank = pools.run(2, run_in_folder, str(work), refused + bad_tags)
    assert per_rank[0] == per_rank[1]
    for (save_dir, tag), error in zip(refused, per_rank[0]):
        target = str(Path(save_dir) / tag)
        assert error.startswith(f"SaveRefused: save_checkpoint({target!r}): refused, nothing was written"), error
        assert "name a folder below it" in error
    for error in per_rank[0][len(refused):]:
        assert error.startswith("ValueError: save_checkpoint: checking the tag failed on rank 0: ValueError: tag "), error
        assert "must name one folder" in error
    assert snapshot(tmp_path) == before


def test_a_folder_whose_parent_cannot_hold_the_staging_folder_is_refused(pools: Any, tmp_path: Path) -> None:
    (tmp_path / "a_file").write_text("mine")
    before = snapshot(tmp_path)
    errors = pools.run(2, run_save, "save_checkpoint", str(tmp_path / "a_file" / "ckpt"))
    assert errors[0] == errors[1] and errors[0].startswith("OSError: save_checkpoint("), errors
    assert "cannot create the staging folder" in errors[0] and "nothing was written" in errors[0]
    assert snapshot(tmp_path) == before


# --------------------------------------------------------------------------- #
# A step that fails on one rank fails on every rank
# --------------------------------------------------------------------------- #


def run_commit_fails_on_one_rank(ctx: Any, path: str, where: str) -> dict[str, Any]:
    from unittest import mock

    from z3kit_recipes.zero3.weights import commit

    engine = new_engine(ctx, seed=1)
    save_at(engine, path, client_state={"which": "first"})
    real_replace = os.replace

    def rename_fails(src: Any, dst: Any) -> None:
        if ".partial-" in os.fspath(src):
            raise OSError(28, "No space left on device (injected)")
        real_replace(src, dst)

    def hash_fails(p: Path) -> str:
        raise PermissionError(13, "Permission denied (injected)", str(p))

    patch = (mock.patch("os.replace", rename_fails) if where == "rename on rank 0" and ctx.rank == 0 else
             mock.patch.object(commit, "_sha256", hash_fails) if where == "hash on the last rank" and ctx.rank == ctx.world - 1
             else contextlib.nullcontext())
    with patch:
        error = outcome(saver(engine, "save_checkpoint"), path, client_state={"which": "second"})
    # every rank stopped at the same step: the engine goes on, and the earlier checkpoint is intact
    return {"error": error, "client": engine.load_checkpoint(path)[1], "again": outcome(saver(engine, "save_checkpoint"), path)}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("where", ["rename on rank 0", "hash on the last rank"])
def test_a_commit_step_that_fails_on_one_rank_fails_on_every_rank(pools: Any, world: int, where: str, tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    results = pools.run(world, run_commit_fails_on_one_rank, str(path), where, timeout=120)
    errors = {r["error"] for r in results}
    assert len(errors) == 1, errors
    error = errors.pop()
    if where == "rename on rank 0":
        assert error.startswith("OSError: save_checkpoint: writing the manifest and renaming"), error
        assert "failed on rank 0" in error and "No space left on device (injected)" in error
    else:
        assert error.startswith("PermissionError: save_checkpoint: hashing the files failed"), error
        assert f"on rank {world - 1}: PermissionError" in error and "(injected)" in error
    assert all(r["client"] == {"which": "first"} and r["again"] == "saved" for r in results)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # the failed save's staging folder removed


# --------------------------------------------------------------------------- #
# A rank that dies
# --------------------------------------------------------------------------- #


def run_rank_dies(ctx: Any, method: str, path: str) -> dict[str, Any]:
    import time
    from unittest import mock

    from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter

    engine = new_engine(ctx)
    # an earlier save, which the dying one must leave as it is
    saver(engine, "save_pretrained" if method == "save_pretrained" else "save_checkpoint")(path)
    gathers = [0]
    layout_class = type(engine.layout)
    real_gather = layout_class.gather_full

    def gather_then_die(self: Any, *args: Any) -> Any:
        gathers[0] += 1
        if gathers[0] == 3:  # mid-save: two parameters gathered and written
            os._exit(3)
        return real_gather(self, *args)

    def die(*args: Any, **kwargs: Any) -> Any:
        os._exit(3)

    patch: Any = contextlib.nullcontext()
    if ctx.rank == ctx.world - 1:
        patch = {"save_checkpoint": mock.patch.object(FileSystemWriter, "write_data", die),
                 "save_pretrained": mock.patch.object(layout_class, "gather_full", gather_then_die),
                 "load_checkpoint": mock.patch.object(FileSystemReader, "read_data", die)}[method]
    start = time.monotonic()
    with patch:
        caught = outcome(saver(engine, method), path)
    return {"caught": caught, "seconds": time.monotonic() - start}


@pytest.mark.parametrize(("method", "world"), [("save_checkpoint", 2), ("save_checkpoint", 4),
                                               ("save_pretrained", 4), ("load_checkpoint", 2)])
def test_a_rank_that_dies_mid_save_or_load_gives_rank_failed(method: str, world: int, tmp_path: Path) -> None:
    from tests.dist_pool import LOST, DistPool

    path = tmp_path / "saved"
    pool = DistPool(world)  # of its own: a lost rank breaks a pool
    try:
        results = pool.run(run_rank_dies, method, str(path), lost_ok=True, timeout=120)
    finally:
        pool.close()
    assert results[-1] == LOST
    for r in results[:-1]:
        assert r["caught"].startswith("RankFailed: "), r["caught"]
        assert f"rank(s) [{world - 1}] posted nothing" in r["caught"] and "lost" in r["caught"], r["caught"]
        assert r["seconds"] < 20, r
    assert sorted(p.name for p in tmp_path.iterdir()) == ["saved"]  # the survivors removed the staging folder
    assert (path / MANIFEST).is_file()


def run_save_warned(ctx: Any, path: str) -> list[str]:
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        save_at(new_engine(ctx), path)
    return [str(w.message) for w in caught if "did not finish" in str(w.message)]


def test_leftovers_of_earlier_saves_are_named_not_deleted(pools: Any, tmp_path: Path) -> None:
    stale = tmp_path / ".ckpt.partial-0badf00d"
    stale.mkdir()
    (stale / "0_0.distcp").write_bytes(b"half")
    warned = pools.run(2, run_save_warned, str(tmp_path / "ckpt"))
    assert warned[1] == [] and len(warned[0]) == 1  # rank 0 says it, once
    assert ".ckpt.partial-0badf00d" in warned[0][0] and "delete them once no save" in warned[0][0]
    assert (stale / "0_0.distcp").read_bytes() == b"half"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".ckpt.partial-0badf00d", "ckpt"]


# --------------------------------------------------------------------------- #
# Load errors name the file and the folder, and change nothing
# --------------------------------------------------------------------------- #


def run_load(ctx: Any, method: str, path: str) -> dict[str, Any]:
    engine = new_engine(ctx, seed=7)
    before = engine.full_state_dict()
    message = error_of(getattr(engine, method), path)
    return {"message": message, "unchanged": unchanged(before, engine.full_state_dict())}


@pytest.mark.parametrize("damage", ["truncated manifest", "empty manifest", "export as checkpoint",
                                    "truncated safetensors", "checkpoint as export", "truncated index"])
def test_a_load_error_names_the_file_and_the_folder_and_changes_nothing(pools: Any, damage: str, tmp_path: Path) -> None:
    ckpt, export = tmp_path / "ckpt", tmp_path / "export"
    pools.run(2, run_save, "save_checkpoint", str(ckpt))
    pools.run(2, run_save, "save_pretrained", str(export))
    manifest, weights, index = ckpt / MANIFEST, export / "model.safetensors", export / "model.safetensors.index.json"
    if damage == "truncated manifest":
        manifest.write_bytes(manifest.read_bytes()[:100])
    elif damage == "empty manifest":
        manifest.write_bytes(b"")
    elif damage == "truncated safetensors":
        weights.write_bytes(weights.read_bytes()[:-20])
    elif damage == "truncated index":  # an index next to the weights is what is read first
        index.write_text('{"weight_map": {"0.weight": "model.safet')
    method, path, named, says = {
        "truncated manifest": ("load_checkpoint", ckpt, manifest, "not valid JSON"),
        "empty manifest": ("load_checkpoint", ckpt, manifest, "not valid JSON"),
        "export as checkpoint": ("load_checkpoint", export, export / MANIFEST, "load it with engine.load_pretrained"),
        "truncated safetensors": ("load_pretrained", export, weights, "damaged or incomplete"),
        "checkpoint as export": ("load_pretrained", ckpt, ckpt, "load it with engine.load_checkpoint"),
        "truncated index": ("load_pretrained", export, index, "damaged or incomplete"),
    }[damage]
    for r in pools.run(2, run_load, method, str(path)):
        assert r["unchanged"]
        assert r["message"].startswith("ValueError: ") and str(named) in r["message"] and str(path) in r["message"], r
        assert says in r["message"], r["message"]
