"""Built-in English benchmark sentences.

Thirty varied sentences for speed and intelligibility benchmarks when no seed-tts-eval list
is given: plain statements, questions, exclamations, numbers (cardinals, decimals, money,
percent, ordinals, years, times), abbreviations, quotes and parentheses, short and long
inputs, and one long paragraph that servers split into several sentences.
"""

from __future__ import annotations

__all__ = ["BUILTIN_SENTENCES"]

BUILTIN_SENTENCES: tuple[str, ...] = (
    "Hello world, this is a test.",
    "The quick brown fox jumps over the lazy dog.",
    "Yes.",
    "Could you please call me back tomorrow morning?",
    "What time does the next train to Boston leave?",
    "Watch out, the floor is wet!",
    "I bought 3 apples and 12 oranges at the market.",
    "The total comes to $45.99, including tax.",
    "Prices rose by 7.5% over the last 12 months.",
    "She finished 2nd in the race and he came 21st.",
    "The meeting starts at 9:30 a.m. on Monday.",
    "The company was founded in 1998 and moved in 2015.",
    "Dr. Smith and Mr. Jones met at the hospital on Oak St. yesterday.",
    "Please read chapters 4 through 7 before Friday's exam.",
    "The population grew to 1,250,000 people by the end of the decade.",
    'He said, "I will be there in five minutes," and then hung up.',
    "The recipe (which my grandmother wrote) calls for two cups of flour.",
    "Is it raining outside, or is the sky just cloudy?",
    "Turn left at the second light; the bakery is on your right.",
    "We need three things: patience, practice, and a little luck.",
    "The temperature dropped to -5 degrees overnight.",
    "Pi is approximately 3.14159, a number every student learns.",
    "Wow, that was the best concert I have ever seen!",
    "Neither the manager nor the employees knew about the change.",
    "The library is open from Monday to Saturday, except on holidays.",
    "Can you believe it's already the end of the year?",
    "Our flight, number 237, departs from gate B12 at 6:45 p.m.",
    "The experiment was repeated 10 times to confirm the results.",
    "Thank you very much for your help, I really appreciate it.",
    (
        "Speech synthesis has improved dramatically over the past decade. Early systems "
        "stitched together recorded fragments, and the result often sounded robotic. "
        "Modern neural models predict the sound directly from text, and they can produce "
        "natural rhythm, stress, and intonation. Still, numbers like 1,024 or dates like "
        "July 4th, 1776 remain tricky, and careful text normalization is needed before any "
        "model sees the input. Benchmarks such as this one measure both how fast audio "
        "arrives and how intelligible it is."
    ),
)
