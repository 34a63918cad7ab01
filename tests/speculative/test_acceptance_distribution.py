"""Statistical tests: the exact speculative sampler preserves the target distribution - with power.

The harness (`run_trials` + `check_distribution`) fixes one target distribution p_i per verified position
(p_1..p_(gamma+1), independent of context) and one draft distribution q_i per drafted position, samples drafted
tokens x_i ~ q_i for N independent trials at once, and runs an acceptance function over all of them in a single
batched call. A trial *reaches* position i when its step emitted at least i + 1 tokens (read from the -1 padding of
the token tensor, so a variant that emits extra tokens is judged on them too). Among the trials reaching position i
the emitted token must be distributed exactly as p_i, whatever q is. Each position is checked
(tests/helpers/goodness_of_fit.py) with

- a zero-probability check: any emitted token with p_i(token) == 0 fails immediately;
- a chi-square goodness-of-fit test (bins with expected count < 5 are pooled; a pooled bin still under 5 gets a
  Poisson tail test and is folded into the largest bin), failing at p-value < 1e-4;
- a total-variation bound 2.25 * sum_x sqrt(p(x)(1 - p(x)) / n) (a 4.5-sigma union bound over the bins).

Power: the same harness must reject the four implementation errors the architecture note lists (argmax matching at
T > 0, resampling from p instead of the residual, keeping the drafted tail after a rejection, processors applied to
one side only), plus a 3 % mixture bias injected directly. The broken variants live in this file with the signature
of `accept`; the one-sided-processor error is exercised at the harness level by feeding differently processed p/q.

Further: greedy (point masses) reduces to exact argmax matching (hand-written expected tensors), seeded
determinism, batches mixing different `num_drafted`, and the i.i.d.-acceptance law: with sum_x min(p, q) = alpha at
every position, tokens per step follow the truncated geometric law with mean (1 - alpha^(gamma+1)) / (1 - alpha).

Regression at the end: torch.rand can return exactly 0 (probability 2^-24 per draw); `accept` must still never
accept a drafted token whose target probability is 0.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from helpers.goodness_of_fit import (
    MIN_SAMPLES,
    P_VALUE_THRESHOLD,
    PositionCheck,
    goodness_of_fit,
    goodness_of_fit_counts,
)
from scipy import stats

from specdeploy.decoding.sampling import SamplingParams, sample, sampling_distribution
from specdeploy.speculative.acceptance import AcceptanceResult, accept, accept_greedy

AcceptFn = Callable[
    [torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Generator | None], AcceptanceResult
]

N_TRIALS = 200_000


pytestmark = pytest.mark.usefixtures("single_thread")


# ---------------------------------------------------------------------------------------------------------------
# Harness
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Trials:
    draft_tokens: torch.Tensor  # [N, gamma]
    num_drafted: torch.Tensor  # [N]
    tokens: torch.Tensor  # [N, gamma + 1]
    num_accepted: torch.Tensor  # [N]
    emitted: torch.Tensor  # [N] number of tokens the step emitted (leading non -1 entries)


def run_trials(accept_fn: AcceptFn, p: torch.Tensor, q: torch.Tensor, *, n: int = N_TRIALS, seed: int = 0,
               pass_draft_probs: bool = True, reported_q: torch.Tensor | None = None,
               num_drafted: torch.Tensor | None = None) -> Trials:
    """p: [gamma + 1, V] target distributions; q: [gamma, V] draft distributions the drafted tokens are sampled from.

    pass_draft_probs=False calls the acceptance function with draft_probs=None (draft-free proposer; q must be
    one-hot). reported_q, when given, is what the acceptance function is told q was (a mismatched draft sampler)."""
    gamma, vocab = q.shape
    assert p.shape == (gamma + 1, vocab)
    draft_gen = torch.Generator().manual_seed(10_000 + seed)
    if gamma:
        draft_tokens = torch.multinomial(q.double(), n, replacement=True, generator=draft_gen).T.contiguous()
    else:
        draft_tokens = torch.zeros(n, 0, dtype=torch.long)
    if pass_draft_probs:
        shown = q if reported_q is None else reported_q
        draft_probs = shown.float().expand(n, gamma, vocab)
    else:
        assert reported_q is None and bool(((q == 0) | (q == 1)).all()) and bool((q.sum(-1) == 1).all())
        draft_probs = None
    if num_drafted is None:
        num_drafted = torch.full((n,), gamma, dtype=torch.long)
    target_probs = p.float().expand(n, gamma + 1, vocab)
    generator = torch.Generator().manual_seed(seed)
    result = accept_fn(draft_tokens, draft_probs, target_probs, num_drafted, generator)
    assert result.tokens.shape == (n, gamma + 1) and result.num_accepted.shape == (n,)
    emitted = (result.tokens >= 0).long().cumprod(-1).sum(-1)
    return Trials(draft_tokens, num_drafted, result.tokens, result.num_accepted, emitted)


def check_distribution(trials: Trials, p: torch.Tensor) -> list[PositionCheck]:
    """Per position i: the emitted token among trials that reached i (emitted > i), against p[i]."""
    positions, vocab = p.shape
    tokens = trials.tokens[:, :positions]
    reached = trials.emitted[:, None] > torch.arange(positions)[None, :]
    if bool(((tokens < 0) | (tokens >= vocab))[reached].any()):
        return [PositionCheck(i, int(reached[:, i].sum()), -1, 0.0, 1.0, 0.0) for i in range(positions)]
    # One bincount for all positions: key = position * V + token, unreached entries land in a spare bin.
    keys = torch.where(reached, torch.arange(positions)[None, :] * vocab + tokens, positions * vocab)
    counts = torch.bincount(keys.flatten(), minlength=positions * vocab + 1)[:-1].view(positions, vocab)
    return [goodness_of_fit_counts(counts[i], p[i], position=i) for i in range(positions)]


def passes(trials: Trials, p: torch.Tensor) -> bool:
    return all(check.ok for check in check_distribution(trials, p))


def assert_distribution(trials: Trials, p: torch.Tensor, min_tested_positions: int = 1) -> None:
    checks = check_distribution(trials, p)
    report = "\n".join(str(check) for check in checks)
    assert all(check.ok for check in checks), f"emitted tokens are not distributed as p:\n{report}"
    tested = sum(check.n >= MIN_SAMPLES for check in checks)
    assert tested >= min_tested_positions, f"only {tested} positions had enough samples:\n{report}"


def assert_well_formed(trials: Trials) -> None:
    """Structural invariants of an AcceptanceResult for the exact sampler: the accepted drafted prefix, one final
    token, -1 after it, and num_accepted within 0..num_drafted."""
    tokens, num_accepted, num_drafted = trials.tokens, trials.num_accepted, trials.num_drafted
    gamma = trials.draft_tokens.shape[1]
    assert bool((num_accepted >= 0).all()) and bool((num_accepted <= num_drafted).all())
    assert torch.equal(trials.emitted, num_accepted + 1), "tokens emitted must be num_accepted + 1"
    positions = torch.arange(gamma + 1)[None, :]
    drafts = torch.cat([trials.draft_tokens, torch.full_like(num_accepted[:, None], -1)], dim=1)
    expected = torch.where(positions < num_accepted[:, None], drafts, -1)
    actual = torch.where(positions == num_accepted[:, None], -1, tokens)
    assert torch.equal(actual, expected), "accepted prefix must be the drafts, and -1 after the final token"


def assert_acceptance_rates(trials: Trials, p: torch.Tensor, q: torch.Tensor) -> None:
    """P(draft i accepted | position i reached with a draft there) = sum_x min(p_i, q_i), within 5 standard errors."""
    gamma = q.shape[0]
    # joint[d, a]: rows that drafted d tokens and accepted a of them.
    joint = torch.bincount(trials.num_drafted * (gamma + 1) + trials.num_accepted, minlength=(gamma + 1) ** 2)
    joint = joint.view(gamma + 1, gamma + 1).double().numpy()
    alphas = torch.minimum(p[:gamma].double(), q.double()).sum(-1).numpy()
    for i in range(gamma):
        reached = joint[i + 1:, i:].sum()  # drafted beyond i and accepted at least i
        survived = joint[i + 1:, i + 1:].sum()
        if reached < MIN_SAMPLES:
            continue
        rate, alpha = survived / reached, float(alphas[i])
        se = math.sqrt(max(alpha * (1 - alpha), 1e-12) / reached)
        assert abs(rate - alpha) <= 5 * se + 1e-9, f"position {i}: acceptance rate {rate:.4f} vs alpha {alpha:.4f}"


def tv_distance(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a.double() - b.double()).abs().sum(-1).max())


# ---------------------------------------------------------------------------------------------------------------
# Broken variants (same signature as `accept`) - the harness must reject each of them
# ---------------------------------------------------------------------------------------------------------------


def _assemble(draft_tokens: torch.Tensor, num_accepted: torch.Tensor, final_token: torch.Tensor) -> torch.Tensor:
    batch, gamma = draft_tokens.shape
    tokens = torch.full((batch, gamma + 1), -1, dtype=torch.long)
    keep = torch.arange(gamma)[None, :] < num_accepted[:, None]
    tokens[:, :gamma] = torch.where(keep, draft_tokens, -1)
    tokens[torch.arange(batch), num_accepted] = final_token
    return tokens


def _q_of_drafts(draft_tokens, draft_probs, safe):
    if draft_probs is None:
        return torch.ones(safe.shape, dtype=torch.float32)
    return draft_probs.gather(-1, safe[..., None]).squeeze(-1)


def _exact_survival(draft_tokens, draft_probs, target_probs, num_drafted, generator):
    gamma = draft_tokens.shape[1]
    valid = torch.arange(gamma)[None, :] < num_drafted[:, None]
    safe = torch.where(valid, draft_tokens, 0)
    p_of_x = target_probs[:, :gamma].gather(-1, safe[..., None]).squeeze(-1)
    q_of_x = _q_of_drafts(draft_tokens, draft_probs, safe)
    uniform = torch.rand(p_of_x.shape, generator=generator)
    survives = (uniform * q_of_x <= p_of_x) & valid
    return survives, survives.long().cumprod(-1).sum(-1)


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    residual = (p - q).clamp(min=0)
    mass = residual.sum(-1, keepdim=True)
    return torch.where(mass > 0, residual / mass.clamp(min=1e-30), p)


def _q_rows(draft_tokens, draft_probs, index, vocab):
    rows = torch.arange(draft_tokens.shape[0])
    if draft_probs is None:
        return torch.nn.functional.one_hot(draft_tokens[rows, index].clamp(min=0), vocab).float()
    return draft_probs[rows, index]


def argmax_match_accept(draft_tokens, draft_probs, target_probs, num_drafted, generator):
    """(a) Accept x_i iff it equals argmax p_i; on a mismatch emit a sample from p_i."""
    gamma = draft_tokens.shape[1]
    valid = torch.arange(gamma)[None, :] < num_drafted[:, None]
    survives = (draft_tokens == target_probs[:, :gamma].argmax(-1)) & valid
    num_accepted = survives.long().cumprod(-1).sum(-1)
    rows = torch.arange(draft_tokens.shape[0])
    final_token = sample(target_probs[rows, num_accepted], generator)
    return AcceptanceResult(_assemble(draft_tokens, num_accepted, final_token), num_accepted)


def resample_from_p_accept(draft_tokens, draft_probs, target_probs, num_drafted, generator):
    """(b) The exact accept test, but a rejection resamples from p_i instead of normalize(max(0, p_i - q_i))."""
    _, num_accepted = _exact_survival(draft_tokens, draft_probs, target_probs, num_drafted, generator)
    rows = torch.arange(draft_tokens.shape[0])
    final_token = sample(target_probs[rows, num_accepted], generator)
    return AcceptanceResult(_assemble(draft_tokens, num_accepted, final_token), num_accepted)


def keep_tail_accept(draft_tokens, draft_probs, target_probs, num_drafted, generator):
    """(c) The rejected token is replaced by the residual sample, but the drafted tail after it is still emitted."""
    batch, gamma = draft_tokens.shape
    vocab = target_probs.shape[-1]
    _, num_accepted = _exact_survival(draft_tokens, draft_probs, target_probs, num_drafted, generator)
    rows = torch.arange(batch)
    rejected = num_accepted < num_drafted
    at = num_accepted.clamp(max=max(gamma - 1, 0))
    final_p = target_probs[rows, num_accepted]
    final_dist = torch.where(rejected[:, None], _residual(final_p, _q_rows(draft_tokens, draft_probs, at, vocab)),
                             final_p)
    final_token = sample(final_dist, generator)
    tokens = torch.full((batch, gamma + 1), -1, dtype=torch.long)
    positions = torch.arange(gamma)[None, :]
    tokens[:, :gamma] = torch.where(positions < num_drafted[:, None], draft_tokens, -1)
    tokens[rows, num_accepted] = final_token  # the tail x_(k+1).. stays; the bonus slot stays -1 on a rejection
    claimed = torch.where(rejected, num_drafted - 1, num_accepted)
    return AcceptanceResult(tokens, claimed)


def leaky_accept(draft_tokens, draft_probs, target_probs, num_drafted, generator, leak: float = 0.03):
    """Power calibration: the exact sampler, except that a fraction `leak` of first tokens come from q_1."""
    result = accept(draft_tokens, draft_probs, target_probs, num_drafted, generator)
    rows = torch.arange(draft_tokens.shape[0])
    leaked = torch.rand(rows.shape, generator=generator) < leak
    tokens = result.tokens.clone()
    tokens[:, 0] = torch.where(leaked, draft_tokens[:, 0], tokens[:, 0])
    num_accepted = torch.where(leaked, 0, result.num_accepted)
    tokens[:, 1:] = torch.where(leaked[:, None], -1, tokens[:, 1:])
    return AcceptanceResult(tokens, num_accepted)


# ---------------------------------------------------------------------------------------------------------------
# Case construction
# ---------------------------------------------------------------------------------------------------------------


def random_pair(seed: int, gamma: int, vocab: int, scale: float = 1.5) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    p = (torch.randn(gamma + 1, vocab, generator=g, dtype=torch.float64) * scale).softmax(-1)
    q = (torch.randn(gamma, vocab, generator=g, dtype=torch.float64) * scale).softmax(-1)
    return p.float(), q.float()


def one_hot(tokens: list[int], vocab: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(tokens), vocab).float()


def normalized(rows: list[list[float]]) -> torch.Tensor:
    t = torch.tensor(rows, dtype=torch.float64)
    return (t / t.sum(-1, keepdim=True)).float()


def sampling_pair(seed: int, gamma: int, vocab: int, params: SamplingParams, draft_noise: float = 1.0,
                  seen: torch.Tensor | None = None):
    """Target and (correlated) draft logits, plus p and q through the same sampling processors."""
    g = torch.Generator().manual_seed(seed)
    target_logits = torch.randn(gamma + 1, vocab, generator=g) * 2.0
    draft_logits = target_logits[:gamma] + torch.randn(gamma, vocab, generator=g) * draft_noise
    seen_t = None if seen is None else seen.expand(gamma + 1, vocab)
    seen_d = None if seen is None else seen.expand(gamma, vocab)
    p = sampling_distribution(target_logits, params, seen_t)
    q = sampling_distribution(draft_logits, params, seen_d)
    return target_logits, draft_logits, p, q


# ---------------------------------------------------------------------------------------------------------------
# The harness itself: calibrated (no false alarms) and powerful (detects a 3 % bias)
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(5))
def test_harness_accepts_direct_samples_from_p(seed):
    p, _ = random_pair(100 + seed, gamma=0, vocab=12)
    samples = torch.multinomial(p[0].double(), N_TRIALS, replacement=True,
                                generator=torch.Generator().manual_seed(seed))
    check = goodness_of_fit(samples, p[0])
    assert check.ok, str(check)


def test_harness_detects_three_percent_mixture_bias():
    p, q = random_pair(7, gamma=1, vocab=12)
    assert tv_distance(p[0], q[0]) > 0.3
    mixed = 0.97 * p[0].double() + 0.03 * q[0].double()
    samples = torch.multinomial(mixed, N_TRIALS, replacement=True, generator=torch.Generator().manual_seed(0))
    assert not goodness_of_fit(samples, p[0]).ok
    assert not passes(run_trials(leaky_accept, p, q), p)


def test_harness_flags_any_zero_probability_token():
    p = normalized([[0.0, 1.0, 1.0, 1.0]])[0]
    samples = torch.cat([torch.multinomial(p.double(), 10_000, replacement=True,
                                           generator=torch.Generator().manual_seed(0)), torch.tensor([0])])
    check = goodness_of_fit(samples, p)
    assert check.impossible == 1 and not check.ok


# ---------------------------------------------------------------------------------------------------------------
# The exact sampler preserves p
# ---------------------------------------------------------------------------------------------------------------


RANDOM_CASES = [  # (seed, gamma, vocab, logit scale)
    (0, 1, 8, 1.0),
    (1, 2, 10, 1.5),
    (2, 3, 12, 2.0),
    (3, 4, 16, 1.0),
    (4, 4, 8, 3.0),
    (5, 3, 16, 2.5),
]


@pytest.mark.parametrize(("seed", "gamma", "vocab", "scale"), RANDOM_CASES)
def test_exact_accept_preserves_target_random_pairs(seed, gamma, vocab, scale):
    p, q = random_pair(seed, gamma, vocab, scale)
    trials = run_trials(accept, p, q, seed=seed)
    assert_well_formed(trials)
    assert_distribution(trials, p, min_tested_positions=gamma + 1)
    assert_acceptance_rates(trials, p, q)


def test_exact_accept_disjoint_supports_always_rejects_and_emits_p():
    p = normalized([[3, 2, 1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1], [1, 2, 3, 4, 5, 6, 7, 8]])
    q = normalized([[0, 0, 0, 0, 1, 2, 3, 4], [1, 0, 0, 0, 0, 0, 0, 0]])
    trials = run_trials(accept, p, q)
    assert_well_formed(trials)
    assert bool((trials.num_accepted == 0).all())
    assert_distribution(trials, p)


def test_exact_accept_partially_disjoint_supports():
    # q puts mass where p is 0 (never accepted) and p puts mass where q is 0 (only reachable via the residual).
    p = normalized([[4, 3, 2, 1, 0, 0, 0, 0], [0, 1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1]])
    q = normalized([[1, 1, 0, 0, 3, 3, 0, 0], [0, 2, 0, 0, 1, 1, 1, 0]])
    trials = run_trials(accept, p, q)
    assert_well_formed(trials)
    assert_distribution(trials, p, min_tested_positions=3)
    assert_acceptance_rates(trials, p, q)


def test_exact_accept_q_equal_p_accepts_everything():
    p, _ = random_pair(11, gamma=3, vocab=10)
    q = p[:3].clone()
    trials = run_trials(accept, p, q)
    assert_well_formed(trials)
    assert bool((trials.num_accepted == 3).all())
    assert_distribution(trials, p, min_tested_positions=4)


@pytest.mark.parametrize("pass_draft_probs", [False, True], ids=["draft_probs_none", "explicit_one_hot"])
def test_exact_accept_one_hot_draft(pass_draft_probs):
    vocab = 10
    p, _ = random_pair(21, gamma=4, vocab=vocab, scale=1.0)
    p = p.clone()
    p[2, 5] = 0.0  # the third drafted token is impossible under the target: always rejected
    p = p / p.sum(-1, keepdim=True)
    drafted = [int(p[0].argmax()), int(p[1].argmin()), 5, 3]
    q = one_hot(drafted, vocab)
    trials = run_trials(accept, p, q, pass_draft_probs=pass_draft_probs)
    assert_well_formed(trials)
    assert bool((trials.num_accepted <= 2).all())
    assert_distribution(trials, p, min_tested_positions=3)
    assert_acceptance_rates(trials, p, q)


def test_exact_accept_near_zero_masses():
    tiny = 1e-6
    # p is tiny where q is large (almost always rejected -> residual) and q is tiny where p is large.
    p = normalized([[0.5, 0.3, 0.2, tiny, tiny, tiny], [tiny, 0.6, 0.4, tiny, tiny, tiny],
                    [0.2, 0.2, 0.2, 0.2, 0.2, tiny]])
    q = normalized([[tiny, tiny, 0.1, 0.5, 0.4, tiny], [tiny, 0.5, tiny, 0.5, tiny, tiny]])
    trials = run_trials(accept, p, q)
    assert_well_formed(trials)
    assert_distribution(trials, p, min_tested_positions=3)
    assert_acceptance_rates(trials, p, q)


SAMPLING_CASES = [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.3),
    SamplingParams(temperature=1.0, top_k=4),
    SamplingParams(temperature=0.7, top_p=0.8),
    SamplingParams(temperature=1.3, top_k=6, top_p=0.9),
]


@pytest.mark.parametrize("params", SAMPLING_CASES, ids=lambda s: f"T{s.temperature}-k{s.top_k}-p{s.top_p}")
def test_exact_accept_preserves_processed_target_distribution(params):
    _, _, p, q = sampling_pair(31, gamma=3, vocab=12, params=params)
    trials = run_trials(accept, p, q, seed=1)
    assert_well_formed(trials)
    assert_distribution(trials, p, min_tested_positions=3)
    assert_acceptance_rates(trials, p, q)


def test_exact_accept_with_repetition_penalty_on_both_sides():
    vocab = 12
    seen = torch.zeros(vocab, dtype=torch.bool)
    seen[[0, 3, 7]] = True
    params = SamplingParams(temperature=0.9, top_k=8, repetition_penalty=1.5)
    _, _, p, q = sampling_pair(41, gamma=2, vocab=vocab, params=params, seen=seen)
    trials = run_trials(accept, p, q, seed=2)
    assert_distribution(trials, p, min_tested_positions=3)


def test_exact_accept_gamma_zero_samples_p():
    p, q = random_pair(51, gamma=0, vocab=9)
    trials = run_trials(accept, p, q)
    assert_well_formed(trials)
    assert bool((trials.num_accepted == 0).all())
    assert_distribution(trials, p)


def test_batched_rows_with_different_num_drafted():
    gamma, vocab = 4, 10
    p, q = random_pair(61, gamma, vocab, scale=1.0)
    num_drafted = torch.arange(N_TRIALS) % (gamma + 1)  # 0..gamma interleaved in one batch
    trials = run_trials(accept, p, q, seed=3, num_drafted=num_drafted)
    assert_well_formed(trials)
    assert bool((trials.emitted <= num_drafted + 1).all())
    for k in range(gamma + 1):
        rows = num_drafted == k
        group = Trials(trials.draft_tokens[rows], num_drafted[rows], trials.tokens[rows], trials.num_accepted[rows],
                       trials.emitted[rows])
        # A row drafting k tokens emits its bonus at position k from p_(k+1): every position still follows p.
        assert_distribution(group, p[: k + 1], min_tested_positions=min(k + 1, 2))
        assert_acceptance_rates(group, p, q)


# ---------------------------------------------------------------------------------------------------------------
# The four broken variants must fail the same harness
# ---------------------------------------------------------------------------------------------------------------


def broken_case() -> tuple[torch.Tensor, torch.Tensor]:
    p, q = random_pair(71, gamma=3, vocab=8, scale=1.2)
    assert tv_distance(p[:3], q) > 0.2  # q really differs from p, so every error shows
    return p, q


def test_exact_accept_passes_the_broken_variant_case():
    p, q = broken_case()
    assert passes(run_trials(accept, p, q, seed=5), p)


@pytest.mark.parametrize("variant", [argmax_match_accept, resample_from_p_accept, keep_tail_accept],
                         ids=["a_argmax_match", "b_resample_from_p", "c_keep_drafted_tail"])
def test_broken_variant_is_detected(variant):
    p, q = broken_case()
    trials = run_trials(variant, p, q, seed=5)
    assert not passes(trials, p), "\n".join(str(c) for c in check_distribution(trials, p))


def test_broken_variant_a_argmax_match_detected_at_other_temperatures():
    _, _, p, q = sampling_pair(81, gamma=2, vocab=10, params=SamplingParams(temperature=1.3, top_k=6))
    assert passes(run_trials(accept, p, q, seed=6), p)
    assert not passes(run_trials(argmax_match_accept, p, q, seed=6), p)


def test_argmax_match_is_exact_at_temperature_zero():
    # The control for (a): with point masses the exact rule and argmax matching coincide.
    _, _, p, q = sampling_pair(82, gamma=3, vocab=10, params=SamplingParams(temperature=0.0), draft_noise=1.5)
    exact = run_trials(accept, p, q, n=2000, seed=7)
    matched = run_trials(argmax_match_accept, p, q, n=2000, seed=7)
    assert torch.equal(exact.tokens, matched.tokens)
    assert passes(matched, p)


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.7, top_k=5), SamplingParams(temperature=1.3),
                                    SamplingParams(temperature=1.0, top_p=0.7)],
                         ids=lambda s: f"T{s.temperature}-k{s.top_k}-p{s.top_p}")
def test_broken_variant_d_target_processors_skipped(params):
    # (d) the draft side samples from and reports its processed q, the target side hands over raw softmax(logits).
    target_logits, _, p, q = sampling_pair(91, gamma=3, vocab=12, params=params)
    p_raw = target_logits.float().softmax(-1)
    assert passes(run_trials(accept, p, q, seed=8), p)
    trials = run_trials(accept, p_raw, q, seed=8)
    assert not passes(trials, p), "\n".join(str(c) for c in check_distribution(trials, p))


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.7, top_k=5),
                                    SamplingParams(temperature=1.0, top_p=0.7)],
                         ids=lambda s: f"T{s.temperature}-k{s.top_k}-p{s.top_p}")
def test_broken_variant_d_draft_reports_unprocessed_q(params):
    # (d') the draft samples from its processed q but reports raw softmax(logits) to the acceptance rule.
    _, draft_logits, p, q = sampling_pair(92, gamma=3, vocab=12, params=params)
    q_raw = draft_logits.float().softmax(-1)
    trials = run_trials(accept, p, q, seed=9, reported_q=q_raw)
    assert not passes(trials, p), "\n".join(str(c) for c in check_distribution(trials, p))


# ---------------------------------------------------------------------------------------------------------------
# Greedy, determinism
# ---------------------------------------------------------------------------------------------------------------


def greedy_targets() -> torch.Tensor:
    """Point masses p_1..p_4 on tokens 2, 4, 1, 3 (vocab 6), from logits through temperature 0."""
    logits = torch.full((4, 6), -1.0)
    for i, token in enumerate([2, 4, 1, 3]):
        logits[i, token] = 5.0
    logits[1, 0] = 4.0  # a runner-up that must not matter
    return sampling_distribution(logits, SamplingParams(temperature=0.0))


@pytest.mark.parametrize("explicit_q", [False, True, "tokens"],
                         ids=["draft_probs_none", "one_hot_draft_probs", "accept_greedy_from_tokens"])
def test_greedy_reduces_to_exact_match(explicit_q):
    p = greedy_targets()
    draft_tokens = torch.tensor([
        [2, 4, 1],  # all accepted -> bonus argmax(p_4) = 3
        [2, 0, 1],  # rejected at position 2 -> argmax(p_2) = 4 emitted, tail discarded
        [5, 4, 1],  # rejected at position 1 -> 2
        [2, 4, 1],  # num_drafted = 1 -> x_1 accepted, bonus from p_2 = 4
        [2, 4, 0],  # num_drafted = 2 -> both accepted, bonus from p_3 = 1
        [9, 9, 9],  # num_drafted = 0 -> nothing to verify (entries ignored, even out of vocab), p_1 = 2
        [2, 4, 5],  # rejected at position 3 -> 1
    ])
    num_drafted = torch.tensor([3, 3, 3, 1, 2, 0, 3])
    batch = draft_tokens.shape[0]
    target = p.expand(batch, 4, 6)
    draft_probs = None
    if explicit_q is True:
        draft_probs = torch.nn.functional.one_hot(draft_tokens.clamp(max=5), 6).float()
    if explicit_q == "tokens":  # the batch decoder's greedy path: only the tokens the point masses sit on
        result = accept_greedy(draft_tokens, target.argmax(-1), num_drafted)
    else:
        result = accept(draft_tokens, draft_probs, target, num_drafted, None)
    expected = torch.tensor([
        [2, 4, 1, 3],
        [2, 4, -1, -1],
        [2, -1, -1, -1],
        [2, 4, -1, -1],
        [2, 4, 1, -1],
        [2, -1, -1, -1],
        [2, 4, 1, -1],
    ])
    assert torch.equal(result.tokens, expected)
    assert torch.equal(result.num_accepted, torch.tensor([3, 1, 0, 1, 2, 0, 2]))


def test_accept_greedy_equals_accept_on_point_masses():
    generator = torch.Generator().manual_seed(7)
    batch, gamma, vocab = 64, 5, 4  # a small vocabulary so that many drafted tokens match
    target_tokens = torch.randint(vocab, (batch, gamma + 1), generator=generator)
    draft_tokens = torch.where(torch.rand(batch, gamma, generator=generator) < 0.7, target_tokens[:, :gamma],
                               torch.randint(vocab, (batch, gamma), generator=generator))
    num_drafted = torch.randint(gamma + 1, (batch,), generator=generator)
    p = torch.nn.functional.one_hot(target_tokens, vocab).float()
    expected = accept(draft_tokens, None, p, num_drafted, None)
    result = accept_greedy(draft_tokens, target_tokens, num_drafted)
    assert torch.equal(result.tokens, expected.tokens)
    assert torch.equal(result.num_accepted, expected.num_accepted)
    assert 0 < expected.num_accepted.float().mean() < gamma  # both full and partial acceptances occurred


def test_greedy_draft_model_matches_target_argmax_walk():
    # Temperature 0 on both sides through sampling_distribution: accept while the draft's argmax is the target's.
    params = SamplingParams(temperature=0.0)
    target_logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0]])
    draft_logits = torch.tensor([[0.0, 2.0, 1.9], [0.0, 0.5, 1.0]])  # argmax 1 (match), then 2 (target says 0)
    p = sampling_distribution(target_logits, params)[None]
    q = sampling_distribution(draft_logits, params)[None]
    draft_tokens = q.argmax(-1)
    result = accept(draft_tokens, q, p, torch.tensor([2]), None)
    assert torch.equal(result.tokens, torch.tensor([[1, 0, -1]]))
    assert torch.equal(result.num_accepted, torch.tensor([1]))


def test_seeded_determinism():
    p, q = random_pair(101, gamma=3, vocab=10)
    first = run_trials(accept, p, q, n=5000, seed=42)
    second = run_trials(accept, p, q, n=5000, seed=42)
    other = run_trials(accept, p, q, n=5000, seed=43)
    assert torch.equal(first.tokens, second.tokens) and torch.equal(first.num_accepted, second.num_accepted)
    assert not torch.equal(first.tokens, other.tokens)


# ---------------------------------------------------------------------------------------------------------------
# i.i.d. acceptance: tokens per step
# ---------------------------------------------------------------------------------------------------------------


def alpha_pair(alpha: float, gamma: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position: q random on tokens 0..V-2 (q(V-1) = 0), p = alpha * q + (1 - alpha) * e_(V-1).
    Then sum_x min(p, q) = alpha exactly and a drafted token survives iff r <= p(x)/q(x) = alpha."""
    g = torch.Generator().manual_seed(seed)
    q = torch.rand(gamma + 1, vocab, generator=g, dtype=torch.float64) + 0.1
    q[:, -1] = 0
    q = q / q.sum(-1, keepdim=True)
    p = alpha * q
    p[:, -1] = 1 - alpha
    return p.float(), q[:gamma].float()


