import difflib
import errno
import os
from pathlib import Path

import pytest

from goldens.artifacts import distdir, stanza
from goldens.artifacts.sample_module import SAMPLE_MODULE
from goldens.artifacts.stanza import GoldenPin

SHA_A = "a" * 64
SHA_B = "b" * 64
PIN_A = GoldenPin(
    "test_llama_golden",
    SHA_A,
    f"https://llama-goldens.invalid/artifacts/test_llama_golden/2/{SHA_A}/test_llama_golden.tar.gz",
)
PIN_B = GoldenPin(
    "test_llama_golden",
    SHA_B,
    f"https://llama-goldens.invalid/artifacts/test_llama_golden/3/{SHA_B}/test_llama_golden.tar.gz",
)

SEED_STANZA = f'''http_archive(
    name = "test_llama_golden",
    build_file_content = """
filegroup(
    name = "test_llama_golden",
    srcs = glob(["**"]),
    visibility = ["//visibility:public"],
)
""",
    sha256 = "{SHA_A}",
    url = "{PIN_A.url}",
)'''


def _changed_lines(before: str, after: str) -> list[str]:
    return [
        line
        for line in difflib.unified_diff(before.splitlines(), after.splitlines(), lineterm="", n=0)
        if line[:1] in "+-" and not line.startswith(("+++", "---"))
    ]


def test_render_is_the_seed_stanza() -> None:
    assert stanza.render(PIN_A) == SEED_STANZA


def test_render_then_parse_round_trips() -> None:
    assert stanza.parse(SAMPLE_MODULE + "\n" + stanza.render(PIN_A) + "\n") == {PIN_A.name: PIN_A}


def test_adding_a_stanza_appends_it_and_keeps_every_other_byte() -> None:
    updated = stanza.set_pin(SAMPLE_MODULE, PIN_A)
    assert updated == SAMPLE_MODULE + "\n" + SEED_STANZA + "\n"


def test_repinning_changes_only_sha256_and_url() -> None:
    other = GoldenPin(
        "torch_llama_golden", "c" * 64, "https://h.invalid/x/torch_llama_golden.tar.gz"
    )
    before = stanza.set_pin(stanza.set_pin(SAMPLE_MODULE, PIN_A), other) + "# trailing comment\n"
    after = stanza.set_pin(before, PIN_B)
    assert _changed_lines(before, after) == [
        f'-    sha256 = "{SHA_A}",',
        f'-    url = "{PIN_A.url}",',
        f'+    sha256 = "{SHA_B}",',
        f'+    url = "{PIN_B.url}",',
    ]
    assert stanza.parse(after) == {PIN_B.name: PIN_B, other.name: other}


def test_a_second_stanza_goes_right_after_the_last_one() -> None:
    text = stanza.set_pin(SAMPLE_MODULE, PIN_A) + "\nuse_repo(pip)\n"
    other = GoldenPin("torch_llama_golden", SHA_B, "https://h.invalid/torch_llama_golden.tar.gz")
    updated = stanza.set_pin(text, other)
    assert updated.index("torch_llama_golden") < updated.index("use_repo(pip)\n")
    assert updated.replace("\n\n" + stanza.render(other), "", 1) == text


def test_a_hand_written_stanza_with_urls_is_replaced_whole() -> None:
    text = SAMPLE_MODULE + (
        '\nhttp_archive(\n    name = "test_llama_golden",  # the (old) one\n'
        '    urls = ["https://h.invalid/old/test_llama_golden.tar.gz"],\n)\n\nx = 1\n'
    )
    assert stanza.parse(text)[PIN_A.name].url == "https://h.invalid/old/test_llama_golden.tar.gz"
    assert stanza.set_pin(text, PIN_A) == SAMPLE_MODULE + "\n" + SEED_STANZA + "\n\nx = 1\n"


def test_the_repo_rule_line_is_added_when_missing() -> None:
    text = 'module(name = "m")\n'
    updated = stanza.set_pin(text, PIN_A)
    assert updated == text + "\n" + stanza.REPO_RULE_LINE + "\n\n" + SEED_STANZA + "\n"
    assert stanza.set_pin(updated, PIN_B).count("use_repo_rule") == 1


