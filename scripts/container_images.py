"""Build the images users deploy (docker/Dockerfile.*) with whichever container engine this machine has.

``make image`` and ``make image-test`` call it. docker when its daemon answers, else podman. With podman it
also works on machines without a container registry and behind this machine's own pip setup:

- the base (``PYTHON_IMAGE``): the Dockerfiles' python:3.11-slim when it can be pulled; otherwise a Debian
  bookworm root with Python 3.11 made by ``mmdebstrap`` and imported once (kept as
  ``localhost/pagoda-python:3.11-bookworm`` for the next build);
- the engine's settings: runc with explicit rlimits, cgroupfs and a file event log, written to
  ``.cache/images/containers.conf`` (``CONTAINERS_CONF``), because crun cannot start containers on some VMs;
- pip in the build sees the host's pip configuration (``pip config list``) and every local folder or file it
  names (wheel folders, file:// indexes, CA bundle, constraints), bind-mounted read-only at the same paths;
- the PyTorch wheel index the Dockerfile names is replaced by the host's index when it cannot be reached.

    python -m scripts.container_images scheduler executor-cpu
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import resource
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".cache" / "images"
REGISTRY = os.environ.get("IMAGE_REGISTRY", "ghcr.io/pagoda-llm")
VERSION = re.search(r'(?m)^version = "(.*)"$', (ROOT / "pyproject.toml").read_text()).group(1)  # type: ignore[union-attr]
LOCAL_BASE = "localhost/pagoda-python:3.11-bookworm"
BASE_PACKAGES = ("python3", "python3-venv", "python3-pip", "python-is-python3", "passwd", "ca-certificates")
DEBIAN_MIRROR = "http://deb.debian.org/debian"
PULL_TIMEOUT_S = 120
BUILD_TIMEOUT_S = 3600


def log(message: str) -> None:
    """One progress line on stderr (builds are long; every wait says what it waits for)."""
    print(f"[images {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def docker_answers() -> bool:
    """Whether a docker client is installed and its daemon answers (a client alone cannot build)."""
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "info"], capture_output=True, timeout=30).returncode == 0


@functools.cache
def engine() -> str | None:
    """`docker` when its daemon answers, else `podman` when installed, else None."""
    forced = os.environ.get("CONTAINER_ENGINE")
    if forced:
        return forced
    if docker_answers():
        return "docker"
    return "podman" if shutil.which("podman") else None


def podman_conf() -> Path:
    """containers.conf for podman: runc, explicit rlimits within this machine's hard limits, no systemd."""
    nofile = min(resource.getrlimit(resource.RLIMIT_NOFILE)[1], 65536)
    nproc = min(resource.getrlimit(resource.RLIMIT_NPROC)[1], 32768)  # runc refuses this machine's very limit
    text = (
        "# Written by scripts/container_images.py (podman settings of make image / make image-test).\n"
        "[containers]\n"
        f'default_ulimits = ["nofile={nofile}:{nofile}", "nproc={nproc}:{nproc}"]\n'
        "[engine]\n"
        'runtime = "runc"\ncgroup_manager = "cgroupfs"\nevents_logger = "file"\n'
    )
    path = CACHE / "containers.conf"
    CACHE.mkdir(parents=True, exist_ok=True)
    if not path.exists() or path.read_text() != text:
        path.write_text(text)
    return path


def engine_env() -> dict[str, str]:
    """The environment to run the engine in (podman: our containers.conf)."""
    env = dict(os.environ)
    if engine() == "podman" and "CONTAINERS_CONF" not in os.environ:
        env["CONTAINERS_CONF"] = str(podman_conf())
    return env


class EngineError(RuntimeError):
    """An engine command failed; the message carries the command and the end of its output."""


