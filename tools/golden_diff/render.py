"""golden_diff's output: the text summary (what a reviewer reads next to the new hash), the
same review as markdown (a table per golden file, for a pull request) and as JSON, and the
HTML report (goldens/report.py's page, one section per changed case)."""

from __future__ import annotations

import json
from collections.abc import Iterable

import numpy as np

from goldens.diff import (
    IDENTICAL_STEP,
    CaseDiff,
    FileDiff,
    GoldenSet,
    StepDelta,
    case_rows,
    constrained_class,
    file_class,
    first_difference,
    number,
    sampling_class,
    worst_class,
)
from goldens.report import CaseView
from goldens.schema import Case

CONTEXT_BEFORE, CONTEXT_AFTER = 2, 3  # steps of token context around a divergence


def token_at(case: Case, step: int) -> str:
    return repr(case.steps[step].token_text) if step < len(case.steps) else "(no step)"


def case_line(diff: CaseDiff) -> str:
    before, after = diff.before, diff.after
    if before is None or after is None or diff.status == "identical":
        return f"case {diff.case_id}: {diff.status}"
    if diff.status == "prompt differs":
        return f"case {diff.case_id}: prompt differs: {before.prompt!r} -> {after.prompt!r}"
    if diff.status == "input ids differ":
        return f"case {diff.case_id}: {input_ids_difference(before.input_ids, after.input_ids)}"
    return f"case {diff.case_id}: " + "; ".join(changed_parts(diff, before, after))


def changed_parts(diff: CaseDiff, before: Case, after: Case) -> list[str]:
    """The first changed step and its tokens, the worst numbers, and what the tokens did;
    then what changed at the recorded prompt positions."""
    deltas = diff.deltas
    positions = position_parts(diff, before, after)
    step = first_difference(before.steps, after.steps)
    if step is None:
        # the steps are equal: what else changed (prompt positions, sampling or constrained
        # goldens, the end of sequence)
        others = [
            why
            for changed in (sampling_class(before, after), constrained_class(before, after))
            if changed is not None
            for why in [changed[1]]
        ]
        if before.stopped_on_eos != after.stopped_on_eos:
            others.append(f"stopped_on_eos {before.stopped_on_eos} -> {after.stopped_on_eos}")
        return ["steps identical", *positions, *others]
    divergence = first_difference(before.token_ids, after.token_ids)
    parts = [f"first changed step {step}: {token_change(before, after, step)}"]
    if deltas:
        parts.append(worst_numbers(deltas, divergence))
    parts.append(
        "greedy tokens unchanged" if divergence is None else f"tokens differ from step {divergence}"
    )
    if len(before.steps) != len(after.steps):
        parts.append(f"{len(before.steps)} -> {len(after.steps)} steps")
    return parts + positions


def position_parts(diff: CaseDiff, before: Case, after: Case) -> list[str]:
    """Prompt positions recorded on one side only, and the worst change at those both
    record (the position, not a step, names it)."""
    parts = []
    if before.positions != after.positions:
        added = sorted(set(after.positions) - set(before.positions))
        removed = sorted(set(before.positions) - set(after.positions))
        reach = f" (up to position {max(after.positions)})" if after.positions else ""
        parts.append(
            f"prompt positions {len(before.positions)} -> {len(after.positions)} recorded"
            f"{reach}: {len(added)} added, {len(removed)} removed"
        )
    moved = {p: d for p, d in diff.position_deltas.items() if d != IDENTICAL_STEP}
    if moved:
        worst = max(moved, key=lambda p: moved[p].max_logprob_diff)
        parts.append(
            f"{len(moved)} of {len(diff.position_deltas)} prompt positions moved: max "
            f"|Δ log-prob| {number(moved[worst].max_logprob_diff)} (position {worst}), "
            f"max KL {number(max(d.kl for d in moved.values()))}"
        )
    return parts


def token_id_at(case: Case, step: int) -> int | None:
    return case.steps[step].token_id if step < len(case.steps) else None


