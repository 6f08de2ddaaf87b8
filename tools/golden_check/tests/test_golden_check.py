"""golden_check end to end without llama.cpp: a loopback OpenAI-compatible server that serves
this engine's own numbers passes the pinned goldens; the same server on a mutated checkpoint
fails them; an address where nothing listens, a checkpoint that does not exist and an engine x
encoding that is not judged exit 2 with one line. (llama.cpp itself: test_llama_cpp.)"""

from __future__ import annotations

import dataclasses
import socket
from pathlib import Path
from types import SimpleNamespace

import pytest

from goldens.engines.tests.fake_server import FakeServer
from harness.llama3 import checkpoint_mutations, engine_runs
from tools.golden_check import golden_check


def _served(path):
    """A fake server whose model is this engine on the GGUF at `path`."""
    (variant,) = [v for v in golden_check.checkpoints().values() if v.encoding == "float32"]
    engine = engine_runs.load_engine(dataclasses.replace(variant, path=path))

    def logits(prefix):
        return engine.generate(list(prefix), 1).logits[0].float().numpy()

    return variant, FakeServer("token_ids", logits=logits)


def _check(url: str, *extra: str) -> int:
    argv = ["--engine=openai", f"--url={url}", "--checkpoint=tinyllama-float32", "--lane=short"]
    return golden_check.main([*argv, "--report-dir", *extra])


def test_a_server_with_this_engines_numbers_passes_and_a_mutated_checkpoint_fails(tmp_path, capsys):
    variant, server = _served(golden_check.checkpoints()["tinyllama-float32"].path)
    with server:
        assert _check(server.url, str(tmp_path)) == 0
    out = capsys.readouterr().out
    assert "own/float32/external" in out and "torch/float32/external" in out
    assert "input ids: not checked" in out  # a bare OpenAI server cannot tokenize
    assert out.strip().endswith("verdict: PASS")
    assert len(list(tmp_path.glob("golden_report_*.html"))) == 2

    mutation = checkpoint_mutations.BY_NAME["weight_scaled"]
    copy = checkpoint_mutations.mutated_copy(variant.path, mutation, tmp_path)
    _, server = _served(copy)
    with server:
        assert _check(server.url, str(tmp_path)) == 1
    out = capsys.readouterr().out
    assert "golden mismatch in case 'prose'" in out
    assert out.strip().endswith("verdict: FAIL")


