"""Configuration of ``train-ppo``: one small dataclass per concern (see examples/ppo/*.yaml)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from megatron_rlhf.distributed.layouts import ParallelSection
from megatron_rlhf.training.config import OptimConfig, RunConfig


@dataclass(kw_only=True)
class ModelsConfig:
    """Where each of the four roles comes from: HF BLOOM dirs, megatron-rlhf checkpoints, or a
    training run directory (its latest checkpoint is used). How every role is built (bf16,
    recompute, attention): ``train``, as in every command."""

    MOVED_KEYS: ClassVar[dict[str, str]] = {"attention_backend": "train.attention_backend"}
    """Keys this section once had, and where they are now (they load with a warning)."""

    actor: str
    """The SFT policy to optimise (LM head)."""
    reference: str | None = None
    """The frozen reference policy of the KL term; default: the actor's checkpoint."""
    critic: str
    """Initialisation of the critic: the AM/RM checkpoint or the SFT trunk (a new 1-output
    scalar head is created on its trunk)."""
    reward: str | None = None
    """The frozen reward model (1 output) or Advantage Model (2 outputs: r and e_tau)."""
    reward_fn: str | None = None
    """Instead of a reward model: ``package.module:function`` mapping (prompt_ids, response_ids)
    lists of token ids to a float score (rule-based rewards, tests with a known reward). The
    module is imported and run: a config naming one is code, trust it as such."""
    reward_kind: Literal["am", "rm"] = "am"
    """am: score = a = r - e_tau(x) (AM-PPO); rm: score = r (RM-PPO)."""
    tokenizer: str | None = None
    """Tokenizer directory (for sample dumps); default: the actor's checkpoint directory."""


@dataclass(kw_only=True)
class PromptDataConfig:
    """The PPO prompts."""

    prompts: str
    """Indexed prompt dataset prefix (tools/preprocess_data.py --kind prompt)."""
    max_prompt_length: int = 256
    """Longer prompts keep their last max_prompt_length tokens."""
    prompt_clusters: str | None = None
    """Output prefix of tools/build_rehearsal_clusters.py run on the same prompts in the same
    order: reward statistics are then also logged per prompt cluster."""


@dataclass(kw_only=True)
class RolloutConfig:
    """How the actor samples its responses each step."""

    prompts_per_step: int = 8
    """Prompts rolled out per PPO step over the whole world: the global batch (paper: 256),
    split evenly over the data-parallel ranks of the rollout and of every role."""
    max_new_tokens: int = 64
    """Most response tokens per prompt (EOS included)."""
    temperature: float = 1.0
    """Sampling temperature (> 0); log-probs of the update use the same one."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]; 1 samples from the whole vocabulary. Both engines
    record each sampled token's log-prob mu under the distribution it was drawn from (the
    temperature applied, the nucleus renormalised), and the score stage computes pi_old's for
    the importance weight pi_old/mu under the same transform, so the weight is 1 at staleness
    0; the PPO ratio and the KL reward use the untruncated distribution at the temperature
    (``ppo/scoring.py``: reading)."""
    engine: Literal["megatron", "vllm"] = "megatron"
    """Who generates. megatron: our KV-cached decode over Megatron-Core layers, in the rollout
    layout (``parallel.rollout``). vllm: vLLM (``pip install -e ".[vllm]"``; GPUs:
    ``".[vllm-gpu]"``) at the rollout layout's TP, one replica per rollout DP rank, the
    actor's weights copied to it in memory before every rollout (needs parallel.rollout.pp=1).
    Sampled tokens differ between the two (their samplers draw differently); greedy tokens and
    the log-probs of the same tokens agree."""
    decode_batch: int | None = None
    """Decode slots per rollout data-parallel rank (engine megatron): at most this many rows
    decode at once, and a row that ends (EOS or max_new_tokens) hands its KV-cache slot to a
    waiting prompt (continuous batching, ``generation/refill.py``); ended rows are compacted
    away only when a cost model (rows carried vs. KV bytes copied) says it pays. Set it below
    the rank's prompts (prompts_per_step / rollout DP) to bound the KV cache and keep the
    decode batch full while responses end early. None or 0: all of the rank's prompts decode
    at once. Tokens are the same either way (per-row seeds; log-probs up to float rounding).
    Needs parallel.rollout.pp=1."""
    sync_bucket_mb: float = 256
    """engine=vllm: the weight sync's bucket, in MiB per rank (> 0). Each vLLM rank receives
    only its TP shard of the actor, a bucket at a time: larger buckets mean fewer messages,
    smaller ones less memory in flight (one bucket of send and receive buffers a rank).
    Logged each step: rollout/sync_s, rollout/sync_bytes_per_rank (bytes written into this
    rank's engine: 1/TP of the model plus the replicated norms and biases) and
    rollout/sync_remote_bytes_per_rank (of those, received from other ranks)."""


