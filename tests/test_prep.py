"""data_prep: ImageNet tree -> HDF5 shards, verify, stage (serial; tests/mpi covers ranks)."""
from __future__ import annotations

import json
import os

import h5py
import numpy as np
import pytest

from hpcdl.cli.main import main as hpcdl_main
from hpcdl.data_prep.shard import InjectedFailure, shard_tree
from hpcdl.data_prep.stage import stage_node
from hpcdl.data_prep.synthetic import make_imagenet_tree
from hpcdl.data_prep.verify import verify_shards


def read_shards(out: str, split: str) -> dict[str, tuple[int, tuple]]:
    """key -> (label, stored shape) over every shard of a split."""
    found = {}
    for name in sorted(os.listdir(out)):
        if name.startswith(split + "-") and name.endswith(".h5"):
            with h5py.File(os.path.join(out, name), "r") as f:
                for key, label, shape in zip(f["keys"].asstr()[:], f["labels"][:], f["shapes"][:],
                                             strict=True):
                    assert key not in found, f"{key} stored twice"
                    found[key] = (int(label), tuple(int(s) for s in shape))
    return found


def file_bytes(directory: str) -> dict[str, bytes]:
    return {n: open(os.path.join(directory, n), "rb").read() for n in sorted(os.listdir(directory))
            if not n.startswith(".")}


def test_labels_and_keys_survive_the_round_trip(quirky_tree, tmp_path):
    out = str(tmp_path / "shards")
    manifest = shard_tree(quirky_tree.root, out, shards=3)
    stored = {**read_shards(out, "train"), **read_shards(out, "val")}
    assert {k: v[0] for k, v in stored.items()} == quirky_tree.labels
    assert manifest["classes"] == quirky_tree.classes
    assert manifest["splits"]["val"]["num_samples"] == len(quirky_tree.keys("val"))


def test_cmyk_grayscale_and_png_named_jpeg_become_rgb(quirky_tree, tmp_path):
    out = str(tmp_path / "shards")
    shard_tree(quirky_tree.root, out, shards=2)
    stored = read_shards(out, "train")
    for name in ("cmyk", "gray", "png_named"):
        key = next(k for k in quirky_tree.labels if f"/{name}." in k)
        assert stored[key][1] == (30, 40, 3), key


def test_corrupt_and_non_image_files_are_skipped_with_reasons(quirky_tree, tmp_path):
    manifest = shard_tree(quirky_tree.root, str(tmp_path / "shards"), shards=2)
    skipped = {s["key"]: s["reason"] for s in manifest["skipped"]}
    assert set(skipped) == set(quirky_tree.bad)
    assert skipped["train/n01440764/notes.txt"] == "not an image"
    assert "corrupt" in skipped["train/n01440764/truncated.JPEG"]


def test_empty_class_folder_is_reported_and_keeps_its_index(quirky_tree, tmp_path):
    manifest = shard_tree(quirky_tree.root, str(tmp_path / "shards"), shards=2)
    assert manifest["empty_classes"]["train"] == quirky_tree.empty_classes
    empty_index = manifest["classes"].index(quirky_tree.empty_classes[0])
    assert manifest["splits"]["train"]["class_counts"][empty_index] == 0


def test_strict_fails_naming_the_bad_files(quirky_tree, tmp_path):
    with pytest.raises(RuntimeError, match="truncated.JPEG"):
        shard_tree(quirky_tree.root, str(tmp_path / "shards"), shards=2, strict=True)


def test_shard_sizes_differ_by_at_most_one(clean_tree, tmp_path):
    manifest = shard_tree(clean_tree.root, str(tmp_path / "shards"), shards=7)
    sizes = [s["num_samples"] for s in manifest["shards"] if s["split"] == "train"]
    assert len(sizes) == 7 and sum(sizes) == 40 and max(sizes) - min(sizes) <= 1


def test_seed_changes_which_samples_share_a_shard(clean_tree, tmp_path):
    a = shard_tree(clean_tree.root, str(tmp_path / "a"), shards=4, seed=0)
    b = shard_tree(clean_tree.root, str(tmp_path / "b"), shards=4, seed=1)
    assert [s["sha256"] for s in a["shards"]] != [s["sha256"] for s in b["shards"]]


