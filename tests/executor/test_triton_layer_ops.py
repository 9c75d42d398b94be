"""The batch-invariant Triton layer ops (CUDA), run by Triton's CPU interpreter: a row gives the same bits at any
number of rows, and the values are those of the torch ops within rounding.

Skipped without the triton package (it is not needed on a CPU; pip install triton to run it here). On a CUDA
machine the same check runs compiled (``PAGODA_TRITON_COMPILED=1``, on the device).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

CHECK = r"""
import torch
from executor_svc.models.layer_ops import TorchLayerOps
from executor_svc.models.triton_layer_ops import TritonLayerOps

device = "cuda" if torch.cuda.is_available() else "cpu"
ref = TorchLayerOps()
ops = TritonLayerOps(ref)
gen = torch.Generator().manual_seed(0)
for dtype, tol in ((torch.bfloat16, 2e-2), (torch.float32, 1e-5)):
    for k, n, bias in ((96, 80, False), (200, 130, True)):
        w = (torch.randn(n, k, generator=gen) * k**-0.5).to(dtype).to(device)
        b = torch.randn(n, generator=gen).to(dtype).to(device) if bias else None
        probes = torch.randn(3, k, generator=gen).to(dtype).to(device)
        alone = [ops.linear(probes[i : i + 1], w, b)[0] for i in range(3)]
        for m in (1, 2, 17, 64, 65, 130):
            batch = torch.randn(m + 3, k, generator=gen).to(dtype).to(device)
            where = torch.randperm(m + 3, generator=gen)[:3]
            batch[where] = probes
            out = ops.linear(batch, w, b)
            for i in range(3):
                assert torch.equal(out[where[i]], alone[i]), ("linear", dtype, k, n, m, i)
            error = (out.float() - ref.linear(batch, w, b).float()).abs().max().item()
            assert error < tol * 4, ("linear vs torch", dtype, error)
    hidden = 160
    weight = torch.randn(hidden, generator=gen).to(dtype).to(device)
    probe = torch.randn(1, hidden, generator=gen).to(dtype).to(device)
    alone = ops.rms_norm(probe, weight, 1e-6)[0]
    for m in (1, 5, 33):
        batch = torch.randn(m, hidden, generator=gen).to(dtype).to(device)
        batch[m // 2] = probe[0]
        out = ops.rms_norm(batch, weight, 1e-6)
        assert torch.equal(out[m // 2], alone), ("rms_norm", dtype, m)
        assert (out.float() - ref.rms_norm(batch, weight, 1e-6).float()).abs().max().item() < tol * 8
        x = torch.randn(m, hidden, generator=gen).to(dtype).to(device)
        res_a, res_b = batch.clone(), batch.clone()
        got = ops.add_rms_norm(x, res_a, weight, 1e-6)
        want = ref.add_rms_norm(x, res_b, weight, 1e-6)
        # One rounding of the sum to the dtype each (the interpreter's bf16 rounding is not always torch's).
        assert torch.allclose(res_a.float(), res_b.float(), rtol=2**-7, atol=0), ("add_rms_norm residual", dtype)
        assert (got.float() - want.float()).abs().max().item() < tol * 8, ("add_rms_norm", dtype)
print("ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs the triton package")
def test_triton_layer_ops_are_batch_invariant_and_match_torch():
    env = {**os.environ}
    if os.environ.get("PAGODA_TRITON_COMPILED") != "1":
        env["TRITON_INTERPRET"] = "1"
    done = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
