"""Loader throughput: HDF5 shards + ShardedImageNet against the torchvision ``ImageFolder`` way
(Pillow decode, RandomResizedCrop, flip, ToTensor, Normalize, stack), on the same images, one
core each, both ending in the same normalised float32 NCHW batch; also ImageFolder and
WebDataset over the shards' own pre-resized JPEGs, simplejpeg's decode rate of them (the
floor of any JPEG loader) and ``hpcdl prep shard`` at 1 and 2 ranks (``--shard-ranks``).
``--generate N`` writes N ImageNet-like 500x375 JPEGs first. Goals: ``hdf5_vs_imagefolder``
>= 3, ``hdf5_vs_imagefolder_resized`` and ``hdf5_vs_webdataset`` >= 1.5,
``shard_ranks_2_vs_1`` >= 1.8. docs/performance.md, "Loader".

``--pace STEP.json ...`` measures instead whether decode keeps pace with the bf16 step
(:mod:`hpcdl.bench.pace`; docs/data.md, "Decode threads per compute core").
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
    parser.add_argument("--no-resized-baselines", action="store_true",
                        help="skip ImageFolder and WebDataset over the shards' pre-resized JPEGs")
    parser.add_argument("--pace", nargs="+", metavar="STEP_JSON",
                        help="instead: decode rate per worker thread, and data wait of ranks "
                             "consuming at each file's bf16 step rate (docs/results/"
                             "bf16-step-vs-plain-torch-*/MODEL.json)")
    parser.add_argument("--pace-workers", default="0,1,2",
                        help="--pace: decode threads per rank to try (must include 1)")
    parser.add_argument("--pace-seconds", type=float, default=4.0,
                        help="--pace: seconds timed per configuration")
    parser.add_argument("--pace-repeats", type=int, default=1,
                        help="--pace: run every configuration this many times, in rotated order")
    parser.add_argument("--note", default="",
                        help="a line kept in the JSON (say whether the machine was shared)")
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


def pil_train_transform(size: int, rng: random.Random):
    """torchvision's ImageNet train transform on a PIL image (RandomResizedCrop, flip, ToTensor,
    Normalize per image, as pytorch/examples' ImageNet script does), without torchvision."""
    import numpy as np
    import torch
    from PIL import Image

    from hpcdl.data.loader import IMAGENET_MEAN, IMAGENET_STD

    mean = torch.tensor(IMAGENET_MEAN).view(3, 1, 1)
    std = torch.tensor(IMAGENET_STD).view(3, 1, 1)

    def transform(img):
        img = img.convert("RGB")
        img = img.crop(torchvision_rrc(*img.size, rng)).resize((size, size),
                                                               Image.Resampling.BILINEAR)
        if rng.random() < 0.5:
            img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        chw = torch.from_numpy(np.array(img)).permute(2, 0, 1).to(torch.float32) / 255.0
        return (chw - mean) / std

    return transform


def time_imagefolder(files, images: int, batch: int, size: int) -> tuple[float, float]:
    """(images per wall second, images per CPU second) of the ImageFolder pipeline."""
    import torch
    from PIL import Image

    transform = pil_train_transform(size, random.Random(0))
    done, start, cpu = 0, time.perf_counter(), time.process_time()
    while done < images:
        tensors, labels = [], []
        for path, label in files[done % len(files):][:batch]:
            with open(path, "rb") as f:
                tensors.append(transform(Image.open(f)))
            labels.append(label)
        torch.stack(tensors), torch.tensor(labels)
        done += len(tensors)
    return done / (time.perf_counter() - start), done / (time.process_time() - cpu)


def stored_train_jpegs(shard_dir: str):
    """Yield (key, class name, label, JPEG bytes) of every stored train image, shard by shard."""
    import h5py

    from hpcdl.data.format import read_manifest, split_shards

    manifest = read_manifest(shard_dir)
    if manifest.get("image_format") != "jpeg":
        raise SystemExit(f"hpcdl bench loader: {shard_dir} stores {manifest.get('image_format')}"
                         " images; the fair baselines need JPEG shards (prep shard's default)")
    classes = manifest["classes"]
    for entry in split_shards(manifest, "train"):
        with h5py.File(os.path.join(shard_dir, entry["name"]), "r") as f:
            for key, label, data in zip(f["keys"].asstr()[:], f["labels"][:], f["images"],
                                        strict=True):
                yield key, classes[int(label)], int(label), data.tobytes()


def export_resized_baselines(shard_dir: str, out: str) -> tuple[str, list[str]]:
    """Write the shards' pre-resized JPEGs, byte for byte, as an ImageFolder tree
    (``out/tree/train/<class>/``) and as WebDataset tar shards (``out/wds/``, one per HDF5
    shard-sized group of 1,000), so all three loaders read the same bytes."""
    import webdataset as wds

    tree, tars = os.path.join(out, "tree"), os.path.join(out, "wds")
    os.makedirs(tars, exist_ok=True)
    with wds.ShardWriter(os.path.join(tars, "train-%05d.tar"), maxcount=1000,
                         verbose=0) as sink:
        for key, class_name, label, jpeg in stored_train_jpegs(shard_dir):
            folder = os.path.join(tree, "train", class_name)
            os.makedirs(folder, exist_ok=True)
            name = os.path.basename(key).rsplit(".", 1)[0]
            with open(os.path.join(folder, f"{name}.jpg"), "wb") as f:
                f.write(jpeg)
            sink.write({"__key__": f"{class_name}/{name}", "jpg": jpeg, "cls": label})
    return tree, sorted(os.path.join(tars, t) for t in os.listdir(tars))


