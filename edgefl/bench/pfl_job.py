"""The FedAvg job of ``edgefl bench scale`` in Apple's pfl (pfl-research 0.6), one process.

``edgefl bench scale --systems pfl`` runs this file as a script under ``--pfl-python`` (an
interpreter with ``pfl[pytorch]`` that need not have edgefl)::

    python pfl_job.py DATA.npz '{"rounds": 3, "lr": 0.5, "local_steps": 5, "seed": 0}'

``DATA.npz`` (written by the parent with edgefl's own generator, so the data and the initial
model are edgefl's): ``x``/``y`` every device's training rows one after the other,
``offsets`` (device ``d`` owns rows ``offsets[d]:offsets[d+1]``), ``x_test``/``y_test`` the
test set, ``weight``/``bias`` the initial logistic-regression model.

The job in pfl's terms: ``torch.nn.Linear(dim, classes)`` with cross-entropy, local SGD at
``lr`` for ``local_steps`` full-batch steps (``local_batch_size=None``: one batch is the
device's whole dataset, so ``local_num_epochs`` = steps), the central optimizer plain SGD at
lr 1.0 (FedAvg: the model plus the mean update), cohort = every device each round (a
``MinimizeReuseUserSampler`` over the device ids visits each once per round), the mean
weighted by data points (``WeightByDatapoints``; pfl's own default weight is 1 per user),
``SimulatedBackend`` (one process), and the central model evaluated on the test set every
round (``CentralEvaluationCallback``). Prints one JSON line: ``rounds_per_s`` and
``cpu_s_per_round`` between the end of round 1 and the end of the last round, and
``final_accuracy``.

Imports only numpy, torch, pfl, json, sys and time.
"""

import json
import sys
import time

if __name__ == "__main__" and not getattr(sys.flags, "safe_path", False):
    del sys.path[0]  # (this file's folder, edgefl/bench: its modules must not shadow others)

ACCURACY = "Central val | accuracy"


def main(argv: list) -> int:
    import numpy as np
    import torch

    torch.set_num_threads(1)  # one core, as the plain loop and every edgefl rank
    # (pfl.model.pytorch first: importing it selects pfl's PyTorch ops for the rest)
    from pfl.model.pytorch import PyTorchModel  # isort: skip
    from pfl.aggregate.simulate import SimulatedBackend
    from pfl.aggregate.weighting import WeightByDatapoints
    from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
    from pfl.callback.base import TrainingProcessCallback
    from pfl.callback.central_evaluation import CentralEvaluationCallback
    from pfl.data.dataset import Dataset
    from pfl.data.federated_dataset import FederatedDataset
    from pfl.data.sampling import MinimizeReuseUserSampler
    from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
    from pfl.metrics import Metrics, Weighted

    path, opts = argv[1], json.loads(argv[2])
    rounds, seed = int(opts["rounds"]), int(opts.get("seed", 0))
    np.random.seed(seed)  # (pfl draws its central seeds from numpy's global generator)
    torch.manual_seed(seed)

    t0 = time.perf_counter()
    with np.load(path) as z:
        x, y = torch.from_numpy(z["x"]), torch.from_numpy(z["y"])
        offsets = z["offsets"].tolist()
        x_test, y_test = torch.from_numpy(z["x_test"]), torch.from_numpy(z["y_test"])
        weight, bias = torch.from_numpy(z["weight"]), torch.from_numpy(z["bias"])
    n_dev = len(offsets) - 1
    # device d's dataset: views of its rows (torch tensors: pfl's to_tensor would turn
    # numpy labels into float32)
    users = [(x[offsets[d] : offsets[d + 1]], y[offsets[d] : offsets[d + 1]]) for d in range(n_dev)]

    class LogReg(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(weight.shape[1], weight.shape[0])
            with torch.no_grad():
                self.linear.weight.copy_(weight)
                self.linear.bias.copy_(bias)

        def forward(self, xb):
            return self.linear(xb)

        def loss(self, xb, yb):
            self.train()
            return torch.nn.functional.cross_entropy(self(xb), yb)

        @torch.no_grad()
        def metrics(self, xb, yb):
            self.eval()
            logits = self(xb)
            n = len(yb)
            loss = torch.nn.functional.cross_entropy(logits, yb, reduction="sum").item()
            right = (logits.argmax(1) == yb).sum().item()
            return {"loss": Weighted(loss, n), "accuracy": Weighted(right, n)}

    net = LogReg()
    model = PyTorchModel(
        model=net,
        local_optimizer_create=torch.optim.SGD,
        central_optimizer=torch.optim.SGD(net.parameters(), lr=1.0),
    )
    train = FederatedDataset(
        make_dataset_fn=lambda uid: Dataset(users[uid], user_id=uid),
        user_sampler=MinimizeReuseUserSampler(list(range(n_dev))),
    )
    backend = SimulatedBackend(training_data=train, val_data=None,
                               postprocessors=[WeightByDatapoints()])  # fmt: skip
    eval_params = NNEvalHyperParams(local_batch_size=None)
    train_params = NNTrainHyperParams(
        local_num_epochs=int(opts["local_steps"]),  # one full batch per epoch
        local_learning_rate=float(opts["lr"]),
        local_batch_size=None,
    )
    algo_params = NNAlgorithmParams(
        central_num_iterations=rounds,
        # per-device evaluation before and after local training (not part of the job) runs in
        # the iterations divisible by this: only the first, which the rates exclude
        evaluation_frequency=rounds + 1,
        train_cohort_size=n_dev,
        val_cohort_size=None,
    )

    class Clock(TrainingProcessCallback):
        """The end of each round (after the central evaluation) and its test accuracy."""

        def __init__(self) -> None:
            self.wall, self.cpu, self.acc = [], [], []

        def after_central_iteration(self, aggregate_metrics, model, *, central_iteration):
            self.wall.append(time.perf_counter())
            self.cpu.append(time.process_time())
            got = aggregate_metrics[ACCURACY] if ACCURACY in aggregate_metrics else None
            self.acc.append(None if got is None else float(got.overall_value))
            return False, Metrics()

    test = Dataset((x_test, y_test))
    clock = Clock()
    setup_s = time.perf_counter() - t0
    # (pfl's central evaluation runs before round 1 and after every round but the first)
    callbacks = [CentralEvaluationCallback(test, model_eval_params=eval_params, frequency=1), clock]
    FederatedAveraging().run(
        algorithm_params=algo_params,
        backend=backend,
        model=model,
        model_train_params=train_params,
        model_eval_params=eval_params,
        callbacks=callbacks,
        send_metrics_to_platform=False,  # (it would print every metric every round)
    )
    acc = clock.acc[-1]
    if acc is None:  # (one round: pfl evaluated only the initial model)
        acc = float(model.evaluate(test, eval_params=eval_params)["accuracy"].overall_value)
    steady = len(clock.wall) - 1
    out = {
        "rounds_per_s": steady / (clock.wall[-1] - clock.wall[0]) if steady else float("nan"),
        "cpu_s_per_round": (clock.cpu[-1] - clock.cpu[0]) / steady if steady else float("nan"),
        "final_accuracy": acc,
        "test_accuracy_per_round": clock.acc,
        "setup_s": setup_s,
        "devices": n_dev,
    }
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
