"""deploy/k8s/: every manifest is valid against the Kubernetes schema (kubernetes-validate bundles the schemas, so
this runs offline), and every `jserve serve` flag, env var, port and metric the manifests name exists.

LeaderWorkerSet is a CRD the bundled schemas do not know: its own fields are checked against LWS_SCHEMA below
(written from the v1 CRD, the fields these manifests use), and its two pod templates against the real
PodTemplateSpec schema by wrapping each in a core/v1 PodTemplate.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import re
import shlex
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from jserve.cli import main

ROOT = Path(__file__).resolve().parents[1]
MANIFESTS = sorted((ROOT / "deploy" / "k8s").glob("*.yaml"))
K8S_VERSION = "1.33.0"

# spec of leaderworkerset.x-k8s.io/v1 LeaderWorkerSet (kubernetes-sigs/lws config/crd), the fields used here.
LWS_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "leaderworkerset.x-k8s.io/v1"},
        "kind": {"const": "LeaderWorkerSet"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["leaderWorkerTemplate"],
            "properties": {
                "replicas": {"type": "integer", "minimum": 0},
                "startupPolicy": {"enum": ["LeaderCreated", "LeaderReady"]},
                "leaderWorkerTemplate": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["workerTemplate"],
                    "properties": {
                        "size": {"type": "integer", "minimum": 1},
                        "restartPolicy": {"enum": ["RecreateGroupOnPodRestart", "None", "Default"]},
                        "leaderTemplate": {"type": "object"},
                        "workerTemplate": {"type": "object"},
                    },
                },
            },
        },
    },
}
# Env vars the manifests read that jserve does not: who sets or reads each.
EXTERNAL_ENV = {
    "HF_HOME": "huggingface_hub",  # where hub downloads go (a --model given as a hub id)
    "HF_TOKEN": "huggingface_hub",  # gated hub models
    "LWS_LEADER_ADDRESS": "the LeaderWorkerSet controller",
    "LWS_GROUP_SIZE": "the LeaderWorkerSet controller",
    "LWS_WORKER_INDEX": "the LeaderWorkerSet controller",
}


def documents() -> list[tuple[str, dict]]:
    return [(path.name, doc) for path in MANIFESTS for doc in yaml.safe_load_all(path.read_text()) if doc]


def pod_specs() -> list[tuple[str, dict]]:
    """Every pod template's spec: Deployments' and both of a LeaderWorkerSet's."""
    specs = []
    for name, doc in documents():
        if doc["kind"] == "Deployment":
            specs.append((f"{name}:{doc['metadata']['name']}", doc["spec"]["template"]["spec"]))
        elif doc["kind"] == "LeaderWorkerSet":
            template = doc["spec"]["leaderWorkerTemplate"]
            for role in ("leaderTemplate", "workerTemplate"):
                specs.append((f"{name}:{role}", template[role]["spec"]))
    return specs


def serve_argv(container: dict) -> list[str]:
    """The `jserve serve ...` words a container runs: the image's entrypoint is `jserve`, or a shell line."""
    command, args = container.get("command", []), container.get("args", [])
    if command[:2] == ["sh", "-c"]:
        words = shlex.split(args[0])
        assert words[:3] == ["exec", "jserve", "serve"], "exec, so SIGTERM reaches jserve itself"
        return words[2:]
    assert not command, "no command: the image's ENTRYPOINT (jserve) runs"
    return list(args)


def serve_help() -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        main(["serve", "--help"])
    return out.getvalue()


def flag_values(argv: list[str]) -> dict[str, str | None]:
    assert argv[0] == "serve"
    values: dict[str, str | None] = {}
    for word in argv[1:]:
        assert word.startswith("--"), f"{word!r}: give every flag as --name=value"
        name, _, value = word.partition("=")
        values[name] = value if value else None
    return values


def test_there_are_manifests_of_each_kind():
    kinds = {doc["kind"] for _, doc in documents()}
    assert {"Deployment", "Service", "HorizontalPodAutoscaler", "ConfigMap", "LeaderWorkerSet"} <= kinds


@pytest.mark.parametrize(("name", "doc"), documents(), ids=lambda x: x if isinstance(x, str) else x["kind"])
def test_manifest_is_valid_against_the_kubernetes_schema(name, doc):
    if doc["kind"] != "LeaderWorkerSet":
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        return
    jsonschema.validate(doc, LWS_SCHEMA)
    for role in ("leaderTemplate", "workerTemplate"):
        wrapped = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": f"lws-{role.lower()}"},
                   "template": doc["spec"]["leaderWorkerTemplate"][role]}
        kubernetes_validate.validate(wrapped, K8S_VERSION, strict=True)


