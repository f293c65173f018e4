"""``edgefl bench stacked``: local training of many devices, one by one (the sequential
trainer, ``fit_loop``) against one stacked computation (``edgefl.training.stacked``), in
this process on one core, side by side.

The job is the issue's FedAvg probe: logistic regression (or ``--model mlp``), ``--samples``
examples per device, ``--steps`` full-batch SGD steps (``--batch`` for mini-batches), every
device starting from one model. Printed: seconds per device of each path, their ratio,
and the largest relative difference of the trained parameters. ``--kernels`` picks the CPU
kernels, ``portable`` (the default, as a job's ``run.kernels``) or ``native``. This measures
the kernel alone; a job uses it with ``train.vectorize = "auto"`` (edgefl/runtime/stacking.py).
"""

from __future__ import annotations

import sys
import time

NAME = "stacked"
HELP = "local training of many devices: one by one vs one stacked torch.func computation"


def add_args(p) -> None:
    p.add_argument("--devices", type=int, default=2000, help="devices trained (default 2000)")
    p.add_argument("--samples", type=int, default=200, help="examples per device")
    p.add_argument("--features", type=int, default=60, help="input features")
    p.add_argument("--classes", type=int, default=10, help="classes")
    p.add_argument("--steps", type=int, default=5, help="SGD steps per device")
    p.add_argument("--batch", type=int, default=0, help="batch size (0: full batch)")
    p.add_argument("--model", choices=("logreg", "mlp"), default="logreg")
    p.add_argument("--chunk", type=int, default=500, help="devices per stacked call")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--kernels",
        choices=("portable", "native"),
        default="portable",
        help="CPU kernels (edgefl's run.kernels, pinned here before torch runs): portable "
        "(the default, as a job runs) or native (this CPU's fastest)",
    )


def main(args) -> int:
    from .. import kernels

    why = kernels.pin(args.kernels)  # (before torch runs a kernel here)
    if why is not None:
        print(f"edgefl bench {NAME}: {why}", file=sys.stderr)
        return 2
    import torch
    from torch import nn
    from torch.utils.data import TensorDataset

    from ..training.client import FitContext
    from ..training.stacked import fit_stacked
    from ..training.trainer import fit_loop
    from .common import header, table, write_json

    header(NAME, ["edgefl", "bench", NAME, *sys.argv[3:]], vars(args) | {"func": None}, args.seed)
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(args.seed)
    k, n, f, c = args.devices, args.samples, args.features, args.classes
    X = torch.randn(k, n, f, generator=g)
    Y = torch.randint(0, c, (k, n), generator=g)
    torch.manual_seed(args.seed)
    if args.model == "logreg":
        model: nn.Module = nn.Linear(f, c)
    else:
        model = nn.Sequential(nn.Linear(f, 64), nn.ReLU(), nn.Linear(64, c))
    start = {name: p.detach().clone() for name, p in model.named_parameters()}
    ce = nn.functional.cross_entropy
    lr = 0.1

    def gens(lo: int, hi: int) -> list[torch.Generator]:
        return [torch.Generator().manual_seed(args.seed * 100003 + d) for d in range(lo, hi)]

    t0 = time.perf_counter()
    seq = []
    for d, gen in zip(range(k), gens(0, k)):
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(start[name])
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        ctx = FitContext(d, 0, 0, gen, "cpu", ce, None)
        fit_loop(model, TensorDataset(X[d], Y[d]), epochs=0, steps=args.steps,
                 batch_size=args.batch, generator=gen, optimizer=opt, ctx=ctx)  # fmt: skip
        seq.append({name: p.detach().clone() for name, p in model.named_parameters()})
    t_seq = time.perf_counter() - t0

    t0 = time.perf_counter()
    stacked: dict[str, list[torch.Tensor]] = {name: [] for name in start}
    for lo in range(0, k, args.chunk):
        hi = min(k, lo + args.chunk)
        got, _ = fit_stacked(model, start, X[lo:hi], Y[lo:hi], generators=gens(lo, hi),
                             loss=ce, lr=lr, steps=args.steps, batch_size=args.batch)  # fmt: skip
        for name in start:
            stacked[name].append(got[name])
    t_stack = time.perf_counter() - t0
    worst = 0.0
    for name in start:
        s = torch.cat(stacked[name])
        ref = torch.stack([d[name] for d in seq])
        worst = max(worst, ((s - ref).abs().max() / ref.abs().max().clamp_min(1e-12)).item())
    rows = [
        {"path": "one by one", "ms_per_device": 1e3 * t_seq / k, "speedup": 1.0},
        {
            "path": "stacked",
            "ms_per_device": 1e3 * t_stack / k,
            "speedup": t_seq / t_stack,
            "max_rel_diff": worst,
        },  # fmt: skip
    ]
    print(table(rows, ["path", "ms_per_device", "speedup", "max_rel_diff"]))
    write_json(args.json, rows)
    return 0
