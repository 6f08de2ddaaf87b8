"""Text <-> token ids, from a tokenizer.json folder or from the vocabulary stored in a GGUF.

Both build a `tokenizers.Tokenizer`. For a GGUF the byte-level BPE is rebuilt from
`tokenizer.ggml.tokens` and `tokenizer.ggml.merges`, with the pre-tokenizer llama.cpp uses for
the file's `tokenizer.ggml.pre`, and control tokens kept whole.
BOS is added by this class (never by the backend's post-processor), as the checkpoint says.
"""

import functools
import json
import os
import pathlib
from collections.abc import Iterable

import numpy as np
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

from pipelines.llama3.gguf_file import GGUFFile
from pipelines.llama3.gguf_loader import CheckpointError, metadata_value, open_gguf

# Pre-tokenizer regexes, from llama.cpp's llama-vocab.cpp (by tokenizer.ggml.pre).
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_PRE_TYPES = frozenset({"llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx", "falcon3"})
# GPT-2's own split (tokenizers' ByteLevel use_regex), with every digit split off first.
DIGITS_THEN_GPT2_PRE_TYPES = frozenset(
    {"smollm", "starcoder", "refact", "codeshell", "command-r", "exaone"}
)
GPT2_PRE_TYPES = frozenset({"gpt2", "default"})
KNOWN_PRE_TYPES = LLAMA3_PRE_TYPES | DIGITS_THEN_GPT2_PRE_TYPES | GPT2_PRE_TYPES

TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map that byte-level vocabularies are spelled in."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, (chr(c) for c in chars), strict=True))


_BYTE_ALPHABET = _byte_alphabet()


def _pre_tokenizer(pre_type: str) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer of a `tokenizer.ggml.pre` in KNOWN_PRE_TYPES."""
    if pre_type in LLAMA3_PRE_TYPES:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    if pre_type in DIGITS_THEN_GPT2_PRE_TYPES:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)  # GPT2_PRE_TYPES


class Tokenizer:
    def __init__(
        self, backend: BackendTokenizer, bos_id: int | None, eos_ids: Iterable[int], add_bos: bool
    ) -> None:
        self.backend = backend
        self.bos_id = bos_id
        self.eos_ids: set[int] = set(eos_ids)
        self.add_bos = add_bos and bos_id is not None

    def copy(self) -> "Tokenizer":
        """A tokenizer with its own BOS/EOS settings over the same (shared) backend."""
        return Tokenizer(self.backend, self.bos_id, self.eos_ids, self.add_bos)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`; BOS first when `add_bos` (default: as the checkpoint says)."""
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if self.add_bos if add_bos is None else add_bos:
            if self.bos_id is None:
                raise ValueError("this tokenizer has no BOS token")
            ids = [self.bos_id, *ids]
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self) -> tuple[list[bytes], set[int]]:
        """(each id's bytes, the special ids): a byte-level token's bytes are its spelling in
        GPT-2's byte alphabet read back (a token may hold part of a UTF-8 character); an
        added token's are its text; a special (control) token's its name, never text."""
        return _token_bytes(self.backend)

    @classmethod
    def from_gguf(cls, path: str | os.PathLike) -> "Tokenizer":
        return cls.from_gguf_reader(open_gguf(path), path)

    @classmethod
    def from_gguf_reader(cls, reader: GGUFFile, path: str | os.PathLike) -> "Tokenizer":
        path = pathlib.Path(path)
        model = metadata_value(reader, "tokenizer.ggml.model")
        if model != "gpt2":
            raise CheckpointError(
                path,
                f"tokenizer.ggml.model {model!r} is not supported (only 'gpt2', byte-level BPE)",
            )
        tokens: tuple[str, ...] = metadata_value(reader, "tokenizer.ggml.tokens")
        merges: tuple[str, ...] = metadata_value(reader, "tokenizer.ggml.merges")
        if not tokens or merges is None:
            raise CheckpointError(path, "tokenizer.ggml.tokens or tokenizer.ggml.merges is missing")
        token_types = metadata_value(reader, "tokenizer.ggml.token_type")
        token_types = np.ones(len(tokens), np.int32) if token_types is None else token_types
        if len(token_types) != len(tokens):
            raise CheckpointError(
                path,
                f"tokenizer.ggml.token_type has {len(token_types)} entries, "
                f"tokenizer.ggml.tokens {len(tokens)}",
            )

        pre_type = metadata_value(reader, "tokenizer.ggml.pre", "default")
        if pre_type not in KNOWN_PRE_TYPES:
            raise CheckpointError(
                path,
                f"tokenizer.ggml.pre {pre_type!r} is not supported "
                f"(known: {', '.join(sorted(KNOWN_PRE_TYPES))})",
            )
        types = np.asarray(token_types, dtype=np.int32).tobytes()
        backend = _backend(tokens, merges, types, pre_type)
        bos_id = metadata_value(reader, "tokenizer.ggml.bos_token_id")
        eos_id = metadata_value(reader, "tokenizer.ggml.eos_token_id")
        eot_id = metadata_value(
            reader, "tokenizer.ggml.eot_token_id"
        )  # Llama 3 Instruct's <|eot_id|>
        add_bos = metadata_value(reader, "tokenizer.ggml.add_bos_token")
        return cls(
            backend,
            bos_id=None if bos_id is None else int(bos_id),
            eos_ids={int(i) for i in (eos_id, eot_id) if i is not None},
            add_bos=bool(add_bos) if add_bos is not None else bos_id is not None,
        )

    @classmethod
    def from_folder(cls, folder: str | os.PathLike) -> "Tokenizer":
        """A Hugging Face tokenizer folder: tokenizer.json; tokenizer_config.json for BOS/EOS."""
        folder = pathlib.Path(folder)
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(
                f"{tokenizer_file} not found: expected a Hugging Face tokenizer folder"
            )
        backend = BackendTokenizer.from_file(str(tokenizer_file))
        settings = {}
        if (folder / "tokenizer_config.json").is_file():
            settings = json.loads((folder / "tokenizer_config.json").read_text())

        def token_id(entry: object) -> int | None:
            content = entry.get("content") if isinstance(entry, dict) else entry
            return None if content is None else backend.token_to_id(content)

        bos_id = token_id(settings.get("bos_token"))
        eos_ids = {i for i in [token_id(settings.get("eos_token"))] if i is not None}
        if (folder / "generation_config.json").is_file():
            generation = json.loads((folder / "generation_config.json").read_text())
            extra = generation.get("eos_token_id", [])
            eos_ids |= set(extra if isinstance(extra, list) else [extra])
        add_bos = settings.get("add_bos_token")
        if add_bos is None and bos_id is not None:
            # Llama 3's tokenizer.json adds BOS in its post-processor rather than saying so.
            add_bos = backend.encode("a", add_special_tokens=True).ids[:1] == [bos_id]
        return cls(backend, bos_id=bos_id, eos_ids=eos_ids, add_bos=bool(add_bos))


