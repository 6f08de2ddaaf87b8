"""tools/claims.py on scratch repositories: a bit-level claim without a named test fails, so does
a document naming a test that does not exist; a backed claim passes. The repository itself is
checked by tools/lint/lint.sh (the check reads every test file of the source tree)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tools import claims


def _repo(tmp_path: Path, readme: str) -> Path:
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text(readme)
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "test_kernels.py").write_text("def test_builds_agree():\n    pass\n")
    (tmp_path / "pkg" / "BUILD.bazel").write_text('pytest_test(\n    name = "kernels_test",\n)\n')
    return tmp_path


def test_a_backed_claim_passes(tmp_path, capsys) -> None:
    root = _repo(tmp_path, "Every build gives the same bits (`test_builds_agree`).\n")
    assert claims.main([f"--root={root}"]) == 0
    assert "1 bit-level claims, 1 backed" in capsys.readouterr().out


def test_a_claim_without_a_test_fails_naming_its_line(tmp_path, capsys) -> None:
    root = _repo(tmp_path, "# Title\n\nThe kernels agree\nbit for bit on every CPU.\n")
    assert claims.main([f"--root={root}", "--quiet"]) == 1
    assert "README.md:3: states a bit-level property and names no test" in capsys.readouterr().err


def test_a_table_row_is_its_own_claim(tmp_path, capsys) -> None:
    readme = "| a | bitwise in batch | `kernels_test` |\n| b | bit-identical to gguf-py | |\n"
    assert claims.main([f"--root={_repo(tmp_path, readme)}", "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "README.md:2:" in err and "README.md:1:" not in err


@pytest.mark.parametrize(
    "cited",
    [
        "`pytest_test`",
        "`kernels_lib_test`",
        "`test_skipped_away`",
        "`test_skipped_if_true`",
        "`test_expected_to_fail`",
        "`test_in_a_skipped_file`",
        "`test_skipped_file`",
    ],
    ids=[
        "a test macro",
        "a library target",
        "a skipped test",
        "skipif(True)",
        "an xfail",
        "a test of a file whose pytestmark skips it",
        "a test file whose pytestmark skips it",
    ],
)
def test_a_claim_backed_by_no_test_that_runs_fails(tmp_path, capsys, cited) -> None:
    """A name that exists but runs nothing backs no claim: a test macro of the .bzl files, a
    target of another rule, a test function under an unconditional skip, a skipif(True) or an
    xfail, a test file (or its test) whose `pytestmark` skips it (all but the first three
    were accepted before)."""
    root = _repo(tmp_path, f"Every build gives the same bits ({cited}).\n")
    (root / "pkg" / "defs.bzl").write_text("def pytest_test(name, **kwargs):\n    pass\n")
    build = root / "pkg" / "BUILD.bazel"
    build.write_text(build.read_text() + 'py_library(\n    name = "kernels_lib_test",\n)\n')
    skipped = (
        "@pytest.mark.skip(reason='later')\ndef test_skipped_away():\n    pass\n"
        "@pytest.mark.skipif(True, reason='never')\ndef test_skipped_if_true():\n    pass\n"
        "@pytest.mark.xfail(reason='known')\ndef test_expected_to_fail():\n    pass\n"
    )
    (root / "pkg" / "test_more.py").write_text(skipped)
    whole_file = "pytestmark = pytest.mark.skip(reason='later')\n\n\n"
    whole_file += "def test_in_a_skipped_file():\n    pass\n"
    (root / "pkg" / "test_skipped_file.py").write_text(whole_file)
    assert claims.main([f"--root={root}", "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "README.md:1: states a bit-level property and names no test that runs" in err
    assert "which is no test" not in err  # each name is known, none runs


def test_a_test_name_that_does_not_exist_fails(tmp_path, capsys) -> None:
    root = _repo(tmp_path, "Bitwise (`test_builds_agree`, `test_renamed_away`); `--test_env`.\n")
    assert claims.main([f"--root={root}", "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "names `test_renamed_away`, which is no test" in err and "test_env" not in err


def test_code_fences_are_not_claims(tmp_path) -> None:
    root = _repo(tmp_path, "```\nsame bits\n```\n")
    assert claims.main([f"--root={root}", "--quiet"]) == 0


@pytest.mark.parametrize(
    "phrase",
    ["byte for byte", "the same bytes", "identical bits", "repeatable to the bit", "bits for bits"],
)
def test_every_spelling_of_a_bit_level_claim_is_a_claim(tmp_path, capsys, phrase) -> None:
    """Each was read as no claim before (an audit's README "identical bits on every CPU")."""
    root = _repo(tmp_path, f"The kernels give {phrase} on every CPU.\n")
    assert claims.main([f"--root={root}", "--quiet"]) == 1
    assert "README.md:1: states a bit-level property and names no test" in capsys.readouterr().err


def test_a_readme_below_the_root_is_read_too(tmp_path, capsys) -> None:
    root = _repo(tmp_path, "# Title\n")
    (root / "pkg" / "README.md").write_text("The files regenerate byte for byte.\n")
    assert claims.main([f"--root={root}", "--quiet"]) == 1
    assert "pkg/README.md:1: states a bit-level property" in capsys.readouterr().err


def test_a_claim_in_docs_is_read(tmp_path, capsys) -> None:
    """docs/*.md is read as README.md is (the module docstring): a claim there without a test
    fails. Catches documents() leaving docs/ out (the repository's lint still passed, reading
    10 of its 39 claims)."""
    root = _repo(tmp_path, "# Title\n")
    (root / "docs" / "kernels.md").write_text("The kernels agree bit for bit.\n")
    assert claims.main([f"--root={root}", "--quiet"]) == 1
    assert "docs/kernels.md:1: states a bit-level property" in capsys.readouterr().err


def test_a_code_fence_ends_the_paragraph_above_it(tmp_path, capsys) -> None:
    """A claim right above a code fence is its own paragraph: a test named below the fence does
    not back it. Catches blocks() not emptying its paragraph at a fence."""
    readme = "The kernels agree bit for bit.\n```\nmake\n```\nSee `test_builds_agree`.\n"
    assert claims.main([f"--root={_repo(tmp_path, readme)}", "--quiet"]) == 1
    assert "README.md:1: states a bit-level property and names no test" in capsys.readouterr().err


def test_a_heading_backs_no_claim_below_it(tmp_path, capsys) -> None:
    """A heading is no paragraph: a test it names does not back the claim right below it.
    Catches blocks() joining a heading to the next paragraph."""
    readme = "## Builds (`test_builds_agree`)\nThe kernels agree bit for bit.\n"
    assert claims.main([f"--root={_repo(tmp_path, readme)}", "--quiet"]) == 1
    assert "README.md:2: states a bit-level property and names no test" in capsys.readouterr().err


def test_a_test_name_outside_backticks_backs_no_claim(tmp_path, capsys) -> None:
    """Only a backticked name backs a claim (the module docstring): prose naming
    test_builds_agree does not. Catches cited_tests() reading the whole text."""
    root = _repo(tmp_path, "The kernels agree bit for bit (test_builds_agree).\n")
    assert claims.main([f"--root={root}", "--quiet"]) == 1
    assert "README.md:1: states a bit-level property and names no test" in capsys.readouterr().err


@pytest.mark.parametrize(
    "test_file",
    [
        "@pytest.mark.skip(reason='later')\n@pytest.mark.parametrize('x', [1])\n"
        "def test_cited(x):\n    pass\n",
        "pytestmark = [pytest.mark.skip(reason='later')]\n\n\ndef test_cited():\n    pass\n",
    ],
    ids=["a skip above another decorator", "a pytestmark list that skips"],
)
def test_every_form_of_a_skip_backs_no_claim(tmp_path, capsys, test_file) -> None:
    """A skip stacked above another decorator, and a `pytestmark = [...]` list that skips, run
    nothing, so back no claim. Catches SKIPPED without its decorator lines and SKIPPED_FILE
    without its list form."""
    root = _repo(tmp_path, "Every build gives the same bits (`test_cited`).\n")
    (root / "pkg" / "test_cited_file.py").write_text(test_file)
    assert claims.main([f"--root={root}", "--quiet"]) == 1
    assert "README.md:1: states a bit-level property and names no test that runs" in (
        capsys.readouterr().err
    )


@pytest.mark.parametrize(
    ("cited", "test_file"),
    [
        (
            "test_on_posix",
            "@pytest.mark.skipif(sys.platform == 'win32', reason='posix')\n"
            "def test_on_posix():\n    pass\n",
        ),
        (
            "test_partly_skipped",
            "@pytest.mark.skip(reason='later')\ndef test_later():\n    pass\n\n\n"
            "def test_now():\n    pass\n",
        ),
    ],
    ids=["a conditional skipif", "a test file with one test skipped of two"],
)
def test_a_test_that_runs_somewhere_backs_a_claim(tmp_path, capsys, cited, test_file) -> None:
    """Only an unconditional skip, skipif(True) or xfail unbacks: a skipif on a condition runs
    where the condition is false, and a test file runs while one of its tests does. Catches
    NOT_RUN matching `skipif(` as `skip`, and a test file unbacked by any one skipped test."""
    root = _repo(tmp_path, f"Every build gives the same bits (`{cited}`).\n")
    (root / "pkg" / "test_partly_skipped.py").write_text(test_file)
    assert claims.main([f"--root={root}", "--quiet"]) == 0, capsys.readouterr().err


def test_a_test_under_a_bazel_output_folder_is_no_test(tmp_path, capsys) -> None:
    """bazel-* folders hold copies (a test deleted from the source may live on there): a test
    only there is unknown. Catches known_tests() reading the .py files of bazel-* folders."""
    root = _repo(tmp_path, "Every build gives the same bits (`test_stale`).\n")
    (root / "bazel-out" / "pkg").mkdir(parents=True)
    (root / "bazel-out" / "pkg" / "test_old.py").write_text("def test_stale():\n    pass\n")
    assert claims.main([f"--root={root}", "--quiet"]) == 1
    assert "names `test_stale`, which is no test" in capsys.readouterr().err


def test_generated_targets_and_golden_archives_are_known_names(tmp_path, capsys) -> None:
    """A gpu_pytest_test's NAME_on_cpu target backs a claim, and the golden archive's name
    `test_llama_golden` is no test name (NOT_TESTS). Catches GENERATED_SUFFIXES unused and
    NOT_TESTS unread (the repository's lint catches both, this file did not)."""
    readme = "Same bits on the CPU (`test_gpu_kernels_on_cpu`), pinned by `test_llama_golden`.\n"
    root = _repo(tmp_path, readme)
    (root / "gpu").mkdir()
    (root / "gpu" / "BUILD.bazel").write_text(
        'gpu_pytest_test(\n    name = "test_gpu_kernels",\n)\n'
    )
    assert claims.main([f"--root={root}", "--quiet"]) == 0, capsys.readouterr().err


def test_a_generated_name_of_an_x_test_target_backs_a_claim(tmp_path, capsys) -> None:
    """`kernels_test_on_cpu`, the CPU twin of gpu_pytest_test(name = "kernels_test"), is a test
    name: TEST_NAME read `\\w+_test\\b`, which stops at no word boundary inside
    `kernels_test_on_cpu`, so the claim read as naming no test at all (exit 1), though the
    `test_*` twins were read."""
    assert claims.TEST_NAME.findall("`kernels_test_on_cpu`") == ["kernels_test_on_cpu"]
    root = _repo(tmp_path, "Same bits on the CPU (`kernels_test_on_cpu`).\n")
    (root / "gpu").mkdir()
    (root / "gpu" / "BUILD.bazel").write_text('gpu_pytest_test(\n    name = "kernels_test",\n)\n')
    assert claims.main([f"--root={root}", "--quiet"]) == 0, capsys.readouterr().err