@dataclass(kw_only=True)
class KLConfig:
    """The KL penalty -beta * KL(pi || pi_ref) of the shaped reward (Eq. 2)."""

    coef: float = 0.05
    """beta of Eq. 2 (initial value when adaptive)."""
    estimator: Literal["k1", "k2", "k3", "abs"] = "k1"
    """Per-token KL estimate: k1 = log-ratio, k2 = half squared log-ratio, k3 = Schulman's
    unbiased low-variance estimator, abs = |log-ratio|."""
    adaptive: bool = False
    """Adapt beta towards ``target`` (Ziegler et al. 2019's proportional controller)."""
    target: float = 6.0
    """Per-sequence KL the adaptive controller aims at."""
    horizon: int = 10000
    """Sequences over which the adaptive controller moves beta (its time constant)."""


@dataclass(kw_only=True)
class PPOConfig:
    """The policy/value update (and its rejection-sampling alternative); its micro-batches and
    packing are every pass's, in ``train``."""

    MOVED_KEYS: ClassVar[dict[str, str]] = {
        "micro_batch_size": "train.micro_batch_size",
        "packing": "train.packing",
        "max_tokens_per_micro_batch": "train.max_tokens_per_micro_batch",
    }
    """Keys this section once had, and where they are now (they load with a warning)."""

    algorithm: Literal["ppo", "rejection_sampling"] = "ppo"
    """ppo: clipped PPO with a critic; rejection_sampling: fine-tune on the best of several
    responses per prompt (Eqs. 3-4)."""
    epochs: int = 1
    """PPO epochs over each rollout batch."""
    num_minibatches: int = 1
    """Optimizer steps per epoch (each over 1/num_minibatches of the rollout batch)."""
    old_logprobs: Literal["auto", "rollout", "recompute"] = "auto"
    """Where log pi_old (the PPO ratio's denominator and the KL term's policy side) comes from.
    rollout: the log-probs the rollout computed for the tokens it sampled (same weights, at
    rollout.temperature; needs rollout.top_p=1, since at top_p < 1 they are of the nucleus
    renormalised), as TRL does: no actor forward in scoring (at BLOOM-560m's vocabulary, a
    fifth of a CPU PPO step). recompute: an actor forward over the finished sequences, as
    verl and OpenRLHF do; with bf16 weights a KV-cached decode and a full forward round
    differently (~1e-2 in a log-prob), so only recomputing makes the first ratio exactly 1.
    auto: rollout when the weights are fp32, rollout.top_p is 1 and rollout.engine is
    megatron (the two then agree to ~1e-6), else recompute (vLLM's log-probs differ from a
    Megatron forward by up to ~1e-3 on a trained model)."""
    rollout_correction: Literal["none", "token_tis", "seq_tis"] = "none"
    """How the update corrects for a behaviour policy mu (the rollout engine's: vLLM's
    kernels, a bf16 decode) that is not exactly pi_old. none: no weight. token_tis: each
    token's clipped policy term times min(pi_old/mu, rollout_correction_cap); seq_tis: times
    min(prod over the sequence of pi_old/mu, cap). The weights need pi_old recomputed
    (ppo.old_logprobs=recompute); with old_logprobs=rollout, pi_old is mu and every weight is
    1: the PPO ratio pi_theta/mu is then itself the importance weight toward the behaviour
    policy (clipped, not truncated). With a correction on, old_logprobs=auto takes the
    rollout's log-probs for any engine at rollout.top_p 1 (it no longer forces a recompute
    for vLLM). Both sides of pi_old/mu are of the distribution sampled from (temperature,
    top-p renormalised), so the weights are right at any rollout.temperature and top_p.
    Logged: rollout/is_weight_mean, is_weight_max, is_capped_fraction, kl_behaviour_old."""
    rollout_correction_cap: float = 2.0
    """Truncation of the importance weights (>= 1)."""
    clip_ratio: float = 0.2
    """epsilon of the clipped policy objective: ratios outside [1 - eps, 1 + eps] get no
    gradient."""
    value_clip: float = 0.2
    """Critic updates clip the new value to within this of the old value."""
    gamma: float = 1.0
    """Discount of the per-token rewards in GAE."""
    lam: float = 0.95
    """lambda of GAE (bias/variance trade-off of the advantage)."""
    lam_critic: float | None = None
    """lambda of the critic's targets (``async.value_targets`` gae and vtrace; suffix_is
    regresses on Monte-Carlo returns, lambda 1, and takes it for its V-trace fallback), in
    [0, 1]; None: ``lam``, so the critic regresses on the returns of the actor's GAE. VC-PPO
    (arXiv:2503.01491) and VAPO (arXiv:2504.05118) argue for 1.0: with lambda < 1 a long
    response's terminal reward reaches the early tokens' targets only through a critic still
    biased by its initialisation. None keeps a run's targets what they were before the key."""
    whiten_advantages: bool = True
    """Normalise advantages to mean 0, std 1 over the whole data-parallel batch."""
    reward_normalization: Literal["none", "moving_average"] = "none"
    """moving_average: the RM-PPO w/ MA baseline."""
    reward_ma_momentum: float = 0.9
    """Momentum of the running reward mean/std of ``moving_average``."""
    kl: KLConfig = field(default_factory=KLConfig)
    rejection_samples_per_prompt: int = 4
    """Rejection sampling (Eqs. 3-4): responses drawn per prompt."""
    rejection_threshold: float | None = None
    """Keep the best response of each prompt if its score >= this (None: always keep it)."""


