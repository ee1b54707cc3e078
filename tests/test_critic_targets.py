"""The critic's targets on stale samples and the actor's weight (issue 48, item 2), in process:
``async.value_targets`` gae / vtrace / suffix_is (ppo/correction.py's objects, chosen by
ppo/roles.py ``critic_targets``), the ESS fallback, ``async.is_mode=mask``, and the synchronous
default path unchanged. References in float64."""

from __future__ import annotations

import math

import pytest
import torch
from megatron_rlhf.kernels import gae, masked_whiten

from megatron_rlhf.ppo.advantages import compute_advantages, suffix_is_targets
from megatron_rlhf.ppo.correction import (
    GAETargets,
    StaleCorrection,
    SuffixISTargets,
    VTraceTargets,
)
from megatron_rlhf.ppo.experience import Experience
from megatron_rlhf.ppo.losses import behaviour_correction, value_loss


def _config(*overrides: str):
    """A train-ppo config (only the keys these tests read matter) with ``overrides``."""
    from megatron_rlhf.config import load_config
    from megatron_rlhf.ppo.config import TrainPPOConfig

    required = ["models.actor=a", "models.critic=a", "data.prompts=p"]
    return load_config(TrainPPOConfig, None, required + list(overrides))


def _experience(rewards, values, mask, log_pi, log_mu) -> Experience:
    """A batch of (B, T) responses with the fields the critic's targets read (prompt: 1 token)."""
    batch, length = mask.shape
    return Experience(
        sequences=torch.zeros(batch, 1 + length, dtype=torch.long),
        attention_mask=torch.ones(batch, 1 + length, dtype=torch.long),
        response_mask=mask,
        prompt_index=torch.arange(batch),
        prompt_length=1,
        rollout_logprobs=log_mu,
        logprobs=log_pi,
        rewards=rewards,
        values=values,
    )


def _ragged(batch: int, length: int, generator) -> torch.Tensor:
    """(batch, length) float64 response mask: each row 1..1 0..0, lengths 0 to length."""
    lengths = torch.randint(0, length + 1, (batch,), generator=generator)
    lengths[0], lengths[-1] = length, 0
    return (torch.arange(length)[None, :] < lengths[:, None]).double()


def _monte_carlo(rewards, mask, gamma: float) -> torch.Tensor:
    """G_t = sum_{k>=t} gamma^(k-t) r_k, a float64 loop."""
    out = torch.zeros_like(rewards, dtype=torch.float64)
    for b in range(rewards.shape[0]):
        following = 0.0
        for t in range(rewards.shape[1] - 1, -1, -1):
            if mask[b, t]:
                following = float(rewards[b, t]) + gamma * following
                out[b, t] = following
    return out


def _gae_loop(rewards, values, mask, gamma: float, lam: float) -> tuple:
    """GAE's (advantages, returns), a float64 loop (V after the response is 0)."""
    advantages = torch.zeros_like(rewards, dtype=torch.float64)
    for b in range(rewards.shape[0]):
        following, next_value = 0.0, 0.0
        for t in range(rewards.shape[1] - 1, -1, -1):
            if mask[b, t]:
                v = float(values[b, t])
                delta = float(rewards[b, t]) + gamma * next_value - v
                following = delta + gamma * lam * following
                advantages[b, t], next_value = following, v
    return advantages, advantages + values.double() * mask


