"""The scheduler's text modules import without torch or numpy."""

from __future__ import annotations

import json
import subprocess
import sys


def test_text_modules_import_without_torch_or_numpy():
    code = (
        "import json, sys\n"
        "import scheduler_svc.text.tokenizer, scheduler_svc.text.detokenizer, scheduler_svc.text.stop_checker\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('torch', 'numpy', 'transformers'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []
