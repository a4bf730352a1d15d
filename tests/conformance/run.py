"""Run the conformance programs one way and write every program's numbers to JSON.

    python run.py --modes plain tf-mirrored --out DIR   one plain process, then
                                                        tf.distribute.MirroredStrategy on 2 logical CPUs
    horovodrun -np 2 ... python run.py --modes tfdp --out DIR
    horovodrun -np 2 ... python run.py --modes preset:zero1 --out DIR   `tfdp.strategy("zero1")`

Each rank writes ``<mode>-rank<r>.json``: ``{program: {"seconds": s, ...numbers} or {"error": text}}``.
A program that raises is recorded, and the next one runs: every rank raises at the same
collective, so the ranks stay paired.
"""

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(Path(__file__).parent))

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

from programs import PROGRAMS, SHARED_FOLDER_ENV, rank  # noqa: E402


def strategy_factory(mode):
    if mode == "plain":
        return tf.distribute.get_strategy
    if mode == "tf-mirrored":
        # One instance for all programs: several MirroredStrategy objects in one process
        # reuse collective instance keys and abort each other's collectives.
        strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
        return lambda: strategy
    import tfdp

    if mode == "tfdp-balanced":  # uneven static shares: rank 0 gets 70% of every batch
        return lambda: tfdp.MirroredStrategy(balance=[0.7, 0.3])
    if mode.startswith("preset:"):
        return lambda: tfdp.strategy(mode.split(":", 1)[1])
    return tfdp.MirroredStrategy


def mode_name(text):
    if text in ("plain", "tf-mirrored", "tfdp", "tfdp-balanced") or text.startswith("preset:"):
        return text
    raise argparse.ArgumentTypeError(f"unknown mode {text!r}: plain, tf-mirrored, tfdp, tfdp-balanced or preset:NAME")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--modes", nargs="+", type=mode_name, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--programs", nargs="*", help="default: all, in definition order")
    parser.add_argument("--mirrored-programs", nargs="*", help="tf-mirrored runs only these (default: all)")
    args = parser.parse_args()
    if "tf-mirrored" in args.modes:
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    factories = {mode: strategy_factory(mode) for mode in args.modes}
    results = {mode: {} for mode in args.modes}
    # Program by program, every mode: op_determinism, which cannot be undone, runs last.
    for name in args.programs or list(PROGRAMS):
        for mode in args.modes:
            if mode != "tf-mirrored" or args.mirrored_programs is None or name in args.mirrored_programs:
                results[mode][name] = run_one(mode, name, factories[mode], args.out)
    for mode in args.modes:
        (Path(args.out) / f"{mode}-rank{rank()}.json").write_text(json.dumps(results[mode]))


def run_one(mode, name, make_strategy, out):
    function, _ = PROGRAMS[name]
    # A folder every rank of this job sees, for programs that read back what rank 0 wrote.
    os.environ[SHARED_FOLDER_ENV] = str(Path(out) / f"shared-{mode}-{name}".replace(":", "-"))
    keras.backend.clear_session()  # the same automatic names in every mode
    tf.random.set_seed(None)
    start = time.monotonic()
    try:
        result = function(make_strategy)
    except Exception as err:  # noqa: BLE001 - recorded; the test decides what it means
        result = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-3000:]}
    result["seconds"] = time.monotonic() - start
    print(f"{mode} {name}: {result['seconds']:.1f} s{' ERROR' if 'error' in result else ''}",
          file=sys.stderr, flush=True)
    return result


if __name__ == "__main__":
    main()
