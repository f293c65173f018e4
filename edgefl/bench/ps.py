"""``edgefl bench ps``: parameter-server mechanisms on sparse L1 logistic regression.

Workload: the built-in ``clicks`` dataset (power-law feature frequencies, non-IID devices,
10^6 features by default) and a binary logistic regression ``p = sigmoid(x . w + b)`` trained
to minimise the training objective

    F(w, b) = mean over all devices' examples of log-loss + l1 * ||w||_1   (b not penalised)

with FedAvg rounds: every device pulls its working set of the global model (its features'
weights and the bias), runs ``local_steps`` full-batch gradient steps on its smooth local loss
at ``local_lr``, and pushes its delta; the server takes the sample-weighted mean, applies the
server optimizer and the L1 proximal step (``server.l1 = l1 * local_lr * local_steps``, so a
round with ``sgd`` at ``lr = 1`` is one proximal gradient step; see
:mod:`edgefl.algorithms.server_opt.optimizers`).

**In-process.** Devices are simulated one after another in this one process, no MPI. Every
message a device and the server exchange is really encoded and decoded with
:mod:`edgefl.algorithms.ps.compress`, and the decoded values are what training uses, so
``bytes_up``/``bytes_down`` are the exact sizes of the messages the runtime will send: each
message's payload plus the 80-byte wire header, summed over all devices and rounds.
``time_s`` is this process's wall time for the variant (training, filtering, encoding).

Variants (uplink = device -> server):

* ``dense``: pull the whole model, push the whole delta as a dense float32 vector (FedAvg).
* ``index/value``: pull only the working set (request = its keys, reply = float32 values),
  push (index, value) pairs of the working set (the encoder picks dense when denser than 1/2).
* ``key-caching``: as index/value, but the working set's key list is sent once; afterwards
  requests and pushes name it by its 16-byte hash.
* ``significant``: significantly-modified filter (``--sig-threshold``) + index/value.
* ``kkt``: KKT filter (``--l1``, ``--kkt-margin``) + index/value.
* ``combined``: KKT then significantly-modified filters, ``--value-dtype`` values with error
  feedback, key caching (pushes as a bitmap over the cached working set).
* ``fedavgm``, ``fedadam``, ``fedyogi``, ``fedadagrad``: server optimizers (index/value
  messages, lossless, so they differ from ``index/value`` only in the server step).

Second table: the working-set fraction per device (share of the model's keys a device's data
references) when a fixed pool of ``--ws-total-samples`` examples is split over 8 .. 512
devices.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field

import numpy as np

NAME = "ps"
HELP = "parameter-server mechanisms: filters, compression, key caching, server optimizers"


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="small problem (about a minute)")
    p.add_argument("--devices", type=int, default=None, help="devices [64; quick 16]")
    p.add_argument("--rounds", type=int, default=None, help="FedAvg rounds [100; quick 20]")
    p.add_argument("--features", type=int, default=None, help="features [10^6; quick 2*10^5]")
    p.add_argument("--samples-per-device", type=int, default=None, help="[2000; quick 1000]")
    p.add_argument("--nnz", type=int, default=20, help="feature draws per example [20]")
    p.add_argument("--zipf", type=float, default=1.1, help="power-law exponent [1.1]")
    p.add_argument("--noniid", type=float, default=0.5, help="device-local feature share [0.5]")
    p.add_argument("--label-skew", type=float, default=0.5, help="device logit shift std [0.5]")
    p.add_argument("--local-steps", type=int, default=5, help="local gradient steps [5]")
    p.add_argument("--local-lr", type=float, default=1.0, help="local learning rate [1.0]")
    p.add_argument("--l1", type=float, default=3e-4, help="L1 strength of the objective")
    p.add_argument("--sig-threshold", type=float, default=3e-3, help="ps.sig_threshold")
    p.add_argument("--kkt-margin", type=float, default=0.0, help="ps.kkt_margin")
    p.add_argument(
        "--value-dtype",
        default="float16",
        choices=("float32", "float16", "bfloat16"),
        help="value dtype of the combined variant",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--ws-devices", default="8,32,128,512", help="device counts of the working-set table"
    )
    p.add_argument(
        "--ws-total-samples",
        type=int,
        default=None,
        help="examples split over the devices in the working-set table [131072; quick 32768]",
    )


@dataclass
class Variant:
    """One row: how devices filter and encode, and the server optimizer."""

    name: str
    mode: str  # "dense" | "indexed" | "cached"
    filters: list[str] = field(default_factory=list)
    value_dtype: str = "float32"
    server: dict = field(default_factory=dict)


@dataclass
class Device:
    """A device's data restricted to its working set (columns remapped to 0..m-1)."""

    x: object  # scipy CSR, n x m
    y: np.ndarray  # float64 labels
    keys: np.ndarray  # working-set keys (feature ids, then the bias key)
    n: int


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * z))


