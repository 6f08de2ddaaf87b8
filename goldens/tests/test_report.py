"""The HTML report: what a case view takes from a comparison, and what the page shows of it
(token strip, curves, tolerance, summary), queried through its stable hooks."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from goldens import compare
from goldens.record import CaseSpec, record_case
from goldens.report import CaseView, case_view, render_html, write_report
from goldens.tests.dom import Element, parse
from goldens.tolerances import Tolerance

TOL = Tolerance(
    "own/float32/cpu",
    logprob_atol=1e-4,
    kl_max=1e-6,
    topk_overlap_min=0.95,
    near_tie_margin=2e-4,
    why="test",
)
FAILING = CaseView(
    title="tiny float32 · prose",
    prompt="The <capital> of\tFrance",
    golden_tokens=[" Paris", ",", " a", " city", "\n"],
    run_tokens=[" Paris", ".", " a", " town", "\n"],
    logprob_delta=[0.0, 2e-3, 5e-5, 0.3, 1e-9],
    kl=[0.0, 4e-6, 1e-8, 1e-2, 1e-12],
    status="FAIL",
    first_failing_step=1,
    tolerance_label="own/float32/cpu",
    logprob_atol=1e-4,
    kl_max=1e-6,
    notes=("first diverging layer: 3, attention",),
    step_status=("PASS", "FAIL", "PASS", "FAIL", "PASS"),
)
PASSING = CaseView(
    title="tiny float32 · code",
    prompt="def f():",
    golden_tokens=["\n", "   "],
    run_tokens=["\n", "   "],
    logprob_delta=[0.0, 0.0],
    kl=[0.0, 0.0],
    status="PASS",
    tolerance_label="own/float32/cpu",
    logprob_atol=1e-4,
    kl_max=1e-6,
)


def _page(*cases: CaseView) -> Element:
    return parse(render_html("golden report", ["line one", "line <two>"], list(cases)))


def _compared(run_steps: int = 6, input_ids=(1, 2, 3)) -> tuple[compare.CaseReport, list[str]]:
    """A six-step golden against a run whose step 3 moved by 1e-3 (and that may end early)."""
    vocab, steps = 64, 6
    logits = (
        np.cos(np.arange(vocab)[None, :] * (np.arange(steps)[:, None] + 1) * 0.7) * 2.0
    ).astype(np.float32)
    for i in range(steps):
        logits[i, (3 * i + 1) % vocab] = 8.0
    tokens = [int(np.argmax(row)) for row in logits]
    spec = CaseSpec("prose", "The capital of France is", steps, 20)
    golden = record_case(spec, [1, 2, 3], tokens, logits, lambda ids: f"<{ids[0]}>", set())
    moved = logits.copy()
    moved[3, golden.steps[3].topk_ids[5]] += 1e-3
    case_report = compare.compare_case(
        golden, list(input_ids), tokens[:run_steps], moved[:run_steps], TOL
    )
    return case_report, [s.token_text for s in golden.steps]


def _points(chart: Element) -> list[tuple[float, float]]:
    return [tuple(map(float, p.split(","))) for p in chart.one("polyline").attrs["points"].split()]


def _chart(page: Element, case: int, metric: str) -> Element:
    return page.one("section", id=f"case-{case}").one("svg", "curve", data_metric=metric)


def test_case_view_takes_every_step_and_the_tolerance_from_the_report():
    case_report, tokens = _compared()
    view = case_view(case_report, "tiny · prose", tokens, tokens, notes=["layer 3"])
    assert view.prompt == "The capital of France is"
    assert view.logprob_delta == [s.max_logprob_diff for s in case_report.steps]
    assert view.logprob_delta[3] == pytest.approx(1e-3, rel=1e-2)
    assert view.kl == [s.kl for s in case_report.steps]
    assert (view.status, view.first_failing_step) == ("FAIL", 3)
    assert view.step_status == ("PASS", "PASS", "PASS", "FAIL", "PASS", "PASS")
    assert (view.tolerance_label, view.logprob_atol, view.kl_max) == ("own/float32/cpu", 1e-4, 1e-6)
    assert view.notes == (
        f"first failing step 3 (logprob): {case_report.first_failing.detail}",
        "layer 3",
    )


def test_a_run_that_ended_early_shows_missing_tokens_and_infinities_on_the_top_edge():
    case_report, tokens = _compared(run_steps=4)
    view = case_view(case_report, "tiny · prose", tokens, tokens[:4])
    assert view.kl[4:] == [math.inf, math.inf]
    page = _page(view)
    run_row = page.one("tr", "run")
    assert [td.attrs["data-step"] for td in run_row.select("td", "missing")] == ["4", "5"]
    chart = _chart(page, 0, "kl")
    top = float(chart.one("rect", "plot").attrs["y"])
    assert [y for _, y in _points(chart)[4:]] == [top, top]


def test_a_changed_tokenization_is_noted():
    case_report, tokens = _compared(input_ids=(1, 2))
    view = case_view(case_report, "tiny · prose", tokens, tokens)
    assert (
        view.notes[0] == "the run's tokenization of the prompt differs from the golden's input ids"
    )


def test_the_token_strip_marks_changed_tokens_and_the_first_failing_step():
    strip = _page(FAILING).one("table", "token-strip")
    assert [td.attrs["data-step"] for td in strip.select("td", "changed")] == ["1", "3"]
    assert all(td in strip.one("tr", "run").children for td in strip.select("td", "changed"))
    first = strip.select(cls="first-failing")
    assert [(e.tag, e.attrs["data-step"]) for e in first] == [("th", "1"), ("td", "1"), ("td", "1")]
    assert [th.attrs["data-step"] for th in strip.select("th", "step-fail")] == ["1", "3"]


def test_tokens_are_escaped_and_whitespace_is_visible():
    page = _page(FAILING, PASSING)
    golden_rows = [row.select("td") for row in page.select("tr", "golden")]
    assert [td.text for td in golden_rows[0]] == ["·Paris", ",", "·a", "·city", "↵"]
    assert [td.text for td in golden_rows[1]] == ["↵", "···"]
    assert golden_rows[0][0].attrs["title"] == "' Paris'"
    assert (
        page.one("section", id="case-0").one("p", "prompt").text == "prompt The·<capital>·of→France"
    )
    assert page.select("capital") == []


def test_each_curve_has_a_point_per_step_on_a_log_scale_with_its_tolerance_line():
    page = _page(FAILING)
    kl = _chart(page, 0, "kl")
    points = _points(kl)
    assert [x for x, _ in points] == sorted(x for x, _ in points)
    assert len(points) == 5
    ys = [y for _, y in points]
    decade = (ys[2] - ys[3]) / 6  # 1e-8 and 1e-2 are six decades apart
    assert ys[4] == pytest.approx(ys[2] + 4 * decade, abs=0.2)  # 1e-12
    tolerance = kl.one("line", "tolerance")
    assert tolerance.attrs["data-value"] == "1e-06"
    assert float(tolerance.attrs["y1"]) == pytest.approx(ys[2] - 2 * decade, abs=0.2)
    plot = kl.one("rect", "plot")
    assert ys[0] == float(plot.attrs["y"]) + float(plot.attrs["height"])  # zero: bottom edge
    assert [c.attrs["data-step"] for c in kl.select("circle", "above")] == ["1", "3"]
    logprob = _chart(page, 0, "logprob_delta")
    assert logprob.one("line", "tolerance").attrs["data-value"] == "0.0001"
    assert [c.attrs["data-step"] for c in logprob.select("circle", "above")] == ["1", "3"]
    assert logprob.one("line", "first-failing").attrs["data-step"] == "1"


def test_a_passing_case_has_no_marks():
    page = _page(PASSING)
    section = page.one("section", "case")
    assert section.attrs["data-status"] == "PASS"
    assert section.attrs["data-first-failing-step"] == ""
    assert section.select(cls="changed") + section.select(cls="first-failing") == []
    assert section.select("circle", "above") == []
    assert len(section.select("line", "tolerance")) == 2


def test_the_summary_has_its_lines_the_tolerance_and_one_row_per_case():
    page = _page(FAILING, PASSING)
    summary = page.one("section", "summary")
    assert [li.text for li in summary.select("li")] == ["line one", "line <two>"]
    rows = [[td.text for td in tr.select("td")] for tr in summary.one("tbody").select("tr")]
    assert rows == [
        ["tiny float32 · prose", "FAIL", "1", "0.3", "0.01"],
        ["tiny float32 · code", "PASS", "", "0", "0"],
    ]
    tolerance = page.one("section", id="case-0").one("p", "tolerance")
    assert tolerance.text == "tolerance own/float32/cpu |Δ log-prob| ≤ 0.0001, KL ≤ 1e-06"
    notes = page.one("section", id="case-0").one("ul", "notes")
    assert [li.text for li in notes.select("li")] == ["first diverging layer: 3, attention"]


def test_the_page_is_self_contained_and_deterministic():
    text = render_html("golden report", ["summary"], [FAILING, PASSING])
    assert text == render_html("golden report", ["summary"], [FAILING, PASSING])
    for outside in ("http", "<script", "src=", "url(", "@import", "<link"):
        assert outside not in text
    assert [a.attrs["href"] for a in parse(text).select("a")] == ["#case-0", "#case-1"]


def test_write_report_replaces_the_file_in_one_step(tmp_path):
    path = tmp_path / "golden_report.html"
    path.write_text("old")
    assert write_report(path, "t", ["s"], [FAILING]) == path
    assert path.read_text(encoding="utf-8") == render_html("t", ["s"], [FAILING])
    assert [p.name for p in tmp_path.iterdir()] == ["golden_report.html"]


def test_a_case_view_refuses_an_unknown_status_and_more_run_tokens_than_steps():
    with pytest.raises(ValueError, match="status 'BROKEN' is not one of PASS, FAIL"):
        CaseView("t", "p", ["a"], ["a"], [0.0], [0.0], "BROKEN")
    with pytest.raises(ValueError, match="2 run tokens for 1 golden steps"):
        CaseView("t", "p", ["a"], ["a", "b"], [0.0], [0.0], "CHANGED")


def _row(page: Element, row: str) -> list[tuple[str, str | None]]:
    """A token strip row's cells: (title, data-token-id) each."""
    cells = page.one("tr", row).select("td")
    return [(td.attrs["title"], td.attrs.get("data-token-id")) for td in cells]


