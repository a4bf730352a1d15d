"""`tfdp bench`: run presets side by side on one workload, on loopback or emulated hosts.

Every preset runs in its own job of `workers` workers (`tfdp.tools.launcher`), plus one job of a
single worker with no communication: its time per step is the compute time C, the
baseline for scaling efficiency. For each preset the report gives
median time per step and its spread, samples/s, speed-up over sync, scaling efficiency
(samples/s over `workers` x the single worker's), tfdp's payload bytes per step, the bytes
that crossed the link per step (emulated hosts) and, given a link rate, the advisor's
prediction and the measured/predicted ratio. The advisor's compute (C and the compressed presets'
compression, timed on the model's shapes: `tfdp.tools.codec_timing`) is what a worker gets in
the job: on emulated hosts that share this machine's CPUs, `workers` copies of the single-worker
job run side by side (`tfdp.tools.side_by_side`) and each step counts as their slowest copy's, as
a synchronous step waits for its slowest worker (`lockstep_seconds`); with `pin_cpus`, the single
worker on one CPU.
Writes ``bench.json``, ``bench.md`` and ``bench.png`` to `out_dir`, and ``bench-shares.png`` (each
worker's share over the steps) when a preset balances shares.

Example (as root, for emulated hosts):
    >>> rows = run_bench(["sync", "topk-1pct"], workers=2, rate_mbit=100, params=6e6, out_dir="/tmp/b")
    >>> rows[1]["speedup_vs_sync"]
"""

import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from tfdp import presets
from tfdp.tools import advisor
from tfdp.tools.launcher import launch
from tfdp.tools.slowdown import SLOWDOWN_ENV, parse_slowdown, remove_groups

SINGLE_WORKER = "1 worker (compute only)"
SIDE_BY_SIDE = "1-worker jobs side by side (compute only)"


def _job(preset, workers, rate_mbit, workload, params, batch_size, steps, warmup_steps, threads, timeout, log,
         digits_options=(), slowdown=None, optimizer="sgd", extra=(), pin_cpus=False):
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        command = [sys.executable, "-m", "tfdp.tools.bench_worker", "--preset", preset, "--workload", workload,
                   "--params", str(params), "--batch-size", str(batch_size), "--steps", str(steps),
                   "--warmup-steps", str(warmup_steps), "--optimizer", optimizer, "--out", str(out), *digits_options,
                   *extra]
        # `threads` threads per op; the inter-op pool gets one more, so that Horovod's all-reduces start
        # while backprop goes on (with 1, backprop runs to its end first: docs/results.md, overlap).
        env = dict(os.environ, TF_NUM_INTRAOP_THREADS=str(threads), TF_NUM_INTEROP_THREADS=str(threads + 1),
                   TF_CPP_MIN_LOG_LEVEL="2")
        env.pop(SLOWDOWN_ENV, None)
        if slowdown and workers > 1:
            env[SLOWDOWN_ENV] = slowdown
        try:
            result = launch(command, workers, rate_mbit=rate_mbit if workers > 1 else None, timeout=timeout,
                            env=env, sink=log, pin_cpus=pin_cpus)
        finally:
            if slowdown:
                remove_groups()
        if result.returncode != 0 or not out.exists():
            tail = "\n".join(result.output.splitlines()[-30:])
            raise RuntimeError(f"bench job {preset!r} on {workers} worker(s) failed "
                               f"(exit {result.returncode}):\n{tail}")
        return json.loads(out.read_text())


def _side_by_side(copies, *job_args, extra=()):
    """`copies` single-worker jobs at once, their timed phases started together; their compute and
    compression times as the workers of a synchronous job see them (`lockstep_seconds`)."""
    from concurrent.futures import ThreadPoolExecutor

    from tfdp.tools.side_by_side import abandon

    with tempfile.TemporaryDirectory() as meeting, ThreadPoolExecutor(copies) as pool:
        flags = [*extra, "--side-by-side", meeting, str(copies)]

        def copy(_):
            try:
                return _job("sync", 1, None, *job_args, extra=flags)
            except BaseException:
                abandon(meeting)  # the other copies stop waiting for this one
                raise

        results = list(pool.map(copy, range(copies)))
    combined = dict(results[0], copies=copies, alone_median_seconds=statistics.median(
        r["median_seconds"] for r in results))
    combined["forward_seconds"] = statistics.median(r["forward_seconds"] for r in results)
    combined["median_seconds"] = lockstep_seconds([r["step_seconds"] for r in results])
    combined["compressor_seconds"] = {
        name: lockstep_seconds([r["compressor_step_seconds"][name] for r in results])
        for name in results[0].get("compressor_step_seconds", {})}
    return combined


