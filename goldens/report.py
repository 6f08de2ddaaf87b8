"""One self-contained HTML page that shows what changed between a golden and a run, and where.

A failing golden test prints a diagnosis of its first failing step (compare.format_failure).
Seeing what changed, and why, takes every step of every case at once: which tokens differ
between the golden and the run, and how KL and the worst |Δ log-prob| move step by step
against the tolerance. This module renders that page for the failing golden tests
(failure_report.write_failure_report) and for the golden diff tool alike, from one `CaseView` per
case.

The page is one file that needs nothing else: inline CSS, inline SVG charts, no scripts, no
fonts, no links outside itself, so it opens the same anywhere (a CI artifact, an attachment).
The same inputs give the same bytes: no clock, fixed number formatting.

Hooks for tests and scripts (stable names):
  - `section.summary`: the summary lines and `table.overview`, one row per case;
  - `section.case` (`id="case-N"`, `data-status`, `data-first-failing-step`);
  - `table.token-strip`: rows `tr.golden` and `tr.run`, one `td[data-step]` per step (with
    `data-token-id` where the view knows the id); a run token that differs from the golden's
    (another id, or another text) is `td.changed`, only ever in `tr.run`; the first failing
    step's cells are `.first-failing`;
  - `svg.curve[data-metric=kl|logprob_delta]`: one `polyline.series` with a point per step
    (log scale; zeros and tiny values on the bottom edge, infinities on the top edge), one
    `circle.point[data-step]` per step (`.above` past the tolerance), and `line.tolerance`
    (`data-value`) when the tolerance is known.
"""

from __future__ import annotations

import dataclasses
import html
import math
import pathlib
from collections.abc import Sequence

from goldens.cli_files import write_atomically
from goldens.compare import CaseReport

STATUSES = ("PASS", "FAIL", "AMBIGUOUS", "CHANGED", "IDENTICAL")
METRICS = {  # data-metric -> (chart title, tolerance field of CaseView)
    "kl": ("KL(golden ‖ run)", "kl_max"),
    "logprob_delta": ("max |Δ log-prob| over the golden top-k", "logprob_atol"),
}
LOG_FLOOR = -12  # decades: values below 1e-12, zeros included, sit on the chart's bottom edge


@dataclasses.dataclass(frozen=True)
class CaseView:
    """What the page shows of one case: tokens and per-step curves of a golden and a run."""

    title: str  # e.g. "tinyllama float32 · prose"
    prompt: str
    golden_tokens: list[str]  # token texts of the golden ("from" side in a diff)
    run_tokens: list[str]  # token texts of the run ("to" side); same length, or shorter
    logprob_delta: list[float]  # per step: max |Δ log-prob| over the golden top-k
    kl: list[float]  # per step KL
    status: str  # one of STATUSES
    first_failing_step: int | None = None
    tolerance_label: str | None = None  # e.g. "own/float32/cpu"
    logprob_atol: float | None = None
    kl_max: float | None = None
    notes: tuple[str, ...] = ()  # extra lines shown with the case
    step_status: tuple[str, ...] = ()  # per step PASS, FAIL or AMBIGUOUS, when known
    # Recorded prompt positions (long prompts) and their metrics, drawn on a position axis.
    positions: tuple[int, ...] = ()
    position_logprob_delta: tuple[float, ...] = ()
    position_kl: tuple[float, ...] = ()
    # Token ids of golden_tokens and run_tokens, when known (empty: compared by text only).
    # Ids decide "changed": byte tokens of one character (東京🦙 in SmolLM2's vocabulary) each
    # decode alone to '\ufffd', so two different ids can show the same text.
    golden_ids: tuple[int, ...] = ()
    run_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status {self.status!r} is not one of {', '.join(STATUSES)}")
        if len(self.run_tokens) > len(self.golden_tokens):
            raise ValueError(
                f"{self.title}: {len(self.run_tokens)} run tokens for "
                f"{len(self.golden_tokens)} golden steps"
            )
        for side, ids, tokens in (
            ("golden", self.golden_ids, self.golden_tokens),
            ("run", self.run_ids, self.run_tokens),
        ):
            if ids and len(ids) != len(tokens):
                raise ValueError(
                    f"{self.title}: {len(ids)} {side} token ids for {len(tokens)} {side} tokens"
                )


