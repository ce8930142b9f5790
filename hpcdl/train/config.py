"""Recipes: YAML files validated into dataclasses, with ``key=value`` overrides.

A recipe names the model, optimizer, schedule, batch, epochs and data options as data; the
trainer never branches on a recipe's name. The schema is the one in
docs/architecture.md. Unknown and missing keys are reported by their dotted name with the
file, so a typo such as ``batch.per_rnak`` fails before any rank touches data.

The ``model``, ``optimizer`` and ``schedule`` sections carry keys specific to the named
model/optimizer/schedule; they are kept as dicts and validated by the factory that consumes
them (hpcdl.models.create_model, hpcdl.optim.create_optimizer / create_schedule).
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib.resources
import logging
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

from hpcdl.buckets import DEFAULT_BUCKET_MB, DEFAULT_TRIAL_S, bucket_bytes
from hpcdl.errors import BadInputError
from hpcdl.io import atomic_write_text

__all__ = ["Config", "PRECISIONS", "RecipeError", "WIRE_DTYPES", "load_recipe",
           "parse_overrides", "resolve_precision", "resolve_recipe", "shipped_recipes",
           "resolve_batch", "elastic_batch", "rank_counts",
           "write_resolved_config", "config_from_dict"]


log = logging.getLogger("hpcdl.train.config")


class RecipeError(BadInputError, ValueError):
    """A recipe (or an override of it) does not match the schema."""


class _RecipeLoader(yaml.SafeLoader):
    """YAML 1.1 reads ``1e-3`` (no dot) as a string; recipes and overrides mean a number."""


_RecipeLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
                  |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
                  |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
                  |[-+]?\.(?:inf|Inf|INF)
                  |\.(?:nan|NaN|NAN))$""", re.X),
    list("-+0123456789."))


def _yaml_load(text_or_file: Any) -> Any:
    return yaml.load(text_or_file, Loader=_RecipeLoader)  # noqa: S506 - a SafeLoader subclass


@dataclass
class DataConfig:
    image_size: int = 224        # side of the square training crop, px
    val_resize: int = 256        # validation: short side resized to this, then center-cropped
    min_scale: float = 0.08      # random_resized: smallest share of the image's area cropped
    # Decode threads per rank, each given a core of its own by the sbatch templates. One
    # thread decodes what tens of cores' bf16 steps consume (docs/data.md, "Decode threads
    # per compute core", the measured table; tests/test_loader_pace.py holds this default to
    # it): one feeds the skx template's socket, the second is room for photographs, which may
    # decode slower than the measured synthetic JPEGs, and for larger sockets.
    workers: int = 2
    rotate_shards: bool = False  # a node reads other shards each epoch (all staged on it)
    # Train crop: random_resized (Inception/torchvision, min_scale..1), or Caffe's fixed-size
    # crop after resizing to val_resize² (caffe_square) or short side val_resize
    # (caffe_short_side), hpcdl.data.augment.caffe_crop_boxes.
    crop: str = "random_resized"
    # imagenet: (x/255 - mean)/std; caffe_mean: (x - mean) * input_scale (Caffe's transform).
    normalize: str = "imagenet"
    input_scale: float = 1.0


@dataclass
class BatchConfig:
    # Required: the published global batch is what a recipe reproduces.
    global_: int = dataclasses.field(default=0, metadata={"key": "global", "required": True})
    per_rank: int | None = None   # None: derived as global / (ranks * accumulation)
    accumulation: int = 1


