"""The manifests of ``deploy/``: every kustomization built (the kustomize features they use:
resources, namespace, labels, images, replicas, JSON patches, ConfigMap generators) and each
object validated offline, strictly (unknown fields refused), the built-in kinds against the
Kubernetes schemas of ``kubernetes-validate`` and the custom ones (RoleBasedGroup,
InferencePool) against their CRDs' schemas vendored in ``deploy/schemas``; every radixd.toml
a ConfigMap carries passes ``radixd check-config`` (its ``main``, in this process); and the wiring holds together (probes,
drain within the grace period, PDB and pool selectors, the HPA's metric, the topology hint,
the image's command)."""

from __future__ import annotations

import copy
import functools
import gzip
import json
import tomllib
from pathlib import Path

import jsonschema
import pytest
import yaml

from radixd import cli

kubernetes_validate = pytest.importorskip("kubernetes_validate")

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
KUSTOMIZATIONS = ["base", "overlays/cpu", "overlays/h200", "rbg", "inference-pool"]
K8S_VERSION = "1.33.0"


def build(directory: Path) -> list[dict]:
    """``kustomize build`` for the features these kustomizations use."""
    k = yaml.safe_load((directory / "kustomization.yaml").read_text())
    assert k["kind"] == "Kustomization"
    unknown = set(k) - {"apiVersion", "kind", "namespace", "resources", "labels", "images", "replicas", "patches",
                        "configMapGenerator", "generatorOptions"}
    assert not unknown, f"{directory}: kustomize fields this test does not build: {unknown}"
    objs: list[dict] = []
    for res in k.get("resources", []):
        path = directory / res
        objs += build(path) if path.is_dir() else [o for o in yaml.safe_load_all(path.read_text()) if o]
    assert k.get("generatorOptions", {}) in ({}, {"disableNameSuffixHash": True})
    for gen in k.get("configMapGenerator", []):
        objs.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": gen["name"]},
                     "data": {Path(f).name: (directory / f).read_text() for f in gen["files"]}})
    for lab in k.get("labels", []):
        assert set(lab) == {"pairs"}  # metadata only, as kustomize's default
        for o in objs:
            o["metadata"].setdefault("labels", {}).update(lab["pairs"])
    for o in objs:
        if "namespace" in k:
            o["metadata"]["namespace"] = k["namespace"]
        for c in pod_spec(o).get("containers", []) if pod_spec(o) else []:
            for img in k.get("images", []):
                if c["image"].split(":")[0] == img["name"]:
                    c["image"] = f"{img.get('newName', img['name'])}:{img['newTag']}"
        for rep in k.get("replicas", []):
            if o["metadata"]["name"] == rep["name"] and o["kind"] in ("Deployment", "StatefulSet"):
                o["spec"]["replicas"] = rep["count"]
    for p in k.get("patches", []):
        assert set(p["target"]) == {"kind", "name"}
        hits = [o for o in objs if (o["kind"], o["metadata"]["name"]) == (p["target"]["kind"], p["target"]["name"])]
        assert hits, p["target"]
        for o in hits:
            for op in yaml.safe_load(p["patch"]):
                json_patch(o, op)
    return objs


def json_patch(obj: dict, op: dict) -> None:
    *parents, last = [int(x) if x.isdigit() else x for x in op["path"].lstrip("/").split("/")]
    node = obj
    for part in parents:
        node = node[part]
    assert op["op"] in ("add", "replace")
    if op["op"] == "replace":
        node[last]  # must exist  # noqa: B018
    node[last] = op["value"]


def pod_spec(o: dict) -> dict | None:
    if o["kind"] == "Deployment":
        return o["spec"]["template"]["spec"]
    return None


@functools.cache
def crd_schemas() -> dict[tuple[str, str], dict]:
    out = {}
    for f in (DEPLOY / "schemas").glob("*.json.gz"):
        doc = json.loads(gzip.decompress(f.read_bytes()))
        out[(f"{doc['group']}/{doc['version']}", doc["kind"])] = strict(doc["openAPIV3Schema"])
    return out