def case_view(
    report: CaseReport,
    title: str,
    golden_tokens: list[str],
    run_tokens: list[str],
    notes: Sequence[str] = (),
) -> CaseView:
    """The view of one compared case; the first failing step's diagnosis becomes a note. The
    token ids are the report's: the golden's token at each step, and the run's greedy choice
    at each step it ran (`run_tokens` are their texts)."""
    tol = report.tolerance
    first = report.first_failing
    derived = []
    if not report.input_ids_match:
        derived.append("the run's tokenization of the prompt differs from the golden's input ids")
    if first is not None:
        derived.append(f"first failing step {first.step} ({first.metric}): {first.detail}")
    prompt_failing = [c for c in report.prompt_checks if c.status == "FAIL"]
    if prompt_failing:
        c = prompt_failing[0]
        derived.append(
            f"{len(prompt_failing)} of {len(report.prompt_checks)} prompt positions fail; the "
            f"first, {c.where} ({c.metric}): {c.detail}"
        )
    derived += [f"ambiguous {s.where}: {s.detail}" for s in report.ambiguous_steps]
    return CaseView(
        title=title,
        prompt=report.prompt,
        golden_tokens=list(golden_tokens),
        run_tokens=list(run_tokens),
        logprob_delta=[s.max_logprob_diff for s in report.steps],
        kl=[s.kl for s in report.steps],
        status=report.status,
        first_failing_step=None if first is None else first.step,
        tolerance_label=tol.key,
        logprob_atol=tol.logprob_atol,
        kl_max=tol.kl_max,
        notes=(*derived, *notes),
        step_status=tuple(s.status for s in report.steps),
        positions=tuple(c.position for c in report.prompt_checks),
        position_logprob_delta=tuple(c.max_logprob_diff for c in report.prompt_checks),
        position_kl=tuple(c.kl for c in report.prompt_checks),
        golden_ids=tuple(s.expected_token for s in report.steps),
        run_ids=tuple(s.actual_token for s in report.steps if s.actual_token is not None),
    )


def write_report(
    path: pathlib.Path, title: str, summary: list[str], cases: list[CaseView]
) -> pathlib.Path:
    """Write the page to `path` in one rename (never a half-written file); returns `path`."""
    write_atomically(path, render_html(title, summary, cases))
    return path


def render_html(title: str, summary: list[str], cases: list[CaseView]) -> str:
    """The whole page: summary block, then one section per case."""
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en">',
        '<head><meta charset="utf-8">',
        f"<title>{_esc(title)}</title>",
        f"<style>{_CSS}</style>",
        "</head>",
        "<body>",
        f"<h1>{_esc(title)}</h1>",
        _summary(summary, cases),
        *(_case(i, case) for i, case in enumerate(cases)),
        "</body>",
        "</html>",
    ]
    return "\n".join(parts) + "\n"


def _summary(lines: list[str], cases: list[CaseView]) -> str:
    items = "".join(f"<li>{_esc(line)}</li>" for line in lines)
    rows = "".join(_overview_row(i, case) for i, case in enumerate(cases))
    return (
        f'<section class="summary" id="summary"><ul>{items}</ul>'
        '<table class="overview"><thead><tr><th>case</th><th>status</th>'
        "<th>first failing step</th><th>max |Δ log-prob|</th><th>max KL</th></tr></thead>"
        f"<tbody>{rows}</tbody></table></section>"
    )


def _overview_row(index: int, case: CaseView) -> str:
    return (
        f'<tr data-case="case-{index}"><td><a href="#case-{index}">{_esc(case.title)}</a></td>'
        f"<td>{_badge(case.status)}</td><td>{_first_failing(case)}</td>"
        f"<td>{_num(max(case.logprob_delta, default=0.0))}</td>"
        f"<td>{_num(max(case.kl, default=0.0))}</td></tr>"
    )


def _case(index: int, case: CaseView) -> str:
    notes = "".join(f"<li>{_esc(note)}</li>" for note in case.notes)
    return (
        f'<section class="case" id="case-{index}" data-status="{case.status}" '
        f'data-first-failing-step="{_first_failing(case)}">'
        f"<h2>{_badge(case.status)} {_esc(case.title)}</h2>"
        f'<p class="prompt">prompt <code>{_token_html(_shown_prompt(case.prompt))}</code></p>'
        f"{_tolerance(case)}"
        + (f'<ul class="notes">{notes}</ul>' if notes else "")
        + _token_strip(case)
        + '<div class="curves">'
        + "".join(_chart(metric, case) for metric in METRICS)
        + "".join(_position_chart(metric, case) for metric in METRICS if case.positions)
        + "</div></section>"
    )


PROMPT_SHOWN = 240  # characters of a long prompt shown on the page


def _shown_prompt(prompt: str) -> str:
    if len(prompt) <= PROMPT_SHOWN:
        return prompt
    return f"{prompt[:PROMPT_SHOWN]} … ({len(prompt)} characters)"


