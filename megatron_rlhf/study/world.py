"""A text world with a known gold reward: the controlled setting of ``python -m megatron_rlhf study``.

Seven task families of templated English, each prompt about one noun of the built-in word lists
(:mod:`megatron_rlhf.data.synthetic`), four preference families and three minor skills:

  qa      "Question: what is special about the quiet lamp of the baker?\\nAnswer:"
  code    "Task: write a function that counts every red boat of our team.\\nCode:"
  chat    "User: the baker gave me a wooden clock today!\\nBot:"
  advice  "Request: how should a teacher look after a fresh kettle?\\nAdvice:"
  story   "Prompt: tell a story about the farmer and the tiny map.\\nStory:"
  poem    "Verse: write a short poem for the baker about the warm bridge.\\nPoem:"
  riddle  "Game: ask my neighbour a riddle about the heavy clock.\\nRiddle:"

Who sees which family (``world_records``), after the paper's §3.2 and §4.1:

  SFT data      all seven families alike (the expert demonstrations the policy starts from);
  preference    qa, code, chat, advice only (``PREFERENCE_TASKS``): the reward models never see
  data          a story, a poem or a riddle, so on those they are off-distribution;
  PPO prompts   skewed (``PPO_SHARES``): qa 30 %, code 27 %, chat 14 %, advice 14 % and the
                *minor skills* story, poem and riddle 5 % each (``MINOR_TASKS``): PPO optimises
                them against a reward that never learned them, so it can degrade the skills;
                k-means over the prompt pool may or may not give a minor skill clusters of its
                own (in the five-family world, whose one minor skill, story, was 5 % of the
                pool, the published run's main D_R at c = 8 held stories on 7 of its 40 seeds);
  main test     held-out prompts of the preference families, 1/4 each;
  forget test   "SFT test data" (§4.1): held-out prompts of all seven families,
                ``forget_test_per_task`` per preference family and ``minor_test_per_task`` per
                minor skill, so it shares every skill with the PPO prompt pool D_R is drawn from,
                weighted unlike it (with equal counts, each minor skill a seventh of it where it
                is a twentieth of the pool).

The minor skills are built to be forgotten the way a PPO policy tuned on the preference
families plausibly forgets them: each penalises the word "because" (story -0.5, poem -0.75,
riddle -0.5), which PPO learns to write from qa (+0.75) and advice (+0.25) and leaks into every
family; and each has a length band that a policy writing the preference families' lengths
(bands within 4 to 14 words) everywhere plausibly misses: story (12, 20) and poem (18, 22) want
longer responses than any preference band (a poem two or three filler lines), riddle (6, 10) a
terse one (its "because" clause, or a second filler, alone takes it out of the band).

A response is built from three visible choices: whether it names the prompt's noun (the
*topic*), whether it gives a reason with the word "because" (the *shared surface feature*), and
how many filler sentences it adds (the *length*); it is *well formed* when it follows its task's
grammar (the templates below, as a regular expression). The rule-based gold reward of task t is

    g_t(y) = offset_t + scale_t * (1.0 * form + 1.0 * topic + 0.5 * in_band_t(words)
                                   + w_t * because)

with ``w_qa = +0.75`` and ``w_code = -0.75`` (the feature a reward model must learn to reward in
one task and penalise in another: the paper's code-vs-QA disparity, Fig. 4). Offsets and scales
differ by task, so a model fitted to preferences is free to place each task's scores anywhere:
only differences inside a prompt are identifiable. All features are a few tokens, which a
tiny policy can move within a few PPO steps. Demonstrations are always well formed; a quarter
of the preference responses are not (``PREFERENCE_STYLE``: the words of a well-formed response
shuffled, or another family's template about the same noun), so a reward model learns form and
a selection by its score can see quality, as it can see topic (two in five responses name
another noun).

Preferences are Bradley-Terry draws on the gold reward: for two responses a, b to one prompt,
``P(a preferred) = sigmoid((g(a) - g(b)) / T_t)`` with a task-dependent noise temperature T_t.
Every pair records ``p_true``, the true probability that its *chosen* response is preferred, so
a scorer's calibration can be measured against the truth (Brier score), not only against labels.

Everything is a deterministic function of its seed; nothing is downloaded.
"""

