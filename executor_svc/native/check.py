"""``python -m executor_svc.native.check``: which kernel variants are installed, which one this CPU loads.

Prints each installed variant (whether this CPU runs it), loads the chosen one
and runs one op against torch. Exits 1, naming what is missing, when a
variant given to ``--require`` is not installed (``portable`` stands for
every portable variant) or when no variant loads. The executor image runs it
at build time, so an image without its kernels fails to build.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from executor_svc.native import variants


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line.

    Raises:
        SystemExit: bad arguments, or an unknown variant name in ``--require``.
    """
    parser = argparse.ArgumentParser(prog="python -m executor_svc.native.check", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--require",
        default="",
        help=f"comma-separated variants that must be installed: portable, native, {', '.join(variants.PORTABLE_NAMES)}",
    )
    parser.add_argument("--folder", type=Path, default=None, help="the kernels' folder (default: the installed ones)")
    args = parser.parse_args(argv)
    try:
        args.require = required_names(args.require)
    except ValueError as exc:
        parser.error(str(exc))
    return args


def required_names(spec: str) -> tuple[str, ...]:
    """``portable,native`` -> the variant names it stands for.

    Raises:
        ValueError: an unknown name.
    """
    names: list[str] = []
    for item in filter(None, (part.strip() for part in spec.split(","))):
        if item == "portable":
            names.extend(variants.PORTABLE_NAMES)
        elif item in variants.PREFERENCE:
            names.append(item)
        else:
            raise ValueError(f"unknown kernel variant {item!r}; use portable, {', '.join(variants.PREFERENCE)}")
    return tuple(dict.fromkeys(names))


def main(argv: Sequence[str] | None = None) -> int:
    """Reports the kernels; 0 when every required variant is installed and the chosen one works."""
    args = parse_args(argv)
    from executor_svc.native import loader

    try:
        found = loader.installed(args.folder)
    except loader.KernelsUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    flags = variants.cpu_flags()
    for variant in found.variants:
        runs = "runs on this CPU" if variant.runs_on(flags) else f"needs {' '.join(sorted(variant.requires - flags))}"
        print(f"{variant.name:12} {runs:40} {found.folder / found.libraries[variant.name]}")
    missing = [name for name in args.require if name not in found.libraries]
    if missing:
        print(f"error: kernel variants missing from {found.folder}: {', '.join(missing)}", file=sys.stderr)
        return 1
    try:
        kernels = loader.load(args.folder, flags)
        _smoke_test(kernels.ops)
    except (loader.KernelsUnavailable, RuntimeError, AssertionError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"loaded {kernels.variant} ({', '.join(sorted(kernels.features)) or 'no vector extensions'})")
    return 0


def _smoke_test(ops) -> None:
    """One fused op against torch: the library runs, not only loads."""
    import torch

    x = torch.randn(3, 64)
    weight = torch.rand(64)
    expected = torch.nn.functional.rms_norm(x, (64,), weight, 1e-6)
    assert torch.allclose(ops.rms_norm(x, weight, 1e-6), expected, atol=1e-5), "rms_norm disagrees with torch"


if __name__ == "__main__":
    sys.exit(main())
