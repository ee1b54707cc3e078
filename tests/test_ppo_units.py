"""PPO-SR pure pieces against float64 references, and train-ppo's up-front validation."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_rlhf.ppo.control import KLController, RewardNormalizer
from megatron_rlhf.ppo.losses import policy_loss, ppo_sr_loss, sft_nll, value_loss


def _ragged_mask(batch: int, length: int, generator) -> torch.Tensor:
    lengths = torch.randint(1, length + 1, (batch,), generator=generator)
    return (torch.arange(length)[None, :] < lengths[:, None]).float()


def test_policy_loss_matches_float64_reference():
    g = torch.Generator().manual_seed(0)
    logprobs = -torch.rand(5, 7, generator=g) * 3
    old = logprobs + torch.randn(5, 7, generator=g) * 0.3
    adv = torch.randn(5, 7, generator=g)
    mask = _ragged_mask(5, 7, g)
    loss, metrics = policy_loss(logprobs, old, adv, mask, clip_ratio=0.2)
    total, clipped, count = 0.0, 0, 0
    for b in range(5):
        for t in range(7):
            if mask[b, t] == 0:
                continue
            ratio = math.exp(float(logprobs[b, t]) - float(old[b, t]))
            a = float(adv[b, t])
            unclipped, clip = -a * ratio, -a * min(max(ratio, 0.8), 1.2)
            total += max(unclipped, clip)
            clipped += clip > unclipped
            count += 1
    assert abs(float(loss) - total / count) < 1e-6
    assert abs(float(metrics["clip_fraction"]) - clipped / count) < 1e-6


def test_value_loss_matches_float64_reference():
    g = torch.Generator().manual_seed(1)
    values, old, returns = (torch.randn(4, 6, generator=g) for _ in range(3))
    mask = _ragged_mask(4, 6, g)
    loss, _ = value_loss(values, old, returns, mask, clip_range=0.2)
    v, o, r, m = (x.double() for x in (values, old, returns, mask))
    clipped = o + (v - o).clamp(-0.2, 0.2)
    errors = torch.maximum((v - r) ** 2, (clipped - r) ** 2)
    assert abs(float(loss) - float(0.5 * (errors * m).sum() / m.sum())) < 1e-6


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_sft_rehearsal_term_is_exactly_gamma_nll(reduction):
    """Eq. 9 at the loss level: with rehearsal on, the actor loss of the same microbatch
    differs from rehearsal off by gamma * NLL(D_R rows), computed independently in float64
    (summed over each row's tokens and averaged over rows, or averaged over tokens)."""
    from megatron_rlhf.distributed import initialize
    from megatron_rlhf.ppo.microbatch import MicroBatch
    from megatron_rlhf.ppo.update import actor_loss

    initialize()
    g = torch.Generator().manual_seed(2)
    ppo_rows, rehearsal_rows, width, vocab, prompt, response = 3, 2, 9, 37, 4, 5
    logits = torch.randn(ppo_rows + rehearsal_rows, width, vocab, generator=g)
    input_ids = torch.randint(0, vocab, (ppo_rows + rehearsal_rows, width), generator=g)
    response_mask = _ragged_mask(ppo_rows, response, g)
    rows = torch.arange(ppo_rows)[:, None] * width
    base = dict(
        packed=False,
        predicting=torch.where(
            response_mask.bool(), rows + prompt - 1 + torch.arange(response)[None, :], 0
        ),
        response_mask=response_mask,
        last=rows[:, 0] + width - 1,  # not read by the actor
        prompt_end=rows[:, 0] + prompt - 1,
        old_logprobs=-torch.rand(ppo_rows, response, generator=g),
        advantages=torch.randn(ppo_rows, response, generator=g),
        tokens=float(response_mask.sum()),  # this microbatch is the global batch
        loss_scale=1,
    )
    rehearsal_mask = torch.zeros(rehearsal_rows, width)
    rehearsal_mask[:, 3:7] = 1
    rehearsal_mask[1, 6] = 0
    target_rows, target_columns = rehearsal_mask[:, 1:].nonzero(as_tuple=True)
    off = MicroBatch(
        input_ids=input_ids[:ppo_rows], padding_mask=torch.ones(ppo_rows, width), **base
    )
    on = MicroBatch(
        input_ids=input_ids,
        padding_mask=torch.ones(ppo_rows + rehearsal_rows, width),
        rehearsal_positions=(ppo_rows + target_rows) * width + target_columns,
        rehearsal_tokens=float(rehearsal_mask[:, 1:].sum()),
        rehearsal_rows=rehearsal_rows,
        **base,
    )
    gamma = 0.01
    loss_off, _ = actor_loss(0.2, gamma, 1.0, logits[:ppo_rows], off, tp_group=None)
    loss_on, metrics = actor_loss(0.2, gamma, 1.0, logits, on, reduction, tp_group=None)
    reference_logprobs = torch.log_softmax(logits[ppo_rows:, :-1].double(), dim=-1)
    targets = input_ids[ppo_rows:, 1:]
    token_lp = reference_logprobs.gather(-1, targets[..., None]).squeeze(-1)
    m = rehearsal_mask[:, 1:].double()
    nll = float(-(token_lp * m).sum() / (m.shape[0] if reduction == "sum" else m.sum()))
    assert abs(float(metrics["rehearsal_nll"]) - nll) < 1e-5
    assert abs(float(loss_on - loss_off) - gamma * nll) < 1e-6
    assert ppo_sr_loss(loss_off, None, gamma) is loss_off


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_sft_nll_reductions_match_float64_reference(reduction):
    """sum (Eq. 9: Σ over a sequence's tokens, mean over sequences) and mean (per token), with
    a ragged mask, against plain float64 loops."""
    g = torch.Generator().manual_seed(3)
    logprobs = -torch.rand(5, 8, generator=g) * 4
    mask = torch.zeros(5, 8)
    for row, (start, stop) in enumerate(((2, 8), (1, 2), (3, 6), (0, 8), (5, 7))):
        mask[row, start:stop] = 1
    per_sequence = [-sum(float(logprobs[b, t]) for t in range(8) if mask[b, t]) for b in range(5)]
    tokens = sum(int(mask[b].sum()) for b in range(5))
    expected = sum(per_sequence) / 5 if reduction == "sum" else sum(per_sequence) / tokens
    assert float(sft_nll(logprobs, mask, reduction)) == pytest.approx(expected, abs=1e-5)
    with pytest.raises(ValueError, match="sum or mean"):
        sft_nll(logprobs, mask, "token")


def test_rehearsal_rows_lose_prompt_tokens_from_the_left():
    from megatron_rlhf.data import cut_prompt_to_fit

    ids = torch.arange(10, 22)  # 8 prompt tokens, 4 response tokens
    mask = torch.tensor([0] * 8 + [1] * 4)
    same, cut = cut_prompt_to_fit({"input_ids": ids, "loss_mask": mask, "index": 3}, 12)
    assert not cut and torch.equal(same["input_ids"], ids)
    short, cut = cut_prompt_to_fit({"input_ids": ids, "loss_mask": mask, "index": 3}, 6)
    assert cut and short["index"] == 3
    assert short["input_ids"].tolist() == [16, 17, 18, 19, 20, 21]  # last 2 prompt + response
    assert short["loss_mask"].tolist() == [0, 0, 1, 1, 1, 1]
    # a response longer than the limit keeps one prompt token and its first limit - 1 tokens
    tiny, _ = cut_prompt_to_fit({"input_ids": ids, "loss_mask": mask}, 3)
    assert tiny["input_ids"].tolist() == [17, 18, 19] and tiny["loss_mask"].tolist() == [0, 1, 1]
    # the old rule (keep the first tokens) left no response token to train
    assert int(mask[:6].sum()) == 0


def test_adaptive_kl_controller_moves_towards_target():
    fixed = KLController(0.1)
    fixed.update(100.0, 8)
    assert fixed.coef == 0.1
    adaptive = KLController(0.1, adaptive=True, target=1.0, horizon=100)
    adaptive.update(10.0, 50)  # KL far above target: error clipped at +0.2
    assert adaptive.coef == pytest.approx(0.1 * (1 + 0.2 * 50 / 100))
    adaptive.update(0.9, 100)
    assert adaptive.coef == pytest.approx(0.1 * 1.1 * (1 - 0.1))


def test_moving_average_reward_normaliser():
    normalizer = RewardNormalizer("moving_average", momentum=0.5)
    assert normalizer(2.0, 4.0) == (2.0, pytest.approx(2.0))
    shift, scale = normalizer(4.0, 0.0)
    assert shift == 3.0 and scale == pytest.approx(math.sqrt(2.0))
    assert RewardNormalizer("none")(5.0, 9.0) == (0.0, 1.0)
    state = normalizer.state_dict()
    restored = RewardNormalizer("moving_average", momentum=0.5)
    restored.load_state_dict(state)
    assert restored(1.0, 1.0) == normalizer(1.0, 1.0)


@pytest.mark.parametrize("budget", [1, 23, 1000], ids=["row_per_pack", "some_rows", "one_pack"])
def test_packed_scoring_equals_padded_scoring(tmp_path, budget):
    """Reference/old log-probs, values and AM scores from packed micro-batches (rows' real
    tokens back to back, block-diagonal attention) equal the padded micro-batches' on every
    response token (rel 1e-5); padding positions are 0. Budget 1 puts every row alone, 23
    packs a few rows per micro-batch, 1000 packs the whole batch in one row."""
    from dist_bloom_common import ARCH_A

    from megatron_rlhf.checkpoint import load_bloom
    from megatron_rlhf.distributed import destroy, initialize
    from megatron_rlhf.models.bloom.tiny import save_random_hf_bloom
    from megatron_rlhf.ppo.config import RolloutConfig
    from megatron_rlhf.ppo.experience import Experience
    from megatron_rlhf.ppo.microbatch import Batching
    from megatron_rlhf.ppo.scoring import score

    save_random_hf_bloom(tmp_path / "lm", ARCH_A, seed=4)
    g = torch.Generator().manual_seed(5)
    prompt_lengths, response_lengths, p, n = [3, 7, 1, 5, 6, 2], [4, 1, 6, 2, 6, 3], 7, 6
    batch = len(prompt_lengths)
    sequences = torch.full((batch, p + n), 3, dtype=torch.long)
    mask = torch.zeros((batch, p + n), dtype=torch.long)
    for row, (prompt, response) in enumerate(zip(prompt_lengths, response_lengths)):
        sequences[row, p - prompt : p + response] = torch.randint(
            4, ARCH_A.vocab_size, (prompt + response,), generator=g
        )
        mask[row, p - prompt : p + response] = 1
    initialize()
    try:
        models = {
            "logprobs": load_bloom(tmp_path / "lm").eval(),
            "ref_logprobs": load_bloom(tmp_path / "lm").eval(),
            "values": load_bloom(tmp_path / "lm", head="scalar", num_scalar_outputs=1).eval(),
            "scores": load_bloom(tmp_path / "lm", head="scalar", num_scalar_outputs=2).eval(),
        }

        def experience():
            return Experience(
                sequences=sequences.clone(), attention_mask=mask.clone(),
                response_mask=mask[:, p:].clone(), prompt_index=torch.arange(batch),
                prompt_length=p,
            )  # fmt: skip

        sampling, rows = RolloutConfig(temperature=0.8), dict(micro_batch_size=4, pad_id=3)
        padded = score(experience(), models, "am", sampling, Batching(**rows, max_tokens=None))
        packed = score(experience(), models, "am", sampling, Batching(**rows, max_tokens=budget))
    finally:
        destroy()
    real = mask[:, p:].bool()
    for name in ("logprobs", "ref_logprobs", "values"):
        a, b = getattr(packed, name), getattr(padded, name)
        assert a.shape == b.shape == (batch, n)
        scale = b[real].abs().max()
        assert (a - b)[real].abs().max() <= 1e-5 * scale, name
        assert (a[~real] == 0).all(), name
    assert (packed.scores - padded.scores).abs().max() <= 1e-5 * padded.scores.abs().max()


def _bandit(seed: int, actions: int = 6, spread: float = 0.4):
    """A one-step softmax policy pi = softmax(theta) over ``actions`` tokens, a behaviour policy
    mu = softmax(theta + noise) and centred advantages A (sum_k pi_k A_k = 0), float64."""
    g = torch.Generator().manual_seed(seed)
    theta = torch.randn(actions, generator=g, dtype=torch.float64)
    mu = torch.softmax(theta + spread * torch.randn(actions, generator=g, dtype=torch.float64), 0)
    pi = torch.softmax(theta, 0)
    rewards = torch.randn(actions, generator=g, dtype=torch.float64)
    return theta, pi, mu, rewards - (pi * rewards).sum()


def _estimate(theta, mu, advantages, samples: int, seed: int, mode: str, cap: float):
    """The update's policy gradient at theta = theta_old on ``samples`` tokens drawn from mu,
    through ``behaviour_correction`` and ``policy_loss`` (autograd), and the per-sample
    contributions (for the standard error), computed independently."""
    from megatron_rlhf.ppo.losses import behaviour_correction

    g = torch.Generator().manual_seed(seed)
    actions = torch.multinomial(mu, samples, replacement=True, generator=g)
    theta = theta.clone().requires_grad_()
    logprobs = torch.log_softmax(theta, 0)[actions][None]  # (1, n) one row of n tokens
    mask = torch.ones_like(logprobs)
    weights, _ = behaviour_correction(logprobs.detach(), mu.log()[actions][None], mask, mode, cap)
    loss, _ = policy_loss(logprobs, logprobs.detach(), advantages[actions][None], mask, 0.2,
                          weights=weights)  # fmt: skip
    (grad,) = torch.autograd.grad(-loss, theta)
    pi = torch.softmax(theta.detach(), 0)
    w = torch.ones(samples, dtype=torch.float64) if weights is None else weights[0]
    per_sample = (w * advantages[actions])[:, None] * (
        torch.nn.functional.one_hot(actions, theta.shape[0]) - pi
    )
    return grad, per_sample.std(0) / samples**0.5


@pytest.mark.parametrize("seed", [0, 1])
def test_token_tis_gives_the_on_policy_gradient_in_expectation(seed):
    """Samples from a perturbed mu: the corrected estimator's mean is the on-policy gradient
    sum_k pi_k A_k (e_k - pi) = pi * A (closed form) within 4 standard errors; the uncorrected
    one is not (its expectation is mu * A - pi (mu . A))."""
    theta, pi, mu, advantages = _bandit(seed)
    cap = 1e9  # no truncation: exactly unbiased
    on_policy = pi * advantages
    got, se = _estimate(theta, mu, advantages, 40_000, seed, "token_tis", cap)
    assert ((got - on_policy).abs() <= 4 * se).all(), (got, on_policy, se)
    naive, naive_se = _estimate(theta, mu, advantages, 40_000, seed, "none", cap)
    assert ((naive - on_policy).abs() > 8 * naive_se).any(), (naive, on_policy, naive_se)
    biased = mu * advantages - pi * (mu * advantages).sum()  # E_mu[A (e_a - pi)], closed form
    assert ((naive - biased).abs() <= 4 * naive_se).all()


def test_truncated_weights_give_their_closed_form_bias():
    """With cap c the estimator's expectation is sum_k mu_k min(pi_k/mu_k, c) A_k (e_k - pi):
    the truncation's bias is exactly where pi/mu > c."""
    theta, pi, mu, advantages = _bandit(3, spread=1.2)
    cap = 1.5
    assert (pi / mu).max() > cap  # the truncation bites
    w = (pi / mu).clamp(max=cap)
    truncated = mu * w * advantages - pi * (mu * w * advantages).sum()
    got, se = _estimate(theta, mu, advantages, 40_000, 3, "token_tis", cap)
    assert ((got - truncated).abs() <= 4 * se).all(), (got, truncated, se)


def test_behaviour_correction_weights_and_metrics_match_float64():
    from megatron_rlhf.ppo.losses import behaviour_correction

    g = torch.Generator().manual_seed(9)
    old = -torch.rand(4, 6, generator=g) * 3
    behaviour = old + torch.randn(4, 6, generator=g) * 0.4
    mask = _ragged_mask(4, 6, g)
    assert behaviour_correction(old, behaviour, mask, "none", 2.0) == (None, {})
    for mode in ("token_tis", "seq_tis"):
        weights, metrics = behaviour_correction(old, behaviour, mask, mode, 2.0)
        want, raw_all, k3 = torch.zeros(4, 6, dtype=torch.float64), [], []
        for b in range(4):
            real = [t for t in range(6) if mask[b, t]]
            seq = sum(float(old[b, t]) - float(behaviour[b, t]) for t in real)
            for t in real:
                r = float(old[b, t]) - float(behaviour[b, t])
                raw = math.exp(r if mode == "token_tis" else seq)
                want[b, t] = min(raw, 2.0)
                raw_all.append(raw)
                k3.append(math.exp(r) - 1 - r)
        torch.testing.assert_close(weights.double(), want, rtol=1e-6, atol=1e-7)
        n = len(raw_all)
        assert metrics["is_weight_mean"] == pytest.approx(float(want.sum()) / n, rel=1e-6)
        assert metrics["is_weight_max"] == pytest.approx(float(want.max()), rel=1e-6)
        assert metrics["is_capped_fraction"] == pytest.approx(sum(r > 2 for r in raw_all) / n)
        assert metrics["kl_behaviour_old"] == pytest.approx(sum(k3) / n, rel=1e-6)


def test_microbatch_index_maps_read_what_padded_slicing_read():
    """The typed micro-batch on ragged rows (left-padded prompts, responses ending early): in
    the padded layout its index maps read what the padded slicing read (the response logits at
    columns P - 1 .. P + N - 2, r at the last real token, e_tau at column P - 1); in the packed
    layout, and after right-padding the grid, they point at the same tokens; rehearsal
    positions predict the rows' loss-masked tokens."""
    from megatron_rlhf.ppo.experience import Experience
    from megatron_rlhf.ppo.microbatch import microbatch
    from megatron_rlhf.reward.model import last_token_positions

    g = torch.Generator().manual_seed(7)
    p, n = 5, 4
    prompts, responses = [2, 5, 1], [4, 1, 3]
    sequences = torch.full((3, p + n), 3)
    mask = torch.zeros((3, p + n), dtype=torch.long)
    for row, (prompt, response) in enumerate(zip(prompts, responses)):
        mask[row, p - prompt : p + response] = 1
        sequences[row][mask[row].bool()] = torch.randint(4, 50, (prompt + response,), generator=g)
    experience = Experience(
        sequences=sequences, attention_mask=mask, response_mask=mask[:, p:],
        prompt_index=torch.arange(3), prompt_length=p,
    )  # fmt: skip
    real = mask[:, p:].bool()
    output = torch.randn(3, p + n, 2, generator=g)  # a scalar head's full-grid output
    padded = microbatch(experience, False, None, 3)
    at = padded.at
    assert torch.equal(at(output, padded.predicting)[real], output[:, p - 1 : p - 1 + n][real])
    assert torch.equal(at(output, padded.last), output[range(3), last_token_positions(mask)])
    assert torch.equal(at(output, padded.prompt_end), output[:, p - 1])
    rehearsal = [(torch.tensor([9, 8, 7, 6]), torch.tensor([0, 0, 1, 1]))]
    targets = sequences[:, p:][real]
    for mb in (
        padded,
        padded.padded_to(p + n + 3, 3),
        microbatch(experience, True, None, 3),
        microbatch(experience, True, rehearsal, 3),
        microbatch(experience, False, rehearsal, 3).padded_to(20, 3),
    ):
        assert torch.equal(mb.targets(mb.response_positions())[0], targets)
        grid = mb.input_ids.flatten()
        assert torch.equal(grid[mb.last], sequences[torch.arange(3), last_token_positions(mask)])
        assert torch.equal(grid[mb.prompt_end], sequences[:, p - 1])
        if mb.rehearsal_positions is not None:
            assert mb.targets(mb.rehearsal_positions)[0].tolist() == [7, 6]


def _sampler_logprobs_float64(logits, tokens, temperature: float, top_p: float):
    """log mu (K,) of ``tokens`` (K,) under softmax(logits / T) cut to the top-p nucleus and
    renormalised, and log softmax(logits / T) of them untruncated (K,), from logits (K, V):
    float64, the nucleus found by walking each position's tokens from the most likely while
    the mass before the token is below top_p."""
    truncated, untruncated = [], []
    for row, token in zip(logits.double(), tokens.tolist()):
        probs = torch.softmax(row / temperature, dim=-1)
        kept, mass = [], 0.0
        for index in torch.argsort(probs, descending=True).tolist():
            if mass >= top_p:
                break
            kept.append(index)
            mass += float(probs[index])
        assert token in kept, "the sampler drew a token outside the nucleus"
        untruncated.append(math.log(float(probs[token])))
        truncated.append(untruncated[-1] - math.log(sum(float(probs[i]) for i in kept)))
    return torch.tensor(truncated), torch.tensor(untruncated)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_behaviour_logprobs_are_the_distribution_sampled_and_pi_old_matches(
    tmp_path, monkeypatch, packed
):
    """mu is what was sampled (issue 48, item 1). At temperature 0.7 and top-p 0.9 our engine
    records each token's log-prob under softmax(z / T) cut to the nucleus and renormalised;
    the score stage computes pi_old (the same actor: staleness 0) under the same transform, so
    pi_old/mu is 1 to 1e-5 on every response token; and pi_old of the PPO ratio and KL reward
    stays the untruncated softmax at T. References: a float64 softmax of a full forward's
    logits with the nucleus found by hand. Ragged prompts, rows ending at different steps,
    padded and packed scoring micro-batches (packed: the nucleus found 3 positions at a time).
    (Before: mu was log softmax(z) at T = 1 over the whole vocabulary, 0.48 from the reference
    here, and pi_old/mu ran from 0.93 to 1.46.)"""
    from dist_bloom_common import ARCH_A

    from megatron_rlhf.checkpoint import load_bloom
    from megatron_rlhf.distributed import destroy, initialize
    from megatron_rlhf.generation import SamplingConfig, generate
    from megatron_rlhf.models.bloom.tiny import save_random_hf_bloom
    from megatron_rlhf.ppo import scoring
    from megatron_rlhf.ppo.config import RolloutConfig
    from megatron_rlhf.ppo.losses import behaviour_correction
    from megatron_rlhf.ppo.microbatch import Batching
    from megatron_rlhf.ppo.rollout import experience_of

    temperature, top_p, new = 0.7, 0.9, 8
    if packed:  # ARCH_A's vocabulary is padded to 1,024 columns
        monkeypatch.setattr(scoring, "NUCLEUS_CHUNK_ELEMENTS", 3 * 1024)
    save_random_hf_bloom(tmp_path / "lm", ARCH_A, seed=6)
    g = torch.Generator().manual_seed(8)
    lengths, p = [3, 7, 1, 5, 6, 2], 7
    ids = torch.full((len(lengths), p), 3, dtype=torch.long)
    prompt_mask = torch.zeros((len(lengths), p), dtype=torch.long)
    for row, length in enumerate(lengths):
        ids[row, p - length :] = torch.randint(4, ARCH_A.vocab_size, (length,), generator=g)
        prompt_mask[row, p - length :] = 1
    prompts = {"input_ids": ids, "attention_mask": prompt_mask, "index": torch.arange(6)}
    sampling = SamplingConfig(
        max_new_tokens=new, temperature=temperature, top_p=top_p, row_seeds=tuple(range(6)),
        eos_id=-1,
    )  # fmt: skip
    initialize()
    try:
        model = load_bloom(tmp_path / "lm").eval()
        endless = generate(model, ids, prompt_mask, sampling).response_ids
        sampling.eos_id = int(endless[0, 2])  # row 0 ends at its third token, others later
        out = generate(model, ids, prompt_mask, sampling)
        experience = experience_of(
            prompts, out.response_ids, out.response_mask, out.response_logprobs
        )
        scored = scoring.score(
            experience, {"logprobs": model}, "am",
            RolloutConfig(temperature=temperature, top_p=top_p),
            Batching(micro_batch_size=4, max_tokens=23 if packed else None, pad_id=3),
        )  # fmt: skip
        with torch.no_grad():
            logits = model(scored.sequences, scored.attention_mask)  # (B, P + N, V)
    finally:
        destroy()
    real = scored.response_mask.bool()
    n = real.shape[1]
    assert len(set(real.sum(dim=1).tolist())) >= 2 and int(real.sum(dim=1).min()) == 3
    predicting = logits[:, p - 1 : p - 1 + n][real]  # (M, V) the logits of each real token
    mu_ref, untruncated_ref = _sampler_logprobs_float64(
        predicting, scored.responses[real], temperature, top_p
    )
    assert (untruncated_ref - mu_ref).max() < -1e-3  # the nucleus cut something everywhere
    assert (scored.rollout_logprobs[real].double() - mu_ref).abs().max() <= 1e-5
    assert (scored.old_sampler_logprobs[real].double() - mu_ref).abs().max() <= 1e-5
    assert (scored.logprobs[real].double() - untruncated_ref).abs().max() <= 1e-5
    ratio = scored.behaviour_log_ratio().exp()
    assert (ratio[real] - 1).abs().max() <= 1e-5
    # what ppo.rollout_correction=token_tis and the async weight then apply: 1 at staleness 0
    weights, metrics = behaviour_correction(
        scored.sampled_old_logprobs(), scored.rollout_logprobs, scored.response_mask,
        "token_tis", 2.0,
    )  # fmt: skip
    assert (weights[real] - 1).abs().max() <= 1e-5 and abs(metrics["kl_behaviour_old"]) < 1e-9
    assert (scored.rollout_logprobs[~real] == 0).all()
    assert (scored.old_sampler_logprobs[~real] == 0).all()
