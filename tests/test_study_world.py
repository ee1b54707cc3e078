"""The study world's seven families (issue 50): four preference families and three minor skills.

Every family's responses follow its grammar and ``broken_text`` never does; the gold reward of
each family is its offset and scale over form, topic, band and "because", with the minor skills
built to be forgotten (a negative "because" weight); the minor skills are never in the
preference data, 5 % each of the PPO pool and all in the forget set; another world seed deals
another world, the same seed the same one byte for byte. In-process and fast: no model.
"""

from __future__ import annotations

import hashlib
import json
import random

import pytest

from megatron_rlhf.study import world

SIZES = world.WorldSizes(sft_per_task=30, pref_train_per_task=20, pref_test_per_task=8,
                         ppo_prompts=400, main_test_per_task=6, forget_test_per_task=9,
                         minor_test_per_task=5)  # fmt: skip
ALWAYS = world.ResponseStyle(p_topic=1.0, p_because=1.0, max_filler=3)
NEVER = world.ResponseStyle(p_topic=0.0, p_because=0.0, max_filler=0)


def test_seven_families_four_preference_and_three_minor():
    assert world.MINOR_TASKS == ("story", "poem", "riddle")
    assert world.MINOR_TASK in world.MINOR_TASKS
    assert set(world.TASK_SPECS) == {*world.PREFERENCE_TASKS, *world.MINOR_TASKS}
    assert not set(world.PREFERENCE_TASKS) & set(world.MINOR_TASKS)
    assert set(world.PPO_SHARES) == set(world.TASK_SPECS)
    assert sum(world.PPO_SHARES.values()) == pytest.approx(1.0)
    assert all(world.PPO_SHARES[task] == 0.05 for task in world.MINOR_TASKS)
    markers = [spec.marker for spec in world.TASK_SPECS.values()]
    openers = [spec.prompt.split()[0] for spec in world.TASK_SPECS.values()]
    assert len(set(markers)) == len(set(openers)) == 7  # a distinct prompt shape each
    for task in world.TASK_SPECS:
        prompts = world.all_prompts(task)
        assert len(prompts) == len(set(prompts)) == 1800
        for prompt in prompts[::97]:
            assert world.task_of(prompt) == task
            assert prompt.endswith("\n" + world.TASK_SPECS[task].marker)
            noun = world.topic_of(prompt)
            assert prompt.count(noun) == 1, prompt  # the topic noun, and no other, in the prompt


def test_every_family_writes_well_formed_responses_and_broken_text_is_not():
    """All seven families: any style's response fullmatches its own grammar and no other
    family's; the choices read back (topic, "because", fillers); ``broken_text`` is ill formed
    whichever way it breaks, and so is a response cut short."""
    rng = random.Random(50)
    grammars = world._GRAMMARS
    assert set(grammars) == set(world.TASK_SPECS)
    for task in world.TASK_SPECS:
        for prompt in world.all_prompts(task)[::60]:
            noun = world.topic_of(prompt)
            for style in (world.SFT_STYLE, world.ResponseStyle(p_because=0.9), ALWAYS, NEVER):
                response = world.response_text(prompt, rng, style)
                features = world.features(prompt, response)
                assert features["form"] == 1.0, (task, response)
                others = [t for t in grammars if t != task and grammars[t].fullmatch(response)]
                assert not others, (task, response, others)
                assert world.features(prompt, response[:-3])["form"] == 0.0, response
                if style is ALWAYS:
                    assert features["topic"] == features["because"] == 1.0, response
                    assert noun in response
                if style is NEVER:
                    assert features["topic"] == features["because"] == 0.0, response
            for _ in range(4):
                broken = world.broken_text(prompt, rng, world.PREFERENCE_STYLE)
                assert world.features(prompt, broken)["form"] == 0.0, (task, broken)


def test_fillers_lengthen_and_minor_responses_stay_as_short_as_stories():
    """Fillers add words in every family; the new minor skills' longest responses are no longer
    than stories' (the generation budget follows the longest SFT demonstration)."""
    rng = random.Random(7)
    longest = {}
    for task in world.TASK_SPECS:
        bare = world.ResponseStyle(p_because=0.0, max_filler=0)
        filled = world.ResponseStyle(p_because=0.0, max_filler=3)
        for prompt in world.all_prompts(task)[:40]:
            # one seed draws the same head in both styles (the filler count is drawn last)
            pairs = [(world.response_text(prompt, random.Random(s), bare),
                      world.response_text(prompt, random.Random(s), filled)) for s in range(8)]  # fmt: skip
            assert all(long.startswith(short) for short, long in pairs), (task, pairs)
            assert any(len(long.split()) > len(short.split()) for short, long in pairs), task
        texts = [world.response_text(p, rng, ALWAYS) for p in world.all_prompts(task)[:300]]
        longest[task] = max(len(text) for text in texts)
    for task in ("poem", "riddle"):
        assert longest[task] <= longest["story"], longest


