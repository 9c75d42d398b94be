"""KV cache sizing: the default block size and the executor's --block-size flag."""

from __future__ import annotations

import pytest
import torch

from executor_svc.config import load_config
from executor_svc.kv_cache import default_block_size

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    ("head_dim", "dtype", "expected"),
    [
        (64, torch.float32, 16),  # 4 KiB of K per kv head
        (64, torch.bfloat16, 32),
        (128, torch.bfloat16, 16),
        (128, torch.float32, 16),  # never below 16
        (32, torch.float32, 32),
        (8, torch.bfloat16, 128),  # capped
    ],
)
def test_cpu_blocks_hold_one_page_of_k_per_kv_head(head_dim, dtype, expected):
    assert default_block_size(CPU, head_dim, dtype) == expected


def test_cuda_blocks_stay_16_tokens():
    assert default_block_size(torch.device("cuda"), 64, torch.bfloat16) == 16


def test_block_size_flag_is_auto_by_default_and_rejects_negatives():
    assert load_config([]).block_size == 0
    assert load_config(["--block-size", "48"]).block_size == 48
    with pytest.raises((ValueError, SystemExit)):
        load_config(["--block-size", "-16"])
