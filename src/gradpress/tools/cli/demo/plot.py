"""The demo's figure (``demo.png``): loss, metric and bytes against steps and bytes for every method;
needs matplotlib."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .report import plural


_STYLES = (("-", "o", 2.6), ("--", "s", 1.6), ("-.", "^", 1.6), (":", "D", 1.9), ("-", "v", 1.2), ("--", "x", 1.2))


def _plain_log_ticks(axis: Any) -> None:
    """Label a log axis at 1, 2, 5 x 10^k with plain numbers and no minor labels (they overlap)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    axis.set_minor_formatter(NullFormatter())


def plot(summary: dict[str, Any], path: Path) -> bool:
    """Write :func:`make_figure`'s figure to ``path``; ``False`` without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig = make_figure(summary)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def make_figure(summary: dict[str, Any]) -> Any:
    """The demo's 2x2 matplotlib figure (needs matplotlib).

    Left: test metric and train loss vs step, with the end of the plain-allreduce warm-up marked.
    Right: the same vs MB each worker sent *after* the warm-up (log axis): during the warm-up every
    method sends what allreduce sends, which would squeeze the compressed methods into one smear.
    """
    import matplotlib.pyplot as plt

    accuracy = summary["metric_name"] == "accuracy"
    start = summary["config"]["start_iter"]
    metric = "test accuracy" if accuracy else "test perplexity per character (log)"
    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5), constrained_layout=True)
    sent_anything = False
    for i, m in enumerate(summary["methods"].values()):
        linestyle, marker, width = _STYLES[i % len(_STYLES)]
        style = {"label": m["label"], "color": f"C{i % 10}", "linestyle": linestyle, "marker": marker,
                 "markersize": 3.5, "linewidth": width}
        curve = m["curve"]
        steps = [c["step"] for c in curve]
        axes[0][0].plot(steps, [c["metric"] for c in curve], **style)
        axes[1][0].plot(steps[1:], [c["train_loss"] for c in curve[1:]], **style)  # step 0 has no train loss
        after = [c for c in curve if c["step"] > start and c["bytes"] > m["bytes_warm_up"]]
        if after:
            sent_anything = True
            mb = [(c["bytes"] - m["bytes_warm_up"]) / 1e6 for c in after]
            axes[0][1].plot(mb, [c["metric"] for c in after], **style)
            axes[1][1].plot(mb, [c["train_loss"] for c in after], **style)
    for row, ylabel in ((0, metric), (1, "train loss (log)")):
        for col in (0, 1):
            ax = axes[row][col]
            ax.set_ylabel(ylabel)
            ax.grid(True, alpha=0.3)
            if row == 1 or not accuracy:
                ax.set_yscale("log")
                _plain_log_ticks(ax.yaxis)
        axes[row][0].set_xlabel("step")
        axes[row][0].axvline(start, color="grey", linestyle=":", linewidth=1.2,
                             label=f"step {start}: warm-up ends, compression / local steps start")
        axes[row][1].set_xlabel(f"MB sent per worker after the {start} warm-up steps (log)")
        if sent_anything:
            axes[row][1].set_xscale("log")
            _plain_log_ticks(axes[row][1].xaxis)
        else:
            axes[row][1].text(0.5, 0.5, "nothing was sent (1 worker)", ha="center", va="center",
                              transform=axes[row][1].transAxes)
    axes[0][0].set_title("vs training step")
    axes[0][1].set_title("vs bytes sent once the methods differ")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"gradpress demo: {summary['task']}, {plural(summary['workers'], 'worker')}, "
                 f"{summary['config']['steps']} steps (dotted line: end of the {start}-step warm-up, where "
                 "every method communicates every step)")
    return fig
