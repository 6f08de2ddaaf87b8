"""golden_diff as a reviewer runs it: synthetic golden sets in tmp_path, and the repository's
own store (test_llama_golden versions 1 and 2)."""

from __future__ import annotations

import dataclasses
import json
import re
import zipfile
from pathlib import Path

import numpy as np
import pytest

from goldens import diff, schema, tolerances
from goldens.artifacts import archive, stanza
from goldens.artifacts.store import ArchiveRef, LocalStore
from goldens.diff import step_delta
from tools.golden_diff import inputs, render
from tools.golden_diff.golden_diff import main

VOCAB, STEPS, TOP_K = 64, 4, 20
OWN = "test_llama_golden"
FLOAT32 = "tinyllama_float32_all_golden.json"
Q4_K = "tinyllama_q4_k_all_golden.json"
PROVENANCE = {
    "producer": "engine",
    "producer_version": "llama3-engine/2",
    "model": "tinyllama",
    "encoding": "float32",
    "hardware": "all",
    "device": "cpu",
    "dtype": "float32",
    "checkpoint": "tiny_llama.gguf",
    "checkpoint_sha256": "a" * 64,
    "torch_version": "2.13.0",
    "logits_dtype": "float32",
}


def _logits(seed: int) -> np.ndarray:
    """STEPS rows; step i prefers token 3 * i + 1 by a wide margin, the rest a fixed pattern."""
    rows = np.cos(np.arange(VOCAB)[None, :] * (np.arange(STEPS)[:, None] + 1) * 0.7 + seed)
    logits = rows.astype(np.float32) * 2.0
    for i in range(STEPS):
        logits[i, 3 * i + 1] = 8.0
    return logits


def _case(case_id: str, logits: np.ndarray, prompt: str = "The capital of France is"):
    steps = []
    for row in logits:
        token = int(np.argmax(row))
        steps.append(schema.step_from_logits(row, token, f" t{token}", TOP_K))
    return schema.Case(case_id, prompt, [128000, 791], steps)


def _golden(logits: dict[str, np.ndarray], **provenance: str) -> schema.Golden:
    cases = [_case(case_id, rows) for case_id, rows in logits.items()]
    return schema.Golden(schema.Provenance(**(PROVENANCE | provenance)), cases)


BASE = {"prose": _logits(0), "code": _logits(1)}


def _write(folder: Path, goldens: dict[str, schema.Golden]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, golden in goldens.items():
        schema.write(golden, folder / name)
    return folder


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Relative paths mean tmp_path; pinned archives are extracted under tmp_path."""
    monkeypatch.delenv("BUILD_WORKING_DIRECTORY", raising=False)
    monkeypatch.delenv("BUILD_WORKSPACE_DIRECTORY", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)


@pytest.fixture
def base(tmp_path: Path) -> Path:
    return _write(tmp_path / "base", {FLOAT32: _golden(BASE), Q4_K: _golden(BASE)})


def test_identical_folders_exit_0_and_say_so(capsys, base: Path, tmp_path: Path) -> None:
    same = _write(tmp_path / "same", {FLOAT32: _golden(BASE), Q4_K: _golden(BASE)})
    code, out, err = _run(capsys, OWN, f"--from={base}", "--to=same")
    assert (code, err) == (0, "")
    assert out.splitlines() == [
        f"golden diff {OWN}",
        f"from: folder {base}",
        f"to:   folder {same}",
        f"{FLOAT32}: identical",
        "  case prose: identical",
        "  case code: identical",
        f"{Q4_K}: identical",
        "  case prose: identical",
        "  case code: identical",
        "identical: 2 files",
    ]


def test_one_changed_step_is_reported_with_its_values(capsys, base: Path, tmp_path: Path) -> None:
    moved = {"prose": BASE["prose"].copy(), "code": BASE["code"]}
    moved["prose"][2, 12] += 0.5  # id 12 is 6th in step 2's top-20; the greedy token stays
    _write(tmp_path / "new", {FLOAT32: _golden(moved), Q4_K: _golden(BASE)})
    code, out, _ = _run(capsys, OWN, f"--from={base}", "--to=new")
    assert code == 1
    lines = out.splitlines()
    assert lines[3:6] == [
        f"{FLOAT32}: changed [over tolerance]",
        "  case prose: first changed step 2: ' t7' (same token); max |Δ log-prob| 0.5 (step 2), "
        "max KL 3.5e-4; greedy tokens unchanged",
        "  case code: identical",
    ]
    assert lines[-2:] == [
        "different: 1 of 2 files changed, 0 added, 0 removed",
        f"worst: over tolerance ({FLOAT32}: case prose: |Δ log-prob| 0.5, KL 3.5e-4 over "
        "own/float32/cpu (0.0001, KL 1e-07))",
    ]


def test_a_failing_tests_outputs_zip_is_its_runs_over_the_other_side(
    capsys, base: Path, tmp_path: Path
) -> None:
    """bazel-testlogs/.../test.outputs/outputs.zip holds the failing goldens' runs only (and
    their reports): the other files are the --from side's, not removed ones."""
    moved = {"prose": BASE["prose"].copy(), "code": BASE["code"]}
    moved["prose"][2, 12] += 0.5
    run = _write(tmp_path / "run", {FLOAT32: _golden(moved)})
    outputs = tmp_path / "outputs.zip"
    with zipfile.ZipFile(outputs, "w") as archive_file:
        archive_file.write(run / FLOAT32, FLOAT32)
        archive_file.writestr("golden_report_tiny-float32-llama3_1_x.html", "<html></html>")
        archive_file.writestr("quantized/" + FLOAT32, "{}")  # another mode's run: not read
    code, out, _ = _run(capsys, OWN, f"--from={base}", f"--to={outputs}")
    assert code == 1
    lines = out.splitlines()
    assert lines[2] == f"to:   test outputs {outputs}, other files from folder {base}"
    assert f"{FLOAT32}: changed [over tolerance]" in lines
    assert f"{Q4_K}: identical" in lines
    # The extracted folder reads the same.
    folder = tmp_path / "extracted"
    with zipfile.ZipFile(outputs) as archive_file:
        archive_file.extractall(folder)
    assert _run(capsys, OWN, f"--from={base}", f"--to={folder}")[1].splitlines()[3:] == lines[3:]


def test_a_zip_that_is_no_test_output_is_refused(capsys, base: Path, tmp_path: Path) -> None:
    with zipfile.ZipFile(tmp_path / "other.zip", "w") as archive_file:
        archive_file.writestr(FLOAT32, "{}")
    code, _, err = _run(capsys, OWN, f"--from={base}", "--to=other.zip")
    assert code == 2
    assert "holds no golden_report_*.html: not the outputs of a golden test" in err