def time_webdataset(urls: list[str], images: int, batch: int, size: int) -> tuple[float, float]:
    """(images per wall second, per CPU second) of WebDataset's own pipeline: tar shards read
    sequentially, ``decode("pil")``, the same train transform, ``batched`` collation."""
    import webdataset as wds

    transform = pil_train_transform(size, random.Random(0))
    pipeline = (wds.WebDataset(urls, shardshuffle=False, empty_check=False)
                .decode("pil").to_tuple("jpg", "cls").map_tuple(transform, int)
                .batched(batch, partial=True))
    done, start, cpu = 0, time.perf_counter(), time.process_time()
    while done < images:
        for x, _ in pipeline:
            done += len(x)
            if done >= images:
                break
    return done / (time.perf_counter() - start), done / (time.process_time() - cpu)


def time_simplejpeg_decode(shard_dir: str, images: int) -> float:
    """simplejpeg's decode of the stored JPEGs alone, images per CPU second: the floor."""
    import simplejpeg

    stored = [jpeg for _, _, _, jpeg in stored_train_jpegs(shard_dir)]
    done, cpu = 0, time.process_time()
    while done < images:
        for jpeg in stored[:images - done]:
            simplejpeg.decode_jpeg(jpeg, colorspace="RGB")
            done += 1
    return done / (time.process_time() - cpu)


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


def resized_baselines(args: argparse.Namespace) -> list[dict]:
    """ImageFolder and WebDataset over the shards' own pre-resized JPEGs, and the decode floor."""
    try:
        import webdataset  # noqa: F401
    except ImportError:
        raise SystemExit("hpcdl bench loader: the WebDataset baseline needs `pip install "
                         "'hpcdl[bench]'` (or pass --no-resized-baselines)") from None
    results = []
    with tempfile.TemporaryDirectory(prefix="hpcdl-loader-baselines-") as work:
        tree, tars = export_resized_baselines(args.shards, work)
        wall, per_core = time_imagefolder(imagefolder_files(tree), args.images, args.batch,
                                          args.image_size)
        results.append({"name": "imagefolder_pillow_resized", "workers": 0,
                        "images_per_s": wall, "images_per_s_per_core": per_core})
        wall, per_core = time_webdataset(tars, args.images, args.batch, args.image_size)
        results.append({"name": "webdataset_pil_resized", "workers": 0, "images_per_s": wall,
                        "images_per_s_per_core": per_core})
    results.append({"name": "simplejpeg_decode_only", "workers": 0,
                    "images_per_s_per_core": time_simplejpeg_decode(args.shards, args.images)})
    return results


def prepare_shards(args: argparse.Namespace) -> None:
    """The --src tree (written first with --generate) and its shards in --shards."""
    from hpcdl.data_prep.shard import shard_tree
    from hpcdl.data_prep.synthetic import make_imagenet_tree

    if not args.generate and not os.path.isdir(os.path.join(args.src, "train")):
        raise SystemExit(f"hpcdl bench loader: --src {args.src}: no train/ folder; expected "
                         f"TREE/train/<class>/*.JPEG, or add --generate N to write one there")
    if args.generate and not os.path.isdir(os.path.join(args.src, "train")):
        per_class = max(1, args.generate // 10)
        print(f"writing {per_class * 10} 500x375 JPEGs to {args.src}", flush=True)
        make_imagenet_tree(args.src, num_classes=10, train_per_class=per_class, val_per_class=0,
                           size=(500, 375))
    if not os.path.isfile(os.path.join(args.shards, "manifest.json")):
        print(f"sharding {args.src} -> {args.shards}", flush=True)
        shard_tree(args.src, args.shards, args.num_shards)


def run_pace(args: argparse.Namespace) -> int:
    """--pace: the decode sweep and the paced ranks, one JSON (hpcdl.bench.pace)."""
    from hpcdl.bench.pace import load_average, measure, step_rate
    from hpcdl.results import bench_report, emit

    steps = [step_rate(path) for path in args.pace]  # bad input stops before any work
    try:
        workers = [int(w) for w in args.pace_workers.split(",") if w.strip()]
    except ValueError:
        raise SystemExit(f"hpcdl bench loader: --pace-workers {args.pace_workers!r}: expected "
                         f"counts like 0,1,2") from None
    prepare_shards(args)
    start_load = load_average()
    records, ratios = measure(args.shards, steps, workers, args.pace_seconds, args.batch,
                              args.image_size, args.pace_repeats)
    report = bench_report("loader-pace", records, ratios)
    report.update(step_rates=steps, note=args.note,
                  load_average={"start": start_load, "end": load_average()})
    emit(report, ["repeat", "kind", "model", "layout", "workers", "images_per_cpu_s",
                  "data_wait_fraction", "delivered_vs_step"], args.json)
    return 0


def run(args: argparse.Namespace) -> int:
    import torch

    from hpcdl.results import bench_report, emit

    torch.set_num_threads(1)
    if args.pace:
        return run_pace(args)
    prepare_shards(args)
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
    if not args.no_resized_baselines:
        results += resized_baselines(args)
        rate = {r["name"]: r.get("images_per_s_per_core") for r in results}
        ratios["hdf5_vs_imagefolder_resized"] = (rate["hdf5_sharded"]
                                                 / rate["imagefolder_pillow_resized"])
        ratios["hdf5_vs_webdataset"] = rate["hdf5_sharded"] / rate["webdataset_pil_resized"]
        ratios["hdf5_fraction_of_decode"] = rate["hdf5_sharded"] / rate["simplejpeg_decode_only"]
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
    if args.note:
        report["note"] = args.note
    emit(report, ["name", "workers", "ranks", "images_per_s", "images_per_s_per_core",
                  "seconds"], args.json)
    return 0
