"""Plots of evaluation reports (PNG, matplotlib's non-interactive Agg backend; matplotlib: a dependency of stam-lab).

- ``plot_timeline``: a patient's ACTIVE and HISTORY sizes over clinical time, one line pair per variant
  (from the ``timeline`` a state report carries, computed from the transition log by ``timeline``).
- ``plot_score_vs_tokens``: each QA system's score against its mean served tokens.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from schemas import Store, TransitionEvent, TransitionKind


def timeline(events: Iterable[TransitionEvent], *, max_points: int = 400) -> list[tuple[str, int, int]]:
    """(clinical time, ACTIVE size, HISTORY size) after each applied entry, in log order, read from the
    transition log alone. Entries without a clinical time keep the previous point's time. At most
    ``max_points`` points (evenly thinned, the last always kept)."""
    store: dict[str, Store] = {}
    points: list[tuple[str, int, int]] = []
    current_entry: str | None = None
    when: str | None = None

    def close() -> None:
        if current_entry is not None and when is not None:
            active = sum(s is Store.ACTIVE for s in store.values())
            points.append((when, active, len(store) - active))

    for e in events:
        if e.entry_id != current_entry:
            close()
            current_entry = e.entry_id
        if e.clinical_time is not None:
            t = e.clinical_time.isoformat()
            when = t if when is None or t > when else when
        if e.kind in (TransitionKind.ADDED, TransitionKind.ARCHIVED) and e.to_store is not None:
            store[e.memory_id] = e.to_store
    close()
    if len(points) > max_points:
        step = len(points) / max_points
        points = [points[int(i * step)] for i in range(max_points - 1)] + [points[-1]]
    return points


def _pyplot() -> Any:
    try:
        # deferred: optional matplotlib (the lab's), not installed everywhere
        import matplotlib
    except ImportError as exc:  # an optional dependency: say how to get it
        raise RuntimeError("plots need matplotlib: pip install -e lab (or matplotlib>=3.8)") from exc
    matplotlib.use("Agg")
    # deferred: optional matplotlib (the lab's), not installed everywhere
    import matplotlib.pyplot as plt

    return plt


def plot_timeline(series: Sequence[tuple[str, Sequence[Sequence[Any]]]], out: Path, *, title: str) -> Path:
    """``series``: (variant, [(iso time, active, history), ...]) per variant, one patient."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for i, (name, points) in enumerate(series):
        if not points:
            continue
        x = [datetime.fromisoformat(p[0]) for p in points]
        color = f"C{i}"
        ax.step(x, [p[1] for p in points], where="post", color=color, label=f"{name}: ACTIVE")
        ax.step(x, [p[2] for p in points], where="post", color=color, linestyle="--", label=f"{name}: HISTORY")
    ax.set_xlabel("clinical time")
    ax.set_ylabel("memories")
    ax.set_title(title)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.autofmt_xdate()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def plot_score_vs_tokens(systems: dict[str, dict[str, Any]], out: Path, *, score: str, title: str) -> Path:
    """One point per system: its ``score`` (a key of the system's summary) against mean served tokens."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (name, s) in enumerate(systems.items()):
        if s.get(score) is None:
            continue
        ax.scatter([s["tokens_mean"]], [s[score]], color=f"C{i}", s=50)
        ax.annotate(name, (s["tokens_mean"], s[score]), textcoords="offset points", xytext=(6, 4), fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel("served tokens per question (mean, log scale)")
    ax.set_ylabel(score.replace("_", " "))
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