@dataclass(kw_only=True)
class PlacementConfig:
    """Which ranks hold what (ppo/placement.py)."""

    mode: Literal["colocated", "disaggregated"] = "colocated"
    """colocated: every rank holds every role and generates between updates. disaggregated:
    the last ``rollout_ranks`` ranks hold only the rollout engine (ours, in
    ``parallel.rollout``'s layout over those ranks), the others
    the actor, reference, critic and reward in their layouts over the remaining ranks; samples
    travel to the training ranks and the actor's weights back (shard to shard). With
    ``async.max_staleness`` >= 1 generation overlaps the update; at 0 the two sets take
    turns."""
    rollout_ranks: int = 0
    """Ranks of the rollout engine (disaggregated only; >= 1 and fewer than the world)."""


@dataclass(kw_only=True)
class AsyncConfig:
    """Bounded-staleness PPO (config key ``async``; ppo/staleness.py): the rollout trained at
    step t was generated by the actor of step t - s, s <= max_staleness. Colocated, the actor
    generates between its own updates, so that gives the staleness (and its corrections), not
    overlap; ``placement.mode=disaggregated`` overlaps generation with the update."""

    max_staleness: int = 0
    """Largest s (>= 0): 0 is the synchronous step (generate, then train on it); 1 is
    one-step-off; N keeps N rollouts in flight, generated N steps ahead of their update."""
    value_targets: Literal["gae", "vtrace", "suffix_is"] = "gae"
    """What the critic regresses on (ppo/correction.py's critic targets; the actor's
    advantages are GAE(gamma, ppo.lam) on the rollout's samples whichever): gae: GAE(gamma,
    ppo.lam_critic)'s returns, as if the samples were pi_old's (on stale samples the critic then
    learns the value of the behaviour policy mu); vtrace: V-trace's targets (rho_bar = is_cap,
    c_bar = 1, lambda = ppo.lam_critic; ppo/advantages.py: vtrace), whose fixed point is the
    value of pi_old where pi_old/mu <= is_cap; suffix_is: each state's Monte-Carlo return
    (gamma, lambda 1) in a weighted MSE, weighted by min(prod of pi_old/mu over the rest of
    the response, its own token included, suffix_cap) self-normalised over the batch's tokens
    (ppo/advantages.py: suffix_is_targets), toward the value of pi_old; below min_ess it falls
    back to vtrace for the batch. When mu is pi_old, vtrace's targets are gae's (to rounding)
    and suffix_is's the plain Monte-Carlo returns, unweighted. vtrace, and suffix_is with
    min_ess > 0, need is_cap >= 1."""
    is_cap: float = 2.0
    """With max_staleness >= 1: the cap of the importance weight pi_old/mu on the policy term
    (pi_old: the current actor, recomputed; mu: the rollout's behaviour log-probs), see
    is_mode, and V-trace's rho_bar (its c_bar is 1); >= 1, or 0 for no weight (the correction
    off: PPO clipped around the current actor as if the samples were its own)."""
    is_mode: Literal["clip", "mask"] = "clip"
    """What a token whose weight pi_old/mu is above is_cap gets (per sequence with
    ppo.rollout_correction=seq_tis): clip: the weight is_cap (truncated importance sampling,
    TIS); mask: 0, the token leaves the policy term (AReaL's behaviour mask; it still counts
    in the token mean's denominator)."""
    suffix_cap: float = 5.0
    """value_targets=suffix_is: the truncation C of a state's weight min(prod pi_old/mu, C)
    (> 0)."""
    min_ess: float = 0.1
    """value_targets=suffix_is: when the effective sample size of the batch's weights,
    (sum w)^2 / (N sum w^2) over its N response tokens, is below this (in [0, 1]; 0: never),
    the critic regresses on V-trace's targets for that batch instead (logged:
    critic/suffix_ess, critic/vtrace_fallback 0 or 1)."""


