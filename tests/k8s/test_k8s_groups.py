"""Executor groups in k8s/overlays/gpu-group and cpu-group (docs/parallel-deploy.md): every pod's ranks and
rendezvous as its process would start (worker scripts run under sh), parsed by the executor's own config,
and the group checks failing, specifically, on manifests broken one way at a time."""

from __future__ import annotations

import copy

import k8s_validate as validate
import pytest
from k8s_checks import check_all
from k8s_groups import check_groups, launch, members
from k8s_manifests import kubectl_path, overlay_dirs, render
from k8s_pods import by_kind, containers, expand, selects, selects_pods, setting, template_labels

pytestmark = pytest.mark.skipif(kubectl_path() is None, reason="kubectl is not installed: k8s/ cannot be rendered")

LEADERS, WORKERS, RENDEZVOUS = "pagoda-executor", "pagoda-executor-worker", "pagoda-executor-group"
WORKER = f"pod {WORKERS}-1 (statefulset/{WORKERS} container executor)"


def _address(group: int) -> str:
    return f"{LEADERS}-{group}.{RENDEZVOUS}.pagoda.svc.cluster.local:29500"


@pytest.fixture(scope="module")
def gpu_group() -> list[dict]:
    return render(overlay_dirs()["gpu-group"])


@pytest.fixture(scope="module")
def cpu_group() -> list[dict]:
    return render(overlay_dirs()["cpu-group"])


def _pod(member) -> dict[str, str]:
    return {"metadata.name": member.pod_name, "metadata.namespace": member.namespace}


def _by_name(objects: list[dict], kind: str, name: str) -> dict:
    return next(o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name)


def _executor_spec(objects: list[dict], statefulset: str) -> dict:
    return _by_name(objects, "StatefulSet", statefulset)["spec"]["template"]["spec"]["containers"][0]


def test_expand_follows_the_kubelet():
    env = {"POD_NAME": "pagoda-executor-1", "EMPTY": ""}
    assert expand("$(POD_NAME).svc:$(EMPTY)29500", env) == "pagoda-executor-1.svc:29500"
    assert expand("$(UNSET) $$(POD_NAME) $((1 + 2)) $POD_NAME $", env) == "$(UNSET) $(POD_NAME) $((1 + 2)) $POD_NAME $"


def test_gpu_group_pods_run_two_groups_of_four_by_two_ranks(gpu_group):
    """Two groups, each a leader pod with ranks 0-3 and a worker pod with ranks 4-7, every pod on 4 GPUs
    (T x P = 8 = 2 pods x 4 GPUs), each meeting at its leader's DNS name."""
    found, errors = members(gpu_group)
    assert errors == []
    table = {
        m.pod_name: (list(m.ranks), m.get("--group-address"), m.serves_api, m.container.spec["resources"])
        for m in found
    }
    gpus = {
        "limits": {"cpu": "32", "memory": "192Gi", "nvidia.com/gpu": 4},
        "requests": {"cpu": "16", "memory": "128Gi"},
    }
    assert table == {
        f"{LEADERS}-0": ([0, 1, 2, 3], _address(0), True, gpus),
        f"{LEADERS}-1": ([0, 1, 2, 3], _address(1), True, gpus),
        f"{WORKERS}-0": ([4, 5, 6, 7], _address(0), False, gpus),
        f"{WORKERS}-1": ([4, 5, 6, 7], _address(1), False, gpus),
    }
    assert {(m.get("--tensor-parallel-size"), m.get("--pipeline-parallel-size")) for m in found} == {("4", "2")}


def test_cpu_group_pods_are_each_a_whole_group_of_two(cpu_group):
    found, errors = members(cpu_group)
    assert errors == []
    assert [(m.pod_name, list(m.ranks), m.get("--group-address")) for m in found] == [
        (f"{LEADERS}-0", [0, 1], ""),
        (f"{LEADERS}-1", [0, 1], ""),
    ]


