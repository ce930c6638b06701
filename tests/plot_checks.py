"""What a report plot must show, read from the matplotlib figure `plot_entries` draws (shared by the report
and CLI tests)."""

from __future__ import annotations

import matplotlib.colors
import pytest
from matplotlib.container import BarContainer, ErrorbarContainer

from moe_tune.commands.report import entry_words
from moe_tune.profiles.entry import Entry
from moe_tune.profiles.verdict import verdict_of


@pytest.fixture
def drawn(monkeypatch):
    """The matplotlib figures `plot_entries` draws, kept open for the test to read (closed after it)."""
    import matplotlib.pyplot as plt

    figures = []
    close = plt.close
    monkeypatch.setattr(plt, "close", figures.append)
    yield figures
    for fig in figures:
        close(fig)


def check_plot(fig, entries) -> None:
    """The plot's two axes hold the data of `entries`: the correct candidates of the entry worth explaining
    (`plots.worth_explaining`) as bars of their median time in ms, fastest first, labelled by config, the
    winner green, its finalists' re-timed medians as markers, its verdict in the title; every entry's speedup
    in order, the explained one's label in bold."""
    from moe_tune.commands.plots import worth_explaining

    entries = [Entry.from_json(e) if isinstance(e, dict) else e for e in entries]  # `Entry`s or their JSON
    left, right = fig.axes
    assert left.get_xlabel() == "median time (ms)" and right.get_xlabel() == "speedup over the default config"
    first = worth_explaining(entries)
    results = sorted((r for r in first.results if r.get("median_s")), key=lambda r: r["median_s"])
    assert len(results) >= 2
    bars = _bars(left)
    finals = next(c for c in left.containers if isinstance(c, ErrorbarContainer) and c.lines[0] is not None)
    assert [b.get_width() for b in bars] == pytest.approx([r["median_s"] * 1e3 for r in results])
    labels = [t.get_text().replace("\n", " ") for t in left.get_yticklabels()]
    assert labels == [" ".join(f"{k}={v}" for k, v in r["config"].items()) for r in results]
    winner = labels.index(" ".join(f"{k}={v}" for k, v in first.config.items()))
    assert bars[winner].get_facecolor()[:3] == pytest.approx(matplotlib.colors.to_rgb("tab:green"))
    verdict = verdict_of(first)
    title = left.get_title(loc="left")
    assert f"verdict: {verdict.label}" in title and entry_words(first) in title.replace("\n", " ")  # in words
    # the final round: one marker per finalist, at its re-timed median, on its config's row
    marker_x, marker_y = finals.lines[0].get_data()
    assert sorted(marker_x) == pytest.approx(sorted(f["median_s"] * 1e3 for f in verdict.finalists))
    assert labels[int(marker_y[0])] == " ".join(f"{k}={v}" for k, v in verdict.finalists[0]["config"].items())
    assert len(left.get_legend().get_texts()) >= 5
    assert [b.get_width() for b in _bars(right)] == pytest.approx(
        [e.speedup_over_default or 0.0 for e in entries])
    grey = [b.get_facecolor()[:3] == pytest.approx((0.6,) * 3) for b in _bars(right)]
    assert grey == [e.default_config is not None and dict(e.config) == dict(e.default_config) for e in entries]
    right_labels = [t.get_text() for t in right.get_yticklabels()]
    assert len(right_labels) == len(entries)
    assert [t.get_fontweight() == "bold" for t in right.get_yticklabels()] == [e is first for e in entries]
    for label, entry in zip(right_labels, entries):  # each bar is labelled by its own entry's shape
        sizes = {k: v for k, v in entry.fields.items() if k in ("m", "k", "n", "groups", "tokens", "hidden")}
        assert sizes and all(f"{k}={v}" in label.split() for k, v in sizes.items()), (label, entry.fields)
        assert entry.fields.get("direction", "") in label


def _bars(ax) -> list:
    return next(c for c in ax.containers if isinstance(c, BarContainer)).patches