def run_engine(
    args: list[str], timeout_s: float, check: bool = False, **kwargs: object
) -> subprocess.CompletedProcess[str]:
    """`<engine> args...`, bounded; with `check`, a failure raises EngineError with what the engine said."""
    name = engine()
    assert name is not None, "no container engine"
    proc = subprocess.run([name, *args], env=engine_env(), text=True, timeout=timeout_s, **kwargs)  # type: ignore[call-overload]
    if check and proc.returncode != 0:
        said = ((proc.stdout or "") + (proc.stderr or ""))[-4000:]
        raise EngineError(f"{name} {' '.join(args[:2])} ... failed with exit status {proc.returncode}:\n{said}")
    return proc


def image_exists(tag: str) -> bool:
    return run_engine(["image", "inspect", tag], 60, capture_output=True).returncode == 0


def dockerfile_default(dockerfile: str, arg: str) -> str:
    """The default of `ARG arg=...` in docker/<dockerfile>."""
    text = (ROOT / "docker" / dockerfile).read_text()
    return re.search(rf"(?m)^ARG {arg}=(\S+)$", text).group(1)  # type: ignore[union-attr]


def python_base() -> str:
    """The PYTHON_IMAGE to build on: $PYTHON_IMAGE, the cached local base, the pinned slim image, or a new base."""
    if os.environ.get("PYTHON_IMAGE"):
        return os.environ["PYTHON_IMAGE"]
    if image_exists(LOCAL_BASE):
        log(f"base image {LOCAL_BASE}: cached")
        return LOCAL_BASE
    pinned = "docker.io/library/" + dockerfile_default("Dockerfile.scheduler", "PYTHON_IMAGE")
    log(f"pulling {pinned} (at most {PULL_TIMEOUT_S} s)")
    try:
        if run_engine(["pull", pinned], PULL_TIMEOUT_S, capture_output=True).returncode == 0:
            return pinned
    except subprocess.TimeoutExpired:
        pass
    log(f"no registry: building {LOCAL_BASE} with mmdebstrap (Debian bookworm, Python 3.11)")
    build_local_base()
    return LOCAL_BASE


def build_local_base() -> None:
    """Debian bookworm with Python 3.11 (what python:3.11-slim provides), imported as LOCAL_BASE."""
    if shutil.which("mmdebstrap") is None:
        raise SystemExit("no base image: cannot pull python:3.11-slim and mmdebstrap is not installed")
    CACHE.mkdir(parents=True, exist_ok=True)
    tarball = CACHE / "python-base.tar"
    command = [
        "mmdebstrap", "--variant=minbase", "--include=" + ",".join(BASE_PACKAGES),
        "--dpkgopt=path-exclude=/usr/share/doc/*", "--dpkgopt=path-exclude=/usr/share/man/*",
        "--dpkgopt=path-exclude=/usr/share/locale/*", "bookworm", str(tarball), DEBIAN_MIRROR,
    ]  # fmt: skip
    subprocess.run(command, check=True, timeout=1800, stdout=subprocess.DEVNULL)
    path = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    changes = ["--change", f"ENV PATH={path}", "--change", 'CMD ["python3"]']
    run_engine(["import", *changes, str(tarball), LOCAL_BASE], 600, check=True, capture_output=True)
    tarball.unlink()


def pip_settings() -> dict[str, dict[str, str]]:
    """The host's effective pip settings by section (files first, then PIP_* variables over them)."""
    out = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    sections: dict[str, dict[str, str]] = {}
    env_lines = []
    for line in out.splitlines():
        match = re.fullmatch(r"(:env:|[\w-]+)\.([\w-]+)='(.*)'", line.strip())
        if not match:
            continue
        if match.group(1) == ":env:":
            env_lines.append(match)
        else:
            sections.setdefault(match.group(1), {})[match.group(2)] = match.group(3)
    for match in env_lines:
        sections.setdefault("global", {})[match.group(2)] = match.group(3)
    return sections