@dataclass
class TrainConfig:
    seed: int = 0
    label_smoothing: float = 0.0
    eval_every_epochs: int = 1
    checkpoint_every_steps: int = 0
    keep_checkpoints: int = 3
    log_every_steps: int = 10
    # true | false | auto (hpcdl.cpus.memory_format_name: auto is channels_last for a
    # bfloat16 step on >= 2 threads, for a model oneDNN can train in it); a recipe that
    # omits the key trains contiguous.
    channels_last: bool | str = False
    # The compute dtype, float32 | auto | bfloat16 (resolve_precision; docs/training.md,
    # "Precision"): a recipe that omits the key trains in float32, the shipped ones say auto.
    precision: str = "float32"
    # Goyal et al. (arXiv:1706.02677 §2.2): rescale the momentum buffer by lr(t)/lr(t-1)
    # for optimizers whose buffer holds lr·g (LARS); a no-op for torch's SGD.
    momentum_correction: bool = False
    # The run's optimizer steps when the source gives them rather than epochs (Caffe's
    # max_iter: NVCaffe's 32K solver runs 4,000 steps, 102.4 epochs of ImageNet at 39 steps
    # per epoch); null: epochs x steps per epoch. The schedule's decay spans these steps.
    total_steps: int | None = None


#: hpcdl.comm.policy.ALGORITHMS, spelled here so reading a recipe does not initialise MPI
CONSISTENCY_ALGORITHMS = ("sync", "local_sgd", "hierarchical_local_sgd", "powersgd")


@dataclass
class CommConfig:
    # auto: chosen by a timed trial at start (hpcdl/comm/trial.py), rule: hpcdl.comm's rule,
    # or a backend's name (docs/comm.md)
    backend: str = "auto"
    bucket_mb: float = DEFAULT_BUCKET_MB   # MiB; checked in validate (comm.bucket_mb > 0)
    # The gradients' dtype on the wire, auto | float32 | bfloat16 (hpcdl.train.precision)
    wire_dtype: str = "auto"
    # How replicas stay consistent (hpcdl/comm/policy.py, docs/comm.md): sync,
    # local_sgd, hierarchical_local_sgd or powersgd.
    algorithm: str = "sync"
    local_steps: int = 1          # H: steps between model averages (local SGD)
    sync_warmup_steps: int = 0    # synchronous steps first (post-local SGD; PowerSGD's start)
    powersgd_rank: int = 4        # r of the PowerSGD factors
    # Weight-update sharding (hpcdl/optim/sharded.py, Xu et al. 2020): reduce-scatter the
    # gradients, each rank steps its slice, allgather the parameters. sync only.
    shard_update: bool = False
    # Update each bucket's parameters as soon as its average arrives, while the later
    # buckets (the first layers') are still on the wire: LARS and sgd, whose step is per
    # tensor (docs/comm.md, "The overlapped update"); false: every bucket, then one step.
    overlap_update: bool = True
    # backend: auto's start-up trial: at most this many seconds (0: the rule decides), and
    # whether it also tries other bucket sizes and no first-layers bucket
    trial_s: float = DEFAULT_TRIAL_S
    trial_buckets: bool = True

    def __post_init__(self) -> None:
        if self.trial_s < 0:
            raise RecipeError(f"comm.trial_s={self.trial_s}: must be >= 0 (0: no trial, "
                              f"the rule decides)")
        if self.algorithm not in CONSISTENCY_ALGORITHMS:
            raise RecipeError(f"comm.algorithm={self.algorithm!r}: choose one of "
                              f"{', '.join(CONSISTENCY_ALGORITHMS)}")
        for key in ("local_steps", "powersgd_rank"):
            if getattr(self, key) < 1:
                raise RecipeError(f"comm.{key}={getattr(self, key)}: must be >= 1")
        if self.shard_update and self.algorithm != "sync":
            raise RecipeError(f"comm.shard_update: true needs comm.algorithm: sync (got "
                              f"comm.algorithm={self.algorithm!r}): {self.algorithm} does not "
                              f"average every gradient every step, so there is no allreduce "
                              f"to split around the update; set one of the two keys")
        if self.shard_update and self.wire_dtype == "bfloat16":
            raise RecipeError(f"comm.shard_update: true needs comm.wire_dtype: float32 (got "
                              f"{self.wire_dtype!r}): the sharded reduce-scatter and the "
                              f"parameter allgather run in the parameters' dtype; set one of "
                              f"the two keys")
        if self.sync_warmup_steps < 0:
            raise RecipeError(f"comm.sync_warmup_steps={self.sync_warmup_steps}: must be >= 0")

    @property
    def bucket_bytes(self) -> int:
        """``bucket_mb`` in bytes: the one conversion between the recipe and the communicator
        (hpcdl/train/session.py opens it with this; the trainer's reducer takes the same)."""
        return bucket_bytes(self.bucket_mb)