def token_change(before: Case, after: Case, step: int) -> str:
    """The greedy tokens at `step`, told apart by id: tokens whose text alone is the same
    (each byte of a multi-byte character decodes to '\ufffd') carry their ids."""
    first, second = token_at(before, step), token_at(after, step)
    first_id, second_id = token_id_at(before, step), token_id_at(after, step)
    if first_id == second_id:
        # one id decoded two ways (the decoder changed between the goldens)
        return f"{first} (same token)" if first == second else f"{first} -> {second} (same id)"
    if first == second:
        first, second = f"{first} (id {first_id})", f"{second} (id {second_id})"
    return f"{first} -> {second}"


def worst_numbers(deltas: list[StepDelta], divergence: int | None) -> str:
    """The case's max |Δ log-prob| with its step and caveats, and its max KL."""
    worst = int(np.argmax([d.max_logprob_diff for d in deltas]))
    notes = [f"step {worst}"]
    if divergence is not None and worst > divergence:
        notes.append("after the tokens diverged")
    if deltas[worst].bounded_ids:
        count = deltas[worst].bounded_ids
        notes.append(f"{count} id{'s' * (count > 1)} outside the to top-k, bounded")
    return (
        f"max |Δ log-prob| {number(deltas[worst].max_logprob_diff)} ({', '.join(notes)}), "
        f"max KL {number(max(d.kl for d in deltas))}"
    )


def input_ids_difference(before: list[int], after: list[int]) -> str:
    at = first_difference(before, after) or 0
    first = before[at] if at < len(before) else "(end)"
    second = after[at] if at < len(after) else "(end)"
    return (
        f"input ids differ at position {at}: {first} -> {second} "
        f"({len(before)} -> {len(after)} ids; tokenizer or BOS changed?)"
    )


def context_lines(before: Case, after: Case) -> list[str]:
    """The greedy tokens of both sides around their first difference, '|' marking it."""
    at = first_difference(before.token_ids, after.token_ids)
    if at is None:
        return []
    start = max(0, at - CONTEXT_BEFORE)
    # the first differing tokens carry their ids where their texts coincide (token_change)
    same_text = token_at(before, at) == token_at(after, at)
    lines = []
    for label, case in (("from:", before), ("to:", after)):
        texts = [repr(s.token_text) for s in case.steps[start : at + CONTEXT_AFTER]]
        if same_text and at < len(case.steps):
            texts[at - start] += f" (id {case.steps[at].token_id})"
        marked = [*texts[: at - start], "|", *texts[at - start :]]
        steps = f"steps {start}-{start + len(texts) - 1}:"
        lines.append(f"  {label:<5} {steps} {' '.join(marked)}")
    return lines


def file_lines(diff: FileDiff) -> list[str]:
    if diff.status == "added":
        return [f"{diff.name}: added ({len(diff.cases)} cases)"]
    if diff.status == "removed":
        return [f"{diff.name}: removed ({len(diff.cases)} cases)"]
    header = f"{diff.name}: {diff.status}"
    if diff.status != "identical":
        header += f" [{file_class(diff)[0]}]"
    if diff.header_differences:
        header += ": " + "; ".join(diff.header_differences)
    lines = [header]
    for case in diff.cases:
        lines.append("  " + case_line(case))
        if case.status == "changed":
            lines += ["  " + line for line in context_lines(case.before, case.after)]
    return lines


def verdict(diffs: Iterable[FileDiff]) -> str:
    statuses = [d.status for d in diffs]
    common = statuses.count("identical") + statuses.count("changed")
    changed, added, removed = (statuses.count(s) for s in ("changed", "added", "removed"))
    if changed + added + removed == 0:
        return f"identical: {common} files"
    return f"different: {changed} of {common} files changed, {added} added, {removed} removed"


def summary_lines(
    name: str, before: GoldenSet, after: GoldenSet, diffs: list[FileDiff]
) -> list[str]:
    lines = [f"golden diff {name}", f"from: {before.description}", f"to:   {after.description}"]
    for diff in diffs:
        lines += file_lines(diff)
    klass, where = worst_class(diffs)
    if klass == "identical":
        return [*lines, verdict(diffs)]
    return [*lines, verdict(diffs), f"worst: {klass} ({where})"]


