"""Stop strings of a text AR request (OpenAI's ``stop``): the reply ends before the first
occurrence of any of them, and no one downstream ever sees text past that point.

:class:`StopStringMatcher` watches one request's generated tokens through the stage's
tokenizer (:class:`TokenText`). A token is *held* while any of its text could still be the
start of a stop string (a suffix of the held text is a prefix of one), or while the text
ends inside a character (a byte token), and *released* as soon as it cannot; the AR stage
streams only released tokens (:class:`~omnistage.scheduling.ar.ARScheduler`), so every
consumer of the stream (the text decoder, a talker voicing the reply) gets the same tokens
and none of them past the stop. The hold-back is per token, the unit the stream carries.

When a stop string appears, the reply is the text before it: the held tokens whose text lies
wholly before it are kept, and the text before the stop string inside the next token (the
stop string may start mid-token) is re-tokenized as the reply's *tail* (:class:`StopMatch`),
so the kept tokens and the tail decode to exactly the text before the stop string.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

REPLACEMENT_CHAR = "\ufffd"  # what a decoder shows for a character cut between tokens


class TokenText(Protocol):
    """A tokenizer's text view of token ids (e.g. Hugging Face's ``decode(ids,
    skip_special_tokens=True)`` and ``encode(text, add_special_tokens=False)``)."""

    def decode(self, token_ids: list[int]) -> str:
        """The text of ``token_ids`` (special tokens left out)."""

    def encode(self, text: str) -> list[int]:
        """Token ids whose :meth:`decode` is ``text``."""


@dataclass(frozen=True)
class TokenizerText:
    """A Hugging Face tokenizer (``PreTrainedTokenizerBase``) as :class:`TokenText`: special
    tokens are left out of the text and not added to it."""

    tokenizer: PreTrainedTokenizerBase

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)


@dataclass(frozen=True)
class StopMatch:
    """A stop string was found.

    Attributes:
        kept: held tokens that stay in the reply (released with the match), in order.
        tail: token ids of the reply's text before the stop string that is not in the kept
            tokens (the start of the token the stop string begins in), re-tokenized; empty
            when the stop string begins at a token boundary.
    """

    kept: int
    tail: list[int]


class StopStringMatcher:
    """One request's stop strings over its generated tokens (module docstring).

    Args:
        stops: the stop strings (each non-empty).
        token_text: the stage's tokenizer.

    Raises:
        ValueError: no stop string, or an empty one.
    """

    def __init__(self, stops: tuple[str, ...], token_text: TokenText) -> None:
        if not stops or not all(stops):
            raise ValueError(f"stop strings must be non-empty, got {stops!r}")
        self.stops, self.token_text = stops, token_text
        self.held: list[int] = []  # tokens not yet released, in order

    def push(self, token: int) -> int | StopMatch:
        """Take the next generated token.

        Returns:
            how many of the oldest held tokens are released now (0 or more), or the
            :class:`StopMatch` when the held text holds a stop string (the request ends).
        """
        self.held.append(token)
        text = self.token_text.decode(self.held)
        # a character still being spelled shows as one last REPLACEMENT_CHAR that is not
        # its text: a stop string (one holding U+FFFD too) is looked for before it
        spelled = text[:-1] if text.endswith(REPLACEMENT_CHAR) else text
        found = [i for i in (spelled.find(stop) for stop in self.stops) if i >= 0]
        if found:
            end = min(found)
            kept = self._tokens_within(text[:end])
            kept_text = self.token_text.decode(self.held[:kept])
            tail = text[len(kept_text) : end]
            return StopMatch(kept, self.token_text.encode(tail) if tail else [])
        if text.endswith(REPLACEMENT_CHAR):
            return 0  # a character is still being spelled: its text is not known yet
        released = self._tokens_within(text[: len(text) - self._stop_prefix_length(text)])
        del self.held[:released]
        return released

    def flush(self) -> int:
        """The request ended without a stop string: every held token is released; returns
        how many."""
        released, self.held = len(self.held), []
        return released

    def _stop_prefix_length(self, text: str) -> int:
        """Characters at the end of ``text`` that could begin a stop string: the longest such
        suffix. Each stop string is tried from its longest candidate down and only above the
        longest found so far, so a held text that is wholly a stop string's prefix (it grows
        with every token while it stays one) costs one comparison, not one per length."""
        longest = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:n]):
                    longest = n
                    break
        return longest

    def _tokens_within(self, prefix: str) -> int:
        """The most held tokens whose text is a prefix of ``prefix`` (and whole characters)."""
        count = 0
        for n in range(1, len(self.held) + 1):
            piece = self.token_text.decode(self.held[:n])
            if len(piece) > len(prefix):
                break
            if prefix.startswith(piece) and not piece.endswith(REPLACEMENT_CHAR):
                count = n
        return count
