"""CI's cost report: the slowest executed test targets of a Bazel run (its build event file),
and each target far over its row in the budget table."""

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "bazel" / "test_budget.py"
spec = importlib.util.spec_from_file_location("test_budget", SCRIPT)
test_budget = importlib.util.module_from_spec(spec)
spec.loader.exec_module(test_budget)

TABLE = """# Test budget

| target | seconds | why |
| --- | --- | --- |
| `//a:slow` | 100 | the long cases |
| //a:fast | 5 | imports torch |
| //a:cached | 10 | |
"""


def _event(label: str, millis: int, cached: bool = False, attempt: int = 1) -> str:
    event = {
        "id": {"testResult": {"label": label, "run": 1, "shard": 1, "attempt": attempt}},
        "testResult": {"testAttemptDurationMillis": str(millis), "status": "PASSED"},
    }
    if cached:
        event["testResult"]["cachedLocally"] = True
    return json.dumps(event)


def _files(tmp_path: Path, events: list[str]) -> tuple[Path, Path]:
    bep, table = tmp_path / "bep.json", tmp_path / "budget.md"
    other = json.dumps({"id": {"progress": {"opaqueCount": 1}}, "progress": {}})
    bep.write_text("\n".join([other, *events]) + "\n")
    table.write_text(TABLE)
    return bep, table


def test_ranks_executed_targets_and_names_those_over_budget(tmp_path, capsys):
    events = [
        _event("//a:slow", 150_000),
        _event("//a:fast", 4_000),
        _event("//a:fast", 7_000, attempt=2),  # a retried attempt counts too: 11 s > 2 x 5
        _event("//a:cached", 900_000, cached=True),
        _event("//a:new", 3_000),
    ]
    bep, table = _files(tmp_path, events)
    executed = {"//a:slow": 150.0, "//a:fast": 11.0, "//a:new": 3.0}
    assert test_budget.executed_seconds(bep) == executed
    rows = {"//a:slow": 100.0, "//a:fast": 5.0, "//a:cached": 10.0}
    assert test_budget.budget_rows(table) == rows
    assert test_budget.main([str(bep), "--budget", str(table)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[:5] == [
        "slowest test targets (of 3 executed, seconds):",
        "    150.0  //a:slow",
        "     11.0  //a:fast",
        "      3.0  //a:new",
        "    164.0  total, every executed target",
    ]
    assert out[5:] == [
        "budget: //a:fast took 11 s, over 2x its row (5 s)",
        "budget: //a:new took 3 s and has no row in the budget table",
    ]


def test_a_run_answered_from_the_cache_and_bad_input(tmp_path, capsys):
    bep, table = _files(tmp_path, [_event("//a:slow", 1, cached=True)])
    assert test_budget.main([str(bep), "--budget", str(table)]) == 0
    assert "none executed" in capsys.readouterr().out
    assert test_budget.main([str(tmp_path / "missing.json"), "--budget", str(table)]) == 2
    table.write_text("no rows here\n")
    assert test_budget.main([str(bep), "--budget", str(table)]) == 2


def test_only_more_than_the_factor_is_named_and_the_factor_defaults_to_two(tmp_path, capsys):
    """The docstring's "more than `--factor` (2) times its row": exactly 2x is within budget,
    just over it is named, 1.9x is not. Catches `s >= factor * row` (200 s on a 100 s row
    named) and a default factor below 1.9 (1.5: the 19 s and 200 s targets named)."""
    events = [_event("//a:slow", 200_000), _event("//a:fast", 10_100), _event("//a:cached", 19_000)]
    bep, table = _files(tmp_path, events)
    assert test_budget.main([str(bep), "--budget", str(table)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line for line in out if line.startswith("budget:")] == [
        "budget: //a:fast took 10 s, over 2x its row (5 s)"
    ]


def test_a_result_from_the_remote_cache_is_not_an_executed_target(tmp_path, capsys):
    """Only attempts Bazel executed count ("not those answered from a cache"): a remote cache
    hit (`executionInfo.cachedRemotely`) took no test time in this run. Catches dropping the
    `cachedRemotely` check (the hit's 900 s ranked first and named over budget)."""
    remote = json.loads(_event("//a:cached", 900_000))
    remote["testResult"]["executionInfo"] = {"cachedRemotely": True}
    bep, table = _files(tmp_path, [_event("//a:slow", 150_000), json.dumps(remote)])
    assert test_budget.executed_seconds(bep) == {"//a:slow": 150.0}
    assert test_budget.main([str(bep), "--budget", str(table)]) == 0
    assert "//a:cached" not in capsys.readouterr().out


def test_ten_slowest_are_listed_and_the_total_is_over_every_executed_target(tmp_path, capsys):
    """The docstring's "prints the ten slowest, the sum over every executed target": of twelve
    targets, the ten slowest in order, then the sum of all twelve. Catches `ranked[:9]` (or
    `[:11]`) and a total over the shown ten only."""
    events = [_event(f"//b:t{i:02d}", (i + 1) * 1_000) for i in range(12)]
    bep, table = _files(tmp_path, events)
    assert test_budget.main([str(bep), "--budget", str(table), "--factor", "1e9"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "slowest test targets (of 12 executed, seconds):"
    assert out[1:11] == [f"  {i + 1:7.1f}  //b:t{i:02d}" for i in range(11, 1, -1)]
    assert out[11] == f"  {sum(range(1, 13)):7.1f}  total, every executed target"
    assert len([line for line in out if "has no row in the budget table" in line]) == 12