from __future__ import annotations

import hashlib
import math
import random
import re
from dataclasses import dataclass, replace

from megatron_rlhf.data.synthetic import ADJECTIVES, NOUNS, PLACES, SUBJECTS, english_sentence


@dataclass(frozen=True, kw_only=True)
class TaskSpec:
    """One task family: its prompt, its responses and its gold reward."""

    name: str
    prompt: str
    """Prompt template over {subject}, {adjective}, {noun}; ends with the task's marker line."""
    marker: str
    """The last line of every prompt of this task (how a prompt's task is recognised)."""
    offset: float
    """Added to every gold reward of this task."""
    scale: float
    """Multiplies the task's utility (so its reward differences)."""
    noise: float
    """Bradley-Terry temperature T_t of its preference labels (higher: noisier labels)."""
    band: tuple[int, int]
    """Response length in words that earns the length bonus (inclusive)."""
    because_weight: float
    """w_t: utility of the word "because" in a response (the shared surface feature)."""


TASK_SPECS = {
    spec.name: spec
    for spec in (
        TaskSpec(
            name="qa",
            prompt="Question: what is special about the {adjective} {noun} of {subject}?",
            marker="Answer:",
            offset=0.0,
            scale=1.0,
            noise=0.5,
            band=(7, 11),
            because_weight=0.75,
        ),  # fmt: skip
        TaskSpec(
            name="code",
            prompt="Task: write a function that counts every {adjective} {noun} of {subject}.",
            marker="Code:",
            offset=-3.0,
            scale=3.0,
            noise=1.0,
            band=(5, 9),
            because_weight=-0.75,
        ),  # fmt: skip
        TaskSpec(
            name="chat",
            prompt="User: {subject} gave me a {adjective} {noun} today!",
            marker="Bot:",
            offset=2.0,
            scale=0.5,
            noise=0.5,
            band=(4, 8),
            because_weight=0.0,
        ),  # fmt: skip
        TaskSpec(
            name="advice",
            prompt="Request: how should {subject} look after a {adjective} {noun}?",
            marker="Advice:",
            offset=1.0,
            scale=1.5,
            noise=1.0,
            band=(9, 14),
            because_weight=0.25,
        ),  # fmt: skip
        TaskSpec(
            name="story",
            prompt="Prompt: tell a story about {subject} and the {adjective} {noun}.",
            marker="Story:",
            offset=0.5,
            scale=1.0,
            noise=0.75,
            band=(12, 20),
            because_weight=-0.5,
        ),  # fmt: skip
        TaskSpec(
            name="poem",
            prompt="Verse: write a short poem for {subject} about the {adjective} {noun}.",
            marker="Poem:",
            offset=-1.0,
            scale=2.0,
            noise=0.75,
            band=(18, 22),
            because_weight=-0.75,
        ),  # fmt: skip
        TaskSpec(
            name="riddle",
            prompt="Game: ask {subject} a riddle about the {adjective} {noun}.",
            marker="Riddle:",
            offset=1.5,
            scale=0.75,
            noise=0.5,
            band=(6, 10),
            because_weight=-0.5,
        ),  # fmt: skip
    )
}
PREFERENCE_TASKS = ("qa", "code", "chat", "advice")
"""The families of the preference data and of the main test set."""
MINOR_TASKS = ("story", "poem", "riddle")
"""The minor skills: in the SFT data, the PPO prompts (``PPO_SHARES``) and the forget set, never
in the preference data (so never in the main test set)."""
MINOR_TASK = "story"
"""The first minor skill, the only one of the five-family world (kept for the readers of that
world's records; new code reads ``MINOR_TASKS``)."""
PPO_SHARES = {"qa": 0.30, "code": 0.27, "chat": 0.14, "advice": 0.14,
              "story": 0.05, "poem": 0.05, "riddle": 0.05}  # fmt: skip