def test_suffix_is_at_staleness_zero_is_monte_carlo_regression():
    """mu = pi_old (the log-probs are the same tensor): every weight is exactly 1, the targets
    are the plain Monte-Carlo returns (the float64 loop, to 1e-12: the kernel sums by
    matmuls), the weighted value loss is the unweighted one bit for bit and the float64 mean
    of 0.5 max((V - G)^2, (clip(V) - G)^2); ESS 1, no fallback. Ragged rows, gamma < 1."""
    g = torch.Generator().manual_seed(3)
    batch, length, gamma = 9, 11, 0.97
    mask = _ragged(batch, length, g)
    rewards = torch.randn(batch, length, generator=g, dtype=torch.float64) * mask
    values = torch.randn(batch, length, generator=g, dtype=torch.float64) * mask
    log_pi = -torch.rand(batch, length, generator=g, dtype=torch.float64)
    experience = _experience(rewards, values, mask, log_pi, log_pi)
    fallback = VTraceTargets(gamma, 0.95, rho_bar=2.0)
    metrics = SuffixISTargets(gamma, cap=5.0, min_ess=0.1, fallback=fallback)(experience)
    assert metrics == {"critic/suffix_ess": 1.0, "critic/vtrace_fallback": 0.0}
    assert torch.equal(experience.value_weights, mask)
    want = _monte_carlo(rewards, mask, gamma)
    torch.testing.assert_close(experience.returns, want, rtol=0, atol=1e-12)
    new_values = values + 0.3 * torch.randn(batch, length, generator=g, dtype=torch.float64)
    weighted, _ = value_loss(new_values, values, experience.returns, mask, 0.2, weights=mask)
    plain, _ = value_loss(new_values, values, experience.returns, mask, 0.2)
    assert torch.equal(weighted, plain)
    clipped = values + (new_values - values).clamp(-0.2, 0.2)
    errors = torch.maximum((new_values - want).square(), (clipped - want).square())
    reference = 0.5 * float((errors * mask).sum() / mask.sum())
    assert float(weighted) == pytest.approx(reference, rel=1e-12)


def test_suffix_weights_span_the_rest_of_the_response_and_are_self_normalised():
    """w_t = min(prod_{k=t}^{T-1} pi/mu, cap) (its own token included), scaled so that their
    mean over the batch's response tokens is 1; ESS = (sum w)^2 / (N sum w^2); the weighted
    loss is the float64 weighted mean. Loops in float64."""
    g = torch.Generator().manual_seed(5)
    batch, length, cap = 7, 6, 3.0
    mask = _ragged(batch, length, g)
    rewards = torch.randn(batch, length, generator=g, dtype=torch.float64) * mask
    log_ratio = 0.6 * torch.randn(batch, length, generator=g, dtype=torch.float64)
    returns, weights, ess = suffix_is_targets(rewards, mask, log_ratio, 1.0, cap)
    raw = torch.zeros(batch, length, dtype=torch.float64)
    for b in range(batch):
        for t in range(length):
            if mask[b, t]:
                product = math.prod(
                    math.exp(float(log_ratio[b, k])) for k in range(t, length) if mask[b, k]
                )
                raw[b, t] = min(product, cap)
    assert (raw[mask.bool()] == cap).any() and (raw[mask.bool()] < cap).any()
    n, total = float(mask.sum()), float(raw.sum())
    torch.testing.assert_close(weights, raw * n / total, rtol=1e-12, atol=0)
    assert ess == pytest.approx(total**2 / (n * float(raw.square().sum())), rel=1e-12)
    torch.testing.assert_close(returns, _monte_carlo(rewards, mask, 1.0), rtol=0, atol=1e-12)
    values = torch.randn(batch, length, generator=g, dtype=torch.float64)
    loss, _ = value_loss(values, values, returns, mask, 0.2, weights=weights)
    reference = 0.5 * float((weights * (values - returns).square() * mask).sum()) / n
    assert float(loss) == pytest.approx(reference, rel=1e-12)