def test_verify_names_the_shard_with_a_flipped_byte(clean_tree, tmp_path, capsys):
    out = str(tmp_path / "shards")
    shard_tree(clean_tree.root, out, shards=3)
    assert verify_shards(out) == {}
    assert hpcdl_main(["prep", "verify", out]) == 0
    path = os.path.join(out, "train-00001-of-00003.h5")
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0x01
    open(path, "wb").write(bytes(data))
    assert list(verify_shards(out)) == ["train-00001-of-00003.h5"]
    capsys.readouterr()
    assert hpcdl_main(["prep", "verify", out]) == 1
    assert "BAD train-00001-of-00003.h5" in capsys.readouterr().out


def test_verify_reports_a_missing_shard(clean_tree, tmp_path):
    out = str(tmp_path / "shards")
    shard_tree(clean_tree.root, out, shards=2)
    os.unlink(os.path.join(out, "val-00000-of-00001.h5"))
    assert verify_shards(out) == {"val-00000-of-00001.h5": "missing"}


def test_killed_run_resumes_to_the_bytes_of_an_uninterrupted_run(quirky_tree, tmp_path):
    whole, resumed = str(tmp_path / "whole"), str(tmp_path / "resumed")
    shard_tree(quirky_tree.root, whole, shards=4)
    with pytest.raises(InjectedFailure):
        shard_tree(quirky_tree.root, resumed, shards=4, fail_after=2)
    assert sorted(n for n in os.listdir(resumed) if n.endswith(".h5")) == [
        "train-00000-of-00004.h5", "train-00001-of-00004.h5"]
    # A kill mid-write leaves only a temporary file under another name; the rerun removes it.
    stale = os.path.join(resumed, ".train-00002-of-00004.h5.abc123.tmp")
    open(stale, "wb").write(b"half a shard")
    done_before = os.stat(os.path.join(resumed, "train-00000-of-00004.h5")).st_mtime_ns
    shard_tree(quirky_tree.root, resumed, shards=4)
    assert not os.path.exists(stale)
    assert os.stat(os.path.join(resumed, "train-00000-of-00004.h5")).st_mtime_ns == done_before
    assert file_bytes(resumed) == file_bytes(whole)


def test_rerun_rewrites_a_complete_shard_that_was_damaged(clean_tree, tmp_path):
    out = str(tmp_path / "shards")
    shard_tree(clean_tree.root, out, shards=2)
    good = file_bytes(out)
    path = os.path.join(out, "train-00000-of-00002.h5")
    open(path, "r+b").write(b"\0\0\0\0")
    shard_tree(clean_tree.root, out, shards=2)
    assert file_bytes(out) == good


def test_raw_format_stores_decoded_pixels(clean_tree, tmp_path):
    out = str(tmp_path / "raw")
    shard_tree(clean_tree.root, out, shards=1, image_format="raw")
    with h5py.File(os.path.join(out, "train-00000-of-00001.h5"), "r") as f:
        assert f.attrs["image_format"] == "raw"
        image, shape = f["images"][0], tuple(f["shapes"][0])
    assert image.size == np.prod(shape) and shape == (30, 40, 3)


def test_resize_scales_the_short_side_down_only(tmp_path):
    tree = make_imagenet_tree(str(tmp_path / "tree"), num_classes=1, train_per_class=2,
                              val_per_class=0, size=(90, 60))
    shard_tree(tree.root, str(tmp_path / "a"), shards=1, resize=30)
    assert {s for _, s in read_shards(str(tmp_path / "a"), "train").values()} == {(30, 45, 3)}
    shard_tree(tree.root, str(tmp_path / "b"), shards=1, resize=256)
    assert {s for _, s in read_shards(str(tmp_path / "b"), "train").values()} == {(60, 90, 3)}


def test_shard_attributes_carry_format_and_classes(clean_tree, tmp_path):
    out = str(tmp_path / "shards")
    shard_tree(clean_tree.root, out, shards=2)
    with h5py.File(os.path.join(out, "train-00001-of-00002.h5"), "r") as f:
        assert f.attrs["format_version"] == 1
        assert list(f.attrs["classes"]) == clean_tree.classes
        assert (f.attrs["split"], f.attrs["shard_index"], f.attrs["num_shards"]) == ("train", 1, 2)


def devkit_tree(tmp_path):
    """A flat val/ labelled by the devkit's ground-truth ids instead of the Kaggle csv."""
    tree = make_imagenet_tree(str(tmp_path / "tree"), num_classes=3, train_per_class=1,
                              val_per_class=2, val_layout="flat")
    os.unlink(os.path.join(tree.root, "LOC_val_solution.csv"))
    val = tree.keys("val")
    truth = tmp_path / "ILSVRC2012_validation_ground_truth.txt"
    return tree, val, truth


