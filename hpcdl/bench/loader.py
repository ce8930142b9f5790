"""Loader throughput: HDF5 shards + ShardedImageNet against the torchvision ``ImageFolder`` way
(open each JPEG with Pillow, convert RGB, RandomResizedCrop, flip, ToTensor, Normalize, stack:
pytorch/examples' ImageNet recipe), on the same images, in one run, one core each (torch on
one thread, loader ``workers=0``). Both sides end in the same normalised float32 NCHW batch:
the loader's uint8 batch goes through ``hpcdl.data.normalize`` as in the trainer. Images per
core is images per CPU second of the process.

Also measures sharding throughput at 1 and 2 ranks (``--shard-ranks``) by timing
``mpiexec -n P hpcdl prep shard`` on the same tree. ``--generate N`` writes a tree of N
ImageNet-like 500x375 JPEGs first. Goals: ``hdf5_vs_imagefolder`` >= 3,
``shard_ranks_2_vs_1`` >= 1.8 (on a machine with 2 free cores).
"""
from __future__ import annotations

import argparse
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

COMMAND = "loader"
HELP = "HDF5-shard loader images/s per core vs a Pillow ImageFolder baseline; sharding 1 vs 2 ranks"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--src", required=True, help="ImageNet-shaped tree (TREE/train/<class>/*)")
    parser.add_argument("--shards", required=True,
                        help="shard directory (sharded from --src first if it has no manifest)")
    parser.add_argument("--generate", type=int, default=0, metavar="N",
                        help="first write N 500x375 JPEGs into --src (10 classes) if it is empty")
    parser.add_argument("--images", type=int, default=1000, help="images timed per side")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--threads", type=int, default=0,
                        help="also time the loader with this many worker threads (0: skip)")
    parser.add_argument("--num-shards", type=int, default=8, help="train shards when sharding")
    parser.add_argument("--shard-ranks", default="1,2",
                        help="rank counts to time `prep shard` at ('' to skip)")
    parser.add_argument("--json", metavar="FILE", help="write the results here (bench JSON)")


def imagefolder_files(src: str) -> list[tuple[str, int]]:
    root = os.path.join(src, "train")
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
    return [(os.path.join(root, c, f), i) for i, c in enumerate(classes)
            for f in sorted(os.listdir(os.path.join(root, c)))]


def torchvision_rrc(width: int, height: int, rng: random.Random,
                    scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)) -> tuple[int, int, int, int]:
    """torchvision.transforms.RandomResizedCrop.get_params, as (left, top, right, bottom)."""
    area = width * height
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target = area * rng.uniform(*scale)
        aspect = math.exp(rng.uniform(*log_ratio))
        w = int(round(math.sqrt(target * aspect)))
        h = int(round(math.sqrt(target / aspect)))
        if 0 < w <= width and 0 < h <= height:
            top, left = rng.randint(0, height - h), rng.randint(0, width - w)
            return left, top, left + w, top + h
    side = min(width, height)
    left, top = (width - side) // 2, (height - side) // 2
    return left, top, left + side, top + side


def time_imagefolder(files, images: int, batch: int, size: int) -> tuple[float, float]:
    """(images per wall second, images per CPU second) of the ImageFolder pipeline."""
    import numpy as np
    import torch
    from PIL import Image

    from hpcdl.data.loader import IMAGENET_MEAN, IMAGENET_STD

    mean = torch.tensor(IMAGENET_MEAN).view(3, 1, 1)
    std = torch.tensor(IMAGENET_STD).view(3, 1, 1)
    rng = random.Random(0)
    done, start, cpu = 0, time.perf_counter(), time.process_time()
    while done < images:
        tensors, labels = [], []
        for path, label in files[done % len(files):][:batch]:
            with open(path, "rb") as f:
                img = Image.open(f).convert("RGB")
            img = img.crop(torchvision_rrc(*img.size, rng)).resize((size, size),
                                                                   Image.Resampling.BILINEAR)
            if rng.random() < 0.5:
                img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
            # ToTensor + Normalize per image, as pytorch/examples' ImageNet script does.
            chw = torch.from_numpy(np.array(img)).permute(2, 0, 1).to(torch.float32) / 255.0
            tensors.append((chw - mean) / std)
            labels.append(label)
        torch.stack(tensors), torch.tensor(labels)
        done += len(tensors)
    return done / (time.perf_counter() - start), done / (time.process_time() - cpu)


def time_sharded(shard_dir: str, images: int, batch: int, size: int,
                 workers: int) -> tuple[float, float]:
    """(images per wall second, per CPU second) of ShardedImageNet's train transform, the
    first batch excluded as warm-up."""
    from hpcdl.data import ShardedImageNet, normalize

    loader = ShardedImageNet(shard_dir, "train", batch_size=batch, image_size=size,
                             workers=workers)
    done, epoch, start, cpu = 0, 0, None, None
    while done < images:
        loader.set_epoch(epoch)
        for x, _ in loader:
            if start is None:  # warm-up: files opened, threads started
                start, cpu = time.perf_counter(), time.process_time()
                continue
            normalize(x)  # the trainer's step, so both sides end in the same float batch
            done += len(x)
            if done >= images:
                break
        epoch += 1
    loader.close()
    return done / (time.perf_counter() - start), done / (time.process_time() - cpu)


def time_prep_shard(src: str, ranks: int, num_shards: int) -> float:
    """Wall seconds of `mpiexec -n ranks hpcdl prep shard` into a fresh directory."""
    mpiexec = shutil.which("mpiexec")
    if mpiexec is None:
        raise SystemExit("hpcdl bench loader: mpiexec not found "
                         "(pip install mpich, or pass --shard-ranks '')")
    with tempfile.TemporaryDirectory(prefix="hpcdl-shard-bench-") as out:
        command = [mpiexec, "-n", str(ranks), sys.executable, "-m", "hpcdl.cli.main", "prep",
                   "shard", "--src", src, "--out", out, "--shards", str(num_shards),
                   "--no-progress"]
        start = time.perf_counter()
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        return time.perf_counter() - start


def run(args: argparse.Namespace) -> int:
    import torch

    from hpcdl.bench.report import bench_report, emit
    from hpcdl.data_prep.shard import shard_tree
    from hpcdl.data_prep.synthetic import make_imagenet_tree

    torch.set_num_threads(1)
    if args.generate and not os.path.isdir(os.path.join(args.src, "train")):
        per_class = max(1, args.generate // 10)
        print(f"writing {per_class * 10} 500x375 JPEGs to {args.src}", flush=True)
        make_imagenet_tree(args.src, num_classes=10, train_per_class=per_class, val_per_class=0,
                           size=(500, 375))
    if not os.path.isfile(os.path.join(args.shards, "manifest.json")):
        print(f"sharding {args.src} -> {args.shards}", flush=True)
        shard_tree(args.src, args.shards, args.num_shards)
    files = imagefolder_files(args.src)
    # Per core = per CPU second of this process (all its threads): on a shared machine that
    # is steadier than wall time, and it is what a core-hour budget pays for.
    results = []
    wall, per_core = time_imagefolder(files, args.images, args.batch, args.image_size)
    results.append({"name": "imagefolder_pillow", "workers": 0, "images_per_s": wall,
                    "images_per_s_per_core": per_core})
    wall, per_core = time_sharded(args.shards, args.images, args.batch, args.image_size, 0)
    results.append({"name": "hdf5_sharded", "workers": 0, "images_per_s": wall,
                    "images_per_s_per_core": per_core})
    ratios = {"hdf5_vs_imagefolder": results[1]["images_per_s_per_core"]
              / results[0]["images_per_s_per_core"]}
    if args.threads > 0:
        wall, per_core = time_sharded(args.shards, args.images, args.batch, args.image_size,
                                      args.threads)
        results.append({"name": "hdf5_sharded_threads", "workers": args.threads,
                        "images_per_s": wall, "images_per_s_per_core": per_core})
        ratios[f"threads_{args.threads}_vs_inline_wall"] = wall / results[1]["images_per_s"]
    shard_ranks = [int(r) for r in args.shard_ranks.split(",") if r.strip()]
    num_images = len(files)
    for ranks in shard_ranks:
        seconds = time_prep_shard(args.src, ranks, args.num_shards)
        results.append({"name": "prep_shard", "ranks": ranks, "images": num_images,
                        "seconds": seconds, "images_per_s": num_images / seconds})
    shard_rates = {r["ranks"]: r["images_per_s"] for r in results if r["name"] == "prep_shard"}
    if 1 in shard_rates and 2 in shard_rates:
        ratios["shard_ranks_2_vs_1"] = shard_rates[2] / shard_rates[1]
    report = bench_report("loader", results, ratios)
    emit(report, ["name", "workers", "ranks", "images_per_s", "images_per_s_per_core",
                  "seconds"], args.json)
    return 0