def test_the_review_as_markdown_has_a_table_per_file(capsys, base: Path, tmp_path: Path) -> None:
    moved = {"prose": BASE["prose"].copy(), "code": BASE["code"].copy()}
    moved["prose"][2, 12] += 0.5
    moved["code"][1] = -moved["code"][1]  # the greedy token at step 1 changes
    _write(tmp_path / "new", {FLOAT32: _golden(moved), Q4_K: _golden(BASE)})
    code, out, _ = _run(capsys, OWN, f"--from={base}", "--to=new", "--format=markdown")
    assert code == 1
    lines = out.splitlines()
    assert lines[0] == f"### golden diff `{OWN}`: tokens changed"
    table = lines[lines.index(f"#### `{FLOAT32}`: changed [tokens changed]") + 2 :]
    assert table[0].startswith("| case | first changed step | token before | token after |")
    assert table[2].startswith("| prose | 2 | `' t7'` | `' t7'` | 0.5 | 3.5e-4 | over tolerance")
    assert table[3].startswith("| code | 1 | `' t4'` | ")
    assert table[3].endswith("| tokens changed: from step 1 |")
    assert f"#### `{Q4_K}`: identical" in lines


def test_the_review_as_json_names_every_case_with_its_class(
    capsys, base: Path, tmp_path: Path
) -> None:
    moved = {"prose": BASE["prose"].copy(), "code": BASE["code"]}
    moved["prose"][2, 12] += 0.5
    _write(tmp_path / "new", {FLOAT32: _golden(moved), Q4_K: _golden(BASE)})
    code, out, _ = _run(capsys, OWN, f"--from={base}", "--to=new", "--format=json")
    assert code == 1
    body = json.loads(out)
    assert body["worst"]["class"] == "over tolerance"
    assert [(f["file"], f["class"]) for f in body["files"]] == [
        (FLOAT32, "over tolerance"),
        (Q4_K, "identical"),
    ]
    prose = body["cases"][0]
    assert (prose["file"], prose["case"], prose["class"]) == (FLOAT32, "prose", "over tolerance")
    assert prose["first_changed_step"] == 2 and prose["max_logprob_diff"] == pytest.approx(
        0.5, abs=0.01
    )
    assert [c["class"] for c in body["cases"][1:]] == ["identical"] * 3


def test_step_delta_matches_the_full_distribution_when_nothing_leaves_the_top_k() -> None:
    before, after = BASE["prose"][2], BASE["prose"][2].copy()
    after[12] += 0.5
    token = int(np.argmax(before))
    delta = step_delta(
        schema.step_from_logits(before, token, "", TOP_K),
        schema.step_from_logits(after, token, "", TOP_K),
    )
    p = np.exp(before - np.logaddexp.reduce(before.astype(np.float64)))
    q = np.exp(after - np.logaddexp.reduce(after.astype(np.float64)))
    top = np.argsort(-before, kind="stable")[:TOP_K]
    tail_p, tail_q = 1 - p[top].sum(), 1 - q[top].sum()
    kl = float(np.sum(p[top] * np.log(p[top] / q[top])) + tail_p * np.log(tail_p / tail_q))
    assert delta.max_logprob_diff == pytest.approx(np.abs(np.log(q[top] / p[top])).max(), rel=1e-5)
    assert delta.kl == pytest.approx(kl, rel=1e-4)
    assert delta.bounded_ids == 0


def test_an_id_the_to_side_lacks_is_bounded_by_its_kth_log_prob() -> None:
    before = schema.Step(5, "", [5, 6, 7], [0.0, -1.0, -2.0], 1.0, {})
    after = schema.Step(5, "", [5, 6, 8], [0.0, -1.5, -1.8], 1.0, {})
    delta = step_delta(before, after)
    # id 7: from -3.0, to at most the to side's 3rd log-prob, -2.8 -> |Δ| 0.2; id 6: 0.5.
    assert delta.max_logprob_diff == pytest.approx(0.5)
    assert delta.bounded_ids == 1
    assert step_delta(before, before) == diff.StepDelta(0.0, 0.0, 0)


def test_a_changed_token_shows_both_tokens_and_context(capsys, base: Path, tmp_path: Path) -> None:
    moved = {"prose": BASE["prose"].copy(), "code": BASE["code"]}
    moved["prose"][3, 30] = 9.0  # step 3 now picks id 30 instead of id 10
    _write(tmp_path / "new", {FLOAT32: _golden(moved), Q4_K: _golden(BASE)})
    code, out, _ = _run(capsys, OWN, f"--from={base}", "--to=new")
    assert code == 1
    lines = out.splitlines()
    assert lines[4].startswith("  case prose: first changed step 3: ' t10' -> ' t30'; ")
    assert lines[4].endswith("; tokens differ from step 3")
    assert lines[5:7] == [
        "    from: steps 1-3: ' t4' ' t7' | ' t10'",
        "    to:   steps 1-3: ' t4' ' t7' | ' t30'",
    ]


def _texts(golden: schema.Golden, text: str) -> schema.Golden:
    """`golden` with every step's token text `text`."""
    cases = [
        dataclasses.replace(c, steps=[dataclasses.replace(s, token_text=text) for s in c.steps])
        for c in golden.cases
    ]
    return dataclasses.replace(golden, cases=cases)


