"""What a started vLLM server serves and how: :class:`ServerConfig` and the argv it becomes.

The launcher owns host, port and the flags the suite has options for; extra arguments
that set one of them are refused instead of being silently overridden (argparse keeps
the last value). A model directory that lacks tokenizer files or carries a vision tower
gets the flags it needs to be served from its config alone.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import ServerError
from ..files import UnreadableFile, read_json

__all__ = ["ServerConfig", "check_extra_args", "implied_args", "redacted", "vocab_size"]

# Flags the launcher sets itself, and what to use instead: in extra arguments they
# would silently override (argparse keeps the last) or fight with ours.
_OWNED_FLAGS = {
    "--host": "the server always listens on 127.0.0.1",
    "--port": "a free port is picked",
    "--uds": "the server listens on TCP 127.0.0.1",
    "--model": "set the model (pytest: --server-model)",
    "--tensor-parallel-size": "set the TP size (pytest: --server-tp)",
    "-tp": "set the TP size (pytest: --server-tp)",
    "--load-format": "set the load format (pytest: --load-format)",
    "--max-model-len": "set it (pytest: --max-model-len)",
    "--max-num-seqs": "set it (pytest: --max-num-seqs)",
    "--api-key": "set the key (pytest: --vllm-api-key)",
}
# Files any of which means a checkpoint directory carries a tokenizer.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "tiktoken.model", "vocab.json")


@dataclass(frozen=True)
class ServerConfig:
    """What to serve and how; :meth:`argv` turns it into the launcher's argument list.

    ``model`` is a checkpoint (or config-only) directory or a hub id, passed to vLLM as is.
    ``extra_args`` go last, verbatim; flags the launcher owns are refused (see
    :func:`check_extra_args`).

    >>> ServerConfig("/m", max_num_seqs=4).argv(["python", "-m", "x"], "127.0.0.1", 8000)[3:7]
    ['--model', '/m', '--host', '127.0.0.1']
    """

    model: str
    tensor_parallel_size: int = 1
    load_format: str = "dummy"
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    kv_cache_memory_bytes: int | None = None
    api_key: str | None = None
    extra_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        check_extra_args(self.extra_args)

    def served_vocab_size(self) -> int | None:
        """The vocabulary the server serves: ``--hf-overrides``' vocab_size where the extra arguments set one
        (one rank of TP N serves 1/N of it), else the model directory's; prompts draw token ids below it.

        >>> ServerConfig("decodebench/models/tiny-kimi", extra_args=("--hf-overrides", '{"vocab_size": 512}')
        ...              ).served_vocab_size()
        512
        """
        for flag, value in zip(self.extra_args, self.extra_args[1:], strict=False):
            if flag == "--hf-overrides":
                overrides = json.loads(value)
                nested = overrides.get("text_config")
                vocab = (nested if isinstance(nested, dict) else overrides).get("vocab_size")
                if isinstance(vocab, int):
                    return vocab
        return vocab_size(self.model)

    def argv(self, launcher: Sequence[str], host: str, port: int) -> list[str]:
        argv = [*launcher, "--model", self.model, "--host", host, "--port", str(port),
                "--tensor-parallel-size", str(self.tensor_parallel_size), "--load-format", self.load_format]
        optional = {"--max-model-len": self.max_model_len, "--max-num-seqs": self.max_num_seqs,
                    "--kv-cache-memory-bytes": self.kv_cache_memory_bytes, "--api-key": self.api_key}
        for flag, value in optional.items():
            if value is not None and not _mentions(self.extra_args, flag):
                argv += [flag, str(value)]
        argv += [a for a in implied_args(self.model) if not _mentions(self.extra_args, a)]
        return argv + list(self.extra_args)


def check_extra_args(args: Iterable[str]) -> None:
    """Refuse extra server arguments that set what the launcher owns (host, port, model, ...).

    >>> check_extra_args(["--enforce-eager", "--block-size", "16"])
    >>> check_extra_args(["--port=9000"])
    Traceback (most recent call last):
    ...
    decodebench.errors.ServerError: extra server argument '--port=9000' conflicts: a free port is picked
    """
    for arg in args:
        flag = arg.split("=", 1)[0]
        if flag in _OWNED_FLAGS:
            raise ServerError(f"extra server argument {arg!r} conflicts: {_OWNED_FLAGS[flag]}")


def implied_args(model: str) -> list[str]:
    """Flags a model directory needs to serve from its config alone.

    No tokenizer files: ``--skip-tokenizer-init`` (prompts are token ids anyway). A
    vision-language config (``vision_config``, as Kimi-K2.5's): ``--language-model-only``,
    which skips the vision tower and its processor; decode never runs them.

    >>> implied_args("decodebench/models/kimi-k2.5")
    ['--skip-tokenizer-init', '--language-model-only']
    """
    directory = Path(model)
    if not (directory / "config.json").is_file():
        return []  # a hub id or an unusual layout: vLLM decides
    args = []
    if not any((directory / name).is_file() for name in _TOKENIZER_FILES):
        args.append("--skip-tokenizer-init")
    if "vision_config" in _read_config(directory):
        args.append("--language-model-only")
    return args


def vocab_size(model: str) -> int | None:
    """``vocab_size`` of a model directory's config.json (``text_config`` first), or None.

    >>> vocab_size("decodebench/models/tiny-kimi"), vocab_size("moonshotai/Kimi-K2.5")
    (1024, None)
    """
    directory = Path(model)
    if not (directory / "config.json").is_file():
        return None
    config = _read_config(directory)
    text = config.get("text_config")
    value = (text if isinstance(text, dict) else config).get("vocab_size")
    return value if isinstance(value, int) else None


def _read_config(directory: Path) -> dict:
    try:
        config = read_json(directory / "config.json")
    except UnreadableFile as exc:
        raise ServerError(str(exc)) from exc
    return config if isinstance(config, dict) else {}


def redacted(argv: Sequence[str]) -> list[str]:
    """``argv`` with the value of ``--api-key`` masked, for logs and stored results.

    >>> redacted(["serve", "--api-key", "s3cret", "--api-key=s3cret"])
    ['serve', '--api-key', '***', '--api-key=***']
    """
    masked = []
    for arg in argv:
        secret = masked[-1:] == ["--api-key"]
        masked.append("***" if secret else "--api-key=***" if arg.startswith("--api-key=") else arg)
    return masked


def _mentions(args: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)
