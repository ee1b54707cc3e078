"""Synthetic scored PPO records with distinct "skills", for tests, the benchmark and demos.

Each prompt is drawn from one of a few skills (arithmetic, cooking, code, travel, writing,
health), so sentence embeddings form real clusters; numbers and word choices make every prompt
unique. Scores are normal with a per-skill mean, as an advantage model's would differ by task.
Deterministic in ``seed``; nothing is downloaded.
"""

from __future__ import annotations

import random

WORDS = {
    "food": ["lentil soup", "risotto", "banana bread", "ramen", "paella", "pancakes", "curry"],
    "lang": ["Python", "Rust", "JavaScript", "Go", "C++", "Java"],
    "task": [
        "reverses a linked list",
        "parses a CSV file",
        "sorts a list of dates",
        "counts words in a file",
        "merges two dictionaries",
        "validates an email address",
    ],
    "city": ["Lisbon", "Kyoto", "Nairobi", "Reykjavik", "Lima", "Montreal", "Hanoi"],
    "month": ["January", "April", "July", "October", "December"],
    "job": ["nurse", "data analyst", "carpenter", "teacher", "pilot", "chef"],
    "thing": ["the sea", "autumn leaves", "an old bicycle", "city lights", "a lost glove"],
}
SKILLS = {
    "math": [
        "What is {a} plus {b}?",
        "Solve for x: {a}x + {b} = {c}.",
        "Compute {a} times {b} and explain each step.",
    ],
    "cooking": [
        "How do I cook {food} for {a} people?",
        "Give me a recipe for {food} that takes {a} minutes.",
    ],
    "code": [
        "Write a {lang} function that {task} (case {a}).",
        "My {lang} program that {task} fails on input {a}; how do I fix it?",
    ],
    "travel": [
        "Plan a {a}-day trip to {city} in {month}.",
        "What should I pack for {city} in {month} on a budget of {a} dollars?",
    ],
    "writing": [
        "Write a resume summary for a {job} with {a} years of experience.",
        "Write a short poem about {thing} in {a} lines.",
    ],
    "health": [
        "How many hours of sleep does a {a}-year-old need?",
        "Suggest a {a}-minute stretching routine for a {job}.",
    ],
}
SCORE_MEAN = {
    "math": 0.5,
    "cooking": -0.2,
    "code": 0.1,
    "travel": -0.5,
    "writing": 0.3,
    "health": 0.0,
}


def synthetic_scored_records(num_records: int, seed: int = 0, entropy: bool = True) -> list[dict]:
    """``num_records`` dicts ``{"prompt", "response", "score", "skill"[, "entropy"]}``, unique
    prompts, deterministic in ``seed``."""
    rng = random.Random(seed)
    skills = sorted(SKILLS)
    records, seen = [], set()
    while len(records) < num_records:
        skill = rng.choice(skills)
        slots = {name: rng.choice(words) for name, words in WORDS.items()}
        slots.update(a=rng.randint(2, 9999), b=rng.randint(2, 999), c=rng.randint(2, 99))
        prompt = rng.choice(SKILLS[skill]).format(**slots)
        if prompt in seen:
            continue
        seen.add(prompt)
        words = rng.randint(3, 40)
        response = " ".join(rng.choice(prompt.split()) for _ in range(words)) + "."
        record = {
            "prompt": prompt,
            "response": " Sure. " + response,
            "score": round(rng.gauss(SCORE_MEAN[skill], 1.0), 4),
            "skill": skill,
        }
        if entropy:
            record["entropy"] = round(rng.uniform(0.2, 3.0), 3)
        records.append(record)
    return records
