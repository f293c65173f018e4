"""edgefl.algorithms.fedeval.plugin: the FederatedEvaluation class."""

from __future__ import annotations

import pytest
import torch

from edgefl.algorithms.base import Plugin
from edgefl.algorithms.fedeval.coordinator import FedEvalCoordinator
from edgefl.algorithms.fedeval.kinds import FED_EVAL
from edgefl.algorithms.fedeval.plugin import FederatedEvaluation
from edgefl.algorithms.fedeval.worker import FedEvalWorker
from edgefl.errors import ConfigError

from ..fakes import config


def hits(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (output.argmax(-1) == target).float()


def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:  # a reserved name
    return output.sum(-1)


HITS = f"{__name__}:hits"


def test_the_plugin_wires_its_halves_and_the_kind_rank_0_handles():
    assert issubclass(FederatedEvaluation, Plugin) and FederatedEvaluation.name == "fedeval"
    assert FederatedEvaluation.coordinator is FedEvalCoordinator
    assert FederatedEvaluation.worker is FedEvalWorker
    assert FedEvalCoordinator.message_kinds == (FED_EVAL,)
    assert FederatedEvaluation.summary_keys == {"fed_eval": None}


def test_it_is_on_when_every_is_positive():
    assert not FederatedEvaluation.enabled(config())
    assert FederatedEvaluation.enabled(config(None, "evaluation.every=1"))


def test_check_config_accepts_the_defaults_and_importable_metrics():
    FederatedEvaluation.check_config(config(None, "evaluation.every=2"))
    FederatedEvaluation.check_config(config(None, f'evaluation.metrics=["{HITS}"]'))


@pytest.mark.parametrize("h", ["1.0", "1.5"])
def test_a_holdout_of_one_or_more_is_refused(h):
    with pytest.raises(ConfigError, match=r"'evaluation\.holdout' = .*must be in \(0, 1\)"):
        FederatedEvaluation.check_config(config(None, f"evaluation.holdout={h}"))


@pytest.mark.parametrize(
    "metrics, match",
    [
        ('["no_such_module_xyz:f"]', r"evaluation\.metrics\[0\].*cannot import"),
        ('["not a spec"]', r"evaluation\.metrics\[0\]"),
        (f'["{HITS}", "{HITS}"]', r"evaluation\.metrics\[1\].*'hits' is used twice"),
        (f'["{__name__}:loss"]', r"'loss' is reserved"),
        (f'["{__name__}:HITS"]', r"'HITS' is not callable"),
    ],
)
def test_a_bad_metric_is_refused_naming_its_index(metrics, match):
    with pytest.raises(ConfigError, match=match):
        FederatedEvaluation.check_config(config(None, f"evaluation.metrics={metrics}"))