class _TokenMDP:
    """A response of at most 4 tokens over {0, 1, EOS=2}, each drawn by a policy that depends on
    its position; the state is the prefix (15 of them: 0/1 strings of length 0-3). Each token
    earns ``STEP[a]`` (0.1 for a 1), the last one also the score: the share of 1s among the 4
    places, plus 0.3 for an EOS after at least two tokens. pi prefers 1, mu 0; pi/mu <= 2 (the
    trainer's default is_cap, so V-trace's fixed point is V^pi itself); prod over a response
    <= 16. V^pi and V^mu differ by 0.14-0.37 over the states."""

    length, eos = 4, 2
    pi = torch.tensor([[0.2, 0.6, 0.2], [0.2, 0.6, 0.2], [0.2, 0.7, 0.1], [0.1, 0.8, 0.1]])
    mu = torch.tensor([[0.4, 0.3, 0.3], [0.4, 0.35, 0.25], [0.45, 0.4, 0.15], [0.5, 0.4, 0.1]])
    step = (0.0, 0.1, 0.0)

    @classmethod
    def score(cls, tokens: list[int]) -> float:
        body = [t for t in tokens if t != cls.eos]
        return sum(body) / cls.length + (0.3 if tokens[-1] == cls.eos and len(body) >= 2 else 0)

    @staticmethod
    def state(prefix: list[int]) -> int:
        return 2 ** len(prefix) - 1 + sum(bit << i for i, bit in enumerate(reversed(prefix)))

    @classmethod
    def value(cls, policy: torch.Tensor) -> torch.Tensor:
        """V^policy of every state, exactly: the expectation over the tree of responses."""
        table = torch.zeros(2**cls.length - 1, dtype=torch.float64)

        def expected(prefix: list[int]) -> float:
            total = 0.0
            for token in range(3):
                tokens, p = prefix + [token], float(policy[len(prefix), token])
                ends = token == cls.eos or len(tokens) == cls.length
                total += p * (cls.step[token] + (cls.score(tokens) if ends else expected(tokens)))
            table[cls.state(prefix)] = total
            return total

        expected([])
        return table

    @classmethod
    def episodes(cls, count: int, seed: int) -> tuple:
        """``count`` responses of mu, right-padded: (states (-1 on padding), rewards, log pi,
        log mu, mask), float64."""
        g = torch.Generator().manual_seed(seed)
        shape = (count, cls.length)
        states = torch.full(shape, -1, dtype=torch.long)
        rewards, log_pi, log_mu = (torch.zeros(shape, dtype=torch.float64) for _ in range(3))
        prefix_value, ones = torch.zeros(count, dtype=torch.long), torch.zeros(count)
        alive = torch.ones(count, dtype=torch.bool)
        for t in range(cls.length):
            rows = alive.nonzero()[:, 0]
            token = torch.multinomial(cls.mu[t], rows.shape[0], replacement=True, generator=g)
            states[rows, t] = 2**t - 1 + prefix_value[rows]
            log_pi[rows, t] = cls.pi[t, token].double().log()
            log_mu[rows, t] = cls.mu[t, token].double().log()
            rewards[rows, t] = torch.tensor(cls.step, dtype=torch.float64)[token]
            ones[rows] += (token == 1).float()
            ends = (token == cls.eos) | (t == cls.length - 1)
            bonus = 0.3 * float(t >= 2) * (token == cls.eos).double()  # t tokens before EOS
            rewards[rows[ends], t] += (ones[rows] / cls.length).double()[ends] + bonus[ends]
            prefix_value[rows] = 2 * prefix_value[rows] + token.clamp(max=1)
            alive[rows[ends]] = False
        return states, rewards, log_pi, log_mu, (states >= 0).double()