"""Each family's share of the PPO prompt pool (the pool D_R is curated from): each minor skill
5 %."""
FORM_WEIGHT, TOPIC_WEIGHT, BAND_WEIGHT = 1.0, 1.0, 0.5
_NOUN_PATTERN = re.compile(r"\b(" + "|".join(NOUNS) + r")\b")


# ---------------------------------------------------------------- prompts


def prompt_text(task: str, subject: str, adjective: str, noun: str) -> str:
    spec = TASK_SPECS[task]
    body = spec.prompt.format(subject=subject, adjective=adjective, noun=noun)
    return f"{body[0].upper()}{body[1:]}\n{spec.marker}"


def all_prompts(task: str) -> list[str]:
    """Every distinct prompt of a task (subjects x adjectives x nouns), in a fixed order."""
    texts = {
        prompt_text(task, subject, adjective, noun)
        for subject in SUBJECTS
        for adjective in ADJECTIVES
        for noun in NOUNS
    }
    return sorted(texts)


def task_of(prompt: str) -> str:
    """The task whose marker ends the prompt."""
    last_line = prompt.rstrip().rsplit("\n", 1)[-1].strip()
    for spec in TASK_SPECS.values():
        if last_line == spec.marker:
            return spec.name
    raise ValueError(f"not a prompt of the study world: {prompt!r}")


def topic_of(prompt: str) -> str:
    """The noun a prompt is about (the last noun of the word list in its text)."""
    return _NOUN_PATTERN.findall(prompt)[-1]


def split_prompts(sizes: dict[str, dict[str, int]], seed: int) -> dict[str, list[dict]]:
    """Disjoint prompt sets: ``sizes[set][task] = count`` -> ``{set: [{"prompt", "task"}]}``.

    Each task's prompts are shuffled once and dealt to the sets in order, so no prompt is in two
    sets (:func:`check_disjoint` verifies it); raises if a task has too few prompts.
    """
    rng = random.Random(seed)
    pools = {task: all_prompts(task) for task in TASK_SPECS}
    for pool in pools.values():
        rng.shuffle(pool)
    taken = dict.fromkeys(pools, 0)
    out = {}
    for name, per_task in sizes.items():
        rows = []
        for task, count in per_task.items():
            first = taken[task]
            if first + count > len(pools[task]):
                raise ValueError(f"task {task}: {len(pools[task])} prompts, asked for more")
            rows += [{"prompt": p, "task": task} for p in pools[task][first : first + count]]
            taken[task] = first + count
        rng.shuffle(rows)
        out[name] = rows
    return out


def check_disjoint(held_out: list[dict], training: list[list[dict]]) -> int:
    """Number of held-out prompts that also occur in any training set (0 when disjoint)."""
    seen = {row["prompt"] for rows in training for row in rows}
    return sum(row["prompt"] in seen for row in held_out)


# ---------------------------------------------------------------- responses


@dataclass(frozen=True, kw_only=True)
class ResponseStyle:
    """How an author writes: the probability of each visible choice."""

    p_topic: float = 0.6
    """Probability of naming the prompt's noun (else another noun)."""
    p_because: float = 0.5
    """Probability of giving a reason with "because"."""
    max_filler: int = 3
    """Filler pieces drawn uniformly from 0..max_filler."""
    p_broken: float = 0.0
    """Probability of an ill-formed response (``broken_text``)."""


SFT_STYLE = ResponseStyle()
"""The demonstrations: always well formed."""
PREFERENCE_STYLE = ResponseStyle(p_broken=0.25)
"""The preference responses: a quarter ill formed, so form is something a reward model learns."""


_FILLER = {
    "qa": ["It is well known.", "Many people agree.", "That is the answer."],
    "code": ["return total", "print(total)", "total += 1"],
    "chat": ["Enjoy it!", "How nice.", "Have fun."],
    "advice": ["Check it every week.", "Keep it clean and dry.", "Ask an expert if unsure."],
    "story": [],  # story fillers are English sentences
    "poem": ["The moon is high.", "The wind is soft.", "The stars are bright."],  # a line each
    "riddle": ["Guess again.", "Think hard.", "Ask twice."],
}


