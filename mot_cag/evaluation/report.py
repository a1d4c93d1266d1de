"""Human-readable eval reports: a table for the terminal and a PNG bar chart."""

from __future__ import annotations

from rich.table import Table

COLUMNS = ("exact_match", "f1", "accuracy", "token_accuracy", "nll", "kl_to_direct", "retrieval_recall",
           "mean_ttft_s")


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.3f}"


def render_table(report: dict) -> Table:
    """One row per mode, then retention."""
    title = f"{report['target']} on {report.get('dataset', '?')} (n={report['n']}"
    title += f", source {report['source']})" if report.get("source") else ")"
    table = Table("mode", *COLUMNS, title=title)
    for mode, rec in report["modes"].items():
        table.add_row(mode, *[_fmt(rec.get(c)) for c in COLUMNS])
    ret = report.get("retention")
    if ret:
        table.caption = "retention translated/direct: " + ", ".join(f"{k} {_fmt(v)}" for k, v in ret.items())
    return table


def check_plot(path: str) -> None:
    """Fail before any work when ``--plot PATH`` cannot be written: matplotlib missing or no such folder."""
    from pathlib import Path

    from mot_cag.errors import MotCagError

    _pyplot()
    folder = Path(path).expanduser().resolve().parent
    if not folder.is_dir():
        raise MotCagError(f"--plot {path}: folder {folder} does not exist.")


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        from mot_cag.errors import MotCagError

        raise MotCagError("--plot needs matplotlib: pip install 'mot-cag[plot]'.") from None
    return plt


def save_plot(report: dict, path: str) -> None:
    """Bar chart of the bounded scores per mode (matplotlib, PNG)."""
    plt = _pyplot()
    metrics = ["exact_match", "f1", "accuracy", "token_accuracy"]
    modes = list(report["modes"])
    fig, ax = plt.subplots(figsize=(7, 3.5))
    width = 0.8 / max(1, len(modes))
    for i, mode in enumerate(modes):
        vals = [report["modes"][mode].get(m) or 0.0 for m in metrics]
        ax.bar([j + i * width for j in range(len(metrics))], vals, width, label=mode)
    ax.set_xticks([j + width * (len(modes) - 1) / 2 for j in range(len(metrics))], metrics)
    ax.set_ylim(0, 1)
    ax.set_title(f"{report['target']} ({report.get('dataset', '')})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
