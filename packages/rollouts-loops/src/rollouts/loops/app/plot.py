"""`rollouts plot RUN_DIR`: one PNG of loss, reward, accuracy, KL, entropy and lr over steps."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rollouts.loops.run.loggers import read_jsonl

PANELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("loss", ("loss", "sft/loss", "rl/loss")),
    ("reward", ("reward_mean", "rl/reward_mean")),
    ("accuracy", ("accuracy", "eval/accuracy")),
    ("KL", ("kl", "approx_kl")),
    ("entropy", ("entropy",)),
    ("learning rate", ("lr",)),
)
"""(panel title, metric keys plotted in it)."""


def _series(records: Sequence[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for r in records:
        value = r.get(key)
        if isinstance(value, (int, float)) and math.isfinite(value):
            xs.append(r.get("global_step", r["step"]))
            ys.append(float(value))
    return xs, ys


def plot_run(run_dir: str | Path, *, out: str | Path | None = None) -> Path:
    """Plot every metrics*.jsonl in `run_dir` into `run_dir/metrics.png` (or `out`); returns the path."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError("plotting needs matplotlib: pip install 'rollouts-loops[plot]'") from e
    run_dir = Path(run_dir)
    files = sorted(run_dir.glob("metrics*.jsonl"))
    if not files:
        raise ValueError(f"{run_dir}: no metrics*.jsonl file to plot")
    runs = {f.stem.removeprefix("metrics").strip("_-") or "train": read_jsonl(f) for f in files}
    fig, axes = plt.subplots(2, 3, figsize=(14, 7), constrained_layout=True)
    for ax, (title, keys) in zip(axes.flat, PANELS, strict=True):
        drawn = False
        for phase, records in runs.items():
            for key in keys:
                xs, ys = _series(records, key)
                if xs:
                    ax.plot(xs, ys, marker="." if len(xs) < 50 else None, label=f"{phase}: {key}")
                    drawn = True
        ax.set_title(title)
        ax.set_xlabel("step")
        if drawn:
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="gray")
    out_path = Path(out) if out is not None else run_dir / "metrics.png"
    fig.savefig(out_path, dpi=90)
    plt.close(fig)
    return out_path
