"""horovodrun, with its build checks remembered: ``python -m tfdp._compat.horovodrun ARGS``.

Before every launch, horovodrun asks whether Horovod was built with Gloo (or MPI) by
importing Horovod's TensorFlow extension in a forked child (`horovod/common/util.py`
`gloo_built`, `mpi_built`, `_check_extension_lambda`): that imports TensorFlow, about 4 s of
CPU here, for an answer that changes only when Horovod or TensorFlow is reinstalled. This
module runs horovodrun's own command line (`horovod/runner/launch.py` `run_commandline`)
with those two checks answered from a file, keyed by the installed extension and TensorFlow
library (path, size, modification time). A key that is missing or changed runs the real
check again; only positive answers are kept, so a fixed build is seen at once.

`tfdp run`, `tfdp.tools.launcher` and the tests launch through here; the workers and
everything else horovodrun does are unchanged. ``TFDP_CACHE`` (default ``~/.cache/tfdp``)
holds the file, ``horovod-build.json``.
"""

import importlib.util
import json
import os
import sys
from pathlib import Path

_CHECKS = ("gloo_built", "mpi_built")


def cache_file():
    """Where the remembered answers live."""
    return Path(os.environ.get("TFDP_CACHE") or Path.home() / ".cache" / "tfdp") / "horovod-build.json"


def build_key():
    """What the answers depend on: Horovod's TensorFlow extension and TensorFlow's framework
    library, each as path, size and modification time (found without importing them)."""
    parts = []
    for package, pattern in (("horovod", "tensorflow/mpi_lib*.so"), ("tensorflow", "libtensorflow_framework.so*")):
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            return None
        found = sorted(Path(next(iter(spec.submodule_search_locations))).glob(pattern))
        if not found:
            return None
        stat = found[0].stat()
        parts.append(f"{found[0]}:{stat.st_size}:{stat.st_mtime_ns}")
    return "|".join(parts)


def remembered(name, check, key, path=None):
    """`check` (horovodrun's check `name`, a function of ``verbose``) answered from the file when
    `key` matches it."""
    path = path or cache_file()

    def answer(verbose=False):
        saved = _read(path)
        if key is not None and saved.get("key") == key and saved.get(name) is True:
            return True
        result = check(verbose=verbose)
        if result is True and key is not None:
            saved = saved if saved.get("key") == key else {"key": key}
            saved[name] = True
            _write(path, saved)
        return result

    return answer


def _read(path):
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}


def _write(path, saved):
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_text(json.dumps(saved))
        temporary.replace(path)  # atomic: concurrent launches never read half a file
    except OSError:
        pass  # a read-only home only costs the check next time


def main(argv=None):
    from horovod.runner import launch

    key = build_key()
    for name in _CHECKS:
        setattr(launch, name, remembered(name, getattr(launch, name), key))
    sys.argv = ["horovodrun", *(sys.argv[1:] if argv is None else argv)]
    return launch.run_commandline()


if __name__ == "__main__":  # horovodrun's children may be spawned: guard the launch
    sys.exit(main())
