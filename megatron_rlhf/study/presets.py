"""Sizes of the study: ``quick`` (CI, minutes on 2 CPU cores) and ``full`` (the published run).
The demo (``megatron_rlhf/demo.py``) runs the same world at its own single-seed size."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(kw_only=True)
class Preset:
    """Everything the study's size depends on; written into results.json."""

    seeds: int = 3
    """Seeds: reward-model init and data order, PPO sampling and evaluation sampling. Every seed
    runs the core: Table 1's RM and AM, D_R, and the arms of ``run.ARMS``."""
    worlds: int = 1
    """Worlds the seeds are nested in: each its own SFT data, preference data, held-out sets and
    SFT policy (``world.world_records`` at world seed ``first_world + w``). Seed ``s`` is in
    world ``(s - first_seed) % worlds``, so the first N seeds of any subset spread over the
    worlds."""
    first_world: int = 0
    """World seeds are first_world .. first_world + worlds - 1 (a development run takes worlds
    of its own, e.g. ``--first-world 100``)."""
    exploratory_seeds: int = 1
    """How many of the seeds (the first ones) also run the exploratory arms
    (``run.exploratory_arms``: the positive control at the paper's gamma, rehearsal on RM-PPO,
    rejection sampling, and the PPO-settings grid if ``ppo_grid`` has settings)."""
    attribution_seeds: int = 1
    """How many of the seeds (the first ones) run the attribution arms at ``attribution_gamma``
    (``run.attribution_arms``: selective, random, family-stratified and positive-control
    rehearsal, a no-rehearsal arm at a KL coefficient matched to SR's KL, and the dose)."""
    curve_seeds: int = 1
    """How many of the seeds (the first ones) run the hacking curves: one RM-PPO and one AM-PPO
    run of ``curve_steps[-1]`` steps, judged at every step of ``curve_steps``."""
    extra_reward_seeds: int = 1
    """How many of the seeds (the first ones) train the over-trained RM and AM and the margin
    sweep of Table 1 (two thirds of a seed's reward-model time)."""
    first_seed: int = 0
    """The seeds are first_seed .. first_seed + seeds - 1: a development set for choosing
    settings (e.g. ``--first-seed 100``) never overlaps the reporting seeds 0 .. seeds - 1."""
    sft_per_task: int = 300
    """SFT demonstrations per task family (all five; ``world.world_records``)."""
    pref_train_per_task: int = 300
    """Training preference pairs per preference family (four)."""
    pref_test_per_task: int = 100
    """Held-out preference pairs per preference family (Table 1)."""
    minor_test_per_task: int = 60
    """Held-out forget-set prompts per minor skill (the primary forget endpoint)."""
    ppo_prompts: int = 512
    """PPO prompts in all, skewed by ``world.PPO_SHARES`` (also the pool D_R is curated from)."""
    main_test_per_task: int = 75
    """Held-out main-set prompts per preference family (4 x 75 = 300)."""
    forget_test_per_task: int = 60
    """Held-out forget-set prompts per preference family (main-family transfer)."""
    vocab_size: int = 600
    """BPE vocabulary trained on the world's text."""
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    sft_steps: int = 250
    sft_lr: float = 3e-3
    sft_batch: int = 32
    reward_epochs: float = 1.0
    """Epochs of the Table 1 RM and AM."""
    long_epochs: float = 4.0
    """Epochs of the over-trained RM and AM (the exploratory over-training claims)."""
    reward_lr: float = 1e-3
    reward_batch: int = 32
    margins: tuple[float, ...] = (1.5, 4.0, 8.0)
    """Extra AM margins m (the Table 1 AM uses the paper's 2.5)."""
    clusters: int = 8
    """c of the main AM-PPO-SR arm."""
    top_k: int = 4
    """k of the main AM-PPO-SR arm."""
    attribution_gamma: float = 0.1
    """The rehearsal weight of the attribution arms: where rehearsal moves the minor skills
    (the v3 dose), unlike the paper's 0.01."""
    gammas: tuple[float, ...] = (1.0,)
    """The rest of the dose: AM-PPO-SR at these gamma too, on the attribution seeds."""
    kl_matched_coefs: tuple[float, ...] = (0.2,)
    """KL coefficients of the anchoring control: AM-PPO without rehearsal held closer to SFT
    by a larger beta (one: ``am_ppo_kl``; several, for a development run: ``am_ppo_kl<coef>``).
    The issue asked for the beta that matches SR's KL to SFT; the development run (README,
    "How the anchoring control was chosen") found SR at gamma 0.1 *farther* from SFT in KL
    (0.76) than AM-PPO (0.43), so no raised beta matches it. 0.2 (10x the shared beta) holds
    the policy at a quarter of SR's KL (0.19): a control anchored more than SR, so SR beating
    it on the minor skills is more than anchoring."""
    curve_steps: tuple[int, ...] = (5, 10, 20, 40)
    """PPO steps at which the hacking curves are judged (the run takes the last)."""
    ppo_grid: tuple[dict, ...] = ()
    """PPO settings besides ``ppo`` at which RM-PPO and AM-PPO are also compared on the
    exploratory seeds (v3 ran lr 1e-4 / 3e-4 crossed with 10 / 20 steps: README)."""
    sweep_clusters: tuple[int, ...] = (2, 4, 8, 16)
    """Fig. 6: cluster counts, at fixed k and at fixed c*k (empty: no sweep)."""
    sweep_seeds: int = 3
    """How many of the seeds (the first ones) run the Fig. 6 sweep."""
    ppo: dict = field(default_factory=lambda: {
        "steps": 20, "prompts_per_step": 32, "max_new_tokens": None, "micro_batch_size": 16,
        "num_minibatches": 2, "kl_coef": 0.02, "actor_lr": 1e-4, "critic_lr": 1e-3,
        "rehearsal_gamma": 0.01, "rehearsal_micro_batch_size": 4, "rejection_samples": 4,
    })  # fmt: skip
    """What every PPO arm shares (same beta, learning rate and steps). ``max_new_tokens``
    None: the data's generation budget (``stages.generation_budget``: above the longest SFT
    demonstration of every family), for PPO, D_R's SFT responses and evaluation alike.

    Actor lr 1e-4 and 20 steps were chosen on development seeds 100-101 in the v2 world
    (issue 20; README, "How the PPO setting was chosen") and are kept in the v3 world; because
    the AM-vs-RM direction flipped across those settings, ``ppo_grid`` now runs RM-PPO and
    AM-PPO at the other three (lr 1e-4 / 3e-4 crossed with 10 / 20 steps) on the exploratory
    seeds, and the report gives every setting's comparison."""
    tie_margin: float = 0.1
    """Gold judge: |g(policy) - g(SFT)| <= tie_margin * scale_t is a tie."""
    max_length: int = 96
    """Longest prompt + response in tokens (SFT and preference data)."""
    threads: int = 1
    """torch intra-op threads (one is fastest for these tiny models)."""


