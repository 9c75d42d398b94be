"""Render the kustomize tree with kubectl and validate objects against the
Kubernetes JSON schemas of one fixed version (strict: unknown fields fail)."""

from __future__ import annotations

import pathlib
import shutil
import subprocess

import kubernetes_validate
import yaml

REPO = pathlib.Path(__file__).resolve().parents[2]
K8S_DIR = REPO / "k8s"
# The Kubernetes version the manifests are written for (fields newer than it fail).
KUBE_VERSION = "1.32.0"


class RenderError(RuntimeError):
    """`kubectl kustomize` failed; the message carries its stderr."""


def kubectl_path() -> str | None:
    """Path of kubectl, or None when it is not installed."""
    return shutil.which("kubectl")


def overlay_dirs() -> dict[str, pathlib.Path]:
    """Every renderable kustomization: the base and each overlay, by name."""
    dirs = {"base": K8S_DIR / "base"}
    for path in sorted((K8S_DIR / "overlays").iterdir()):
        if (path / "kustomization.yaml").is_file():
            dirs[path.name] = path
    return dirs


def render(path: pathlib.Path) -> list[dict]:
    """Objects produced by `kubectl kustomize <path>`, in output order."""
    kubectl = kubectl_path()
    if kubectl is None:
        raise RenderError("kubectl is not installed")
    proc = subprocess.run([kubectl, "kustomize", str(path)], capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise RenderError(f"kubectl kustomize {path} failed: {proc.stderr.strip()}")
    return [obj for obj in yaml.safe_load_all(proc.stdout) if obj]


def object_id(obj: dict) -> str:
    """`kind/name`, lower-case kind, as kubectl prints it."""
    return f"{obj.get('kind', '?').lower()}/{obj.get('metadata', {}).get('name', '?')}"


def validate_schemas(objects: list[dict], version: str = KUBE_VERSION) -> list[str]:
    """Strict schema validation of each object; one error string per bad object."""
    errors = []
    for obj in objects:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            where = ".".join(str(part) for part in exc.path)
            errors.append(f"{object_id(obj)}: {where}: {exc.message}")
        except kubernetes_validate.SchemaNotFoundError as exc:
            errors.append(f"{object_id(obj)}: unknown kind: {exc.message}")
    return errors
