"""A manifest is input from a shared directory: its shard names become paths that `hpcdl prep
stage` writes on every node. Only the names the format defines are read, and staging writes
nowhere but its `--to` directory."""
from __future__ import annotations

import hashlib
import json
import os
import shutil

import pytest

from hpcdl.cli.main import main
from hpcdl.data.format import ManifestError, read_manifest
from hpcdl.data_prep.shard import shard_tree
from hpcdl.data_prep.stage import stage_node
from hpcdl.errors import EXIT_BAD_INPUT


@pytest.fixture(scope="module")
def pristine(clean_tree, tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("names") / "shards")
    shard_tree(clean_tree.root, out, shards=2, val_shards=1)
    return out


@pytest.fixture
def shards(pristine, tmp_path) -> str:
    """A copy of the shards whose manifest a test may rewrite, under tmp_path/shared/."""
    return shutil.copytree(pristine, str(tmp_path / "shared" / "shards"))


def edit_manifest(shard_dir: str, position: int, **changes) -> dict:
    path = os.path.join(shard_dir, "manifest.json")
    manifest = json.load(open(path))
    manifest["shards"][position].update(changes)
    with open(path, "w") as f:
        json.dump(manifest, f)
    return manifest


def plant_payload(shard_dir: str, name: str) -> str:
    """A file at ``shard_dir/name`` and a manifest entry 0 naming it, with its true sha256 and
    size, as someone who can write the shared directory would make it."""
    payload = os.path.normpath(os.path.join(shard_dir, name))
    os.makedirs(os.path.dirname(payload), exist_ok=True)
    with open(payload, "wb") as f:
        f.write(b"#!/bin/sh\necho owned\n")
    data = open(payload, "rb").read()
    edit_manifest(shard_dir, 0, name=name, bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    return payload


def files_under(root) -> set[str]:
    """Every file and directory below ``root``, relative to it."""
    return {os.path.relpath(os.path.join(d, n), root) for d, dirs, names in os.walk(root)
            for n in dirs + names}


@pytest.mark.parametrize("name", ["../payload.h5", "../../evil/payload.h5", "/tmp/payload.h5",
                                  "manifest.json", "train-00000-of-00002.h5/../x",
                                  "train-00000-of-00003.h5", "train-0-of-2.h5"])
def test_a_name_other_than_the_formats_shard_name_is_refused_naming_manifest_and_entry(
        shards, name):
    edit_manifest(shards, 0, name=name)
    with pytest.raises(ManifestError) as caught:
        read_manifest(shards)
    message = str(caught.value)
    assert f"manifest {os.path.join(shards, 'manifest.json')}" in message
    assert f"shard entry 0 {ascii(name)}" in message
    assert "'train-00000-of-00002.h5'" in message  # the name it must have


@pytest.mark.parametrize("change, why", [
    ({"split": "../x"}, "split '../x' is not one of train, val"),
    ({"index": 7}, "index 7 is outside 0..1"),
    ({"index": "0"}, "index '0' is outside"),
    ({"bytes": -1}, "non-negative integers"),
    ({"sha256": "abc"}, "is not 64 hex digits"),
])
def test_an_entry_of_another_split_index_size_or_digest_is_refused(shards, change, why):
    edit_manifest(shards, 0, **change)
    with pytest.raises(ManifestError, match="shard entry 0 ") as caught:
        read_manifest(shards)
    assert why in str(caught.value)


def test_an_entry_listed_twice_is_refused(shards):
    path = os.path.join(shards, "manifest.json")
    manifest = json.load(open(path))
    manifest["shards"][1] = dict(manifest["shards"][0])
    json.dump(manifest, open(path, "w"))
    with pytest.raises(ManifestError, match="listed twice|outside|must be"):
        read_manifest(shards)


def test_a_manifest_without_class_names_is_refused(shards):
    path = os.path.join(shards, "manifest.json")
    manifest = json.load(open(path))
    json.dump({**manifest, "classes": []}, open(path, "w"))
    with pytest.raises(ManifestError, match="'classes' must be a non-empty list"):
        read_manifest(shards)


def test_stage_of_a_traversing_manifest_exits_2_and_writes_nothing_outside_to(shards, tmp_path,
                                                                               capsys):
    """The reproduction: an entry ``../payload.h5`` whose file and sha256 are genuine."""
    payload = plant_payload(shards, "../payload.h5")
    node = tmp_path / "node"
    node.mkdir()
    before = files_under(tmp_path)
    code = main(["prep", "stage", "--shards", shards, "--to", str(node / "local")])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("hpcdl prep stage")]
    assert code == EXIT_BAD_INPUT
    assert len(lines) == 1 and "Traceback" not in err, err
    assert os.path.join(shards, "manifest.json") in lines[0] and "'../payload.h5'" in lines[0]
    assert not (node / "payload.h5").exists()     # the target the manifest asked for
    assert not (node / "local").exists()          # no partial --to directory either
    assert files_under(tmp_path) == before
    assert os.path.exists(payload)


def test_stage_resolves_each_target_even_past_read_manifest(shards, tmp_path, monkeypatch):
    """Staging's own check: a name that got past read_manifest (or a symbolic link planted in
    --to) still cannot put a byte outside --to."""
    import hpcdl.data_prep.stage as stage

    manifest = read_manifest(shards)
    manifest["shards"][0]["name"] = "../escaped.h5"
    monkeypatch.setattr(stage, "read_manifest", lambda _: manifest)
    local = tmp_path / "local"
    with pytest.raises(ManifestError, match=r"'\.\./escaped\.h5' would be staged to .*outside"):
        stage_node(shards, str(local), node_index=0, num_nodes=1)
    assert not local.exists() and not (tmp_path / "escaped.h5").exists()


def test_stage_refuses_a_symbolic_link_in_to_that_leads_outside(shards, tmp_path):
    local, elsewhere = tmp_path / "local", tmp_path / "elsewhere"
    local.mkdir()
    elsewhere.mkdir()
    (local / "train-00000-of-00002.h5").symlink_to(elsewhere / "target")
    with pytest.raises(ManifestError, match="outside --to"):
        stage_node(shards, str(local), node_index=0, num_nodes=1)
    assert os.listdir(elsewhere) == [] and os.listdir(local) == ["train-00000-of-00002.h5"]
