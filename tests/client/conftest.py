"""Makes ``fixtures_tiny`` importable and registers its fixtures here."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from fixtures_tiny import client_tiny_model_dir, client_tiny_system  # noqa: E402,F401
