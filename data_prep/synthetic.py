"""Build ImageNet-shaped trees for tests, the demo and the benchmarks.

The images are smooth colour fields with a little noise, so their JPEGs compress and decode
like photographs (pure noise would be 5x larger and slower to decode than ImageNet's).
``quirks=True`` adds the files that real ILSVRC2012 contains and a sharder must survive:
a CMYK JPEG, a grayscale JPEG, a PNG saved with a ``.JPEG`` name, a truncated JPEG, a
non-image file and an empty class folder; ``val_layout="flat"`` writes ``val/`` as flat files
labelled by a Kaggle-style ``LOC_val_solution.csv``.
"""
from __future__ import annotations

import io
import os
from dataclasses import dataclass, field

import numpy as np


@dataclass
class TreeInfo:
    """What a test needs to check a round trip through the sharder."""

    root: str
    classes: list[str]
    labels: dict[str, int] = field(default_factory=dict)   # good key -> class index
    bad: dict[str, str] = field(default_factory=dict)      # bad key -> kind of defect
    empty_classes: list[str] = field(default_factory=list)

    def keys(self, split: str) -> list[str]:
        return sorted(k for k in self.labels if k.startswith(split + "/"))


def photo_like(rng: np.random.Generator, width: int, height: int) -> np.ndarray:
    """An HxWx3 uint8 image: a random colour gradient plus mild noise."""
    y = np.linspace(0.0, 1.0, height, dtype=np.float32)[:, None, None]
    x = np.linspace(0.0, 1.0, width, dtype=np.float32)[None, :, None]
    a, b, c = (rng.uniform(0, 255, size=3).astype(np.float32) for _ in range(3))
    image = a * (1 - x) * (1 - y) + b * x + c * y * (1 - x)
    image = image + rng.normal(0, 12, size=(height, width, 3)).astype(np.float32)
    return np.clip(image, 0, 255).astype(np.uint8)


def _save(image, path: str, fmt: str = "JPEG", **kw) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    image.save(path, format=fmt, **kw)


def _write_quirks(root: str, classes: list[str], rng: np.random.Generator, size: tuple[int, int],
                  info: TreeInfo) -> None:
    from PIL import Image

    w, h = size
    c0 = classes[0]
    rgb = Image.fromarray(photo_like(rng, w, h))
    second = 1 % len(classes)
    decodable = ((f"train/{c0}/cmyk.JPEG", rgb.convert("CMYK"), {"quality": 90}, 0),
                 (f"train/{c0}/gray.JPEG", rgb.convert("L"), {"quality": 90}, 0),
                 (f"train/{classes[second]}/png_named.JPEG", rgb, {"fmt": "PNG"}, second))
    for key, image, kw, label in decodable:
        _save(image, os.path.join(root, key), **kw)
        info.labels[key] = label
    buf = io.BytesIO()
    rgb.save(buf, format="JPEG", quality=90)
    key = f"train/{c0}/truncated.JPEG"
    with open(os.path.join(root, key), "wb") as f:
        f.write(buf.getvalue()[: len(buf.getvalue()) // 2])
    info.bad[key] = "truncated"
    key = f"train/{c0}/notes.txt"
    with open(os.path.join(root, key), "w", encoding="utf-8") as f:
        f.write("not an image\n")
    info.bad[key] = "non-image"


def make_imagenet_tree(root: str, num_classes: int = 3, train_per_class: int = 8,
                       val_per_class: int = 2, size: tuple[int, int] = (40, 30),
                       quirks: bool = False, val_layout: str = "folders",
                       seed: int = 0, quality: int = 90) -> TreeInfo:
    """Write ``root/train/<wnid>/*.JPEG`` and ``root/val/...``; returns what was written.

    ``size`` is (width, height): (500, 375) is ImageNet's most common shape, (40, 30) keeps
    tests fast. With ``quirks`` an extra, empty class folder is added after the others.
    """
    from PIL import Image

    if val_layout not in ("folders", "flat"):
        raise ValueError(f"val_layout={val_layout!r}: expected 'folders' or 'flat'")
    rng = np.random.default_rng(seed)
    classes = [f"n{1440764 + 1000 * i:08d}" for i in range(num_classes)]
    empty = [f"n{99999999 - i:08d}" for i in range(1 if quirks else 0)]
    all_classes = sorted(classes + empty)
    info = TreeInfo(root=root, classes=all_classes, empty_classes=list(empty))
    index = {c: i for i, c in enumerate(all_classes)}
    for c in empty:
        os.makedirs(os.path.join(root, "train", c), exist_ok=True)
    w, h = size
    val_rows, val_counter = [], 0
    for c in classes:
        for i in range(train_per_class):
            key = f"train/{c}/{c}_{i}.JPEG"
            _save(Image.fromarray(photo_like(rng, w, h)), os.path.join(root, key), quality=quality)
            info.labels[key] = index[c]
        for _ in range(val_per_class):
            val_counter += 1
            stem = f"ILSVRC2012_val_{val_counter:08d}"
            key = f"val/{c}/{stem}.JPEG" if val_layout == "folders" else f"val/{stem}.JPEG"
            _save(Image.fromarray(photo_like(rng, w, h)), os.path.join(root, key), quality=quality)
            info.labels[key] = index[c]
            val_rows.append(f"{stem},{c} 1 1 {w - 1} {h - 1}")
    if val_layout == "flat":
        with open(os.path.join(root, "LOC_val_solution.csv"), "w", encoding="utf-8") as f:
            f.write("ImageId,PredictionString\n" + "\n".join(val_rows) + "\n")
    if quirks:
        _write_quirks(root, [c for c in all_classes if c not in empty], rng, size, info)
        # _write_quirks labels by position among non-empty classes; map to all_classes.
        nonempty = [c for c in all_classes if c not in empty]
        for key in list(info.labels):
            if "/cmyk." in key or "/gray." in key or "/png_named." in key:
                info.labels[key] = index[nonempty[info.labels[key]]]
    return info