def test_devkit_ground_truth_maps_ids_through_a_synsets_file(tmp_path):
    tree, val, truth = devkit_tree(tmp_path)
    # Devkit order differs from sorted order: here id 1 is the last sorted class.
    devkit_order = list(reversed(tree.classes))
    truth.write_text("".join(f"{devkit_order.index(tree.classes[tree.labels[k]]) + 1}\n"
                             for k in val))
    synsets = tmp_path / "synsets.txt"
    synsets.write_text("".join(f"{w} some words\n" for w in devkit_order))
    out = str(tmp_path / "shards")
    shard_tree(tree.root, out, shards=1, val_labels=str(truth), synsets=str(synsets))
    assert {k: v[0] for k, v in read_shards(out, "val").items()} == {
        k: tree.labels[k] for k in val}


def test_devkit_ground_truth_without_synsets_uses_sorted_classes_and_warns(tmp_path):
    tree, val, truth = devkit_tree(tmp_path)
    truth.write_text("".join(f"{tree.labels[k] + 1}\n" for k in val))
    out = str(tmp_path / "shards")
    with pytest.warns(UserWarning, match="--synsets"):
        shard_tree(tree.root, out, shards=1, val_labels=str(truth))
    assert {k: v[0] for k, v in read_shards(out, "val").items()} == {
        k: tree.labels[k] for k in val}


def test_flat_val_without_labels_is_a_clear_error(tmp_path):
    tree = make_imagenet_tree(str(tmp_path / "tree"), num_classes=2, train_per_class=1,
                              val_per_class=1, val_layout="flat")
    os.unlink(os.path.join(tree.root, "LOC_val_solution.csv"))
    with pytest.raises(FileNotFoundError, match="--val-labels"):
        shard_tree(tree.root, str(tmp_path / "shards"), shards=1)


def test_stage_copies_exactly_the_node_shards_and_skips_verified_ones(clean_tree, tmp_path):
    out, local = str(tmp_path / "shards"), str(tmp_path / "local")
    shard_tree(clean_tree.root, out, shards=4, val_shards=2)
    result = stage_node(out, local, node_index=1, num_nodes=2)
    assert sorted(os.listdir(local)) == ["manifest.json", "train-00001-of-00004.h5",
                                         "train-00003-of-00004.h5", "val-00001-of-00002.h5"]
    assert len(result["copied"]) == 3
    open(os.path.join(local, "train-00003-of-00004.h5"), "r+b").write(b"junk")
    again = stage_node(out, local, node_index=1, num_nodes=2)
    assert again["copied"] == ["train-00003-of-00004.h5"] and len(again["present"]) == 2
    assert verify_shards(local, names=again["copied"] + again["present"]) == {}
    manifest = json.load(open(os.path.join(local, "manifest.json")))
    assert len(manifest["shards"]) == 6


def test_stage_refuses_a_damaged_source_shard(clean_tree, tmp_path):
    out, local = str(tmp_path / "shards"), str(tmp_path / "local")
    shard_tree(clean_tree.root, out, shards=1)
    open(os.path.join(out, "train-00000-of-00001.h5"), "r+b").write(b"junk")
    with pytest.raises(ValueError, match="hpcdl prep verify"):
        stage_node(out, local, node_index=0, num_nodes=1)
    assert not any(n.endswith(".h5") for n in os.listdir(local))


def test_prep_shard_cli_runs_without_mpiexec(quirky_tree, tmp_path, capsys):
    out = str(tmp_path / "shards")
    assert hpcdl_main(["prep", "shard", "--src", quirky_tree.root, "--out", out,
                       "--shards", "2", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "skipped train/n01440764/notes.txt: not an image" in printed
    assert "empty class folders in train: n99999999" in printed
    assert verify_shards(out) == {}


def test_stage_cli_without_mpiexec_is_one_node(clean_tree, tmp_path):
    out, local = str(tmp_path / "shards"), str(tmp_path / "local")
    shard_tree(clean_tree.root, out, shards=2)
    assert hpcdl_main(["prep", "stage", "--shards", out, "--to", local]) == 0
    assert set(os.listdir(local)) == {n for n in os.listdir(out) if not n.startswith(".")}
