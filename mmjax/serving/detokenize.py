"""Incremental detokenization for streaming: new text per step, whole UTF-8 characters, stop strings.

Decoding the whole output every step costs O(length) per token. Like vLLM, we decode only a window: the
tokens since `prefix_offset` (already emitted, kept as context) and the new ones after `read_offset`; the new
text is the window's decode minus the prefix's. Byte-level BPE tokens can end inside a multi-byte character
(the decode then ends in U+FFFD), so such tokens are held until the character completes. Text that could
be the start of a stop string is held back until it is known not to be one, so a streaming client never
sees part of a stop string.
"""

from __future__ import annotations

import inspect
import numbers
from collections.abc import Sequence
from typing import Any

REPLACEMENT_CHAR = "\ufffd"  # what a decode shows for an incomplete UTF-8 sequence
PROMPT_CONTEXT_TOKENS = 5  # prompt tokens decoded as context for the first output token (leading spaces)
MAX_PENDING_TOKENS = 4  # a UTF-8 character spans at most 4 bytes: a longer incomplete tail is invalid bytes


class IncrementalDetokenizer:
    """Streams one request's output text.

    `tokenizer` is anything with `decode(ids)` (an `mmjax.data.tokenizer.Tokenizer`, a `tokenizers.Tokenizer`,
    a Hugging Face tokenizer); `skip_special_tokens` is passed on when its `decode` takes it. After a stop
    string `.stopped` is True and later tokens are ignored. When the request ends without one, call
    `flush()` for the text still held back. `.text` is the output so far (emitted plus held back).
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], stop: Sequence[str] = (),
                 include_stop_str: bool = False, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        # a tokenizer with `decodes_text = False` (an engine-core process's: text is the API process's work) has
        # no text to give: every call returns "" at once, the per-token host work of a step it would waste
        self._no_text = getattr(tokenizer, "decodes_text", True) is False
        if self._no_text and any(stop):
            raise ValueError("stop strings need a tokenizer that decodes text")
        self._decode_kwargs = {}
        try:
            if "skip_special_tokens" in inspect.signature(tokenizer.decode).parameters:
                self._decode_kwargs = {"skip_special_tokens": skip_special_tokens}
        except (TypeError, ValueError):  # builtin without a signature (e.g. a Rust binding): try the kwarg
            self._decode_kwargs = {"skip_special_tokens": skip_special_tokens}
        # mmjax's Tokenizer.decode cuts at the first EOS; with special tokens skipped anyway, drop EOS ids
        # first so an EOS in the prompt context (chat turns) or mid-output (ignore_eos) hides no text
        eos = getattr(tokenizer, "eos_id", None)
        self._drop = frozenset([eos]) if skip_special_tokens and isinstance(eos, int) else frozenset()
        self.stop = tuple(s for s in stop if s)
        self.include_stop_str = include_stop_str
        self._max_stop = max((len(s) for s in self.stop), default=0)
        # window: ids[:read] were decoded already (context only), ids[read:] are pending
        self._ids = [] if self._no_text else [int(i) for i in prompt_token_ids[-PROMPT_CONTEXT_TOKENS:]]
        if self._ids and self._decode(self._ids).endswith(REPLACEMENT_CHAR):
            self._ids = []  # the prompt ends inside a character: such context would garble the first text
        self._read = len(self._ids)
        self._text = ""  # decoded output text, including what is held back
        self._emitted = 0  # length of the prefix of _text already returned
        self.stopped = False
        self.stop_str: str | None = None  # the stop string that ended the output

    @property
    def text(self) -> str:
        return self._text

    def _decode(self, ids: Sequence[int]) -> str:
        ids = [i for i in ids if i not in self._drop]
        return self._tokenizer.decode(ids, **self._decode_kwargs) if ids else ""

    def push(self, token_ids: int | Sequence[int]) -> str:
        """Add newly generated tokens; returns only the text that became final since the last call."""
        if self.stopped or self._no_text:
            return ""
        self._ids.extend([int(token_ids)] if isinstance(token_ids, numbers.Integral) else
                         (int(t) for t in token_ids))
        return self._append(self._advance(hold_incomplete=True))

    def push_each(self, token_ids: Sequence[int], last: bool = False) -> list[tuple[list[int], str]]:
        """Add tokens one at a time, for token-granular streaming: per token, ([token], the text it released,
        often "" while a character or a possible stop string is incomplete). The list ends at the token that
        completes a stop string (later ones are dropped: the output ends there). `last`: the request ended with
        these tokens, so the text still held back joins the last piece (a piece of no tokens if none came). A
        tokenizer without text gives one piece of every token and no text."""
        if self._no_text:
            return [(list(token_ids), "")] if len(token_ids) else []
        pieces: list[tuple[list[int], str]] = []
        for token in token_ids:
            pieces.append(([int(token)], self.push(token)))
            if self.stopped:
                return pieces
        rest = self.flush() if last else ""
        if rest and pieces:
            pieces[-1] = (pieces[-1][0], pieces[-1][1] + rest)
        elif rest:
            pieces.append(([], rest))
        return pieces

    def _advance(self, hold_incomplete: bool) -> str:
        """Text of the pending tokens, all but those of a trailing incomplete character when
        `hold_incomplete`; the tokens read become the context of the next window."""
        n = len(self._ids)
        prefix_text = self._decode(self._ids[:self._read])
        full, split = self._decode(self._ids), n
        if hold_incomplete and full.endswith(REPLACEMENT_CHAR):
            # hold back the fewest trailing tokens that leave complete text; a longer incomplete tail than
            # one character's bytes is invalid output and is released as it decodes
            for j in range(1, min(MAX_PENDING_TOKENS, n - self._read) + 1):
                text = self._decode(self._ids[:n - j])
                if not text.endswith(REPLACEMENT_CHAR):
                    full, split = text, n - j
                    break
            else:
                if n - self._read <= MAX_PENDING_TOKENS:
                    return ""  # the character may still complete
        new = full[len(prefix_text):]
        self._ids = self._ids[self._read:]
        self._read = split - (n - len(self._ids))
        return new

    def _append(self, new: str) -> str:
        start = max(0, len(self._text) - self._max_stop + 1)  # a stop may begin in the held-back tail
        self._text += new
        if self.stop:
            hits = [(i, s) for s in self.stop if (i := self._text.find(s, start)) >= 0]
            if hits:
                i, s = min(hits)
                self.stopped, self.stop_str = True, s
                self._text = self._text[:i + len(s) if self.include_stop_str else i]
                return self._release(len(self._text))
        return self._release(len(self._text) - self._partial_stop_len())

    def _partial_stop_len(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of some stop string."""
        text = self._text
        for n in range(min(self._max_stop - 1, len(text)), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0

    def _release(self, end: int) -> str:
        end = max(end, self._emitted)
        out = self._text[self._emitted:end]
        self._emitted = end
        return out

    def flush(self) -> str:
        """The request ended without a stop string: return everything still held back (a partial stop
        string, or the bytes of an incomplete character, decoded as they are)."""
        if self._no_text:
            return ""
        out = ""
        if not self.stopped and self._read < len(self._ids):
            out = self._append(self._advance(hold_incomplete=False))
        return out if self.stopped else out + self._release(len(self._text))
