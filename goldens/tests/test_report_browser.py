"""The HTML report as a person sees it: opened by a real headless browser (Debian's chromium).

The page a browser builds (its DOM, dumped after loading) must hold the token strips and the
SVG curves with their points and tolerance lines, and its screenshot must show them: a page
of the right size, not blank, with the colours of a changed token and of a FAIL badge. The
screenshot is kept under $TEST_UNDECLARED_OUTPUTS_DIR when Bazel sets it.

Without chromium the tests skip with the command that installs it (tools/chromium/install.sh);
with CI_REQUIRE_BROWSER=1 (CI, after running that script) they fail instead.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import struct
import subprocess
import zlib
from pathlib import Path

import numpy as np
import pytest

from goldens.report import CaseView, write_report
from goldens.tests.dom import Element, parse

REQUIRE_ENV = "CI_REQUIRE_BROWSER"
INSTALL = "tools/chromium/install.sh (as root; it runs: apt-get install -y chromium)"
WINDOW = (1200, 1600)
CHANGED_CELL = (0xFF, 0xD8, 0xB5)  # report.py's CSS: td.changed background
FAIL_BADGE = (0xCF, 0x22, 0x2E)  # report.py's CSS: .status-fail background
STEPS = 8
CASES = [
    CaseView(
        title="tinyllama float32 · translation",
        prompt="Translate to French: Good morning",
        golden_tokens=[" Bon", "jour", ",", " mon", " ami", ".", "\n", "<|eot_id|>"],
        run_tokens=[" Bon", "jour", ",", " mes", " amis", ".", "\n", "<|eot_id|>"],
        logprob_delta=[1e-9, 2e-6, 3e-5, 0.2, 0.35, 0.01, 4e-3, 0.0],
        kl=[0.0, 1e-10, 2e-9, 4e-3, 8e-3, 2e-5, 1e-6, 1e-12],
        status="FAIL",
        first_failing_step=3,
        tolerance_label="own/float32/cpu",
        logprob_atol=1e-4,
        kl_max=1e-7,
        notes=("first diverging layer: 3, attention",),
        step_status=("PASS", "PASS", "PASS", "FAIL", "FAIL", "FAIL", "FAIL", "PASS"),
    ),
    CaseView(
        title="tinyllama float32 · code",
        prompt="def fibonacci(n):",
        golden_tokens=["\n", "   ", " if", " n", " <", " 2", ":", " return"],
        run_tokens=["\n", "   ", " if", " n", " <", " 2", ":", " return"],
        logprob_delta=[0.0, 1e-8, 3e-8, 0.0, 2e-7, 1e-8, 0.0, 5e-8],
        kl=[0.0, 0.0, 1e-12, 0.0, 3e-11, 0.0, 0.0, 1e-11],
        status="PASS",
        tolerance_label="own/float32/cpu",
        logprob_atol=1e-4,
        kl_max=1e-7,
    ),
]


@dataclasses.dataclass(frozen=True)
class Rendered:
    dom: Element  # the page as the browser built it
    screenshot: Path


@pytest.fixture(scope="module")
def chromium() -> str:
    path = shutil.which("chromium")
    if path is not None:
        return path
    message = f"chromium is not installed; install it with {INSTALL}"
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{message} (${REQUIRE_ENV}=1: the browser tests must run)")
    pytest.skip(message)


@pytest.fixture(scope="module")
def rendered(chromium: str, tmp_path_factory: pytest.TempPathFactory) -> Rendered:
    work = tmp_path_factory.mktemp("browser")
    outputs = Path(os.environ.get("TEST_UNDECLARED_OUTPUTS_DIR") or work)
    page = write_report(work / "report.html", "golden report", ["2 cases, 1 fails"], CASES)
    screenshot = outputs / "golden_report_screenshot.png"
    width, height = WINDOW
    dom = _chromium(chromium, work, "--dump-dom", page.as_uri())
    _chromium(
        chromium,
        work,
        f"--screenshot={screenshot}",
        f"--window-size={width},{height}",
        page.as_uri(),
    )
    return Rendered(parse(dom), screenshot)


def _chromium(chromium: str, work: Path, *args: str) -> str:
    """Run headless chromium; its stdout. HOME and the profile live in `work` (a sandbox has no
    writable HOME); --no-sandbox because tests may run as root."""
    command = [
        chromium,
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        f"--user-data-dir={work / 'profile'}",
        *args,
    ]
    env = {**os.environ, "HOME": str(work)}
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, f"{' '.join(command)} failed:\n{done.stderr[-3000:]}"
    return done.stdout


def test_the_browser_builds_both_token_strips_with_the_changed_tokens_marked(rendered):
    sections = rendered.dom.select("section", "case")
    assert [s.attrs["data-status"] for s in sections] == ["FAIL", "PASS"]
    for section, case in zip(sections, CASES, strict=True):
        strip = section.one("table", "token-strip")
        assert len(strip.one("tr", "golden").select("td")) == STEPS
        assert [td.attrs["title"] for td in strip.one("tr", "run").select("td")] == [
            repr(token) for token in case.run_tokens
        ]
    failing, passing = sections
    assert [td.attrs["data-step"] for td in failing.select("td", "changed")] == ["3", "4"]
    marked = [(e.tag, e.attrs["data-step"]) for e in failing.select(cls="first-failing")]
    assert marked == [("th", "3"), ("td", "3"), ("td", "3"), ("line", "3"), ("line", "3")]
    assert passing.select(cls="changed") == []


def test_the_browser_draws_every_curve_with_a_point_per_step_and_its_tolerance(rendered):
    charts = rendered.dom.select("svg", "curve")
    assert [c.attrs["data-metric"] for c in charts] == ["kl", "logprob_delta"] * 2
    for chart in charts:
        (polyline,) = chart.select("polyline")
        assert len(polyline.attrs["points"].split()) == STEPS
        assert len(chart.select("circle", "point")) == STEPS
    tolerances = [c.one("line", "tolerance").attrs["data-value"] for c in charts]
    assert tolerances == ["1e-07", "0.0001"] * 2
    above = [[c.attrs["data-step"] for c in chart.select("circle", "above")] for chart in charts]
    assert above == [["3", "4", "5", "6"], ["3", "4", "5", "6"], [], []]


def test_the_screenshot_shows_a_page_with_the_changed_tokens_and_the_fail_badge(rendered):
    data = rendered.screenshot.read_bytes()
    assert 10_000 < len(data) < 5_000_000
    pixels = _png_rgb(data)
    assert pixels.shape[:2] == (WINDOW[1], WINDOW[0])
    colours = pixels.reshape(-1, 3)
    assert len(np.unique(colours, axis=0)) > 100  # text, lines, badges: not a blank page
    assert np.mean(np.any(colours != 255, axis=1)) > 0.02
    assert np.sum(np.all(colours == CHANGED_CELL, axis=1)) > 200  # two cells' backgrounds
    assert np.sum(np.all(colours == FAIL_BADGE, axis=1)) > 100  # badges, points, lines


def _png_rgb(data: bytes) -> np.ndarray:
    """An 8-bit, non-interlaced RGB or RGBA PNG as a [height, width, 3] uint8 array."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG file"
    chunks, pos = {}, 8
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind = data[pos + 4 : pos + 8]
        chunks[kind] = chunks.get(kind, b"") + data[pos + 8 : pos + 8 + length]
        pos += 12 + length
    width, height, depth, colour_type, _, _, interlace = struct.unpack(">IIBBBBB", chunks[b"IHDR"])
    assert (depth, colour_type in (2, 6), interlace) == (8, True, 0), "unsupported PNG layout"
    channels = 3 if colour_type == 2 else 4
    stride = width * channels
    raw = zlib.decompress(chunks[b"IDAT"])
    rows, previous = [], np.zeros(stride, np.uint8)
    for row in range(height):
        start = row * (stride + 1)
        line = np.frombuffer(raw, np.uint8, stride, start + 1)
        previous = _unfilter(raw[start], line, previous, channels)
        rows.append(previous)
    return np.stack(rows).reshape(height, width, channels)[:, :, :3]


def _unfilter(kind: int, line: np.ndarray, previous: np.ndarray, bpp: int) -> np.ndarray:
    """Undo one row's PNG filter (None, Sub, Up, Average, Paeth); uint8 arithmetic wraps."""
    if kind == 0:
        return line.copy()
    if kind == 1:
        return line.reshape(-1, bpp).cumsum(axis=0, dtype=np.uint8).reshape(-1)
    if kind == 2:
        return line + previous
    out, up = bytearray(line.tobytes()), previous.tobytes()
    for i in range(len(out)):
        left = out[i - bpp] if i >= bpp else 0
        if kind == 3:
            out[i] = (out[i] + (left + up[i]) // 2) & 0xFF
            continue
        upper_left = up[i - bpp] if i >= bpp else 0
        estimate = left + up[i] - upper_left
        pa, pb, pc = abs(estimate - left), abs(estimate - up[i]), abs(estimate - upper_left)
        predictor = left if pa <= pb and pa <= pc else up[i] if pb <= pc else upper_left
        out[i] = (out[i] + predictor) & 0xFF
    return np.frombuffer(bytes(out), np.uint8)