def _response(task: str, noun: str, because: bool, fillers: int) -> str:
    """A hand-written well-formed response (the templates of the module docstring)."""
    clause = {"qa": " because the baker made it", "code": " # because it is fast",
              "chat": " because it is new", "advice": " because it breaks easily",
              "story": " because it was red", "poem": " because the night is long",
              "riddle": " because it never sleeps"}[task] if because else ""  # fmt: skip
    head = {"qa": f" The {noun} is red{clause}.",
            "code": f" def count_{noun}(items): total = len(items){clause}",
            "chat": f" Oh, a {noun}! That is red{clause}.",
            "advice": f" Keep the {noun} on the hill{clause}.",
            "story": f" Once the farmer found a {noun} on the hill{clause}.",
            "poem": f" Sing of the red {noun} on the hill{clause}.",
            "riddle": f" What is red on the hill? The {noun}{clause}."}[task]  # fmt: skip
    filler = {"qa": " Many people agree.", "code": "\n    total += 1", "chat": " How nice.",
              "advice": " Check it every week.", "story": " The baker paints the red lamp.",
              "poem": "\nThe moon is high.", "riddle": " Think hard."}[task]  # fmt: skip
    return head + filler * fillers


@pytest.mark.parametrize("task", list(world.TASK_SPECS))
def test_gold_reward_of_each_family(task):
    """g_t = offset_t + scale_t * (form + topic + 0.5 * in_band + w_t * because), on
    hand-written responses whose features are known without reading them back."""
    spec = world.TASK_SPECS[task]
    prompt = world.all_prompts(task)[123]
    noun = world.topic_of(prompt)
    other = next(n for n in world.NOUNS if n != noun)
    low, high = spec.band
    for because in (False, True):
        for fillers in range(4):
            for topic in (noun, other):
                response = _response(task, topic, because, fillers)
                words = len(response.split())
                in_band = low <= words <= high
                expected = spec.offset + spec.scale * (
                    1.0 + (topic == noun) + 0.5 * in_band + spec.because_weight * because
                )
                assert world.gold_reward(prompt, response) == pytest.approx(expected), response
                assert world.utility(prompt, response) == pytest.approx(
                    (expected - spec.offset) / spec.scale
                )
                salad = " " + " ".join(reversed(response.split()))  # form is worth scale_t
                assert world.gold_reward(prompt, salad) == pytest.approx(expected - spec.scale)
    if task in world.MINOR_TASKS:
        assert spec.because_weight < 0  # PPO learns "because" from qa and leaks it here
    # at equal length, "because" is worth exactly scale_t * w_t
    clause_free = _response(task, noun, False, 0)
    assert world.gold_reward(prompt, clause_free) == pytest.approx(
        spec.offset + spec.scale * (2.0 + 0.5 * world.features(prompt, clause_free)["in_band"])
    )


def test_new_minor_skills_gold_parameters_and_where_their_bands_sit():
    """The parameters the report cites, and bands away from the preference families'."""
    poem, riddle = world.TASK_SPECS["poem"], world.TASK_SPECS["riddle"]
    assert (poem.offset, poem.scale, poem.band, poem.because_weight) == (-1.0, 2.0, (18, 22),
                                                                           -0.75)  # fmt: skip
    assert (riddle.offset, riddle.scale, riddle.band, riddle.because_weight) == (
        1.5, 0.75, (6, 10), -0.5)  # fmt: skip
    top = max(world.TASK_SPECS[t].band[1] for t in world.PREFERENCE_TASKS)
    assert world.TASK_SPECS["story"].band[0] > 11 and poem.band[0] > top
    prompt = world.all_prompts("riddle")[0]
    noun = world.topic_of(prompt)
    terse = _response("riddle", noun, False, 0)
    assert world.features(prompt, terse)["in_band"] == 1.0
    assert world.features(prompt, _response("riddle", noun, True, 0))["in_band"] == 0.0
    assert world.features(prompt, _response("riddle", noun, False, 2))["in_band"] == 0.0
    # a preference-family-length poem (no fillers) misses the band; two lines and a reason hit it
    prompt = world.all_prompts("poem")[0]
    noun = world.topic_of(prompt)
    assert world.features(prompt, _response("poem", noun, True, 0))["in_band"] == 0.0
    assert world.features(prompt, _response("poem", noun, True, 2))["in_band"] == 1.0
    assert world.features(prompt, _response("poem", noun, False, 3))["in_band"] == 1.0


