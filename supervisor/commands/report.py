"""`supervisor report OUT`: per part, what the export cost and how far each quantized weight is from its source.

    journal.jsonl ─▶ load() ─▶ Report ─┬▶ summary() + table(): a line, then a rich table (a row per part)
                                       ├▶ modules_table(): every module's error
                                       └▶ write_html(): one self-contained page, a PNG plot per column

Every figure comes from the journal's Shard records (supervisor/output/journal.py): the child's time for the part, the
bytes read from the source and written, the worker's peak RSS and GPU memory, the retries before the attempt
that wrote it, and per quantized module the relative error ||dequantized - source|| / ||source|| of its weight,
which the child measured while the layer was in memory (child/backends/quant_error.py). Reading only the journal (no lock,
a torn last line skipped) makes it work on a finished export, a failed one and one still running.

Owns the presentation of those records. It never writes into the output folder and never imports torch;
matplotlib (Agg canvas, no display, no pyplot state) is imported only for --html.
"""
from __future__ import annotations

import base64
import html
import io
import math
import os
import re
from dataclasses import dataclass
from typing import Callable

from rich import box
from rich.table import Table

from shared import durable, layout
from shared.messages import NON_LAYER
from supervisor.output import journal
from supervisor.commands import status
from supervisor.errors import InputError

MIB = 2**20


def _max_error(r: journal.Shard) -> float | None:
    return max(r.quant_error.values()) if r.quant_error else None


@dataclass(frozen=True)
class Column:
    key: str
    title: str
    value: Callable[[journal.Shard], float | None]
    fmt: str  # format spec of a cell
    total: Callable  # sum (math.fsum: exact, whatever the parts' order) or max, for the totals row


COLUMNS = (
    Column("seconds", "time s", lambda r: r.seconds, ".2f", math.fsum),
    Column("source_bytes", "in MiB", lambda r: r.source_bytes / MIB, ".2f", math.fsum),
    Column("nbytes", "out MiB", lambda r: r.nbytes / MIB, ".2f", math.fsum),
    # "-": no worker wrote the part (the non-layer part the supervisor copied itself, supervisor/run/verbatim.py)
    Column("peak_rss", "peak RSS MiB", lambda r: r.peak_rss / MIB if r.peak_rss else None, ".0f", max),
    Column("peak_gpu", "peak GPU MiB", lambda r: r.peak_gpu / MIB if r.peak_rss else None, ".0f", max),
    Column("retries", "retries", lambda r: r.retries, "d", sum),
    Column("quant_error", "max rel. error", _max_error, ".4f", max),
)


@dataclass
class Report:
    output: str
    info: dict  # supervisor.commands.status.status(): scheme, source, done, left, finalized, running_pid
    parts: list[journal.Shard]  # journaled parts: layers in order, then the non-layer shard
    quality: dict | None = None  # the latest finished `verify --quality` (supervisor.run.quality.figures), if any


def load(output: str) -> Report:
    """The journal's view of `output`; raises OutputError when it is not an export folder."""
    st = status.read_state(output)  # read once: a running export's journal grows between two reads
    info = status.status(output, st)
    parts = sorted(st.shards.values(), key=lambda r: (r.index == NON_LAYER, r.index))
    from supervisor.run import quality

    return Report(output=os.path.abspath(output), info=info, parts=parts, quality=quality.figures(output))


def label(index: int) -> str:
    return "non-layer" if index == NON_LAYER else str(index)


def short_name(name: str, index: int) -> str:
    """A module's name inside its part: 'model.layers.3.mlp.down_proj' -> 'mlp.down_proj'."""
    marker = f".{index}."
    at = name.find(marker) if index != NON_LAYER else -1
    return name[at + len(marker):] if at >= 0 else name


def cell(column: Column, value) -> str:
    return "-" if value is None else format(value, column.fmt)


def _worst(r: journal.Shard) -> str:
    return short_name(max(r.quant_error, key=r.quant_error.get), r.index) if r.quant_error else "-"


def _totals(report: Report) -> list[str]:
    out = []
    for c in COLUMNS:
        values = [v for v in map(c.value, report.parts) if v is not None]
        out.append(cell(c, c.total(values)) if values else "-")
    return out


def summary(report: Report) -> str:
    i = report.info
    state = "finalized" if i["finalized"] else (f"running (pid {i['running_pid']})" if i["running_pid"] else
                                                "not finished")
    left = "" if not i["left"] else f"; left: {', '.join(map(str, i['left'][:12]))}" + (
        f" … ({len(i['left'])} in all)" if len(i["left"]) > 12 else "")
    how = f" ({i['method']}, arithmetic {i['arithmetic']})" if i.get("arithmetic") else ""
    return f"{report.output}: {i['scheme']}{how} from {i['source']}; {i['done']} journaled, {state}{left}"


