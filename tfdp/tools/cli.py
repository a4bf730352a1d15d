"""The ``tfdp`` command line: a thin argparse layer over presets and horovodrun.

    tfdp presets                                   list strategy presets
    tfdp run -np 2 [--strategy P] [--timeline FILE] script.py ...
                                                   horovodrun with preset P (FILE: Horovod's timeline)
    tfdp timeline FILE [--png OUT] [--last-ms 200] [--end-ms T]
                                                   totals per collective phase; a chart of a window
    tfdp advise --params 5e6 --bandwidth-mbit 100 --compute-ms 40 [-np 2] [--check]
                                                   predicted time per step of each preset
                                                   (--check: measure it on emulated hosts)
    tfdp bench --presets sync topk-1pct -np 2 [--rate-mbit 100] [--params 6e6] [--out DIR]
                                                   measure presets side by side (JSON, markdown, PNG)
"""

import argparse
import os
import sys
from pathlib import Path

from tfdp import presets


def _list_presets(_args):
    for name in presets.preset_names():
        description = " ".join(presets.load_preset(name)["description"].split())
        print(f"{name:<16} {description}")
    return 0


def _advise(args):
    from tfdp.tools import advisor

    if (args.params is None) == (args.model is None):
        raise ValueError("Give the model as --params COUNT or as --model FILE.keras (one of them).")
    if args.compute_ms is None:
        if args.model is None:
            raise ValueError("Give --compute-ms (a measured step of one worker), or --model FILE.keras to time "
                             "the model's own step here.")
        args.compute_ms = 1000 * advisor.model_step_seconds(args.model, args.batch_size)
        print(f"one training step of {args.model} here, batch {args.batch_size}: {args.compute_ms:.1f} ms")
    for name in ("bandwidth_mbit", "compute_ms"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0. Received: {getattr(args, name)}")
    if args.np < 1:
        raise ValueError(f"-np must be >= 1. Received: -np {args.np}")
    shapes = (advisor.shapes_from_parameter_count(int(args.params)) if args.params is not None
              else advisor.shapes_from_model_file(args.model))
    speeds = _speeds(args.speeds, args.np)
    measured = None
    measure = args.measure_compressors or args.model is not None  # a real model: time its own tensors
    if measure:
        from tfdp.tools.codec_timing import compressor_seconds

        measured = {name: compressor_seconds(name, shapes) for name in presets.preset_names()
                    if presets.load_variant(name)["strategy"] == "compressed"}
        print("compression compute measured on these shapes here (ms/step): "
              + ", ".join(f"{name} {1000 * s:.1f}" for name, s in measured.items()))
    rows = advisor.advise(shapes, args.np, args.bandwidth_mbit * 1e6 / 8, args.compute_ms / 1000,
                          args.latency_ms / 1000, speeds=speeds, compressor_seconds=measured)
    params = sum(advisor._numel(s) for s in shapes)
    print(f"{params:,} parameters, {args.np} workers, {args.bandwidth_mbit:g} Mbit/s, "
          f"compute {args.compute_ms:.4g} ms/step, latency {args.latency_ms:g} ms per collective"
          + (f", worker speeds {'/'.join(f'{v:g}' for v in speeds)}" if speeds else ""))
    print(f"{'preset':<16} {'ms/step':>9} {'comm ms':>9} {'MB sent':>9}  accuracy against sync (preset grid)")
    for row in rows:
        print(f"{row.preset:<16} {1000 * row.seconds_per_step:>9.1f} {1000 * row.communication_seconds:>9.1f} "
              f"{row.bytes_sent / 1e6:>9.3f}  {advisor.accuracy_note(row.preset)}")
    if not measure:
        print("(compressed presets without their compression compute: add --measure-compressors)")
    choice = advisor.recommendation(rows, holds=advisor.holds_accuracy)
    fastest = rows[0].preset
    if fastest != choice and not advisor.holds_accuracy(fastest):
        print(f"faster but not accurate everywhere: {fastest} ({advisor.accuracy_note(fastest)})")
    if choice == "sync" and rows[0].preset != "sync":
        print(f"recommended: sync (nothing that keeps accuracy is predicted {100 * advisor.BEATS_SYNC_BY:g}% "
              "faster)")
    else:
        print(f"recommended: {choice}")
    if args.check:
        _check_advice(args, choice)
    return 0


def _speeds(text, workers):
    if text is None:
        return None
    try:
        speeds = [float(v) for v in text.split(",")]
    except ValueError:
        speeds = []
    if len(speeds) != workers or min(speeds) <= 0:
        raise ValueError(f"--speeds needs {workers} relative speeds > 0, comma-separated (e.g. "
                         f"{','.join(['1'] * (workers - 1) + ['0.5'])}). Received: {text!r}")
    return speeds


def _check_advice(args, recommended):
    """Measure the recommended preset and sync on emulated hosts at the given bandwidth."""
    from tfdp.tools import bench
    from tfdp.tools.network import check_available

    if args.params is None:
        raise ValueError("--check measures the mlp workload: give the model as --params COUNT.")
    check_available()
    names = list(dict.fromkeys([recommended, "sync"]))
    print(f"checking on {args.np} emulated hosts at {args.bandwidth_mbit:g} Mbit/s ({args.check_steps} steps each)...")
    rows = bench.run_bench(names, workers=args.np, rate_mbit=args.bandwidth_mbit, params=args.params,
                           steps=args.check_steps, out_dir=args.check_out)
    print(f"measured compute {rows[0]['compute_ms']:.1f} ms/step (one worker alone)")
    print(f"{'preset':<16} {'predicted ms':>13} {'measured ms':>12} {'measured/predicted':>19}")
    for row in rows:
        print(f"{row['preset']:<16} {row['predicted_ms']:>13.1f} {row['median_ms']:>12.1f} "
              f"{row['measured_over_predicted']:>19.2f}")
    print(f"(predictions use the measured compute time; report in {args.check_out}/)")


def _bench(args):
    from tfdp.tools import bench
    from tfdp.tools.network import check_available

    if args.rate_mbit is not None:
        if args.rate_mbit <= 0:
            raise ValueError(f"--rate-mbit must be > 0. Received: {args.rate_mbit}")
        check_available()
    if not 0 < args.target_accuracy <= 1:
        raise ValueError(f"--target-accuracy must be in (0, 1]. Received: {args.target_accuracy}")
    for name in ("steps", "batch_size", "threads", "epochs"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1. Received: {getattr(args, name)}")
    bench.run_bench(args.presets, workers=args.np, rate_mbit=args.rate_mbit, workload=args.workload,
                    params=args.params, batch_size=args.batch_size, steps=args.steps,
                    warmup_steps=args.warmup_steps, threads=args.threads, out_dir=args.out, timeout=args.timeout,
                    target_accuracy=args.target_accuracy, epochs=args.epochs, slowdown=args.slowdown,
                    optimizer=args.optimizer, pin_cpus=args.pin_cpus)
    print((Path(args.out) / "bench.md").read_text())
    print(f"wrote {args.out}/bench.json, bench.md, bench.png (worker output: bench.log)")
    return 0


def _timeline(args):
    from tfdp.tools import timeline

    if not Path(args.file).is_file():
        raise ValueError(f"{args.file}: no such timeline file (write one with `tfdp run --timeline FILE ...`).")
    spans = timeline.load(args.file)
    print(timeline.format_summary(spans))
    if args.png:
        timeline.draw(spans, args.png, last_ms=args.last_ms, end_ms=args.end_ms,
                      title=f"Horovod timeline: {Path(args.file).name}")
        print(f"wrote {args.png}")
    return 0


def split_command(passthrough):
    """``(horovodrun's flags, the workers' command)`` of what follows ``tfdp run``'s own flags.

    A script (``train.py``) runs with this Python, the one tfdp is installed in, unless a Python
    interpreter is named before it, as for horovodrun (``python train.py``, ``python3 -u
    train.py``). Without a script, everything passes through to horovodrun.

    Example:
        >>> split_command(["--gloo", "python3", "-u", "train.py", "--epochs", "2"])
        (['--gloo'], ['python3', '-u', 'train.py', '--epochs', '2'])
    """
    scripts = [i for i, arg in enumerate(passthrough) if arg.endswith(".py")]
    if not scripts:
        return list(passthrough), []
    named = [i for i, arg in enumerate(passthrough[:scripts[0]]) if Path(arg).name.startswith("python")]
    if named:
        return list(passthrough[:named[0]]), list(passthrough[named[0]:])
    return list(passthrough[:scripts[0]]), [sys.executable, *passthrough[scripts[0]:]]


def _run(args, passthrough):
    import socket

    from tfdp._compat.horovod import check_host_address
    from tfdp.tools.launcher import horovodrun_command

    hosts = [h.split(":")[0] for h in (args.hosts or "").split(",") if h]
    if len(set(hosts)) > 1 and socket.gethostname() in hosts:  # this machine is one of several hosts
        check_host_address({"HOROVOD_CROSS_SIZE": str(len(set(hosts))), "HOROVOD_RANK": "(this host)"})
    if args.strategy:
        presets.load_variant(args.strategy)  # Fail here, once, not on every worker (and without TensorFlow).
        os.environ[presets.ENV_VAR] = args.strategy
    if args.timeline:
        folder = Path(args.timeline).resolve().parent
        if not folder.is_dir():
            raise ValueError(f"--timeline {args.timeline}: the folder {folder} does not exist; create it first.")
        os.environ["HOROVOD_TIMELINE"] = str(Path(args.timeline).resolve())  # written by rank 0's Horovod
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    horovodrun_args, command = split_command(passthrough)
    argv = horovodrun_command(command, args.np, args.hosts, horovodrun_args)
    os.execv(argv[0], argv)  # horovodrun takes over this process: signals and exit code are its own.


def build_parser():
    parser = argparse.ArgumentParser(prog="tfdp", description="Data-parallel Keras 3 training on Horovod.")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("presets", help="list strategy presets").set_defaults(handler=_list_presets)
    run = commands.add_parser(
        "run", help="launch a script on N workers with horovodrun (other flags pass through)"
    )
    run.add_argument("-np", "--num-proc", dest="np", type=int, required=True, help="number of workers")
    run.add_argument("-H", "--hosts", help="horovodrun host list (default localhost:NP)")
    run.add_argument("--strategy", help="preset name, sets $TFDP_STRATEGY for the workers")
    run.add_argument("--timeline", help="write Horovod's timeline (Chrome trace JSON) to this file; "
                     "read it with `tfdp timeline FILE`")
    timeline = commands.add_parser("timeline", help="summarise a Horovod timeline and draw its last milliseconds")
    timeline.add_argument("file", help="a file written by `tfdp run --timeline FILE`")
    timeline.add_argument("--png", help="draw the last --last-ms milliseconds here")
    timeline.add_argument("--last-ms", type=float, default=200.0, help="window of the chart (default 200)")
    timeline.add_argument("--end-ms", type=float, help="the window ends here, in ms since the timeline began "
                          "(default: the end of the run)")
    timeline.set_defaults(handler=_timeline)
    advise = commands.add_parser("advise", help="predict time per step of each preset (ring cost model)")
    advise.add_argument("--params", type=float, help="parameter count of the model")
    advise.add_argument("--model", help="a saved Keras model file (its trainable shapes are used)")
    advise.add_argument("--bandwidth-mbit", type=float, required=True, help="link bandwidth, Mbit/s")
    advise.add_argument("--compute-ms", type=float, help="measured compute time per step (default with --model: "
                        "timed here)")
    advise.add_argument("--batch-size", type=int, default=32, help="rows per worker when timing --model")
    advise.add_argument("--latency-ms", type=float, default=0.1, help="latency per collective")
    advise.add_argument("-np", type=int, default=2, help="number of workers")
    advise.add_argument("--speeds", help="each worker's relative compute speed, e.g. 1,0.5 (default: all 1); "
                        "--compute-ms is the time of a speed-1 worker")
    advise.add_argument("--measure-compressors", action="store_true",
                        help="time each compressed preset's compression on the model's shapes on this machine "
                             "and add it to the prediction")
    advise.add_argument("--check", action="store_true",
                        help="measure the recommended preset and sync on emulated hosts (root; --params only)")
    advise.add_argument("--check-steps", type=int, default=6, help="timed steps per preset for --check")
    advise.add_argument("--check-out", default="advise-check", help="where --check writes its bench report")
    advise.set_defaults(handler=_advise)
    bench = commands.add_parser("bench", help="measure presets side by side on loopback or emulated hosts")
    bench.add_argument("--presets", nargs="+", default=["sync", "topk-1pct", "powersgd-r4", "async-s1"])
    bench.add_argument("-np", type=int, default=2, help="number of workers (>= 2)")
    bench.add_argument("--rate-mbit", type=float, help="emulated hosts with this link rate (root); "
                       "default: loopback")
    bench.add_argument("--workload", choices=["mlp", "cnn", "digits"], default="mlp",
                       help="digits: real data, also reports the time to --target-accuracy")
    bench.add_argument("--params", type=float, default=6e6, help="parameter count of the mlp workload")
    bench.add_argument("--batch-size", type=int, default=32, help="per worker")
    bench.add_argument("--steps", type=int, default=8, help="timed steps per preset")
    bench.add_argument("--warmup-steps", type=int, default=3, help="untimed steps (plus the preset's own)")
    bench.add_argument("--threads", type=int, default=1,
                       help="TensorFlow intra-op threads per worker (the inter-op pool gets one more)")
    bench.add_argument("--pin-cpus", action="store_true",
                       help="worker r runs on CPU r alone, the single-worker baseline on CPU 0: hosts of one CPU each")
    bench.add_argument("--timeout", type=float, default=900, help="seconds per job before it is ended")
    bench.add_argument("--target-accuracy", type=float, default=0.95, help="digits only")
    bench.add_argument("--epochs", type=int, default=20, help="digits only")
    bench.add_argument("--slowdown", help="RANK:FACTOR[,...]: those workers compute FACTOR x slower "
                       "(a CPU quota; root), e.g. 1:2")
    bench.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd",
                       help="optimizer of the mlp and cnn workloads (adam: two slots per weight)")
    bench.add_argument("--out", default="bench-results")
    bench.set_defaults(handler=_bench)
    return parser


def main(argv=None):
    parser = build_parser()
    args, passthrough = parser.parse_known_args(argv)
    try:
        if args.command == "run":
            if args.np < 1:
                parser.error(f"-np must be >= 1. Received: -np {args.np}")
            return _run(args, passthrough)
        return args.handler(args)
    except (ValueError, RuntimeError) as err:
        print(f"tfdp: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