def test_the_golden_row_holds_the_golden_tokens_and_only_the_run_row_marks_changes():
    view = dataclasses.replace(
        FAILING, golden_ids=(11, 12, 13, 14, 15), run_ids=(11, 22, 13, 24, 15)
    )
    page = _page(view)
    assert _row(page, "golden") == [
        ("' Paris'", "11"),
        ("','", "12"),
        ("' a'", "13"),
        ("' city'", "14"),
        ("'\\n'", "15"),
    ]
    assert _row(page, "run") == [
        ("' Paris'", "11"),
        ("'.'", "22"),
        ("' a'", "13"),
        ("' town'", "24"),
        ("'\\n'", "15"),
    ]
    assert page.one("tr", "golden").select(cls="changed") == []
    changed = page.one("tr", "run").select("td", "changed")
    assert [td.attrs["data-step"] for td in changed] == ["1", "3"]


# SmolLM2's tokens of "東京🦙" are single bytes that each decode alone to U+FFFD.
REPLACEMENT = "\ufffd"


def test_a_changed_token_id_is_marked_when_both_texts_are_the_same():
    view = CaseView(
        "smollm2 · cjk",
        "東京🦙",
        [REPLACEMENT] * 3,
        [REPLACEMENT] * 3,
        [0.0] * 3,
        [0.0] * 3,
        "FAIL",
        golden_ids=(30, 31, 32),
        run_ids=(30, 41, 32),
    )
    page = _page(view)
    assert [td.attrs["data-step"] for td in page.select("td", "changed")] == ["1"]
    assert page.one("td", "changed") in page.one("tr", "run").children
    assert _row(page, "run")[1] == (repr(REPLACEMENT), "41")
    same = dataclasses.replace(view, run_ids=(30, 31, 32))
    assert _page(same).select(cls="changed") == []
    with pytest.raises(ValueError, match="2 run token ids for 3 run tokens"):
        dataclasses.replace(view, run_ids=(30, 41))


