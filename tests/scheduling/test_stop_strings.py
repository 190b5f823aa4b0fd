"""Stop strings over a request's tokens, model-free: a token is released as soon as its
text can no longer begin a stop string, and a stop string (across tokens, mid-token, in the
first token) keeps exactly the text before it, its tokens and a re-tokenized tail."""

from __future__ import annotations

import time

import pytest

from omnistage.scheduling.stop_strings import StopMatch, StopStringMatcher


class PieceText:
    """A tokenizer over a fixed list of text pieces (token id = index); it encodes text one
    character a token (characters are appended as new pieces)."""

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = list(pieces)

    def decode(self, token_ids: list[int]) -> str:
        return "".join(self.pieces[i] for i in token_ids)

    def encode(self, text: str) -> list[int]:
        ids = []
        for char in text:
            if char not in self.pieces:
                self.pieces.append(char)
            ids.append(self.pieces.index(char))
        return ids


def run(pieces: list[str], stops: tuple[str, ...]) -> tuple[list[int | StopMatch], PieceText]:
    text = PieceText(pieces)
    matcher = StopStringMatcher(stops, text)
    verdicts: list[int | StopMatch] = []
    for token in range(len(pieces)):
        verdicts.append(matcher.push(token))
        if isinstance(verdicts[-1], StopMatch):
            break
    else:
        verdicts.append(matcher.flush())
    return verdicts, text


def test_a_token_is_held_only_while_its_text_could_begin_a_stop_string() -> None:
    verdicts, _ = run(["He", "llo w", "or", "ld."], ("world!",))
    # "He": released; "llo w": held ("w" begins "world!"); "or": held ("wor"); "ld.": "world."
    # is not "world!", all three released; flush: nothing left
    assert verdicts == [1, 0, 0, 3, 0]


def test_a_stop_string_across_two_tokens_keeps_the_text_before_it_as_tokens_and_a_tail() -> None:
    verdicts, text = run(["Hi", " there. Bye", "bye now"], ("Byebye",))
    match = verdicts[-1]
    assert verdicts[:-1] == [1, 0] and isinstance(match, StopMatch)
    # "Hi" was released; " there. " is the tail of the token the stop string begins in
    assert match.kept == 0 and text.decode(match.tail) == " there. "


def test_a_stop_string_at_a_token_boundary_has_no_tail() -> None:
    verdicts, _ = run(["one", " two", "STOP", "three"], ("STOP",))
    assert verdicts == [1, 1, StopMatch(kept=0, tail=[])]


def test_a_stop_string_in_the_first_token_leaves_an_empty_reply() -> None:
    verdicts, text = run(["##", "more"], ("#",))
    assert verdicts == [StopMatch(kept=0, tail=[])]
    verdicts, text = run(["ab#cd", "more"], ("#", "cd"))
    (match,) = verdicts
    assert isinstance(match, StopMatch) and match.kept == 0 and text.decode(match.tail) == "ab"


def test_the_earliest_of_several_stop_strings_ends_the_reply() -> None:
    verdicts, text = run(["a", "b", "c", "d"], ("cd", "bc"))
    assert verdicts[:1] == [1] and verdicts[1] == 0
    match = verdicts[2]
    assert match == StopMatch(kept=0, tail=[])


def test_held_tokens_are_kept_when_the_stop_string_follows_them() -> None:
    # "ab" could begin "abc!" and is held; "abc" too; then "abcX" shows the stop string "cX"
    verdicts, text = run(["ab", "c", "X"], ("abc!", "cX"))
    match = verdicts[-1]
    assert verdicts[:2] == [0, 0] and isinstance(match, StopMatch)
    assert match == StopMatch(kept=1, tail=[])


def test_a_reply_that_never_meets_a_stop_string_releases_every_token() -> None:
    pieces = ["x|", "y|", "z"]
    verdicts, _ = run(pieces, ("|stop",))
    assert verdicts == [0, 1, 2, 0] and sum(verdicts) == len(pieces)


def test_a_token_that_ends_inside_a_character_waits_for_the_next() -> None:
    verdicts, _ = run(["ok", "\ufffd", "!"], ("zz",))
    assert verdicts == [1, 0, 2, 0]


def test_a_held_text_that_stays_a_long_stop_strings_prefix_costs_linear_work_per_token() -> None:
    # A client's stop string = a greedy reply it has seen + one more character holds every
    # token; the longest-suffix search tried every length at each token (cubic in the reply:
    # 400 tokens of 100 characters took 5.5 s of the AR stage's thread, 4096 minutes).
    pieces = ["ab" * 50] * 400
    stop = "ab" * 100_000 + "!"
    matcher = StopStringMatcher((stop,), PieceText(pieces))
    started = time.perf_counter()
    verdicts = [matcher.push(token) for token in range(len(pieces))]
    elapsed = time.perf_counter() - started
    assert verdicts == [0] * len(pieces) and matcher.flush() == len(pieces)
    assert elapsed < 2.0, f"{elapsed:.2f} s for {len(pieces)} held tokens"


class ByteText:
    """A byte-level tokenizer: token id = one UTF-8 byte; a cut character decodes as U+FFFD."""

    def decode(self, token_ids: list[int]) -> str:
        return bytes(token_ids).decode("utf-8", errors="replace")

    def encode(self, text: str) -> list[int]:
        return list(text.encode())


def test_a_replacement_char_stop_string_is_not_met_by_a_character_still_being_spelled() -> None:
    # "é" is two byte tokens; after the first the text shows U+FFFD, which the reply never
    # holds: the stop "\ufffd" cut the reply "aé" to "a"
    matcher = StopStringMatcher(("\ufffd",), ByteText())
    assert [matcher.push(token) for token in "aé".encode()] == [1, 0, 2]
    # a byte that no character continues is U+FFFD in the reply: there the stop is met
    matcher = StopStringMatcher(("\ufffd",), ByteText())
    assert [matcher.push(token) for token in b"a\xffb"] == [1, 0, StopMatch(0, [])]


@pytest.mark.parametrize("stops", [(), ("",), ("a", "")])
def test_empty_stop_strings_are_refused(stops) -> None:
    with pytest.raises(ValueError, match="non-empty"):
        StopStringMatcher(stops, PieceText([]))