def test_tokens_with_one_text_are_told_apart_by_their_ids(capsys, tmp_path: Path) -> None:
    """Each SmolLM2 token of '東京🦙' decodes alone to '\ufffd': two ids with that one text
    are two tokens, in the text, markdown and JSON reviews."""
    moved = {"prose": BASE["prose"].copy(), "code": BASE["code"]}
    moved["prose"][3, 30] = 9.0  # step 3 now picks id 30 instead of id 10
    _write(tmp_path / "a", {FLOAT32: _texts(_golden(BASE), "\ufffd")})
    _write(tmp_path / "b", {FLOAT32: _texts(_golden(moved), "\ufffd")})
    code, out, _ = _run(capsys, OWN, "--from=a", "--to=b")
    assert code == 1
    lines = out.splitlines()
    assert lines[3:7] == [
        f"{FLOAT32}: changed [tokens changed]",
        "  case prose: first changed step 3: '\ufffd' (id 10) -> '\ufffd' (id 30); max |Δ "
        "log-prob| 1.3 (step 3, 1 id outside the to top-k, bounded), max KL 1.2; tokens "
        "differ from step 3",
        "    from: steps 1-3: '\ufffd' '\ufffd' | '\ufffd' (id 10)",
        "    to:   steps 1-3: '\ufffd' '\ufffd' | '\ufffd' (id 30)",
    ]
    code, out, _ = _run(capsys, OWN, "--from=a", "--to=b", "--format=markdown")
    row = next(line for line in out.splitlines() if line.startswith("| prose |"))
    assert row.startswith("| prose | 3 | `'\ufffd'` (id 10) | `'\ufffd'` (id 30) | 1.3 | 1.2 |")
    code, out, _ = _run(capsys, OWN, "--from=a", "--to=b", "--format=json")
    prose = json.loads(out)["cases"][0]
    assert (prose["token_before"], prose["token_after"]) == ("\ufffd", "\ufffd")
    assert (prose["token_id_before"], prose["token_id_after"]) == (10, 30)
    # one id is one token, whatever its text
    unchanged = {"prose": BASE["prose"].copy(), "code": BASE["code"]}
    unchanged["prose"][2, 12] += 0.5
    _write(tmp_path / "c", {FLOAT32: _texts(_golden(unchanged), "\ufffd")})
    line = _run(capsys, OWN, "--from=a", "--to=c")[1].splitlines()[4]
    assert line.startswith("  case prose: first changed step 2: '\ufffd' (same token); ")
    # and one id decoded two ways (another decoder) is still one token
    _write(tmp_path / "d", {FLOAT32: _texts(_golden(BASE), "x")})
    line = _run(capsys, OWN, "--from=a", "--to=d")[1].splitlines()[4]
    assert line.startswith("  case prose: first changed step 0: '\ufffd' -> 'x' (same id); ")


def _with_positions(case: schema.Case, logits: np.ndarray) -> schema.Case:
    """`case` with prompt positions 0..len(logits)-1 recorded from `logits`' rows."""
    steps = [schema.step_from_logits(row, int(np.argmax(row)), "x", TOP_K) for row in logits]
    input_ids = [128000, 791, 6864, 315, 9822, 374]
    return dataclasses.replace(
        case, input_ids=input_ids, positions=list(range(len(steps))), position_steps=steps
    )


def test_moved_prompt_positions_name_the_worst_one(capsys, tmp_path: Path) -> None:
    """Prompt positions that moved: how many, the worst |Δ log-prob| and its position (not the
    first or last that moved), the max KL; a position recorded on one side only changes the
    case."""
    positions = _logits(5)  # 4 rows: positions 0-3
    moved = positions.copy()
    for position, nudge in ((1, 0.1), (2, 0.5), (3, 0.2)):  # position 2's is the worst
        moved[position, np.argsort(positions[position])[-5]] += nudge  # its 5th id
    before = _golden(BASE)
    prose, code = before.cases
    before = dataclasses.replace(
        before, cases=[_with_positions(prose, positions), _with_positions(code, positions)]
    )
    after = dataclasses.replace(
        before,
        cases=[
            _with_positions(prose, moved),
            _with_positions(code, positions[:3]),  # position 3 no longer recorded
        ],
    )
    _write(tmp_path / "a", {FLOAT32: before})
    _write(tmp_path / "b", {FLOAT32: after})
    code_, out, _ = _run(capsys, OWN, "--from=a", "--to=b")
    kl = max(
        step_delta(before.cases[0].position_steps[p], after.cases[0].position_steps[p]).kl
        for p in (1, 2, 3)
    )
    assert diff.number(kl) == "1.7e-4"
    assert code_ == 1
    assert out.splitlines()[3:6] == [
        f"{FLOAT32}: changed [cases changed]",
        "  case prose: steps identical; 3 of 4 prompt positions moved: max |Δ log-prob| 0.5 "
        "(position 2), max KL 1.7e-4",
        "  case code: steps identical; prompt positions 4 -> 3 recorded (up to position 2): "
        "0 added, 1 removed",
    ]
    # the prose case alone: the positions' numbers class it
    klass = diff.case_class(diff.diff_case(before.cases[0], after.cases[0]), None)
    assert klass == ("moved", "|Δ log-prob| 0.5, KL 1.7e-4; no tolerance entry to tell noise")


def test_added_and_removed_files_and_provenance(capsys, base: Path, tmp_path: Path) -> None:
    smollm2 = "smollm2_q4_1_all_golden.json"
    newer = _golden(BASE, torch_version="2.14.0", producer_version="llama3-engine/3")
    _write(tmp_path / "new", {FLOAT32: newer, smollm2: _golden(BASE)})
    code, out, _ = _run(capsys, OWN, f"--from={base}", "--to=new")
    assert code == 1
    assert out.splitlines()[3:] == [
        f"{smollm2}: added (2 cases)",
        f"{FLOAT32}: changed [noise]: producer_version 'llama3-engine/2' -> 'llama3-engine/3'; "
        "torch_version '2.13.0' -> '2.14.0'",
        "  case prose: identical",
        "  case code: identical",
        f"{Q4_K}: removed (2 cases)",
        "different: 1 of 1 files changed, 1 added, 1 removed",
        f"worst: cases changed ({smollm2}: file added)",
    ]


def test_cases_whose_inputs_differ_are_reported_as_such(capsys, base, tmp_path) -> None:
    golden = _golden(BASE)
    prose, code_case = golden.cases
    cases = [
        dataclasses.replace(prose, prompt="Paris is"),
        dataclasses.replace(code_case, input_ids=[128000, 792, 5]),
    ]
    changed = dataclasses.replace(golden, cases=cases)
    _write(tmp_path / "new", {FLOAT32: changed, Q4_K: _golden(BASE)})
    _, out, _ = _run(capsys, OWN, f"--from={base}", "--to=new")
    assert out.splitlines()[4:6] == [
        "  case prose: prompt differs: 'The capital of France is' -> 'Paris is'",
        "  case code: input ids differ at position 1: 791 -> 792 (2 -> 3 ids; tokenizer or BOS "
        "changed?)",
    ]


def test_only_the_names_files_are_compared(capsys, tmp_path: Path) -> None:
    torch_file = "torch_tinyllama_float32_golden.json"
    _write(tmp_path / "a", {FLOAT32: _golden(BASE), torch_file: _golden(BASE)})
    _write(tmp_path / "b", {FLOAT32: _golden(BASE, torch_version="2.14.0")})
    assert _run(capsys, "torch_llama_golden", "--from=a", "--to=a")[1].splitlines()[3] == (
        f"{torch_file}: identical"
    )
    assert _run(capsys, OWN, "--from=a", "--to=b")[1].splitlines()[-2:] == [
        "different: 1 of 1 files changed, 0 added, 0 removed",
        f"worst: noise ({FLOAT32}: only the header changed)",
    ]


