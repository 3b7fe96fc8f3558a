"""Chi-square goodness of fit without scipy.

The statistic sum((O - E)^2 / E) over k categories is asymptotically chi-square with k - 1 degrees
of freedom when the observations follow the expected distribution; its upper tail probability is
the regularized upper incomplete gamma function Q(df/2, stat/2) (torch.special.gammaincc).
"""
import torch


def chi_square_p_value(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    counts = counts.to(torch.float64)
    expected = expected_probs.to(torch.float64) * counts.sum()
    keep = expected > 0
    # Mass where nothing is expected is an outright failure, not something to average away.
    if counts[~keep].sum() > 0:
        return 0.0
    stat = ((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))