def _first_failing(case: CaseView) -> str:
    return "" if case.first_failing_step is None else str(case.first_failing_step)


def _badge(status: str) -> str:
    return f'<span class="status status-{status.lower()}">{status}</span>'


def _tolerance(case: CaseView) -> str:
    if case.tolerance_label is None and case.logprob_atol is None and case.kl_max is None:
        return ""
    bounds = []
    if case.logprob_atol is not None:
        bounds.append(f"|Δ log-prob| ≤ {case.logprob_atol:g}")
    if case.kl_max is not None:
        bounds.append(f"KL ≤ {case.kl_max:g}")
    label = case.tolerance_label or ""
    return (
        f'<p class="tolerance" data-tolerance="{_esc(label)}">tolerance '
        f"<code>{_esc(label)}</code> {_esc(', '.join(bounds))}</p>"
    )


# Whitespace and control characters drawn as visible marks (grey, class "ws").
_VISIBLE = {" ": "·", "\n": "↵", "\t": "→", "\r": "␍"}


def _token_html(text: str) -> str:
    """A token's text, escaped, with whitespace and control characters made visible."""
    if not text:
        return '<span class="ws">∅</span>'
    out = []
    for char in text:
        if char in _VISIBLE:
            out.append(f'<span class="ws">{_VISIBLE[char]}</span>')
        elif not char.isprintable():
            out.append(f'<span class="ws">{_esc(char.encode("unicode_escape").decode())}</span>')
        else:
            out.append(_esc(char))
    return "".join(out)


def _token_strip(case: CaseView) -> str:
    steps = range(len(case.golden_tokens))
    head = "".join(f'<th data-step="{i}"{_classes(_step_classes(case, i))}>{i}</th>' for i in steps)
    golden = "".join(
        _token_cell(case, i, case.golden_tokens[i], _id(case.golden_ids, i), []) for i in steps
    )
    run = "".join(_run_cell(case, i) for i in steps)
    return (
        '<div class="strip-scroll"><table class="token-strip">'
        f'<tr class="steps"><th>step</th>{head}</tr>'
        f'<tr class="golden"><th>golden</th>{golden}</tr>'
        f'<tr class="run"><th>run</th>{run}</tr>'
        "</table></div>"
    )


def _step_classes(case: CaseView, step: int) -> list[str]:
    classes = []
    if step < len(case.step_status) and case.step_status[step] != "PASS":
        classes.append(f"step-{case.step_status[step].lower()}")
    if step == case.first_failing_step:
        classes.append("first-failing")
    return classes


def _run_cell(case: CaseView, step: int) -> str:
    if step >= len(case.run_tokens):
        return f'<td data-step="{step}"{_classes(["missing"])} title="no run token">—</td>'
    text, token_id = case.run_tokens[step], _id(case.run_ids, step)
    golden_id = _id(case.golden_ids, step)
    other_id = token_id is not None and golden_id is not None and token_id != golden_id
    changed = ["changed"] if other_id or text != case.golden_tokens[step] else []
    return _token_cell(case, step, text, token_id, changed)


def _id(ids: tuple[int, ...], step: int) -> int | None:
    return ids[step] if step < len(ids) else None


def _token_cell(
    case: CaseView, step: int, text: str, token_id: int | None, classes: list[str]
) -> str:
    if step == case.first_failing_step:
        classes = [*classes, "first-failing"]
    data_id = "" if token_id is None else f' data-token-id="{token_id}"'
    return (
        f'<td data-step="{step}"{_classes(classes)} title="{_esc(repr(text))}"{data_id}>'
        f"{_token_html(text)}</td>"
    )


def _classes(classes: list[str]) -> str:
    return f' class="{" ".join(classes)}"' if classes else ""


# Chart geometry, in SVG user units (= CSS pixels).
WIDTH, HEIGHT = 540, 210
LEFT, RIGHT, TOP, BOTTOM = 54, 14, 24, 30
PLOT_W, PLOT_H = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM


@dataclasses.dataclass(frozen=True)
class _Scale:
    """Steps along x; log10 of the value along y, from decade `lo` to `hi`, ticked every
    `stride` decades."""

    steps: int
    lo: int
    hi: int
    stride: int

    def x(self, step: int) -> float:
        if self.steps <= 1:
            return LEFT + PLOT_W / 2
        return LEFT + step * PLOT_W / (self.steps - 1)

    def y(self, value: float) -> float:
        exponent = self.hi if value == math.inf else _log10(value)
        exponent = min(max(exponent, self.lo), self.hi)
        return TOP + (self.hi - exponent) * PLOT_H / (self.hi - self.lo)


def _log10(value: float) -> float:
    return math.log10(value) if value > 0 else -math.inf


