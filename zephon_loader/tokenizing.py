"""The tokenizer folder: checked, loaded once in the driver, its special ids read.

Tokenizers are local folders written by ``save_pretrained`` — never hub ids,
which cannot resolve offline (Zephon would retry with backoff, then fail).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from zephon_loader.config.schema import INLINE_MAX_CORES, available_cores
from zephon_loader.errors import field_error as _err

__all__ = ["TOKENIZERS_PARALLELISM", "SharedTokenizer", "check_token_id", "check_tokenizer_dir",
           "fit_tokenizer_threads", "load_tokenizer", "pad_token_id_of"]

_log = logging.getLogger("zephon_loader")

#: The environment variable that switches the ``tokenizers`` library's own thread pool on or off for the
#: process. The library reads it at every batch call, so setting it takes effect at once.
TOKENIZERS_PARALLELISM = "TOKENIZERS_PARALLELISM"

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def pad_token_id_of(tokenizer: Any) -> int | None:
    """The pad id a tokenizer implies for packing: its pad token, else its EOS; None when it has neither."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def check_tokenizer_dir(where: str, path: Path) -> Path:
    """A local folder that holds a saved tokenizer.

    Args:
        where: The config location for messages (``tokenizer.path``).
        path: The resolved folder.

    Raises:
        ValueError: Not an existing folder (a hub id lands here), or no tokenizer file in it.
    """
    raw = os.fspath(path)
    if not path.is_dir():
        hint = (
            "A hub id cannot resolve offline (Zephon would retry with backoff, then fail); "
            "download it once and pass the local directory written by save_pretrained(dir)."
            if not path.exists()
            else "Pass the directory that holds tokenizer.json / tokenizer_config.json."
        )
        raise ValueError(_err(where, raw, "an existing local tokenizer directory", hint))
    if not any((path / name).is_file() for name in _TOKENIZER_FILES):
        raise ValueError(
            _err(where, raw, f"a directory containing one of {list(_TOKENIZER_FILES)}",
                 "Write it with transformers' save_pretrained(dir).")
        )
    return path


def fit_tokenizer_threads(cores: int | None = None) -> bool:
    """On a machine of at most :data:`~zephon_loader.config.schema.INLINE_MAX_CORES` cores, switch the
    ``tokenizers`` library's own thread pool off for this process, unless its environment already decides.

    A fast tokenizer spreads each batch call over a pool of one thread per core whose idle workers spin
    before they sleep. On two cores those threads take the cores from Zephon's engine and the training
    loop, which wait on Python's lock rather than on the tokenizer: the demo pipeline (B=4, S=256) ran at
    ~170k tokens/s with the pool and ~200k without it, with 45,000 involuntary context switches per four
    passes against 300 (``benchmarks/bench_loader.py``; README "Loader overhead"). Encoding gives the same
    ids either way. With more cores the pool is left alone, and so is any value the environment has
    (``TOKENIZERS_PARALLELISM=true`` keeps the pool on two cores).

    The switch is the environment variable :data:`TOKENIZERS_PARALLELISM` (the library's only one), so it
    holds for every tokenizer of the process, and for worker processes started afterwards.

    Args:
        cores: The cores this process may use (default: :func:`~zephon_loader.config.schema.available_cores`).

    Returns:
        Whether this call switched the pool off.
    """
    if TOKENIZERS_PARALLELISM in os.environ:
        return False
    cores = available_cores() if cores is None else cores
    if cores > INLINE_MAX_CORES:
        return False
    os.environ[TOKENIZERS_PARALLELISM] = "false"
    _log.info("zephon_loader: %d core(s): the tokenizers library's thread pool is switched off for this process "
              "(%s=false; set it to true before building the loader to keep the pool)", cores,
              TOKENIZERS_PARALLELISM)
    return True


#: Oldest transformers major that loads the bundled and saved tokenizer folders
#: (their ``tokenizer_config.json`` names ``TokenizersBackend``, a transformers 5 class).
MIN_TRANSFORMERS_MAJOR = 5