def _fit(targets, batch: tuple, sweeps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Fitted value iteration of a table on ``batch`` with the trainer's target object: each
    sweep sets V(s) to the weighted mean sum w G / sum w of the targets at the visits of s
    (w = ``value_weights``, 1 when None: the minimiser of the weighted MSE), the targets
    computed from the previous table. (table, each state's standard error at the last sweep:
    sqrt(sum w^2 (G - V)^2) / sum w)."""
    states, rewards, log_pi, log_mu, mask = batch
    visited = mask.bool()
    index = states[visited]
    table = torch.zeros(2**_TokenMDP.length - 1, dtype=torch.float64)
    for _ in range(sweeps):
        values = table[states.clamp(min=0)] * mask
        experience = _experience(rewards, values, mask, log_pi, log_mu)
        targets(experience)
        weights = mask if experience.value_weights is None else experience.value_weights
        w, g = weights[visited], experience.returns[visited]
        total = torch.zeros_like(table).index_add_(0, index, w)
        table = torch.zeros_like(table).index_add_(0, index, w * g) / total
    spread = torch.zeros_like(table).index_add_(0, index, (w * (g - table[index])).square())
    return table, spread.sqrt() / total


EPISODES = 40_000
"""mu's responses in the tabular test: every state is visited ~1,600 times or more (the
3-token prefix of 1s: 0.3 x 0.35 x 0.4 of the responses; 1,591 with seed 0), so each fit's
standard error is <= 0.006 per state (measured; suffix IS's, with products up to 16, the
largest)."""


def test_on_mu_samples_gae_learns_v_mu_while_vtrace_and_suffix_is_learn_v_pi():
    """A table fitted to the trainer's target objects on 40,000 responses of mu: GAE's returns
    (lambda 1, Monte Carlo, and lambda 0.9) converge to V^mu; V-trace's (rho_bar 2 = max pi/mu,
    c_bar 1; lambda 1 and 0.9) and suffix IS's (cap 1e6: untruncated) to V^pi, each within 4
    of its own standard errors per state + 1e-3 (and 0.05 absolute), while V^pi and V^mu differ
    by 0.14-0.37. Measured (seed 0): max |fit - V^mu| 0.006 for both GAE arms (root 0.362,
    V^mu 0.364); max |fit - V^pi| 0.007 for both V-trace arms (root 0.727, V^pi 0.733) and
    0.011 for suffix IS (root 0.722); standard errors <= 0.006. With the trainer's default
    suffix_cap 5 the truncated products pull the states early in the response toward mu's
    value: root 0.632, max |fit - V^pi| 0.10 (asserted: the root between V^mu and V^pi)."""
    mdp = _TokenMDP
    v_pi, v_mu = mdp.value(mdp.pi), mdp.value(mdp.mu)
    assert (v_pi - v_mu).abs().min() > 0.14
    batch = mdp.episodes(EPISODES, seed=0)
    lam = 0.9
    arms = {
        "gae lambda 1": (GAETargets(1.0, 1.0), v_mu, 1),
        "gae lambda 0.9": (GAETargets(1.0, lam), v_mu, 8),
        "vtrace lambda 1": (VTraceTargets(1.0, 1.0, rho_bar=2.0), v_pi, 8),
        "vtrace lambda 0.9": (VTraceTargets(1.0, lam, rho_bar=2.0), v_pi, 8),
        "suffix_is": (SuffixISTargets(1.0, 1e6, 0.0, VTraceTargets(1.0, lam, 2.0)), v_pi, 1),
    }
    for name, (targets, want, sweeps) in arms.items():
        table, standard_error = _fit(targets, batch, sweeps)
        error = (table - want).abs()
        assert (error <= 4 * standard_error + 1e-3).all(), (name, error, standard_error)
        assert error.max() < 0.05, (name, error)
        other = v_mu if want is v_pi else v_pi
        assert (table - other).abs().min() > 0.1, name
    truncated, _ = _fit(SuffixISTargets(1.0, 5.0, 0.0, VTraceTargets(1.0, lam, 2.0)), batch, 1)
    root = mdp.state([])
    assert v_mu[root] < truncated[root] < v_pi[root]


def test_the_critic_falls_back_to_vtrace_below_min_ess_and_not_above():
    """The batch's ESS (the float64 formula on the explicit suffix products) against
    async.min_ess just above and just below it: below, the targets are V-trace's (bit for bit
    VTraceTargets' on the same batch), unweighted, and critic/vtrace_fallback is 1; above (and
    at min_ess 0), suffix IS's weighted Monte-Carlo targets and 0."""
    g = torch.Generator().manual_seed(8)
    batch, length = 6, 5
    mask = _ragged(batch, length, g)
    rewards = torch.randn(batch, length, generator=g, dtype=torch.float64) * mask
    values = torch.randn(batch, length, generator=g, dtype=torch.float64) * mask
    log_pi = -torch.rand(batch, length, generator=g, dtype=torch.float64)
    log_mu = log_pi - 0.8 * torch.randn(batch, length, generator=g, dtype=torch.float64)
    weights = []
    for b in range(batch):
        for t in range(length):
            if mask[b, t]:
                rest = [k for k in range(t, length) if mask[b, k]]
                weights.append(
                    min(math.exp(sum(float(log_pi[b, k] - log_mu[b, k]) for k in rest)), 5.0)
                )
    ess = sum(weights) ** 2 / (len(weights) * sum(w * w for w in weights))
    assert 0.05 < ess < 0.95
    vtrace = VTraceTargets(1.0, 0.95, rho_bar=2.0)
    want = _experience(rewards, values, mask, log_pi, log_mu)
    vtrace(want)
    for min_ess, falls_back in ((ess * 1.001, True), (ess * 0.999, False), (0.0, False)):
        experience = _experience(rewards, values, mask, log_pi, log_mu)
        metrics = SuffixISTargets(1.0, 5.0, min_ess, vtrace)(experience)
        assert metrics["critic/suffix_ess"] == pytest.approx(ess, rel=1e-12)
        assert metrics["critic/vtrace_fallback"] == float(falls_back)
        if falls_back:
            assert torch.equal(experience.returns, want.returns)
            assert experience.value_weights is None
        else:
            torch.testing.assert_close(experience.returns, _monte_carlo(rewards, mask, 1.0))
            assert experience.value_weights is not None
            assert not torch.equal(experience.value_weights, mask)


