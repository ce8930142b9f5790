"""Fashion-MNIST as an ImageNet-shaped JPEG tree, for the demo and smoke tests.

Fashion-MNIST (Xiao, Rasul & Vollgraf 2017, MIT licence) ships with hpcdl as a class-balanced
subset (hpcdl/demo_data: 600 train + 100 test images per class, idx format, gzipped) and is
read in full from Debian's ``dataset-fashion-mnist`` package when installed. ``write_tree``
writes ``TREE/train/<class>/*.JPEG`` and ``TREE/val/<class>/*.JPEG`` (grayscale JPEGs; the
sharder converts them to RGB), so the demo exercises exactly the ImageNet path:
tree -> ``hpcdl prep shard`` -> ``ShardedImageNet``.
"""
from __future__ import annotations

import gzip
import os
import struct

import numpy as np

DEBIAN_DIR = "/usr/share/datasets/fashion-mnist"
# Folder names sort in label order, so class index == Fashion-MNIST label.
CLASSES = ["00_tshirt_top", "01_trouser", "02_pullover", "03_dress", "04_coat",
           "05_sandal", "06_shirt", "07_sneaker", "08_bag", "09_ankle_boot"]
FILES = {"train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
         "val": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")}


def demo_dir() -> str:
    """Where the shipped subset lives (inside the installed hpcdl package)."""
    import hpcdl

    return os.path.join(os.path.dirname(hpcdl.__file__), "demo_data")


def read_idx(path: str) -> np.ndarray:
    """An idx file (LeCun's MNIST format), gzipped or not, as a numpy array."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        data = f.read()
    zero, dtype_code, ndim = struct.unpack(">HBB", data[:4])
    if zero != 0 or dtype_code != 0x08:
        raise ValueError(f"{path}: not an unsigned-byte idx file (header {data[:4].hex()})")
    shape = struct.unpack(f">{ndim}I", data[4:4 + 4 * ndim])
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(shape)


def write_idx(path: str, array: np.ndarray) -> None:
    """Gzipped idx with a zero mtime, so the file's bytes depend only on the array."""
    header = struct.pack(">HBB", 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as f:
        f.write(header + np.ascontiguousarray(array, dtype=np.uint8).tobytes())


def load_split(source: str, split: str) -> tuple[np.ndarray, np.ndarray]:
    """(images N x 28 x 28, labels N) of ``split`` from ``source``: 'demo', 'debian' or a folder."""
    folder = {"demo": demo_dir(), "debian": DEBIAN_DIR}.get(source, source)
    images, labels = (read_idx(os.path.join(folder, name)) for name in FILES[split])
    if len(images) != len(labels):
        raise ValueError(f"{folder}: {len(images)} images but {len(labels)} labels for {split}")
    return images, labels


def balanced_subset(labels: np.ndarray, per_class: int) -> np.ndarray:
    """Indices of the first ``per_class`` samples of each class, in file order."""
    picks = [np.flatnonzero(labels == c)[:per_class] for c in range(len(CLASSES))]
    return np.sort(np.concatenate(picks))


def make_demo_subset(out_dir: str, source: str = "debian", train_per_class: int = 600,
                     val_per_class: int = 100) -> None:
    """Write the class-balanced subset shipped in hpcdl/demo_data (how it was made)."""
    os.makedirs(out_dir, exist_ok=True)
    for split, per_class in (("train", train_per_class), ("val", val_per_class)):
        images, labels = load_split(source, split)
        keep = balanced_subset(labels, per_class)
        write_idx(os.path.join(out_dir, FILES[split][0]), images[keep])
        write_idx(os.path.join(out_dir, FILES[split][1]), labels[keep])


def write_tree(root: str, source: str = "demo", train_per_class: int | None = None,
               val_per_class: int | None = None, quality: int = 95) -> dict[str, int]:
    """Write Fashion-MNIST as ``root/{train,val}/<class>/<index>.JPEG``; returns counts per split.

    ``source``: 'demo' (the shipped subset), 'debian' (the full 60k/10k) or a folder of idx
    files. ``*_per_class`` keep only the first that many images of each class.
    """
    from PIL import Image

    counts = {}
    for split, per_class in (("train", train_per_class), ("val", val_per_class)):
        images, labels = load_split(source, split)
        keep = (balanced_subset(labels, per_class) if per_class is not None
                else np.arange(len(labels)))
        for name in CLASSES:
            os.makedirs(os.path.join(root, split, name), exist_ok=True)
        for i in keep:
            path = os.path.join(root, split, CLASSES[labels[i]], f"{split}_{i:05d}.JPEG")
            Image.fromarray(images[i]).save(path, format="JPEG", quality=quality)
        counts[split] = len(keep)
    return counts
