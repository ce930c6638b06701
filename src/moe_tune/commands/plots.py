"""`moe-tune report --plot FILE.png`: what a sweep measured and why it chose its winner, drawn with matplotlib
(headless).

Left, one entry (`worth_explaining`: of the selected entries, the largest clean win; one entry selected,
e.g. with `--key`: that one): every correct candidate's sweep-round median as a bar, fastest first,
its spread as a whisker; the finalists' re-timed medians of the final round as diamonds beside them; the
winner and the default coloured; when the default was kept for being within noise, the band of times a
candidate had to beat to count as a win; the verdict (and its marks: unverified, weak evidence, low budget)
and the shape in words in the title. Right: each selected entry's speedup over its default, coloured by
verdict, hatched red when marked. Long labels are wrapped, and the figure is saved with a tight bounding box,
so nothing is cut off at any length.
"""

from __future__ import annotations

import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from moe_tune.commands.report import dtype_label, entry_words, shape_label
from moe_tune.core.errors import UsageError, path_error
from moe_tune.profiles.entry import Entry
from moe_tune.profiles.verdict import BEAT_DEFAULT, WITHIN_NOISE, Verdict, low_budget, marks, verdict_of

WINNER, DEFAULT, OTHER, FINAL, BAND = "tab:green", "tab:orange", "tab:blue", "black", "0.85"
_LABEL_WIDTH = 40  # characters per line of a y label
_TITLE_WIDTH = 90  # characters per line of a wrapped key
_VARYING = ("backend", "distribution")  # named in a speedup label when the entries plotted differ in them


def config_label(config: Mapping[str, Any]) -> str:
    """`tm=128 tk=2048 tn=1408 tail=16` (wrapped at word boundaries when long)."""
    return "\n".join(textwrap.wrap(" ".join(f"{k}={v}" for k, v in config.items()), _LABEL_WIDTH)) or "-"


def worth_explaining(entries: Sequence[Entry]) -> Entry:
    """The entry whose candidates the left panel explains: of the wins over the default with nothing to doubt
    (no mark: verified, strong evidence, the whole search space or budget measured), the largest speedup;
    else the entry with the most correct candidates measured (then the largest speedup); ties: the first."""
    def speedup(e: Entry) -> float:
        return e.speedup_over_default or 0.0

    clean = [e for e in entries if verdict_of(e).rule == BEAT_DEFAULT and not marks(e)]
    if clean:
        return max(clean, key=speedup)
    return max(entries, key=lambda e: (sum(1 for r in e.results if r.get("median_s")), speedup(e)))


def speedup_labels(entries: Sequence[Entry]) -> list[str]:
    """One label per entry: kernel, shape (every key field but the dtypes, which follow as people name them),
    and the backend or distribution where the entries differ in them, so that no two rows read alike."""
    varying = [name for name in _VARYING if len({str(e.fields.get(name)) for e in entries}) > 1]
    return [" ".join(part for part in (e.op or "", e.direction or "", shape_label(dict(e.fields)),
                                        dtype_label(dict(e.fields)), *(str(e.fields.get(n)) for n in varying)) if part)
            for e in entries]


def plot_entries(entries: Sequence[Entry], path: str | Path, *, title: str | None = None) -> Path:
    """Draw the candidates and verdict of the entry `worth_explaining` and the speedups of all `entries` into
    `path` (format from its suffix: .png, .svg, .pdf)."""
    if not entries:
        raise UsageError("nothing to plot: no tuned entry matches (run `moe-tune sweep`, or loosen the filters)")
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt
    from matplotlib.backend_bases import FigureCanvasBase

    _check_format(Path(path), FigureCanvasBase.get_supported_filetypes())

    first = worth_explaining(entries)
    results = sorted((r for r in first.results if r.get("median_s")), key=lambda r: r["median_s"])
    rows = max(len(results), len(entries))
    fig, (left, right) = plt.subplots(1, 2, figsize=(16, max(4.5, 0.42 * rows + 2.5)),
                                      gridspec_kw={"width_ratios": [3, 2]})
    _candidates(left, first, results)
    _speedups(right, entries, explained=next(i for i, e in enumerate(entries) if e is first))
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=120, bbox_inches="tight")  # the tight box grows to hold every label and the legend
    except OSError as e:
        raise path_error("cannot write the plot", path, e) from None
    finally:
        plt.close(fig)
    return path


def _check_format(path: Path, formats: dict[str, str]) -> None:
    """UsageError for a file name whose suffix matplotlib cannot write (checked before anything is drawn);
    no suffix writes PNG."""
    suffix = path.suffix.lower().lstrip(".")
    if suffix and suffix not in formats:
        raise UsageError(f"cannot write the plot {path}: matplotlib writes no .{suffix} files; use one of "
                         f"{', '.join('.' + f for f in sorted(formats))}")