@pytest.mark.parametrize("mode", ["token_tis", "seq_tis"])
def test_is_mode_mask_zeroes_exactly_the_tokens_above_the_cap(mode):
    """async.is_mode=mask: the weight of a token (with seq_tis: of every token of a sequence)
    whose pi_old/mu is above async.is_cap is 0 and every other token's is its ratio, the
    same as is_mode=clip's there (clip gives the cap above it); through the StaleCorrection
    the trainer holds. is_capped_fraction counts the masked tokens."""
    g = torch.Generator().manual_seed(13)
    batch, length, cap = 8, 6, 2.0
    mask = _ragged(batch, length, g)
    old = -torch.rand(batch, length, generator=g, dtype=torch.float64) * 2
    mu = old - 0.9 * torch.randn(batch, length, generator=g, dtype=torch.float64)
    log_ratio = (old - mu) * mask
    ratio = log_ratio.exp() if mode == "token_tis" else log_ratio.sum(1, keepdim=True).exp()
    ratio = ratio.expand_as(mask) * mask
    above = (ratio > cap) & mask.bool()
    assert above.any() and (mask.bool() & ~above).any()
    config = _config(
        "async.max_staleness=1", "async.is_mode=mask", f"async.is_cap={cap}",
        f"ppo.rollout_correction={mode}", f"ppo.rollout_correction_cap={cap}",
    )  # fmt: skip
    experience = _experience(None, None, mask, old, mu)
    experience.policy_version = torch.zeros(batch, dtype=torch.long)
    masked, metrics = StaleCorrection(config.ppo, config.async_)(experience, step=1)
    clipped, _ = behaviour_correction(old, mu, mask, mode, cap, "clip")
    assert torch.equal(masked == 0, above | ~mask.bool())
    torch.testing.assert_close(masked[~above], ratio[~above], rtol=1e-12, atol=0)
    torch.testing.assert_close(clipped[~above], masked[~above], rtol=0, atol=0)
    assert (clipped[above] == cap).all()
    n = float(mask.sum())
    assert metrics["async/is_capped_fraction"] == pytest.approx(float(above.sum()) / n)
    m2 = float((log_ratio.square() * mask).sum()) / n
    assert metrics["async/log_ratio_m2"] == pytest.approx(m2, rel=1e-12)