def lockstep_seconds(step_seconds):
    """The median step of processes that wait for each other every step, from their steps timed
    apart: a synchronous step ends when its slowest worker is done, so step i takes the longest
    of the processes' i-th steps. `step_seconds`: one list per process.

    >>> lockstep_seconds([[1.0, 3.0, 2.0], [2.0, 1.0, 2.5]])
    2.5
    """
    return statistics.median(max(steps) for steps in zip(*step_seconds))


def _spread(seconds):
    ordered = sorted(seconds)
    return ordered[0], ordered[-1]


def run_bench(preset_names, workers=2, rate_mbit=None, workload="mlp", params=6e6, batch_size=32, steps=8,
              warmup_steps=3, threads=1, out_dir="bench-results", timeout=900, progress=True,
              target_accuracy=0.95, epochs=20, slowdown=None, optimizer="sgd", pin_cpus=False):
    """Run every preset, write the report files to `out_dir`, return the rows (dicts).

    Synthetic workloads train with `optimizer` (``"sgd"``: plain SGD; ``"adam"``: Adam, whose
    two slots per weight are what ``shard_optimizer_state`` shards).
    The digits workload trains `epochs` epochs and also reports the seconds to reach
    `target_accuracy` on its test split. `slowdown` (``"RANK:FACTOR,..."``, root) makes
    those workers of every multi-worker job FACTOR times slower in compute
    (`tfdp.tools.slowdown`); the single-worker baseline runs at full speed. `pin_cpus` runs
    worker r on CPU r alone and the single-worker baseline on CPU 0, as on hosts of one CPU
    each: without it a worker alone has every CPU, which it does not have in the job.
    """
    from tqdm import tqdm

    for name in preset_names:
        presets.load_variant(name)  # An unknown preset fails now, before any job starts.
    if slowdown:
        slowdown = ",".join(f"{r}:{f:g}" for r, f in parse_slowdown(slowdown).items())  # a bad one fails now
    if workers < 2:
        raise ValueError(f"`workers` must be >= 2 to compare strategies. Received: {workers}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # The advisor's compute is a worker's in the job: where the workers share this machine's CPUs
    # (emulated hosts, not pinned), copies of the single worker side by side measure it.
    advised_by = SIDE_BY_SIDE if rate_mbit is not None and not pin_cpus else SINGLE_WORKER
    jobs = ([(SINGLE_WORKER, "sync", 1)] + ([(SIDE_BY_SIDE, "sync", workers)] if advised_by == SIDE_BY_SIDE else [])
            + [(name, name, workers) for name in preset_names])
    raw = {}
    with open(out_dir / "bench.log", "w") as log, tqdm(jobs, desc="tfdp bench", unit="job",
                                                        disable=not progress) as bar:
        for label, preset, n in bar:
            bar.set_postfix_str(f"{label} on {n}")
            digits_options = (["--target-accuracy", str(target_accuracy), "--epochs", str(epochs)]
                              if workload == "digits" else [])
            # The advisor's baseline also times the compressed presets' compression on the model's
            # shapes, with the workers' threads: the advisor's prediction adds it.
            timed = [p for p in preset_names if presets.load_variant(p)["strategy"] == "compressed"]
            if any(presets.load_variant(p)["strategy"] == "auto" for p in preset_names):
                from tfdp.auto import default_candidates

                timed += [c for c in default_candidates() if c != "sync" and c not in timed]
            timing = ["--time-compressors", *timed] if label == advised_by and rate_mbit is not None else []
            job_args = (workload, params, batch_size, steps, warmup_steps, threads, timeout, log, digits_options,
                        slowdown, optimizer)
            if label == SIDE_BY_SIDE:
                raw[label] = _side_by_side(n, *job_args, extra=timing)
            else:
                raw[label] = _job(preset, n, rate_mbit, *job_args, timing, pin_cpus)
    single = raw.pop(SINGLE_WORKER)
    advised = raw.pop(SIDE_BY_SIDE, single)
    compute = single["median_seconds"]
    shapes = [tuple(s) for s in single["shapes"]]
    rows = []
    for name in preset_names:
        r = raw[name]
        low, high = _spread(r["step_seconds"])
        row = {
            "preset": name, "workers": workers, "rate_mbit": rate_mbit, "workload": workload,
            "parameters": r["parameters"], "batch_size_per_worker": batch_size,
            "median_ms": 1000 * r["median_seconds"], "min_ms": 1000 * low, "max_ms": 1000 * high,
            "samples_per_second": workers * batch_size / r["median_seconds"],
            "scaling_efficiency": compute / r["median_seconds"],
            "payload_bytes_per_step": r["payload_bytes_per_step"],
            "link_bytes_per_step": r["link_bytes_per_step"],
            "compute_ms": 1000 * compute,
            # Rank 0's CPU seconds per step, all its threads: above the wall time when the worker
            # computes on several CPUs, near it when the CPUs are shared and busy throughout.
            "cpu_ms_per_step": 1000 * r["cpu_seconds_per_step"] if "cpu_seconds_per_step" in r else None,
            "optimizer_state_bytes": (r.get("memory") or {}).get("optimizer_state_bytes"),
            "peak_rss_bytes": 1024 * r["peak_rss_kb"] if r.get("peak_rss_kb") else None,
            "picked": (r.get("auto") or {}).get("picked"),  # what auto ran after measuring
        }
        row.update(_balance_columns(r, workers, batch_size))
        for key in ("seconds_to_target", "epochs_to_target", "final_accuracy", "target_accuracy"):
            if key in r:
                row[key] = r[key]
        if rate_mbit is not None:
            ran = row["picked"] or name
            # The latency per collective this job measured on its link (Horovod's negotiation and a
            # round trip: 1-4 ms here, not the advisor's default of 0.1 ms).
            latency = r.get("latency_seconds") or advisor.DEFAULT_LATENCY_SECONDS
            row["latency_ms"] = 1000 * latency
            predicted = advisor.predict(ran, shapes, workers, rate_mbit * 1e6 / 8, advised["median_seconds"],
                                        latency_seconds=latency,
                                        compressor_seconds=advised.get("compressor_seconds", {}).get(ran, 0.0))
            row["advisor_compute_ms"] = 1000 * advised["median_seconds"]
            row["predicted_ms"] = 1000 * predicted.seconds_per_step
            row["measured_over_predicted"] = row["median_ms"] / row["predicted_ms"]
        if r["link_bytes_per_step"] is not None and r["payload_bytes_per_step"]:
            row["link_over_payload"] = r["link_bytes_per_step"] / r["payload_bytes_per_step"]
        rows.append(row)
    if "sync" in raw:
        for row in rows:
            row["speedup_vs_sync"] = 1000 * raw["sync"]["median_seconds"] / row["median_ms"]
    summary = {"slowdown": slowdown, "pin_cpus": pin_cpus, "single_worker_ms": 1000 * compute,
               "side_by_side_ms": 1000 * advised["median_seconds"] if advised is not single else None,
               "single_worker_forward_ms": 1000 * single["forward_seconds"] if single.get("forward_seconds") else None,
               "single_worker_samples_per_second": batch_size / compute,
               "rows": rows, "raw": raw, "single_worker": single,
               "side_by_side": advised if advised is not single else None}
    (out_dir / "bench.json").write_text(json.dumps(summary, indent=1))
    (out_dir / "bench.md").write_text(markdown_table(rows, compute, workers, rate_mbit, slowdown,
                                                     single.get("forward_seconds"), pin_cpus,
                                                     summary["side_by_side_ms"] and summary["side_by_side_ms"] / 1000))
    chart(rows, out_dir / "bench.png", workers, rate_mbit)
    if any(r.get("share_history") for r in rows):
        shares_chart(rows, out_dir / "bench-shares.png", slowdown)
    return rows


def _balance_columns(result, workers, batch_size):
    """Each worker's share of the global batch and, where measured, its busy ms per step."""
    stats = result.get("balance")
    if not stats:
        return {"shares": [1 / workers] * workers, "busy_ms": None, "share_changes": 0}
    speeds = stats["speeds_rows_per_second"]
    rows = [share * batch_size * workers for share in stats["shares"]]
    busy = None if not speeds else [1000 * n / s for n, s in zip(rows, speeds)]
    return {"shares": stats["shares"], "busy_ms": busy, "share_changes": stats["changes"],
            "share_history": stats["history"], "steps_run": result["warmup_steps"] + result["steps"] + 1}


def _mb(count):
    return None if count is None else count / 1e6


def _fmt(value, spec, missing="–"):
    return missing if value is None else format(value, spec)


def markdown_table(rows, compute_seconds, workers, rate_mbit, slowdown=None, forward_seconds=None, pin_cpus=False,
                   side_by_side_seconds=None):
    link = f"{rate_mbit:g} Mbit/s emulated hosts" if rate_mbit else "loopback"
    link += ", one CPU per worker" if pin_cpus else ""
    slowdown_note = f", slowdown {slowdown} (rank:factor, CPU quota)" if slowdown else ""
    first = rows[0]
    latencies = "/".join(f"{r['latency_ms']:.1f}" for r in rows) if all("latency_ms" in r for r in rows) else ""
    lines = [
        f"{workers} workers, {link}{slowdown_note}; {first['workload']} with {first['parameters']:,} parameters, "
        f"batch {first['batch_size_per_worker']} per worker; one worker alone: {1000 * compute_seconds:.1f} ms/step"
        + (f" (forward and loss {1000 * forward_seconds:.1f} ms: backprop and update "
           f"{1 - forward_seconds / compute_seconds:.0%})" if forward_seconds else "")
        + (f"; {workers} such workers side by side on this machine's CPUs, each step their slowest's "
           f"(the advisor's compute): {1000 * side_by_side_seconds:.1f} ms/step" if side_by_side_seconds else "")
        + (f"; an all-reduce of 4 bytes (the advisor's latency per collective): {latencies} ms" if latencies else "")
        + ".",
        "",
        "| preset | ms/step (median) | min–max | samples/s | vs sync | scaling eff. | payload MB/step "
        "| link MB/step | link/payload | advisor ms | measured/advisor | shares | busy ms/step "
        "| optimizer state MB (rank 0) | peak RSS MB (rank 0) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    digits = "target_accuracy" in first
    if digits:
        lines[2] += f" s to {first['target_accuracy']:g} accuracy | final accuracy |"
        lines[3] += "---|---|"
    for r in rows:
        link_mb = None if r["link_bytes_per_step"] is None else r["link_bytes_per_step"] / 1e6
        target = (f" {_fmt(r['seconds_to_target'], '.1f', 'not reached')} | {r['final_accuracy']:.4f} |"
                  if digits else "")
        label = r["preset"] + (f" (ran {r['picked']})" if r.get("picked") else "")
        lines.append(
            f"| {label} | {r['median_ms']:.1f} | {r['min_ms']:.0f}–{r['max_ms']:.0f} "
            f"| {r['samples_per_second']:.0f} | {_fmt(r.get('speedup_vs_sync'), '.2f')}x "
            f"| {r['scaling_efficiency']:.2f} | {r['payload_bytes_per_step'] / 1e6:.3f} | {_fmt(link_mb, '.3f')} "
            f"| {_fmt(r.get('link_over_payload'), '.3f')} | {_fmt(r.get('predicted_ms'), '.1f')} "
            f"| {_fmt(r.get('measured_over_predicted'), '.2f')} | {'/'.join(f'{x:.2f}' for x in r['shares'])} "
            f"| {'–' if r['busy_ms'] is None else '/'.join(f'{x:.0f}' for x in r['busy_ms'])} "
            f"| {_fmt(_mb(r.get('optimizer_state_bytes')), '.2f')} | {_fmt(_mb(r.get('peak_rss_bytes')), '.0f')} |"
            + target)
    return "\n".join(lines) + "\n"


def chart(rows, path, workers, rate_mbit):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["preset"] for r in rows]
    fig, ax = plt.subplots(figsize=(1.6 * len(rows) + 2, 3.6))
    xs = range(len(rows))
    ax.bar(xs, [r["median_ms"] for r in rows], color="tab:blue", label="measured (median)")
    ax.errorbar(xs, [r["median_ms"] for r in rows],
                yerr=[[r["median_ms"] - r["min_ms"] for r in rows], [r["max_ms"] - r["median_ms"] for r in rows]],
                fmt="none", ecolor="black", capsize=3, label="min–max")
    if all("predicted_ms" in r for r in rows):
        ax.scatter(xs, [r["predicted_ms"] for r in rows], marker="_", s=600, color="tab:red", zorder=3,
                   label="advisor")
    ax.axhline(rows[0]["compute_ms"], color="gray", ls="--", lw=1, label="1 worker, compute only")
    if max(r["max_ms"] for r in rows) > 20 * min(r["min_ms"] for r in rows):
        ax.set_yscale("log")
    ax.set_xticks(list(xs), names)
    ax.set_ylabel("ms per step")
    link = f"{rate_mbit:g} Mbit/s emulated hosts" if rate_mbit else "loopback"
    ax.set_title(f"{workers} workers, {link}, {rows[0]['parameters'] / 1e6:.1f} M parameters")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def shares_chart(rows, path, slowdown=None):
    """Each worker's share of the global batch over the training steps, per balanced preset."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    balanced = [r for r in rows if r.get("share_history")]
    fig, axes = plt.subplots(1, len(balanced), figsize=(5 * len(balanced), 3.4), squeeze=False)
    for ax, row in zip(axes[0], balanced):
        history = row["share_history"]
        last_step = row.get("steps_run") or history[-1]["step"] + 1
        steps = [h["step"] for h in history] + [last_step]
        for worker in range(len(history[0]["shares"])):
            shares = [h["shares"][worker] for h in history]
            ax.step(steps, shares + shares[-1:], where="post", label=f"rank {worker}")
        ax.set_ylim(0, 1)
        ax.set_xlabel("training step")
        ax.set_ylabel("share of each global batch")
        ax.set_title(f"{row['preset']}" + (f" (slowdown {slowdown})" if slowdown else ""))
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