def _candidates(ax, entry: Entry, results: list[dict[str, Any]]) -> None:
    """The left panel: sweep-round bars with spread, final-round diamonds, winner / default, verdict."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    verdict = verdict_of(entry)
    winner, default = dict(entry.config), entry.default_config
    medians = [r["median_s"] * 1e3 for r in results]
    colors = [WINNER if r["config"] == winner else DEFAULT if r["config"] == default else OTHER for r in results]
    edges = [DEFAULT if r["config"] == default else "none" for r in results]  # the default kept: green, edged
    ax.barh(range(len(results)), medians, xerr=_whiskers(results), color=colors, edgecolor=edges, linewidth=2,
            error_kw={"ecolor": "0.35", "capsize": 2, "linewidth": 0.8})
    ax.set_yticks(range(len(results)), [config_label(r["config"]) for r in results], fontsize=7)
    row = {_key(r["config"]): i for i, r in enumerate(results)}
    finals = [(row[_key(f["config"])], f) for f in verdict.finalists
              if f.get("median_s") and _key(f["config"]) in row]
    if finals:
        ax.errorbar([f["median_s"] * 1e3 for _, f in finals], [i for i, _ in finals],
                    xerr=_whiskers([f for _, f in finals]),
                    fmt="D", color=FINAL, markersize=6, capsize=3, linewidth=1, zorder=3)
    handles = [Patch(color=WINNER, label="winner"), Patch(color=DEFAULT, label="default"),
               Patch(color=OTHER, label="other candidate"),
               Line2D([], [], color="0.35", linewidth=0.8, label="sweep round: min to max"),
               Line2D([], [], color=FINAL, marker="D", linestyle="none",
                      label="final round: re-timed median, min to max")]
    if winner == default:
        handles[0] = Patch(facecolor=WINNER, edgecolor=DEFAULT, linewidth=2, label="winner = default")
    band = _noise_band(entry, verdict)
    if band is not None:
        ax.axvspan(*band, color=BAND, zorder=0)
        handles.append(Patch(color=BAND, label=f"within noise of the default (+-{verdict.noise:.0%}): not a win"))
    ax.invert_yaxis()
    ax.set_xlim(left=0)
    ax.set_xlabel("median time (ms)")
    _legend_below(ax, handles, ncol=3)
    found = marks(entry)
    lines = [f"verdict: {verdict.label}" + (f" [{', '.join(found).upper()}]" if found else ""),
             *textwrap.wrap(entry_words(entry), _TITLE_WIDTH),
             f"{len(results)} correct candidates, {len(entry.failures)} failed or wrong"
             + (f"; {low_budget(entry)}" if low_budget(entry) else "")]
    if verdict.derived:
        lines += textwrap.wrap("derived: the entry predates recorded verdicts, so the noise is from the default's "
                               "samples alone and a finalist's bar may be its re-timed median", _TITLE_WIDTH + 20)
    ax.set_title("\n".join(lines), fontsize=8, loc="left")


def _whiskers(timings: Sequence[Mapping[str, Any]]) -> list[list[float]]:
    """[[below], [above]] the median (ms) of each timing record: to its min and max where recorded, else the
    spread (max - min, all an older entry kept) centred on the median, cut at zero."""
    below, above = [], []
    for t in timings:
        median = t["median_s"] * 1e3
        if t.get("min_s") is not None and t.get("max_s") is not None:
            low, high = median - t["min_s"] * 1e3, t["max_s"] * 1e3 - median
        else:
            low = high = (t.get("spread") or 0.0) * median / 2
        below.append(min(low, median))
        above.append(high)
    return [below, above]


def _noise_band(entry: Entry, verdict: Verdict) -> tuple[float, float] | None:
    """(low, high) ms of the times that were within noise of the kept default, or None."""
    default_ms = next((f["median_s"] * 1e3 for f in verdict.finalists if f.get("is_default") and f.get("median_s")),
                      None)
    if verdict.rule != WITHIN_NOISE or verdict.noise is None or default_ms is None:
        return None
    return default_ms / (1 + verdict.noise), default_ms


def _speedups(ax, entries: Sequence[Entry], explained: int = 0) -> None:
    """The right panel: each entry's speedup over its default, coloured by how its winner was chosen; the
    label of the entry the left panel explains (`explained`, its index) in bold."""
    from matplotlib.patches import Patch

    labels = speedup_labels(entries)
    # grey where the default won: kept within noise, or the fastest itself (a speedup of 1, not a win)
    kept = [e.default_config is not None and dict(e.config) == dict(e.default_config) for e in entries]
    bars = ax.barh(range(len(entries)), [e.speedup_over_default or 0.0 for e in entries],
                   color=["0.6" if k else "tab:purple" for k in kept])
    doubtful = [bool(marks(e)) for e in entries]  # unverified, weak evidence, low budget: hatched
    for bar, flagged in zip(bars, doubtful):
        if flagged:
            bar.set_hatch("//")
            bar.set_edgecolor("tab:red")
    ax.set_yticks(range(len(entries)), ["\n".join(textwrap.wrap(label, 2 * _LABEL_WIDTH)) for label in labels],
                  fontsize=7)
    ax.get_yticklabels()[explained].set_fontweight("bold")
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.invert_yaxis()
    ax.set_xlabel("speedup over the default config")
    ax.set_title("speedup per shape", fontsize=9)
    handles = [Patch(color="tab:purple", label="a win over the default"),
               Patch(color="0.6", label="the default kept (fastest, within noise or unverified)")]
    if any(doubtful):
        handles.append(Patch(facecolor="white", edgecolor="tab:red", hatch="//",
                             label="unverified, weak evidence or low budget"))
    _legend_below(ax, handles, ncol=len(handles))


def _key(config: Mapping[str, Any]) -> tuple:
    return tuple(sorted(config.items()))


def _legend_below(ax: Any, handles: list[Any], ncol: int) -> None:
    """The legend under the axis label: offset in inches from the axes' bottom, so that it clears the tick
    labels and the x label however short the axes are (a fraction of the axes' height does not)."""
    from matplotlib.transforms import ScaledTranslation

    below = ax.transAxes + ScaledTranslation(0, -0.5, ax.figure.dpi_scale_trans)
    ax.legend(handles=handles, fontsize=7, ncol=ncol, loc="upper left", bbox_to_anchor=(0.0, 0.0),
              bbox_transform=below)