@dataclass
class Config:
    """A validated recipe. ``model``/``optimizer``/``schedule`` are dicts with a ``name``."""

    name: str
    model: dict[str, Any]
    epochs: float
    optimizer: dict[str, Any]
    schedule: dict[str, Any]
    batch: BatchConfig
    source: str = ""
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    # What the source reports: {top1: 0..1, source: citation, checked: bool}; hpcdl report
    # prints the measured top-1 against it.
    expected: dict[str, Any] = field(default_factory=dict)
    # Where the source ran it, for `hpcdl plan --recipe` ({machine: skx, procs: 2048}); the
    # trainer never reads it.
    plan: dict[str, Any] = field(default_factory=dict)
    path: str = ""  # the file it came from (not part of the schema; for messages)

    def to_dict(self) -> dict[str, Any]:
        """The resolved recipe in the schema's order (what RUN_DIR/config.yaml holds)."""
        return {
            "name": self.name,
            "source": self.source,
            "model": dict(self.model),
            "data": _section_to_dict(self.data),
            "batch": _section_to_dict(self.batch),
            "epochs": int(self.epochs) if float(self.epochs).is_integer() else self.epochs,
            "optimizer": dict(self.optimizer),
            "schedule": dict(self.schedule),
            "train": _section_to_dict(self.train),
            "comm": _section_to_dict(self.comm),
            **({"expected": dict(self.expected)} if self.expected else {}),
            **({"plan": dict(self.plan)} if self.plan else {}),
        }


# Sections that are dataclasses, and the free-form sections (a dict that must name something).
_SECTIONS = {"data": DataConfig, "batch": BatchConfig, "train": TrainConfig, "comm": CommConfig}
_NAMED_SECTIONS = ("model", "optimizer", "schedule")
_TOP_LEVEL = ("name", "source", "model", "data", "batch", "epochs", "optimizer", "schedule",
              "train", "comm", "expected", "plan")
_REQUIRED_TOP = ("name", "model", "batch", "epochs", "optimizer", "schedule")


def _key_of(f: dataclasses.Field) -> str:
    return f.metadata.get("key", f.name)


def _section_to_dict(section: Any) -> dict[str, Any]:
    return {_key_of(f): getattr(section, f.name) for f in dataclasses.fields(section)}


def _coerce(value: Any, annotation: str, where: str) -> Any:
    """Check a scalar against the field's annotation; ints are accepted where floats are."""
    optional = "None" in annotation
    if value is None:
        if optional:
            return None
        raise RecipeError(f"{where}: null is not allowed (expected {annotation})")
    base = annotation.replace("| None", "").strip()
    if base == "bool":
        if isinstance(value, bool):
            return value
    elif base == "int":
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif base == "float":
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif base == "str":
        if isinstance(value, str):
            return value
    elif base == "bool | str":
        if isinstance(value, (bool, str)):
            return value
    else:  # pragma: no cover - every schema field has one of the types above
        return value
    raise RecipeError(f"{where}: expected {base}, got {value!r} ({type(value).__name__})")