def test_a_file_without_a_final_newline_keeps_its_bytes() -> None:
    text = SAMPLE_MODULE.rstrip("\n")
    assert stanza.set_pin(text, PIN_A) == text + "\n\n" + SEED_STANZA + "\n"


def test_parens_and_names_inside_strings_and_comments_are_not_calls() -> None:
    tail = (
        '# http_archive(name = "test_llama_golden") is how goldens are pinned\n'
        'doc = """http_archive(\n    name = "test_llama_golden",\n"""\n'
    )
    assert stanza.parse(SAMPLE_MODULE + tail) == {}
    # The first stanza goes right after the repo rule's declaration.
    updated = stanza.set_pin(SAMPLE_MODULE + tail, PIN_A)
    assert updated == SAMPLE_MODULE + "\n" + SEED_STANZA + "\n" + tail


def test_parens_in_comments_and_strings_inside_a_stanza_leave_it_whole() -> None:
    hand_written = (
        "http_archive(  # not http_archive( again\n"
        '    name = "test_llama_golden",\n'
        '    build_file_content = "filegroup(name = \\")(\\")",  # )\n'
        f'    sha256 = "{SHA_A}",\n'
        f'    url = "{PIN_A.url}",\n'
        ")\n"
    )
    text = SAMPLE_MODULE + "\n" + hand_written
    assert stanza.parse(text) == {PIN_A.name: PIN_A}
    updated = stanza.set_pin(text, PIN_B)
    assert updated == text.replace(PIN_A.url, PIN_B.url).replace(SHA_A, SHA_B)


@pytest.mark.parametrize("newline", ["\n", "\r\n"])
def test_non_ascii_text_before_the_literals_keeps_every_other_byte(newline: str) -> None:
    # `ast` counts columns in UTF-8 bytes: text with multi-byte characters earlier on the same
    # line must not shift the rewritten literals.
    line = (
        f'http_archive(name = "test_llama_golden", build_file_content = "# Größe ✓", '
        f'sha256 = "{SHA_A}", url = "{PIN_A.url}")'
    )
    text = f"# Goldens für Llama — ✓{newline}{line}{newline}# après{newline}"
    updated = stanza.set_pin(text, PIN_B)
    assert updated == text.replace(PIN_A.url, PIN_B.url).replace(SHA_A, SHA_B)
    assert stanza.parse(updated) == {PIN_B.name: PIN_B}


def test_a_file_that_does_not_parse_names_the_line() -> None:
    broken = SAMPLE_MODULE + 'http_archive(\n    name = "test_llama_golden",\n'
    line = SAMPLE_MODULE.count("\n") + 1
    for rewrite in (stanza.parse, lambda text: stanza.set_pin(text, PIN_A)):
        with pytest.raises(stanza.StanzaError, match=f"MODULE.bazel line {line}: .*never closed"):
            rewrite(broken)


def test_two_stanzas_with_one_name_are_an_error() -> None:
    text = stanza.set_pin(SAMPLE_MODULE, PIN_A)
    with pytest.raises(stanza.StanzaError, match="two http_archive stanzas"):
        stanza.parse(text + "\n" + SEED_STANZA + "\n")


def test_update_module_file_is_atomic_and_idempotent(tmp_path: Path) -> None:
    module = tmp_path / "MODULE.bazel"
    module.write_text(SAMPLE_MODULE)
    module.chmod(0o640)
    assert stanza.update_module_file(module, PIN_A)
    assert not stanza.update_module_file(module, PIN_A)
    assert module.read_text() == SAMPLE_MODULE + "\n" + SEED_STANZA + "\n"
    assert module.stat().st_mode & 0o777 == 0o640
    assert [p.name for p in tmp_path.iterdir()] == ["MODULE.bazel"]


