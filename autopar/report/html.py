"""Self-contained HTML: the plan's report page (`autopar show --html`) and a timeline page
(`autopar show --timeline out.html`). Pictures are inline PNG data, styles inline; the page
loads nothing, so it opens offline and can be mailed as one file."""

from __future__ import annotations

import base64
import html
import io

from autopar.plans.plan import Plan
from autopar.report.draw import memory_figure, timeline_figure
from autopar.report.explain import explain, format_delta, format_value
from autopar.report.timeline import layout

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 24px; color: #222; max-width: 1600px; }
h1 { font-size: 20px; } h2 { font-size: 16px; margin-top: 28px; }
pre { background: #f6f6f6; padding: 12px; font-size: 12px; overflow-x: auto; }
table { border-collapse: collapse; font-size: 12px; }
td, th { border: 1px solid #ccc; padding: 3px 8px; text-align: right; }
td:first-child, th:first-child { text-align: left; }
tr.total td { font-weight: bold; background: #f3f3f3; }
.figure img { max-width: 100%; height: auto; }
.faster { color: #1d7a46; } .slower { color: #b03030; }
"""


def _page(title: str, body: str) -> str:
    return (f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
            f"<style>{_STYLE}</style></head><body>\n{body}\n</body></html>\n")


def _figure(element_id: str, figure, alt: str) -> str:
    """The figure as an inline PNG (a data URI: an SVG of a long pipeline runs to megabytes)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(figure)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    data = base64.b64encode(buffer.getvalue()).decode()
    return f'<div class="figure"><img id="{element_id}" alt="{html.escape(alt)}" src="data:image/png;base64,{data}"></div>'


def timeline_html(plan: Plan) -> str:
    timeline = layout(plan)
    title = f"autopar timeline: {plan.model} on {plan.cluster}"
    return _page(title, f"<h1>{html.escape(title)}</h1>\n{_figure('timeline', timeline_figure(plan, timeline), 'timeline')}")


def alternatives_table(plan: Plan) -> str:
    explanation = explain(plan)
    if not explanation.alternatives:
        return "<p id=\"alternatives\">No runners-up recorded for this plan.</p>"
    head = "".join(f"<th title=\"{html.escape(a.config)}\">{a.label}</th>" for a in explanation.alternatives)
    rows = []
    for row in explanation.rows:
        cells = "".join(f"<td class=\"{'slower' if (d or 0) > 0 else 'faster' if (d or 0) < 0 else ''}\">"
                        f"{html.escape(format_delta(d, row.chosen, row.unit))}</td>" for d in row.deltas)
        total = ' class="total"' if row.term in ("step time", "peak memory") else ""
        rows.append(f"<tr{total}><td>{html.escape(row.term)}</td>"
                    f"<td>{html.escape(format_value(row.chosen, row.unit))}</td>{cells}</tr>")
    legend = "".join(f"<li><b>{a.label}</b> {html.escape(a.config)}: {html.escape(', '.join(a.changes) or '-')}</li>"
                     for a in explanation.alternatives)
    return (f"<table id=\"alternatives\"><tr><th>term</th><th>chosen</th>{head}</tr>{''.join(rows)}</table>"
            f"<ul>{legend}</ul>")


def report_html(plan: Plan) -> str:
    """The summary, the timeline, the memory per stage and the alternatives, in one page."""
    title = f"autopar plan: {plan.model} on {plan.cluster}"
    body = [f"<h1>{html.escape(title)}</h1>",
            "<h2>Summary</h2>", f"<pre id=\"summary\">{html.escape(plan.summary())}</pre>",
            "<h2>Timeline of one step</h2>", _figure("timeline", timeline_figure(plan), "timeline of one step"),
            "<h2>Memory per device by pipeline stage</h2>", _figure("memory", memory_figure(plan), "memory per stage"),
            "<h2>Alternatives considered</h2>", alternatives_table(plan)]
    return _page(title, "\n".join(body))