def test_a_case_view_takes_the_token_ids_from_the_report():
    case_report, _tokens = _compared()
    golden_ids = [s.expected_token for s in case_report.steps]
    moved = dataclasses.replace(case_report.steps[2], actual_token=golden_ids[2] + 1)
    case_report = dataclasses.replace(
        case_report, steps=[*case_report.steps[:2], moved, *case_report.steps[3:]]
    )
    view = case_view(case_report, "tiny · prose", [REPLACEMENT] * 6, [REPLACEMENT] * 6)
    assert view.golden_ids == tuple(golden_ids) == (1, 4, 7, 10, 13, 16)
    assert view.run_ids == (1, 4, 8, 10, 13, 16)
    assert [td.attrs["data-step"] for td in _page(view).select("td", "changed")] == ["2"]


def _with_positions() -> compare.CaseReport:
    """A golden recording prompt positions 0, 255 and 4097, against a run that moved the
    logits at position 4097 by 1e-3 (its argmax unchanged) and nowhere else."""
    vocab = 64
    rows = (np.cos(np.arange(vocab)[None, :] * np.arange(1, 5)[:, None] * 0.7) * 2.0).astype(
        np.float32
    )
    for i in range(4):
        rows[i, 5 * i + 2] = 8.0
    logits, prompt_rows = rows[:1], rows[1:]
    positions = [0, 255, 4097]
    spec = CaseSpec("long", "a long prompt", 1, 20, positions_every=256, long=True)
    input_ids = list(range(1, 4100))
    golden = record_case(
        spec,
        input_ids,
        [2],
        logits,
        lambda ids: f"<{ids[0]}>",
        set(),
        positions=positions,
        prompt_logits=prompt_rows,
    )
    moved = dict(zip(positions, prompt_rows.copy(), strict=True))
    moved[4097][golden.position_steps[2].topk_ids[3]] += 1e-3
    return compare.compare_case(golden, input_ids, [2], logits, TOL, moved)