def test_nothing_listening_exits_2_with_one_line_naming_the_url(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/v1"
    assert (
        golden_check.main(["--engine=openai", f"--url={url}", "--checkpoint=tinyllama-float32"])
        == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"nothing answers at {url}" in err[0]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--engine=openai", "--checkpoint=nope", "--url=http://x/v1"], "is not one of"),
        (["--engine=openai", "--checkpoint=tinyllama-float32"], "needs --url"),
        (["--engine=llama_cpp", "--checkpoint=tinyllama-q4_k"], "is not judged"),
        (["--engine=openai", "--url=http://x/v1", "--checkpoint=tinyllama-float32",
          "--mutations"], "--mutations needs"),
        (["--engine=openai", "--url=http://x/v1", "--checkpoint=tinyllama-float32",
          "--sampling"], "--sampling needs --engine=llama_cpp"),
        (["--engine=llama_cpp", "--checkpoint=tinyllama-float32", "--sampling",
          "--sampler=top_k=50"], "give a top_k from 1 to 20"),
        (["--engine=llama_cpp", "--checkpoint=tinyllama-float32", "--sampling",
          "--sampler=temp=2"], "KEY one of temperature, top_k, top_p, min_p"),
        (["--engine=llama_cpp", "--checkpoint=tinyllama-float32", "--sampling",
          "--sampler=top_k=5,temperature=0"], "temperature=0.0 must be > 0"),
        # Checked by the parser: each reached the engine and stopped in a traceback, exit 1.
        (["--engine=openai", "--url=http://x/v1", "--checkpoint=tinyllama-float32",
          "--timeout=-5"], "argument --timeout: -5: give a number of seconds above 0"),
        (["--engine=openai", "--url=http://x/v1", "--checkpoint=tinyllama-float32",
          "--timeout=nan"], "argument --timeout: nan: give a number of seconds above 0"),
        (["--engine=openai", "--url=http://x/v1", "--checkpoint=tinyllama-float32",
          "--batch=0"], "argument --batch: 0: give at least 1"),
        (["--engine=openai", "--url=http://x/v1", "--checkpoint=tinyllama-float32",
          "--batch=-1"], "argument --batch: -1: give at least 1"),
        (["--engine=this", "--checkpoint=tinyllama-float32", "--mode=turbo"],
         "argument --mode: invalid choice: 'turbo'"),
    ],
)  # fmt: skip
def test_bad_input_exits_2_naming_it(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        code = golden_check.main(argv)
        raise SystemExit(code)
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert message in captured.err


def test_a_report_that_cannot_be_written_exits_2_not_a_verdict(tmp_path, monkeypatch, capsys):
    """A failed report write (here mkstemp refused) is one line, exit 2: exit 1 means FAIL."""
    from goldens import cli_files

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    def judge(args, variant, gguf, goldens, column, report_dir=None):
        cli_files.write_atomically(report_dir / "golden_report_x.html", "<html>")
        raise AssertionError("the write above must fail")

    monkeypatch.setattr(cli_files.tempfile, "mkstemp", refuse)
    monkeypatch.setattr(golden_check, "_judge", judge)
    assert _check("http://x/v1", str(tmp_path)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"golden_check: cannot write {tmp_path / 'golden_report_x.html'} (Permission denied); "
        f"free space or grant write permission in {tmp_path}, or name another path"
    ]


def test_transformers_passes_this_engines_golden_and_every_mutation_fails_it(tmp_path, capsys):
    argv = ["--engine=transformers", "--checkpoint=tinyllama-float32", "--lane=short"]
    assert (
        golden_check.main([*argv, "--golden=own", "--mutations", f"--report-dir={tmp_path}"]) == 0
    )
    out = capsys.readouterr().out
    assert "own/float32/cpu" in out
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ")}
    for mutation in checkpoint_mutations.MUTATIONS:
        line = lines[mutation.name]
        if mutation.name == "rope_theta":  # transformers rebuilds rope from Llama 3.1's recipe
            assert "not applicable: the engine refuses the file" in line, line
        else:
            assert " FAIL: " in line, line
    assert out.strip().endswith("verdict: PASS")


def test_list_names_every_checkpoint(capsys):
    assert golden_check.main(["--list"]) == 0
    out = capsys.readouterr().out
    assert "tinyllama-float32" in out and "tiny_llama.gguf" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--engine=openai", "--url=http://x/v1", "--checkpoint=tinyllama-float32",
          "--timeout=0"], "argument --timeout: 0: give a number of seconds above 0"),
        (["--engine=llama_cpp", "--checkpoint=tinyllama-float32", "--sampling", "--draws=0"],
         "--draws=0: give at least 1"),
        (["--engine=llama_cpp", "--url=http://x/v1", "--checkpoint=tinyllama-float32",
          "--mutations"], "--mutations needs an engine this command starts"),
        (["--engine=openai", "--url=http://x/v1", "--checkpoint=tinyllama-float32",
          "--report-dir=REPORT_FILE"], "exists and is not a directory; name a folder"),
    ],
)  # fmt: skip
def test_bad_input_exits_2_before_any_engine_is_started(
    argv, message, tmp_path, monkeypatch, capsys
):
    """Each of these is refused (exit 2, naming the option) before an engine is built or a
    llama-server started: the engine is replaced by one that fails the test. Planted: --timeout
    checked as `>= 0`, --draws as `< 0`, --mutations refused for openai only (a --url server
    cannot be restarted on each mutated copy), --report-dir not checked before the judging (it
    failed after every case had run)."""
    report_file = tmp_path / "report_file"
    report_file.write_text("")
    argv = [a.replace("REPORT_FILE", str(report_file)) for a in argv]

    def started(*args, **kwargs):
        raise AssertionError("an engine was started for a command that must be refused")

    monkeypatch.setattr(golden_check, "_target", started)
    monkeypatch.setattr(golden_check, "_judge", started)
    with pytest.raises(SystemExit) as exit_info:
        code = golden_check.main(argv)
        raise SystemExit(code)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_an_unavailable_checkpoint_and_an_unpinned_golden_exit_2_with_one_line(monkeypatch, capsys):
    """A checkpoint whose file is not on this machine, and a golden that is not pinned, are bad
    input: exit 2 and one line naming them (exit 1 means a verdict failed). Planted: either
    branch returning 1."""
    table = golden_check.checkpoints()
    absent = dataclasses.replace(
        table["tinyllama-float32"], path=None, unavailable_reason="not downloaded here"
    )
    monkeypatch.setattr(golden_check, "checkpoints", lambda: {**table, "tinyllama-float32": absent})
    argv = ["--engine=openai", "--url=http://x/v1", "--checkpoint=tinyllama-float32"]
    assert golden_check.main(argv) == 2
    assert capsys.readouterr().err.splitlines() == [
        "golden_check: tinyllama-float32: not downloaded here"
    ]
    monkeypatch.setattr(golden_check, "checkpoints", lambda: table)
    monkeypatch.setattr(golden_check.golden_files, "find_golden", lambda *args: None)
    assert golden_check.main([*argv, "--golden=own"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("golden_check: no own golden "), err
    assert err[0].endswith(" is pinned"), err


def test_sampling_with_nothing_listening_exits_2_with_one_line_naming_the_url(capsys):
    """--sampling's engine failure is bad input too (exit 2), not a FAIL (exit 1). Planted: its
    EngineError branch returning 1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/v1"
    argv = ["--engine=llama_cpp", f"--url={url}", "--checkpoint=tinyllama-float32", "--sampling"]
    assert golden_check.main([*argv, "--lane=short", "--draws=1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nothing answers at http://127.0.0.1:" in err[0], err


def _against_a_random_model(tmp_path, *extra: str) -> tuple[int, list[dict]]:
    """golden_check on the short cases of tinyllama-float32's own golden, against a fake
    server whose model is random numbers (fake_server.logits_of, 64 ids: cheap, every check
    fails): the exit status and the requests the server got."""
    argv = ["--engine=openai", "--checkpoint=tinyllama-float32", "--lane=short", "--golden=own"]
    with FakeServer("token_ids") as server:
        code = golden_check.main([*argv, f"--url={server.url}", f"--report-dir={tmp_path}", *extra])
    return code, server.requests


def test_model_batch_and_echo_reach_the_server(tmp_path, capsys):
    """README "Judge your own engine": --model is the name the server is sent (this engine's
    server answers 404 to another name), --batch the prefixes per request, --echo one
    request per case with prompt log-probabilities. Planted, each caught here: _target
    building the adapter without args.model, or without echo (the options dict), or without
    batch (the adapter's default 16)."""
    code, requests = _against_a_random_model(tmp_path, "--model=tiny", "--batch=4")
    assert code == 1  # random numbers fail: the point is what was sent
    assert {r.get("model") for r in requests} == {"tiny"}
    sizes = [len(r["prompt"]) if isinstance(r["prompt"][0], list) else 1 for r in requests]
    assert max(sizes) == 4 and all("echo" not in r for r in requests), sizes
    code, requests = _against_a_random_model(tmp_path, "--echo")
    assert code == 1
    assert [r["echo"] for r in requests] == [True] * 4  # the short lane's four cases
    assert all(isinstance(r["prompt"][0], int) for r in requests)  # one sequence each
    capsys.readouterr()


def test_a_failure_reads_as_the_readmes_example(tmp_path, capsys):
    """README "Reading a golden failure": the failing case's text names the tolerance, how
    many steps and prompt positions fail and the first of them, the golden's greedy choice
    there and the regeneration command; the last line is the verdict. The short lane's
    'prose' case against a model of random numbers fails every step and every recorded
    prompt position, so the first failing position is 0 (recorded up to 4), as the README's
    example reads. Planted: the prompt-position line naming the last failing position
    instead of the first (prompt_failing[-1]; goldens/tests' texts have one failing
    position, so they pass on it)."""
    code, _ = _against_a_random_model(tmp_path)
    out = capsys.readouterr().out
    assert code == 1 and out.strip().endswith("verdict: FAIL")
    text = out[out.index("golden mismatch in case 'prose'") :]
    lines = [line.rstrip() for line in text.splitlines()]
    assert lines[0].startswith(
        "golden mismatch in case 'prose' ('The capital of France is', 6 prompt tokens) "
        "against tinyllama_float32_all_golden.json"
    ), lines[0]
    assert lines[1].startswith("  tolerance own/float32/external: |Δ log-prob| 0.001, KL 1e-06")
    assert lines[2].startswith("  teacher-forced: 10 of 10 steps fail (logprob), 0 ambiguous")
    assert lines[3:6] == [
        "  free-running greedy agreement: 0 of 10 steps",
        "  prompt positions: 5 of 5 fail, the first at position 0 (recorded up to position 4)",
        "  first failing check: prompt position 0 of 6 (metric logprob); the next prompt token "
        "is 791",
    ]
    assert lines[6].startswith(
        "  golden greedy choice there 123496 '●●●●●●●●●●●●●●●●' (golden top-1/top-2 gap 0.7742)"
    ), lines[6]
    assert (
        "  regenerate the golden (if the change is intended): ./bazelw run "
        "//max_tests/integration/architectures/llama3:evaluate_llama -- --model=tinyllama "
        "--encoding=float32 --device=cpu"
    ) in lines


@pytest.mark.parametrize(
    ("argv", "column"),
    [
        (["--engine=openai", "--url=http://x/v1", "--checkpoint=tinyllama-float32"], "external"),
        (["--engine=llama_cpp", "--url=http://x/v1", "--checkpoint=tinyllama-float32"],
         "llama_cpp"),
        (["--engine=this", "--checkpoint=tinyllama-float32"], "cpu"),
        # not judged under llama_cpp (exit 2, test_bad_input_exits_2_naming_it); the message
        # says --tolerance=external judges it anyway, and so it does
        (["--engine=llama_cpp", "--url=http://x/v1", "--checkpoint=tinyllama-q4_k",
          "--tolerance=external"], "external"),
        (["--engine=openai", "--url=http://x/v1", "--checkpoint=tinyllama-float32",
          "--tolerance=cpu"], "cpu"),
    ],
)  # fmt: skip
def test_the_tolerance_column_is_the_engines_unless_tolerance_names_another(
    argv, column, tmp_path, monkeypatch, capsys
):
    """README: tolerances per engine are columns of tolerances.yaml (llama_cpp for llama.cpp,
    external for any other server, cpu for this engine and transformers); --tolerance= picks
    another. The column the judging gets is recorded (the judging itself replaced by an
    engine error: exit 2). Planted: --tolerance ignored (the engine's column always): the
    not-judged q4_k file then exits 2 before any judging, and --tolerance=cpu judged a
    server under the looser external column (test_serve passes --tolerance=cpu; its server
    would pass under external too, so it cannot notice)."""
    judged = []

    def judge(args, variant, gguf, goldens, column, report_dir=None):
        judged.append(column)
        raise golden_check.EngineError("stopped after the column was chosen")

    monkeypatch.setattr(golden_check, "_judge", judge)
    argv = [*argv, "--golden=own", "--lane=short", f"--report-dir={tmp_path}"]
    assert golden_check.main(argv) == 2
    assert judged == [column], capsys.readouterr().err


def test_a_checkpoint_mutation_that_passes_fails_the_check(tmp_path, monkeypatch, capsys):
    """README: with --mutations each edited copy must FAIL; one that passes is a failed
    verdict (exit 1), its line saying PASS (missed), whatever the mutations after it do; and
    every mutation failing does not excuse a failing checkpoint. The judging is replaced:
    first the checkpoint passes and norm_weight's copy passes (missed), the other copies
    fail; then the checkpoint fails and every copy fails. Planted, each caught here:
    `caught = fails` (the last mutation's verdict alone: rope_theta fails, so exit 0); the
    mutations' result replacing the checkpoint's (`failed = not _mutations(...)`) instead of
    joining it."""
    missed = {"checkpoint": False, "mutation": "norm_weight"}

    def verdict(fails: bool):
        return SimpleNamespace(
            failures=["planted failure"] if fails else [], max_logprob_diff=1.0, max_kl=0.1,
            reference="own", source="golden.json",
        )  # fmt: skip

    def judge(args, variant, gguf, goldens, column, report_dir=None):
        if report_dir is not None:  # the checkpoint itself
            return [verdict(missed["checkpoint"])], ("fake", True), [tmp_path / "report.html"]
        return [verdict(missed["mutation"] not in Path(gguf).name)], ("fake", True), []

    monkeypatch.setattr(golden_check, "_judge", judge)
    monkeypatch.setattr(golden_check, "_row", lambda verdict: "row")
    monkeypatch.setattr(
        golden_check.checkpoint_mutations,
        "mutated_copy",
        lambda source, mutation, folder: Path(folder) / f"copy.{mutation.name}.gguf",
    )
    argv = ["--engine=this", "--checkpoint=tinyllama-float32", "--golden=own", "--mutations"]
    argv += ["--lane=short", f"--report-dir={tmp_path}"]
    assert golden_check.main(argv) == 1
    out = capsys.readouterr().out
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ")}
    assert "PASS (missed)" in lines["norm_weight"], lines
    assert " FAIL: " in lines["weight_scaled"] and " FAIL: " in lines["rope_theta"], lines
    assert out.strip().endswith("verdict: FAIL")
    missed.update(checkpoint=True, mutation="none")  # every copy fails, and so does the file
    assert golden_check.main(argv) == 1
    out = capsys.readouterr().out
    assert "planted failure" in out and out.strip().endswith("verdict: FAIL")


def test_the_sampling_check_runs_with_the_readmes_defaults(monkeypatch, capsys):
    """README "Judge your own engine", --sampling: 2000 draws per case (one seed each), held
    to the llama_cpp order by default, by a G-test at alpha 1e-6, under the default sampler
    temperature=1.5,top_k=20,top_p=0.8,min_p=0.05. The engine and the draws are replaced:
    what check_sampler is asked, and the header, are recorded. Planted, each caught here:
    --order defaulting to transformers; DEFAULT_SAMPLER's top_p 0.9; DRAWS 1000."""
    asked = []

    def check_sampler(engine, case, sampler, draws, order):
        asked.append((case.id, sampler, draws, order))
        return SimpleNamespace(case_id=case.id, verdict="PASS", summary=lambda: case.id)

    engine = SimpleNamespace(name="fake llama.cpp", close=lambda: None)
    monkeypatch.setattr(golden_check, "_target", lambda *args: golden_check.Target(engine))
    monkeypatch.setattr(golden_check.sampler_check, "check_sampler", check_sampler)
    argv = ["--engine=llama_cpp", "--checkpoint=tinyllama-float32", "--sampling", "--lane=short"]
    assert golden_check.main(argv) == 0
    header = capsys.readouterr().out.splitlines()[0]
    sampler = {"temperature": 1.5, "top_k": 20, "top_p": 0.8, "min_p": 0.05}
    assert len(asked) == 4, asked  # the short lane's four cases
    assert all((s, d, o) == (sampler, 2000, "llama_cpp") for _, s, d, o in asked), asked
    assert "in the llama_cpp order, 2000 draws per case, G-test at alpha 1e-06" in header, header


def test_a_goldens_header_names_no_path_and_no_local_torch_suffix(tmp_path, monkeypatch) -> None:
    """docs/goldens.md:35-36: the provenance golden_check's goldens are made with
    (golden_files.provenance) records `checkpoint` as the GGUF's file name, never a path, and
    `torch_version` without the local suffix, so goldens made from one file in two checkouts
    have the same header (planted: `checkpoint=str(variant.path)`, which passed the fast tests
    and tests_harness' evaluate_llama cases that write a golden; `torch_version=
    torch.__version__`)."""
    import torch

    from goldens.diff import FileDiff, GoldenFile
    from harness.llama3 import golden_files
    from harness.llama3.variants import testdata_directory

    monkeypatch.setattr(torch, "__version__", "2.13.0+cu130")
    checkpoint = (testdata_directory() / "tiny_llama.gguf").resolve()  # a relative runfiles path
    (variant,) = [v for v in golden_check.checkpoints().values() if v.encoding == "float32"]
    headers = []
    for checkout in ("a", "b"):
        (tmp_path / checkout).mkdir()
        (tmp_path / checkout / checkpoint.name).symlink_to(checkpoint)
        copy = dataclasses.replace(variant, path=tmp_path / checkout / checkpoint.name)
        headers.append(golden_files.provenance(copy, "engine", "llama3-engine/2", "cpu"))
    assert (headers[0].checkpoint, headers[0].torch_version) == ("tiny_llama.gguf", "2.13.0")
    files = [GoldenFile(5, dataclasses.asdict(header), []) for header in headers]
    assert FileDiff("g.json", *files, []).header_differences == []


def test_a_report_under_bazel_names_the_outputs_zip_of_its_shard() -> None:
    """docs/goldens.md:853-858: a failing golden test's report line names the zip Bazel makes
    of its outputs, `bazel-testlogs/PACKAGE/TARGET/[shard_I_of_N/]test.outputs/outputs.zip`,
    shard I being TEST_SHARD_INDEX + 1 (failure_report, which golden_check's reports come
    from too). Planted: `shard_{index}_of_{total}` (shard 0 of 2), caught before only by
    tests_slow's test_mutations."""
    from harness.llama3.failure_report import bazel_outputs_zip

    target = {"TEST_TARGET": "//max_tests/integration/architectures/llama3:test_llama"}
    logs = "bazel-testlogs/max_tests/integration/architectures/llama3/test_llama"
    assert bazel_outputs_zip(target) == f"{logs}/test.outputs/outputs.zip"
    one_shard = {**target, "TEST_TOTAL_SHARDS": "1", "TEST_SHARD_INDEX": "0"}
    assert bazel_outputs_zip(one_shard) == f"{logs}/test.outputs/outputs.zip"
    for index, folder in (("0", "shard_1_of_2"), ("1", "shard_2_of_2")):
        sharded = {**target, "TEST_TOTAL_SHARDS": "2", "TEST_SHARD_INDEX": index}
        assert bazel_outputs_zip(sharded) == f"{logs}/{folder}/test.outputs/outputs.zip"
    assert bazel_outputs_zip({}) is None  # not under bazel test: the report line has no zip


# checkpoint_mutations itself: each planted edit is the one its docstring names, by its factor,
# and nothing else in the file moves.
def _tensors_and_fields(path):
    from gguf import GGUFReader

    from testing import gguf_reader

    gguf_reader.install()
    reader = GGUFReader(path)
    tensors = {t.name: (t.tensor_type, t.data.tobytes()) for t in reader.tensors}
    fields = {key: field.contents() for key, field in reader.fields.items()}
    return tensors, fields


def _tiny_with_attn_v(folder, attn_v_type):
    """A 1-layer tiny checkpoint (dim 256: a Q4_K row) whose blk.0.attn_v is `attn_v_type`."""
    from tools.gen_tiny_model.tiny_llama import write_tiny_llama

    path = folder / f"tiny_attn_v_{attn_v_type.name}.gguf"
    write_tiny_llama(
        path, dim=256, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=256,
        tensor_types={"blk.0.attn_v.weight": attn_v_type},
    )  # fmt: skip
    return path


def _only_change(original, copy, tensor=None, field=None):
    """The copy's tensors and fields, asserting every other one is the original's."""
    tensors, fields = _tensors_and_fields(original)
    changed_tensors, changed_fields = _tensors_and_fields(copy)
    assert changed_tensors.keys() == tensors.keys() and changed_fields.keys() == fields.keys()
    for name in tensors:
        if name != tensor:
            assert changed_tensors[name] == tensors[name], name
    for key in fields:
        if key != field:
            assert changed_fields[key] == fields[key], key
    return (tensors, fields), (changed_tensors, changed_fields)


@pytest.mark.parametrize("kind", ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0", "Q4_K"])
def test_weight_scaled_scales_every_attn_v_weight_by_1_002_and_nothing_else(kind, tmp_path):
    """checkpoint_mutations' weight_scaled: blk.0.attn_v.weight x1.002, float values directly
    (rounded to nearest, BF16 to nearest even as torch rounds), block-quantized ones through
    every float16 scale of each block (Q4_1's m and Q4_K's dmin too: an offset m left alone is
    not a scale of the weights), and every other tensor and field byte for byte. Planted:
    Q4_1's or Q4_K's second scale dropped, F16 refused, BF16 truncated, the factor 1.02."""
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    qtype = GGMLQuantizationType[kind]
    original = _tiny_with_attn_v(tmp_path, qtype)
    mutation = checkpoint_mutations.BY_NAME["weight_scaled"]
    assert mutation.what == "blk.0.attn_v.weight x1.002"
    copy = checkpoint_mutations.mutated_copy(original, mutation, tmp_path)
    assert copy == tmp_path / f"tiny_attn_v_{kind}.weight_scaled.gguf"
    name = "blk.0.attn_v.weight"
    (tensors, _), (changed, _) = _only_change(original, copy, tensor=name)
    assert changed[name][0] == tensors[name][0] == qtype
    before, after = tensors[name][1], changed[name][1]
    assert before != after
    if kind in ("F32", "F16"):
        dtype = np.float32 if kind == "F32" else np.float16
        old = np.frombuffer(before, dtype)
        expected = (old.astype(np.float32) * np.float32(1.002)).astype(dtype)
        assert np.frombuffer(after, dtype).tobytes() == expected.tobytes()
        return
    if kind == "BF16":
        old = torch.from_numpy(np.frombuffer(before, np.int16).copy()).view(torch.bfloat16)
        expected = (old.float() * 1.002).to(torch.bfloat16)
        assert torch.equal(torch.from_numpy(np.frombuffer(after, np.int16).copy()),
                           expected.view(torch.int16))  # fmt: skip
        return
    old = dequantize(np.frombuffer(before, np.uint8), qtype)
    new = dequantize(np.frombuffer(after, np.uint8), qtype)
    # Each float16 scale rounds to 2**-11 relative: the weights move by 1.002 within that
    # (|d q| + |m| <= 2 max |w|, so 1.002 * 2**-10 of the largest weight at worst).
    error = np.abs(new - np.float32(1.002) * old)
    assert error.max() <= 1.01 * 2**-10 * np.abs(old).max(), error.max()
    ratio = float(np.dot(new, old) / np.dot(old, old))
    assert ratio == pytest.approx(1.002, abs=2e-4)
    # The bounds above let an unscaled offset (0.002 |m|) through: within each 32 weights (a
    # block, a Q4_K sub-block) the new weights are a * old + b, and b is only the two scales'
    # roundings apart (1.002 * 2**-10 of the block's largest weight at most), never 0.002 |m|.
    old_blocks, new_blocks = old.reshape(-1, 32), new.reshape(-1, 32)
    centred = old_blocks - old_blocks.mean(axis=1, keepdims=True)
    slope = (centred * new_blocks).sum(axis=1) / (centred * centred).sum(axis=1)
    offset = np.abs(new_blocks.mean(axis=1) - slope * old_blocks.mean(axis=1))
    bound = 1.01 * 2**-10 * np.abs(old_blocks).max(axis=1) + 1e-7
    assert (offset <= bound).all(), offset.max()


def test_norm_weight_and_rope_theta_change_their_one_value_by_their_factor(tmp_path):
    """norm_weight: blk.0.attn_norm.weight[0] x1.05 (float32), nothing else; rope_theta:
    llama.rope.freq_base x1.01, nothing else. Planted: the norm element shifted (+1.05) instead
    of scaled, the theta divided, the ffn norm changed instead of the attention norm."""
    import numpy as np

    from tools.gen_tiny_model.tiny_llama import write_tiny_llama

    original = tmp_path / "tiny.gguf"
    write_tiny_llama(original, n_layers=1, rope_theta=10000.0)
    norm = checkpoint_mutations.mutated_copy(
        original, checkpoint_mutations.BY_NAME["norm_weight"], tmp_path
    )
    name = "blk.0.attn_norm.weight"
    (tensors, _), (changed, _) = _only_change(original, norm, tensor=name)
    old = np.frombuffer(tensors[name][1], np.float32)
    new = np.frombuffer(changed[name][1], np.float32)
    assert new[0] == old[0] * np.float32(1.05) and new[0] != old[0]
    assert new[1:].tobytes() == old[1:].tobytes()

    theta = checkpoint_mutations.mutated_copy(
        original, checkpoint_mutations.BY_NAME["rope_theta"], tmp_path
    )
    key = "llama.rope.freq_base"
    (_, fields), (_, changed_fields) = _only_change(original, theta, field=key)
    assert fields[key] == 10000.0
    assert changed_fields[key] == pytest.approx(10100.0, rel=1e-7)