TABLE1_MARGINS = {1.5: "am_m1.5", 2.5: "am", 4.0: "am_m4", 8.0: "am_m8"}
"""AM margin m -> the study's reward-model name (Table 1's AM uses the paper's m = 2.5)."""


def seed_range(preset: Preset) -> range:
    return range(preset.first_seed, preset.first_seed + preset.seeds)


def _among_first(preset: Preset, seed: int, count: int) -> bool:
    """Whether ``seed`` is one of the first ``count`` seeds of the preset."""
    return seed - preset.first_seed < count


def runs_exploratory(preset: Preset, seed: int) -> bool:
    return _among_first(preset, seed, preset.exploratory_seeds)


def runs_extra_rewards(preset: Preset, seed: int) -> bool:
    return _among_first(preset, seed, preset.extra_reward_seeds)


def runs_sweep(preset: Preset, seed: int) -> bool:
    """Whether ``seed`` runs Fig. 6's sweep (one of the first ``sweep_seeds``, if it sweeps)."""
    return _among_first(preset, seed, preset.sweep_seeds) and bool(preset.sweep_clusters)


def runs_attribution(preset: Preset, seed: int) -> bool:
    return _among_first(preset, seed, preset.attribution_seeds)


def runs_curves(preset: Preset, seed: int) -> bool:
    return _among_first(preset, seed, preset.curve_seeds)


def world_of(preset: Preset, seed: int) -> int:
    """The world index (0 .. worlds - 1) seed ``seed`` is nested in."""
    return (seed - preset.first_seed) % preset.worlds


def world_seed(preset: Preset, world: int) -> int:
    """The seed ``world.world_records`` builds world index ``world`` from."""
    return preset.first_world + world


PRESETS = {
    # CI: two worlds (the nesting runs end to end), SFT's loss is flat from ~150 steps, PPO runs
    # 8 of the frozen setting's 20 steps, and the reward models (two thirds of the CPU time)
    # train on 200 pairs per task with the over-trained pair at 3 epochs.
    "quick": Preset(
        seeds=3,
        worlds=2,
        sft_steps=160,
        pref_train_per_task=200,
        long_epochs=3.0,
        sweep_seeds=1,
        curve_steps=(2, 4, 8),
        ppo={**Preset().ppo, "steps": 8},
    ),
    "full": Preset(
        # v4 (issue 50): 3 worlds x 10 seeds. The core's 30 seeds are above the v3 power rule's
        # counts at v3's effects (AM vs RM main 22, SR main 8); the attribution arms and the
        # dose run on 21 seeds (7 a world), the hacking curves on 15 (5 a world). Budget and
        # the development run that fixed it: README, "How many seeds".
        seeds=30,
        worlds=3,
        exploratory_seeds=6,
        attribution_seeds=21,
        curve_seeds=15,
        extra_reward_seeds=3,
        sft_per_task=450,
        pref_train_per_task=450,
        pref_test_per_task=500,
        ppo_prompts=640,
        main_test_per_task=100,
        forget_test_per_task=80,
        minor_test_per_task=200,
        hidden=96,
        sft_steps=400,
        sweep_seeds=3,
    ),  # fmt: skip
}