@pytest.mark.parametrize("overlay", ["cpu-group", "gpu-group"])
def test_every_group_pod_starts_a_config_the_executor_accepts(overlay):
    """Each pod's arguments and environment, parsed by ExecutorConfig (its group checks included): the
    rank, ranks per process and rendezvous each pod's process gets."""
    from executor_svc.config import ExecutorConfig
    from pagoda.runtime.flags import parse_config

    objects = render(overlay_dirs()[overlay])
    configs = {}
    for member in members(objects)[0]:
        args, env = launch(member.container, objects, _pod(member))
        configs[member.pod_name] = parse_config(ExecutorConfig, args, "pagoda-executor", "", environ=env)
    expected = {
        "gpu-group": {
            f"{LEADERS}-0": (0, 4, _address(0)),
            f"{LEADERS}-1": (0, 4, _address(1)),
            f"{WORKERS}-0": (4, 4, _address(0)),
            f"{WORKERS}-1": (4, 4, _address(1)),
        },
        "cpu-group": {f"{LEADERS}-0": (0, 2, ""), f"{LEADERS}-1": (0, 2, "")},
    }[overlay]
    assert {name: (c.group_rank, c.local_ranks, c.group_address) for name, c in configs.items()} == expected
    assert {(c.group_size, c.kv_offload_dir, c.lora) for c in configs.values()} == {
        (8 if overlay == "gpu-group" else 2, "", ())
    }


def test_the_schedulers_discover_only_the_leaders(gpu_group):
    """The scheduler's --executors Service selects the leaders (ready ones only), the rendezvous Service
    publishes them before they are ready, and one disruption budget covers leaders and workers."""
    sched = next(c for c in containers(gpu_group) if c.program == "pagoda-scheduler")
    discovery = _by_name(gpu_group, "Service", setting(sched, gpu_group, "--executors").split(".")[0])
    rendezvous = _by_name(gpu_group, "Service", RENDEZVOUS)
    leaders, workers = (_by_name(gpu_group, "StatefulSet", n) for n in (LEADERS, WORKERS))
    selected = {
        svc["metadata"]["name"]: [
            w["metadata"]["name"] for w in (leaders, workers) if selects(svc["spec"]["selector"], template_labels(w))
        ]
        for svc in by_kind(gpu_group, "Service")
        if svc["metadata"]["name"].startswith(LEADERS)
    }
    assert selected == {LEADERS: [LEADERS], RENDEZVOUS: [LEADERS]}
    assert (discovery["spec"]["publishNotReadyAddresses"], rendezvous["spec"]["publishNotReadyAddresses"]) == (
        False,
        True,
    )
    (pdb,) = [p for p in by_kind(gpu_group, "PodDisruptionBudget") if p["metadata"]["name"] == LEADERS]
    assert [selects_pods(pdb["spec"]["selector"], template_labels(w)) for w in (leaders, workers)] == [True, True]
    assert {w["spec"]["updateStrategy"]["type"] for w in (leaders, workers)} == {"OnDelete"}


def test_a_worker_script_that_cannot_start_is_reported(gpu_group):
    """Without its pod name (the downward API) the worker's script cannot work out its ordinal."""
    (worker,) = [c for c in containers(gpu_group) if c.workload["metadata"]["name"] == WORKERS and not c.is_init]
    with pytest.raises(RuntimeError, match="its script exited"):
        launch(worker, gpu_group, {"metadata.namespace": "pagoda"})


def _break(objects: list[dict], how) -> list[str]:
    broken = copy.deepcopy(objects)
    how(broken)
    return check_groups(broken)


def test_an_extra_worker_meets_no_leader(gpu_group):
    errors = _break(gpu_group, lambda o: _by_name(o, "StatefulSet", WORKERS)["spec"].update(replicas=3))
    assert errors == [
        f"pod {WORKERS}-2 (statefulset/{WORKERS} container executor): rank 4 meets at {_address(2)!r}, "
        f"no leader's address ({[_address(0), _address(1)]})"
    ]


def test_a_missing_worker_leaves_its_group_short(gpu_group):
    errors = _break(gpu_group, lambda o: _by_name(o, "StatefulSet", WORKERS)["spec"].update(replicas=1))
    assert errors == [
        f"pod {LEADERS}-1 (statefulset/{LEADERS} container executor): its group's pods run ranks [0, 1, 2, 3], "
        "not 0..7 once each (1 pods, --tensor-parallel-size x --pipeline-parallel-size = 8)"
    ]