def _families(rows: list[dict]) -> dict[str, int]:
    counts = dict.fromkeys(world.TASK_SPECS, 0)
    for row in rows:
        assert world.task_of(row["prompt"]) == row["task"]
        counts[row["task"]] += 1
    return counts


def test_world_records_deal_the_minor_skills_where_the_design_says():
    records = world.world_records(SIZES, seed=0)
    assert _families(records["sft"]) == dict.fromkeys(world.TASK_SPECS, 30)
    none_minor = dict.fromkeys(world.MINOR_TASKS, 0)
    for name, per_task in (("pref_train", 20), ("pref_test", 8), ("main_test", 6)):
        assert _families(records[name]) == {**dict.fromkeys(world.PREFERENCE_TASKS, per_task),
                                            **none_minor}, name  # fmt: skip
    ppo = _families(records["ppo_prompts"])
    assert sum(ppo.values()) == 400
    assert ppo == {"qa": 120, "code": 108, "chat": 56, "advice": 56, "story": 20, "poem": 20,
                   "riddle": 20}  # fmt: skip
    for task in world.MINOR_TASKS:
        assert ppo[task] / 400 == 0.05
    forget = _families(records["forget_test"])
    assert forget == {**dict.fromkeys(world.PREFERENCE_TASKS, 9),
                      **dict.fromkeys(world.MINOR_TASKS, 5)}  # fmt: skip
    prompts = [r["prompt"] for rows in records.values() for r in rows]
    assert len(prompts) == len(set(prompts))  # disjoint across every set
    assert all(world.features(r["prompt"], r["response"])["form"] == 1.0 for r in records["sft"])
    # minor_test_per_task left out: as many per minor skill as per preference family
    default = world.world_records(world.WorldSizes(**{**SIZES.__dict__,
                                                      "minor_test_per_task": None}))  # fmt: skip
    assert _families(default["forget_test"]) == dict.fromkeys(world.TASK_SPECS, 9)


def test_ppo_prompt_counts_deal_every_total():
    for total in range(len(world.TASK_SPECS), 2500):
        counts = world.ppo_prompt_counts(total)
        assert sum(counts.values()) == total and min(counts.values()) >= 1, (total, counts)
        if total % 100 == 0:  # exact shares (no float residue: 100 * 0.14 is 14)
            assert counts == {t: round(total * s) for t, s in world.PPO_SHARES.items()}, total


def test_a_set_asking_for_more_prompts_than_a_family_has_raises():
    world.split_prompts({"a": {"poem": 1000}, "b": {"poem": 800}}, seed=0)
    with pytest.raises(ValueError, match="task riddle: 1800 prompts"):
        world.split_prompts({"a": {"riddle": 1000}, "b": {"riddle": 801}}, seed=0)
    with pytest.raises(ValueError, match="1800 prompts, asked for more"):
        world.world_records(world.WorldSizes(**{**SIZES.__dict__, "sft_per_task": 1796}))


def _digest(records: dict) -> str:
    return hashlib.sha256(json.dumps(records, sort_keys=True).encode()).hexdigest()


def test_world_seed_deals_a_different_world_and_reproduces_it():
    """World seed 1 differs from 0 in every set (other prompts, other responses and labels);
    the same seed gives the same records byte for byte (nothing depends on set order: each
    family's prompts are sorted before the seeded shuffle)."""
    zero, one = world.world_records(SIZES, seed=0), world.world_records(SIZES, seed=1)
    assert list(zero) == list(one) == ["sft", "pref_train", "pref_test", "ppo_prompts",
                                       "main_test", "forget_test"]  # fmt: skip
    for name in zero:
        assert _families(zero[name]) == _families(one[name]), name  # same sizes
        prompts_zero = {r["prompt"] for r in zero[name]}
        prompts_one = {r["prompt"] for r in one[name]}
        assert len(prompts_zero & prompts_one) < len(prompts_zero) / 4, name  # other prompts
    # other responses to the same prompt: the seeds' streams are unrelated
    sft_zero = {r["prompt"]: r["response"] for r in zero["sft"]}
    shared = [r for r in one["sft"] if r["prompt"] in sft_zero]
    assert sum(r["response"] != sft_zero[r["prompt"]] for r in shared) >= len(shared) / 2
    assert world.stream_seed(0, "sft") != world.stream_seed(1, "prompts")
    assert _digest(world.world_records(SIZES, seed=0)) == _digest(zero)
    assert _digest(world.world_records(SIZES, seed=1)) == _digest(one) != _digest(zero)
    assert all(world.all_prompts(t) == sorted(world.all_prompts(t)) for t in world.TASK_SPECS)
