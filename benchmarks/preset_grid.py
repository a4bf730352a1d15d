"""Every shipped preset against sync on a grid of ordinary configurations, 2 workers, 3 seeds.

    .venv/bin/python benchmarks/preset_grid.py                    # the whole grid (about 2-3 hours on 2 cores)
    .venv/bin/python benchmarks/preset_grid.py --cells digits-mlp-sgd-64 --presets topk-1pct async-s1
    .venv/bin/python benchmarks/preset_grid.py --resume                 # run the cells not yet in the results
    .venv/bin/python benchmarks/preset_grid.py --resume --replace --presets qsgd  # rerun qsgd where it ran

Cells: (dataset, model) in {(digits, conv), (digits, mlp), (breast_cancer, mlp)} x optimizer in
{momentum SGD (0.05, 0.9), Adam (2e-3)} x global batch in {32, 128}, named like
``digits-conv-sgd-32``. Each cell is one horovodrun job that trains sync and every preset for
every seed, 20 epochs, and reads the test accuracy after 12 epochs (the short budget) and 20
(the long budget) of the same runs. A cell name with another batch (``digits-mlp-sgd-64``) or
``--epochs`` runs that configuration too.

Writes ``benchmarks/results/preset_grid.json`` (every run) and ``preset_grid.md``: per cell,
budget and preset, the mean test accuracy minus sync in percentage points with its standard
error over seeds (of the per-seed differences), the gradient bytes per step one worker sent,
and the exchanges per step. Also ``strategies/accuracy.json`` (``OUT.accuracy.json`` for
another ``--out``), per preset the (cell, budget) pairs measured, how many are within 1 pp
of sync and the worst one: what `tfdp advise` reports and what `tfdp.AutoStrategy` chooses
its candidates from.

    .venv/bin/python benchmarks/preset_grid.py --summary-only     # rewrite accuracy.json from the json
"""

import argparse
import itertools
import json
import statistics
import tempfile
from pathlib import Path

import _launch

HERE = Path(__file__).resolve().parent
WORKER = HERE / "_preset_worker.py"
PRESETS = ["fp16", "bf16", "qsgd", "topk-1pct", "efsign", "powersgd-r4", "async-s1", "async-s2", "local-sgd-h16"]
MODELS = [("digits", "conv"), ("digits", "mlp"), ("breast_cancer", "mlp")]
CELLS = [f"{d}-{m}-{o}-{b}" for (d, m), o, b in itertools.product(MODELS, ["sgd", "adam"], [32, 128])]
BAND_PP = 1.0
DEFAULT_OUT = HERE / "results" / "preset_grid"
SUMMARY = HERE.parent / "strategies" / "accuracy.json"


def parse_cell(name):
    dataset, model, optimizer, batch = name.rsplit("-", 3)
    return dataset, model, optimizer, int(batch)


def run_cell(cell, presets, seeds, epochs, report_epochs, with_sync=True):
    dataset, model, optimizer, batch = parse_cell(cell)
    with tempfile.TemporaryDirectory() as out:
        ranks = _launch.run_job(WORKER, out, ["--dataset", dataset, "--model", model, "--optimizer", optimizer,
                                              "--batch-size", batch, "--epochs", epochs, "--report-epochs",
                                              *report_epochs, "--seeds", *seeds, "--configs",
                                              *(["sync"] if with_sync else []), *presets],
                                timeout=7200)
    return [dict(run, cell=cell) for run in ranks[0]]


def summarise(runs, report_epochs):
    """Rows (cell, epochs, preset, mean pp, standard error pp, bytes/step, rounds/step)."""
    rows = []
    for cell in dict.fromkeys(r["cell"] for r in runs):
        in_cell = [r for r in runs if r["cell"] == cell]
        sync = {r["seed"]: r for r in in_cell if r["config"] == "sync"}
        order = ["sync", *PRESETS]
        configs = sorted(dict.fromkeys(r["config"] for r in in_cell),
                         key=lambda c: order.index(c) if c in order else len(order))
        for epochs, preset in itertools.product(report_epochs, configs):
            runs_of = [r for r in in_cell if r["config"] == preset]
            diffs = [100 * (r["accuracy"][str(epochs)] - sync[r["seed"]]["accuracy"][str(epochs)]) for r in runs_of]
            se = statistics.stdev(diffs) / len(diffs) ** 0.5 if len(diffs) > 1 else float("nan")
            # Over the whole run (20 epochs): local SGD's exchanges do not fall in every epoch.
            stats = runs_of[0]["stats"]
            rows.append({"cell": cell, "epochs": epochs, "preset": preset, "diff_pp": statistics.mean(diffs),
                         "se_pp": se, "accuracy": statistics.mean(r["accuracy"][str(epochs)] for r in runs_of),
                         "bytes_per_step": statistics.mean(r["stats"]["gradient_bytes"] / r["stats"]["steps"]
                                                           for r in runs_of),
                         "dense_bytes_per_step": stats["dense_bytes"] / stats["steps"],
                         "rounds_per_step": stats["rounds"] / max(stats["steps"], 1), "seeds": len(diffs)})
    return rows