def _logloss(z: np.ndarray, y: np.ndarray) -> float:
    # log(1 + exp(-z)) for y = 1, log(1 + exp(z)) for y = 0
    s = np.where(y > 0.5, -z, z)
    return float(np.logaddexp(0.0, s).sum())


def build_devices(data, layout) -> list[Device]:
    from ..policies.keyrange import csr_columns, linear_working_set

    out = []
    for k in range(data.num_devices):
        ex = data.train(k)
        cols = csr_columns(ex.csr)
        ws = linear_working_set(layout, "weight", cols, dense=["bias"])
        x = ex.csr[:, cols].tocsr().astype(np.float64)
        out.append(Device(x, ex.labels.astype(np.float64), ws.keys, ex.csr.shape[0]))
    return out


def local_train(dev: Device, pulled: np.ndarray, steps: int, lr: float):
    """K full-batch gradient steps from ``pulled`` (working-set values, bias last).

    Returns ``(delta float32, gradient at the pulled point float64)``.
    """
    w = pulled[:-1].astype(np.float64)
    b = float(pulled[-1])
    g0 = None
    for s in range(steps):
        r = _sigmoid(dev.x @ w + b) - dev.y
        gw = dev.x.T @ r / dev.n
        gb = float(r.mean())
        if s == 0:
            g0 = np.concatenate([gw, [gb]])
        w -= lr * gw
        b -= lr * gb
    new = np.concatenate([w, [b]]).astype(np.float32)
    return new - pulled.astype(np.float32), g0


def objective(data, devices_full, w: np.ndarray, l1: float) -> tuple[float, float]:
    """(training objective incl. L1, test accuracy) of the global model ``w`` (bias last)."""
    feats, b = w[:-1].astype(np.float64), float(w[-1])
    loss, n = 0.0, 0
    for ex in devices_full:
        loss += _logloss(ex.csr @ feats + b, ex.labels)
        n += ex.csr.shape[0]
    te = data.test()
    acc = float(np.mean(((te.csr @ feats + b) > 0) == (te.labels > 0)))
    return loss / n + l1 * float(np.abs(feats).sum()), acc