def test_html_report_has_one_section_per_case(capsys, base: Path, tmp_path: Path) -> None:
    moved = {"prose": BASE["prose"].copy(), "code": BASE["code"]}
    moved["prose"][1, 12] += 0.5
    _write(tmp_path / "new", {FLOAT32: _golden(moved), Q4_K: _golden(BASE)})
    code, _, err = _run(capsys, OWN, f"--from={base}", "--to=new", "--html=out/diff.html")
    page = (tmp_path / "out" / "diff.html").read_text(encoding="utf-8")
    assert code == 1
    assert err == f"wrote {tmp_path / 'out' / 'diff.html'}\n"
    statuses = re.findall(
        r'<section class="case" id="case-\d+" data-status="(\w+)" '
        r'data-first-failing-step="(\d*)"',
        page,
    )
    assert statuses == [("CHANGED", "1"), ("IDENTICAL", ""), ("IDENTICAL", ""), ("IDENTICAL", "")]
    assert "different: 1 of 2 files changed, 0 added, 0 removed" in page


def test_an_archive_file_is_an_input(capsys, base: Path, tmp_path: Path) -> None:
    (tmp_path / "goldens.tar.gz").write_bytes(archive.pack_files(sorted(base.iterdir())))
    code, out, _ = _run(capsys, OWN, "--from=goldens.tar.gz", f"--to={base}")
    assert out.splitlines()[1] == f"from: archive {tmp_path / 'goldens.tar.gz'}"
    assert (code, out.splitlines()[-1]) == (0, "identical: 2 files")


