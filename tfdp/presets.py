"""Named strategy presets: small YAML files in ``strategies/`` (package ``tfdp.preset_files`` once installed).

A preset has exactly these keys::

    description: one line on when to use it
    strategy: mirrored            # a key of STRATEGY_CLASSES
    options: {}                   # keyword arguments of that class

Files are read with `yaml.safe_load` (never pickle or eval); unknown keys and wrong
types are errors that name the file and the fix.
"""

import importlib.resources
import os

import yaml

ENV_VAR = "TFDP_STRATEGY"
DEFAULT_PRESET = "sync"
PRESET_KEYS = {"description": str, "strategy": str, "options": dict}


def _strategy_classes():
    from tfdp.strategies import AsyncStrategy, CompressedStrategy, MirroredStrategy

    return {"mirrored": MirroredStrategy, "compressed": CompressedStrategy, "async": AsyncStrategy}


def _preset_files():
    root = importlib.resources.files("tfdp.preset_files")
    return {
        entry.name[: -len(".yaml")]: entry
        for entry in root.iterdir()
        if entry.name.endswith(".yaml")
    }


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
    classes = _strategy_classes()
    if data["strategy"] not in classes:
        raise ValueError(
            f"Preset {source}: unknown strategy {data['strategy']!r}; choose one of {sorted(classes)}."
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


def strategy(name=None):
    """Build the strategy of preset `name`, of ``$TFDP_STRATEGY``, or of ``"sync"``.

    Example:
        >>> strategy = tfdp.strategy()          # TFDP_STRATEGY=sync by default
        >>> with strategy.scope():
        ...     model = build_model()
    """
    name = name or os.environ.get(ENV_VAR) or DEFAULT_PRESET
    preset = load_preset(name)
    cls = _strategy_classes()[preset["strategy"]]
    try:
        return cls(**preset["options"])
    except TypeError as err:
        raise ValueError(f"Preset {name!r} has options that {cls.__name__} does not take: {err}") from err
