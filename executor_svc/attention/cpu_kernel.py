"""The C++ paged decode kernel (cpu_kernel.cpp and its headers); built by executor_svc.native.build.

``python -m executor_svc.attention.cpu_kernel`` builds it ahead of time.
"""

from __future__ import annotations

import sys

from executor_svc.native import build

NAME = build.ATTENTION.name
SOURCE = build.ATTENTION.sources[0]
HEADERS = build.ATTENTION.headers
can_build = build.can_build
is_built = build.ATTENTION.is_built
load = build.ATTENTION.load
build_directory = build.ATTENTION.build_directory


def main() -> int:
    """Builds the kernel ahead of time; exits 0 without a compiler (the torch backend is used)."""
    if not (is_built() or can_build()):
        print(f"{NAME}: no C++ compiler or ninja; attention uses the torch backend", file=sys.stderr)
        return 0
    load()
    print(f"built {NAME} in {build_directory()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
