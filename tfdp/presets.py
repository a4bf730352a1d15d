"""Named strategy presets: small YAML files in ``strategies/`` (package ``tfdp.preset_files`` once installed).

A preset has exactly these keys::

    description: one line on when to use it
    strategy: mirrored            # a key of STRATEGY_CLASSES
    options: {}                   # keyword arguments of that class

Files are read with `yaml.safe_load` (never pickle or eval); unknown keys and wrong
types are errors that name the file and the fix.

A *variant* is a preset plus explicit overrides of its options, written
``NAME:key=value,key=value`` (values in YAML: numbers, true/false, null, names; a dotted
key reaches into a nested option), e.g. ``topk-1pct:compressor.ratio=0.001,local_residual=false``
or ``async-s1:staleness=8``. Benchmarks and convergence tests name what they run this way,
and ``TFDP_STRATEGY`` and ``tfdp run --strategy`` accept it too.
"""

import copy
import importlib.resources
import os

import yaml

ENV_VAR = "TFDP_STRATEGY"
DEFAULT_PRESET = "sync"
PRESET_KEYS = {"description": str, "strategy": str, "options": dict}
# Named here, not read off the classes: validating a preset (`tfdp run --strategy`) must not
# import TensorFlow, which costs the launcher seconds before any worker starts.
STRATEGY_KINDS = ("async", "auto", "compressed", "mirrored")


def _strategy_classes():
    from tfdp.auto import AutoStrategy
    from tfdp.strategies import AsyncStrategy, CompressedStrategy, MirroredStrategy

    return {"mirrored": MirroredStrategy, "compressed": CompressedStrategy, "async": AsyncStrategy,
            "auto": AutoStrategy}


def _preset_files():
    root = importlib.resources.files("tfdp.preset_files")
    return {
        entry.name[: -len(".yaml")]: entry
        for entry in root.iterdir()
        if entry.name.endswith(".yaml")
    }


def accuracy(name):
    """What the preset grid measured for preset `name` against sync, or None if it did not run it.

    Returns:
        dict with ``cells`` ((configuration, budget) pairs measured), ``within_band`` (how
        many within ``band_pp`` of sync's test accuracy, mean of 3 seeds), ``worst_pp`` and
        ``worst`` (that pair). Written by ``benchmarks/preset_grid.py``.

    Example:
        >>> tfdp.presets.accuracy("fp16")["within_band"]
        24
    """
    import json

    summary = importlib.resources.files("tfdp.preset_files") / "accuracy.json"
    return json.loads(summary.read_text())["presets"].get(name) if summary.is_file() else None


def preset_names():
    """Return the names of all presets, sorted."""
    return sorted(_preset_files())


def parse_preset(text, source="<string>"):
    """Parse and validate the YAML text of one preset.

    Raises:
        ValueError: bad syntax, unknown or missing keys, wrong types, unknown strategy.
    """
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ValueError(f"Preset {source} is not valid YAML: {err}") from err
    if not isinstance(data, dict):
        raise ValueError(f"Preset {source} must be a mapping with keys {sorted(PRESET_KEYS)}.")
    unknown = set(data) - set(PRESET_KEYS)
    if unknown:
        raise ValueError(
            f"Preset {source} has unknown keys {sorted(unknown)}; allowed keys are {sorted(PRESET_KEYS)}."
        )
    for key, kind in PRESET_KEYS.items():
        if key not in data:
            raise ValueError(f"Preset {source} is missing key {key!r}.")
        if not isinstance(data[key], kind):
            raise ValueError(
                f"Preset {source}: {key!r} must be a {kind.__name__}. Received: {key}={data[key]!r}"
            )
    if data["strategy"] not in STRATEGY_KINDS:
        raise ValueError(
            f"Preset {source}: unknown strategy {data['strategy']!r}; choose one of {list(STRATEGY_KINDS)}."
        )
    return data


def load_preset(name):
    """Return the validated contents of preset `name`.

    Raises:
        ValueError: no preset of that name, or the preset is invalid.
    """
    files = _preset_files()
    if name not in files:
        raise ValueError(f"Unknown strategy preset {name!r}. Available presets: {sorted(files)}.")
    return parse_preset(files[name].read_text(), source=f"{name!r} ({files[name].name})")


def parse_variant(text):
    """Split ``NAME:key=value,...`` into the preset name and a dict of (dotted) overrides.

    Example:
        >>> parse_variant("topk-1pct:compressor.ratio=0.001,local_residual=false")
        ('topk-1pct', {'compressor.ratio': 0.001, 'local_residual': False})
    """
    name, _, rest = text.partition(":")
    overrides = {}
    for item in filter(None, rest.split(",")):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"Variant {text!r}: overrides are written key=value, comma-separated. "
                             f"Received: {item!r}")
        overrides[key.strip()] = yaml.safe_load(value)
    return name.strip(), overrides


def _override(options, dotted, value):
    *path, last = dotted.split(".")
    node = options
    for key in path:
        if isinstance(node.get(key), str):
            node[key] = {"name": node[key]}  # `compressor: fp16` seen as `{name: fp16}`
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise ValueError(f"Override {dotted!r}: {key!r} is not a mapping of options.")
    node[last] = value


def load_variant(text):
    """`load_preset` of a preset or variant: its options with the overrides applied.

    Example:
        >>> load_variant("sync:bucket_bytes=262144")["options"]
        {'bucket_bytes': 262144}
    """
    name, overrides = parse_variant(text)
    preset = copy.deepcopy(load_preset(name))
    for dotted, value in overrides.items():
        _override(preset["options"], dotted, value)
    return preset


def resolve_variant(text):
    """Return ``(strategy class, options)`` of a preset or variant, validated.

    Raises:
        ValueError: unknown preset, malformed overrides.
    """
    preset = load_variant(text)
    return _strategy_classes()[preset["strategy"]], preset["options"]


def strategy(name=None):
    """Build the strategy of preset (or variant) `name`, of ``$TFDP_STRATEGY``, or of ``"sync"``.

    Example:
        >>> strategy = tfdp.strategy()          # TFDP_STRATEGY=sync by default
        >>> strategy = tfdp.strategy("topk-1pct:compressor.ratio=0.02")
        >>> with strategy.scope():
        ...     model = build_model()
    """
    name = name or os.environ.get(ENV_VAR) or DEFAULT_PRESET
    cls, options = resolve_variant(name)
    try:
        return cls(**options)
    except TypeError as err:
        raise ValueError(f"Preset {name!r} has options that {cls.__name__} does not take: {err}") from err
