import json
import pathlib

import pytest
import torch

from goldens import cli_files
from goldens.cli_files import user_path
from tools.gen_tiny_model import gen_tiny_model, write_draft, write_hf_config
from tools.gen_tiny_model.gen_tiny_model import main

VALID = [
    "--quantization-encoding=float32",
    "--n-layers=1",
    "--n-heads=1",
    "--n-kv-heads=1",
    "--hidden-dim=16",
]


def _with(*overrides: str) -> list[str]:
    names = {o.split("=")[0] for o in overrides}
    return [a for a in VALID if a.split("=")[0] not in names] + list(overrides)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (_with("--n-heads=7", "--hidden-dim=24"), "--n-heads=7 must divide --hidden-dim=24"),
        (_with("--n-heads=5", "--hidden-dim=16"), "--n-heads=5 must divide --hidden-dim=16"),
        (_with("--n-heads=4", "--n-kv-heads=3"), "--n-kv-heads=3 must divide --n-heads=4"),
        (_with("--n-heads=16"), "must be even (RoPE rotates pairs)"),
        (
            _with("--quantization-encoding=q4_k"),
            "--hidden-dim=16 must be a multiple of 256 for --quantization-encoding=q4_k",
        ),
        (
            _with("--quantization-encoding=q4_k", "--hidden-dim=256", "--intermediate-dim=300"),
            "--intermediate-dim=300 must be a multiple of 256",
        ),
        (
            _with("--quantization-encoding=nvfp4"),
            "--hidden-dim=16 must be a multiple of 64 for --quantization-encoding=nvfp4 "
            "(NVFP4 blocks hold 64 values)",
        ),
        (
            _with("--quantization-encoding=nvfp4", "--hidden-dim=64", "--intermediate-dim=96"),
            "--intermediate-dim=96 must be a multiple of 64",
        ),
        (_with("--quantization-encoding=q8_0"), "invalid choice: 'q8_0'"),
        (_with("--n-layers=0"), "0 must be at least 1"),
        (_with("--n-heads=two"), "'two' is not an integer"),
    ],
)
def test_invalid_argument_exits_2_with_one_line_and_writes_nothing(tmp_path, capsys, args, message):
    output = tmp_path / "model.gguf"
    with pytest.raises(SystemExit) as exit_info:
        exit_code = main([f"--output={output}", *args])
        raise SystemExit(exit_code)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.count("\n") == 1, err
    assert list(tmp_path.iterdir()) == []


def test_a_hidden_dim_of_12_runs_in_every_engine_mode(tmp_path):
    """No alignment rule beyond the formats' own blocks: the engine, dense or fused, takes any
    hidden size its heads divide (the packed kernels need 32 | K, which Q4/Q8 blocks ensure)."""
    from pipelines.llama3 import Llama3Engine

    path = tmp_path / "h12.gguf"
    assert main(_with("--hidden-dim=12", "--n-heads=2", f"--output={path}")) == 0
    logits = [
        Llama3Engine.from_gguf(path, mode=mode).forward_logits([1, 2, 3])
        for mode in ("eager", "quantized")
    ]
    assert logits[0].shape[1] > 0 and torch.isfinite(logits[0]).all()
    assert torch.equal(logits[0], logits[1])


def test_output_under_a_file_exits_2_and_leaves_the_file(tmp_path, capsys):
    blocker = tmp_path / "checkpoints"
    blocker.write_text("not a folder")
    assert main([f"--output={blocker / 'sub' / 'model.gguf'}", *VALID]) == 2
    err = capsys.readouterr().err
    assert "cannot be created" in err and err.count("\n") == 1
    assert list(tmp_path.iterdir()) == [blocker] and blocker.read_text() == "not a folder"


def test_invalid_command_creates_no_output_folder(tmp_path, capsys):
    output = tmp_path / "absent" / "model.gguf"
    assert main([f"--output={output}", *_with("--n-heads=5")]) == 2
    assert list(tmp_path.iterdir()) == []


