"""What a report plot must show, read from the matplotlib figure `plot_entries` draws (shared by the report
and CLI tests)."""

from __future__ import annotations

import matplotlib.colors
import pytest


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
    """The plot's two axes hold the data of `entries`: the first entry's correct candidates as bars of their
    median time in ms, fastest first, labelled by config, the winner green; every entry's speedup in order."""
    entries = [e.to_json() if hasattr(e, "to_json") else e for e in entries]  # `Entry`s or their JSON
    left, right = fig.axes
    assert left.get_xlabel() == "median time (ms)" and right.get_xlabel() == "speedup over the default config"
    first = entries[0]
    results = sorted((r for r in first["results"] if r.get("median_s")), key=lambda r: r["median_s"])
    assert len(results) >= 2
    assert [b.get_width() for b in left.patches] == pytest.approx([r["median_s"] * 1e3 for r in results])
    labels = [t.get_text() for t in left.get_yticklabels()]
    assert labels == [" ".join(f"{k}={v}" for k, v in r["config"].items()) for r in results]
    winner = labels.index(" ".join(f"{k}={v}" for k, v in first["config"].items()))
    assert left.patches[winner].get_facecolor()[:3] == pytest.approx(matplotlib.colors.to_rgb("tab:green"))
    assert first["key"] in left.get_title()
    assert [b.get_width() for b in right.patches] == pytest.approx(
        [e.get("speedup_over_default") or 0.0 for e in entries])
    right_labels = [t.get_text() for t in right.get_yticklabels()]
    assert len(right_labels) == len(entries)
    for label, entry in zip(right_labels, entries):  # each bar is labelled by its own entry's shape
        sizes = {k: v for k, v in entry["fields"].items() if k in ("m", "k", "n", "groups", "tokens", "hidden")}
        assert sizes and all(f"{k}={v}" in label.split() for k, v in sizes.items()), (label, entry["fields"])
        assert entry["fields"].get("direction", "") in label