@dataclass(kw_only=True)
class RehearsalSection:
    """Selective Rehearsal (paper §3.2)."""

    enabled: bool = False
    """Selective Rehearsal: add gamma * NLL(D_R batch) to the actor loss (Eq. 9)."""
    dataset: str | None = None
    """Indexed SFT dataset D_R (tools/build_rehearsal_clusters.py output prefix)."""
    gamma: float = 0.01
    """γ of Eq. 9 (the paper: 0.01); what it weighs depends on ``nll_reduction``."""
    nll_reduction: Literal["sum", "mean"] = "sum"
    """sum (the paper's Eq. 9): NLL summed over a sequence's response tokens, averaged over the
    rehearsal rows, so γ weighs every token and the term grows with response length; mean: the
    per-token NLL (a token mean, like the PPO loss), so γ weighs the average token and
    γ_mean ≈ γ_sum × mean response length pulls as hard (see ppo/losses.py)."""
    micro_batch_size: int = 2
    """Rehearsal rows added to each actor microbatch."""
    max_length: int = 512
    """Longest rehearsal row; a longer one loses prompt tokens from the left (its response is
    kept, and at least one prompt token), so every row still trains its response."""


@dataclass(kw_only=True)
class TrainSection(RunConfig):
    """The run (``train``, as in every command: training/config.py ``RunConfig``, how every
    role is built and batched included): its steps, samples and train-ppo's defaults."""

    steps: int = 100
    """PPO steps (the paper: 100 actor steps)."""
    output_dir: str = "runs/ppo"
    """Checkpoints (step_N), metrics.jsonl, samples.jsonl and TensorBoard logs go here."""
    micro_batch_size: int = 4
    """Sequences per scoring and update forward/backward pass of every role (per data-parallel
    rank)."""
    save_interval: int = 50
    """Checkpoint every this many steps and at the end (0: only at the end)."""
    log_interval: int = 1
    """Write TensorBoard scalars and metrics.jsonl every this many steps and at the end (the
    progress bar moves every step)."""
    sample_interval: int = 10
    """Dump (prompt, response, score) samples to samples.jsonl every this many steps and at the
    end (0: only at the end)."""

    def problems(self) -> list[str]:
        """What is wrong with the section's counts. The intervals follow training/run.py's
        ``Run.due`` (0: only at the end), as in train-sft and train-reward."""
        return [
            f"train.{key}={getattr(self, key)} must be >= {least}"
            for key, least in (
                ("steps", 1), ("save_interval", 0), ("log_interval", 1), ("sample_interval", 0),
            )
            if getattr(self, key) < least
        ] + self.save_at_problems()  # fmt: skip


@dataclass(kw_only=True)
class TrainPPOConfig:
    """``train-ppo``: every section of one run (``--print-config`` lists each key)."""

    models: ModelsConfig
    parallel: ParallelSection = field(default_factory=ParallelSection)
    data: PromptDataConfig
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    rehearsal: RehearsalSection = field(default_factory=RehearsalSection)
    async_: AsyncConfig = field(default_factory=AsyncConfig, metadata={"key": "async"})
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    actor_optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=5e-7))
    critic_optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=5e-6))
    train: TrainSection = field(default_factory=TrainSection)
