"""The image test reads the rendered manifests with the k8s tests' helpers (tests/k8s/k8s_*.py)."""

import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "k8s")]