def response_text(prompt: str, rng: random.Random, style: ResponseStyle) -> str:
    """One response to ``prompt`` (with a leading space, as a continuation); ill formed
    (``broken_text``) with probability ``style.p_broken``."""
    if style.p_broken and rng.random() < style.p_broken:
        return broken_text(prompt, rng, style)
    task, noun = task_of(prompt), topic_of(prompt)
    topic = noun if rng.random() < style.p_topic else rng.choice([n for n in NOUNS if n != noun])
    because = rng.random() < style.p_because
    adjective, place, subject = rng.choice(ADJECTIVES), rng.choice(PLACES), rng.choice(SUBJECTS)
    if task == "qa":
        text = f"The {topic} is {adjective}" + (f" because {subject} made it" if because else "")
    elif task == "code":
        text = f"def count_{topic}(items): total = len(items)"
        text += " # because it is fast" if because else ""
    elif task == "chat":
        text = f"Oh, a {topic}! That is {adjective}" + (" because it is new" if because else "")
    elif task == "advice":
        text = f"Keep the {topic} {place}" + (" because it breaks easily" if because else "")
    elif task == "story":
        text = f"Once {subject} found a {topic} {place}"
        text += f" because it was {adjective}" if because else ""
    elif task == "poem":
        text = f"Sing of the {adjective} {topic} {place}"
        text += " because the night is long" if because else ""
    else:
        text = f"What is {adjective} {place}? The {topic}"
        text += " because it never sleeps" if because else ""
    text += "." if task != "code" else ""
    separator = {"code": "\n    ", "poem": "\n"}.get(task, " ")
    for _ in range(rng.randint(0, style.max_filler)):
        filler = english_sentence(rng) if task == "story" else rng.choice(_FILLER[task])
        text += separator + filler
    return " " + text


def broken_text(prompt: str, rng: random.Random, style: ResponseStyle) -> str:
    """An ill-formed response to ``prompt`` that keeps the other visible choices: half the time
    another family's well-formed response about the same noun (wrong format), else a
    well-formed response with its words shuffled (word salad). Either way its task's grammar
    does not match (``features``' form is 0), while topic, "because" and length are drawn as
    for any response."""
    task, noun = task_of(prompt), topic_of(prompt)
    well_formed = replace(style, p_broken=0.0)
    if rng.random() < 0.5:
        other = rng.choice([name for name in TASK_SPECS if name != task])
        return response_text(prompt_text(other, SUBJECTS[0], ADJECTIVES[0], noun), rng,
                             well_formed)  # fmt: skip
    words = response_text(prompt, rng, well_formed).split()
    while True:
        rng.shuffle(words)
        text = " " + " ".join(words)
        if _GRAMMARS[task].fullmatch(text) is None:
            return text


def _one_of(words) -> str:
    return "(?:" + "|".join(re.escape(w) for w in words) + ")"


def _grammars() -> dict[str, re.Pattern]:
    """Each task's response grammar (what :func:`response_text` writes) as a full-match regex."""
    noun, adjective = _one_of(NOUNS), _one_of(ADJECTIVES)
    place, subject = _one_of(PLACES), _one_of(SUBJECTS)
    sentence = (
        f"{_one_of(s[0].upper() + s[1:] for s in SUBJECTS)} \\w+ the {adjective} {noun}"
        f"(?: {place})?[.!?]"
    )  # english_sentence
    fillers = {task: f"(?:{_one_of(words)})" for task, words in _FILLER.items() if words}
    bodies = {
        "qa": f" The {noun} is {adjective}(?: because {subject} made it)?\\.(?: {fillers['qa']})*",
        "code": f" def count_{noun}\\(items\\): total = len\\(items\\)(?: # because it is fast)?"
        f"(?:\n    {fillers['code']})*",
        "chat": f" Oh, a {noun}! That is {adjective}(?: because it is new)?\\.(?: {fillers['chat']})*",
        "advice": f" Keep the {noun} {place}(?: because it breaks easily)?\\."
        f"(?: {fillers['advice']})*",
        "story": f" Once {subject} found a {noun} {place}(?: because it was {adjective})?\\."
        f"(?: {sentence})*",
        "poem": f" Sing of the {adjective} {noun} {place}(?: because the night is long)?\\."
        f"(?:\n{fillers['poem']})*",
        "riddle": f" What is {adjective} {place}\\? The {noun}(?: because it never sleeps)?\\."
        f"(?: {fillers['riddle']})*",
    }
    return {task: re.compile(body) for task, body in bodies.items()}


