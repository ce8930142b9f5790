"""ImageNet tree -> checksummed HDF5 shards, MPI-parallel and resumable.

Each rank writes whole shards (shard t of the combined train+val job list goes to rank
t mod P), so no parallel HDF5 is needed and throughput scales with ranks until the file
system saturates. A shard is built in memory (h5py's core driver), hashed, and written under a
temporary name that is renamed into place only when complete (hpcdl.io.atomic_write_bytes);
a small record in ``DIR/.progress/`` then marks it done. A rerun skips every shard whose
record matches both the plan and the file's sha256, so a killed run resumes, and because
the HDF5 bytes depend only on the inputs (fixed creation order, no timestamps, one libver),
the result is byte-identical to an uninterrupted run at any number of ranks. The shard
layout (format version 1) is docs/data.md's, "The shard format".
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hpcdl.data.format import FORMAT_VERSION, MANIFEST, shard_name
from hpcdl.data_prep.tree import scan_tree
from hpcdl.errors import BadInputError, mark_agreed
from hpcdl.io import atomic_write_bytes, atomic_write_text, sha256_file

__all__ = ["FORMAT_VERSION", "MANIFEST", "shard_name", "shard_tree", "sha256_file"]

PROGRESS_DIR = ".progress"
JPEG_QUALITY = 90


class SkipSample(Exception):
    """A source file that cannot become a training image; the message is the reason."""


class BadSourceError(BadInputError, RuntimeError):
    """``--strict``: source files (or label rows) that would have been skipped, named."""


class InjectedFailure(RuntimeError):
    """Raised by ``fail_after`` to simulate a job killed mid-run (tests)."""


def resized_size(width: int, height: int, short_side: int) -> tuple[int, int]:
    """Scale so the short side is ``short_side``; never upscale (it adds bytes, not detail)."""
    short = min(width, height)
    if not short_side or short <= short_side:
        return width, height
    scale = short_side / short
    return max(1, round(width * scale)), max(1, round(height * scale))


def decode_rgb(data: bytes, resize: int):
    """Decode any image Pillow knows (by content, not extension) to RGB, short side <= resize.

    JPEGs are decoded at a reduced DCT scale (Pillow's draft mode) when the target allows,
    which is most of the sharding time saved on ImageNet's ~400x350 average image.
    CMYK, grayscale, palette and alpha images become RGB.

    Every exception of the decoding is the file's fault, not the sharder's: Pillow's format
    plugins parse untrusted bytes and raise whatever their parser meets (OSError and
    SyntaxError mostly, but also EOFError, struct.error, IndexError, KeyError, ...), so all of
    them make the file a skipped sample with the reason.
    """
    from PIL import Image, UnidentifiedImageError

    try:
        img = Image.open(io.BytesIO(data))
    except UnidentifiedImageError as exc:
        raise SkipSample("not an image") from exc
    except Exception as exc:  # noqa: BLE001 - see above: any plugin error is a corrupt file
        raise SkipSample(f"corrupt image header: {_reason(exc)}") from exc
    try:
        target = resized_size(*img.size, resize)
        if img.format == "JPEG" and target != img.size:
            img.draft("RGB", target)
        img.load()
        if img.mode != "RGB":
            img = img.convert("RGB")
        if img.size != target:
            img = img.resize(target, Image.Resampling.BICUBIC)
        return np.asarray(img)
    except Exception as exc:  # noqa: BLE001 - see above
        raise SkipSample(f"corrupt {img.format or 'image'}: {_reason(exc)}") from exc


def _reason(exc: BaseException) -> str:
    """An exception as a skip reason: its type when the message alone does not say it."""
    text = str(exc)
    return text if isinstance(exc, OSError) and text else f"{type(exc).__name__}: {text}"


def encode_sample(path: str, resize: int, image_format: str) -> tuple[np.ndarray, tuple]:
    """The stored bytes and (H, W, C) of one source file, or SkipSample with the reason."""
    import simplejpeg

    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:  # EACCES, EIO, a file gone since the scan: this file, not the run
        raise SkipSample(f"unreadable ({exc.strerror or exc})") from exc
    if not data:
        raise SkipSample("empty file")
    rgb = np.ascontiguousarray(decode_rgb(data, resize))
    if image_format == "raw":
        return rgb.reshape(-1), rgb.shape
    jpeg = simplejpeg.encode_jpeg(rgb, quality=JPEG_QUALITY, colorspace="RGB",
                                  colorsubsampling="420")
    return np.frombuffer(jpeg, dtype=np.uint8), rgb.shape


def deal(num_samples: int, num_shards: int, seed: int) -> list[np.ndarray]:
    """Shuffle sample indices with ``seed`` and deal them round-robin: sizes differ by <= 1."""
    order = np.random.default_rng(seed).permutation(num_samples)
    return [order[j::num_shards] for j in range(num_shards)]


def default_val_shards(train_shards: int, num_train: int, num_val: int) -> int:
    """Val shards in proportion to train (ImageNet: 1024 train -> 40 val), at least 1."""
    if num_val == 0:
        return 0
    return max(1, -(-train_shards * num_val // max(num_train, 1)))


def build_shard(images: Sequence[np.ndarray], shapes: Sequence[tuple], labels: Sequence[int],
                keys: Sequence[str], attrs: dict[str, Any]) -> bytes:
    """The HDF5 file image of one shard, built in memory.

    Deterministic bytes: h5py writes no timestamps unless asked (track_times off), creation
    order is fixed here, and ``libver`` pins the object-header versions.
    """
    import h5py

    name = f"shard-{attrs['split']}-{attrs['shard_index']}-{os.getpid()}"
    with h5py.File(name, "w", driver="core", backing_store=False, track_order=True,
                   libver=("earliest", "v110")) as f:
        n = len(labels)
        data = np.empty(n, dtype=object)
        for i, image in enumerate(images):
            data[i] = image
        ds = f.create_dataset("images", (n,), dtype=h5py.vlen_dtype(np.uint8), track_times=False)
        if n:  # low-level write: h5py's high level would see equal-length raw images as 2-D
            ds.id.write(h5py.h5s.ALL, h5py.h5s.ALL, data)
        f.create_dataset("shapes", data=np.asarray(shapes, dtype=np.uint16).reshape(n, 3),
                         track_times=False)
        f.create_dataset("labels", data=np.asarray(labels, dtype=np.int16), track_times=False)
        f.create_dataset("keys", data=np.asarray(list(keys), dtype=h5py.string_dtype()),
                         shape=(n,), track_times=False)
        for key, value in attrs.items():
            if isinstance(value, list):
                f.attrs[key] = np.asarray(value, dtype=h5py.string_dtype())
            else:
                f.attrs[key] = value
        f.flush()
        return f.id.get_file_image()


@dataclass
class ShardJob:
    """One shard to write: which samples (indices into the split's listing) and where."""

    split: str
    index: int
    count: int
    samples: np.ndarray

    @property
    def name(self) -> str:
        return shard_name(self.split, self.index, self.count)


def plan_id(job: ShardJob, keys: Sequence[str], options: dict[str, Any]) -> str:
    """A fingerprint of everything that determines a shard's bytes (for resume checks)."""
    digest = hashlib.sha256(json.dumps(options, sort_keys=True).encode())
    for i in job.samples:
        digest.update(keys[i].encode() + b"\0")
    return digest.hexdigest()


def completed_record(out: str, job: ShardJob, plan: str) -> dict | None:
    """The record of a shard already written and verified by an earlier run, else None."""
    record_path = os.path.join(out, PROGRESS_DIR, job.name + ".json")
    shard_path = os.path.join(out, job.name)
    if not (os.path.isfile(record_path) and os.path.isfile(shard_path)):
        return None
    with open(record_path, encoding="utf-8") as f:
        record = json.load(f)
    if record.get("plan") != plan or sha256_file(shard_path) != record.get("sha256"):
        return None
    return record


def write_shard(src: str, out: str, job: ShardJob, keys: Sequence[str], labels: Sequence[int],
                classes: list[str], options: dict[str, Any], plan: str, strict: bool,
                progress=None) -> dict:
    """Encode a shard's samples, write it atomically, and return its record."""
    images, shapes, kept_labels, kept_keys, skipped = [], [], [], [], []
    for i in job.samples:
        key = keys[i]
        try:
            image, shape = encode_sample(os.path.join(src, key), options["resize"],
                                         options["image_format"])
        except SkipSample as exc:
            skipped.append({"key": key, "reason": str(exc)})
            if strict:
                return {"name": job.name, "failed": True, "skipped": skipped}
            continue
        finally:
            if progress is not None:
                progress.update(1)
        images.append(image)
        shapes.append(shape)
        kept_labels.append(labels[i])
        kept_keys.append(key)
    attrs = {"format_version": FORMAT_VERSION, "image_format": options["image_format"],
             "split": job.split, "shard_index": job.index, "num_shards": job.count,
             "resize": options["resize"], "classes": classes}
    image = build_shard(images, shapes, kept_labels, kept_keys, attrs)
    atomic_write_bytes(os.path.join(out, job.name), image)
    class_counts = np.bincount(np.asarray(kept_labels, dtype=np.int64),
                               minlength=len(classes)).tolist()
    record = {"name": job.name, "split": job.split, "index": job.index,
              "num_samples": len(kept_labels), "bytes": len(image),
              "sha256": hashlib.sha256(image).hexdigest(), "class_counts": class_counts,
              "skipped": skipped, "plan": plan}
    atomic_write_text(os.path.join(out, PROGRESS_DIR, job.name + ".json"),
                      json.dumps(record, sort_keys=True) + "\n")
    return record


def remove_stale_temporaries(out: str) -> None:
    """Temporary shard files left by a killed run (their final names were never created)."""
    for name in os.listdir(out):
        if name.startswith(".") and name.endswith(".tmp") and ".h5." in name:
            os.unlink(os.path.join(out, name))


def make_jobs(listings: dict, shards: int, val_shards: int | None, seed: int) -> list[ShardJob]:
    """Every shard of every split, in a fixed order (train then val)."""
    jobs = []
    for split, listing in listings.items():
        n = len(listing.keys)
        count = shards if split == "train" else (
            val_shards if val_shards is not None
            else default_val_shards(shards, len(listings["train"].keys), n))
        if count <= 0 or n == 0:
            continue
        # Each split gets its own stream so adding val files does not reorder train shards.
        split_seed = [seed, 0 if split == "train" else 1]
        for j, samples in enumerate(deal(n, count, split_seed)):
            jobs.append(ShardJob(split, j, count, samples))
    return jobs


def build_manifest(classes: list[str], listings: dict, records: list[dict],
                   options: dict[str, Any]) -> dict:
    records = sorted(records, key=lambda r: (r["split"] != "train", r["split"], r["index"]))
    splits = {}
    for split in listings:
        mine = [r for r in records if r["split"] == split]
        if not mine:
            continue
        counts = np.sum([r["class_counts"] for r in mine], axis=0).astype(int).tolist()
        splits[split] = {"num_samples": sum(r["num_samples"] for r in mine),
                         "num_shards": len(mine), "class_counts": counts}
    return {
        "format_version": FORMAT_VERSION,
        "image_format": options["image_format"],
        "resize": options["resize"],
        "seed": options["seed"],
        "classes": classes,
        "splits": splits,
        "shards": [{k: r[k] for k in ("name", "split", "index", "num_samples", "bytes", "sha256")}
                   for r in records],
        "skipped": [s for listing in listings.values() for s in listing.skipped]
                   + [s for r in records for s in r["skipped"]],
        "empty_classes": {split: listing.empty_classes for split, listing in listings.items()},
    }


def _strict_message(skipped: list[dict]) -> str:
    return ("--strict: bad source files: "
            + "; ".join(f"{s['key']} ({s['reason']})" for s in skipped)
            + "; fix or remove them, or run without --strict to skip them")


def shard_tree(src: str, out: str, shards: int, val_shards: int | None = None,
               resize: int = 256, image_format: str = "jpeg", seed: int = 0,
               strict: bool = False, val_labels: str | None = None, synsets: str | None = None,
               comm=None, progress: bool = False, fail_after: int | None = None) -> dict:
    """Shard ``src`` into ``out``; every rank of ``comm`` (mpi4py, or None: serial) calls it.

    Returns the manifest (on every rank). Raises :class:`BadSourceError` (agreed: on every
    rank) naming the files when ``strict`` and a source file had to be skipped.
    """
    if image_format not in ("jpeg", "raw"):
        raise ValueError(f"--format {image_format!r}: expected jpeg or raw")
    if shards < 1:
        raise ValueError(f"--shards {shards}: need at least 1")
    rank, size = (comm.rank, comm.size) if comm is not None else (0, 1)
    listing = None
    if rank == 0:
        try:
            # The tree is read before anything is created: a rejected --src or --val-labels
            # leaves no --out directory behind.
            listing = scan_tree(src, val_labels, synsets)
            os.makedirs(os.path.join(out, PROGRESS_DIR), exist_ok=True)
            remove_stale_temporaries(out)
        except (OSError, ValueError) as exc:
            listing = exc  # raised on every rank below, so none waits in a collective
    if comm is not None:
        listing = comm.bcast(listing, root=0)
    if isinstance(listing, Exception):
        # Every rank raises the same error here: one of the tree's is agreed (one line, exit 2)
        raise mark_agreed(listing) if isinstance(listing, BadInputError) else listing
    classes, listings = listing
    unlisted = [s for split_listing in listings.values() for s in split_listing.skipped]
    if strict and unlisted:  # every rank holds the same listing: every rank raises this
        raise mark_agreed(BadSourceError(_strict_message(unlisted)))
    options = {"image_format": image_format, "resize": resize, "seed": seed,
               "format_version": FORMAT_VERSION, "classes": classes}
    jobs = make_jobs(listings, shards, val_shards, seed)
    mine = [job for t, job in enumerate(jobs) if t % size == rank]
    bar = None
    if progress and rank == 0:
        from tqdm import tqdm

        bar = tqdm(total=sum(len(j.samples) for j in mine), unit="img", file=sys.stderr,
                   desc=f"shard (rank 0 of {size})")
    records, written = [], 0
    for job in mine:
        listing_j = listings[job.split]
        plan = plan_id(job, listing_j.keys, options)
        record = completed_record(out, job, plan)
        if record is None:
            if fail_after is not None and written >= fail_after:
                raise InjectedFailure(f"injected failure after {written} shards on rank {rank}")
            record = write_shard(src, out, job, listing_j.keys, listing_j.labels, classes,
                                 options, plan, strict, bar)
            written += 1
        elif bar is not None:
            bar.update(len(job.samples))
        records.append(record)
        if record.get("failed"):
            break  # --strict: stop here, report at the gather so no rank is left waiting
    if bar is not None:
        bar.close()
    if comm is not None:
        gathered = comm.allgather(records)
        records = [r for part in gathered for r in part]
    failed = [s for r in records if r.get("failed") for s in r["skipped"]]
    if failed:  # gathered: every rank raises the same error
        raise mark_agreed(BadSourceError(_strict_message(failed)))
    manifest = build_manifest(classes, listings, records, options)
    if rank == 0:
        atomic_write_text(os.path.join(out, MANIFEST), json.dumps(manifest, indent=1) + "\n")
    if comm is not None:
        comm.Barrier()
    return manifest