# --- the store: versions, sha256s, the pin ------------------------------------------------


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A scratch repository: versions 1 and 2 of test_llama_golden in its store, 2 pinned."""
    root = tmp_path / "repo"
    store = LocalStore(root / "artifacts")
    for version, torch_version in ((1, "2.13.0"), (2, "2.14.0")):
        folder = _write(
            tmp_path / f"v{version}", {FLOAT32: _golden(BASE, torch_version=torch_version)}
        )
        data = archive.pack_files(sorted(folder.iterdir()))
        ref = ArchiveRef(OWN, version, archive.sha256_hex(data))
        store.write(ref, data)
    pin = stanza.GoldenPin(OWN, ref.sha256, store.url(ref))
    (root / "MODULE.bazel").write_text(stanza.set_pin("", pin), encoding="utf-8")
    return root


def _store_flags(repo: Path) -> list[str]:
    return [f"--artifacts-dir={repo / 'artifacts'}", f"--module-file={repo / 'MODULE.bazel'}"]


def _sha(repo: Path, version: int) -> str:
    return LocalStore(repo / "artifacts").digests(OWN, version)[0]


def test_versions_shas_and_the_pin_name_stored_archives(capsys, repo: Path) -> None:
    sha1, sha2 = _sha(repo, 1), _sha(repo, 2)
    code, out, _ = _run(capsys, OWN, "--from=1", f"--to={sha2}", *_store_flags(repo))
    assert code == 0  # the numbers are identical: only the provenance moved
    assert out.splitlines()[1:4] == [
        f"from: {OWN} version 1 (sha256 {sha1})",
        f"to:   {OWN} version 2 (sha256 {sha2})",
        f"{FLOAT32}: changed [noise]: torch_version '2.13.0' -> '2.14.0'",
    ]
    code, out, _ = _run(capsys, OWN, "--to=2", *_store_flags(repo))  # --from: the pin
    assert (code, out.splitlines()[-1]) == (0, "identical: 1 files")


def test_bazel_run_defaults_pin_against_testdata(capsys, monkeypatch, repo: Path) -> None:
    """Under `bazel run` the repository is the workspace: its pin, store and testdata."""
    monkeypatch.setenv("BUILD_WORKSPACE_DIRECTORY", str(repo))
    testdata = _write(repo / inputs.TESTDATA, {FLOAT32: _golden(BASE, torch_version="x")})
    code, out, _ = _run(capsys, OWN)
    assert code == 0
    assert out.splitlines()[1:4] == [
        f"from: {OWN} version 2 (sha256 {_sha(repo, 2)})",
        f"to:   folder {testdata}",
        f"{FLOAT32}: changed [noise]: torch_version '2.14.0' -> 'x'",
    ]


def test_repository_store_version_1_against_version_2(capsys) -> None:
    code, out, err = _run(capsys, OWN, "--from=1", "--to=2")
    lines = out.splitlines()
    assert (code, err) == (1, "")
    assert lines[-2:] == [
        "different: 4 of 4 files changed, 0 added, 0 removed",
        "worst: tokens changed (tinyllama_bfloat16_all_golden.json: case code: from step 6)",
    ]
    headers = [line for line in lines if line.endswith("_golden.json") or ": changed" in line]
    # float32 and q4_k moved within their noise floors (they were made on another CPU)
    assert headers == [
        f"{name}: changed [{klass}]: schema_version 1 -> 2; logits_dtype (absent) -> 'float32'; "
        "producer_version 'llama3-engine/1' -> 'llama3-engine/2'"
        for name, klass in (
            ("smollm2_q4_1_all_golden.json", "moved"),
            ("tinyllama_bfloat16_all_golden.json", "tokens changed"),
            (FLOAT32, "noise"),
            (Q4_K, "noise"),
        )
    ]
    bf16 = lines[lines.index(headers[1]) + 1 :]
    # README.md's example: the worst step of `code` comes after its tokens diverged
    assert bf16[:5] == [
        "  case prose: first changed step 0: ' wasm' (same token); max |Δ log-prob| 0.26 (step "
        "0, 1 id outside the to top-k, bounded), max KL 5.7e-3; greedy tokens unchanged",
        "  case code: first changed step 0: 'YO' (same token); max |Δ log-prob| 5.4 (step 9, "
        "after the tokens diverged, 20 ids outside the to top-k, bounded), max KL 3.7; tokens "
        "differ from step 6",
        "    from: steps 4-8: ' forgotten' 'انه' | ')\\r\\n' ' RowBox' ' difference'",
        "    to:   steps 4-8: ' forgotten' 'انه' | \"'][\" '-Out' ' treating'",
        "  case question: first changed step 0: ' avoids' (same token); max |Δ log-prob| 4.1 "
        "(step 9, after the tokens diverged, 20 ids outside the to top-k, bounded), max KL 3.2; "
        "tokens differ from step 8",
    ]
    assert _run(capsys, OWN, "--from=1", "--to=2")[1] == out  # deterministic
    code, out, _ = _run(capsys, OWN, "--from=2", "--to=2")
    assert (code, out.splitlines()[-1]) == (0, "identical: 4 files")


# --- bad input ----------------------------------------------------------------------------


def _error(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    code, out, err = _run(capsys, *args)
    assert (code, out) == (2, "")
    assert err.startswith("golden_diff: error: ") and err.count("\n") == 1
    return err


def test_an_unknown_name_is_refused(capsys, base: Path) -> None:
    err = _error(capsys, "llama_golden", f"--from={base}", f"--to={base}")
    assert (
        "unknown NAME 'llama_golden'; golden archives: test_llama_golden, torch_llama_golden" in err
    )


def test_a_version_not_in_the_store_is_refused(capsys, repo: Path, base: Path) -> None:
    err = _error(capsys, OWN, "--from=9", f"--to={base}", *_store_flags(repo))
    assert f"--from=9: version 9 of {OWN} is not in the local store" in err
    assert "(versions there: 1, 2)" in err


def test_a_folder_without_goldens_is_refused(capsys, base: Path, tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    err = _error(capsys, OWN, f"--from={base}", "--to=empty")
    assert f"--to: folder {tmp_path / 'empty'} holds no {OWN} golden files" in err
    assert "evaluate_llama" in err


def test_a_sha_neither_pinned_nor_stored_is_refused(capsys, repo: Path, base: Path) -> None:
    err = _error(capsys, OWN, f"--from={'0' * 64}", f"--to={base}", *_store_flags(repo))
    assert f"--from={'0' * 64}: this sha256 of {OWN} is neither pinned" in err


def test_unreadable_json_names_the_file(capsys, base: Path, tmp_path: Path) -> None:
    bad = _write(tmp_path / "bad", {})
    (bad / FLOAT32).write_text("{not json", encoding="utf-8")
    err = _error(capsys, OWN, f"--from={base}", "--to=bad")
    assert f"--to: folder {bad}: {FLOAT32} is not readable JSON" in err


def test_a_file_that_is_no_archive_is_refused(capsys, base: Path, tmp_path: Path) -> None:
    (tmp_path / "broken.tar.gz").write_bytes(b"not gzip")
    err = _error(capsys, OWN, "--from=broken.tar.gz", f"--to={base}")
    assert f"--from: archive {tmp_path / 'broken.tar.gz'}: not a readable tar.gz archive" in err


def test_an_archive_failing_its_checksum_is_refused(capsys, repo: Path, base: Path) -> None:
    path = LocalStore(repo / "artifacts").path(ArchiveRef(OWN, 1, _sha(repo, 1)))
    path.write_bytes(b"damaged")
    err = _error(capsys, OWN, "--from=1", f"--to={base}", *_store_flags(repo))
    assert f"--from: {OWN} version 1 (sha256 {_sha(repo, 1)}): checksum mismatch" in err
    assert "git checkout --" in err


def test_a_pinned_archive_missing_from_the_store_is_fetched_by_its_url(capsys, repo, base) -> None:
    """The pinned URL is on a reserved domain, so the fetch reports what is missing."""
    missing = LocalStore(repo / "artifacts").path(ArchiveRef(OWN, 2, _sha(repo, 2)))
    missing.unlink()
    err = _error(capsys, OWN, f"--to={base}", *_store_flags(repo))
    assert f"--from: pinned {OWN} (sha256 {_sha_from_module(repo)}): {OWN}: " in err
    assert "is not in the local store" in err


@pytest.mark.parametrize("before", [None, "--from=3", f"--from={'a' * 64}", "--from=no/such"])
def test_an_unreachable_store_is_one_line_exit_2_naming_the_endpoint(
    capsys, repo: Path, base: Path, closed_port: int, fake_aws_credentials: None, before: str | None
) -> None:
    """Listing the store's versions and sha256s (for the pin, a version, a sha256, or the
    message about an input that is none of them) goes through the same check as a download:
    an S3 endpoint nobody listens on is bad input naming it, not a traceback (exit 1)."""
    endpoint = f"http://127.0.0.1:{closed_port}"
    store = [
        "--bucket=goldens",
        f"--endpoint-url={endpoint}",
        f"--module-file={repo / 'MODULE.bazel'}",
    ]
    err = _error(capsys, OWN, *([before] if before else []), f"--to={base}", *store)
    assert f"golden_diff: error: --from: listing on s3://goldens/artifacts at {endpoint}" in err


def _sha_from_module(repo: Path) -> str:
    return stanza.parse((repo / "MODULE.bazel").read_text(encoding="utf-8"))[OWN].sha256


def test_an_html_path_that_is_a_folder_exits_2_before_the_review(
    capsys, base: Path, tmp_path: Path
) -> None:
    """--html names the file to write: a folder there exits 2 before anything is printed (it
    printed the review, then stopped in a traceback renaming its page over the folder)."""
    _write(tmp_path / "new", {FLOAT32: _golden(BASE), Q4_K: _golden(BASE)})
    (tmp_path / "out").mkdir()
    code, out, err = _run(capsys, OWN, f"--from={base}", "--to=new", "--html=out")
    assert code == 2 and out == ""
    assert f"--html={tmp_path / 'out'} is a directory; name the file to write" in err


def test_help_has_examples(capsys) -> None:
    code, out, _ = _run(capsys, "--help")
    assert code == 0
    assert "examples:\n  # the pinned archive against the goldens" in out
    # test_llama is sharded (shard_count 2): its outputs are per shard
    outputs = "llama3/test_llama/shard_1_of_2/test.outputs/outputs.zip"
    assert f"--to=bazel-testlogs/max_tests/integration/architectures/{outputs}\n" in out
    assert "test_llama/test.outputs" not in out


def test_a_schema_1_golden_is_read_leniently() -> None:
    body = json.loads(schema.to_json(_golden(BASE)))
    body["schema_version"] = 1
    del body["provenance"]["logits_dtype"]
    golden = diff.parse_golden(json.dumps(body).encode(), "v1.json")
    assert (golden.schema_version, "logits_dtype" in golden.provenance) == (1, False)
    assert [c.id for c in golden.cases] == ["prose", "code"]


def test_a_move_within_the_noise_floor_is_noise_and_exits_0(capsys, base, tmp_path) -> None:
    """own/float32/cpu's noise floor (the larger of noise_floor and isa_noise_floor) is ~5e-5:
    a 1e-5 nudge is noise, 5e-4 is over the 1e-4 tolerance; a changed token is worse."""
    cases = {}
    for name, delta in (("noise", 1e-5), ("over", 5e-4)):
        moved = {"prose": BASE["prose"].copy(), "code": BASE["code"]}
        moved["prose"][2, 12] += delta
        cases[name] = _write(tmp_path / name, {FLOAT32: _golden(moved), Q4_K: _golden(BASE)})
    code, out, _ = _run(capsys, OWN, f"--from={base}", f"--to={cases['noise']}")
    assert code == 0 and out.splitlines()[3] == f"{FLOAT32}: changed [noise]"
    assert out.splitlines()[-1].startswith(f"worst: noise ({FLOAT32}: case prose: |Δ log-prob|")
    code, out, _ = _run(capsys, OWN, f"--from={base}", f"--to={cases['over']}")
    assert code == 1 and out.splitlines()[3] == f"{FLOAT32}: changed [over tolerance]"


def _sampled(tokens: list[int], probs: list[float], settings: dict | None = None) -> schema.Sampled:
    kept = schema.Kept([1, 4], probs)
    settings = settings or {"temperature": 2.0, "top_k": 2, "seed": 12}
    return schema.Sampled("hot", settings, [kept] * STEPS, tokens, [kept] * len(tokens))


def test_a_changed_sampling_golden_is_classed_by_what_changed() -> None:
    """Sampling goldens in a case's class: an added sampler changes cases, a different seeded
    continuation or kept set changes tokens, probabilities alone (logits equal) moved."""
    plain = _case("prose", BASE["prose"])
    with_hot = dataclasses.replace(plain, sampling=[_sampled([1, 4], [0.6, 0.4])])

    def klass(before, after) -> tuple[str, str]:
        return diff.case_class(diff.diff_case(before, after), None)

    assert klass(with_hot, with_hot) == ("identical", "")
    assert klass(plain, with_hot) == ("cases changed", "samplers added ['hot']")
    reseeded = dataclasses.replace(
        plain, sampling=[_sampled([1, 4], [0.6, 0.4], {"temperature": 2.0, "top_k": 2, "seed": 1})]
    )
    assert klass(with_hot, reseeded) == ("cases changed", "samplers settings changed ['hot']")
    redrawn = dataclasses.replace(plain, sampling=[_sampled([4, 4], [0.6, 0.4])])
    assert klass(with_hot, redrawn) == (
        "tokens changed",
        "sampler hot's seeded continuation from draw 0",
    )
    kept = dataclasses.replace(
        plain,
        sampling=[
            dataclasses.replace(with_hot.sampling[0], forced=[schema.Kept([1], [1.0])] * STEPS)
        ],
    )
    assert klass(with_hot, kept) == (
        "tokens changed",
        "sampler hot's kept tokens at teacher-forced step 0",
    )
    moved = dataclasses.replace(plain, sampling=[_sampled([1, 4], [0.5, 0.5])])
    klass_moved, why = klass(with_hot, moved)
    assert (klass_moved, why.split("; ")[-1]) == ("moved", "sampling: max |Δ probability| 0.1")


def _constrained(tokens: list[int], shift: float = 0.0, drawn: list[int] | None = None):
    """A constrained record of three restricted steps over ids 1, 4 and 7."""
    row = np.full(16, -np.inf, dtype=np.float32)
    row[[1, 4, 7]] = [0.5 + shift, 2.0, -1.0]
    steps = [schema.step_from_logits(row, t, str(t), 20) for t in tokens]
    allowed = [schema.allowed_from([1, 4, 7])] * len(tokens)
    kept = schema.Kept([4, 1], [0.8, 0.2])
    drawn = drawn or [4]
    sampled = schema.Sampled(
        "hot", {"temperature": 2.0, "top_k": 2, "seed": 12}, [kept] * len(tokens), drawn, [kept]
    )
    return schema.Constrained("c", "regex", "[a-z]", steps, allowed, True, sampled)


def test_a_changed_constrained_golden_is_classed_by_what_changed() -> None:
    """Constrained goldens in a case's class (their steps longer than the case's, as a
    continuation may be): an added constraint changes cases, a different greedy or seeded
    continuation or mask changes tokens, restricted log-probabilities alone (logits equal)
    moved; and the text names what changed where the case's own steps are equal."""
    plain = _case("prose", BASE["prose"])
    tokens = [4] * (STEPS + 3)
    with_c = dataclasses.replace(plain, constrained=[_constrained(tokens)])

    def klass(before, after) -> tuple[str, str]:
        return diff.case_class(diff.diff_case(before, after), None)

    assert klass(with_c, with_c) == ("identical", "")
    assert klass(plain, with_c) == ("cases changed", "constraints added ['c']")
    greedy = dataclasses.replace(plain, constrained=[_constrained([1, *tokens[1:]])])
    assert klass(with_c, greedy) == (
        "tokens changed",
        "constraint c's greedy continuation from step 0",
    )
    seeded = dataclasses.replace(plain, constrained=[_constrained(tokens, drawn=[1])])
    assert klass(with_c, seeded) == (
        "tokens changed",
        "constraint c: sampler hot's seeded continuation from draw 0",
    )
    entry = _constrained(tokens)
    masked = dataclasses.replace(entry, allowed=[schema.allowed_from([1, 4]), *entry.allowed[1:]])
    assert klass(with_c, dataclasses.replace(plain, constrained=[masked])) == (
        "tokens changed",
        "constraint c's mask at step 0",
    )
    moved = dataclasses.replace(plain, constrained=[_constrained(tokens, shift=0.25)])
    klass_moved, why = klass(with_c, moved)
    assert klass_moved == "moved" and why.startswith("constrained: max |Δ restricted log-prob|")
    assert render.case_line(diff.diff_case(plain, with_c)) == (
        "case prose: steps identical; constraints added ['c']"
    )