def strict(schema: dict) -> dict:
    """A structural schema that refuses unknown fields, as the API server's strict field
    validation does (objects that preserve unknown fields stay open)."""
    s = copy.deepcopy(schema)
    stack = [s]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if ("properties" in node and "additionalProperties" not in node
                    and not node.get("x-kubernetes-preserve-unknown-fields")):
                node["additionalProperties"] = False
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return s


@pytest.fixture(scope="module")
def built() -> dict[str, list[dict]]:
    return {name: build(DEPLOY / name) for name in KUSTOMIZATIONS}


def test_every_object_validates(built):
    crds = crd_schemas()
    assert set(crds) == {("workloads.x-k8s.io/v1alpha2", "RoleBasedGroup"),
                         ("inference.networking.k8s.io/v1", "InferencePool")}
    kinds = set()
    for name, objs in built.items():
        for o in objs:
            kinds.add(o["kind"])
            where = f"{name}: {o['kind']}/{o['metadata']['name']}"
            schema = crds.get((o["apiVersion"], o["kind"]))
            if schema is not None:
                try:
                    jsonschema.validate(o, schema)
                except jsonschema.ValidationError as exc:
                    raise AssertionError(f"{where}: {exc.message} at {list(exc.absolute_path)}") from None
            else:
                try:
                    kubernetes_validate.validate(o, K8S_VERSION, strict=True)
                except kubernetes_validate.ValidationError as exc:
                    raise AssertionError(f"{where}: {exc.message} at {list(exc.path)}") from None
    assert {"Deployment", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler", "ConfigMap",
            "RoleBasedGroup", "InferencePool"} <= kinds


def test_a_crd_schema_catches_a_bad_field(built):
    crds = crd_schemas()
    (rbg,) = [o for o in built["rbg"] if o["kind"] == "RoleBasedGroup"]
    bad = copy.deepcopy(rbg)
    bad["spec"]["roles"][1]["replica"] = 2  # a typo of replicas
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, crds[("workloads.x-k8s.io/v1alpha2", "RoleBasedGroup")])


def test_configmaps_radixd_toml_passes_check_config(built, tmp_path, capsys):
    files: dict[str, str] = {}  # text -> the first kustomization carrying it
    for name, objs in built.items():
        for o in objs:
            if o["kind"] == "ConfigMap" and "radixd.toml" in o.get("data", {}):
                files.setdefault(o["data"]["radixd.toml"], name)
    assert set(files.values()) == {"base", "rbg"}
    for i, (text, name) in enumerate(files.items()):
        path = tmp_path / f"{i}.toml"
        path.write_text(text)
        assert cli.main(["check-config", str(path)]) == 0, f"{name}: {capsys.readouterr()}"
    bad = tmp_path / "bad.toml"
    bad.write_text(next(iter(files)).replace("[kv_events]", "[kv_events]\nblock_sise = 4"))
    assert cli.main(["check-config", str(bad)]) == 2 and "block_sise" in capsys.readouterr().err


