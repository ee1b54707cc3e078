"""A small built-in English corpus and synthetic RLHF records, generated from word lists in code.

Nothing here is downloaded or shipped as data: sentences are drawn from fixed word lists with a
seeded ``random.Random``, so the same seed always gives the same text. The tests, the benchmark
and the demo use it to train the tiny tokenizer and to make prompt, SFT and preference JSONL.

The preference records carry a learnable signal: the chosen answer talks about the thing the
question asks about, politely; the rejected answer is curt and about something else.
"""

from __future__ import annotations

import random

SUBJECTS = [
    "the farmer",
    "a teacher",
    "my neighbour",
    "the old sailor",
    "a young doctor",
    "the baker",
    "our team",
    "the little robot",
    "a tired student",
    "the gardener",
]
VERBS = [
    "repairs",
    "paints",
    "carries",
    "studies",
    "cooks",
    "builds",
    "cleans",
    "sells",
    "finds",
    "describes",
    "measures",
    "borrows",
]
ADJECTIVES = [
    "red",
    "heavy",
    "quiet",
    "bright",
    "wooden",
    "broken",
    "fresh",
    "tiny",
    "ancient",
    "warm",
    "strange",
    "simple",
]
NOUNS = [
    "boat",
    "garden",
    "bicycle",
    "letter",
    "window",
    "kettle",
    "bridge",
    "lamp",
    "violin",
    "basket",
    "map",
    "clock",
    "river",
    "recipe",
    "engine",
]
PLACES = [
    "in the morning",
    "near the harbour",
    "after lunch",
    "at the market",
    "before the rain",
    "on the hill",
    "every Sunday",
    "in the kitchen",
    "under the stars",
    "with great care",
]
TASKS = ["helpful", "harmless", "advice"]


def english_sentence(rng: random.Random) -> str:
    """One plain English sentence such as 'The baker repairs a wooden clock near the harbour.'"""
    subject = rng.choice(SUBJECTS)
    text = f"{subject} {rng.choice(VERBS)} the {rng.choice(ADJECTIVES)} {rng.choice(NOUNS)}"
    if rng.random() < 0.6:
        text += f" {rng.choice(PLACES)}"
    return text[0].upper() + text[1:] + rng.choice([".", ".", ".", "!", "?"])


def english_sentences(num_sentences: int, seed: int = 0) -> list[str]:
    """``num_sentences`` sentences, deterministic in ``seed``."""
    rng = random.Random(seed)
    return [english_sentence(rng) for _ in range(num_sentences)]


def _question(rng: random.Random) -> tuple[str, str]:
    noun, adjective = rng.choice(NOUNS), rng.choice(ADJECTIVES)
    template = rng.choice(
        [
            "How do I look after a {a} {n}?",
            "What should I know before buying a {a} {n}?",
            "Can you tell me something about the {a} {n}?",
            "Why would anyone need a {a} {n}?",
        ]
    )
    return template.format(a=adjective, n=noun), noun


def _good_answer(rng: random.Random, noun: str) -> str:
    sentences = [f"Of course! A good {noun} deserves attention."]
    sentences += [english_sentence(rng) for _ in range(rng.randint(1, 3))]
    sentences.append(f"I hope this helps you with your {noun}.")
    return " ".join(sentences)


def _bad_answer(rng: random.Random, noun: str) -> str:
    other = rng.choice([n for n in NOUNS if n != noun])
    return f"No idea. Ask someone else about the {other}."


def synthetic_records(kind: str, num_records: int, seed: int = 0, hh_format: bool = False):
    """Yield ``num_records`` JSON-ready dicts for ``kind`` in prompt|sft|preference.

    prompt: ``{"prompt"}``; sft: ``{"prompt", "response"}``; preference: ``{"prompt", "chosen",
    "rejected", "task"}``, or with ``hh_format`` the Anthropic HH-RLHF layout ``{"chosen",
    "rejected"}`` of two full "\\n\\nHuman: ... \\n\\nAssistant: ..." transcripts.
    """
    if kind not in ("prompt", "sft", "preference"):
        raise ValueError(f"kind must be prompt, sft or preference, got {kind!r}")
    rng = random.Random(seed)
    for _ in range(num_records):
        question, noun = _question(rng)
        prompt = f"\n\nHuman: {question}\n\nAssistant:"
        if kind == "prompt":
            yield {"prompt": prompt}
        elif kind == "sft":
            yield {"prompt": prompt, "response": " " + _good_answer(rng, noun)}
        else:
            chosen, rejected = " " + _good_answer(rng, noun), " " + _bad_answer(rng, noun)
            if hh_format:
                yield {"chosen": prompt + chosen, "rejected": prompt + rejected}
            else:
                yield {
                    "prompt": prompt,
                    "chosen": chosen,
                    "rejected": rejected,
                    "task": rng.choice(TASKS),
                }
