"""Decode + augment one stored image into a fixed-size uint8 HxWx3 array.

Randomness is a pure function of (seed, epoch, global sample index): a counter-based hash
(SplitMix64) gives each sample its own uniform draws, whichever worker thread decodes it. The
transforms (Inception's RandomResizedCrop and a flip; the validation centre crop) and how they
are computed: docs/data.md, "Transforms".

Caffe's input, the LARS papers' AlexNets' (BVLC/caffe create_imagenet.sh 256×256, train_val
``crop_size: 227``, ``mirror: true``): resized to ``resize``² (``caffe_square``, aspect not
kept) or short side ``resize`` (``caffe_short_side``), then a uniform ``image_size`` crop and a
flip; val the centre crop. Resize and crop are one box (:func:`caffe_crop_boxes`): one resize.
"""
from __future__ import annotations

import math

import numpy as np

DRAWS_PER_ATTEMPT = 4        # area scale, log aspect ratio, top, left
ATTEMPTS = 10                # torchvision's RandomResizedCrop tries 10 times, then centre-crops
FLIP_DRAW = ATTEMPTS * DRAWS_PER_ATTEMPT
NUM_DRAWS = FLIP_DRAW + 1


def splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser on uint64 arrays (wrapping arithmetic)."""
    x = x.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def sample_uniforms(seed: int, epoch: int, sample_index: np.ndarray,
                    num_draws: int = NUM_DRAWS) -> np.ndarray:
    """(len(sample_index), num_draws) uniforms in [0, 1), a function of the three keys only."""
    with np.errstate(over="ignore"):
        key = splitmix64(np.array([seed], dtype=np.uint64))
        key = splitmix64(key ^ np.array([epoch], dtype=np.uint64))
        idx = splitmix64(key ^ np.asarray(sample_index, dtype=np.uint64))
        counters = idx[:, None] ^ splitmix64(np.arange(num_draws, dtype=np.uint64))[None, :]
        bits = splitmix64(counters)
    return (bits >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def random_resized_crop_boxes(heights: np.ndarray, widths: np.ndarray, u: np.ndarray,
                              scale: tuple[float, float] = (0.08, 1.0),
                              ratio: tuple[float, float] = (3 / 4, 4 / 3)) -> np.ndarray:
    """(n, 4) int64 rows (top, left, h, w): torchvision's RandomResizedCrop rule (10 attempts
    at a random area fraction and log-uniform aspect ratio, else the largest centre crop within
    the ratios), evaluated for a whole batch at once from each sample's uniforms ``u``."""
    heights = np.asarray(heights, dtype=np.int64)
    widths = np.asarray(widths, dtype=np.int64)
    draws = u[:, :ATTEMPTS * DRAWS_PER_ATTEMPT].reshape(len(u), ATTEMPTS, DRAWS_PER_ATTEMPT)
    area = (heights * widths).astype(np.float64)[:, None]
    target = area * (scale[0] + draws[..., 0] * (scale[1] - scale[0]))
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    aspect = np.exp(log_lo + draws[..., 1] * (log_hi - log_lo))
    w = np.rint(np.sqrt(target * aspect)).astype(np.int64)
    h = np.rint(np.sqrt(target / aspect)).astype(np.int64)
    fits = (w > 0) & (w <= widths[:, None]) & (h > 0) & (h <= heights[:, None])
    first = fits.argmax(axis=1)
    rows = np.arange(len(u))
    h, w = h[rows, first], w[rows, first]
    top = (draws[rows, first, 2] * (heights - h + 1)).astype(np.int64)
    left = (draws[rows, first, 3] * (widths - w + 1)).astype(np.int64)
    boxes = np.stack([top, left, h, w], axis=1)
    for i in np.flatnonzero(~fits.any(axis=1)):  # rare: extreme aspect ratios
        boxes[i] = centre_fallback_box(int(heights[i]), int(widths[i]), ratio)
    return boxes


def centre_fallback_box(height: int, width: int,
                        ratio: tuple[float, float]) -> tuple[int, int, int, int]:
    """RandomResizedCrop's fallback: the largest centre crop whose aspect is within ``ratio``."""
    in_ratio = width / height
    if in_ratio < ratio[0]:
        w, h = width, int(round(width / ratio[0]))
    elif in_ratio > ratio[1]:
        h, w = height, int(round(height * ratio[1]))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def centre_crop_box(height: int, width: int, image_size: int) -> tuple[float, float, float, float]:
    """(top, left, h, w) in source pixels: resize short side to image_size*256/224, centre-crop."""
    resize = image_size * 256 / 224
    side = image_size * min(height, width) / resize
    return (height - side) / 2, (width - side) / 2, side, side