def test_an_html_report_that_cannot_be_written_exits_2_not_different(
    capsys, base: Path, tmp_path: Path, monkeypatch
) -> None:
    """A report write that fails at the end (a full disk, a folder made read-only meanwhile)
    is one line naming the file and exit 2: exit 1 is the verdict "different"."""
    moved = {"prose": BASE["prose"].copy(), "code": BASE["code"]}
    moved["prose"][1, 12] += 0.5
    _write(tmp_path / "new", {FLOAT32: _golden(moved), Q4_K: _golden(BASE)})

    def no_space(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("tempfile.mkstemp", no_space)
    code, _, err = _run(capsys, OWN, f"--from={base}", "--to=new", "--html=out/diff.html")
    assert code == 2
    assert err.startswith(f"golden_diff: error: cannot write {tmp_path / 'out' / 'diff.html'}")
    assert len(err.splitlines()) == 1


def test_a_usage_error_exits_2_naming_the_option(capsys, base: Path) -> None:
    """A command line argparse refuses is bad input, exit 2 like the rest (exit 1 is the
    verdict "different"). Planted: main returning `int(bool(stop.code))` for usage errors."""
    code, out, err = _run(capsys, OWN, f"--from={base}", f"--to={base}", "--format=yaml")
    assert (code, out) == (2, "")
    assert "argument --format: invalid choice: 'yaml'" in err


def test_a_zip_that_is_no_zip_is_refused_naming_the_flag_and_file(
    capsys, base: Path, tmp_path: Path
) -> None:
    """A damaged outputs.zip is one line, exit 2, naming the flag and the file (it was a
    BadZipFile traceback). Planted: only OSError caught around ZipFile, or the message
    without its `--to: test outputs PATH` prefix."""
    (tmp_path / "broken.zip").write_bytes(b"not a zip")
    err = _error(capsys, OWN, f"--from={base}", "--to=broken.zip")
    assert f"--to: test outputs {tmp_path / 'broken.zip'}: " in err
    assert "give a test's outputs.zip" in err


def test_an_input_that_is_none_of_the_spellings_names_the_flag_and_path(
    capsys, repo: Path, base: Path, tmp_path: Path
) -> None:
    """An input that is no version, sha256, folder or archive is refused naming the flag, what
    the user typed and the path it resolved to, then the stored versions. Planted: the message
    without `--to=SPEC (resolved to PATH)`."""
    err = _error(capsys, OWN, f"--from={base}", "--to=no/such", *_store_flags(repo))
    assert f"--to=no/such (resolved to {tmp_path / 'no' / 'such'}) is none of: " in err
    assert f"versions of {OWN} in the local store" in err and ": 1, 2" in err


def test_a_cache_it_cannot_extract_into_exits_2_naming_the_input(
    capsys, repo: Path, base: Path, tmp_path: Path
) -> None:
    """A stored archive is extracted into the cache (locate.cache_root): a cache that cannot be
    created (here a file where its folder goes) is bad input naming the flag and the version,
    one line, exit 2, not a traceback. Planted: OSError dropped from `checked`'s catch."""
    (tmp_path / "cache").write_text("a file where the cache folder goes")
    err = _error(capsys, OWN, "--from=1", f"--to={base}", *_store_flags(repo))
    assert err.startswith(f"golden_diff: error: --from: {OWN} version 1 (sha256 {_sha(repo, 1)}): ")


def test_a_pin_without_a_sha256_is_not_pinned(capsys, repo: Path, base: Path) -> None:
    """A stanza whose sha256 is empty (a placeholder before the first publish) is no pin:
    'pinned' is refused naming MODULE.bazel and the stored versions to give instead. Planted:
    load_pinned checking `pin is None` only (it fetched the archive with an empty sha256)."""
    module = repo / "MODULE.bazel"
    pin = stanza.parse(module.read_text(encoding="utf-8"))[OWN]
    module.write_text(stanza.set_pin("", dataclasses.replace(pin, sha256="")), encoding="utf-8")
    err = _error(capsys, OWN, f"--to={base}", *_store_flags(repo))
    assert f"--from: {OWN} is not pinned in {module}; give a version (1, 2), a sha256" in err


def test_a_move_above_the_noise_within_the_tolerance_is_different_and_exits_1(
    capsys, base: Path, tmp_path: Path
) -> None:
    """README.md:446-447: exit 0 identical, 1 different; only identical and noise exit 0
    (golden_diff's docstring). A nudge between own/float32/cpu's noise floor (~5e-5) and its
    tolerance (1e-4) is `moved`: a change worth publishing, so exit 1 (planted: `moved` among
    the exit-0 classes)."""
    moved = {"prose": BASE["prose"].copy(), "code": BASE["code"]}
    moved["prose"][2, 12] += 8e-5
    _write(tmp_path / "new", {FLOAT32: _golden(moved), Q4_K: _golden(BASE)})
    code, out, _ = _run(capsys, OWN, f"--from={base}", "--to=new")
    assert out.splitlines()[3] == f"{FLOAT32}: changed [moved]"
    assert out.splitlines()[-1].startswith(f"worst: moved ({FLOAT32}: case prose: ")
    assert code == 1


def test_the_verdict_counts_added_and_removed_files_apart(capsys, base: Path, tmp_path) -> None:
    """README.md:446-447: the review names the files added or removed; its last lines count
    them ("different: 4 of 4 files changed, 0 added, 0 removed", README.md:457). The other
    test adds one file and removes one, so swapped counts passed it (planted: added and
    removed swapped in the verdict)."""
    smollm2 = "smollm2_q4_1_all_golden.json"
    _write(tmp_path / "more", {FLOAT32: _golden(BASE), Q4_K: _golden(BASE), smollm2: _golden(BASE)})
    code, out, _ = _run(capsys, OWN, f"--from={base}", "--to=more")
    assert code == 1
    assert out.splitlines()[-2] == "different: 0 of 2 files changed, 1 added, 0 removed"
    code, out, _ = _run(capsys, OWN, "--from=more", f"--to={base}")
    assert code == 1
    assert out.splitlines()[-2] == "different: 0 of 2 files changed, 0 added, 1 removed"


def test_the_html_report_holds_every_line_of_the_printed_review(
    capsys, base: Path, tmp_path: Path
) -> None:
    """README.md:447: `--html FILE` writes the same report: its summary lists every line the
    review printed, the worst class too (planted: the page given the summary without its
    last line)."""
    import html

    moved = {"prose": BASE["prose"].copy(), "code": BASE["code"]}
    moved["prose"][1, 12] += 0.5
    _write(tmp_path / "new", {FLOAT32: _golden(moved), Q4_K: _golden(BASE)})
    code, out, _ = _run(capsys, OWN, f"--from={base}", "--to=new", "--html=diff.html")
    assert code == 1
    page = (tmp_path / "diff.html").read_text(encoding="utf-8")
    (summary,) = re.findall(r'<section class="summary" id="summary"><ul>(.*?)</ul>', page)
    items = [html.unescape(item) for item in re.findall(r"<li>(.*?)</li>", summary)]
    assert items == out.splitlines()


def test_a_case_with_steps_added_or_removed_is_cases_changed(capsys, base, tmp_path) -> None:
    """docs/goldens.md:885-886: `cases changed` covers steps added or removed, not only
    cases, prompts, input ids or prompt positions. A case that ends two steps earlier (its
    first steps the same) is classed `cases changed`, as is one two steps longer (planted:
    case_class comparing only the prompt positions, which classed both `tokens changed`)."""
    golden = _golden(BASE)
    prose, code_case = golden.cases
    shorter = dataclasses.replace(
        golden, cases=[prose, dataclasses.replace(code_case, steps=code_case.steps[:2])]
    )
    _write(tmp_path / "short", {FLOAT32: shorter, Q4_K: _golden(BASE)})
    for before, after in ((base, tmp_path / "short"), (tmp_path / "short", base)):
        code, out, _ = _run(capsys, OWN, f"--from={before}", f"--to={after}")
        lines = out.splitlines()
        assert code == 1
        assert lines[3] == f"{FLOAT32}: changed [cases changed]"
        assert lines[-1] == (
            f"worst: cases changed ({FLOAT32}: case code: recorded steps or prompt positions "
            "differ)"
        )
    klass = diff.case_class(diff.diff_case(code_case, shorter.cases[1]), None)
    assert klass == ("cases changed", "recorded steps or prompt positions differ")


def test_golden_file_names_follow_the_documented_patterns_and_archives() -> None:
    """docs/goldens.md:71-73: the engine writes `{model}_{encoding}_{hardware}_golden.json`,
    torch `torch_{model}_{encoding}_golden.json` on the CPU and
    `torch_{model}_{encoding}_{hardware}_golden.json` on a GPU; golden_diff files each in its
    archive by that name (planted: torch's GPU name without the hardware, which overwrote the
    CPU golden of the same checkpoint; every fast test passed)."""
    gpu = schema.hardware_key("NVIDIA H200")
    names = {
        ("engine", "all"): "tinyllama_float32_all_golden.json",
        ("engine", gpu): "tinyllama_float32_nvidia_h200_golden.json",
        ("torch", "all"): "torch_tinyllama_float32_golden.json",
        ("torch", gpu): "torch_tinyllama_float32_nvidia_h200_golden.json",
    }
    for (producer, hardware), expected in names.items():
        name = schema.golden_file_name("tinyllama", "float32", hardware, producer)
        assert name == expected, (producer, hardware)
        archive_name = "torch_llama_golden" if producer == "torch" else OWN
        assert diff.belongs_to(archive_name, name), name
        assert not diff.belongs_to(({OWN, "torch_llama_golden"} - {archive_name}).pop(), name)
    assert len(set(names.values())) == len(names)  # no golden overwrites another


def test_a_golden_file_has_sorted_keys_float32_numbers_and_a_trailing_newline(tmp_path) -> None:
    """docs/goldens.md:56 and 60-61, what the files golden_diff compares hold: `logsumexp` in
    float64 rounded to 9 decimals, every other float rounded to float32, sorted keys, a
    trailing newline (so two regenerations are byte-identical and a diff of them is
    `identical`). Planted, each passing every fast test before: the logsumexp unrounded, the
    float32 rounding dropped, `sort_keys` dropped, the trailing newline dropped."""
    logits = np.random.default_rng(0).normal(size=VOCAB) * 3.0  # float64, not float32 values
    step = schema.step_from_logits(logits, int(np.argmax(logits)), " t", TOP_K)
    exact = float(np.log(np.exp(logits).sum()))
    assert step.logsumexp == round(exact, 9) != exact
    for value in [*step.topk_logits, *step.stats.values()]:
        assert value == float(np.float32(value))
    assert step.topk_logits[0] == float(np.float32(logits.max())) != logits.max()
    golden = schema.Golden(schema.Provenance(**PROVENANCE), [schema.Case("c", "p", [1, 2], [step])])
    schema.write(golden, tmp_path / "g.json")
    text = (tmp_path / "g.json").read_text(encoding="utf-8")
    assert text.endswith("}\n") and not text.endswith("\n\n")
    body = json.loads(text)
    assert text == json.dumps(body, sort_keys=True, indent=1, ensure_ascii=False) + "\n"
    assert body["cases"][0]["steps"][0]["logsumexp"] == step.logsumexp


def test_a_move_exactly_at_the_tolerance_is_moved_not_over_it() -> None:
    """golden_diff's docstring: `over tolerance` is |Δ log-prob| or KL *above* the entry's
    threshold, `moved` within it, as compare's check 1 passes |Δ| equal to logprob_atol. A
    change whose worst step sits exactly at own/float32/cpu's thresholds is `moved`; a hair
    above either is `over tolerance` (planted: `<` for the log-prob's `<=`)."""
    tol = tolerances.tolerance("own", "float32", "cpu")
    before = _case("prose", BASE["prose"])
    nudged = BASE["prose"].copy()
    nudged[2, 12] += 1e-3
    after = _case("prose", nudged)
    for logprob, kl, want in (
        (tol.logprob_atol, tol.kl_max, "moved"),
        (tol.logprob_atol * 1.001, tol.kl_max, "over tolerance"),
        (tol.logprob_atol, tol.kl_max * 1.001, "over tolerance"),
    ):
        case_diff = diff.CaseDiff("prose", before, after, [diff.StepDelta(logprob, kl, 0)])
        assert diff.case_class(case_diff, tol)[0] == want, (logprob, kl)


def test_a_case_cut_short_names_the_first_step_only_one_side_has() -> None:
    """first_difference's docstring: a missing item counts, so two sequences equal up to the
    shorter one's end first differ at its length; a review row (case_rows) of a case two
    steps shorter names step 2, its token on the longer side and none on the shorter
    (planted: the longer length, which named step 4: a step neither side has)."""
    assert diff.first_difference([1, 2], [1, 2, 3]) == 2
    assert diff.first_difference([1, 2, 3], [1, 2]) == 2
    assert diff.first_difference([1, 5], [1, 2, 3]) == 1
    assert diff.first_difference([1, 2], [1, 2]) is None
    full = _case("code", BASE["code"])
    short = dataclasses.replace(full, steps=full.steps[:2])
    provenance = dict(PROVENANCE)
    for before, after, texts in ((full, short, (" t7", None)), (short, full, (None, " t7"))):
        goldens = [diff.GoldenFile(2, provenance, [case]) for case in (before, after)]
        (row,) = diff.case_rows([diff.diff_file(FLOAT32, *goldens)])
        assert row.klass == "cases changed" and row.first_changed_step == 2
        assert (row.token_before, row.token_after) == texts
        ids = (row.token_id_before, row.token_id_after)
        assert ids == tuple(None if t is None else 7 for t in texts)
