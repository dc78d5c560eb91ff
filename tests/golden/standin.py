"""A stand-in tokenizer for template goldens, shared by LLaMA-Factory's side (``make_template_goldens.py``) and
ferry's side (``tests/trainer/test_templates_golden.py``). Standard library only.

Its "token ids" are texts: every registered special token (BOS, EOS, pad, the additional special tokens that a
template registers) is one token, every other character is one token. So a rendering is read back exactly by
joining the ids, truncation by ``cutoff_len`` counts characters, and the same conversation tokenises the same on
both sides whatever transformers version is installed.
"""

from __future__ import annotations

import re

#: Tokenizer profiles of the goldens: (BOS, EOS), the pad token is always "<pad>".
PROFILES: dict[str, tuple[str | None, str]] = {
    "llama2": ("<s>", "</s>"),  # a SentencePiece-style base tokenizer with BOS
    "qwen": (None, "<|im_end|>"),  # no BOS, ChatML end of turn as EOS
    "llama3": ("<|begin_of_text|>", "<|eot_id|>"),
}


class StandInTokenizer:
    """Enough of ``transformers.PreTrainedTokenizer`` for LLaMA-Factory's and ferry's template code."""

    def __init__(self, bos_token: str | None, eos_token: str | None, pad_token: str | None = "<pad>"):
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.pad_token = pad_token
        self.additional_special_tokens: list[str] = []
        self.chat_template: str | None = None
        self.padding_side = "right"

    # ids are the token texts themselves
    @property
    def bos_token_id(self) -> str | None:
        return self.bos_token

    @property
    def eos_token_id(self) -> str | None:
        return self.eos_token

    @property
    def pad_token_id(self) -> str | None:
        return self.pad_token

    def _specials(self) -> list[str]:
        toks = {t for t in (self.bos_token, self.eos_token, self.pad_token) if t}
        toks.update(self.additional_special_tokens)
        return sorted(toks, key=lambda t: (-len(t), t))

    def add_special_tokens(self, tokens: dict, replace_additional_special_tokens: bool = True) -> int:
        for key, value in tokens.items():
            if key == "additional_special_tokens":
                if replace_additional_special_tokens:
                    self.additional_special_tokens = []
                self.additional_special_tokens += [v for v in value if v not in self.additional_special_tokens]
            else:
                setattr(self, key, value)
        return 0

    def encode(self, text: str, add_special_tokens: bool = False, **_: object) -> list[str]:
        specials = self._specials()
        if not specials:
            return list(text)
        pieces = re.split("(" + "|".join(re.escape(s) for s in specials) + ")", text)
        out: list[str] = []
        for i, piece in enumerate(pieces):
            if i % 2:
                out.append(piece)
            else:
                out += list(piece)
        return out

    def convert_tokens_to_ids(self, token: str) -> str:
        return token

    def decode(self, ids: list[str], **_: object) -> str:
        return "".join(ids)


def runs(input_ids: list[str], labels: list) -> list[list]:
    """``[[text, flag], ...]``: maximal runs of tokens; ``flag`` is ``True`` (trained on its own token),
    ``False`` (label -100) or, for a single token whose label is another token (LLaMA-Factory's ``efficient_eos``
    trains the EOS at the first position of the next prompt), that label's text."""
    out: list[list] = []
    for tok, lab in zip(input_ids, labels):
        flag = False if lab == -100 else (True if lab == tok else lab)
        if out and out[-1][1] is flag and isinstance(flag, bool):
            out[-1][0] += tok
        else:
            out.append([tok, flag])
    return out
