"""ShardedImageNet: per-node HDF5 shards -> uint8 NCHW batches, prefetched by threads. Why
threads and not worker processes, and why shards open with HDF5 file locking off
(``locking=False``): docs/data.md, "Workers are threads" and "Lustre and NFS".

Checks (docs/data.md, "The shard format"): the node's shards' sizes when built (sha256 with
``verify_shards=True``, each local rank its share), the manifest's class count against the
model's ``num_classes``; later a shard that fails to open or read, labels outside the classes
or bytes that do not decode raise :class:`~hpcdl.data.format.ShardError` naming shard (and
sample), never a bare HDF5 error.
"""
from __future__ import annotations

import itertools
import os
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from hpcdl.data.augment import (
    CAFFE_CROPS,
    FLIP_DRAW,
    caffe_crop_boxes,
    centre_crop_box,
    crop_resize,
    random_resized_crop_boxes,
    sample_uniforms,
)
from hpcdl.data.format import (
    ShardError,
    check_num_classes,
    check_shard_files,
    read_manifest,
    split_shards,
)
from hpcdl.data.sampler import (
    epoch_order,
    node_shard_indices,
    shard_offsets,
    train_num_batches,
    val_num_batches,
)

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
# BVLC's ImageNet mean (python/caffe/imagenet/ilsvrc_2012_mean.npy averaged over pixels, BGR
# 104.0, 116.7, 122.7) in RGB and 0..255: Caffe subtracts the per-pixel mean image, which is
# not shipped; its channel means differ from it by a few grey levels.
CAFFE_MEAN_RGB = (122.68, 116.67, 104.01)
NORMALIZATIONS = ("imagenet", "caffe_mean")


