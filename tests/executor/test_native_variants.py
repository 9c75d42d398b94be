"""Every portable variant's compiler flags compile every kernel source, as the executor image builds them.

``make install`` builds only ``-march=native``, so without this the code
behind the other ``#if`` guards (the scalar loops, AVX-512 without bf16,
AMX on a build machine without it) would be compiled nowhere until an image
build fails. Each variant is one translation unit that includes every source,
at -O0: an intrinsic used outside its instruction set is still an error
there (GCC checks it when inlining), at a fraction of an -O3 build.
"""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import subprocess

import pytest

from executor_svc.native import variants

COMPILER = os.environ.get("CXX", "c++")


def _compile(variant: variants.Variant, unity: str, include_dirs: list[str]) -> tuple[str, int, str]:
    command = [COMPILER, "-std=c++20", "-O0", "-ffast-math", *variant.cflags, "-x", "c++", "-c", "-o", os.devnull]
    command += [f"-I{d}" for d in [str(variants.CSRC), *include_dirs]]
    done = subprocess.run([*command, "-"], input=unity, capture_output=True, text=True, timeout=600)
    return variant.name, done.returncode, done.stderr[-3000:]


@pytest.mark.skipif(shutil.which(COMPILER) is None, reason=f"no C++ compiler ({COMPILER})")
def test_every_portable_variant_compiles_every_source():
    from torch.utils.cpp_extension import include_paths

    unity = "".join(f'#include "{variants.CSRC / source}"\n' for source in variants.SOURCES)
    with concurrent.futures.ThreadPoolExecutor(max(1, min(len(variants.PORTABLE), os.cpu_count() or 1))) as pool:
        results = list(pool.map(lambda v: _compile(v, unity, include_paths()), variants.PORTABLE))
    failed = {name: stderr for name, code, stderr in results if code != 0}
    assert not failed, failed
    assert [name for name, _, _ in results] == list(variants.PORTABLE_NAMES)


def test_the_sources_listed_are_the_sources_there():
    on_disk = {p.name for p in variants.CSRC.iterdir() if p.suffix in (".cpp", ".h")}
    assert on_disk == {*variants.SOURCES, *variants.HEADERS}