def test_failing_prompt_positions_are_noted_and_charted_on_a_position_axis():
    case_report = _with_positions()
    view = case_view(case_report, "tiny · long", ["<2>"], ["<2>"])
    check = case_report.prompt_checks[2]
    assert check.status == "FAIL" and check.max_logprob_diff == pytest.approx(1e-3, rel=1e-2)
    assert view.notes == (
        f"1 of 3 prompt positions fail; the first, prompt position 4097 (logprob): {check.detail}",
    )
    assert view.positions == (0, 255, 4097)
    section = _page(view).one("section", "case")
    charts = section.select("svg", "curve", data_axis="position")
    assert [c.attrs["data-metric"] for c in charts] == ["kl", "logprob_delta"]
    for chart, above in zip(charts, ([], ["4097"]), strict=True):  # KL stays within 1e-6
        assert [c.attrs["data-position"] for c in chart.select("circle", "point")] == [
            "0",
            "255",
            "4097",
        ]
        assert [c.attrs["data-position"] for c in chart.select("circle", "above")] == above
        # x: positions 0 to 4097 across the plot, 54 to 526.
        assert [x for x, _ in _points(chart)] == [54.0, 83.4, 526.0]


def test_a_position_chart_draws_each_position_at_its_value_and_the_tolerance():
    view = dataclasses.replace(
        PASSING,
        positions=(0, 255, 4097),
        position_logprob_delta=(1e-6, 1e-3, 1e-5),
        position_kl=(0.0, 1e-2, 1e-8),
    )
    section = _page(view).one("section", "case")
    logprob = section.one("svg", "curve", data_metric="logprob_delta", data_axis="position")
    # Decades 1e-2 (y 24) to 1e-7 (y 180), 31.2 apart.
    assert _points(logprob) == [(54.0, 148.8), (83.4, 55.2), (526.0, 117.6)]
    assert logprob.one("line", "tolerance").attrs["data-value"] == "0.0001"
    assert float(logprob.one("line", "tolerance").attrs["y1"]) == 86.4
    assert [c.text for c in logprob.select("circle", "point")] == [
        "position 0: 1e-06",
        "position 255: 0.001",
        "position 4097: 1e-05",
    ]
    assert [c.attrs["data-position"] for c in logprob.select("circle", "above")] == ["255"]
    kl = section.one("svg", "curve", data_metric="kl", data_axis="position")
    # Decades 1e-1 (y 24) to 1e-9 (y 180), 19.5 apart; zero on the bottom edge.
    assert _points(kl) == [(54.0, 180.0), (83.4, 43.5), (526.0, 160.5)]
    assert float(kl.one("line", "tolerance").attrs["y1"]) == 121.5
    assert [c.attrs["data-position"] for c in kl.select("circle", "above")] == ["255"]
    assert _page(PASSING).select("svg", data_axis="position") == []


