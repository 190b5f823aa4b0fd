"""English text preparation for Piper: normalization and sentence segmentation.

Piper voices phonemize with espeak-ng, which already reads most English numbers well:
cardinals with thousands separators ("1,000,000"), decimals ("3.14" -> "three point one
four"), percentages ("25%"), ordinals ("21st"), negative numbers and clock times such as
"3:30". :func:`normalize_text` therefore only rewrites what the espeak-ng bundled with
piper-tts 1.8.0 was observed (by reading its phonemes) to mis-read:

==========================  ==================================  ===========================
input                       espeak-ng alone                     after :func:`normalize_text`
==========================  ==================================  ===========================
``$5.50`` / ``€20``         "dollar five point five zero"       "5 dollars 50 cents"
``Dr. Smith``, ``Mr. X``    "doctor." (ends the sentence)       "Doctor Smith", "Mister X"
``St. Louis``               "saint." (ends the sentence)        "Saint Louis"
``Jr.`` / ``Sr.``           "J R" / "S R"                       "Junior" / "Senior"
``No. 5``, ``#5``           "no." (ends the sentence), "hash"   "number 5"
``10:00``, ``3:05``         "ten zero zero", "three zero five"  "10 o'clock", "3 oh 5"
``1990s``, ``'80s``         "nineteen hundred ninety s"         "19 nineties", "eighties"
``in 1990``                 "nineteen hundred ninety"           "in 19 90" (nineteen ninety)
==========================  ==================================  ===========================

Everything else is left to espeak-ng. :func:`split_sentences` cuts normalized text into
sentences that are synthesized one by one (and can be batched).
"""

from __future__ import annotations

import re

from omnistage.core.errors import RequestValidationError

__all__ = ["normalize_text", "split_sentences"]

# ----------------------------------------------------------------------------- normalize

_HSPACE = re.compile(r"[^\S\n]+")
_BLANK_LINES = re.compile(r"\s*\n\s*")

# Titles expanded only when a capitalized word follows, so their period cannot end a sentence.
_TITLES = {"Mr": "Mister", "Mrs": "Missus", "Ms": "Miz", "Dr": "Doctor", "Prof": "Professor"}
_TITLE = re.compile(r"\b(Mr|Mrs|Ms|Dr|Prof)\.(?=\s+[A-Z])")
# "St." before a name is "Saint"; after a capitalized word ("Main St.") espeak says "street".
_SAINT = re.compile(r"(\b[A-Z][a-z]+\s+)?\bSt\.(?=\s+[A-Z])")
_SUFFIX = re.compile(r"(\b[A-Z][a-z]+,?\s+)(Jr|Sr)\.")
_SUFFIXES = {"Jr": "Junior", "Sr": "Senior"}
_SENTENCE_START = re.compile(r"(?:^|[.!?:;\n])\s*$")
_NUMBER_SIGN = re.compile(r"\bNo\.\s*(?=\d)|#(?=\d)")

_CURRENCIES = {  # symbol -> (unit, units, subunit, subunits)
    "$": ("dollar", "dollars", "cent", "cents"),
    "€": ("euro", "euros", "cent", "cents"),
    "£": ("pound", "pounds", "penny", "pence"),
}
_MONEY = re.compile(
    r"([$€£])\s?(\d{1,3}(?:,\d{3})+|\d+)(?:\.(\d+))?"
    r"(?:\s+(thousand|million|billion|trillion)\b)?"
)

_OCLOCK = re.compile(r"\b(\d{1,2}):00\b(?!\s*(?:[ap]\.?m\b|[AP]\.?M\b))")
_FULL_HOUR = re.compile(r"\b(\d{1,2}):00\b")
_OH_MINUTE = re.compile(r"\b(\d{1,2}):0([1-9])\b")

_DECADE_WORDS = {
    "2": "twenties", "3": "thirties", "4": "forties", "5": "fifties",
    "6": "sixties", "7": "seventies", "8": "eighties", "9": "nineties",
}  # fmt: skip
_DECADE = re.compile(r"\b(1[1-9]|20)?([2-9])0'?s\b|(?<![\w'])'([2-9])0s\b")
_CENTURY = re.compile(r"\b(1[1-9])00s\b")
_MILLENNIUM = re.compile(r"\b2000'?s\b")
_YEAR = re.compile(
    r"\b(in|since|by|from|until|till|during|year|circa)\s+(1[1-9])(\d)(\d)\b(?![,.]?\d)",
    re.IGNORECASE,
)


def _money(match: re.Match[str]) -> str:
    unit, units, sub, subs = _CURRENCIES[match.group(1)]
    whole, cents, scale = match.group(2), match.group(3), match.group(4)
    if scale or (cents is not None and len(cents) != 2):
        amount = whole + (f".{cents}" if cents is not None else "")
        return f"{amount} {scale + ' ' if scale else ''}{units}"
    words = []
    if whole != "0" or cents in (None, "00"):
        words.append(f"{whole} {unit if whole == '1' else units}")
    if cents not in (None, "00"):
        words.append(f"{int(cents)} {sub if cents == '01' else subs}")
    return " ".join(words)


def _decade(match: re.Match[str]) -> str:
    century, tens = match.group(1), match.group(2) or match.group(3)
    return f"{century} {_DECADE_WORDS[tens]}" if century else _DECADE_WORDS[tens]


def _year(match: re.Match[str]) -> str:
    cue, century, tens, ones = match.groups()
    if tens == "0" and ones == "0":
        return f"{cue} {century} hundred"
    return f"{cue} {century} {'oh ' + ones if tens == '0' else tens + ones}"


