"""The HTML report: one self-contained file (no script, no network, no external style or font) with
the pictures people would rather look at than read, then the findings table.

`render(report, out)` takes a Report (`check`, `run`, `watch`) or a memory verdict (`tfdoctor memory`;
report/memory.py hands it over as its JSON document, so that this module needs nothing of memory's).
Figures are inline SVG drawn by matplotlib (report/figures.py, report/run_figures.py), an optional
extra: `require_plotting()` is what the CLI calls before any work, so that a missing matplotlib is a
usage error up front, not a crash after a long run.
"""

from __future__ import annotations

import html
import importlib.util
import json
from typing import Any, TextIO

from tfdoctor.errors import UsageError
from tfdoctor.report.run_summary import CURVES_HEALTHY, beyond_curves, curves_healthy
from tfdoctor.result import Report, Result, Status
from tfdoctor.versions import describe

INSTALL_HINT = "pip install 'tfdoctor[html]'"
ORDER = (Status.FAIL, Status.ERROR, Status.WARN, Status.PASS, Status.SKIP)
# Evidence the figures already show, left out of each finding's evidence listing.
DRAWN = {"dependency_map", "map_cell_positions", "loss_curve", "pre_clip_norms", "schedule", "lr_curve",
         "traceback"}
STYLE = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, "DejaVu Sans", sans-serif; color: #222;
       margin: 0; background: #f6f7f9; }
