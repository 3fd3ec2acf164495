"""NVEsm's tokenizer: transformers' `EsmTokenizer` (same vocabulary, ids and special tokens) that reads residue
letters in either case and refuses a character outside ESM-2's alphabet instead of turning it into `<unk>`.

`EsmTokenizer` maps `"mktayiak"` to `[<cls>, <unk>, <eos>]` (its vocabulary holds upper-case letters only, and a
run of unknown characters becomes one `<unk>`), so a lower-case protein silently gets an embedding of nothing.
Here lower case reads as upper case, whitespace is skipped (as `EsmTokenizer` does), the tokens written in angle
brackets (`<mask>`, `<unk>`, ...) keep their meaning, and any other character raises a one-line `ValueError` naming
it and its position. `AutoTokenizer.from_pretrained(folder, trust_remote_code=True, unknown_residues="unk")` reads
each unknown character as one `<unk>` instead (a load-time option, never saved).

Part of the model's Hub remote code: the converter writes it beside `modeling_nv_esm.py` and points the folder's
tokenizer_config.json `auto_map` at it. Imports only transformers.
"""

from __future__ import annotations

import re
from typing import Any

from transformers import EsmTokenizer

UNKNOWN_RESIDUES = ("error", "unk")


class NVEsmTokenizer(EsmTokenizer):
    """`EsmTokenizer` with ESM-2's alphabet enforced (see the module docstring).

    Args:
        vocab_file: vocab.txt, one token a line in id order.
        unknown_residues: `"error"` (default) raises on a character outside the alphabet; `"unk"` reads each such
            character as one `<unk>`.
        **kwargs: `EsmTokenizer`'s (special tokens, `model_max_length`, ...).
    """

    def __init__(self, vocab_file: str, unknown_residues: str = "error", **kwargs: Any) -> None:
        if unknown_residues not in UNKNOWN_RESIDUES:
            raise ValueError(f"unknown_residues must be one of {UNKNOWN_RESIDUES}, got {unknown_residues!r}.")
        self.unknown_residues = unknown_residues
        super().__init__(vocab_file, **kwargs)
        self.init_kwargs.pop("unknown_residues", None)  # a load-time choice: save_pretrained leaves it out
        # The alphabet: the vocabulary's one-character tokens (20 amino acids, X B U Z O, the gaps '.' and '-').
        self.residue_tokens = frozenset(token for token in self.all_tokens if len(token) == 1)

    def _token_pattern(self) -> re.Pattern[str]:
        """The vocabulary's and the added tokens' multi-character tokens (`<mask>`, `<null_1>`, ...), longest first."""
        words = {token for token in self.all_tokens if len(token) > 1} | set(self.added_tokens_encoder)
        return re.compile("|".join(re.escape(word) for word in sorted(words, key=len, reverse=True)))

    def residue_text(self, text: str) -> str:
        """`text` as the vocabulary spells it: residue letters upper-cased, whitespace and multi-character tokens
        kept, any other character refused (or, with `unknown_residues="unk"`, written as `<unk>`)."""
        if not isinstance(text, str):
            raise TypeError(f"NVEsmTokenizer reads str proteins, got a {type(text).__name__}.")
        pieces, start = [], 0
        for match in [*self._token_pattern().finditer(text), None]:
            end = len(text) if match is None else match.start()
            for position in range(start, end):
                char = text[position]
                upper = char.upper() if char.isascii() else char  # 'ß'.upper() would be 'SS'
                if upper in self.residue_tokens or char.isspace():
                    pieces.append(upper)
                elif self.unknown_residues == "unk":
                    pieces.append(f" {self.unk_token} ")
                else:
                    raise ValueError(self._refusal(text, position))
            if match is not None:
                pieces.append(match.group())
                start = match.end()
        return "".join(pieces)

    def _refusal(self, text: str, position: int) -> str:
        letters = "".join(sorted(token for token in self.residue_tokens if token.isalpha()))
        shown = text if len(text) <= 40 else f"{text[:37]}..."
        return (
            f"{text[position]!r} at position {position + 1} of {shown!r} is not in ESM-2's alphabet ({letters}, "
            "either case; '.' and '-'); pass unknown_residues='unk' to from_pretrained to read it as <unk>."
        )

    def tokenize(self, text: str, **kwargs: Any) -> list[str]:
        """The tokens of `text` (see `residue_text`)."""
        return super().tokenize(self.residue_text(text), **kwargs)


__all__ = ["NVEsmTokenizer"]
