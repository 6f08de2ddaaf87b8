"""bench_long_prefill's table from made-up measurements, and its refusals; no model runs.

Each side is measured in a fresh process (a spawn pool of one); here the pool is a stand-in
that runs a made-up `measure` in this process, so what the tool asks of each side and how it
prints the answers are checked without loading a checkpoint.
"""

import concurrent.futures

import pytest

from tools.bench import long_prefill

SECONDS = {"eager": 2.0, "quantized": 4.0, "transformers": 8.0}
RSS = {"eager": 300.0, "quantized": 200.0, "transformers": 900.0}


class _InProcess:
    """ProcessPoolExecutor(1, mp_context=...) as a context manager whose submit runs now."""

    def __init__(self, workers: int, mp_context=None) -> None:
        assert workers == 1 and mp_context is not None  # one fresh (spawned) process a side

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None

    def submit(self, fn, *args):
        future = concurrent.futures.Future()
        future.set_result(fn(*args))
        return future


@pytest.fixture
def measured(monkeypatch) -> list[tuple]:
    """Every measure() call's arguments; each side gets SECONDS and RSS of its own."""
    calls = []

    def measure(side, model, encoding, threads, repeats):
        calls.append((side, model, encoding, threads, repeats))
        return {"seconds": SECONDS[side], "tokens": 8323, "case": "long_8k", "rss_mib": RSS[side]}

    monkeypatch.setattr(long_prefill, "measure", measure)
    monkeypatch.setattr(long_prefill.concurrent.futures, "ProcessPoolExecutor", _InProcess)
    monkeypatch.setattr(long_prefill, "_variants", lambda models: [("tinyllama", "float32")])
    return calls


def test_each_side_is_measured_and_the_ratios_are_transformers_seconds_over_ours(
    measured, capsys
) -> None:
    """Every side (eager, quantized, transformers) is measured once per checkpoint with the
    command line's threads and repeats, and the row prints each side's seconds and peak RSS,
    then eager/tf and quant/tf as transformers' seconds over the engine's (above 1: faster
    than transformers): 8 / 2 and 8 / 4. Planted: the ratios inverted, --threads and
    --repeats swapped on their way to measure, a side's RSS printed under another."""
    assert long_prefill.main(["--models=tinyllama", "--threads=2", "--repeats=3"]) == 0
    assert measured == [
        (side, "tinyllama", "float32", 2, 3) for side in ("eager", "quantized", "transformers")
    ]
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("longest golden case per checkpoint, prefill on 2 thread(s)")
    assert "fastest of 3" in out[0]
    header, row = out[1].split(), out[2].split()
    assert header[-2:] == ["eager/tf", "quant/tf"]
    assert row[:4] == ["tinyllama", "float32", "long_8k", "8323"]
    assert row[4:10] == ["2.000", "300", "4.000", "200", "8.000", "900"]
    assert row[10:] == ["4.00", "2.00"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--models=gpt2"], "--models takes tinyllama, smollm2"),
        (["--models=,"], "--models takes tinyllama, smollm2"),
        (["--threads=0"], "--threads and --repeats must be >= 1"),
        (["--repeats=0"], "--threads and --repeats must be >= 1"),
    ],
)
def test_bad_arguments_exit_2_before_measuring(argv, message, measured, capsys) -> None:
    """A model it does not know, no model, or no thread or repeat: exit 2 with the usage and
    what it takes, and nothing measured."""
    assert long_prefill.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: bench_long_prefill")
    assert message in err
    assert measured == []
