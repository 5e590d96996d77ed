"""Hand-written PyTorch loop for cnn2d_2conv_2fc, the way PyTorch users write it: nn.Sequential,
torch.optim.SGD(momentum), eager, the whole data set as one tensor, loss.item() logged every step, the test set
evaluated (model.eval(), no_grad) every 50 steps.

    python bench/hand_loops/torch.py --steps 400      -> one JSON line (see _common.report)
"""
import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent          # this file is torch.py: never let it shadow torch
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parents[1]))

from bench.hand_loops._common import (LR, MOMENTUM, Timer, evaluates_after, flatten_perm,  # noqa: E402
                                      parse_args, problem, report, setup_env)

args = parse_args(__doc__)
setup_env()
import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

from bench.hand_loops._torch_tensors import evaluator, tensors  # noqa: E402

torch.set_num_threads(1)
P = problem(args.steps)

model = nn.Sequential(
    nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
    nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.Flatten(),
    nn.Linear(4 * 4 * 32, 64), nn.ReLU(), nn.Linear(64, 10),
)
w = P.params
with torch.no_grad():   # the canonical weights in torch layout: OIHW kernels, (out, in) dense, CHW flatten
    model[0].weight.copy_(torch.from_numpy(w["conv1.kernel"].transpose(3, 2, 0, 1).copy()))
    model[0].bias.copy_(torch.from_numpy(w["conv1.bias"]))
    model[3].weight.copy_(torch.from_numpy(w["conv2.kernel"].transpose(3, 2, 0, 1).copy()))
    model[3].bias.copy_(torch.from_numpy(w["conv2.bias"]))
    model[6].weight.copy_(torch.from_numpy(np.ascontiguousarray(w["fc1.kernel"][flatten_perm()].T)))
    model[6].bias.copy_(torch.from_numpy(w["fc1.bias"]))
    model[8].weight.copy_(torch.from_numpy(np.ascontiguousarray(w["fc2.kernel"].T)))
    model[8].bias.copy_(torch.from_numpy(w["fc2.bias"]))

opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
loss_fn = nn.CrossEntropyLoss()
X, Y, order, XT, YT = tensors(P, args.steps)      # NCHW, once
evaluate = evaluator(model, loss_fn, XT, YT)

losses, timer = [], Timer()
evals = [evaluate()]
timer.stamp()
for step in range(args.steps):
    idx = order[step]
    xb, yb = X[idx], Y[idx]
    opt.zero_grad()
    loss = loss_fn(model(xb), yb)
    loss.backward()
    opt.step()
    losses.append(loss.item())
    timer.stamp()
    if evaluates_after(step + 1, args.steps):
        with timer.evaluating():
            evals.append(evaluate())
report("torch", timer, args.warmup, losses, evals, versions={"torch": torch.__version__},
       threads=torch.get_num_threads())