def test_deployment_wiring(built):
    objs = {(o["kind"], o["metadata"]["name"]): o for o in built["overlays/cpu"]}
    dep = objs[("Deployment", "radixd")]
    pod = dep["spec"]["template"]
    (c,) = pod["spec"]["containers"]
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"
    toml = tomllib.loads(objs[("ConfigMap", "radixd-config")]["data"]["radixd.toml"])
    pause = c["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pause + toml["server"]["drain_timeout_s"] < pod["spec"]["terminationGracePeriodSeconds"]
    assert toml["server"]["port"] == c["ports"][0]["containerPort"] and toml["server"]["host"] == "0.0.0.0"
    assert c["image"] == "ghcr.io/radixd/radixd:0.1.0" and dep["metadata"]["namespace"] == "radixd"
    assert {"name": "config", "mountPath": "/etc/radixd", "readOnly": True} in c["volumeMounts"]
    labels = pod["metadata"]["labels"]
    for kind in ("PodDisruptionBudget", "Service"):
        sel = objs[(kind, "radixd")]["spec"]["selector"]
        assert (sel.get("matchLabels") or sel).items() <= labels.items()
    hpa = objs[("HorizontalPodAutoscaler", "radixd")]["spec"]
    assert hpa["scaleTargetRef"]["name"] == "radixd"
    rules = yaml.safe_load(objs[("ConfigMap", "radixd-prometheus-adapter-rules")]["data"]["config.yaml"])["rules"]
    (rule,) = rules
    assert "vllm:num_requests_waiting" in rule["seriesQuery"]
    assert hpa["metrics"][0]["pods"]["metric"]["name"] == "num_requests_waiting" and rule["name"]["as"] == "${1}"
    pool = next(o for o in built["inference-pool"] if o["kind"] == "InferencePool")["spec"]
    assert pool["selector"]["matchLabels"].items() <= labels.items()
    assert pool["targetPorts"] == [{"number": toml["server"]["port"]}]
    h200 = next(o for o in built["overlays/h200"] if o["kind"] == "Deployment")
    assert h200["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"


def test_rolebasedgroup_roles_and_topology(built):
    (rbg,) = [o for o in built["rbg"] if o["kind"] == "RoleBasedGroup"]
    roles = rbg["spec"]["roles"]
    assert [r["name"] for r in roles] == ["mooncake-store", "decode", "prefill", "gateway"]
    decode = roles[1]
    assert decode["rolloutStrategy"]["rollingUpdate"]["type"] == "InPlaceIfPossible"
    (term,) = decode["standalonePattern"]["templateRef"]["patch"]["spec"]["affinity"]["podAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["labelSelector"]["matchLabels"]["rbg.workloads.x-k8s.io/role-name"] == "mooncake-store"
    # the README's in-place update patch names an image that exists at that path
    image = rbg["spec"]["roleTemplates"][0]["template"]["spec"]["containers"][0]["image"]
    assert image.startswith("ghcr.io/radixd/radixd:")
    assert "/spec/roles/1/standalonePattern/template/spec/containers/0/image" in (
        DEPLOY / "rbg" / "kustomization.yaml").read_text()
    # the radixd roles' KV tier below the host is the store role's Mooncake store, whose store
    # service holds the pages (the daemons lend it no memory)
    (cm,) = [o for o in built["rbg"] if o["kind"] == "ConfigMap"]
    cache = tomllib.loads(cm["data"]["radixd.toml"])["cache"]
    assert cache["tiers"] == ["host", "mooncake"]
    store = roles[0]["standalonePattern"]["template"]["spec"]["containers"]
    assert [c["command"] for c in store] == [["mooncake_master"], ["mooncake_client"]]
    rpc = next(p["containerPort"] for p in store[0]["ports"] if p["name"] == "rpc")
    assert cache["mooncake"]["master_server_address"] == f"s-radixd-pd-mooncake-store:{rpc}"
    assert f"--master_server_address=127.0.0.1:{rpc}" in store[1]["args"]
    assert cache["mooncake"].get("global_segment_size", 0) == 0


def test_containerfile_runs_the_daemon_as_the_unit_does():
    text = (DEPLOY / "Containerfile").read_text()
    unit = (ROOT / "packaging" / "radixd.service").read_text()
    exec_start = next(line for line in unit.splitlines() if line.startswith("ExecStart=")).split("=", 1)[1]
    entry = json.loads(next(line for line in text.splitlines() if line.startswith("ENTRYPOINT")).split(" ", 1)[1])
    assert [Path(entry[0]).name, *entry[1:]] == [Path(exec_start.split()[0]).name, *exec_start.split()[1:]]
    for env in ("RADIXD_CACHE=/var/cache/radixd", "PYTHONUNBUFFERED=1"):
        assert env in text and env in unit
    assert "USER 10001" in text and "STOPSIGNAL SIGTERM" in text
