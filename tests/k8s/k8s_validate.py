"""`make k8s-validate`: render every kustomization under k8s/, validate each
object against the Kubernetes schemas (strict), and run the consistency checks.

Usage: python tests/k8s/k8s_validate.py [--kube-version 1.32.0]
Exit status 0 when everything passes, 1 on any error, 2 without kubectl.
"""

from __future__ import annotations

import argparse
import re
import sys

from k8s_checks import check_all, check_images_across
from k8s_flags import PROGRAMS, documented_extra_envs, program_flags
from k8s_manifests import KUBE_VERSION, REPO, kubectl_path, overlay_dirs, render, validate_schemas


def project_version() -> str:
    """`version` of pyproject.toml: the image tags carry it."""
    match = re.search(r'^version = "([^"]+)"', (REPO / "pyproject.toml").read_text(), re.MULTILINE)
    assert match, "pyproject.toml has no version"
    return match.group(1)


def known_flags() -> tuple[dict[str, set[str]], dict[str, set[str]], dict[str, str]]:
    """(flags, documented extra variables, source of the flags) per program."""
    flags, extras, sources = {}, {}, {}
    for program in PROGRAMS:
        flags[program], sources[program] = program_flags(program)
        extras[program] = documented_extra_envs(program)
    return flags, extras, sources


def validate_all(kube_version: str = KUBE_VERSION) -> dict[str, list[str]]:
    """Every error, keyed by `overlay: check`."""
    flags, extras, _ = known_flags()
    renders = {name: render(path) for name, path in overlay_dirs().items()}
    results = {}
    for name, objects in renders.items():
        results[f"{name}: schema {kube_version}"] = validate_schemas(objects, kube_version)
        for check, errors in check_all(objects, flags, extras).items():
            results[f"{name}: {check}"] = errors
    results["all overlays: images"] = check_images_across(renders, project_version())
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kube-version", default=KUBE_VERSION)
    args = parser.parse_args(argv)
    if kubectl_path() is None:
        print("kubectl is not installed: cannot render k8s/", file=sys.stderr)
        return 2
    _, _, sources = known_flags()
    print("flags from: " + ", ".join(f"{p} <- {s}" for p, s in sources.items()))
    results = validate_all(args.kube_version)
    for key, errors in results.items():
        print(f"{'ok  ' if not errors else 'FAIL'} {key}")
        for error in errors:
            print(f"       {error}")
    num_errors = sum(len(e) for e in results.values())
    print(f"{len(results)} checks, {num_errors} errors")
    return 1 if num_errors else 0


if __name__ == "__main__":
    sys.exit(main())