def test_tokenizer_dir_without_tokenizer_json_exits_2(tmp_path, capsys):
    assert main([f"--output={tmp_path / 'm.gguf'}", f"--tokenizer-dir={tmp_path}", *VALID]) == 2
    assert "has no tokenizer.json; write one with" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


TESTDATA = "max_tests/integration/architectures/llama3/testdata"


def _tokenizer_without_eot() -> str:
    """testdata's tokenizer.json with <|eot_id|> (the EOS token) renamed: the right size."""
    text = (pathlib.Path(TESTDATA) / "tokenizer.json").read_text(encoding="utf-8")
    assert text.count('"<|eot_id|>"') == 1, "the planted tokenizer no longer plants"
    return text.replace('"<|eot_id|>"', '"<|eot_idX|>"')


def _three_token_tokenizer() -> str:
    from tokenizers import Tokenizer, models

    return Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]")).to_str()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (lambda: "{}", "tokenizer.json is not a tokenizer (Model missing"),
        (_three_token_tokenizer, "tokenizer.json has 3 tokens, the Llama 3.1 model needs 128256"),
        (_tokenizer_without_eot, "tokenizer.json has no <|eot_id|>"),
    ],
    ids=["empty-object", "three-tokens", "no-eos"],
)
def test_a_bad_tokenizer_exits_2_naming_the_flag_and_creates_no_output_folder(
    tmp_path, capsys, content, message
):
    """The tokenizer is read and checked before the output folder is created (a tokenizer.json
    of {} raised tokenizers' Exception, exit 1, after creating it)."""
    tokenizer_dir = tmp_path / "tokenizer"
    tokenizer_dir.mkdir()
    (tokenizer_dir / "tokenizer.json").write_text(content(), encoding="utf-8")
    output = tmp_path / "absent" / "m.gguf"
    assert main([f"--output={output}", f"--tokenizer-dir={tokenizer_dir}", *VALID]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"gen_tiny_model: error: --tokenizer-dir={tokenizer_dir}: "), err
    assert message in err and "//tools/gen_tiny_model:write_tokenizer" in err, err
    assert err.count("\n") == 1, err
    assert list(tmp_path.iterdir()) == [tokenizer_dir]


def test_relative_output_resolves_against_bazel_working_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("BUILD_WORKING_DIRECTORY", str(tmp_path))
    assert user_path("sub/model.gguf") == tmp_path / "sub" / "model.gguf"
    assert user_path("/abs/model.gguf").as_posix() == "/abs/model.gguf"


def test_help_shows_an_example(capsys):
    with pytest.raises(SystemExit) as exit_info:
        gen_tiny_model.build_parser().parse_args(["--help"])
    assert exit_info.value.code == 0
    assert "./bazelw run //tools:gen_tiny_model -- --output=" in capsys.readouterr().out


TINY = "max_tests/integration/architectures/llama3/testdata/tiny_llama.gguf"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--target=nowhere.gguf"], "--target=nowhere.gguf is not a file"),
        (
            ["--target=max_tests/integration/architectures/llama3/testdata/config.json"],
            "not a readable GGUF file",
        ),
        ([f"--target={TINY}", "--intermediate-dim=0"], "must be at least 1"),
    ],
)
def test_write_draft_refuses_bad_input_with_exit_2_and_writes_nothing(
    tmp_path, capsys, args, message
):
    output = tmp_path / "draft.gguf"
    with pytest.raises(SystemExit) if "at least" in message else _returns(2):
        assert write_draft.main([*args, f"--output={output}"]) == 2
    assert message in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("target", [f"{TESTDATA}/config.json", f"{TESTDATA}/tokenizer.json"])