def test_synchronous_default_targets_are_gae_returns_bit_for_bit():
    """The default config (async.max_staleness 0, value_targets gae, ppo.lam_critic null):
    compute_advantages and the critic-target object ppo/roles.py builds give the whitened
    GAE(gamma, lam) advantages and GAE's returns bit for bit as one call of the kernel (what
    the step computed before the critic had its own targets), which equal a float64 loop
    (1e-12); float32 as the trainer holds them, and float64. ppo.lam_critic=1 changes the
    returns only."""
    from megatron_rlhf.ppo.control import KLController, RewardNormalizer
    from megatron_rlhf.ppo.roles import critic_targets

    config = _config("ppo.gamma=0.99")
    ppo = config.ppo
    assert ppo.lam_critic is None and config.async_.value_targets == "gae"
    targets = critic_targets(config)
    assert targets == GAETargets(0.99, ppo.lam)
    g = torch.Generator().manual_seed(21)
    batch, length = 10, 13
    mask = _ragged(batch, length, g)
    log_pi = -torch.rand(batch, length, generator=g)
    for dtype in (torch.float32, torch.float64):
        m = mask.to(dtype)
        experience = _experience(None, None, m, log_pi.to(dtype), log_pi.to(dtype))
        experience.ref_logprobs = (log_pi - 0.1).to(dtype)
        experience.values = torch.randn(batch, length, generator=g).to(dtype) * m
        experience.scores = torch.randn(batch, generator=g).to(dtype)
        compute_advantages(experience, KLController(ppo.kl.coef), RewardNormalizer(), ppo)
        targets(experience)
        values, rewards = experience.values, experience.rewards
        before_advantages, before_returns = gae(rewards, values, m, ppo.gamma, ppo.lam)
        assert torch.equal(experience.advantages, masked_whiten(before_advantages, m))
        assert torch.equal(experience.returns, before_returns)
        assert experience.value_weights is None
        if dtype == torch.float64:
            loop_advantages, loop_returns = _gae_loop(rewards, values, m, ppo.gamma, ppo.lam)
            torch.testing.assert_close(before_advantages, loop_advantages, rtol=0, atol=1e-12)
            torch.testing.assert_close(experience.returns, loop_returns, rtol=0, atol=1e-12)
            advantages = experience.advantages
            critic_one = critic_targets(_config("ppo.gamma=0.99", "ppo.lam_critic=1"))
            critic_one(experience)
            assert torch.equal(experience.advantages, advantages)
            _, loop_one = _gae_loop(rewards, values, m, ppo.gamma, 1.0)
            torch.testing.assert_close(experience.returns, loop_one, rtol=0, atol=1e-12)
            assert not torch.allclose(experience.returns, loop_returns)


def test_value_targets_choose_their_object():
    """ppo/roles.py critic_targets: one object per async.value_targets, with ppo.lam_critic
    (null: ppo.lam) and V-trace's rho_bar async.is_cap; suffix_is holds its caps and its
    V-trace fallback."""
    from megatron_rlhf.ppo.roles import critic_targets

    def built(*overrides):
        return critic_targets(_config("ppo.lam=0.9", *overrides))

    assert built() == GAETargets(1.0, 0.9)
    assert built("ppo.lam_critic=1.0") == GAETargets(1.0, 1.0)
    assert built("async.value_targets=vtrace", "async.is_cap=3") == VTraceTargets(1.0, 0.9, 3.0)
    suffix = ("async.value_targets=suffix_is", "async.suffix_cap=4", "async.min_ess=0.2")
    want = SuffixISTargets(1.0, 4.0, 0.2, VTraceTargets(1.0, 1.0, 2.0))
    assert built(*suffix, "ppo.lam_critic=1") == want


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["async.suffix_cap=0"], "async.suffix_cap=0.0 must be a finite number > 0"),
        (["async.min_ess=1.5"], "async.min_ess=1.5 must lie in [0, 1]"),
        (["ppo.lam_critic=1.2"], "ppo.lam_critic=1.2 must lie in [0, 1]"),
        (
            ["async.value_targets=suffix_is", "async.is_cap=0"],
            "async.value_targets=suffix_is falls back to V-trace targets below "
            "async.min_ess=0.1, whose ratios async.is_cap truncates, which is 0",
        ),
        (
            ["async.max_staleness=1", "async.is_mode=mask", "async.is_cap=0"],
            "async.is_mode=mask drops the tokens whose weight is above async.is_cap, which is 0",
        ),
        (["async.is_mode=mask"], "async.is_mode=mask applies to the weights of stale rollouts"),
        (["async.is_mode=drop"], "async.is_mode='drop'; choose one of"),
    ],
)
def test_bad_critic_target_settings_name_the_key_and_the_fix(overrides, message):
    from megatron_rlhf.ppo.checks import async_problems
    from megatron_rlhf.utils import InputError

    try:
        problems = async_problems(_config(*overrides))
    except InputError as error:  # a value the loader refuses
        problems = [str(error)]
    assert any(message in problem for problem in problems), problems


