#!/usr/bin/env python3
"""A C++ compiler wrapper that precompiles the kernels' shared header once per set of flags.

Every kernel source includes ``cpu_common.h``, which pulls in ATen and the op
registration API: parsing them is most of a source's compile time, and the
image builds 8 sources x 5 variants. setup.py points ``CXX`` here. For each
compile (``-c x.cpp``) this wrapper builds ``pch.h`` (including ``cpu_common.h``) with the
very same flags into ``<object folder>/pch-<hash of the flags and the header>/pch.h.gch`` unless
it exists (a lock file makes parallel compiles of one variant build it once),
then runs the compiler with ``-include`` of it. The flags differ per variant
(``-march``, the extension name), so each variant gets its own header; a
header that does not match is ignored by the compiler (``-Winvalid-pch`` says
so) and the source still compiles. Any other call (linking, ``-v``) goes to the
compiler unchanged. Standard library only: it runs before anything is installed.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import subprocess
import sys
from pathlib import Path

# The header every source includes first; sources find the same file again and #pragma once skips it.
SHARED_HEADER = Path(__file__).resolve().parent / "cpu_common.h"
# Flags that name one compile's files, not how it compiles: left out of the header's key.
FILE_FLAGS_WITH_VALUE = ("-o", "-MF", "-MT", "-MQ")
FILE_FLAGS = ("-c", "-MMD", "-MD")


def real_compiler() -> str:
    """The compiler this wrapper stands in front of (PAGODA_REAL_CXX, default c++)."""
    return os.environ.get("PAGODA_REAL_CXX") or "c++"


def split_compile(args: list[str]) -> tuple[list[str], str | None, str | None]:
    """(the flags, the C++ source, the object) of a compile command; source None when it is not one."""
    flags: list[str] = []
    source = output = None
    i = 0
    while i < len(args):
        arg = args[i]
        if arg in FILE_FLAGS_WITH_VALUE and i + 1 < len(args):
            output = args[i + 1] if arg == "-o" else output
            i += 2
            continue
        if arg.endswith(".cpp") and not arg.startswith("-"):
            source = arg
        elif arg not in FILE_FLAGS:
            flags.append(arg)
        i += 1
    return flags, (source if "-c" in args else None), output


def ensure_header(compiler: str, flags: list[str], folder: Path) -> Path:
    """The precompiled header for these flags in ``folder``, built once (under a lock)."""
    # The header's text is in the key too: a header precompiled from an older cpu_common.h would be taken (the
    # flags match) and the source's own #include of the edited file then redefines everything in it.
    text = SHARED_HEADER.read_text()
    key = hashlib.sha256("\0".join([compiler, *flags, text]).encode()).hexdigest()[:16]
    where = folder / f"pch-{key}"
    where.mkdir(parents=True, exist_ok=True)
    header = where / "pch.h"
    with open(where / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (where / "pch.h.gch").exists():
            header.write_text(f'#include "{SHARED_HEADER}"\n')
            tmp = where / "pch.h.gch.tmp"
            command = [compiler, *flags, "-x", "c++-header", str(header), "-o", str(tmp)]
            subprocess.run(command, check=True)
            tmp.rename(where / "pch.h.gch")
    return header


def main(args: list[str]) -> int:
    compiler = real_compiler()
    flags, source, output = split_compile(args)
    if source is None or output is None or os.environ.get("PAGODA_KERNEL_PCH") == "0":
        return subprocess.run([compiler, *args]).returncode
    header = ensure_header(compiler, flags, Path(output).resolve().parent)
    return subprocess.run([compiler, "-Winvalid-pch", "-include", str(header), *args]).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