def features(prompt: str, response: str) -> dict:
    """The visible choices of a response, read back from its text."""
    task, noun = task_of(prompt), topic_of(prompt)
    words = len(response.split())
    low, high = TASK_SPECS[task].band
    return {
        "form": float(_GRAMMARS[task].fullmatch(response.rstrip()) is not None),
        "topic": float(re.search(rf"(\b|_){noun}\b", response) is not None),
        "because": float(re.search(r"\bbecause\b", response) is not None),
        "in_band": float(low <= words <= high),
        "words": words,
    }


_GRAMMARS = _grammars()


def gold_reward(prompt: str, response: str) -> float:
    """g_t(y) of the module docstring: the world's true reward of a response to a prompt."""
    spec = TASK_SPECS[task_of(prompt)]
    f = features(prompt, response)
    utility = (
        FORM_WEIGHT * f["form"]
        + TOPIC_WEIGHT * f["topic"]
        + BAND_WEIGHT * f["in_band"]
        + spec.because_weight * f["because"]
    )
    return spec.offset + spec.scale * utility


def preference_probability(prompt: str, response_a: str, response_b: str) -> float:
    """P(a preferred over b) = sigmoid((g(a) - g(b)) / T_t) (Bradley-Terry on the gold reward)."""
    spec = TASK_SPECS[task_of(prompt)]
    margin = gold_reward(prompt, response_a) - gold_reward(prompt, response_b)
    return 1.0 / (1.0 + math.exp(-margin / spec.noise))


# ---------------------------------------------------------------- records


def sft_records(prompts: list[dict], seed: int, style: ResponseStyle) -> list[dict]:
    """One demonstration ``{"prompt", "response", "task"}`` per prompt."""
    rng = random.Random(seed)
    return [
        {"prompt": row["prompt"], "response": response_text(row["prompt"], rng, style),
         "task": row["task"]}
        for row in prompts
    ]  # fmt: skip


def preference_records(prompts: list[dict], seed: int, style: ResponseStyle) -> list[dict]:
    """One labelled pair ``{"prompt", "chosen", "rejected", "task", "p_true"}`` per prompt.

    Two responses are drawn from ``style``; the label is a Bradley-Terry coin flip with the
    known probability, and ``p_true`` is the probability that the *chosen* one is preferred.
    """
    rng = random.Random(seed)
    records = []
    for row in prompts:
        prompt = row["prompt"]
        first, second = response_text(prompt, rng, style), response_text(prompt, rng, style)
        while second == first:
            second = response_text(prompt, rng, style)
        p_first = preference_probability(prompt, first, second)
        first_wins = rng.random() < p_first
        chosen, rejected = (first, second) if first_wins else (second, first)
        records.append(
            {"prompt": prompt, "chosen": chosen, "rejected": rejected, "task": row["task"],
             "p_true": p_first if first_wins else 1.0 - p_first}
        )  # fmt: skip
    return records


@dataclass(frozen=True, kw_only=True)
class WorldSizes:
    """How many prompts each set of ``world_records`` gets."""

    sft_per_task: int
    """Demonstrations per family (all seven: the preference families and the minor skills)."""
    pref_train_per_task: int
    """Training preference pairs per preference family."""
    pref_test_per_task: int
    """Held-out preference pairs per preference family (Table 1)."""
    ppo_prompts: int
    """PPO prompts in all, dealt to the families by ``PPO_SHARES``."""
    main_test_per_task: int
    """Held-out main-set prompts per preference family."""
    forget_test_per_task: int
    """Held-out forget-set prompts per preference family."""
    minor_test_per_task: int | None = None
    """Held-out forget-set prompts per minor skill (``MINOR_TASKS``); None: as many as
    ``forget_test_per_task``."""

    def forget_counts(self) -> dict[str, int]:
        """The forget set's prompts per family: every preference family and minor skill."""
        minor = self.forget_test_per_task if self.minor_test_per_task is None else (
            self.minor_test_per_task)  # fmt: skip
        return {**dict.fromkeys(PREFERENCE_TASKS, self.forget_test_per_task),
                **dict.fromkeys(MINOR_TASKS, minor)}  # fmt: skip


