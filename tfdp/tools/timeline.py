"""Read Horovod's timeline (``tfdp run --timeline FILE``) and draw a window of it.

Horovod writes a Chrome trace (open it in ``chrome://tracing`` or Perfetto): one track per
collective tensor (or fused group), with nested phases: ``NEGOTIATE_ALLREDUCE`` (waiting until
every worker has submitted the tensor), ``ALLREDUCE`` and inside it ``GLOO_ALLREDUCE`` (the
transfer), and the same for all-gathers and broadcasts. `load` turns it into intervals,
`summary` totals each phase, and `draw` renders the last milliseconds as a PNG, one row per
track (``tfdp timeline FILE --png step.png``).

Example:
    >>> spans = load("timeline.json")
    >>> summary(spans)["GLOO_ALLREDUCE"]["count"]
"""

import json
from collections import defaultdict
from dataclasses import dataclass


@dataclass(frozen=True)
class Span:
    """One phase of one track: `name` from `start` to `end` (microseconds), nested `depth` deep."""

    track: str
    name: str
    start: float
    end: float
    depth: int

    @property
    def duration(self):
        return self.end - self.start


def _events(path):
    text = open(path).read().rstrip()
    if not text.endswith("]"):  # a job that was ended leaves the array open
        text = text.rstrip(",") + "]"
    return json.loads(text)


def load(path):
    """The completed phases of a Horovod timeline file, as `Span`s in order of start."""
    tracks, open_phases, spans = {}, defaultdict(list), []
    for event in _events(path):
        pid, phase = event.get("pid"), event.get("ph")
        if phase == "M":
            if event.get("name") == "process_name" and "name" in event.get("args", {}):
                tracks[pid] = event["args"]["name"]
        elif phase == "B":
            open_phases[pid].append((event["name"], event["ts"]))
        elif phase == "E" and open_phases[pid]:
            name, start = open_phases[pid].pop()
            spans.append(Span(tracks.get(pid, str(pid)), name, start, event["ts"], len(open_phases[pid])))
    return sorted(spans, key=lambda s: (s.start, s.depth))


def summary(spans):
    """Per phase name: how many and their total and median milliseconds."""
    by_name = defaultdict(list)
    for span in spans:
        by_name[span.name].append(span.duration / 1000)
    result = {}
    for name, durations in sorted(by_name.items()):
        durations.sort()
        result[name] = {"count": len(durations), "total_ms": sum(durations),
                        "median_ms": durations[len(durations) // 2]}
    return result


def draw(spans, png, last_ms=200.0, title=None, end_ms=None):
    """Draw `last_ms` milliseconds of `spans` into `png`, one row per track: the last ones, or
    those before `end_ms` (milliseconds since the timeline began)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not spans:
        raise ValueError("tfdp timeline: the file holds no completed collective; was the job run with "
                         "`tfdp run --timeline FILE` and did it reach its first step?")
    end = max(s.end for s in spans) if end_ms is None else end_ms * 1000
    shown = [s for s in spans if s.end >= end - last_ms * 1000 and s.start <= end]
    if not shown:
        raise ValueError(f"tfdp timeline: nothing in the {last_ms:g} ms before {end / 1000:g} ms; "
                         f"the timeline spans 0 to {max(s.end for s in spans) / 1000:g} ms.")
    tracks = list(dict.fromkeys(s.track for s in shown))
    names = list(dict.fromkeys(s.name for s in shown))
    colours = {name: plt.get_cmap("tab10")(i % 10) for i, name in enumerate(names)}
    figure, axes = plt.subplots(figsize=(11, 1.2 + 0.45 * len(tracks)))
    for s in shown:
        row = tracks.index(s.track)
        height = 0.8 - 0.2 * s.depth
        axes.barh(row, max(s.duration, 1) / 1000, left=(s.start - end) / 1000 + last_ms, height=height,
                  color=colours[s.name], label=s.name, edgecolor="none")
    handles = {label: h for h, label in zip(*axes.get_legend_handles_labels())}
    axes.legend(handles.values(), handles.keys(), loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    axes.set_yticks(range(len(tracks)), [t if len(t) < 40 else t[:37] + "..." for t in tracks], fontsize=7)
    axes.set_xlim(0, last_ms)
    axes.set_xlabel(f"milliseconds, the {last_ms:g} ms up to {end / 1000:g} ms since the timeline began")
    axes.set_title(title or "Horovod timeline")
    axes.invert_yaxis()
    figure.tight_layout()
    figure.savefig(png, dpi=110)
    plt.close(figure)


def format_summary(spans):
    """`summary` as aligned text lines."""
    lines = [f"{'phase':<24} {'count':>7} {'total ms':>10} {'median ms':>10}"]
    for name, row in summary(spans).items():
        lines.append(f"{name:<24} {row['count']:>7} {row['total_ms']:>10.1f} {row['median_ms']:>10.3f}")
    return "\n".join(lines)


__all__ = ["Span", "draw", "format_summary", "load", "summary"]