def load_tokenizer(path: Path, **options: Any) -> Any:
    """Load in the driver, offline: to validate, read special-token ids, and hand to Zephon's ``tokenize``.

    Raises:
        ImportError: transformers missing or older than 5.
        ValueError: The folder does not load (the message carries transformers' reason).
    """
    try:
        import transformers
    except Exception as exc:  # pragma: no cover - optional extra
        raise ImportError("tokenizer folders need transformers >= 5: pip install 'zephon-loader[hf]'") from exc
    major = int(transformers.__version__.split(".")[0])
    if major < MIN_TRANSFORMERS_MAJOR:
        raise ImportError(
            f"transformers: got {transformers.__version__}, expected >= {MIN_TRANSFORMERS_MAJOR} (tokenizer folders "
            f"saved by transformers 5 name the TokenizersBackend class). Fix: pip install 'transformers>=5'."
        )
    try:
        if _is_generic_fast_tokenizer(path):
            # What AutoTokenizer resolves this folder to, without its model registry: importing
            # transformers.models scans every model's source for its exports (~0.5-1 s per process).
            return transformers.TokenizersBackend.from_pretrained(str(path), local_files_only=True, **options)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(path), local_files_only=True, use_fast=True, **options)
    except Exception as exc:
        raise ValueError(
            _err("tokenizer", str(path), "a directory AutoTokenizer.from_pretrained can load offline",
                 f"It failed with {type(exc).__name__}: {exc}. Re-save it with save_pretrained(dir).")
        ) from exc


#: ``tokenizer_class`` values of a folder AutoTokenizer loads as the generic fast tokenizer (the same class).
GENERIC_FAST_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def _is_generic_fast_tokenizer(path: Path) -> bool:
    """True when ``path``'s ``tokenizer_config.json`` names the generic fast class and ``tokenizer.json`` is there.

    AutoTokenizer then loads exactly ``TokenizersBackend``; any other folder (a model-specific class, remote code in
    ``auto_map``, no ``tokenizer_config.json``, one that does not parse) goes through AutoTokenizer.
    """
    try:
        config = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return (isinstance(config, dict) and config.get("tokenizer_class") in GENERIC_FAST_TOKENIZER_CLASSES
            and "auto_map" not in config and (path / "tokenizer.json").is_file())


def check_token_id(where: str, value: int, vocab: int) -> None:
    """Raise when a configured token id is outside the tokenizer's vocabulary."""
    if not 0 <= value < vocab:
        raise ValueError(_err(where, value, f"an id in [0, {vocab}) (this tokenizer's vocabulary)",
                              "Use an id of this tokenizer."))


class SharedTokenizer:
    """The loader's tokenizer as Zephon's tokenize operator holds it: one object per process, never copied.

    Zephon's runners ``copy.deepcopy`` their operator at every engine start (each epoch, each resume), and
    a copied fast tokenizer, like a freshly loaded one, keeps native memory and makes tokenizing slower
    pass after pass (600 standard-library files, 8x2048: 2.02M tokens/s in the first pass, 1.69M in the
    tenth, RSS +10 MiB per pass; the same object reused: flat). A deep copy of this wrapper is the
    wrapper itself, so every operator instance of the process calls one tokenizer; a pickle (the
    ``process`` and ``ray`` runners' workers) carries the tokenizer, and each worker process then
    shares its own copy the same way.

    Sharing between Zephon's tokenize threads is safe because the backend's truncation and padding are
    switched off here, once, before any thread calls it: Zephon's text operator calls it with
    ``truncation=False, padding=False`` only (no ``max_length``), which transformers would otherwise
    apply on the first call, from whichever threads race to it; encoding itself only reads the backend.
    Not for Zephon's chat operator, whose setup checks call it with ``truncation=True`` (they would
    switch truncation on under another instance's calls). Everything else (``__call__``, attributes,
    ``len``) is the tokenizer's.

    Args:
        tokenizer: A tokenizer the loader loaded itself (:func:`load_tokenizer`), not a caller's object:
            its backend's truncation and padding are switched off.
    """

    __slots__ = ("tokenizer",)

    def __init__(self, tokenizer: Any) -> None:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:
            if backend.truncation is not None:
                backend.no_truncation()
            if backend.padding is not None:
                backend.no_padding()
        object.__setattr__(self, "tokenizer", tokenizer)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.tokenizer(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(object.__getattribute__(self, "tokenizer"), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.tokenizer, name, value)

    def __len__(self) -> int:
        return len(self.tokenizer)

    def __deepcopy__(self, memo: dict[int, Any]) -> "SharedTokenizer":
        return self

    def __reduce__(self) -> tuple[Any, tuple[Any]]:
        return SharedTokenizer, (self.tokenizer,)

    def __repr__(self) -> str:
        return f"SharedTokenizer({self.tokenizer!r})"