def local_paths(settings: dict[str, dict[str, str]]) -> list[Path]:
    """Every existing local path the settings name (folders, files; a file:// index's parent, where its pages
    link the files)."""
    paths = set()
    for values in settings.values():
        for value in values.values():
            for word in value.split():
                path = Path(word.removeprefix("file://"))
                if word.startswith("file://"):
                    path = path.parent
                if path.is_absolute() and path.exists():
                    paths.add(path)
    return sorted(paths)


def podman_build_args() -> list[str]:
    """pip's configuration and what it names, mounted read-only into every RUN; the host's network; parallel stages."""
    settings = pip_settings()
    conf = CACHE / "pip.conf"
    lines = []
    for section, values in settings.items():
        lines += [f"[{section}]", *(f"{key} = {value}" for key, value in values.items())]
    conf.write_text("\n".join(lines) + "\n")
    mounts = [f"{conf}:/etc/pip.conf:ro"]
    mounts += [f"{path}:{path}:ro" for path in local_paths(settings)]
    # --jobs: independent stages at once (the kernels compile while the executor's packages install).
    jobs = ["--jobs", str(min(4, os.cpu_count() or 1))]
    return ["--network", "host", *jobs, *(arg for mount in mounts for arg in ("-v", mount))]


def reachable(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=15):
            return True
    except OSError:
        return False


def torch_index_args(index: str) -> list[str]:
    """TORCH_INDEX_URL: the given index, or the host's pip index when that one cannot be reached."""
    if reachable(index.rstrip("/") + "/torch/"):
        return ["--build-arg", f"TORCH_INDEX_URL={index}"]
    host_index = pip_settings().get("global", {}).get("index-url", "https://pypi.org/simple")
    log(f"{index} unreachable: torch from {host_index} and the host's pip find-links")
    return ["--build-arg", f"TORCH_INDEX_URL={host_index}"]


# Image name -> (Dockerfile, tag, extra build arguments).
IMAGES = {
    "scheduler": ("Dockerfile.scheduler", f"{REGISTRY}/pagoda-scheduler:{VERSION}", []),
    "executor-cpu": ("Dockerfile.executor", f"{REGISTRY}/pagoda-executor:{VERSION}-cpu", ["VARIANT=cpu"]),
    "executor-cuda": ("Dockerfile.executor", f"{REGISTRY}/pagoda-executor:{VERSION}-cuda", ["VARIANT=cuda"]),
}
CUDA_TORCH_INDEX = os.environ.get("CUDA_TORCH_INDEX", "https://download.pytorch.org/whl/cu128")


def build(name: str) -> float:
    """Build one image (IMAGES); returns the seconds it took."""
    dockerfile, tag, build_args = IMAGES[name]
    args = ["build", "-f", f"docker/{dockerfile}", "-t", tag]
    for build_arg in build_args:
        args += ["--build-arg", build_arg]  # explicit: buildah 1.28 does not resolve FROM venv-${VARIANT} else
    args += ["--build-arg", f"PYTHON_IMAGE={python_base()}"]
    if dockerfile == "Dockerfile.executor":
        default_index = dockerfile_default(dockerfile, "TORCH_INDEX_URL")
        args += torch_index_args(CUDA_TORCH_INDEX if name == "executor-cuda" else default_index)
    if engine() == "podman":
        # docker reads docker/<Dockerfile>.dockerignore by itself; podman 4 needs it named.
        args += ["--ignorefile", f"docker/{dockerfile}.dockerignore", *podman_build_args()]
    log(f"building {tag} with {engine()} (at most {BUILD_TIMEOUT_S} s)")
    start = time.monotonic()
    run_engine([*args, str(ROOT)], BUILD_TIMEOUT_S, check=True, cwd=ROOT)
    seconds = time.monotonic() - start
    log(f"built {tag} in {seconds:.0f} s")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("images", nargs="+", choices=sorted(IMAGES))
    args = parser.parse_args()
    if engine() is None:
        raise SystemExit("no container engine: install docker or podman")
    for name in args.images:
        build(name)


if __name__ == "__main__":
    main()