def test_a_rendezvous_that_waits_for_readiness_is_reported(gpu_group):
    errors = _break(
        gpu_group, lambda o: _by_name(o, "Service", RENDEZVOUS)["spec"].update(publishNotReadyAddresses=False)
    )
    assert len(errors) == 2 and all("publish not-ready addresses" in e for e in errors), errors


def test_a_leader_that_meets_elsewhere_is_reported(gpu_group):
    def elsewhere(objects):
        env = _executor_spec(objects, LEADERS)["env"]
        next(v for v in env if v["name"] == "PAGODA_GROUP_ADDRESS")["value"] = "$(POD_NAME).other:29500"

    assert _break(gpu_group, elsewhere) == [
        f"pod {LEADERS}-{g} (statefulset/{LEADERS} container executor): PAGODA_GROUP_ADDRESS is "
        f"'{LEADERS}-{g}.other:29500', not {_address(g)!r}"
        for g in (0, 1)
    ]


def test_a_leader_listening_on_another_port_is_reported(gpu_group):
    """The workers still meet at port 29500: they find no leader, and each group runs ranks 0-3 only."""

    def move(objects):
        spec = _executor_spec(objects, LEADERS)
        next(p for p in spec["ports"] if p["name"] == "group")["containerPort"] = 29501
        next(v for v in spec["env"] if v["name"] == "PAGODA_GROUP_ADDRESS")["value"] = (
            "$(POD_NAME).pagoda-executor-group.$(POD_NAMESPACE).svc.cluster.local:29501"
        )

    errors = _break(gpu_group, move)
    assert sum("rank 4 meets at" in e and "no leader's address" in e for e in errors) == 2
    assert sum("run ranks [0, 1, 2, 3], not 0..7" in e for e in errors) == 2
    assert sum("serve port group 29501" in e for e in errors) == 2
    assert len(errors) == 6


def test_gpus_unlike_ranks_and_unserved_features_are_reported(gpu_group):
    def change(objects):
        _executor_spec(objects, WORKERS)["resources"]["limits"]["nvidia.com/gpu"] = 8
        _executor_spec(objects, WORKERS)["env"].append({"name": "PAGODA_KV_OFFLOAD_DIR", "value": "/kv-offload"})

    errors = _break(gpu_group, change)
    assert f"{WORKER}: runs 4 ranks on 8 GPUs" in errors
    assert f"{WORKER}: --kv-offload-dir is not served by an executor group" in errors
    assert any(e.startswith(f"{WORKER}: differs from its leader {LEADERS}-1 in container resources") for e in errors)


def test_rolling_updates_and_a_short_group_timeout_are_reported(gpu_group):
    def change(objects):
        _by_name(objects, "StatefulSet", WORKERS)["spec"]["updateStrategy"] = {"type": "RollingUpdate"}
        _executor_spec(objects, LEADERS)["env"].append({"name": "PAGODA_GROUP_START_TIMEOUT_S", "value": "60"})

    errors = _break(gpu_group, change)
    assert sum("updateStrategy must be OnDelete" in e for e in errors) == 2
    assert sum("--group-start-timeout-s 60 <= 300s" in e for e in errors) == 2


def test_a_worker_that_serves_is_reported_by_every_check(gpu_group):
    """A worker given the leader's port, probe and scrape annotation: the groups, probes and metrics checks say so."""

    def serve(objects):
        worker = _by_name(objects, "StatefulSet", WORKERS)
        worker["spec"]["template"]["metadata"]["annotations"] = {"prometheus.io/scrape": "true"}
        _executor_spec(objects, WORKERS)["readinessProbe"] = {"grpc": {"port": 50061}}

    broken = copy.deepcopy(gpu_group)
    serve(broken)
    results = check_all(broken, *validate.known_flags()[:2])
    where = f"statefulset/{WORKERS} container executor"
    assert results["probes"] == [f"{where}: readinessProbe on a group rank that serves no health service"]
    assert results["metrics"] == [f"{where}: a group rank without the Executor API serves no metrics to scrape"]
    _executor_spec(broken, WORKERS)["ports"] = [{"name": "grpc", "containerPort": 50061}]
    assert sum("rank 4 declares the Executor API port 'grpc'" in e for e in check_groups(broken)) == 2