def test_a_rename_that_fails_leaves_module_bazel_byte_identical(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The promise that a crash never leaves MODULE.bazel half written: the new text goes to a
    temporary file that one rename puts in place. With the rename failing, every byte of the
    file is as it was and no temporary file is left beside it."""
    module = tmp_path / "MODULE.bazel"
    before = SAMPLE_MODULE.replace("\n", "\r\n").encode()  # bytes a text round trip would change
    module.write_bytes(before)

    def fail(source: object, target: object) -> None:
        raise OSError(errno.EIO, "injected rename failure")

    monkeypatch.setattr(os, "replace", fail)
    monkeypatch.setattr(os, "rename", fail)
    with pytest.raises(OSError, match="injected rename failure"):
        stanza.update_module_file(module, PIN_A)
    assert module.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["MODULE.bazel"]


def test_distdir_fragment_has_one_sorted_folder_per_pinned_archive() -> None:
    pins = [
        PIN_B,
        GoldenPin("torch_llama_golden", SHA_A, PIN_A.url.replace("test_llama", "torch_llama")),
        GoldenPin("other", "d" * 64, "https://example.invalid/other.tar.gz"),  # not in the store
        GoldenPin("stale", SHA_B, PIN_A.url.replace("test_llama", "stale")),  # sha != URL's
        # In the store layout, but on a host Bazel downloads from: no local folder needed.
        GoldenPin("s3", SHA_A, f"https://b.s3.amazonaws.com/artifacts/s3/1/{SHA_A}/s3.tar.gz"),
    ]
    assert distdir.render(pins) == distdir.HEADER + (
        f"common --distdir=artifacts/test_llama_golden/3/{SHA_B}\n"
        f"common --distdir=artifacts/torch_llama_golden/2/{SHA_A}\n"
    )


def test_repinning_to_a_longer_url_written_before_the_sha256_keeps_every_other_byte() -> None:
    """Edits are spliced from the end of the file backwards, so one that changes length (version
    9 to 10 makes the url a byte longer; a placeholder sha256 = "" grows to 64 digits) does not
    shift the other's offsets, whichever keyword comes first. Catches splicing in file order
    (`sorted(edits)`), which then splices the sha256 one byte too early."""
    url_9 = PIN_A.url.replace("/2/", "/9/")
    hand_written = (
        "http_archive(\n"
        '    name = "test_llama_golden",\n'
        f'    url = "{url_9}",\n'
        '    sha256 = "",\n'
        ")\n"
    )
    text = SAMPLE_MODULE + "\n" + hand_written + "# after\n"
    assert stanza.parse(text)[PIN_A.name].url == url_9
    pin = GoldenPin(PIN_B.name, SHA_B, PIN_B.url.replace("/3/", "/10/"))
    updated = stanza.set_pin(text, pin)
    assert updated == text.replace(url_9, pin.url).replace('sha256 = ""', f'sha256 = "{SHA_B}"')
    assert stanza.parse(updated) == {pin.name: pin}


def test_a_stanza_with_a_sha256_but_a_urls_list_is_replaced_whole() -> None:
    """Only a stanza with both sha256 and url as string literals is edited in place; one that
    pins through `urls = [...]` (or a sha256 that is no literal) becomes the rendered stanza.
    Catches `or` weakened to `and` in that test, which splices a missing `url` and crashes."""
    hand_written = (
        "http_archive(\n"
        '    name = "test_llama_golden",\n'
        f'    sha256 = "{SHA_A}",\n'
        f'    urls = ["{PIN_A.url}"],\n'
        ")\n"
    )
    text = SAMPLE_MODULE + "\n" + hand_written + "\nx = 1\n"
    assert stanza.parse(text) == {PIN_A.name: PIN_A}
    assert (
        stanza.set_pin(text, PIN_B) == SAMPLE_MODULE + "\n" + stanza.render(PIN_B) + "\n\nx = 1\n"
    )


def test_lone_carriage_returns_end_lines_where_ast_ends_them() -> None:
    """`ast` ends a line at a lone \\r too, so the byte offsets of the literals count it as a
    line break; every byte but the sha256 and url stays, \\r included. Catches line starts
    computed by splitting on \\n only, which puts the whole file on line 1."""
    text = (
        "# goldens\rx = 1\r"
        "http_archive(\r"
        '    name = "test_llama_golden",\r'
        f'    sha256 = "{SHA_A}",\r'
        f'    url = "{PIN_A.url}",\r'
        ")\r# after\r"
    )
    assert stanza.parse(text) == {PIN_A.name: PIN_A}
    updated = stanza.set_pin(text, PIN_B)
    assert updated == text.replace(PIN_A.url, PIN_B.url).replace(SHA_A, SHA_B)