@pytest.mark.parametrize("alpha", [0.3, 0.6, 0.8, 0.9])
@pytest.mark.parametrize("gamma", [1, 3, 5])
def test_tokens_per_step_matches_geometric_law(alpha, gamma):
    p, q = alpha_pair(alpha, gamma, vocab=6, seed=int(alpha * 100) + gamma)
    n = 100_000
    trials = run_trials(accept, p, q, n=n, seed=gamma)
    assert_well_formed(trials)
    law = np.array([alpha**k * (1 - alpha) for k in range(gamma)] + [alpha**gamma])  # P(num_accepted = k)
    steps = np.arange(gamma + 1) + 1.0
    mean = (1 - alpha ** (gamma + 1)) / (1 - alpha)
    assert math.isclose(float((law * steps).sum()), mean)
    se = math.sqrt(float((law * (steps - mean) ** 2).sum()) / n)
    observed_mean = float((trials.num_accepted + 1).double().mean())
    assert abs(observed_mean - mean) <= 4 * se, f"mean tokens/step {observed_mean:.4f} vs {mean:.4f} (se {se:.4f})"
    counts = torch.bincount(trials.num_accepted, minlength=gamma + 1).numpy()
    assert stats.chisquare(counts, law * n).pvalue > P_VALUE_THRESHOLD
    assert_distribution(trials, p, min_tested_positions=gamma + 1)


# ---------------------------------------------------------------------------------------------------------------
# Regression: torch.rand can return exactly 0, and `r * q <= p` with r == 0 would accept a token with p(x) == 0
# ---------------------------------------------------------------------------------------------------------------


def test_zero_probability_draft_is_never_accepted_even_when_uniform_is_zero():
    # Seed 146: the 18,556th value of torch.rand on a fresh CPU generator is exactly 0.0.
    batch, seed = 18_556, 146
    assert float(torch.rand((batch, 1), generator=torch.Generator().manual_seed(seed))[-1, 0]) == 0.0
    target = torch.tensor([[0.0, 1.0], [0.5, 0.5]]).expand(batch, 2, 2)  # p_1(token 0) == 0
    draft_tokens = torch.zeros(batch, 1, dtype=torch.long)  # a draft-free proposer always proposes token 0
    result = accept(draft_tokens, None, target, torch.ones(batch, dtype=torch.long),
                    torch.Generator().manual_seed(seed))
    assert int(result.num_accepted.max()) == 0
    assert bool((result.tokens[:, 0] == 1).all())