def _scale(steps: int, values: list[float], threshold: float | None) -> _Scale:
    """`steps` along x; a whole decade more above and below the finite positive values and the
    threshold (on the edges: zeros, infinities, values under 1e-12), at most 6 ticks, the
    bottom edge on a tick."""
    shown = [v for v in (*values, threshold or 0.0) if 0 < v < math.inf]
    lo = max(LOG_FLOOR, math.floor(math.log10(min(shown))) - 1) if shown else LOG_FLOOR
    hi = max(lo + 1, math.floor(math.log10(max(shown))) + 1) if shown else 0
    stride = math.ceil((hi - lo) / 6)
    return _Scale(steps, hi - stride * math.ceil((hi - lo) / stride), hi, stride)


def _chart(metric: str, case: CaseView) -> str:
    label, tolerance_field = METRICS[metric]
    values = list(getattr(case, metric))
    threshold = getattr(case, tolerance_field)
    scale = _scale(max(len(values), len(case.golden_tokens)), values, threshold)
    parts = [
        f'<svg class="curve" data-metric="{metric}" data-scale="log" width="{WIDTH}" '
        f'height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" role="img">'
        f"<title>{_esc(label)} per step</title>",
        f'<text class="chart-title" x="{LEFT}" y="15">{_esc(label)}</text>',
        _grid(scale, values),
        _first_failing_line(scale, case.first_failing_step),
    ]
    if threshold is not None:
        parts.append(_tolerance_line(scale, threshold))
    if values:
        points = " ".join(f"{scale.x(i):.1f},{scale.y(v):.1f}" for i, v in enumerate(values))
        parts.append(f'<polyline class="series" data-series="{metric}" points="{points}"/>')
        parts.append(_points(scale, values, threshold))
    parts.append("</svg>")
    return "".join(parts)


def _position_chart(metric: str, case: CaseView) -> str:
    """The metric at each recorded prompt position, on an axis of positions (not steps):
    `svg.curve[data-axis=position]`, one `circle.point[data-position]` per position."""
    label, tolerance_field = METRICS[metric]
    values = list(getattr(case, f"position_{metric}"))
    threshold = getattr(case, tolerance_field)
    scale = _scale(max(case.positions) + 1, values, threshold)
    points = " ".join(
        f"{scale.x(p):.1f},{scale.y(v):.1f}" for p, v in zip(case.positions, values, strict=True)
    )
    circles = []
    for position, value in zip(case.positions, values, strict=True):
        above = threshold is not None and value > threshold
        circles.append(
            f'<circle data-position="{position}"'
            f'{_classes(["point", *(["above"] if above else [])])} cx="{scale.x(position):.1f}" '
            f'cy="{scale.y(value):.1f}" r="3"><title>position {position}: {_num(value)}</title>'
            "</circle>"
        )
    return "".join(
        [
            f'<svg class="curve" data-metric="{metric}" data-axis="position" data-scale="log" '
            f'width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" role="img">'
            f"<title>{_esc(label)} per prompt position</title>",
            f'<text class="chart-title" x="{LEFT}" y="15">{_esc(label)}, prompt positions</text>',
            _grid(scale, values),
            _tolerance_line(scale, threshold) if threshold is not None else "",
            f'<polyline class="series" data-series="{metric}" points="{points}"/>',
            f'<g class="points">{"".join(circles)}</g>',
            "</svg>",
        ]
    )


def _grid(scale: _Scale, values: list[float]) -> str:
    clamped = any(v < 10.0**scale.lo for v in values)
    lines = [f'<rect class="plot" x="{LEFT}" y="{TOP}" width="{PLOT_W}" height="{PLOT_H}"/>']
    for decade in range(scale.hi, scale.lo - 1, -scale.stride):
        y = scale.y(10.0**decade)
        text = ("≤" if clamped and decade == scale.lo else "") + _decade(decade)
        lines.append(f'<line x1="{LEFT}" x2="{LEFT + PLOT_W}" y1="{y:.1f}" y2="{y:.1f}"/>')
        lines.append(f'<text class="y-tick" x="{LEFT - 6}" y="{y + 4:.1f}">{text}</text>')
    step_stride = max(1, math.ceil(scale.steps / 20))
    for step in range(0, scale.steps, step_stride):
        x, y = scale.x(step), TOP + PLOT_H + 16
        lines.append(f'<text class="x-tick" x="{x:.1f}" y="{y}">{step}</text>')
    return f'<g class="grid">{"".join(lines)}</g>'


def _decade(decade: int) -> str:
    return "1" if decade == 0 else f"1e{decade}"


