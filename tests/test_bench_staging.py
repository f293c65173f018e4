"""``edgefl bench staging`` refuses a device torch cannot use here, in one line."""

from __future__ import annotations

import pytest
import torch

from edgefl.bench.staging import check_device


def test_cpu_is_accepted():
    check_device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_a_gpu_is_one_line():
    with pytest.raises(SystemExit, match="torch sees no CUDA device") as e:
        check_device("cuda")
    assert "\n" not in str(e.value)


def test_a_bad_device_string_is_one_line():
    with pytest.raises(SystemExit, match="--device 'gpu0'") as e:
        check_device("gpu0")
    assert "\n" not in str(e.value)
