"""Checkpoints that know themselves (`par.zero.checkpoint`): a damaged, swapped, foreign or changed shard, a
damaged meta.pt, or a pipeline's state handed to the ZeRO loader is refused in one line naming the file; and the
elastic restart falls back to the newest checkpoint that loads, saying so."""
from __future__ import annotations

import shutil

import pytest
import torch

import par.runtime.launch
from par.resilience import elastic_job, resume
from par.zero import checkpoint
from par.zero.checkpoint import CheckpointError


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """ZeRO-3 on 2 ranks, its sharded checkpoint after 2 steps; and a second save of the same run after 3."""
    root = tmp_path_factory.mktemp("ckpt")
    for step, name in ((2, "a"), (3, "b")):
        par.runtime.launch.run("par.zero.job", nproc=2, timeout=300, quiet=True,
                               args=["--runs", "3", "--steps", 3, "--checkpoint", str(root / name),
                                     "--checkpoint-step", step, "--timeline-runs", ""])
    return root


def copy(saved, tmp_path, name="a"):
    target = tmp_path / name
    shutil.copytree(saved / name, target)
    return target


def shard(folder, rank):
    return folder / f"shard_{rank:05d}_of_00002.pt"


def refused(folder, *words):
    with pytest.raises(CheckpointError) as e:
        resume.full_units(str(folder))
    line = str(e.value)
    assert "\n" not in line and all(w in line for w in words), line
    return line


def test_an_intact_checkpoint_loads(saved):
    meta, units = resume.full_units(str(saved / "a"))
    assert meta["step"] == 2 and len(units) == len(meta["units"]) and set(meta["checksums"]) == {"0", "1"}


def test_swapped_shards_are_refused_naming_the_file(saved, tmp_path):
    folder = copy(saved, tmp_path)
    a, b = shard(folder, 0), shard(folder, 1)
    a.rename(folder / "tmp")
    b.rename(a)
    (folder / "tmp").rename(b)
    refused(folder, str(a), "rank 1", "rank 0", "swapped")


@pytest.mark.parametrize("damage", ["truncated", "empty", "garbage"])
def test_a_damaged_shard_is_refused_naming_the_file(saved, tmp_path, damage):
    folder = copy(saved, tmp_path)
    path = shard(folder, 1)
    data = path.read_bytes()
    path.write_bytes({"truncated": data[:len(data) // 2], "empty": b"", "garbage": b"not a checkpoint" * 64}[damage])
    refused(folder, str(path), "damaged")


def test_a_truncated_meta_is_refused_naming_the_file(saved, tmp_path):
    folder = copy(saved, tmp_path)
    meta = folder / "meta.pt"
    meta.write_bytes(meta.read_bytes()[:100])
    refused(folder, str(meta), "damaged")


def test_a_shard_of_another_save_is_refused(saved, tmp_path):
    folder = copy(saved, tmp_path)
    shutil.copy(saved / "b" / shard(folder, 1).name, shard(folder, 1))       # the same rank, another save
    refused(folder, str(shard(folder, 1)), "another save")


def test_a_changed_shard_is_refused(saved, tmp_path):
    folder = copy(saved, tmp_path)
    path = shard(folder, 0)
    data = torch.load(path, weights_only=True)
    data["units"][0]["master"][0] += 1.0          # the file still loads: its bytes differ from its checksum
    torch.save(data, path)
    refused(folder, str(path), "changed")


def test_a_pipeline_state_names_its_loader(saved, tmp_path):
    folder = tmp_path / "pp"
    folder.mkdir()
    torch.save({"layout": "pp", "stages": 2, "dp": 1, "step": 1, "extra": {}}, folder / "meta.pt")
    refused(folder, "pipeline", "load_pp")


def test_the_elastic_restart_falls_back_to_the_newest_checkpoint_that_loads(saved, tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    shutil.copytree(saved / "a", run / "step_2")
    shutil.copytree(saved / "b", run / "step_3")
    shard(run / "step_3", 0).write_bytes(b"")             # the newest is damaged
    step, folder = elastic_job.newest_checkpoint(str(run))
    assert (step, folder) == (2, str(run / "step_2"))
    said = capsys.readouterr().out
    assert "step_3" in said and "falls back to" in said, said


@pytest.mark.parametrize("link", ["loop", "dangling"])
def test_a_checkpoint_folder_that_is_a_broken_link_is_refused_before_training(tmp_path, link):
    folder = tmp_path / "ckpt"
    if link == "loop":
        (tmp_path / "other").symlink_to(folder)
        folder.symlink_to(tmp_path / "other")
    else:
        folder.symlink_to(tmp_path / "missing" / "ckpt")
    from par.runtime.checks import CheckError
    with pytest.raises(CheckError, match="is a link that leads nowhere"):
        checkpoint.check_directory(str(folder))
    with pytest.raises(CheckError, match="is a link that leads nowhere"):
        checkpoint.check_directory(str(folder / "step_4"))