def test_a_broken_manifest_is_caught():
    # The validation above is not vacuous: a misspelt field and a wrong type both fail.
    _, deployment = next((n, d) for n, d in documents() if d["kind"] == "Deployment")
    broken = yaml.safe_load(yaml.safe_dump(deployment))
    broken["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)
    broken = yaml.safe_load(yaml.safe_dump(deployment))
    broken["spec"]["replicas"] = "one"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


def test_every_serve_flag_exists_and_the_drain_time_matches_the_grace_period():
    help_text = serve_help()
    seen = 0
    for where, spec in pod_specs():
        for container in spec["containers"]:
            flags = flag_values(serve_argv(container))
            for flag in flags:
                assert re.search(rf"\s{re.escape(flag)}\b", help_text), f"{where}: {flag} is no jserve serve flag"
            seen += len(flags)
            assert flags.get("--compilation-cache-dir", "").startswith(
                tuple(m["mountPath"] + "/" for m in container["volumeMounts"])), \
                f"{where}: the compilation cache is on a mounted volume"
            if "--port" not in flags:  # a multi-host worker: no HTTP server, no probes
                assert flags["--process-id"] == "${LWS_WORKER_INDEX}" and "workerTemplate" in where
                assert not {"ports", "startupProbe", "readinessProbe", "livenessProbe"} & container.keys()
                continue
            assert flags["--host"] == "0.0.0.0"
            port = int(flags["--port"])
            assert any(p["containerPort"] == port and p["name"] == "http" for p in container["ports"])
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}, f"{where}: {probe}"
            # /health is 503 while loading: liveness waits for the startup probe, which allows for a long load.
            startup = container["startupProbe"]
            assert startup["periodSeconds"] * startup["failureThreshold"] >= 600
            # Kubernetes kills the pod terminationGracePeriodSeconds after it starts stopping it (preStop included):
            # that must cover the preStop sleep and jserve's whole --shutdown-timeout drain.
            drain = float(flags["--shutdown-timeout"])
            pre_stop = int(container["lifecycle"]["preStop"]["exec"]["command"][1])
            grace = spec["terminationGracePeriodSeconds"]
            assert pre_stop + drain < grace <= pre_stop + drain + 15, where
    assert seen > 10


def test_multi_host_flags_come_from_the_leaderworkerset_env():
    for where, spec in pod_specs():
        if "Template" not in where:
            continue
        flags = flag_values(serve_argv(spec["containers"][0]))
        assert flags["--coordinator-address"] == "${LWS_LEADER_ADDRESS}:8476"
        assert flags["--num-processes"] == "${LWS_GROUP_SIZE}"
        assert flags["--process-id"] == "${LWS_WORKER_INDEX}"


def test_every_env_var_is_read_by_jserve_or_a_named_component():
    sources = "\n".join(p.read_text() for p in (ROOT / "jserve").rglob("*.py"))
    hub_dir = Path(importlib.util.find_spec("huggingface_hub").origin).parent
    hub = "\n".join(p.read_text() for p in hub_dir.rglob("*.py"))
    for where, spec in pod_specs():
        for container in spec["containers"]:
            names = {e["name"] for e in container.get("env", [])}
            names |= set(re.findall(r"\$\{(\w+)\}", " ".join(container.get("args", []))))
            for name in names:
                if name in EXTERNAL_ENV:
                    if EXTERNAL_ENV[name] == "huggingface_hub":
                        assert f'"{name}"' in hub, f"{where}: huggingface_hub does not read {name}"
                    continue
                assert f'"{name}"' in sources, f"{where}: {name} is read by nothing"


def test_the_hpa_scales_on_the_queue_metric_the_adapter_serves():
    docs = {doc["kind"]: doc for _, doc in documents() if doc["kind"] in ("HorizontalPodAutoscaler", "ConfigMap")}
    deployment = next(doc for _, doc in documents() if doc["kind"] == "Deployment")
    hpa, adapter = docs["HorizontalPodAutoscaler"], yaml.safe_load(docs["ConfigMap"]["data"]["config.yaml"])
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                             "name": deployment["metadata"]["name"]}
    (metric,) = hpa["spec"]["metrics"]
    (rule,) = adapter["rules"]
    assert metric["type"] == "Pods" and metric["pods"]["metric"]["name"] == rule["name"]["as"]
    series = re.match(r"^([\w:]+)\{", rule["seriesQuery"]).group(1)
    assert series == "jserve:num_requests_waiting" and re.fullmatch(rule["name"]["matches"], series)
    assert f'"{series}"' in (ROOT / "jserve" / "server" / "metrics.py").read_text()
    assert rule["resources"]["overrides"]["pod"] == {"resource": "pod"}


def test_services_select_the_serving_pods():
    docs = documents()
    for name, service in docs:
        if service["kind"] != "Service":
            continue
        selector = service["spec"]["selector"]
        (port,) = service["spec"]["ports"]
        assert port["targetPort"] == "http"
        for _, doc in docs:
            if doc["kind"] == "Deployment" and doc["metadata"]["name"] == service["metadata"]["name"]:
                assert selector.items() <= doc["spec"]["template"]["metadata"]["labels"].items()
            if doc["kind"] == "LeaderWorkerSet" and doc["metadata"]["name"] == service["metadata"]["name"]:
                leader = doc["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["metadata"]["labels"]
                worker = doc["spec"]["leaderWorkerTemplate"]["workerTemplate"]["metadata"]["labels"]
                own = {k: v for k, v in selector.items() if not k.startswith("leaderworkerset.sigs.k8s.io/")}
                assert own.items() <= leader.items() and not own.items() <= worker.items(), name