def _saint(match: re.Match[str]) -> str:
    before = match.group(1)
    if before and not _SENTENCE_START.search(match.string[: match.start()]):
        return match.group(0)  # "Main St. Louis": a street name, espeak reads "street"
    return f"{before or ''}Saint"


def _suffix(match: re.Match[str]) -> str:
    at_end = not match.string[match.end() :].strip(" \t").split("\n", 1)[0]
    return f"{match.group(1)}{_SUFFIXES[match.group(2)]}{'.' if at_end else ''}"


def normalize_text(text: str) -> str:
    """Clean whitespace and rewrite the constructs espeak-ng mis-reads (see module table).

    Horizontal whitespace runs become one space, blank lines collapse to one newline (a
    sentence boundary for :func:`split_sentences`), and the result is stripped. Numbers are
    left as digits wherever espeak-ng reads them correctly.

    Args:
        text: raw request text (``str``; any length).

    Returns:
        The normalized text (may be empty when ``text`` is whitespace only).
    """
    text = _BLANK_LINES.sub("\n", _HSPACE.sub(" ", text)).strip()
    text = _TITLE.sub(lambda m: _TITLES[m.group(1)], text)
    text = _SAINT.sub(_saint, text)
    text = _SUFFIX.sub(_suffix, text)
    text = _NUMBER_SIGN.sub("number ", text)
    text = _MONEY.sub(_money, text)
    text = _OCLOCK.sub(r"\1 o'clock", text)
    text = _FULL_HOUR.sub(r"\1", text)
    text = _OH_MINUTE.sub(r"\1 oh \2", text)
    text = _CENTURY.sub(r"\1 hundreds", text)
    text = _MILLENNIUM.sub("two thousands", text)
    text = _DECADE.sub(_decade, text)
    return _YEAR.sub(_year, text)


# ------------------------------------------------------------------------------- split

# Words whose trailing period is not a sentence end (compared lower-cased, without ".").
_ABBREVIATIONS = frozenset(
    "mr mrs ms dr prof st jr sr vs etc no approx inc ltd co corp mt ft fig dept est gov "
    "gen col lt sgt capt rev hon jan feb mar apr jun jul aug sep sept oct nov dec".split()
)
_BOUNDARY = re.compile(r"[.!?;:]+[\"')\]\u201d\u2019]*(?=\s|$)|\n")
_LAST_WORD = re.compile(r"([\w.'\u2019-]+)$")
_DOTTED = re.compile(r"^(?:\w\.)+\w$")  # e.g, i.e, U.S, a.m (final "." stripped)
_SPEAKABLE = re.compile(r"\w")


def _is_abbreviation(before: str) -> bool:
    """Whether the word right before a "." is an abbreviation or an initial."""
    match = _LAST_WORD.search(before)
    if match is None:
        return False
    word = match.group(1).lstrip("'\u2019")
    if word.lower() in _ABBREVIATIONS or _DOTTED.match(word):
        return True
    return len(word) == 1 and word.isupper() and word not in "IA"


def _split_boundaries(text: str) -> list[str]:
    pieces, start = [], 0
    for match in _BOUNDARY.finditer(text):
        mark = match.group(0)
        if mark.startswith(".") and len(mark.rstrip("\"')]\u201d\u2019")) == 1:
            if _is_abbreviation(text[start : match.start()]):
                continue
        pieces.append(text[start : match.end()])
        start = match.end()
    pieces.append(text[start:])
    return pieces


def _split_long(sentence: str, max_chars: int) -> list[str]:
    """Cut a sentence longer than ``max_chars`` at its last comma, else its last space."""
    pieces = []
    while len(sentence) > max_chars:
        window = sentence[: max_chars + 1]
        cut = window.rfind(", ") + 1
        if cut <= 0:
            cut = window.rfind(" ")
        if cut <= 0:
            cut = max_chars
        pieces.append(sentence[:cut].strip())
        sentence = sentence[cut:].strip()
    return [*pieces, sentence]


def split_sentences(text: str, max_chars: int = 400) -> list[str]:
    """Split text into sentences to synthesize one at a time.

    Boundaries are ``. ! ? ; :`` followed by whitespace or the end (closing quotes and
    brackets stay with their sentence) and newlines. A period after a known abbreviation
    ("Dr.", "etc.", "e.g.", "U.S."), or after a single capital initial other than "I"/"A",
    is not a boundary; decimals ("3.14") and times ("3:30") contain no whitespace after the
    mark, so they never split. A sentence longer than ``max_chars`` is cut further at its
    last ", " within the limit, else at its last space, else hard at ``max_chars``. Pieces
    without any word character (e.g. a lone "...") are dropped.

    Args:
        text: text to split, preferably already passed through :func:`normalize_text`.
        max_chars: maximum characters per returned piece (>= 1).

    Returns:
        Non-empty, stripped pieces, in order, each at most ``max_chars`` characters.

    Raises:
        RequestValidationError: ``param="input"``, when ``text`` is empty, whitespace only,
            or has nothing speakable.
        ValueError: when ``max_chars`` < 1.
    """
    if max_chars < 1:
        raise ValueError(f"max_chars must be >= 1, got {max_chars}")
    if not text or text.isspace():
        raise RequestValidationError("input text is empty", param="input")
    sentences = []
    for piece in _split_boundaries(text):
        piece = piece.strip()
        if _SPEAKABLE.search(piece):
            sentences.extend(_split_long(piece, max_chars))
    sentences = [s for s in sentences if _SPEAKABLE.search(s)]
    if not sentences:
        raise RequestValidationError("input text has nothing to speak", param="input")
    return sentences
