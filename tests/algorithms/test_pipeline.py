"""The two wire pipelines of edgefl.algorithms.base: an Upload through the worker plugins'
``encode`` chain and a Download through rank 0's ``send_model`` chain. At most one plugin
encodes either (a second encoder is an error naming both); a dense transform edits the
Upload's delta in place for the plugins after it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from edgefl.algorithms.base import Download, LocalJob, TaskSpec, Upload
from edgefl.algorithms.fedbn import FedBN
from edgefl.algorithms.gddr.kinds import RESIDUAL
from edgefl.algorithms.gddr.plugin import GDDR
from edgefl.algorithms.ps.plugin import ParameterServer
from edgefl.algorithms.scaffold import Scaffold
from edgefl.comm import Kind
from edgefl.models.flat import FlatParams

from .fakes import FakeWorkerContext, config

AUX = (7.0, 0.25, 1.5, 3.0)


def _upload(n: int = 4) -> Upload:
    return Upload(2, 9, np.arange(n, dtype=np.float32), AUX)


def test_a_fresh_upload_is_the_dense_update_nobody_encoded():
    up = _upload()
    assert (up.by, up.kind, up.payload, up.flush) == ("", None, None, False)
    assert up.aux == AUX and up.delta.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_encoding_an_upload_sets_its_kind_payload_and_encoder_and_keeps_the_aux():
    up = _upload()
    payload = np.ones(3, np.float32)
    up.encode("mine", np.int64(int(Kind.UPDATE)), payload)
    assert (up.by, up.kind, up.aux) == ("mine", int(Kind.UPDATE), AUX)
    assert type(up.kind) is int and up.payload is payload


def test_an_encoding_s_aux_replaces_the_updates():
    up = _upload()
    up.encode("mine", 77, np.ones(2, np.float32), [1.0, 2.0, 3.0, 4.0])
    assert up.aux == (1.0, 2.0, 3.0, 4.0) and isinstance(up.aux, tuple)


def test_a_second_encoder_of_an_upload_is_an_error_naming_both_and_the_first_stays():
    up = _upload()
    first = np.ones(2, np.float32)
    up.encode("gddr", 77, first, (1.0, 1.0, 1.0, 1.0))
    with pytest.raises(RuntimeError, match=r"device 2 task 9: plugins 'gddr' and 'ps' both"):
        up.encode("ps", 78, np.zeros(2, np.float32), (0.0, 0.0, 0.0, 0.0))
    assert (up.by, up.kind, up.payload, up.aux) == ("gddr", 77, first, (1.0, 1.0, 1.0, 1.0))


def test_a_download_is_the_whole_model_unless_a_plugin_encodes_it():
    down = Download(3, 11)
    assert (down.rank, down.version, down.by, down.kind, down.payload, down.aux) == (
        3, 11, "", None, None, ()
    )  # fmt: skip
    vals = np.ones(2, np.float32)
    down.encode("ps", np.int32(5), vals, [2.0, 123.0])
    assert (down.by, down.kind, down.aux) == ("ps", 5, (2.0, 123.0)) and down.payload is vals
    assert type(down.kind) is int


def test_a_second_encoder_of_a_download_is_an_error_naming_both():
    down = Download(3, 11)
    down.encode("ps", 5, np.ones(2, np.float32), (2.0, 1.0))
    with pytest.raises(RuntimeError, match=r"model to rank 3: plugins 'ps' and 'mine' both"):
        down.encode("mine", 6, np.zeros(2, np.float32))
    assert (down.by, down.kind, down.aux) == ("ps", 5, (2.0, 1.0))


def test_the_dense_transform_runs_before_the_encoders():
    # FedBN zeroes its buffers in up.delta before GDDR, the parameter server or SCAFFOLD
    # encode the update (the encode chain runs in plugin order)
    assert FedBN.order < min(GDDR.order, ParameterServer.order, Scaffold.order)


def test_an_encoder_after_fedbn_encodes_the_update_without_the_buffers():
    torch.manual_seed(0)
    flat = FlatParams(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)))
    cfg = config(None, 'model.buffers="local"', 'algorithm.residual="gddr"', "gddr.alpha=0.0")
    ctx = FakeWorkerContext(cfg, {0: [1, 2]}, flat=flat)
    fedbn, gddr = FedBN.worker(ctx, FedBN.name), GDDR.worker(ctx, GDDR.name)
    job = LocalJob(0, 4, 0, TaskSpec(), aux=AUX)
    delta = np.arange(1, flat.numel + 1, dtype=np.float32)
    up = Upload(0, 4, delta, AUX)
    for half in (fedbn, gddr):  # (plugin order)
        half.encode(up, job)
    assert (up.by, up.kind) == ("gddr", int(RESIDUAL))
    want = np.arange(1, flat.numel + 1, dtype=np.float32)
    want[flat.buffer_slice] = 0.0
    assert up.payload.size == flat.numel + 1  # alpha 0: every coordinate is released
    np.testing.assert_array_equal(up.payload[:-1], want)
    assert up.payload[-1] == pytest.approx(float(np.linalg.norm(want.astype(np.float64))))