def markdown_lines(
    name: str, before: GoldenSet, after: GoldenSet, diffs: list[FileDiff]
) -> list[str]:
    """The review as markdown: the verdict, then one table per golden file (case, first
    changed step, tokens before/after there, max |Δ log-prob|, KL, class)."""
    klass, where = worst_class(diffs)
    lines = [
        f"### golden diff `{name}`: {klass}",
        "",
        f"from: {_md(before.description)}  ",
        f"to: {_md(after.description)}  ",
        f"{verdict(diffs)}" + ("" if klass == "identical" else f"; worst: {klass} ({_md(where)})"),
    ]
    rows = case_rows(diffs)
    for diff in diffs:
        header = f"`{diff.name}`: {diff.status}"
        if diff.status != "identical":
            header += f" [{file_class(diff)[0]}]"
        lines += ["", f"#### {header}", ""]
        if diff.header_differences:
            lines += [f"header: {_md('; '.join(diff.header_differences))}", ""]
        lines += [
            "| case | first changed step | token before | token after | max \\|Δ log-prob\\| "
            "| max KL | class |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        for row in (r for r in rows if r.file == diff.name):
            step = "" if row.first_changed_step is None else str(row.first_changed_step)
            klass_cell = row.klass + (f": {_md(row.why)}" if row.why else "")
            # different ids with one text ('\ufffd', a byte of a character each): the ids
            with_ids = row.token_id_before != row.token_id_after and (
                row.token_before == row.token_after
            )
            before_cell = _token(row.token_before, row.token_id_before if with_ids else None)
            after_cell = _token(row.token_after, row.token_id_after if with_ids else None)
            lines.append(
                f"| {_md(row.case)} | {step} | {before_cell} | "
                f"{after_cell} | {number(row.max_logprob_diff)} | "
                f"{number(row.max_kl)} | {klass_cell} |"
            )
    return lines


def json_document(name: str, before: GoldenSet, after: GoldenSet, diffs: list[FileDiff]) -> str:
    """The review as JSON: the verdict, the worst class and one object per case."""
    klass, where = worst_class(diffs)
    body = {
        "name": name,
        "from": before.description,
        "to": after.description,
        "verdict": verdict(diffs),
        "worst": {"class": klass, "where": where},
        "files": [{"file": d.name, "status": d.status, "class": file_class(d)[0]} for d in diffs],
        "cases": [row.as_json() for row in case_rows(diffs)],
    }
    return json.dumps(body, indent=1, ensure_ascii=False)


def _md(text: str) -> str:
    """Text safe in a markdown table cell."""
    return text.replace("|", "\\|").replace("\n", " ")


def _token(text: str | None, token_id: int | None = None) -> str:
    if text is None:
        return ""
    return f"`{_md(repr(text))}`" + ("" if token_id is None else f" (id {token_id})")


def case_views(diffs: list[FileDiff]) -> list[CaseView]:
    """One CaseView per case both sides have, changed or identical."""
    return [
        case_view(file, case)
        for file in diffs
        for case in file.cases
        if case.before is not None and case.after is not None
    ]


def case_view(file: FileDiff, diff: CaseDiff) -> CaseView:
    before, after = diff.before, diff.after
    assert before is not None and after is not None
    notes = [] if diff.status in ("changed", "identical") else [case_line(diff)]
    if len(after.steps) > len(before.steps):  # the page shows the from side's steps
        notes.append(f"the to side has {len(after.steps)} steps, the from side {len(before.steps)}")
    return CaseView(
        title=f"{file.name} / {diff.case_id}",
        prompt=before.prompt,
        golden_tokens=[s.token_text for s in before.steps],
        run_tokens=[s.token_text for s in after.steps[: len(before.steps)]],
        logprob_delta=[d.max_logprob_diff for d in diff.deltas],
        kl=[d.kl for d in diff.deltas],
        status="IDENTICAL" if diff.status == "identical" else "CHANGED",
        first_failing_step=first_difference(before.steps, after.steps),
        notes=(*notes, *file.header_differences),
        positions=tuple(diff.position_deltas),
        position_logprob_delta=tuple(d.max_logprob_diff for d in diff.position_deltas.values()),
        position_kl=tuple(d.kl for d in diff.position_deltas.values()),
    )
