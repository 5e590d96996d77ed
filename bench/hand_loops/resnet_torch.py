"""Hand-written PyTorch loop for resnet_tiny (32x32x3), the way PyTorch users write a ResNet: nn.Module basic
blocks (conv-BN-ReLU-conv-BN, 1x1 projection with BatchNorm on the stride-2 blocks, add, ReLU), nn.BatchNorm2d,
torch.optim.SGD(momentum), eager, loss.item() logged every step, the test set
evaluated (model.eval(), no_grad) every 50 steps. The stride-2 convolutions pad the odd pixel
bottom/right (F.pad), as the spec's TF-style 'same' asks.

    python bench/hand_loops/resnet_torch.py --steps 100      -> one JSON line (see _common.report)
"""
import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parents[1]))

from bench.hand_loops._common import (BN_EPS, BN_MOMENTUM, LR, MOMENTUM, RESNET_BLOCKS, Timer,  # noqa: E402
                                      evaluates_after, parse_args, problem, report, setup_env)

args = parse_args(__doc__)
setup_env()
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from bench.hand_loops._torch_tensors import evaluator, tensors  # noqa: E402

torch.set_num_threads(1)
P = problem(args.steps, "resnet_tiny")


def bn(c: int) -> nn.BatchNorm2d:
    return nn.BatchNorm2d(c, eps=BN_EPS, momentum=BN_MOMENTUM)


class Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.stride = stride
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1 if stride == 1 else 0, bias=False)
        self.bn1, self.bn2 = bn(cout), bn(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.proj = nn.Conv2d(cin, cout, 1, stride=stride, bias=False) if stride != 1 else None
        self.proj_bn = bn(cout) if stride != 1 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.pad(x, (0, 1, 0, 1)) if self.stride == 2 else x
        h = self.bn2(self.conv2(F.relu(self.bn1(self.conv1(h)))))
        s = x if self.proj is None else self.proj_bn(self.proj(x))
        return F.relu(h + s)


class ResNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem, self.stem_bn = nn.Conv2d(3, 16, 3, padding=1, bias=False), bn(16)
        self.blocks = nn.ModuleDict({name: Block(cin, cout, s) for name, cin, cout, s in RESNET_BLOCKS})
        self.fc = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.stem_bn(self.stem(x)))
        for b in self.blocks.values():
            x = b(x)
        return self.fc(x.mean(dim=(2, 3)))


model = ResNet()
w = P.params
with torch.no_grad():   # the canonical weights: HWIO kernels -> OIHW, (in, out) dense -> (out, in)
    def conv(m: nn.Conv2d, name: str) -> None:
        m.weight.copy_(torch.from_numpy(w[f"{name}.kernel"].transpose(3, 2, 0, 1).copy()))

    def norm(m: nn.BatchNorm2d, name: str) -> None:
        for attr, key in (("weight", "gamma"), ("bias", "beta"), ("running_mean", "running_mean"),
                          ("running_var", "running_var")):
            getattr(m, attr).copy_(torch.from_numpy(w[f"{name}.{key}"]))
    conv(model.stem, "stem")
    norm(model.stem_bn, "stem_bn")
    for name, b in model.blocks.items():
        conv(b.conv1, f"{name}_conv1"), norm(b.bn1, f"{name}_bn1"), conv(b.conv2, f"{name}_conv2"), norm(b.bn2, f"{name}_bn2")
        if b.proj is not None:
            conv(b.proj, f"{name}_proj"), norm(b.proj_bn, f"{name}_proj_bn")
    model.fc.weight.copy_(torch.from_numpy(w["fc.kernel"].T.copy()))
    model.fc.bias.copy_(torch.from_numpy(w["fc.bias"]))

opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
loss_fn = nn.CrossEntropyLoss()
X, Y, order, XT, YT = tensors(P, args.steps)      # NCHW, once
evaluate = evaluator(model, loss_fn, XT, YT)

model.train()
losses, timer = [], Timer()
evals = [evaluate()]
timer.stamp()
for step in range(args.steps):
    idx = order[step]
    opt.zero_grad()
    loss = loss_fn(model(X[idx]), Y[idx])
    loss.backward()
    opt.step()
    losses.append(loss.item())
    timer.stamp()
    if evaluates_after(step + 1, args.steps):
        with timer.evaluating():
            evals.append(evaluate())
report("torch", timer, args.warmup, losses, evals, versions={"torch": torch.__version__}, threads=torch.get_num_threads())
