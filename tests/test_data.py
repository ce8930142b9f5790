"""hpcdl.data: the per-node sharded loader (serial: explicit node_index/num_nodes values)."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from hpcdl.data import ShardedImageNet, input_normalization, normalize, read_manifest
from hpcdl.data.augment import (
    caffe_crop_boxes,
    crop_resize,
    random_resized_crop_boxes,
    sample_uniforms,
)
from hpcdl.data.sampler import node_shard_indices
from hpcdl.data_prep.fashion_mnist import CLASSES, balanced_subset, load_split, write_tree
from hpcdl.data_prep.shard import shard_tree


@pytest.fixture(scope="module")
def shards(clean_tree, tmp_path_factory) -> str:
    """40 train samples in 5 shards (8 each), 12 val samples in 3 shards."""
    out = str(tmp_path_factory.mktemp("loader") / "shards")
    shard_tree(clean_tree.root, out, shards=5, val_shards=3)
    return out


def loader(shards, **kw) -> ShardedImageNet:
    kw.setdefault("batch_size", 2)
    kw.setdefault("image_size", 16)
    kw.setdefault("workers", 0)
    return ShardedImageNet(shards, **kw)


def epoch_indices(data: ShardedImageNet) -> list[int]:
    return [int(i) for b in range(len(data)) for i in data.batch_indices(b)]


def layouts():
    return [(1, 1), (1, 3), (2, 1), (2, 2), (3, 2), (5, 1)]


@pytest.mark.parametrize("num_nodes,local_size", layouts())
def test_train_ranks_read_disjoint_samples_from_their_node_shards(shards, num_nodes, local_size):
    counts = [e["num_samples"] for e in read_manifest(shards)["shards"] if e["split"] == "train"]
    offsets = np.concatenate([[0], np.cumsum(counts)])
    seen, lengths = [], set()
    for node, rank in itertools.product(range(num_nodes), range(local_size)):
        data = loader(shards, node_index=node, num_nodes=num_nodes, local_rank=rank,
                      local_size=local_size)
        indices = epoch_indices(data)
        shard_of = np.searchsorted(offsets, indices, side="right") - 1
        assert all(s % num_nodes == node for s in shard_of), (node, rank)
        assert len(indices) == len(data) * 2
        seen += indices
        lengths.add(len(data))
    assert len(lengths) == 1 and lengths.pop() > 0          # every rank: the same batch count
    assert len(seen) == len(set(seen))                       # no sample read twice


@pytest.mark.parametrize("num_nodes,local_size", layouts())
def test_val_ranks_together_read_every_sample_exactly_once(shards, num_nodes, local_size):
    seen, lengths = [], set()
    for node, rank in itertools.product(range(num_nodes), range(local_size)):
        data = loader(shards, split="val", node_index=node, num_nodes=num_nodes,
                      local_rank=rank, local_size=local_size)
        seen += epoch_indices(data)
        lengths.add(len(data))
    assert len(lengths) == 1
    assert sorted(seen) == list(range(12))


def test_union_over_ranks_of_a_node_is_the_node_dataset(shards):
    # One node, 4 ranks, batch 2: 40 samples -> 5 batches each, nothing dropped.
    seen = []
    for rank in range(4):
        data = loader(shards, local_rank=rank, local_size=4)
        assert len(data) == 5
        seen += epoch_indices(data)
    assert sorted(seen) == list(range(40))


def test_two_epochs_differ_in_order_but_not_in_content(shards):
    data = loader(shards, node_index=1, num_nodes=2)
    first = epoch_indices(data)
    data.set_epoch(1)
    second = epoch_indices(data)
    assert first != second and sorted(first) == sorted(second)


def test_labels_follow_the_samples(shards, clean_tree):
    import h5py

    data = loader(shards, batch_size=5, workers=2)
    keys_labels = {}
    for e in data.entries:
        with h5py.File(f"{shards}/{e['name']}", "r") as f:
            keys_labels.update(zip(f["keys"].asstr()[:], f["labels"][:], strict=True))
    assert {k: int(v) for k, v in keys_labels.items()} == {
        k: clean_tree.labels[k] for k in clean_tree.keys("train")}
    labels = torch.cat([y for _, y in data])
    assert labels.dtype == torch.int64
    assert sorted(labels.tolist()) == sorted(clean_tree.labels[k] for k in clean_tree.keys("train"))


def test_batches_are_uint8_nchw_of_image_size(shards):
    x, y = next(iter(loader(shards, batch_size=4, image_size=24)))
    assert x.shape == (4, 3, 24, 24) and x.dtype == torch.uint8 and y.shape == (4,)
    v, _ = next(iter(loader(shards, split="val", batch_size=4, image_size=24)))
    assert v.shape == (4, 3, 24, 24)


def test_threads_give_bit_identical_batches_to_inline_decoding(shards):
    inline = list(loader(shards, workers=0, batch_size=4))
    threaded = list(loader(shards, workers=3, batch_size=4))
    assert len(inline) == len(threaded) == 10
    for (a, la), (b, lb) in zip(inline, threaded, strict=True):
        assert torch.equal(a, b) and torch.equal(la, lb)


def test_resume_mid_epoch_reproduces_the_rest_of_the_epoch(shards):
    data = loader(shards, batch_size=4, seed=3)
    data.set_epoch(2)
    full = list(data)
    data.set_epoch(2, start_batch=6)
    rest = list(data)
    assert len(rest) == len(full) - 6
    for (a, la), (b, lb) in zip(full[6:], rest, strict=True):
        assert torch.equal(a, b) and torch.equal(la, lb)


def test_augmentation_differs_between_epochs_and_seeds(shards):
    a = next(iter(loader(shards, seed=0)))[0]
    b = next(iter(loader(shards, seed=1)))[0]
    assert not torch.equal(a, b)


def test_rotate_shards_moves_shards_between_nodes_keeping_the_length(shards):
    data = loader(shards, node_index=0, num_nodes=2, rotate_shards=True)
    length = len(data)
    owned = []
    for epoch in range(3):
        data.set_epoch(epoch)
        owned.append(node_shard_indices(5, 0, 2, epoch, True))
        assert len(data) == length and len(epoch_indices(data)) == length * 2
    assert owned[0] == [0, 2, 4] and owned[1] == [1, 3] and owned[2] == owned[0]


def test_data_wait_counts_time_spent_waiting_and_resets_per_epoch(shards):
    data = loader(shards)
    list(data)
    assert data.data_wait_s > 0
    data.set_epoch(1)
    assert data.data_wait_s == 0.0


def test_too_few_samples_for_the_layout_is_a_clear_error(shards):
    with pytest.raises(ValueError, match="too few"):
        loader(shards, num_nodes=6, node_index=0)


def test_normalize_uses_imagenet_mean_and_std():
    x = torch.full((1, 3, 2, 2), 255, dtype=torch.uint8)
    y = normalize(x)
    assert y.dtype == torch.float32
    assert torch.allclose(y[0, :, 0, 0], torch.tensor([(1 - 0.485) / 0.229, (1 - 0.456) / 0.224,
                                                       (1 - 0.406) / 0.225]))


def test_augmentation_draws_depend_only_on_seed_epoch_and_sample():
    a = sample_uniforms(0, 1, np.array([5, 9]))
    b = sample_uniforms(0, 1, np.array([9]))
    assert np.array_equal(a[1], b[0])
    assert not np.array_equal(a[0], sample_uniforms(0, 2, np.array([5]))[0])
    assert a.min() >= 0 and a.max() < 1


def test_random_resized_crop_stays_inside_the_image_and_covers_the_scale_range():
    n = 2000
    boxes = random_resized_crop_boxes(np.full(n, 30), np.full(n, 40), sample_uniforms(0, 0,
                                                                                      np.arange(n)))
    top, left, h, w = boxes.T
    assert (top >= 0).all() and (top + h <= 30).all() and (left >= 0).all()
    assert (left + w <= 40).all() and (h > 0).all() and (w > 0).all()
    area = h * w / 1200
    assert area.min() < 0.15 and area.max() > 0.9


def test_random_resized_crop_falls_back_to_a_centre_crop_for_extreme_shapes():
    # A 1-pixel-high strip: no attempt fits the 3/4..4/3 ratio, so the centre fallback is used.
    boxes = random_resized_crop_boxes(np.array([1]), np.array([100]),
                                      sample_uniforms(0, 0, np.array([0])))
    assert boxes.tolist() == [[0, 49, 1, 1]]


def test_fashion_mnist_demo_subset_is_class_balanced():
    images, labels = load_split("demo", "train")
    assert images.shape == (6000, 28, 28)
    assert np.bincount(labels).tolist() == [600] * 10
    assert len(balanced_subset(labels, 3)) == 30


def test_fashion_mnist_tree_shards_and_loads(tmp_path):
    tree = str(tmp_path / "fmnist")
    assert write_tree(tree, train_per_class=3, val_per_class=1) == {"train": 30, "val": 10}
    out = str(tmp_path / "shards")
    manifest = shard_tree(tree, out, shards=2)
    assert manifest["classes"] == CLASSES and manifest["skipped"] == []
    x, y = next(iter(ShardedImageNet(out, "val", batch_size=10, image_size=28, workers=0)))
    assert x.shape == (10, 3, 28, 28) and sorted(y.tolist()) == list(range(10))
    # Grayscale in, RGB out: the three channels are equal.
    assert torch.equal(x[:, 0], x[:, 1]) and torch.equal(x[:, 1], x[:, 2])


def test_bench_loader_writes_both_sides_and_the_ratio(tmp_path):
    import json

    from hpcdl.cli.main import main as hpcdl_main

    out = tmp_path / "loader.json"
    assert hpcdl_main(["bench", "loader", "--src", str(tmp_path / "tree"), "--shards",
                       str(tmp_path / "shards"), "--generate", "10", "--images", "8",
                       "--batch", "4", "--image-size", "32", "--num-shards", "2",
                       "--shard-ranks", "", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    sides = {r["name"]: r for r in report["results"]}
    assert sides["imagefolder_pillow"]["images_per_s_per_core"] > 0
    assert sides["hdf5_sharded"]["images_per_s_per_core"] > 0
    assert report["ratios"]["hdf5_vs_imagefolder"] > 0
    # The fair baselines read the shards' own pre-resized JPEGs: ImageFolder and WebDataset.
    for name in ("imagefolder_pillow_resized", "webdataset_pil_resized", "simplejpeg_decode_only"):
        assert sides[name]["images_per_s_per_core"] > 0
    for ratio in ("hdf5_vs_imagefolder_resized", "hdf5_vs_webdataset", "hdf5_fraction_of_decode"):
        assert report["ratios"][ratio] > 0


def test_resized_baselines_export_the_stored_jpegs_byte_for_byte(tmp_path):
    import tarfile

    from hpcdl.bench.loader import export_resized_baselines, stored_train_jpegs
    from hpcdl.data_prep.synthetic import make_imagenet_tree

    make_imagenet_tree(str(tmp_path / "src"), num_classes=2, train_per_class=3, val_per_class=0)
    shard_tree(str(tmp_path / "src"), str(tmp_path / "shards"), 2)
    stored = {name.rsplit("/", 1)[-1].rsplit(".", 1)[0]: jpeg
              for name, _, _, jpeg in stored_train_jpegs(str(tmp_path / "shards"))}
    tree, tars = export_resized_baselines(str(tmp_path / "shards"), str(tmp_path / "out"))
    files = {p.stem: p.read_bytes() for p in (tmp_path / "out" / "tree").rglob("*.jpg")}
    assert files == stored and len(stored) == 6
    with tarfile.open(tars[0]) as tar:
        in_tar = {m.name.rsplit("/", 1)[-1].removesuffix(".jpg"): tar.extractfile(m).read()
                  for m in tar.getmembers() if m.name.endswith(".jpg")}
    assert in_tar == stored


def test_val_rank_without_shards_yields_empty_batches_to_keep_step_with_the_others(shards):
    # 3 val shards on 5 nodes: nodes 3 and 4 have nothing to read but must not stop early.
    data = loader(shards, split="val", node_index=4, num_nodes=5)
    batches = list(data)
    assert len(batches) == len(data) > 0
    assert all(x.shape == (0, 3, 16, 16) and y.shape == (0,) for x, y in batches)


def test_read_rows_returns_rows_in_the_order_asked(shards):
    import h5py

    from hpcdl.data.loader import read_rows

    with h5py.File(f"{shards}/train-00000-of-00005.h5", "r") as f:
        images = f["images"]
        got = read_rows(images, np.array([5, 1, 3]))
        assert all(np.array_equal(g, images[r]) for g, r in zip(got, [5, 1, 3], strict=True))


def test_caffe_square_crop_is_a_227_window_of_the_image_resized_to_256_squared():
    """Caffe: resize to 256x256 (aspect not kept), crop 227 at Rand(256 - 227 + 1)."""
    heights, widths = np.array([256, 256, 300]), np.array([341, 256, 256])
    lowest = caffe_crop_boxes(heights, widths, np.zeros((3, 2)), 227, 256, square=True)
    highest = caffe_crop_boxes(heights, widths, np.full((3, 2), 0.999999), 227, 256,
                               square=True)
    for (t0, l0, h, w), (t1, l1, _, _), hh, ww in zip(lowest, highest, heights, widths,
                                                       strict=True):
        assert (t0, l0) == (0, 0)
        assert h == pytest.approx(227 * hh / 256) and w == pytest.approx(227 * ww / 256)
        assert t1 == pytest.approx(29 * hh / 256) and l1 == pytest.approx(29 * ww / 256)
    (top, left, h, w), = caffe_crop_boxes(np.array([256]), np.array([341]), None, 227, 256,
                                          square=True)
    assert (top, left) == (14 * 256 / 256, 14 * 341 / 256)        # val: the centre crop


def test_caffe_short_side_crop_keeps_the_aspect():
    draws = np.array([[0.0, 1 - 1e-9]])
    (top, left, h, w), = caffe_crop_boxes(np.array([256]), np.array([341]), draws, 227, 256,
                                          square=False)
    assert (h, w) == (227, 227) and top == 0 and left == 341 - 227


def test_caffe_crop_of_a_raw_image_equals_resize_then_crop():
    """The one-box crop matches resizing the whole image to 256² first, then cropping."""
    gen = torch.Generator().manual_seed(0)
    image = torch.randint(0, 256, (128, 96, 3), dtype=torch.uint8, generator=gen)
    (box,) = caffe_crop_boxes(np.array([128]), np.array([96]), np.array([[0.5, 0.25]]), 56, 64,
                              square=True)
    out = torch.empty((3, 56, 56), dtype=torch.uint8)
    crop_resize(image.numpy().reshape(-1), (128, 96, 3), "raw", box, 56, False, out)
    whole = torch.nn.functional.interpolate(image.permute(2, 0, 1)[None].float(), (64, 64),
                                            mode="bilinear", antialias=True, align_corners=False)
    top, left = round(box[0] * 64 / 128), round(box[1] * 64 / 96)
    expected = whole[0, :, top:top + 56, left:left + 56]
    assert (out.float() - expected).abs().mean() < 12   # two resampling paths, same window


def test_loader_with_caffe_crop_gives_batches_of_the_crop_size(shards):
    x, _ = next(iter(loader(shards, batch_size=4, image_size=14, crop="caffe_square",
                            resize=16)))
    assert x.shape == (4, 3, 14, 14)
    v, _ = next(iter(loader(shards, split="val", batch_size=4, image_size=14,
                            crop="caffe_short_side", resize=16)))
    assert v.shape == (4, 3, 14, 14)
    with pytest.raises(ValueError, match="crop"):
        loader(shards, crop="inception")


def test_caffe_mean_normalization_is_mean_subtraction_times_scale():
    """NVCaffe AlexNet-BN: (x - mean) * 0.00390625, in float64 as the reference."""
    x = torch.tensor([0, 100, 255], dtype=torch.uint8).view(1, 3, 1, 1).expand(1, 3, 2, 2)
    y = normalize(x.contiguous(), *input_normalization("caffe_mean", 0.00390625))
    expected = (torch.tensor([0.0, 100.0, 255.0], dtype=torch.float64)
                - torch.tensor([122.68, 116.67, 104.01], dtype=torch.float64)) / 256
    torch.testing.assert_close(y[0, :, 0, 0].double(), expected, rtol=1e-6, atol=1e-6)
    assert input_normalization() == ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
