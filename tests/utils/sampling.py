"""Sampling test data shared by the sampler, rejection-sampler and GPU sampling tests."""
import torch


class Params:
    """Just the fields the sampler reads (SamplingParams has more)."""

    def __init__(self, temperature=1.0, top_k=0, top_p=1.0, seed=None):
        self.temperature, self.top_k, self.top_p, self.seed = temperature, top_k, top_p, seed


# Target rows p and draft rows q of the distribution tests (rows are probability vectors).
P_ROWS = torch.tensor([[0.40, 0.25, 0.20, 0.10, 0.05],
                       [0.05, 0.10, 0.15, 0.30, 0.40],
                       [0.20, 0.20, 0.20, 0.20, 0.20]], dtype=torch.float64)
Q_NONTRIVIAL = torch.tensor([[0.10, 0.10, 0.50, 0.20, 0.10],
                             [0.30, 0.30, 0.10, 0.20, 0.10]], dtype=torch.float64)