def test_write_draft_checks_the_target_before_creating_the_output_folder(tmp_path, capsys, target):
    """A target that is not a GGUF checkpoint leaves no folder behind (the output's folder was
    created first: TMP/absent/sub stayed after the exit 2)."""
    output = tmp_path / "absent" / "sub" / "d.gguf"
    assert write_draft.main([f"--target={target}", f"--output={output}"]) == 2
    err = capsys.readouterr().err
    assert "not a readable GGUF file" in err and err.count("\n") == 1, err
    assert list(tmp_path.iterdir()) == []


def test_write_draft_output_under_a_file_exits_2(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    assert write_draft.main([f"--target={TINY}", f"--output={blocker / 'd.gguf'}"]) == 2
    err = capsys.readouterr().err
    assert "--output's folder=" in err and err.count("\n") == 1, err
    assert list(tmp_path.iterdir()) == [blocker] and blocker.read_text() == "not a folder"


def test_write_draft_same_target_same_bytes_and_an_output_folder_is_refused(tmp_path, capsys):
    first, second = tmp_path / "a.gguf", tmp_path / "b.gguf"
    assert write_draft.main([f"--target={TINY}", f"--output={first}"]) == 0
    assert write_draft.main([f"--target={TINY}", f"--output={second}"]) == 0
    assert first.read_bytes() == second.read_bytes()
    assert write_draft.main([f"--target={TINY}", f"--output={tmp_path}"]) == 2
    assert "is a directory" in capsys.readouterr().err


def test_write_draft_keeps_the_targets_embedding_and_head_around_one_block_of_zeros(tmp_path):
    """README.md:72: write_draft writes the target's embedding and head around one block of
    zeros (the target's bigram): the kept tensors (token_embd, rope_freqs, output_norm,
    output) byte for byte, one block whose norms are ones and whose matrices are zeros; the
    README's command on tiny_llama.gguf writes testdata's tiny_llama_draft.gguf (before, only
    the slow regeneration test read the bytes written). Planted: every block tensor ones (the
    draft no longer the bigram), and rope_freqs left out."""
    import numpy as np

    from pipelines.llama3.gguf_file import GGUFFile

    output = tmp_path / "draft.gguf"
    assert write_draft.main([f"--target={TINY}", f"--output={output}"]) == 0
    target, draft = GGUFFile(TINY), GGUFFile(output)
    kept = [name for name in write_draft.KEPT if name in target.tensors]
    assert {"token_embd.weight", "rope_freqs.weight", "output_norm.weight"} <= set(kept)
    block = [name for name in draft.tensors if name not in kept]
    assert sorted(draft.tensors) == sorted([*kept, *block]) and draft.get("llama.block_count") == 1
    for name in kept:
        assert draft.tensors[name].tensor_type == target.tensors[name].tensor_type, name
        assert draft.tensor_data(name).tobytes() == target.tensor_data(name).tobytes(), name
    assert len(block) == 9 and all(name.startswith("blk.0.") for name in block), block
    for name in block:
        values = draft.tensor_data(name).view(np.float32)
        assert (values == (1.0 if name.endswith("_norm.weight") else 0.0)).all(), name
    committed = pathlib.Path(TESTDATA) / "tiny_llama_draft.gguf"
    assert output.read_bytes() == committed.read_bytes()


@pytest.mark.parametrize("link", ["same path", "symlink", "hard link"])
def test_write_draft_refuses_to_write_over_its_target(tmp_path, capsys, link):
    """--output naming the --target file (itself, through a symlink or a hard link) exits 2
    and leaves the target's bytes as they were (it was replaced by its own draft, rc 0)."""
    target = tmp_path / "target.gguf"
    target.write_bytes(pathlib.Path(TINY).read_bytes())
    before = target.read_bytes()
    output = {"same path": target, "symlink": tmp_path / "sym.gguf", "hard link": tmp_path / "hl"}
    if link == "symlink":
        output[link].symlink_to(target)
    elif link == "hard link":
        output[link].hardlink_to(target)
    assert write_draft.main([f"--target={target}", f"--output={output[link]}"]) == 2
    err = capsys.readouterr().err
    assert f"--output={output[link]} is the --target file" in err and err.count("\n") == 1, err
    assert target.read_bytes() == before


class _returns:
    """A no-op context (the command returns its status instead of raising)."""

    def __init__(self, status: int) -> None:
        self.status = status

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> bool:
        return False


def _refuse(*args, **kwargs):
    raise PermissionError(13, "Permission denied")


def test_an_output_folder_it_cannot_create_files_in_exits_2_before_the_tokenizer(
    tmp_path, capsys, monkeypatch
):
    """As root, os.access passes /sys; creating the file there fails. That is found before the
    tokenizer build (seconds), not after it in a traceback with exit 1."""
    monkeypatch.setattr(cli_files.tempfile, "TemporaryFile", _refuse)
    monkeypatch.setattr(gen_tiny_model.llama3_tokenizer, "build_tokenizer", _refuse)
    output = tmp_path / "model.gguf"
    assert main(_with(f"--output={output}")) == 2
    err = capsys.readouterr().err
    assert err == (
        f"gen_tiny_model: error: --output's folder={tmp_path}: cannot create files in "
        f"{tmp_path} (Permission denied); name a folder you can write\n"
    )
    assert list(tmp_path.iterdir()) == []


def test_a_write_that_fails_late_exits_2_naming_output(tmp_path, capsys, monkeypatch):
    """A failure after the check (a full disk) is one line naming --output, exit 2."""

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(gen_tiny_model.llama3_tokenizer, "build_tokenizer", lambda: None)
    monkeypatch.setattr(gen_tiny_model.llama3_tokenizer, "gguf_vocab", lambda tokenizer: None)
    monkeypatch.setattr(gen_tiny_model, "write_gguf", disk_full)
    output = tmp_path / "model.gguf"
    assert main(_with(f"--output={output}")) == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.startswith(f"gen_tiny_model: error: --output={output}: cannot write {output} ")
    assert "(No space left on device)" in err
    assert list(tmp_path.iterdir()) == []


def _recorded_writes(monkeypatch) -> list:
    """gen_tiny_model's writer replaced by one that records (config, seed) in the list it
    returns and writes 4 bytes; no tokenizer is built."""
    writes = []

    def write(path, config, encoding, seed, vocab):
        writes.append((config, seed))
        pathlib.Path(path).write_bytes(b"gguf")

    monkeypatch.setattr(gen_tiny_model.llama3_tokenizer, "build_tokenizer", lambda: None)
    monkeypatch.setattr(gen_tiny_model.llama3_tokenizer, "gguf_vocab", lambda tokenizer: None)
    monkeypatch.setattr(gen_tiny_model, "write_gguf", write)
    return writes


def test_the_default_seed_is_2_and_seed_reaches_the_writer(tmp_path, monkeypatch):
    """docs/architecture.md:85 ("Default seed 2"): without --seed the command writes the
    weights of seed 2 (tiny_llama.gguf's README command gives none), with --seed=N those of
    N. Planted, DEFAULT_SEED 3: only the slow regenerate_testdata_test saw the other bytes."""
    writes = _recorded_writes(monkeypatch)
    assert main(_with(f"--output={tmp_path / 'default.gguf'}")) == 0
    assert main(_with(f"--output={tmp_path / 'seven.gguf'}", "--seed=7")) == 0
    assert [seed for _, seed in writes] == [2, 7]


def test_the_intermediate_dim_defaults_to_four_times_the_hidden_dim(tmp_path, monkeypatch):
    """--intermediate-dim's help ("default: 4 x hidden dim"): without it the model's MLP is
    4 x --hidden-dim wide (tiny_llama.gguf's README command gives none: 64 for hidden 16), with
    it the width given; the other flags reach the config as given. Planted, 2 x hidden: only
    the slow regenerate_testdata_test saw the other bytes."""
    writes = _recorded_writes(monkeypatch)
    gqa = ("--n-layers=3", "--n-heads=4", "--n-kv-heads=2")
    assert main(_with(f"--output={tmp_path / 'default.gguf'}", *gqa)) == 0
    assert main(_with(f"--output={tmp_path / 'given.gguf'}", "--intermediate-dim=24")) == 0
    shapes = [
        (c.n_layers, c.n_heads, c.n_kv_heads, c.hidden_dim, c.intermediate_dim) for c, _ in writes
    ]
    assert shapes == [(3, 4, 2, 16, 64), (1, 1, 1, 16, 24)]


@pytest.mark.parametrize("encoding", ["float32", "nvfp4"])
def test_write_hf_config_describes_the_encoding_given(tmp_path, encoding):
    """write_hf_config's docstring: for --quantization-encoding=nvfp4 config.json also carries
    a quantization_config saying which tensors are NVFP4; the other encodings none. Planted:
    hf_config_for called with "float32" whatever the flag (config_nvfp4.json lost its
    quantization_config; only the slow regenerate_testdata_test saw it)."""
    output = tmp_path / "config.json"
    args = ("--hidden-dim=64", "--n-heads=4", "--n-kv-heads=2", "--intermediate-dim=128")
    flags = _with(f"--output={output}", f"--quantization-encoding={encoding}", *args)
    assert write_hf_config.main(flags) == 0
    config = json.loads(output.read_text())
    assert (config["hidden_size"], config["num_key_value_heads"]) == (64, 2)
    if encoding == "float32":
        assert "quantization_config" not in config
    else:
        quantization = config["quantization_config"]
        assert (quantization["format"], quantization["group_size"]) == ("nvfp4", 16)
        assert "blk.0.attn_k.weight" in quantization["quantized"]
        assert "output_norm.weight" in quantization["ignore"]


def test_write_hf_config_help_shows_its_own_example_and_output(capsys):
    with pytest.raises(SystemExit) as exit_info:
        write_hf_config.build_parser().parse_args(["--help"])
    assert exit_info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert out.startswith("usage: write_hf_config ")
    assert "example: ./bazelw run //tools/gen_tiny_model:write_hf_config -- --output=" in out
    assert "gen_tiny_model -- " not in out and "GGUF file to write" not in out
    assert "--output OUTPUT config.json file to write (folder created)" in out


def test_write_hf_config_writes_json_and_a_failed_write_exits_2(tmp_path, capsys, monkeypatch):
    output = tmp_path / "config.json"
    assert write_hf_config.main(_with(f"--output={output}")) == 0
    assert json.loads(output.read_text())["hidden_size"] == 16
    monkeypatch.setattr(cli_files.tempfile, "mkstemp", _refuse)
    assert write_hf_config.main(_with(f"--output={tmp_path / 'other.json'}")) == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.startswith(f"write_hf_config: error: --output={tmp_path / 'other.json'}: cannot ")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]


def test_an_output_that_is_a_folder_exits_2_before_the_tokenizer_is_built(
    tmp_path, capsys, monkeypatch
):
    """--output names the file to write: an existing folder there is refused in one line, exit
    2, before the tokenizer is built and with the folder untouched. Planted: the is_dir check
    dropped (the tokenizer was built, then the write failed renaming over the folder)."""
    (tmp_path / "keep.txt").write_text("kept")

    def built(*args, **kwargs):
        raise AssertionError("the tokenizer was built for a command that must be refused")

    monkeypatch.setattr(gen_tiny_model.llama3_tokenizer, "build_tokenizer", built)
    assert main([f"--output={tmp_path}", *VALID]) == 2
    err = capsys.readouterr().err
    assert (
        err
        == f"gen_tiny_model: error: --output={tmp_path} is a directory; name the file to write\n"
    )
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]