def _part_rows(report: Report) -> tuple[list[str], list[list[str]], list[str]]:
    """(header, one row per journaled part, the totals row): the table both the terminal and the page show; on a
    cluster export the last column says which node (and GPU) wrote each part."""
    where = any(r.where for r in report.parts)
    return (["part", *(c.title for c in COLUMNS), "worst module", *(["written on"] if where else [])],
            [[label(r.index), *(cell(c, c.value(r)) for c in COLUMNS), _worst(r), *([r.where] if where else [])]
             for r in report.parts],
            ["total", *_totals(report), "", *([""] if where else [])])


def _module_rows(report: Report) -> list[list[str]]:
    """(part, module, rel. error) per quantized module of each journaled part."""
    return [[label(r.index), short_name(n, r.index), f"{e:.6f}"]
            for r in report.parts for n, e in r.quant_error.items()]


def table(report: Report) -> Table:
    """One row per journaled part and a totals row. No figure is ever cut: each column is at least as wide as its
    widest cell, so a narrow terminal wraps the headers and folds the module names instead."""
    head, rows, foot = _part_rows(report)
    t = Table(show_footer=bool(rows), box=box.SIMPLE_HEAD)
    for i, title in enumerate(head):
        last = i > len(COLUMNS)  # the module and node names fold; no figure is ever cut
        width = None if last else max(len(w) for w in [x[i] for x in rows + [foot]] + title.split())
        t.add_column(title, footer=foot[i], justify="left" if i == 0 or last else "right", min_width=width,
                     max_width=width, overflow="fold")
    for row in rows:
        t.add_row(*row)
    return t


def modules_table(report: Report) -> Table:
    t = Table(title="quantization error per module: ||dequantized - source|| / ||source||", title_justify="left",
              box=box.SIMPLE_HEAD)
    for name in ("part", "module", "rel. error"):
        t.add_column(name, justify="right" if name == "rel. error" else "left")
    for row in _module_rows(report):
        t.add_row(*row)
    return t


def to_dict(report: Report) -> dict:
    import msgspec

    return {**report.info, "parts": [msgspec.to_builtins(r) for r in report.parts],
            **({"quality": report.quality} if report.quality is not None else {})}


# ---- quality (`verify --quality`, [evaluate]; docs/quality.md) ----------------------------------------------
def quality_lines(q: dict) -> list[str]:
    """The figures in words: what the CLI prints after `verify --quality` and above the report's table."""
    worst = max(q["layers"], key=lambda r: r["rel_error"]) if q["layers"] else None
    return [f"quality over {q['samples']} held-out samples ({q['tokens']} tokens): kl {q['kl']:.6g}, "
            f"top-1 agreement {q['top1']:.4f}, perplexity {q['ppl_source']:.4f} (source) -> {q['ppl_export']:.4f} "
            f"(export)" + (f"; largest hidden-state error {worst['rel_error']:.4g} at layer {worst['index']}"
                           if worst else "")]


def _quality_rows(q: dict) -> list[list[str]]:
    return [[str(r["index"]), f"{r['rel_error']:.6f}", f"{r['cosine']:.6f}"] for r in q["layers"]]


def quality_table(q: dict) -> Table:
    t = Table(title="hidden state per decoder layer, export against source", title_justify="left",
              box=box.SIMPLE_HEAD)
    for name in ("layer", "rel. error", "cosine"):
        t.add_column(name, justify="right")
    for row in _quality_rows(q):
        t.add_row(*row)
    return t


def _quality_png(q: dict) -> str:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 3.2), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    xs = [r["index"] for r in q["layers"]]
    ax.plot(xs, [r["rel_error"] for r in q["layers"]], marker="o", color="#c44e52", label="rel. error")
    ax.set_xlabel("decoder layer")
    ax.set_ylabel("||export - source|| / ||source||")
    ax.grid(alpha=0.3)
    cos = ax.twinx()
    cos.plot(xs, [r["cosine"] for r in q["layers"]], marker=".", color="#4c72b0", label="cosine")
    cos.set_ylabel("cosine")
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return base64.b64encode(buf.getvalue()).decode()


def _quality_html(q: dict | None) -> str:
    if q is None:
        return ""
    return (f"<h2>Quality against the source</h2><p>{html.escape(quality_lines(q)[0])}</p>"
            f'<figure><img alt="hidden-state error per layer" src="data:image/png;base64,{_quality_png(q)}">'
            "<figcaption>the export's hidden state at each decoder layer's output against the source's</figcaption>"
            f"</figure>{_html_table(['layer', 'rel. error', 'cosine'], _quality_rows(q))}")


