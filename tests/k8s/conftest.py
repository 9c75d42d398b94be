"""The k8s tests import their helper modules (k8s_*.py) from this folder, which
is also how `make k8s-validate` runs tests/k8s/k8s_validate.py as a script."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