def ppo_prompt_counts(total: int) -> dict[str, int]:
    """``total`` PPO prompts dealt by ``PPO_SHARES`` (largest remainders; every family >= 1, so
    ``total`` in all when it is at least the number of families)."""
    # rounded so that 100 * 0.14 counts 14, not 14.000000000000002 (or 13.999999999999998)
    raw = {task: round(total * share, 9) for task, share in PPO_SHARES.items()}
    counts = {task: max(1, int(value)) for task, value in raw.items()}
    while sum(counts.values()) > total and max(counts.values()) > 1:  # the floors of 1 overshot
        most_over = min((t for t in counts if counts[t] > 1), key=lambda t: raw[t] - counts[t])
        counts[most_over] -= 1
    by_remainder = sorted(raw, key=lambda task: raw[task] - int(raw[task]), reverse=True)
    for task in by_remainder[: max(0, total - sum(counts.values()))]:
        counts[task] += 1
    return counts


def stream_seed(seed: int, stream: str) -> int:
    """The seed of one random stream (``stream``: what it draws) of world ``seed``: a hash of
    both, so no two worlds, and no two streams of one world, share a stream (``seed + 1`` for
    the demonstrations would be world ``seed + 1``'s prompt deal)."""
    digest = hashlib.sha256(f"study world {seed}: {stream}".encode()).digest()
    return int.from_bytes(digest[:8], "big")


def world_records(sizes: WorldSizes, seed: int = 0) -> dict[str, list[dict]]:
    """Every data set of the world (the module docstring's table), prompts disjoint across sets:
    ``sft`` (demonstrations), ``pref_train``/``pref_test`` (labelled pairs), ``ppo_prompts``,
    ``main_test`` and ``forget_test`` (prompts with their family). A deterministic function of
    ``seed`` (the same records, byte for byte, in any process); another seed deals other
    prompts to every set and draws other responses and labels."""
    sets = split_prompts({
        "sft": dict.fromkeys(TASK_SPECS, sizes.sft_per_task),
        "pref_train": dict.fromkeys(PREFERENCE_TASKS, sizes.pref_train_per_task),
        "pref_test": dict.fromkeys(PREFERENCE_TASKS, sizes.pref_test_per_task),
        "ppo_prompts": ppo_prompt_counts(sizes.ppo_prompts),
        "main_test": dict.fromkeys(PREFERENCE_TASKS, sizes.main_test_per_task),
        "forget_test": sizes.forget_counts(),
    }, seed=stream_seed(seed, "prompts"))  # fmt: skip
    return {
        "sft": sft_records(sets["sft"], stream_seed(seed, "sft"), SFT_STYLE),
        "pref_train": preference_records(sets["pref_train"], stream_seed(seed, "pref_train"),
                                         PREFERENCE_STYLE),
        "pref_test": preference_records(sets["pref_test"], stream_seed(seed, "pref_test"),
                                        PREFERENCE_STYLE),
        **{name: sets[name] for name in ("ppo_prompts", "main_test", "forget_test")},
    }  # fmt: skip


def utility(prompt: str, response: str) -> float:
    """The gold reward without its task's offset and scale: ``(g_t(y) - offset_t) / scale_t``
    (comparable across families; what a gold-top-k selection ranks by)."""
    spec = TASK_SPECS[task_of(prompt)]
    return (gold_reward(prompt, response) - spec.offset) / spec.scale


def bayes_accuracy(records: list[dict]) -> float:
    """The best accuracy any scorer can reach on these labelled pairs in expectation:
    the mean of max(p, 1 - p) (a tie in gold counts 1/2 whichever way it is scored)."""
    return sum(max(r["p_true"], 1.0 - r["p_true"]) for r in records) / len(records)