# ---- HTML ----------------------------------------------------------------------------------------------------
def plotted(report: Report) -> list[Column]:
    """The columns worth a plot: those with at least one non-zero figure (GPU memory is 0 on CPU)."""
    return [c for c in COLUMNS if any(c.value(r) for r in report.parts)]


def check_html_path(path: str, output: str) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise InputError(f"--html {path}: folder {folder!r} does not exist; create it or choose another path")
    out = os.path.realpath(output)
    real = os.path.realpath(os.path.abspath(path))
    if os.path.commonpath([real, out]) == out and not real.startswith(layout.state_dir(out) + os.sep):
        raise InputError(f"--html {path}: is inside the export, which holds only what a loader reads; "
                         "write the page elsewhere (or under its .export folder)")


def write_html(report: Report, path: str) -> list[str]:
    """Write one self-contained page (plots embedded as data: URIs); returns the plotted columns' titles."""
    check_html_path(path, report.output)
    columns = plotted(report)
    figures = "\n".join(
        f'<figure><img alt="{html.escape(c.title)} per part" src="data:image/png;base64,{_png(report, c)}">'
        f"<figcaption>{html.escape(c.title)}</figcaption></figure>" for c in columns)
    not_plotted = [c.title for c in COLUMNS if c not in columns]
    page = _PAGE.format(
        title=html.escape(f"export report: {os.path.basename(report.output)}"),
        summary=html.escape(summary(report)),
        table=_html_table(*_part_rows(report)),
        figures=figures or "<p>nothing journaled yet</p>",
        not_plotted=html.escape(", ".join(not_plotted) + " (all zero or not recorded)") if not_plotted else "",
        modules=_html_table(["part", "module", "rel. error"], _module_rows(report)),
        quality=_quality_html(report.quality))
    durable.write_bytes(path, page.encode())
    return [c.title for c in columns]


def _html_table(head: list[str], rows: list[list[str]], foot: list[str] | None = None) -> str:
    def tr(cells, tag):
        return "<tr>" + "".join(f"<{tag}>{html.escape(str(x))}</{tag}>" for x in cells) + "</tr>"

    body = "\n".join(tr(r, "td") for r in rows)
    return (f"<table><thead>{tr(head, 'th')}</thead><tbody>\n{body}\n</tbody>"
            + (f"<tfoot>{tr(foot, 'td')}</tfoot>" if foot else "") + "</table>")


def _png(report: Report, column: Column) -> str:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 3.2), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    labels = [label(r.index) for r in report.parts]
    x = range(len(report.parts))
    if column.key == "quant_error":
        _error_plot(ax, report, x)
    else:
        ax.bar(x, [column.value(r) or 0 for r in report.parts], color="#4c72b0")
    ax.set_xticks(list(x), labels, rotation=90 if len(labels) > 24 else 0, fontsize=8)
    ax.set_xlabel("part (decoder layer)")
    ax.set_ylabel("rel. error (each module)" if column.key == "quant_error" else column.title)
    ax.grid(axis="y", alpha=0.3)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return base64.b64encode(buf.getvalue()).decode()


def _error_plot(ax, report: Report, x) -> None:
    """Every module's error as a point, one series per kind of module (expert numbers folded), and the maximum."""
    groups: dict[str, tuple[list, list]] = {}
    for pos, r in zip(x, report.parts):
        for name, err in r.quant_error.items():
            kind = re.sub(r"\.\d+\.", ".*.", short_name(name, r.index))
            xs, ys = groups.setdefault(kind, ([], []))
            xs.append(pos)
            ys.append(err)
    for kind, (xs, ys) in sorted(groups.items()):
        ax.scatter(xs, ys, s=12, label=kind)
    ax.plot(list(x), [_max_error(r) or float("nan") for r in report.parts], color="black", lw=1, label="max")
    if len(groups) <= 12:
        ax.legend(fontsize=7, ncols=2, loc="upper left", bbox_to_anchor=(1.0, 1.0))


_PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>{title}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; color: #222; }}
table {{ border-collapse: collapse; font-size: 0.9em; }}
th, td {{ border: 1px solid #ccc; padding: 0.2em 0.6em; text-align: right; }}
th:first-child, td:first-child, td:last-child {{ text-align: left; }}
tfoot td {{ font-weight: bold; }}
figure {{ margin: 1.5em 0; }}
img {{ max-width: 100%; }}
</style>
</head>
<body>
<h1>{title}</h1>
<p>{summary}</p>
<h2>Per part</h2>
{table}
<h2>Plots</h2>
{figures}
<p>{not_plotted}</p>
{quality}
<h2>Quantization error per module</h2>
<p>Relative error of each module's dequantized weight against its source weight,
||dequantized - source|| / ||source||, measured by the worker while the layer was in memory.</p>
<details><summary>every module</summary>
{modules}
</details>
</body>
</html>
"""
