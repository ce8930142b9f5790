"""Scan an ImageNet-shaped tree into (relative path, label) lists.

The layouts understood (per-class ``train/`` and ``val/`` folders; a flat ``val/`` labelled by
Kaggle's ``LOC_val_solution.csv`` or the devkit's ``ILSVRC2012_validation_ground_truth.txt``
with ``synsets``, since the devkit's ids index ``meta.mat``, not the sorted wnids): docs/data.md,
"The source tree". Class indices are the positions of the train folder names in sorted order,
empty folders included (so class ids stay the ones of the full dataset).
"""
from __future__ import annotations

import csv
import os
import warnings
from dataclasses import dataclass, field

from hpcdl.errors import BadInputError

LOC_SOLUTION = "LOC_val_solution.csv"
DEVKIT_GROUND_TRUTH = "ILSVRC2012_validation_ground_truth.txt"


class TreeError(BadInputError, ValueError):
    """The source tree or its labels file cannot be sharded as given (the message names it)."""


class TreeMissingError(TreeError, FileNotFoundError):
    """A folder or labels file the tree needs is not there."""


@dataclass
class SplitListing:
    """The files of one split: ``keys[i]`` (path relative to the tree) has label ``labels[i]``."""

    keys: list[str] = field(default_factory=list)
    labels: list[int] = field(default_factory=list)
    empty_classes: list[str] = field(default_factory=list)
    #: files (or label rows) left out while listing, as the sharder's skips: key and reason
    skipped: list[dict[str, str]] = field(default_factory=list)


def list_classes(tree: str) -> list[str]:
    """Sorted class folder names under ``TREE/train``."""
    train = os.path.join(tree, "train")
    if not os.path.isdir(train):
        raise TreeMissingError(f"{train}: no train/ folder; expected TREE/train/<class>/*")
    classes = sorted(e.name for e in os.scandir(train) if e.is_dir())
    if not classes:
        raise TreeError(f"{train}: no class folders; expected TREE/train/<class>/*")
    return classes


def _files(directory: str) -> list[str]:
    return sorted(e.name for e in os.scandir(directory)
                  if e.is_file() and not e.name.startswith("."))


def scan_class_folders(tree: str, split: str, classes: list[str]) -> SplitListing:
    """``TREE/split/<class>/*``: the folder names the label. Unknown folders are an error."""
    root = os.path.join(tree, split)
    index = {c: i for i, c in enumerate(classes)}
    unknown = sorted(e.name for e in os.scandir(root) if e.is_dir() and e.name not in index)
    if unknown:
        raise TreeError(f"{root}: folders {unknown[:5]} are not train classes")
    listing = SplitListing()
    for name in classes:
        folder = os.path.join(root, name)
        files = _files(folder) if os.path.isdir(folder) else []
        if not files:
            listing.empty_classes.append(name)
        for f in files:
            listing.keys.append(f"{split}/{name}/{f}")
            listing.labels.append(index[name])
    return listing


def read_loc_solution(path: str) -> tuple[dict[str, str], list[tuple[str, str]]]:
    """Kaggle's LOC_val_solution.csv: (image id -> wnid, [(image id, why its row is unusable)]).

    A row is unusable when it has no image id or no class (an empty PredictionString): the
    image it names is then skipped like an unreadable file (``--strict`` refuses it). A file
    that is not such a CSV at all (not UTF-8, an unterminated quote, another header) is a ValueError
    naming it: no row of it can be trusted.
    """
    labels: dict[str, str] = {}
    bad: list[tuple[str, str]] = []
    try:
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.reader(f, strict=True)  # an unterminated quote is an error
            header = next(reader, None)
            if header is None or header[:2] != ["ImageId", "PredictionString"]:
                raise TreeError(f"{path}: expected the header 'ImageId,PredictionString'")
            for row in reader:
                if not row:
                    continue
                tokens = row[1].split() if len(row) > 1 else []
                if row[0] and tokens:
                    labels[row[0]] = tokens[0]
                else:
                    what = "no image id" if not row[0] else "no class in PredictionString"
                    bad.append((row[0], f"{path} line {reader.line_num}: {what}"))
    except (UnicodeDecodeError, csv.Error) as exc:
        raise TreeError(f"{path}: not a readable CSV file ({exc}); expected Kaggle's "
                         f"{LOC_SOLUTION}") from None
    return labels, bad


