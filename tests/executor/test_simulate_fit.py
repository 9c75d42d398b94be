"""bench/fit_step_cost.py: the fit recovers known constants; the committed constants are the committed data's fit."""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path

import pytest

from executor_svc.simulate.cost import SMOLLM2_BF16_CPU, StepCost, StepFeatures

BENCH = Path(__file__).resolve().parents[2] / "bench"
DATA = BENCH / "data" / "step_cost_smollm2_bf16.json"


def _load_fit():
    spec = importlib.util.spec_from_file_location("fit_step_cost", BENCH / "fit_step_cost.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rows(cost: StepCost, noise: float, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for prefill, cached, batch, context in [(0, 0, b, c) for b in (1, 8, 64) for c in (128, 1024)] + [
        (n, c, b, 512) for n in (32, 512) for c in (0, 1024) for b in (0, 8)
    ]:
        features = StepFeatures.of([(cached, prefill)] * (prefill > 0) + [(context - 1, 1)] * batch)
        step_s = cost.seconds(features) * (1 + rng.uniform(-noise, noise))
        rows.append({"point": f"{prefill}/{cached}/{batch}/{context}", **vars(features), "step_s": step_s})
    return rows


def test_fit_recovers_the_constants_of_exact_data():
    cost = StepCost(0.004, 2e-4, 3e-9, 5e-4, 2e-7)
    fitted = _load_fit().fit(_rows(cost, noise=0.0))
    assert fitted.coefficients() == pytest.approx(cost.coefficients(), rel=1e-6)


def test_fit_keeps_every_constant_non_negative():
    cost = StepCost(0.004, 2e-4, 0.0, 5e-4, 0.0)  # two features that cost nothing, measured with noise
    fitted = _load_fit().fit(_rows(cost, noise=0.05))
    assert all(c >= 0 for c in fitted.coefficients())
    assert fitted.base_s == pytest.approx(0.004, rel=0.2) and fitted.per_decode_seq_s == pytest.approx(5e-4, rel=0.2)


def test_committed_constants_are_the_fit_of_the_committed_data():
    data = json.loads(DATA.read_text())
    refitted = _load_fit().fit(data["rows"])
    assert refitted.coefficients() == pytest.approx(SMOLLM2_BF16_CPU.coefficients(), rel=1e-3)
    assert data["fit"]["coefficients"] == pytest.approx(list(SMOLLM2_BF16_CPU.coefficients()), rel=1e-3)
    assert data["fit"]["median_abs_error"] < 0.25  # the model is worth simulating with
