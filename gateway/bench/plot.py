"""``--plot FILE.png``: throughput and p95 TTFT against load, the knee marked.

matplotlib is an optional extra (``kneecap[bench]``) imported only here, and
only through its object API (no pyplot global state). Throughput and TTFT
share the load axis on twin y axes; the SLO is a dashed line on the TTFT axis,
the knee a vertical line, and the loads beyond it are shaded, so the knee is
visible without reading a number. When several prompt lengths ran, a second
panel plots p95 TTFT against prompt length, one line per load.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from gateway.bench.sweep import Series, SweepResult

COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:brown", "tab:pink")
TTFT_COLOR = "tab:red"


class PlotError(RuntimeError):
    """No plot can be written (no matplotlib, a format it cannot write); the message says why."""


MISSING = "--plot needs matplotlib: pip install 'kneecap[bench]'"


def check_plot_path(path: Path) -> None:
    """Fail before the sweep on a file matplotlib could not write, not after it.

    The format is the file's extension (matplotlib's own rule; none means PNG and
    matplotlib adds ``.png``). PGF also needs the TeX program matplotlib runs for it.
    """
    try:
        import matplotlib
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        raise PlotError(MISSING) from None
    fmt = path.suffix[1:].lower() or str(matplotlib.rcParams["savefig.format"])
    supported = FigureCanvasBase.get_supported_filetypes()
    if fmt not in supported:
        names = ", ".join(f".{name}" for name in sorted(supported))
        raise PlotError(f"--plot {path}: matplotlib cannot write .{fmt} files (use {names})")
    tex = str(matplotlib.rcParams["pgf.texsystem"])
    if fmt == "pgf" and shutil.which(tex) is None:
        raise PlotError(f"--plot {path}: a .pgf plot needs {tex}, which is not installed")


def write_plot(result: SweepResult, path: Path) -> None:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise PlotError(MISSING) from None
    by_prompt = _ttft_by_prompt(result)
    panels = 2 if len({k for _, k, _ in by_prompt}) > 1 else 1
    fig = Figure(figsize=(7.5 * panels, 5.0), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, panels, squeeze=False)[0]
    _load_panel(axes[0], result)
    if panels == 2:
        _prompt_panel(axes[1], by_prompt)
    try:
        fig.savefig(path, dpi=110)
    except BrokenPipeError as exc:  # the plot tool (TeX for .pgf) died while fed: not the file
        raise PlotError(f"--plot {path}: {type(exc).__name__}: the plot tool exited") from None
    except OSError:
        raise  # the caller names the file and the reason
    except Exception as exc:  # e.g. a TeX that fails on .pgf: one line, not a traceback
        first = str(exc).strip().splitlines()[:1]
        raise PlotError(f"--plot {path}: {': '.join([type(exc).__name__, *first])}") from None


def _load_panel(ax: Any, result: SweepResult) -> None:
    tt = ax.twinx()
    targets = list(dict.fromkeys(s.target for s in result.series))
    single = len(result.series) == 1
    for i, s in enumerate(result.series):
        name = s.workload + (f" · {s.target}" if len(targets) > 1 else "")
        # One series: the classic twin-axis colours. Several: a colour per series,
        # solid for throughput and dashed for TTFT.
        color = "tab:blue" if single else COLORS[i % len(COLORS)]
        loads = [p.load for p in s.points]
        ax.plot(
            loads,
            [p.output_tok_s for p in s.points],
            "-",
            marker="o",
            color=color,
            linewidth=2,
            label=f"output tok/s ({name})",
        )
        ttft = [p.ttft.at(95.0) * 1e3 if p.ttft else float("nan") for p in s.points]
        tt.plot(
            loads,
            ttft,
            "--",
            marker="s",
            color=TTFT_COLOR if single else color,
            label=f"p95 TTFT ({name})",
        )
        _mark_knee(ax, s, "black" if single else color)
    slo = result.plan.slo
    for term in slo.terms if slo else ():
        if term.metric == "ttft":
            tt.axhline(
                term.limit_s * 1e3,
                color=TTFT_COLOR,
                linestyle=":",
                linewidth=1.5,
                label=f"SLO {term.name} {term.limit_s * 1e3:g} ms",
            )
    kind = result.plan.kind
    ax.set_xlabel("concurrent requests" if kind == "concurrency" else "arrival rate (req/s)")
    ax.set_ylabel("output tokens/s (solid)", color="tab:blue" if single else "black")
    tt.set_ylabel("p95 TTFT (dashed)", color=TTFT_COLOR if single else "black")
    ax.set_ylim(bottom=0)
    ttfts = [p.ttft.at(95.0) for s in result.series for p in s.points if p.ttft]
    if ttfts and min(ttfts) > 0 and max(ttfts) / min(ttfts) > 50:
        # Long and short prompts together: on a linear axis the short ones vanish.
        from matplotlib.ticker import FuncFormatter

        tt.set_yscale("log")
        tt.yaxis.set_major_formatter(FuncFormatter(_ms_label))
    else:
        from matplotlib.ticker import FuncFormatter

        tt.set_ylim(0, tt.get_ylim()[1] * 1.1)  # room above the SLO line
        tt.yaxis.set_major_formatter(FuncFormatter(_ms_label))
    ax.grid(True, alpha=0.3)
    lines = ax.get_legend_handles_labels()
    more = tt.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], loc="upper left", fontsize=8)
    ax.set_title("Throughput and p95 TTFT vs load")


def _mark_knee(ax: Any, s: Series, color: str) -> None:
    knee = s.knee.load
    if knee is None:
        return
    top = max(p.load for p in s.points)
    ax.axvline(knee, color=color, linewidth=2, alpha=0.7)
    if top > knee:
        ax.axvspan(knee, top, color="grey", alpha=0.08)
    ax.annotate(
        f"knee {knee:g}\n({s.knee.basis})",
        xy=(knee, 0),
        xycoords=("data", "axes fraction"),
        xytext=(4, 8),
        textcoords="offset points",
        color=color,
        fontsize=9,
        fontweight="bold",
        bbox={"facecolor": "white", "alpha": 0.8, "edgecolor": "none", "pad": 1},
    )
    # The other detector's answer, when it differs, as a faint line: it says how
    # much room the chosen knee leaves.
    for finding, name in ((s.knee.slo, "SLO"), (s.knee.marginal, "throughput")):
        if finding is not None and finding.load is not None and finding.load != knee:
            ax.axvline(finding.load, color=color, linewidth=1, linestyle="--", alpha=0.5)
            ax.annotate(
                f"{name} knee {finding.load:g}",
                xy=(finding.load, 1),
                xycoords=("data", "axes fraction"),
                xytext=(4, -14),
                textcoords="offset points",
                color=color,
                fontsize=8,
            )


def _ttft_by_prompt(result: SweepResult) -> list[tuple[float, int, float]]:
    """(load, prompt length, p95 TTFT ms) of the first target."""
    if not result.series:
        return []
    first = result.series[0].target
    return [
        (p.load, length, lat.at(95.0) * 1e3)
        for s in result.of_target(first)
        for p in s.points
        for length, lat in p.ttft_by_prompt.items()
    ]


def _prompt_panel(ax: Any, rows: list[tuple[float, int, float]]) -> None:
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    lengths = sorted({n for _, n, _ in rows})
    for i, load in enumerate(sorted({load for load, _, _ in rows})):
        pts = sorted((n, v) for x, n, v in rows if x == load)
        ax.plot(
            [n for n, _ in pts],
            [v for _, v in pts],
            marker="o",
            color=COLORS[i % len(COLORS)],
            label=f"load {load:g}",
        )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xticks(lengths, [f"{n:,}" for n in lengths])
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(_ms_label))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("p95 TTFT")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("p95 TTFT vs prompt length")


def _ms_label(value: float, _pos: int) -> str:
    return f"{value / 1e3:g} s" if value >= 1e3 else f"{value:g} ms"
