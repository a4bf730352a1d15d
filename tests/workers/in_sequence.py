"""Run several worker scripts one after another in one process: one TensorFlow import and one
Horovod start for all of them (about 10 s of a 2-worker job here), for scripts that end normally.

    in_sequence.py uneven.py --out A -- nonfinite.py --out B -- split_inputs.py

Each script runs as ``__main__`` with its own ``sys.argv``, after a line
``in_sequence: <script>`` on stderr that lets a test find the script's own output.
"""

import runpy
import sys
from pathlib import Path

import keras


def scripts(argv):
    """Split ``a.py x -- b.py y`` into ``[["a.py", "x"], ["b.py", "y"]]``."""
    commands, current = [], []
    for arg in argv:
        if arg == "--":
            commands.append(current)
            current = []
        else:
            current.append(arg)
    return [c for c in commands + [current] if c]


def main():
    here = Path(__file__).parent
    for script, *args in scripts(sys.argv[1:]):
        print(f"in_sequence: {script}", file=sys.stderr, flush=True)
        keras.backend.clear_session()  # each script names its layers as it would alone
        sys.argv = [str(here / script), *args]
        runpy.run_path(str(here / script), run_name="__main__")


if __name__ == "__main__":
    main()