def accuracy_summary(rows):
    """Per preset: (cell, budget) pairs measured, how many within `BAND_PP` of sync, the worst."""
    summary = {}
    for preset in dict.fromkeys(r["preset"] for r in rows if r["preset"] != "sync"):
        mine = [r for r in rows if r["preset"] == preset]
        worst = min(mine, key=lambda r: r["diff_pp"])
        summary[preset] = {"cells": len(mine), "within_band": sum(r["diff_pp"] >= -BAND_PP for r in mine),
                           "band_pp": BAND_PP, "worst_pp": round(worst["diff_pp"], 2),
                           "worst": f"{worst['cell']}, {worst['epochs']} epochs"}
    return summary


def write_summary(rows, out):
    """The shipped summary for the default results; ``OUT.accuracy.json`` beside any other --out."""
    shipped = Path(out).resolve() == DEFAULT_OUT
    path = SUMMARY if shipped else Path(f"{out}.accuracy.json")
    source = "benchmarks/results/preset_grid.md" if shipped else f"{out}.md"
    path.write_text(json.dumps({"source": f"{source} (2 workers, 3 seeds)",
                                "presets": accuracy_summary(rows)}, indent=1) + "\n")


def markdown(rows):
    lines = ["| cell | epochs | preset | accuracy | vs sync (pp) | ± s.e. | gradient kB/step | fewer bytes | "
             "exchanges/step |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        flag = " **" if r["preset"] != "sync" and r["diff_pp"] < -BAND_PP else ""
        lines.append(f"| {r['cell']} | {r['epochs']} | {r['preset']} | {r['accuracy']:.4f} | "
                     f"{flag}{r['diff_pp']:+.2f}{flag.strip() and '**'} | {r['se_pp']:.2f} | "
                     f"{r['bytes_per_step'] / 1e3:.1f} | {r['dense_bytes_per_step'] / r['bytes_per_step']:.1f}x | "
                     f"{r['rounds_per_step']:.3f} |")
    return "\n".join(lines) + "\n"


def pivot(rows):
    """One line per (cell, budget), one column per preset: mean pp vs sync, bold beyond the band."""
    presets = [p for p in dict.fromkeys(r["preset"] for r in rows) if p != "sync"]
    value = {(r["cell"], r["epochs"], r["preset"]): r["diff_pp"] for r in rows}
    lines = ["| cell | epochs | " + " | ".join(presets) + " |", "|---|---|" + "---|" * len(presets)]
    for cell, epochs in dict.fromkeys((r["cell"], r["epochs"]) for r in rows):
        cells = []
        for preset in presets:
            diff = value.get((cell, epochs, preset))
            text = "" if diff is None else f"{diff:+.1f}"
            cells.append(f"**{text}**" if diff is not None and diff < -BAND_PP else text)
        lines.append(f"| {cell} | {epochs} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", nargs="+", default=CELLS)
    parser.add_argument("--presets", nargs="+", default=PRESETS, help="presets or variants (NAME:key=value,...)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--report-epochs", nargs="+", type=int, default=[12, 20])
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    parser.add_argument("--resume", action="store_true", help="keep the cells already in --out's json, run the rest")
    parser.add_argument("--replace", action="store_true",
                        help="with --resume: in cells already run, run --presets again (not sync) "
                             "and replace their runs")
    parser.add_argument("--summary-only", action="store_true", help="rewrite the accuracy summary from --out's json and stop")
    args = parser.parse_args()
    if args.summary_only:
        write_summary(json.loads(Path(f"{args.out}.json").read_text())["rows"], args.out)
        return
    runs = json.loads(Path(f"{args.out}.json").read_text())["runs"] if args.resume else []
    done = {r["cell"] for r in runs}
    for cell in [c for c in args.cells if c not in done or args.replace]:
        if cell in done:
            runs = [r for r in runs if not (r["cell"] == cell and r["config"] in args.presets)]
        runs += run_cell(cell, args.presets, args.seeds, args.epochs, args.report_epochs, with_sync=cell not in done)
        rows = summarise(runs, args.report_epochs)
        Path(f"{args.out}.json").write_text(json.dumps({"args": vars(args), "runs": runs, "rows": rows}, indent=1))
        Path(f"{args.out}.md").write_text(pivot(rows) + "\n" + markdown(rows))
        print(markdown([r for r in rows if r["cell"] == cell]), flush=True)
    rows = summarise(runs, args.report_epochs)
    Path(f"{args.out}.md").write_text(pivot(rows) + "\n" + markdown(rows))
    write_summary(rows, args.out)
    failing = [r for r in rows if r["preset"] != "sync" and r["diff_pp"] < -BAND_PP]
    print(f"{len(failing)} (cell, budget, preset) more than {BAND_PP} pp below sync:")
    for r in failing:
        print(f"  {r['cell']} {r['epochs']} epochs {r['preset']}: {r['diff_pp']:+.2f} ± {r['se_pp']:.2f} pp")


if __name__ == "__main__":
    main()