def _check(
    step: int, status: str, metric: str = "", detail: str = "", position: int = 0, **kw
) -> compare.StepCheck:
    return compare.StepCheck(
        step=step,
        status=status,
        metric=metric,
        detail=detail,
        expected_token=7,
        actual_token=7,
        golden_gap=1.0,
        max_logprob_diff=0.0,
        kl=0.0,
        topk_overlap=1.0,
        worst=[],
        position=position,
        **kw,
    )


def test_the_notes_count_only_failing_prompt_positions_name_the_first_and_every_ambiguous_check():
    """The derived notes of a case view: 'N of M prompt positions fail' counts FAIL positions
    only (an AMBIGUOUS one is not a failure) and names the first failing one in sequence order;
    every ambiguous check, prompt positions and steps alike, gets its own note. Catches a note
    naming the last failing position (prompt_failing[-1]), counting AMBIGUOUS positions as
    failing (status != "PASS"), and dropping the ambiguous notes."""
    prompt_checks = [
        _check(0, "PASS", position=0, in_prompt=True),
        _check(1, "FAIL", "logprob", "d10", position=10, in_prompt=True),
        _check(2, "FAIL", "kl", "d20", position=20, in_prompt=True),
        _check(3, "AMBIGUOUS", "token", "tie30", position=30, in_prompt=True),
    ]
    steps = [
        _check(0, "PASS", position=40),
        _check(1, "AMBIGUOUS", "token", "tie1", position=41),
        _check(2, "FAIL", "logprob", "d2", position=42),
    ]
    case_report = compare.CaseReport(
        "prose", "p", "FAIL", steps, True, TOL, prompt_checks=prompt_checks
    )
    view = case_view(case_report, "t", ["a", "b", "c"], ["a", "b", "c"], notes=["mine"])
    assert view.notes == (
        "first failing step 2 (logprob): d2",
        "2 of 4 prompt positions fail; the first, prompt position 10 (logprob): d10",
        "ambiguous prompt position 30: tie30",
        "ambiguous step 1 (position 41): tie1",
        "mine",
    )


def test_a_failure_at_step_0_is_marked_like_any_other_step():
    """Step 0 is a step: when it is the first failing one, the overview row, the section's
    data-first-failing-step, the token strip and both curves mark it. Catches a truthiness
    test (`if not step`) in place of `is None` in _first_failing or _first_failing_line."""
    view = dataclasses.replace(
        FAILING, first_failing_step=0, step_status=("FAIL", "PASS", "PASS", "FAIL", "PASS")
    )
    page = _page(view)
    row = page.one("section", "summary").one("tbody").one("tr")
    assert [td.text for td in row.select("td")][:3] == ["tiny float32 · prose", "FAIL", "0"]
    assert page.one("section", "case").attrs["data-first-failing-step"] == "0"
    strip = page.one("table", "token-strip")
    first = strip.select(cls="first-failing")
    assert [(e.tag, e.attrs["data-step"]) for e in first] == [("th", "0"), ("td", "0"), ("td", "0")]
    for metric in ("kl", "logprob_delta"):
        line = _chart(page, 0, metric).one("line", "first-failing")
        assert (line.attrs["data-step"], line.attrs["x1"]) == ("0", "54.0")