def read_devkit_ground_truth(path: str, files: list[str], classes: list[str],
                             synsets: str | None) -> dict[str, str]:
    """Devkit list: line i is the ILSVRC2012_ID of the i-th sorted validation file."""
    with open(path, encoding="utf-8") as f:
        lines = [(n, line.strip()) for n, line in enumerate(f, start=1) if line.strip()]
    not_ids = [(n, text) for n, text in lines if not text.isdigit()]
    if not_ids:
        raise TreeError(f"{path} line {not_ids[0][0]}: {not_ids[0][1][:40]!r} is not an "
                        f"ILSVRC2012_ID (1..1000, one per line)")
    ids = [int(text) for _, text in lines]
    if len(ids) != len(files):
        raise TreeError(f"{path}: {len(ids)} labels for {len(files)} validation files")
    if synsets:
        with open(synsets, encoding="utf-8") as f:
            id_to_wnid = [line.split()[0] for line in f if line.strip()]
    else:
        warnings.warn(f"{path}: no --synsets file; mapping ILSVRC2012_ID i to the i-th sorted "
                      "train class (the official devkit order differs: pass --synsets)",
                      stacklevel=2)
        id_to_wnid = classes
    bad = [i for i in ids if not 1 <= i <= len(id_to_wnid)]
    if bad:
        raise TreeError(f"{path}: ids {bad[:5]} outside 1..{len(id_to_wnid)}")
    return {os.path.splitext(f)[0]: id_to_wnid[i - 1] for f, i in zip(files, ids, strict=True)}


def find_val_labels(tree: str) -> str | None:
    """A labels file in the usual places when none is given."""
    folders = (tree, os.path.join(tree, "val"), os.path.dirname(os.path.abspath(tree)))
    paths = (os.path.join(folder, name) for folder in folders
             for name in (LOC_SOLUTION, DEVKIT_GROUND_TRUTH))
    return next((path for path in paths if os.path.isfile(path)), None)


def scan_flat_val(tree: str, classes: list[str], labels_file: str | None,
                  synsets: str | None = None) -> SplitListing:
    """``TREE/val/*`` with labels from ``labels_file`` (LOC_val_solution.csv or devkit list)."""
    root = os.path.join(tree, "val")
    files = [f for f in _files(root) if f not in (LOC_SOLUTION, DEVKIT_GROUND_TRUTH)]
    labels_file = labels_file or find_val_labels(tree)
    if labels_file is None:
        raise TreeMissingError(f"{root}: flat validation files need --val-labels "
                                f"({LOC_SOLUTION} or {DEVKIT_GROUND_TRUTH})")
    unusable: list[tuple[str, str]] = []
    if labels_file.endswith(".csv"):
        wnid_of, unusable = read_loc_solution(labels_file)
    else:
        wnid_of = read_devkit_ground_truth(labels_file, files, classes, synsets)
    index = {c: i for i, c in enumerate(classes)}
    listing = SplitListing()
    # A row without an image id is reported as itself; one naming a file not in val/ is
    # ignored like any row of an absent file.
    listing.skipped = [{"key": why.split(": ")[0], "reason": why} for image_id, why in unusable
                       if not image_id]
    why_not = dict(unusable)
    for f in files:
        image_id = os.path.splitext(f)[0]
        if image_id in why_not:
            listing.skipped.append({"key": f"val/{f}", "reason": why_not[image_id]})
            continue
        wnid = wnid_of.get(image_id)
        if wnid is None:
            raise TreeError(f"{labels_file}: no label for val/{f}")
        if wnid not in index:
            raise TreeError(f"{labels_file}: val/{f} has class {wnid!r}, not a train class")
        listing.keys.append(f"val/{f}")
        listing.labels.append(index[wnid])
    return listing


def scan_tree(tree: str, val_labels: str | None = None,
              synsets: str | None = None) -> tuple[list[str], dict[str, SplitListing]]:
    """Classes and the listing of each split present (``train`` always, ``val`` if it exists)."""
    classes = list_classes(tree)
    splits = {"train": scan_class_folders(tree, "train", classes)}
    val = os.path.join(tree, "val")
    if os.path.isdir(val):
        has_folders = any(e.is_dir() for e in os.scandir(val))
        splits["val"] = (scan_class_folders(tree, "val", classes) if has_folders
                         else scan_flat_val(tree, classes, val_labels, synsets))
    return classes, splits
