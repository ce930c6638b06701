"""`moe-tune report --plot FILE.png`: what a sweep measured, drawn with matplotlib (headless).

Left: the time of every correct candidate of one entry (its shape's sweep), fastest first, the winner and
the default marked. Right: each selected entry's speedup over its default config, one bar per shape.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from moe_tune.errors import UsageError
from moe_tune.profiles.entry import Entry


def _label(config: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in config.items()) or "-"


def plot_entries(entries: Sequence[Entry], path: str | Path, *, title: str | None = None) -> Path:
    """Draw the candidates of `entries[0]` and the speedups of all `entries` into `path` (format from its
    suffix: .png, .svg, .pdf)."""
    if not entries:
        raise UsageError("nothing to plot: no tuned entry matches (run `moe-tune sweep`, or loosen the filters)")
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    first = entries[0]
    results = sorted((r for r in first.results if r.get("median_s")), key=lambda r: r["median_s"])
    fig, (left, right) = plt.subplots(1, 2, figsize=(14, max(4.0, 0.28 * max(len(results), len(entries)) + 1.5)))

    winner, default = first.config, first.default_config
    colors = ["tab:green" if r["config"] == winner else "tab:orange" if r["config"] == default else "tab:blue"
              for r in results]
    left.barh([_label(r["config"]) for r in results], [r["median_s"] * 1e3 for r in results], color=colors)
    left.invert_yaxis()
    left.set_xlabel("median time (ms)")
    failed = len(first.failures)
    left.set_title(f"{first.key}\n{len(results)} correct candidates, {failed} failed or wrong "
                   "(green: winner, orange: default)", fontsize=8)
    left.tick_params(axis="y", labelsize=7)

    labels = [f"{e.op or ''} {e.direction or ''} "
              + " ".join(f"{k}={v}" for k, v in e.fields.items() if k in ("m", "k", "n", "groups", "tokens",
                                                                           "hidden")) for e in entries]
    speedups = [e.speedup_over_default or 0.0 for e in entries]
    right.barh(labels, speedups, color="tab:purple")
    right.axvline(1.0, color="black", linewidth=0.8)
    right.invert_yaxis()
    right.set_xlabel("speedup over the default config")
    right.tick_params(axis="y", labelsize=7)
    right.set_title("speedup per shape", fontsize=9)

    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
