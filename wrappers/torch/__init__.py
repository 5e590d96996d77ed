"""PyTorch: torch.nn.functional ops in NCHW, torch.optim optimizers."""
from ..base import Entry


class TorchEntry(Entry):
    name = "torch"
    requires = ("torch",)
    module = "wrappers.torch.backend"
    description = "PyTorch eager, torch.nn.functional in NCHW, torch.optim"