def decode(data: np.ndarray, shape: tuple[int, int, int], image_format: str,
           min_height: int, min_width: int) -> np.ndarray:
    """Stored bytes -> HxWx3 uint8; JPEGs at the smallest DCT scale >= (min_height, min_width)."""
    if image_format == "raw":
        return data.reshape(shape)
    import simplejpeg

    return simplejpeg.decode_jpeg(data.tobytes(), colorspace="RGB", fastdct=True,
                                  fastupsample=True, min_height=min_height, min_width=min_width)


def crop_resize(data: np.ndarray, shape: tuple[int, int, int], image_format: str,
                box: tuple[float, float, float, float], image_size: int, flip: bool, out) -> None:
    """Decode, crop ``box`` (top, left, h, w in stored pixels), resize to image_size^2 into
    ``out`` (a 3 x image_size x image_size uint8 tensor: a batch slot), flip if asked.

    The resize is torch's uint8 bilinear kernel written straight into the batch, antialiased
    when shrinking (Pillow's filter, as torchvision's v2 transforms use)."""
    import torch

    height, width = int(shape[0]), int(shape[1])
    top, left, h, w = box
    # Smallest decode that keeps the crop >= image_size on both sides (never upscale decode).
    factor = min(1.0, max(image_size / h, image_size / w))
    rgb = decode(data, (height, width, 3), image_format,
                 math.ceil(height * factor), math.ceil(width * factor))
    sy, sx = rgb.shape[0] / height, rgb.shape[1] / width
    y0, x0 = int(round(top * sy)), int(round(left * sx))
    y1 = max(y0 + 1, min(rgb.shape[0], int(round((top + h) * sy))))
    x1 = max(x0 + 1, min(rgb.shape[1], int(round((left + w) * sx))))
    crop = torch.from_numpy(rgb).permute(2, 0, 1)[None, :, y0:y1, x0:x1]
    # Antialiasing matters only when shrinking; plain bilinear is the same filter when
    # enlarging (most RandomResizedCrops of a 256-pixel image), and cheaper.
    shrink = y1 - y0 > image_size or x1 - x0 > image_size
    resize = (torch.ops.aten._upsample_bilinear2d_aa.out if shrink
              else torch.ops.aten.upsample_bilinear2d.out)
    resize(crop, [image_size, image_size], False, None, None, out=out[None])
    if flip:  # one image's flip is cheap; a masked flip of the whole batch is not
        out.copy_(out.flip(-1))


CAFFE_CROPS = ("caffe_square", "caffe_short_side")


def caffe_crop_boxes(heights: np.ndarray, widths: np.ndarray, u: np.ndarray | None,
                     image_size: int, resize: int, square: bool) -> list[tuple[float, ...]]:
    """(top, left, h, w) in stored pixels of Caffe's crop: resize the stored image to
    ``resize``² (``square``) or short side ``resize``, take an ``image_size`` crop at an offset
    drawn uniformly from the integer positions (Caffe's DataTransformer: ``Rand(h - crop + 1)``)
    from ``u[:, 0]``/``u[:, 1]``, or the centre (val) when ``u`` is None."""
    if image_size > resize:
        raise ValueError(f"caffe crop: image_size {image_size} is larger than the resize "
                         f"{resize}; set data.val_resize >= data.image_size")
    boxes = []
    for i, (h, w) in enumerate(zip(np.asarray(heights).tolist(), np.asarray(widths).tolist(),
                                   strict=True)):
        sy = resize / h if square else resize / min(h, w)
        sx = resize / w if square else sy
        room_y, room_x = round(h * sy) - image_size, round(w * sx) - image_size
        if u is None:
            top, left = room_y // 2, room_x // 2
        else:
            top = min(int(u[i, 0] * (room_y + 1)), room_y)
            left = min(int(u[i, 1] * (room_x + 1)), room_x)
        boxes.append((top / sy, left / sx, image_size / sy, image_size / sx))
    return boxes