def run_variant(v: Variant, data, devices: list[Device], cfg: dict) -> dict:
    """Simulate ``cfg['rounds']`` rounds of one variant; returns its row."""
    from edgefl.algorithms.server_opt.optimizers import make_server_optimizer

    from ..algorithms.ps.compress import Decoder, Encoder, round_values
    from ..algorithms.ps.filters import FilterContext, make_filter_chain
    from ..policies.keyrange import KeyRange, gather

    feats = data.features
    space = feats + 1  # weights, then the bias
    bias_key = feats
    steps, lr = cfg["local_steps"], cfg["local_lr"]
    total_n = sum(d.n for d in devices)
    server_cfg = {"lr": 1.0, **v.server, "l1": cfg["l1"] * lr * steps}
    opt = make_server_optimizer(server_cfg, l1_keys=KeyRange(0, feats))
    quant = None
    if v.value_dtype != "float32":

        def quant(x, dt=v.value_dtype):
            return round_values(x, dt)

    ps = {
        "filters": v.filters,
        "sig_threshold": cfg["sig_threshold"],
        "l1": cfg["l1"],
        "kkt_margin": cfg["kkt_margin"],
    }
    chains = [make_filter_chain(ps, quant, exempt=[bias_key]) for _ in devices]
    cache = v.mode == "cached"
    up_enc = [
        Encoder(space, v.value_dtype, key_cache=cache, allow_indexed=v.mode != "dense")
        for _ in devices
    ]
    up_dec = [Decoder(space) for _ in devices]
    down_enc = Encoder(space, "float32")
    down_dec = Decoder(space)
    glob = np.zeros(space, np.float32)
    bytes_up = bytes_down = 0
    t0 = time.perf_counter()
    for _r in range(cfg["rounds"]):
        acc = np.zeros(space, np.float64)
        for k, dev in enumerate(devices):
            # pull
            if v.mode == "dense":
                msg = down_enc.encode_values(glob)
                bytes_down += msg.wire_bytes
                pulled = down_dec.decode(msg).values[dev.keys]
            else:
                req = up_enc[k].encode_keys(dev.keys)
                bytes_up += req.wire_bytes
                keys = up_dec[k].decode(req).keys
                rep = down_enc.encode_values(gather(glob, keys))
                bytes_down += rep.wire_bytes
                pulled = down_dec.decode(rep).values
            # train, filter, push
            delta, g0 = local_train(dev, pulled, steps, lr)
            if v.filters or quant is not None:
                ctx = FilterContext(dev.keys, pulled, g0)
                sk, sv = chains[k].apply(dev.keys, delta, ctx)
            else:
                sk, sv = dev.keys, delta
            msg = up_enc[k].encode(sk, sv, base=dev.keys, remember=not v.filters)
            bytes_up += msg.wire_bytes
            got = up_dec[k].decode(msg)
            w = dev.n / total_n
            if got.keys is None:
                acc += w * got.values.astype(np.float64)
            else:
                acc[got.keys] += w * got.values.astype(np.float64)
        opt.step(glob, acc.astype(np.float32))
    elapsed = time.perf_counter() - t0
    obj, accuracy = objective(data, [data.train(k) for k in range(len(devices))], glob, cfg["l1"])
    row = {
        "variant": v.name,
        "bytes_up": int(bytes_up),
        "bytes_down": int(bytes_down),
        "final_objective": obj,
        "accuracy": accuracy,
        "time_s": round(elapsed, 2),
    }
    kkt = [f for c in chains for f in c.filters if f.name == "kkt"]
    if kkt:
        row["_kkt_skipped"] = sum(f.skipped for f in kkt) / max(1, sum(f.seen for f in kkt))
    row["_nnz"] = int(np.count_nonzero(glob[:feats]))
    return row