# Built backends by their GGUF inputs (an LRU of a few): the tiny checkpoints of every
# encoding share Llama 3's 128k-token vocabulary, and building its BPE model takes ~0.3 s.
# Backends are never mutated after the build (Tokenizer.copy shares one), so a cached one is
# handed out as is.
@functools.lru_cache(maxsize=4)
def _backend(
    tokens: tuple[str, ...], merges: tuple[str, ...], types: bytes, pre_type: str
) -> BackendTokenizer:
    """The byte-level BPE backend of a GGUF vocabulary (`types`: token types as int32 bytes,
    `pre_type` one of KNOWN_PRE_TYPES), built once per distinct vocabulary."""
    token_types = np.frombuffer(types, dtype=np.int32)
    # Tokens and merges as the file spells them, as llama.cpp reads them: a normal token that
    # a converter stored in plain UTF-8 ("€" rather than the byte alphabet's "â‚¬") is never
    # the result of encoding text, a merge naming it only joins it to another such token, and
    # an added token keeps its own id, whatever its characters.
    vocab = dict(zip(tokens, range(len(tokens)), strict=True))
    # Byte-level merges hold exactly one space ("Ġ" spells a space inside a token).
    parts = " ".join(merges).split(" ")
    if len(parts) == 2 * len(merges):
        pairs = list(zip(parts[0::2], parts[1::2], strict=True))
    else:
        pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    backend = BackendTokenizer(
        models.BPE(
            vocab, pairs, ignore_merges=pre_type in LLAMA3_PRE_TYPES
        )  # llama.cpp does the same
    )
    backend.pre_tokenizer = _pre_tokenizer(pre_type)
    backend.decoder = decoders.ByteLevel()
    # Control tokens (<|begin_of_text|>, <|im_start|>...) match whole in text, never split.
    control = [tokens[i] for i in np.flatnonzero(token_types == TOKEN_TYPE_CONTROL)]
    backend.add_special_tokens(
        [AddedToken(token, special=True, normalized=False) for token in control]
    )
    backend.add_tokens(
        [
            AddedToken(tokens[i], special=False, normalized=False)
            for i in np.flatnonzero(token_types == TOKEN_TYPE_USER_DEFINED)
        ]
    )
    return backend


# str.translate's table reading GPT-2's alphabet back: each of its characters to the Latin-1
# character of its byte, every other character up to the alphabet's last to one Latin-1 cannot
# encode (characters above it stay above Latin-1): a spelling that encodes as Latin-1 after it
# is all alphabet, and its bytes are the encoding.
_NOT_LATIN1 = chr(0x10FFFF)
_READ_BACK = {code: _NOT_LATIN1 for code in range(ord(max(_BYTE_ALPHABET.values())) + 1)}
_READ_BACK.update({ord(char): chr(byte) for byte, char in _BYTE_ALPHABET.items()})


@functools.lru_cache(maxsize=4)
def _token_bytes(backend: BackendTokenizer) -> tuple[list[bytes], set[int]]:
    added = backend.get_added_tokens_decoder()
    tokens = []
    for index in range(backend.get_vocab_size(with_added_tokens=True)):
        spelled = backend.id_to_token(index) or ""
        if index in added:
            tokens.append(spelled.encode())
            continue
        # the alphabet read back in C: Llama 3's 128k tokens in 0.10 s (0.24 s char by char)
        try:
            tokens.append(spelled.translate(_READ_BACK).encode("latin-1"))
        except UnicodeEncodeError:  # a character outside the alphabet: the text's own bytes
            tokens.append(spelled.encode())
    return tokens, {index for index, token in added.items() if token.special}