main { max-width: 1240px; margin: 0 auto; padding: 20px 24px 40px; }
h1 { font-size: 20px; margin: 0 0 4px; overflow-wrap: anywhere; }
h2 { font-size: 16px; margin: 28px 0 10px; }
.meta { color: #666; font-size: 12px; margin: 2px 0; }
.verdict { font-size: 15px; font-weight: 600; margin: 10px 0 0; }
.pills span { display: inline-block; padding: 2px 10px; margin: 8px 6px 0 0; border-radius: 10px;
              font-size: 12px; font-weight: 600; color: #fff; }
.figures { display: grid; grid-template-columns: repeat(auto-fill, minmax(540px, 1fr)); gap: 14px; }
figure { background: #fff; border: 1px solid #e1e4e8; border-radius: 6px; margin: 0; padding: 10px 12px; }
figure.wide { grid-column: 1 / -1; }
figcaption { font-weight: 600; margin-bottom: 4px; }
figure .note { color: #666; font-size: 12px; margin-top: 2px; }
svg.figure { width: 100%; height: auto; display: block; }
table { border-collapse: collapse; width: 100%; background: #fff; border: 1px solid #e1e4e8; }
th, td { text-align: left; vertical-align: top; padding: 6px 8px; border-bottom: 1px solid #eceef1; }
th { background: #fafbfc; font-size: 12px; color: #555; }
td.id { font-family: ui-monospace, "DejaVu Sans Mono", monospace; white-space: nowrap; }
td .expected, td .where { color: #777; font-size: 12px; }
td .hint { color: #0b6e8a; }
.status { display: inline-block; min-width: 44px; text-align: center; padding: 1px 6px; border-radius: 4px;
          color: #fff; font-size: 12px; font-weight: 700; }
details summary { cursor: pointer; color: #555; font-size: 12px; }
pre { white-space: pre-wrap; word-break: break-word; font-size: 12px; background: #f6f8fa; padding: 8px;
      border-radius: 4px; margin: 4px 0 0; max-height: 360px; overflow: auto; }
.remedy-fits { color: #2ca02c; font-weight: 600; } .remedy-not { color: #d62728; font-weight: 600; }
"""
BADGE = {"pass": "#2ca02c", "warn": "#d08c00", "fail": "#d62728", "error": "#9b59b6", "skip": "#9a9a9a"}


def plotting_available() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def require_plotting() -> None:
    """UsageError unless matplotlib can be imported (without importing it: that is for the figures)."""
    if not plotting_available():
        raise UsageError("--format html draws its figures with matplotlib, which is not installed",
                         INSTALL_HINT)


def render(report: Report | dict[str, Any], out: TextIO, width: int | None = None) -> None:
    """The page of a Report, or of a memory verdict as report/memory.py hands it (see memory_page)."""
    require_plotting()
    out.write(report_page(report) if isinstance(report, Report) else memory_page(report))


def _e(text: Any) -> str:
    return html.escape(str(text), quote=True)


def page(title: str, body: list[str]) -> str:
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
            f"<title>{_e(title)}</title><style>{STYLE}</style></head>\n<body><main>\n"
            + "\n".join(body) + "\n</main></body></html>\n")


def figures_section(figures, heading: str = "Figures") -> list[str]:
    if not figures:
        return []
    parts = [f"<h2>{_e(heading)}</h2>", '<div class="figures">']
    for drawn in figures:
        note = f'<div class="note">{_e(drawn.note)}</div>' if drawn.note else ""
        svg = drawn.svg.replace("<svg", f'<svg role="img" aria-label="{_e(drawn.title)}"', 1)
        parts.append(f'<figure class="{"wide" if drawn.wide else "card"}" data-figure="{_e(drawn.name)}">'
                     f"<figcaption>{_e(drawn.title)}</figcaption>{svg}{note}</figure>")
    parts.append("</div>")
    return parts


# ------------------------------------------------------------------ a Report (check, run, watch)


def report_page(report: Report) -> str:
    from tfdoctor.report.figures import check_figures, safely
    from tfdoctor.report.run_figures import run_figures

    figures = (safely("run", run_figures, report) if report.series else []) + check_figures(report)
    body = [f"<h1>tfdoctor {_e(report.target)}</h1>"]
    if report.versions:
        body.append(f'<p class="meta">versions: {_e(describe(report.versions))}</p>')
    body += [f'<p class="meta">{_e(line)}</p>' for line in _run_lines(report)]
    body += _summary(report)
    body += figures_section(figures, "The run" if report.series else "Figures")
    body += findings_table(report)
    return page(f"tfdoctor {report.target}", body)


def _run_lines(report: Report) -> list[str]:
    """What was run: the watched run's facts, or what `tfdoctor run` discovered."""
    lines = []
    facts = (report.series or {}).get("facts") or {}
    if report.series:
        steps = len((report.series.get("steps") or {}).get("step") or [])
        said = [f"{steps} optimizer steps watched"]
        if isinstance(facts.get("seconds"), (int, float)):
            said.append(f"in {facts['seconds']:.1f} s")
        for key in ("ended", "device"):
            if facts.get(key):
                said.append(f"{key}: {facts[key]}")
        lines.append(", ".join(said))
    found = report.discovered or {}
    if found.get("model"):
        lines.append(f"model {found['model']} ({found.get('parameters', 0):,} parameters), "
                     f"{found.get('steps', '?')} optimizer step(s) recorded")
    if report.stopped:
        lines.append(f"stopped before the last check: {report.stopped}")
    return lines


def _summary(report: Report) -> list[str]:
    counts = report.summary()
    pills = "".join(f'<span style="background:{BADGE[s]}">{n} {s}</span>' for s, n in counts.items() if n)
    problems = report.problems()
    if report.stopped:
        verdict, colour = "stopped before the last check", BADGE["error"]
    elif problems:
        verdict, colour = f"{len(problems)} problem(s) found", BADGE["fail"]
    else:
        verdict, colour = "healthy", BADGE["pass"]
    said = [f'<p class="verdict" style="color:{colour}">{_e(verdict)}</p>', f'<div class="pills">{pills}</div>']
    if report.series and not problems and not report.stopped:  # watch judged the curves, not the model
        if curves_healthy(report.results):
            said[0] = f'<p class="verdict" style="color:{colour}">{_e(CURVES_HEALTHY)}</p>'
        said.insert(1, f'<p class="meta beyond">{_e(beyond_curves(report.target))}</p>')
    return said


def findings_table(report: Report) -> list[str]:
    """Every finding, worst first: status, id, what was seen (under what was expected), the fix; the
    evidence folded under each; the skipped ones folded away, with their reasons."""
    ranked = sorted(report.results, key=lambda r: ORDER.index(r.status))
    shown = [r for r in ranked if r.status is not Status.SKIP]
    skipped = [r for r in ranked if r.status is Status.SKIP]
    parts = ["<h2>Findings</h2>", '<table class="findings"><thead><tr><th>status</th><th>check</th>'
             "<th>what was seen</th><th>fix</th></tr></thead><tbody>"]
    empty = "every check skipped (below)" if skipped else "no check or judge ran"
    parts += [_row(r) for r in shown] or [f'<tr><td colspan="4">{empty}</td></tr>']
    parts.append("</tbody></table>")
    if skipped:
        parts.append(f"<details><summary>{len(skipped)} skipped</summary><table><tbody>")
        parts += [_row(r) for r in skipped]
        parts.append("</tbody></table></details>")
    return parts


def _row(result: Result) -> str:
    status = result.status.value
    where = ""
    if result.details.get("location"):
        call = f" ({result.details['call']})" if result.details.get("call") else ""
        where = f'<div class="where">at {_e(result.details["location"])}{_e(call)}</div>'
    if isinstance(result.details.get("step"), int):
        where += f'<div class="where">at step {result.details["step"]}</div>'
    evidence = {k: v for k, v in result.details.items() if k not in DRAWN and k not in ("location", "call")}
    folded = ""
    if evidence:
        text = json.dumps(evidence, indent=1, default=str, allow_nan=True)
        folded = f"<details><summary>evidence</summary><pre>{_e(text)}</pre></details>"
    if result.details.get("traceback"):
        folded += f"<details><summary>traceback</summary><pre>{_e(result.details['traceback'])}</pre></details>"
    expected = f'<div class="expected">expected: {_e(result.title)}</div>' if result.title else ""
    return (f'<tr class="{status}"><td><span class="status" style="background:{BADGE[status]}">'
            f"{status.upper()}</span></td><td class=\"id\">{_e(result.id)}</td>"
            f"<td>{expected}{_e(result.message)}{where}{folded}</td>"
            f'<td class="hint">{_e(result.hint)}</td></tr>')


# ------------------------------------------------------------------ a memory verdict


def memory_page(data: dict[str, Any]) -> str:
    """`tfdoctor memory`: the peak's breakdown and the remedies against the budget, then the remedies'
    table. `data` is the memory command's JSON document (report/memory.py's to_dict) with the page's
    "heading" and "notes" added (report/memory.py renders a Verdict through here)."""
    from tfdoctor.memory.sizes import format_bytes
    from tfdoctor.report.figures import memory_figures, safely

    peak, budget, source = data["peak_bytes"], data["budget_bytes"], data["budget_source"]
    if data["fits"]:
        said = (f"FITS: peak {format_bytes(peak)} within the budget of {format_bytes(budget)} ({source}), "
                f"{format_bytes(budget - peak)} to spare")
    else:
        said = (f"OUT OF MEMORY: peak {format_bytes(peak)} exceeds the budget of {format_bytes(budget)} "
                f"({source}) by {format_bytes(peak - budget)}")
    body = [f"<h1>{_e(data['heading'])}</h1>",
            f'<p class="verdict" style="color:{BADGE["pass" if data["fits"] else "fail"]}">{_e(said)}</p>']
    limits = [f"{name} that fits: {value:,}" for name, value in
              (("largest sequence length", data.get("largest_seq_that_fits")),
               ("largest batch", data.get("largest_batch_that_fits"))) if isinstance(value, int)]
    if limits:
        body.append(f'<p class="meta">{_e("; ".join(limits))}</p>')
    body += figures_section(safely("memory", memory_figures, data, f"Alive at the peak: "
                                   f"{data.get('peak_phase', '')}, {data.get('peak_op', '')}"))
    body += _remedies_table(data.get("remedies") or [], peak)
    body += [f'<p class="meta">{_e(note)}</p>' for note in data.get("notes", [])]
    return page(data["heading"], body)


def _remedies_table(remedies: list[dict], peak: int) -> list[str]:
    from tfdoctor.memory.sizes import format_bytes

    if not remedies:
        return []
    rows = []
    for r in remedies:
        fits = '<span class="remedy-fits">yes</span>' if r["fits"] else '<span class="remedy-not">no</span>'
        note = " (changes what is trained)" if r.get("changes_training") else ""
        rows.append(f"<tr><td>{_e(r['name'])}</td><td>{_e(r['change'] + note)}</td>"
                    f"<td>{_e(format_bytes(r['peak_bytes']))}</td><td>{r['peak_bytes'] / peak:.2f}</td>"
                    f"<td>{fits}</td></tr>")
    return ["<h2>Remedies</h2>", "<table><thead><tr><th>remedy</th><th>change</th><th>peak</th><th>x now</th>"
            "<th>fits</th></tr></thead><tbody>", *rows, "</tbody></table>"]