def input_normalization(kind: str = "imagenet", input_scale: float = 1.0
                        ) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(mean, std) for :func:`normalize`: ``imagenet`` (x/255 − mean)/std (torchvision);
    ``caffe_mean``: (x − mean)·input_scale in 0..255 units, Caffe's DataTransformer with
    ``mean_file`` and ``scale`` (BVLC AlexNet: scale 1; NVCaffe AlexNet-BN: 0.00390625)."""
    if kind == "imagenet":
        return IMAGENET_MEAN, IMAGENET_STD
    if kind == "caffe_mean":
        if input_scale <= 0:
            raise ValueError(f"data.input_scale must be > 0, got {input_scale}")
        # (x/255 − m/255)/std = (x − m)·scale  ⇔  std = 1/(255·scale)
        return (tuple(m / 255.0 for m in CAFFE_MEAN_RGB),
                (1.0 / (255.0 * input_scale),) * 3)
    raise ValueError(f"data.normalize={kind!r}: choose one of {NORMALIZATIONS}")
PREFETCH_PER_WORKER = 2
#: the decode threads' name prefix (``hpcdl bench train`` leaves them out of the transport's
#: CPU)
LOADER_THREAD_NAME = "hpcdl-loader"


def normalize(images_uint8, mean=IMAGENET_MEAN, std=IMAGENET_STD):
    """uint8 NCHW -> float32 (x/255 - mean) / std, in the trainer (batches cross threads as 1
    byte per pixel): one allocation and two in-place passes, x * (1/(255 std)) + (-mean/std),
    no temporary float batches (fresh memory, page faults) per call."""
    import torch

    std_t = torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1)
    mean_t = torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1)
    out = images_uint8.to(torch.float32)
    return out.mul_(1.0 / (255.0 * std_t)).add_(-mean_t / std_t)


def read_rows(images, rows: np.ndarray) -> np.ndarray:
    """``images[rows]`` of a vlen dataset in one H5Dread on a point selection, in ``rows``
    order (h5py's fancy indexing builds the same read in Python, at several times the cost)."""
    from h5py import h5s

    space = images.id.get_space()
    space.select_elements(np.asarray(rows, dtype=np.uint64).reshape(-1, 1))
    out = np.empty(len(rows), dtype=images.dtype)
    images.id.read(h5s.create_simple((len(rows),)), space, out)
    return out


class ShardedImageNet:
    """Iterates this rank's batches of one split (docs/architecture.md, hpcdl/data)."""

    @classmethod
    def for_communicator(cls, comm: Any, shard_dir: str, split: str, batch_size: int,
                         **options: Any) -> ShardedImageNet:
        """This rank's loader, its node and local rank taken from ``comm`` (anything with
        ``node_index``, ``num_nodes``, ``local_rank``, ``local_size``: an hpcdl communicator);
        ``options``: the constructor's other keywords."""
        return cls(shard_dir, split=split, node_index=comm.node_index, num_nodes=comm.num_nodes,
                   local_rank=comm.local_rank, local_size=comm.local_size,
                   batch_size=batch_size, **options)

    def __init__(self, shard_dir: str, split: str = "train", node_index: int = 0,
                 num_nodes: int = 1, local_rank: int = 0, local_size: int = 1,
                 batch_size: int = 32, image_size: int = 224, seed: int = 0, workers: int = 2,
                 rotate_shards: bool = False, min_scale: float = 0.08,
                 crop: str = "random_resized", resize: int = 256,
                 verify_shards: bool = False, num_classes: int | None = None):
        if not 0 <= node_index < num_nodes:
            raise ValueError(f"node_index={node_index} outside 0..{num_nodes - 1}")
        if not 0 <= local_rank < local_size:
            raise ValueError(f"local_rank={local_rank} outside 0..{local_size - 1}")
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size}: need at least 1")
        self.shard_dir, self.split = shard_dir, split
        self.node_index, self.num_nodes = node_index, num_nodes
        self.local_rank, self.local_size = local_rank, local_size
        self.batch_size, self.image_size, self.seed = batch_size, image_size, seed
        self.workers, self.rotate_shards, self.min_scale = workers, rotate_shards, min_scale
        if crop not in ("random_resized", *CAFFE_CROPS):
            raise ValueError(f"data.crop={crop!r}: choose random_resized or one of "
                             f"{CAFFE_CROPS}")
        self.crop, self.resize = crop, resize
        self.manifest = read_manifest(shard_dir)
        check_num_classes(shard_dir, self.manifest, num_classes)
        self.classes = self.manifest["classes"]
        self.image_format = self.manifest["image_format"]
        self.entries = split_shards(self.manifest, split)
        self.counts = [e["num_samples"] for e in self.entries]
        self.offsets = shard_offsets(self.counts)
        self._check_node_shards(verify_shards)
        self.train = split == "train"
        if self.train:
            self.num_batches = train_num_batches(self.counts, num_nodes, local_size, batch_size)
            if self.num_batches == 0:
                raise ValueError(
                    f"{shard_dir}: {split} has {sum(self.counts)} samples in {len(self.counts)} "
                    f"shards: too few for {num_nodes} nodes x {local_size} ranks x batch "
                    f"{batch_size} (each node needs >= 1 shard and local_size*batch samples)")
        else:
            self.num_batches = val_num_batches(self.counts, num_nodes, local_size, batch_size)
        self._files: dict[int, object] = {}
        self._open_lock = threading.Lock()
        self.data_wait_s = 0.0
        self.set_epoch(0)

    def __len__(self) -> int:
        return self.num_batches

    def _check_node_shards(self, verify: bool) -> None:
        """Sizes of every shard this node reads (any epoch); with ``verify`` also the sha256 of
        this local rank's share of them, so a node's ranks hash in parallel."""
        mine = range(len(self.entries)) if self.rotate_shards else node_shard_indices(
            len(self.entries), self.node_index, self.num_nodes, 0, rotate=False)
        node_entries = [self.entries[i] for i in mine]
        check_shard_files(self.shard_dir, node_entries)
        if verify:
            check_shard_files(self.shard_dir, node_entries[self.local_rank::self.local_size],
                              verify=True)

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        """Order for ``epoch`` (a function of (seed, epoch)); skip the first ``start_batch``."""
        if not 0 <= start_batch <= self.num_batches:
            raise ValueError(f"start_batch={start_batch} outside 0..{self.num_batches}")
        self.epoch, self.start_batch = epoch, start_batch
        self.order = epoch_order(self.counts, self.node_index, self.num_nodes, self.local_rank,
                                 self.local_size, self.seed, epoch, self.rotate_shards,
                                 shuffle=self.train)
        self.data_wait_s = 0.0

    def batch_indices(self, batch: int) -> np.ndarray:
        """Global sample indices of this rank's batch ``batch`` this epoch."""
        return self.order[batch * self.batch_size:(batch + 1) * self.batch_size]

    def _dataset(self, shard: int):
        with self._open_lock:  # opened on first use, by whichever thread needs it first
            if shard not in self._files:
                import h5py

                path = self._shard_path(shard)
                try:
                    f = h5py.File(path, "r", locking=False)
                    opened = (f, f["images"], f["shapes"][:], f["labels"][:])
                except (OSError, KeyError) as exc:
                    raise self._unreadable(shard, exc) from None
                error = self._label_error(shard, opened[3])
                if error is not None:
                    f.close()
                    raise error
                self._files[shard] = opened
            return self._files[shard]

    def _label_error(self, shard: int, labels: np.ndarray) -> ShardError | None:
        """Every label must index a class: an ignore index such as -100 would drop the sample
        from the loss silently, one >= the class count would fail deep in the loss."""
        bad = np.flatnonzero((labels < 0) | (labels >= len(self.classes)))
        if not len(bad):
            return None
        return ShardError(f"shard {self._shard_path(shard)}: label {int(labels[bad[0]])} of "
                          f"sample {int(bad[0])} is outside 0..{len(self.classes) - 1} (the "
                          f"manifest's {len(self.classes)} classes; {len(bad)} such sample(s)); "
                          f"re-shard with `hpcdl prep shard`")

    def _shard_path(self, shard: int) -> str:
        return os.path.join(self.shard_dir, self.entries[shard]["name"])

    def _unreadable(self, shard: int, exc: BaseException) -> ShardError:
        return ShardError(f"shard {self._shard_path(shard)} is unreadable ({type(exc).__name__}: "
                          f"{exc}); check it with `hpcdl prep verify {self.shard_dir}` (or "
                          f"train with --verify-shards) and copy it again")

    def read_samples(self, indices: np.ndarray) -> tuple[list, np.ndarray, np.ndarray]:
        """Stored bytes, (H, W, C) and label of each global sample index, one HDF5 read per
        shard touched (see ``read_rows``)."""
        data = [None] * len(indices)
        shapes = np.empty((len(indices), 3), dtype=np.int64)
        labels = np.empty(len(indices), dtype=np.int64)
        shards = np.searchsorted(self.offsets, indices, side="right") - 1
        for shard in np.unique(shards):
            _, images, shard_shapes, shard_labels = self._dataset(int(shard))
            where = np.flatnonzero(shards == shard)
            rows = indices[where] - self.offsets[shard]
            try:
                items = read_rows(images, rows)
            except OSError as exc:  # a corrupted chunk: name the shard, not just HDF5's error
                raise self._unreadable(int(shard), exc) from None
            for position, item in zip(where, items, strict=True):
                data[position] = item
            shapes[where] = shard_shapes[rows]
            labels[where] = shard_labels[rows]
        return data, shapes, labels

    def load_batch(self, batch: int):
        """Decode and augment one batch: (uint8 NCHW tensor, int64 labels)."""
        import torch

        indices = self.batch_indices(batch)
        size = self.image_size
        images = torch.empty((len(indices), 3, size, size), dtype=torch.uint8)
        data, shapes, labels = self.read_samples(indices)
        if self.crop in CAFFE_CROPS:
            uniforms = sample_uniforms(self.seed, self.epoch, indices) if self.train else None
            boxes = caffe_crop_boxes(shapes[:, 0], shapes[:, 1], uniforms, size, self.resize,
                                     square=self.crop == "caffe_square")
            flips = ((uniforms[:, FLIP_DRAW] < 0.5).tolist() if self.train
                     else [False] * len(indices))
        elif self.train:
            uniforms = sample_uniforms(self.seed, self.epoch, indices)
            boxes = random_resized_crop_boxes(shapes[:, 0], shapes[:, 1], uniforms,
                                              scale=(self.min_scale, 1.0)).tolist()
            flips = (uniforms[:, FLIP_DRAW] < 0.5).tolist()
        else:
            boxes = [centre_crop_box(int(h), int(w), size) for h, w, _ in shapes]
            flips = [False] * len(indices)
        for b, (shape, box, flip) in enumerate(zip(shapes.tolist(), boxes, flips, strict=True)):
            try:
                crop_resize(data[b], shape, self.image_format, box, size, flip, out=images[b])
            except (ValueError, RuntimeError) as exc:  # simplejpeg: ValueError; torch: Runtime
                raise self._undecodable(int(indices[b]), exc) from None
        return images, torch.from_numpy(labels)

    def _undecodable(self, index: int, exc: BaseException) -> ShardError:
        shard = int(np.searchsorted(self.offsets, index, side="right") - 1)
        return ShardError(f"shard {self._shard_path(shard)}: sample {index - self.offsets[shard]} "
                          f"does not decode ({type(exc).__name__}: {exc}); check it with `hpcdl "
                          f"prep verify {self.shard_dir}` and copy it again, or re-shard")

    def __iter__(self):
        batches = range(self.start_batch, self.num_batches)
        if self.workers <= 0:
            for batch in batches:
                start = time.perf_counter()
                result = self.load_batch(batch)
                self.data_wait_s += time.perf_counter() - start
                yield result
            return
        pool = ThreadPoolExecutor(self.workers, thread_name_prefix=LOADER_THREAD_NAME)
        pending: deque = deque()
        todo = iter(batches)
        try:
            pending.extend(pool.submit(self.load_batch, batch)
                           for batch in itertools.islice(todo, self.workers * PREFETCH_PER_WORKER))
            while pending:
                start = time.perf_counter()
                result = pending.popleft().result()
                self.data_wait_s += time.perf_counter() - start
                next_batch = next(todo, None)
                if next_batch is not None:
                    pending.append(pool.submit(self.load_batch, next_batch))
                yield result
        finally:
            for future in pending:
                future.cancel()
            pool.shutdown(wait=True)

    def close(self) -> None:
        for f, *_ in self._files.values():
            f.close()
        self._files.clear()

