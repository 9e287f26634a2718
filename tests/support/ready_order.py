"""A two-layer MLP whose parameters are registered in the order their gradients become
ready (eager autograd: last layer first, bias before weight). A fresh DDP's first bucket
lists parameters in registration order and the rebuilt one in ready order; with the two
equal, the first step after a resume sends the same bucket as the uninterrupted run, so
resuming can be compared with it bit for bit."""

import torch


class ReadyOrderMLP(torch.nn.Module):
    def __init__(self, inputs: int = 16, hidden: int = 32, classes: int = 4, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.b2 = torch.nn.Parameter(torch.randn(classes, generator=g) * 0.1)
        self.w2 = torch.nn.Parameter(torch.randn(classes, hidden, generator=g) / hidden**0.5)
        self.b1 = torch.nn.Parameter(torch.randn(hidden, generator=g) * 0.1)
        self.w1 = torch.nn.Parameter(torch.randn(hidden, inputs, generator=g) / inputs**0.5)

    def forward(self, x):
        hidden = torch.tanh(torch.nn.functional.linear(x, self.w1, self.b1))
        return torch.nn.functional.linear(hidden, self.w2, self.b2)
