"""Package discovery for the ``pagoda`` distribution.

Every package found under an import root ships: a new subpackage cannot be left
out of the wheel (tests/packaging checks the built wheel against the tree). The
project metadata lives in pyproject.toml; only the import-name-to-folder map and
the discovery are here, because setuptools' declarative ``packages.find`` cannot
map a folder to another import name (``client/`` is ``pagoda_client``).
"""

from __future__ import annotations

from setuptools import find_packages, setup

# Import name -> the folder that holds it.
IMPORT_ROOTS = {
    "pagoda": "pagoda",
    "pagoda_client": "client",
    "pagoda_bench": "bench/pagoda_bench",
    "scheduler_svc": "scheduler_svc",
    "executor_svc": "executor_svc",
}

# Folders under a root that are not part of this distribution: the C++ kernels are their own
# distribution (pagoda-kernels), built against the installed torch.
EXCLUDED = ("native.csrc", "native.csrc.*")


def discover_packages(roots: dict[str, str]) -> list[str]:
    """Every package (a folder with ``__init__.py``) under each root, by its import name."""
    packages = []
    for name, folder in roots.items():
        packages.append(name)
        packages += [f"{name}.{sub}" for sub in find_packages(folder, exclude=EXCLUDED)]
    return sorted(packages)


if __name__ == "__main__":
    setup(package_dir=IMPORT_ROOTS, packages=discover_packages(IMPORT_ROOTS))