@pytest.mark.parametrize(
    "overrides",
    [
        ["async.value_targets=suffix_is"],  # staleness 0: the weights are 1
        ["async.value_targets=suffix_is", "async.is_cap=0", "async.min_ess=0"],
        ["async.max_staleness=2", "async.value_targets=suffix_is", "async.is_mode=mask"],
        ["ppo.lam_critic=1", "async.value_targets=vtrace"],
    ],
)
def test_good_critic_target_settings_pass(overrides):
    from megatron_rlhf.ppo.checks import async_problems

    assert async_problems(_config(*overrides)) == []


def test_train_ppo_with_suffix_is_targets_on_stale_rollouts(tmp_path):
    """train-ppo in process on the tiny known-reward task, 3 steps one step stale, suffix_is
    targets: step 1 trains on the initial actor's rollout (weights 1 to rounding: ESS 1 to
    1e-6, log-ratio second moment ~0, no fallback), steps 2-3 on stale ones (ESS < 1,
    log_ratio_m2 > 0), and the weighted critic loss runs through the update's micro-batches.
    With async.min_ess=1 the stale steps fall back to V-trace targets (the 0/1 metric), and
    their critic loss differs from the weighted one (step 1 falls back or not by rounding)."""
    from ppo_fixtures import make_ppo_setup
    from test_checkpoint_integrity import logged

    from megatron_rlhf.config import load_config
    from megatron_rlhf.ppo.config import TrainPPOConfig
    from megatron_rlhf.ppo.setup import validate_config
    from megatron_rlhf.ppo.train import PPOTrainer
    from megatron_rlhf.utils import run_command

    setup = make_ppo_setup(tmp_path / "setup")

    class Never:
        def agreed(self):
            return None

    def train(name: str, *overrides: str) -> list[dict]:
        output_dir = tmp_path / name
        overrides = (
            f"train.output_dir={output_dir}", "train.steps=3", "train.save_interval=100",
            "async.max_staleness=1", "async.value_targets=suffix_is", *overrides,
        )  # fmt: skip
        config = load_config(TrainPPOConfig, setup["config"], list(overrides))
        trainer = lambda: PPOTrainer(validate_config(config, 1)).fit(Never())  # noqa: E731
        assert run_command("train-ppo", trainer, distributed=True) == 0
        return logged(output_dir)

    weighted = train("weighted")
    first, *stale = weighted
    assert first["critic/suffix_ess"] == pytest.approx(1.0, abs=1e-6)
    assert first["async/log_ratio_m2"] == pytest.approx(0.0, abs=1e-9)
    assert first["critic/vtrace_fallback"] == 0.0
    for row in stale:
        assert 0 < row["critic/suffix_ess"] < 1 and row["async/log_ratio_m2"] > 0
        assert row["critic/vtrace_fallback"] == 0.0
    fallen_back = train("fallen_back", "async.min_ess=1")
    assert fallen_back[0]["critic/suffix_ess"] == first["critic/suffix_ess"]
    for row, other in zip(stale, fallen_back[1:], strict=True):
        assert other["critic/vtrace_fallback"] == 1.0
        assert other["critic/value_loss"] != row["critic/value_loss"]
