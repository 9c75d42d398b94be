"""Which kernel variant a CPU gets, and what happens when none fits: fake flag sets and fake manifests.

The flag sets are those of real CPUs as /proc/cpuinfo lists them (trimmed to
the instruction sets); the manifests are written here, so no library loads
unless a test loads the installed one on purpose.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from structlog.testing import capture_logs

from executor_svc.native import check, loader, variants

V3 = "pni ssse3 fma cx16 sse4_1 sse4_2 movbe popcnt xsave avx f16c lahf_lm abm bmi1 avx2 bmi2"
V4 = V3 + " avx512f avx512dq avx512cd avx512bw avx512vl"
CPUS = {
    # name: (flags, variant chosen among the portable ones)
    "sapphire_rapids": (V4 + " avx512_bf16 avx512_vnni amx_bf16 amx_tile amx_int8", "amx"),
    "zen4": (V4 + " avx512_bf16 avx512_vnni avx512ifma", "avx512-bf16"),
    "cascade_lake": (V4 + " avx512_vnni", "avx512"),
    "zen3": (V3 + " sha_ni", "avx2"),
    "sandy_bridge": ("pni ssse3 cx16 sse4_1 sse4_2 popcnt xsave avx lahf_lm", "x86-64"),
    "no_cpuinfo": ("", "x86-64"),
}


@pytest.mark.parametrize("cpu", sorted(CPUS))
def test_each_cpu_gets_the_widest_portable_variant_it_runs(cpu):
    flags, expected = CPUS[cpu]
    assert variants.choose(variants.PORTABLE, flags.split()).name == expected


def test_amx_needs_the_bf16_and_tile_flags_together():
    flags = set(V4.split()) | {"amx_tile", "amx_bf16"}  # no avx512_bf16: the AMX build uses it too
    assert variants.choose(variants.PORTABLE, flags).name == "avx512"


def test_native_is_preferred_where_it_runs_and_skipped_where_it_does_not():
    native = variants.native(["__AVX2__", "__FMA__", "__AVX512F__", "__SSE4_2__", "__UNKNOWN__"])
    assert native.requires == {"avx2", "fma", "avx512f", "sse4_2"}
    installed = (native, *variants.PORTABLE)
    assert variants.choose(installed, CPUS["cascade_lake"][0].split()).name == "native"
    # The same venv moved to a CPU without AVX-512: the native build would fault; a portable one runs.
    assert variants.choose(installed, CPUS["zen3"][0].split()).name == "avx2"
    assert variants.choose((native,), CPUS["zen3"][0].split()) is None


def test_portable_variants_require_what_their_march_allows():
    by_name = {v.name: v for v in variants.PORTABLE}
    assert by_name["x86-64"].requires == frozenset()
    assert by_name["avx2"].requires >= {"avx2", "fma", "bmi2", "f16c", "movbe"}
    assert by_name["avx512"].requires - by_name["avx2"].requires == {
        "avx512f",
        "avx512bw",
        "avx512cd",
        "avx512dq",
        "avx512vl",
    }
    assert by_name["avx512-bf16"].requires - by_name["avx512"].requires == {"avx512_bf16", "avx512_vnni"}
    assert by_name["amx"].requires - by_name["avx512-bf16"].requires == {"amx_tile", "amx_bf16", "amx_int8"}
    assert variants.PREFERENCE[0] == variants.NATIVE
    with pytest.raises(ValueError, match="unknown kernel variant 'avx9'"):
        variants.portable("avx9")


def test_cpu_flags_read_x86_and_arm_cpuinfo(tmp_path):
    x86 = tmp_path / "x86"
    x86.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f\n\nprocessor\t: 1\nflags\t\t: fpu avx2 avx512f\n")
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd sve\n")
    assert variants.cpu_flags(x86) == {"fpu", "avx2", "avx512f"}
    assert variants.cpu_flags(arm) == {"fp", "asimd", "sve"}
    assert variants.cpu_flags(tmp_path / "missing") == frozenset()


def _manifest(folder: Path, names: list[str], torch_version: str | None = None) -> Path:
    """A pagoda-kernels folder with a manifest for portable variants `names` (no libraries)."""
    folder.mkdir(parents=True, exist_ok=True)
    entries = [
        {"name": v.name, "library": f"_C_{v.name}.so", "cflags": list(v.cflags), "requires": sorted(v.requires)}
        for v in map(variants.portable, names)
    ]
    manifest = {"torch": torch_version or torch.__version__, "variants": entries}
    (folder / loader.MANIFEST).write_text(json.dumps(manifest))
    return folder


def test_manifest_lists_the_variants_and_their_libraries(tmp_path):
    found = loader.installed(_manifest(tmp_path, ["amx", "x86-64"]))
    assert [v.name for v in found.variants] == ["amx", "x86-64"]
    assert found.libraries == {"amx": "_C_amx.so", "x86-64": "_C_x86-64.so"}
    assert found.variants[0] == variants.portable("amx")


@pytest.mark.parametrize(
    "setup,message",
    [
        (lambda folder: folder.mkdir(), "manifest in .* is unreadable"),
        (lambda folder: _manifest(folder, ["avx2"], torch_version="1.0.0"), "built against torch 1.0.0, this is"),
        (
            lambda folder: _manifest(folder, ["avx512"]),
            r"no installed variant runs on this CPU \(installed: avx512; for avx512 it lacks avx512bw avx512cd",
        ),
        (lambda folder: _manifest(folder, ["x86-64"]), r"_C_x86-64.so failed to load"),
    ],
)
def test_unusable_kernels_raise_the_reason(tmp_path, setup, message):
    folder = tmp_path / "kernels"
    setup(folder)
    with pytest.raises(loader.KernelsUnavailable, match=message):
        loader.load(folder, cpu_flags=CPUS["zen3"][0].split())


def test_missing_kernels_are_one_log_line_naming_the_reason_and_the_fallback(monkeypatch):
    real_installed = loader.installed
    monkeypatch.setattr(loader, "installed", lambda folder=None: real_installed(Path("/nonexistent")))
    loader._load_once.cache_clear()
    try:
        with capture_logs() as logs:
            assert loader.kernels() is None
            assert loader.kernels() is None  # asked again: no second line
            with pytest.raises(loader.KernelsUnavailable, match="manifest in /nonexistent is unreadable"):
                loader.ops()
    finally:
        loader._load_once.cache_clear()
    assert len(logs) == 1
    assert logs[0]["event"] == "native_kernels_unavailable" and logs[0]["log_level"] == "warning"
    assert "manifest in /nonexistent is unreadable" in logs[0]["reason"]
    assert logs[0]["fallback"] == loader.FALLBACK


def test_not_installed_names_the_environment(monkeypatch):
    monkeypatch.setattr(loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(loader.KernelsUnavailable, match=f"pagoda-kernels is not installed in {sys.prefix}"):
        loader.installed()


def test_check_fails_naming_the_missing_variants(tmp_path, capsys):
    folder = _manifest(tmp_path / "kernels", ["avx512", "x86-64"])
    assert check.main(["--require", "portable", "--folder", str(folder)]) == 1
    err = capsys.readouterr().err
    assert "kernel variants missing" in err and "amx, avx512-bf16, avx2" in err
    assert check.required_names("native, avx2,avx2") == ("native", "avx2")
    with pytest.raises(SystemExit):
        check.parse_args(["--require", "sse9"])


def test_check_passes_on_the_installed_kernels(capsys, cpp_kernel):
    kernels = loader.kernels()
    assert check.main(["--require", kernels.variant]) == 0
    assert f"loaded {kernels.variant}" in capsys.readouterr().out
