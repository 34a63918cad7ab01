"""Do emitted tokens follow a distribution? One position's check: a zero-probability check, a chi-square
goodness-of-fit test (bins with expected count < 5 pooled; a pooled bin still under 5 gets a Poisson tail test and is
folded into the largest bin) failing at p-value < P_VALUE_THRESHOLD, and a total-variation bound of TV_SIGMAS
standard deviations (a union bound over the bins)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from scipy import stats

P_VALUE_THRESHOLD = 1e-4
TV_SIGMAS = 4.5
MIN_SAMPLES = 50  # positions reached by fewer trials are not tested (reported with n)


@dataclass
class PositionCheck:
    position: int  # 0-based: position 0 is the first emitted token of the step
    n: int
    impossible: int  # emitted tokens whose target probability is 0
    pvalue: float
    tv: float
    tv_bound: float

    @property
    def ok(self) -> bool:
        if self.n < MIN_SAMPLES:
            return True
        return self.impossible == 0 and self.pvalue > P_VALUE_THRESHOLD and self.tv <= self.tv_bound

    def __str__(self) -> str:
        return (f"pos {self.position}: n={self.n} impossible={self.impossible} p-value={self.pvalue:.3g} "
                f"tv={self.tv:.4f} (bound {self.tv_bound:.4f}) {'ok' if self.ok else 'FAIL'}")


def goodness_of_fit(samples: torch.Tensor, p: torch.Tensor, position: int = 0) -> PositionCheck:
    """Do `samples` (long, [n]) look like i.i.d. draws from the probability vector p ([V])?"""
    vocab = p.shape[-1]
    if samples.numel() and (samples.min() < 0 or samples.max() >= vocab):
        return PositionCheck(position, samples.numel(), samples.numel(), 0.0, 1.0, 0.0)  # out of vocabulary
    return goodness_of_fit_counts(torch.bincount(samples, minlength=vocab), p, position)


def goodness_of_fit_counts(counts: torch.Tensor, p: torch.Tensor, position: int = 0) -> PositionCheck:
    """counts[x]: how often token x was emitted; p: the distribution it should follow."""
    counts = counts.double()
    n = int(counts.sum())
    p64 = p.double()
    p64 = p64 / p64.sum()
    if n == 0:
        return PositionCheck(position, 0, 0, 1.0, 0.0, 0.0)
    impossible = int(counts[p64 == 0].sum())
    support = p64 > 0
    observed = counts[support].numpy()
    expected = (observed.sum() * p64[support]).numpy()
    small = expected < 5
    bins_obs = list(observed[~small])
    bins_exp = list(expected[~small])
    tail_pvalue = 1.0
    if small.any():
        pooled_obs, pooled_exp = float(observed[small].sum()), float(expected[small].sum())
        # The rare bins are too rare for the chi-square approximation: a two-sided Poisson test on their total.
        upper = stats.poisson.sf(pooled_obs - 1, pooled_exp)
        lower = stats.poisson.cdf(pooled_obs, pooled_exp)
        tail_pvalue = min(1.0, 2 * min(upper, lower))
        if pooled_exp >= 5 or not bins_obs:
            bins_obs.append(pooled_obs)
            bins_exp.append(pooled_exp)
        else:
            largest = int(np.argmax(bins_exp))
            bins_obs[largest] += pooled_obs
            bins_exp[largest] += pooled_exp
    if len(bins_obs) >= 2 and sum(bins_obs) > 0:
        chi_pvalue = float(stats.chisquare(np.array(bins_obs), np.array(bins_exp)).pvalue)
    else:
        chi_pvalue = 1.0  # a single bin: only the zero-probability check applies
    tv = 0.5 * float((counts / n - p64).abs().sum())
    tv_bound = 0.5 * TV_SIGMAS * float((p64 * (1 - p64) / n).sqrt().sum()) + 1.0 / n
    return PositionCheck(position, n, impossible, min(chi_pvalue, tail_pvalue), tv, tv_bound)