def _first_failing_line(scale: _Scale, step: int | None) -> str:
    if step is None:
        return ""
    x = scale.x(step)
    return (
        f'<line class="first-failing" data-step="{step}" x1="{x:.1f}" x2="{x:.1f}" '
        f'y1="{TOP}" y2="{TOP + PLOT_H}"/>'
    )


def _tolerance_line(scale: _Scale, threshold: float) -> str:
    y = scale.y(threshold)
    return (
        f'<line class="tolerance" data-value="{threshold:g}" x1="{LEFT}" x2="{LEFT + PLOT_W}" '
        f'y1="{y:.1f}" y2="{y:.1f}"/>'
        f'<text class="tolerance-label" x="{LEFT + PLOT_W - 4}" y="{y - 4:.1f}">'
        f"tolerance {threshold:g}</text>"
    )


def _points(scale: _Scale, values: list[float], threshold: float | None) -> str:
    circles = []
    for step, value in enumerate(values):
        above = threshold is not None and value > threshold
        circles.append(
            f'<circle data-step="{step}"{_classes(["point", *(["above"] if above else [])])} '
            f'cx="{scale.x(step):.1f}" cy="{scale.y(value):.1f}" r="3">'
            f"<title>step {step}: {_num(value)}</title></circle>"
        )
    return f'<g class="points">{"".join(circles)}</g>'


def _num(value: float) -> str:
    return "∞" if value == math.inf else f"{value:.3g}"


def _esc(text: str) -> str:
    return html.escape(text, quote=True)


_CSS = """
body{font:14px/1.45 system-ui,sans-serif;color:#1f2328;background:#fff;margin:24px;
max-width:1140px}
h1{font-size:20px;margin:0 0 12px}
h2{font-size:16px;margin:0 0 6px}
code{font-family:ui-monospace,monospace;background:#f6f8fa;padding:0 3px;border-radius:3px}
.summary{background:#f6f8fa;border:1px solid #d0d7de;border-radius:6px;padding:10px 14px;
margin-bottom:18px}
.summary ul{margin:0 0 8px;padding-left:18px}
.overview{border-collapse:collapse}
.overview th,.overview td{text-align:left;padding:2px 14px 2px 0}
.case{border:1px solid #d0d7de;border-radius:6px;padding:12px 14px;margin-bottom:18px}
.case p{margin:4px 0}
.notes{margin:4px 0 8px;padding-left:18px;color:#57606a}
.status{display:inline-block;padding:0 8px;border-radius:10px;font-size:12px;font-weight:600;
color:#fff;vertical-align:2px}
.status-pass{background:#1a7f37}.status-identical{background:#57606a}
.status-fail{background:#cf222e}.status-ambiguous{background:#9a6700}
.status-changed{background:#bc4c00}
.strip-scroll{overflow-x:auto;margin:8px 0}
.token-strip{border-collapse:collapse;font:13px ui-monospace,monospace}
.token-strip th,.token-strip td{border:1px solid #d0d7de;padding:2px 6px;white-space:pre;
text-align:center;min-width:3ch}
.token-strip tr>th:first-child{text-align:right;color:#57606a;font-weight:normal}
.token-strip tr.steps th{color:#57606a;font-weight:normal}
.token-strip th.step-fail{background:#ffebe9;color:#82071e}
.token-strip th.step-ambiguous{background:#fff8c5;color:#7d4e00}
.token-strip td.changed{background:#ffd8b5;color:#762c00;font-weight:600}
.token-strip td.missing{color:#8c959f}
.token-strip .first-failing{box-shadow:inset 0 0 0 2px #cf222e}
.ws{color:#8c959f}
.curves{display:flex;flex-wrap:wrap;gap:12px;margin-top:6px}
svg.curve{border:1px solid #eaeef2;border-radius:4px}
svg.curve text{font:11px system-ui,sans-serif;fill:#57606a}
svg.curve .chart-title{font-size:12px;fill:#1f2328}
svg.curve .y-tick{text-anchor:end}
svg.curve .x-tick{text-anchor:middle}
svg.curve .plot{fill:none;stroke:#d0d7de}
svg.curve .grid line{stroke:#eaeef2}
svg.curve .series{fill:none;stroke:#0969da;stroke-width:1.5}
svg.curve .point{fill:#0969da}
svg.curve .point.above{fill:#cf222e}
svg.curve line.tolerance{stroke:#cf222e;stroke-width:1.2;stroke-dasharray:6 4}
svg.curve .tolerance-label{text-anchor:end;fill:#cf222e}
svg.curve line.first-failing{stroke:#cf222e;stroke-opacity:.25;stroke-width:8}
""".strip()