def working_set_rows(cfg: dict, counts: list[int]) -> list[dict]:
    """Working-set fraction per device when ``ws_total_samples`` examples are split."""
    from ..data.clicks import ClicksFederated
    from ..policies.keyrange import ParamLayout, csr_columns, linear_working_set

    rows = []
    for d in counts:
        per = max(1, cfg["ws_total_samples"] // d)
        data = ClicksFederated(
            {**cfg["data_args"], "samples_per_device": per, "test_samples_per_device": 1},
            d,
            cfg["seed"],
        )
        layout = ParamLayout.from_shapes(["weight", "bias"], [(data.features,), (1,)])
        fr = np.array(
            [
                linear_working_set(
                    layout, "weight", csr_columns(data.train(k).csr), dense=["bias"]
                ).fraction
                for k in range(d)
            ]
        )
        rows.append(
            {
                "devices": d,
                "samples_per_device": per,
                "ws_fraction_mean": float(fr.mean()),
                "ws_fraction_min": float(fr.min()),
                "ws_fraction_max": float(fr.max()),
            }
        )
    return rows


def resolve(args: argparse.Namespace) -> dict:
    q = args.quick

    def pick(val, full, quick):
        return val if val is not None else (quick if q else full)

    cfg = {
        "quick": q,
        "devices": pick(args.devices, 64, 16),
        "rounds": pick(args.rounds, 100, 20),
        "local_steps": args.local_steps,
        "local_lr": args.local_lr,
        "l1": args.l1,
        "sig_threshold": args.sig_threshold,
        "kkt_margin": args.kkt_margin,
        "value_dtype": args.value_dtype,
        "seed": args.seed,
        "ws_devices": [int(x) for x in str(args.ws_devices).split(",") if x],
        "ws_total_samples": pick(args.ws_total_samples, 131072, 32768),
        "data_args": {
            "features": pick(args.features, 1_000_000, 200_000),
            "samples_per_device": pick(args.samples_per_device, 2000, 1000),
            "nnz_per_example": args.nnz,
            "zipf": args.zipf,
            "noniid": args.noniid,
            "label_skew": args.label_skew,
        },
    }
    return cfg


VARIANTS = [
    Variant("dense", "dense"),
    Variant("index/value", "indexed"),
    Variant("key-caching", "cached"),
    Variant("significant", "indexed", ["significant"]),
    Variant("kkt", "indexed", ["kkt"]),
    Variant("combined", "cached", ["kkt", "significant"]),
    Variant("fedavgm", "indexed", server={"optimizer": "fedavgm", "lr": 0.3, "beta1": 0.7}),
    Variant("fedadam", "indexed", server={"optimizer": "fedadam", "lr": 0.03, "tau": 1e-3}),
    Variant("fedyogi", "indexed", server={"optimizer": "fedyogi", "lr": 0.03, "tau": 1e-3}),
    Variant("fedadagrad", "indexed", server={"optimizer": "fedadagrad", "lr": 0.1, "tau": 1e-3}),
]


def main(args: argparse.Namespace) -> int:
    from ..data.clicks import ClicksFederated
    from ..policies.keyrange import ParamLayout
    from .common import header, table, write_json

    cfg = resolve(args)
    header(NAME, sys.argv, cfg, args.seed)
    print("# in-process: devices run one after another in this process (no MPI); bytes are")
    print("# the exact encoded message sizes (payload + 80-byte wire header), all rounds")
    data = ClicksFederated(cfg["data_args"], cfg["devices"], cfg["seed"])
    layout = ParamLayout.from_shapes(["weight", "bias"], [(data.features,), (1,)])
    t0 = time.perf_counter()
    devices = build_devices(data, layout)
    wsf = np.mean([d.keys.size for d in devices]) / layout.numel
    print(f"# data built in {time.perf_counter() - t0:.1f} s; mean working set {wsf:.4%}")
    sys.stdout.flush()
    rows = []
    for v in VARIANTS:
        if v.name == "combined":
            v.value_dtype = cfg["value_dtype"]
        rows.append(run_variant(v, data, devices, cfg))
        r = rows[-1]
        print(
            f"#   {r['variant']}: objective {r['final_objective']:.5f}, "
            f"up {r['bytes_up']} B, {r['time_s']} s",
            flush=True,
        )
    base = rows[0]
    shown = []
    for r in rows:
        s = {k: v for k, v in r.items() if not k.startswith("_")}
        s["up_reduction"] = base["bytes_up"] / r["bytes_up"]
        s["objective_vs_dense"] = r["final_objective"] / base["final_objective"] - 1.0
        s["model_nnz"] = r["_nnz"]
        if "_kkt_skipped" in r:
            s["kkt_skipped"] = r["_kkt_skipped"]
        shown.append(s)
    cols = ["variant", "bytes_up", "bytes_down", "final_objective", "accuracy", "time_s"]
    print(table(shown, cols + ["up_reduction", "objective_vs_dense", "model_nnz", "kkt_skipped"]))
    ws_rows = working_set_rows(cfg, cfg["ws_devices"])
    print(table(ws_rows, list(ws_rows[0])))
    comb = next(r for r in shown if r["variant"] == "combined")
    cut_ok = comb["up_reduction"] >= 5.0
    obj_ok = abs(comb["objective_vs_dense"]) <= 0.01
    fr = [r["ws_fraction_mean"] for r in ws_rows]
    falls = all(b < a for a, b in zip(fr, fr[1:]))
    iv = next(r for r in shown if r["variant"] == "index/value")
    print(
        f"# combined vs index/value uplink: {iv['bytes_up'] / comb['bytes_up']:.1f}x less; "
        f"KKT filter skipped {comb.get('kkt_skipped', 0.0):.1%} of the entries it saw"
    )
    print(
        f"# target: combined uplink cut >= 5x: {comb['up_reduction']:.1f}x "
        f"{'HOLDS' if cut_ok else 'FAILS'}; objective within 1% of dense: "
        f"{comb['objective_vs_dense']:+.3%} {'HOLDS' if obj_ok else 'FAILS'}"
    )
    print(
        "# target: working-set fraction falls as devices grow: "
        + " > ".join(f"{x:.4%}" for x in fr)
        + f" {'HOLDS' if falls else 'FAILS'}"
    )
    write_json(args.json, [{k: r[k] for k in cols} for r in rows] + ws_rows)
    return 0