def test_an_ambiguous_step_is_marked_ambiguous_in_the_step_row():
    """Per-step status shows in the strip's step row: th.step-fail for FAIL and
    th.step-ambiguous for AMBIGUOUS (its own CSS colour), nothing for PASS. Catches marking
    only FAIL steps (`== "FAIL"` in place of `!= "PASS"`)."""
    view = dataclasses.replace(FAILING, step_status=("PASS", "FAIL", "AMBIGUOUS", "FAIL", "PASS"))
    strip = _page(view).one("table", "token-strip")
    assert [th.attrs["data-step"] for th in strip.select("th", "step-ambiguous")] == ["2"]
    assert [th.attrs["data-step"] for th in strip.select("th", "step-fail")] == ["1", "3"]
    assert [th.attrs.get("class") for th in strip.select("th", data_step="4")] == [None]


def test_a_whitespace_only_change_of_a_token_is_marked_changed():
    """A run token with another text is changed, whitespace included (' Paris' against
    'Paris', '\\n' against '\\n\\n'): whitespace is what the strip makes visible. Catches a
    comparison of stripped texts."""
    view = dataclasses.replace(
        PASSING,
        golden_tokens=[" Paris", "\n", "a"],
        run_tokens=["Paris", "\n\n", "a"],
        logprob_delta=[0.0] * 3,
        kl=[0.0] * 3,
        status="FAIL",
    )
    changed = _page(view).one("tr", "run").select("td", "changed")
    assert [td.attrs["data-step"] for td in changed] == ["0", "1"]


def test_user_text_is_escaped_in_titles_notes_labels_and_attributes():
    """Every piece of user text (case title, notes, tolerance label, token texts in the title
    attribute) reaches the page as text: no markup of its own, and quotes in attributes do not
    end them. Catches an unescaped case title in the overview, unescaped notes, and escaping
    without quote=True."""
    text = 'a <b>bold</b> & "quoted"'
    view = dataclasses.replace(
        FAILING,
        title=text,
        notes=(f"token <|eot_id|> {text}",),
        tolerance_label=text,
        golden_tokens=['"', "'", "\"'", " city", "\n"],
    )
    page = _page(view)
    assert page.select("b") == []
    assert page.one("section", "summary").one("a").text == text
    case = page.one("section", id="case-0")
    assert case.one("h2").text == f"FAIL {text}"
    assert [li.text for li in case.one("ul", "notes").select("li")] == [f"token <|eot_id|> {text}"]
    assert case.one("p", "tolerance").attrs["data-tolerance"] == text
    assert [title for title, _ in _row(page, "golden")][:3] == [repr('"'), repr("'"), repr("\"'")]


def test_a_value_at_the_tolerance_is_not_above_it():
    """A step passes at its tolerance (compare fails only past it: |Δ| > atol, KL > kl_max),
    so a point exactly on the tolerance line is not `.above`. Catches `>=` in _points."""
    view = dataclasses.replace(
        PASSING, logprob_delta=[1e-4, 2e-4], kl=[1e-6, 2e-6], status="FAIL", first_failing_step=1
    )
    page = _page(view)
    for metric in ("kl", "logprob_delta"):
        chart = _chart(page, 0, metric)
        assert [c.attrs["data-step"] for c in chart.select("circle", "above")] == ["1"]


def test_a_prompt_is_shown_whole_up_to_240_characters_and_cut_past_them():
    """PROMPT_SHOWN (240) characters of a prompt are shown; a longer one is cut there and
    says its length. Catches an off-by-one (`<` in place of `<=`) that cuts a 240-character
    prompt."""

    def shown(prompt: str) -> str:
        return _page(dataclasses.replace(PASSING, prompt=prompt)).one("p", "prompt").text

    assert shown("x" * 240) == "prompt " + "x" * 240
    assert shown("y" * 241) == "prompt " + "y" * 240 + "·…·(241·characters)"