def _build_section(cls: type, raw: Any, section: str, origin: str) -> Any:
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise RecipeError(f"{origin}: '{section}' must be a mapping, got {raw!r}")
    fields = {_key_of(f): f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        names = ", ".join(f"{section}.{k}" for k in unknown)
        raise RecipeError(f"{origin}: unknown key(s) {names}; known: "
                          f"{', '.join(f'{section}.{k}' for k in fields)}")
    kwargs = {}
    for key, f in fields.items():
        if key in raw:
            kwargs[f.name] = _coerce(raw[key], str(f.type), f"{origin}: {section}.{key}")
        elif f.metadata.get("required"):
            raise RecipeError(f"{origin}: missing required key {section}.{key}")
    return cls(**kwargs)


def _named_section(raw: Any, section: str, origin: str) -> dict[str, Any]:
    if not isinstance(raw, Mapping):
        raise RecipeError(f"{origin}: '{section}' must be a mapping with a 'name', got {raw!r}")
    if "name" not in raw or not isinstance(raw["name"], str):
        raise RecipeError(f"{origin}: missing required key {section}.name")
    return dict(raw)


def config_from_dict(raw: Mapping[str, Any], origin: str = "<recipe>") -> Config:
    """Validate a recipe dict (as read from YAML) into a :class:`Config`."""
    if not isinstance(raw, Mapping):
        raise RecipeError(f"{origin}: a recipe is a mapping of sections, got {type(raw).__name__}")
    unknown = sorted(set(raw) - set(_TOP_LEVEL))
    if unknown:
        raise RecipeError(f"{origin}: unknown key(s) {', '.join(unknown)}; known: "
                          f"{', '.join(_TOP_LEVEL)}")
    for key in _REQUIRED_TOP:
        if key not in raw:
            raise RecipeError(f"{origin}: missing required key {key}")
    name = _coerce(raw["name"], "str", f"{origin}: name")
    epochs = _coerce(raw["epochs"], "float", f"{origin}: epochs")
    if epochs <= 0:
        raise RecipeError(f"{origin}: epochs must be > 0, got {epochs}")
    named = {s: _named_section(raw[s], s, origin) for s in _NAMED_SECTIONS}
    raw = {**raw, "train": _renamed_train_keys(raw.get("train"), origin)}
    sections = {s: _build_section(cls, raw.get(s), s, origin) for s, cls in _SECTIONS.items()}
    config = Config(name=name, source=_coerce(raw.get("source") or "", "str", f"{origin}: source"),
                    epochs=epochs, path=origin, expected=_expected(raw.get("expected"), origin),
                    plan=_plan(raw.get("plan"), origin), **named, **sections)
    _check_values(config, origin)
    return config


def _plan(raw: Any, origin: str) -> dict[str, Any]:
    """The ``plan`` section: the machine (a name ``hpcdl plan --machine`` takes) and rank count
    the source ran on."""
    if raw is None:
        return {}
    if not isinstance(raw, Mapping) or set(raw) - {"machine", "procs"}:
        raise RecipeError(f"{origin}: 'plan' is a mapping {{machine, procs}}, got {raw!r}")
    found = {key: _coerce(raw[key], kind, f"{origin}: plan.{key}")
             for key, kind in (("machine", "str"), ("procs", "int")) if key in raw}
    if found.get("procs", 1) < 1:
        raise RecipeError(f"{origin}: plan.procs must be >= 1, got {found['procs']}")
    return found


def _expected(raw: Any, origin: str) -> dict[str, Any]:
    """The ``expected`` section: the top-1 the recipe's source reports, with its citation."""
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise RecipeError(f"{origin}: 'expected' must be a mapping {{top1, source, checked}}")
    unknown = sorted(set(raw) - {"top1", "source", "checked"})
    if unknown:
        raise RecipeError(f"{origin}: unknown key(s) {', '.join(f'expected.{k}' for k in unknown)}"
                          f"; known: expected.top1, expected.source, expected.checked")
    top1 = _coerce(raw.get("top1"), "float", f"{origin}: expected.top1")
    if not 0.0 < top1 <= 1.0:
        raise RecipeError(f"{origin}: expected.top1 is a fraction in (0, 1], got {top1}")
    source = _coerce(raw.get("source"), "str", f"{origin}: expected.source")
    if not source.strip():
        raise RecipeError(f"{origin}: expected.source must cite where top1 comes from")
    checked = _coerce(raw.get("checked", False), "bool", f"{origin}: expected.checked")
    return {"top1": top1, "source": source, "checked": checked}


#: The smallest value of each integer key the schema bounds.
_LEAST = {"batch.global": 1, "batch.per_rank": 1, "batch.accumulation": 1,
          "train.checkpoint_every_steps": 0, "train.eval_every_epochs": 0, "train.total_steps": 1,
          "train.keep_checkpoints": 1, "train.log_every_steps": 1}


def _check_values(config: Config, origin: str) -> None:
    """Ranges a type check cannot catch."""
    for dotted, least in _LEAST.items():
        section, key = dotted.split(".")
        value = _section_to_dict(getattr(config, section))[key]
        if value is not None and value < least:  # (null: an optional key left to its rule)
            raise RecipeError(f"{origin}: {dotted} must be >= {least}, got {value}")
    if config.data.crop not in ("random_resized", "caffe_square", "caffe_short_side"):
        raise RecipeError(f"{origin}: data.crop must be random_resized, caffe_square or "
                          f"caffe_short_side, got {config.data.crop!r}")
    if config.data.normalize not in ("imagenet", "caffe_mean") or config.data.input_scale <= 0:
        raise RecipeError(f"{origin}: data.normalize must be imagenet or caffe_mean and "
                          f"data.input_scale > 0, got {config.data.normalize!r}, "
                          f"{config.data.input_scale}")
    if config.comm.bucket_mb <= 0:
        raise RecipeError(f"{origin}: comm.bucket_mb must be > 0, got {config.comm.bucket_mb}")
    if config.comm.wire_dtype not in WIRE_DTYPES:
        raise RecipeError(f"{origin}: comm.wire_dtype must be one of {', '.join(WIRE_DTYPES)}, "
                          f"got {config.comm.wire_dtype!r}")
    if isinstance(config.train.channels_last, str) and config.train.channels_last != "auto":
        raise RecipeError(f"{origin}: train.channels_last must be true, false or auto, "
                          f"got {config.train.channels_last!r}")
    if config.train.precision not in PRECISIONS:
        raise RecipeError(f"{origin}: train.precision must be one of {', '.join(PRECISIONS)}, "
                          f"got {config.train.precision!r}")


#: train.precision's values and comm.wire_dtype's
PRECISIONS = ("auto", "float32", "bfloat16")
WIRE_DTYPES = ("auto", "float32", "bfloat16")


def resolve_precision(requested: str, native_bf16: bool) -> str:
    """The compute dtype a run uses: ``auto`` is ``bfloat16`` where bf16 is native
    (hpcdl.cpus.bf16_native), else ``float32``; the other two are themselves."""
    if requested == "auto":
        return "bfloat16" if native_bf16 else "float32"
    return requested


def _renamed_train_keys(raw: Any, origin: str) -> Any:
    """``train.bf16`` / ``train.bf16_emulated`` (recipes and run directories written before
    ``train.precision``) -> ``train.precision`` with the meaning they had: bf16 where native
    and float32 elsewhere is ``auto``; bf16 even where emulated is ``bfloat16``."""
    if not isinstance(raw, Mapping) or not {"bf16", "bf16_emulated"} & set(raw):
        return raw
    if "precision" in raw:
        raise RecipeError(f"{origin}: train.bf16 and train.bf16_emulated are replaced by "
                          f"train.precision; give only train.precision")
    train = dict(raw)
    bf16 = _coerce(train.pop("bf16", False), "bool", f"{origin}: train.bf16")
    emulated = _coerce(train.pop("bf16_emulated", False), "bool", f"{origin}: train.bf16_emulated")
    train["precision"] = ("bfloat16" if emulated else "auto") if bf16 else "float32"
    log.warning("%s: train.bf16=%s (train.bf16_emulated=%s) is read as train.precision: %s; "
                "the old keys will go", origin, bf16, emulated, train["precision"])
    return train


def parse_overrides(overrides: Iterable[str]) -> list[tuple[list[str], Any]]:
    """``a.b=value`` -> (["a", "b"], value parsed as a YAML scalar: 32, 1e-3, true, null)."""
    parsed = []
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise RecipeError(f"override {item!r}: expected KEY=VALUE, e.g. batch.per_rank=32")
        try:
            value = _yaml_load(text) if text.strip() else None
        except yaml.YAMLError as exc:
            raise RecipeError(f"override {item!r}: value is not valid YAML ({exc})") from None
        parsed.append((key.strip().split("."), value))
    return parsed


def _apply_override(raw: dict[str, Any], keys: list[str], value: Any, item: str) -> None:
    node = raw
    for depth, key in enumerate(keys[:-1]):
        child = node.get(key)
        if child is None:
            child = node[key] = {}
        if not isinstance(child, dict):
            raise RecipeError(f"override {item}: {'.'.join(keys[:depth + 1])} is a value, "
                              f"not a section")
        node = child
    node[keys[-1]] = value


def shipped_recipes() -> list[str]:
    """Names of the recipes installed with hpcdl (``recipes/`` in the repository)."""
    files = importlib.resources.files("hpcdl.recipes")
    return sorted(p.name[:-len(".yaml")] for p in files.iterdir() if p.name.endswith(".yaml"))


def resolve_recipe(name_or_path: str) -> str:
    """A recipe file: ``name_or_path`` itself when it exists, else the shipped recipe of that
    name (``resnet50_lars_32k`` or ``resnet50_lars_32k.yaml``), so a wheel install finds them.

    A name that is neither raises :class:`RecipeError` listing the shipped names."""
    if os.path.exists(name_or_path) or os.sep in name_or_path:
        return name_or_path
    name = name_or_path.removesuffix(".yaml")
    candidate = importlib.resources.files("hpcdl.recipes") / f"{name}.yaml"
    if candidate.is_file():
        return str(candidate)
    raise RecipeError(f"recipe {name_or_path}: no such file, and no shipped recipe of that name "
                      f"(shipped: {', '.join(shipped_recipes())})")


def load_recipe(path: str, overrides: Iterable[str] = ()) -> Config:
    """Read ``path`` (a file, or a shipped recipe's name: :func:`resolve_recipe`), apply
    ``key=value`` overrides (dotted keys), validate.

    Errors name the file and the dotted key: ``recipes/x.yaml: unknown key(s) batch.per_rnak``.
    """
    path = resolve_recipe(path)
    try:
        with open(path, encoding="utf-8") as f:
            raw = _yaml_load(f)
    except FileNotFoundError:
        raise RecipeError(f"recipe {path}: no such file") from None
    except yaml.YAMLError as exc:
        raise RecipeError(f"recipe {path}: not valid YAML ({exc})") from None
    if raw is None:
        raise RecipeError(f"recipe {path}: the file is empty")
    if not isinstance(raw, dict):
        raise RecipeError(f"recipe {path}: a recipe is a mapping of sections, got "
                          f"{type(raw).__name__}")
    items = list(overrides)
    for (keys, value), item in zip(parse_overrides(items), items, strict=True):
        _apply_override(raw, keys, value, item)
    origin = path if not items else f"{path} (with overrides {' '.join(items)})"
    return config_from_dict(raw, origin)


def resolve_batch(batch: BatchConfig, ranks: int) -> tuple[int, int]:
    """(per_rank, accumulation) such that per_rank × ranks × accumulation == batch.global.

    The recipe's global batch is what the published hyperparameters (lr, warm-up) were tuned
    for (Goyal et al.'s linear scaling rule ties lr to it), so it is honoured exactly; a
    mismatch is an error saying which override fixes it.
    """
    accumulation = batch.accumulation
    if batch.per_rank is None:
        per_rank, rest = divmod(batch.global_, ranks * accumulation)
        if rest or per_rank == 0:
            raise RecipeError(
                f"batch.global={batch.global_} is not divisible by {ranks} ranks × accumulation "
                f"{accumulation}; run on a rank count that divides it "
                f"({format_counts(rank_counts(batch.global_ // accumulation))}"
                f"{' with this accumulation' if accumulation > 1 else ''}), or set "
                f"batch.per_rank and batch.accumulation so that per_rank × ranks × accumulation "
                f"= {batch.global_}")
        return per_rank, accumulation
    actual = batch.per_rank * ranks * accumulation
    if actual != batch.global_:
        hint = ""
        if batch.global_ % (ranks * accumulation) == 0:
            hint = f"; set batch.per_rank={batch.global_ // (ranks * accumulation)}"
        elif batch.global_ % (ranks * batch.per_rank) == 0:
            hint = f"; set batch.accumulation={batch.global_ // (ranks * batch.per_rank)}"
        raise RecipeError(
            f"batch.global={batch.global_} but batch.per_rank={batch.per_rank} × {ranks} ranks × "
            f"accumulation {accumulation} = {actual}{hint} (or batch.per_rank=null to derive it)")
    return batch.per_rank, accumulation


def rank_counts(global_batch: int) -> list[int]:
    """Rank counts over which ``global_batch`` splits into equal per-rank micro-batches: its
    divisors (per_rank × ranks × accumulation = global has an integer solution iff ranks
    divides global)."""
    return [p for p in range(1, global_batch + 1) if global_batch % p == 0]


def format_counts(counts: list[int], most: int = 14) -> str:
    shown = ", ".join(map(str, counts[:most]))
    return shown + (f", ... ({len(counts)} in all)" if len(counts) > most else "")


def elastic_batch(batch: BatchConfig, ranks: int,
                  saved_per_rank: int | None = None) -> tuple[int, int]:
    """(per_rank, accumulation) for resuming at ``ranks`` a run written at another rank count,
    with the same global batch (docs/training.md, "Resuming on another rank count").

    The recipe's own rule first (:func:`resolve_batch`: ``per_rank: null`` derives the per-rank
    batch). Where it has no solution, ``batch.per_rank`` (or the checkpoint's per-rank batch)
    is an upper bound -- what fitted a rank's memory -- and the fewest accumulation steps that
    keep per_rank × ranks × accumulation = global under it are taken (Goyal et al.,
    arXiv:1706.02677 §2.2: accumulating k micro-batches is one batch of k× the size, BN aside).
    A rank count that does not divide the global batch is an error naming those that do.
    """
    global_ = batch.global_
    if ranks < 1 or global_ % ranks:
        raise RecipeError(
            f"batch.global={global_} cannot be split over {ranks} ranks: no per-rank batch × "
            f"accumulation gives {global_} / {ranks} = {global_ / max(ranks, 1):.2f} images per "
            f"rank per step. Rank counts that keep the global batch: "
            f"{format_counts(rank_counts(global_))}; relaunch on one of them (e.g. "
            f"{', '.join(str(p) for p in _nearest(rank_counts(global_), ranks))} ranks)")
    with contextlib.suppress(RecipeError):
        return resolve_batch(batch, ranks)
    bound = batch.per_rank or saved_per_rank or global_ // ranks
    share = global_ // ranks
    accumulation = next(a for a in range(1, share + 1) if share % a == 0 and share // a <= bound)
    return share // accumulation, accumulation


def _nearest(counts: list[int], ranks: int) -> list[int]:
    below = [p for p in counts if p < ranks][-1:]
    above = [p for p in counts if p > ranks][:1]
    return below + above


def write_resolved_config(config: Config, run_dir: str) -> str:
    """Write RUN_DIR/config.yaml atomically: the recipe as it ran (overrides applied); it
    loads again with :func:`load_recipe`, so ``hpcdl train --recipe RUN_DIR/config.yaml``
    repeats the run."""
    data = config.to_dict()
    path = os.path.join(run_dir, "config.yaml")
    atomic_write_text(path, f"# resolved from {config.path}\n"
                      + yaml.safe_dump(data, sort_keys=False))
    return path
