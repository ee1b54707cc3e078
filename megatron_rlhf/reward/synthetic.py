"""A synthetic preference set that reproduces the mechanism behind the paper's Fig. 4.

Pairs alone carry no per-task offset (Eq. 1 only sees score differences), so the spread of an
RM's per-task means needs a cause. The paper names one (§1): code patterns get high reward in
Code Generation and then leak into QA. We build exactly that, on token ids of a tiny vocabulary:

- every response mixes GOOD, BAD and FILLER tokens; its quality q = (#good - #bad) / length;
- a FEATURE token (the "code pattern") is rewarded only in task "code", where exactly one of
  the two responses of each pair holds it; in task "qa" every response holds it (so it never
  decides a QA comparison), and in task "chat" none does;
- the true reward is ``quality_weight · q + feature_bonus · [task == code and FEATURE in y]``
  and the chosen response is drawn by Bradley-Terry: P(y1 ≻ y2) = σ(R1 - R2).

An RM learns a large positive weight on FEATURE from the code pairs and, since every QA response
holds it, scores all of QA higher: the per-task means spread by about ``feature_bonus``. An AM
scores a = r - e_τ(x) with a prompt-dependent e_τ and bounds a_c < m, a_r > -m (Eq. 6), so e_τ
absorbs each task's offset and the per-task means of a sit near 0. Each task has its own block
of prompt tokens, which is what lets e_τ(x) tell the tasks apart.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

PAD_ID = 0
"""Reserved for padding; never generated."""
FEATURE_ID = 1
"""The "code pattern" token."""
GOOD_IDS = tuple(range(2, 10))
BAD_IDS = tuple(range(10, 18))
FILLER_IDS = tuple(range(18, 32))
TASKS = ("code", "qa", "chat")
"""Task names, in the order their prompt-token blocks follow FILLER_IDS."""
PROMPT_BLOCK = 8
"""Prompt tokens per task: task t draws its prompts from ids 32 + 8t ... 32 + 8t + 7."""
VOCAB_SIZE = 32 + PROMPT_BLOCK * len(TASKS)


@dataclass(kw_only=True)
class SyntheticPreferenceConfig:
    num_pairs_per_task: int = 1000
    """Comparison pairs generated for each of TASKS."""
    feature_bonus: float = 4.0
    """True reward of the FEATURE token in task "code" (it is worth nothing elsewhere)."""
    quality_weight: float = 4.0
    """True reward per unit of quality q = (#good - #bad) / length, q in [-1, 1]."""
    prompt_length: tuple[int, int] = (3, 8)
    """Inclusive range of prompt lengths."""
    response_length: tuple[int, int] = (4, 16)
    """Inclusive range of response lengths before the FEATURE token is inserted."""
    seed: int = 0
    """Seed of the generator's own random.Random (global RNGs are left alone)."""


def make_synthetic_preferences(config: SyntheticPreferenceConfig) -> list[dict]:
    """Preference pairs ``{prompt_ids, chosen_ids, rejected_ids, task}``, tasks interleaved."""
    rng = random.Random(config.seed)
    pairs = []
    for _ in range(config.num_pairs_per_task):
        for task_index, task in enumerate(TASKS):
            pairs.append(_make_pair(rng, config, task_index, task))
    return pairs


def true_reward(response_ids: list[int], task: str, config: SyntheticPreferenceConfig) -> float:
    """The hidden reward that decided the comparisons (see the module docstring)."""
    good = sum(token in GOOD_IDS for token in response_ids)
    bad = sum(token in BAD_IDS for token in response_ids)
    quality = (good - bad) / len(response_ids)
    has_feature = FEATURE_ID in response_ids
    return config.quality_weight * quality + config.feature_bonus * (task == "code" and has_feature)


def _make_pair(rng: random.Random, config, task_index: int, task: str) -> dict:
    first_block = 32 + PROMPT_BLOCK * task_index
    prompt = [
        rng.randrange(first_block, first_block + PROMPT_BLOCK)
        for _ in range(rng.randint(*config.prompt_length))
    ]
    if task == "code":
        first_has_feature = rng.random() < 0.5
        features = (first_has_feature, not first_has_feature)
    else:
        features = (task == "qa", task == "qa")
    responses = [_make_response(rng, config, has_feature) for has_feature in features]
    while responses[0] == responses[1]:  # identical texts are not a comparison
        responses[1] = _make_response(rng, config, features[1])
    rewards = [true_reward(response, task, config) for response in responses]
    first_wins = rng.random() < 1.0 / (1.0 + math.exp(rewards[1] - rewards[0]))
    chosen, rejected = responses if first_wins else responses[::-1]
    return {"prompt_ids": prompt, "chosen_ids": chosen, "rejected_ids": rejected, "task": task}


def _make_response(rng: random.Random, config, has_feature: bool) -> list[int]:
    good_share, bad_share = rng.uniform(0.0, 0.5), rng.uniform(0.0, 0.5)
    response = []
    for _ in range(rng.randint(*config.response_length)):
        draw = rng.random()
        pool = (
            GOOD_IDS
            if draw < good_share
            else BAD_IDS
            if draw < good_share + bad_share
            else FILLER_IDS
        )
        response.append(rng.choice(pool))
    if has_feature:
        response.insert(rng.randint(0, len(response)), FEATURE_ID)
    return response
