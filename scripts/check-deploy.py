#!/usr/bin/env python3
"""Offline checks of what operators install: deploy/ (base and overlays), the alert rules and
the Dockerfile.

- Renders each kustomization with the subset of kustomize this repository uses (resources,
  namespace, configMapGenerator with create/replace and labels, strategic-merge patches,
  images), since no kustomize binary is installable here.
- Validates every built-in object against the Kubernetes schemas (kubernetes-validate, strict,
  for the oldest supported Kubernetes), and the monitoring.coreos.com objects by hand.
- Loads each generated config with `kube-event-bridge check-config`.
- Checks least privilege: the ClusterRole grants list+watch on exactly what the config
  watches (plus discovery), nothing else; the Lease Role exists when leader election is on.
- Checks the Deployment's hardening (non-root, read-only root, no capabilities, seccomp,
  probes, resources, two replicas; three or more when sharded, with the Lease rules sharding needs).
- Checks that the PrometheusRule carries exactly deploy/alerts/*.rules.yml, and runs
  `promtool check rules` and `hadolint`.
- The Helm chart (deploy/helm/kube-event-bridge, with the Helm scripts/build-helm builds):
  `helm lint --strict`; `helm template` of every example values file checked as above and
  compared with its kustomization field by field (one source of truth, either way); the RBAC
  it derives from config.resources (a custom kind, an unknown one, a wildcard); the values
  schema refusing misspelt and mistyped values; its copies of the dashboard and alert rules.

Prints one line per check and a closing `check-deploy: N passed, M failed`.
"""

import copy
import json
import os
import pathlib
import subprocess
import sys
import tempfile

import kubernetes_validate
import yaml

ROOT = pathlib.Path(__file__).resolve().parent.parent
KUBERNETES_VERSION = "1.33"  # the oldest cluster we support (k8s-openapi feature v1_33)
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding"}
# apiVersion/kind → (API group, plural) for the kinds the shipped configs watch.
KNOWN_RESOURCES = {
    ("v1", "ConfigMap"): ("", "configmaps"),
    ("v1", "Secret"): ("", "secrets"),
    ("v1", "Pod"): ("", "pods"),
    ("v1", "Service"): ("", "services"),
    ("v1", "Namespace"): ("", "namespaces"),
    ("apps/v1", "Deployment"): ("apps", "deployments"),
    ("apps/v1", "StatefulSet"): ("apps", "statefulsets"),
}
DISCOVERY = {"/api", "/api/*", "/apis", "/apis/*", "/version"}
# get on the namespace kube-system, whose uid identifies the cluster in checkpoints.
IDENTITY_RULE = {"apiGroups": [""], "resources": ["namespaces"], "resourceNames": ["kube-system"], "verbs": ["get"]}

results = []


def check(name, ok, detail=""):
    results.append((name, ok))
    print(f"{'ok  ' if ok else 'FAIL'} {name}" + (f": {detail}" if detail and not ok else ""))
    return ok


def docs(path):
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d]


def merge(base, patch):
    """Strategic merge, as far as these manifests need: maps merge recursively, lists of maps
    with a `name` merge by name, other lists are replaced."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for k, v in patch.items():
            out[k] = merge(base[k], v) if k in base else copy.deepcopy(v)
        return out
    if isinstance(base, list) and isinstance(patch, list) and all(isinstance(i, dict) and "name" in i for i in base + patch):
        out = [copy.deepcopy(i) for i in base]
        for item in patch:
            match = next((i for i, b in enumerate(out) if b["name"] == item["name"]), None)
            if match is None:
                out.append(copy.deepcopy(item))
            else:
                out[match] = merge(out[match], item)
        return out
    return copy.deepcopy(patch)


def render(directory):
    with open(directory / "kustomization.yaml") as f:
        k = yaml.safe_load(f)
    objects = []
    for r in k.get("resources", []):
        path = (directory / r).resolve()
        objects += render(path) if path.is_dir() else docs(path)
    for gen in k.get("configMapGenerator", []):
        data = {}
        for entry in gen.get("files", []):
            key, _, file = entry.partition("=") if "=" in entry else (pathlib.Path(entry).name, "", entry)
            data[key] = (directory / file).read_text()
        existing = [o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"] == gen["name"]]
        behavior = gen.get("behavior", "create")
        labels = gen.get("options", {}).get("labels")
        if behavior == "create":
            assert not existing, f"configMapGenerator {gen['name']} already exists"
            objects.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": gen["name"], **({"labels": labels} if labels else {})}, "data": data})
        else:
            assert existing, f"configMapGenerator {gen['name']}: nothing to {behavior}"
            existing[0]["data"] = data if behavior == "replace" else {**existing[0]["data"], **data}
            if labels:
                existing[0]["metadata"]["labels"] = {**existing[0]["metadata"].get("labels", {}), **labels}
    for p in k.get("patches", []):
        patch = docs(directory / p["path"])[0]
        targets = [i for i, o in enumerate(objects) if o["kind"] == patch["kind"] and o["metadata"]["name"] == patch["metadata"]["name"]]
        assert len(targets) == 1, f"patch {p['path']} matches {len(targets)} objects"
        objects[targets[0]] = merge(objects[targets[0]], patch)
    if "namespace" in k:
        for o in objects:
            if o["kind"] not in CLUSTER_SCOPED:
                o["metadata"]["namespace"] = k["namespace"]
    for image in k.get("images", []):
        for o in objects:
            for c in o.get("spec", {}).get("template", {}).get("spec", {}).get("containers", []):
                if c.get("image") == image["name"]:
                    c["image"] = f"{image.get('newName', image['name'])}:{image.get('newTag', 'latest')}"
    return objects


def keeps_checkpoint(sink):
    """Whether a sink keeps a checkpoint (resume is on by default): kafka, nats in jetstream
    mode, stdout with a path."""
    if sink.get("resume", True) is False:
        return False
    kind = sink.get("type")
    return (kind == "kafka"
            or (kind == "nats" and (sink.get("nats") or {}).get("mode", "jetstream") == "jetstream")
            or (kind == "stdout" and bool((sink.get("stdout") or {}).get("path"))))


def find(objects, kind, name=None):
    return [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]


def binary():
    target = pathlib.Path(os.environ.get("CARGO_TARGET_DIR") or ROOT / "target")
    exe = (target if target.is_absolute() else ROOT / target) / "debug" / "kube-event-bridge"
    if not exe.exists():
        subprocess.run(["cargo", "build", "--quiet", "--bin", "kube-event-bridge"], cwd=ROOT, check=True)
    return exe


def check_kustomization(directory):
    label = str(directory.relative_to(ROOT))
    try:
        objects = render(directory)
    except Exception as e:  # a broken kustomization is one failed check, not a crash
        check(f"{label}: renders", False, str(e))
        return None
    check(f"{label}: renders ({len(objects)} objects)", True)
    check_objects(label, objects, "kube-event-bridge-config")
    return objects


def check_objects(label, objects, config_map):
    """What deploy/ and the Helm chart must both give: valid objects, a config that loads,
    least-privilege RBAC, a hardened Deployment and monitoring that fits together."""
    for o in objects:
        what = f"{label}: {o['kind']} {o['metadata']['name']}"
        if o["apiVersion"].startswith("monitoring.coreos.com/"):
            continue
        try:
            kubernetes_validate.validate(o, KUBERNETES_VERSION, strict=True)
            check(f"{what} matches the Kubernetes {KUBERNETES_VERSION} schema", True)
        except Exception as e:
            check(f"{what} matches the Kubernetes {KUBERNETES_VERSION} schema", False, str(e).splitlines()[0])

    # The config loads, and RBAC grants exactly what it needs.
    cm = find(objects, "ConfigMap", config_map)[0]
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
        f.write(cm["data"]["config.yaml"])
        f.flush()
        run = subprocess.run([str(binary()), "check-config", f.name], capture_output=True, text=True)
    check(f"{label}: config.yaml passes check-config", run.returncode == 0, run.stderr.strip())
    config = yaml.safe_load(cm["data"]["config.yaml"])
    # CRDs: to start a kind when its CRD is installed, and stop it when it is deleted.
    needed = {("apiextensions.k8s.io", "customresourcedefinitions")}
    for r in config["resources"]:
        key = (r.get("api_version") or r.get("apiVersion"), r["kind"])
        ok = check(f"{label}: {key[1]} has a known plural for the RBAC check", key in KNOWN_RESOURCES)
        if ok:
            needed.add(KNOWN_RESOURCES[key])
    granted, extra = set(), []
    role = find(objects, "ClusterRole", "kube-event-bridge")[0]
    for rule in role["rules"]:
        if "nonResourceURLs" in rule:
            if set(rule["nonResourceURLs"]) - DISCOVERY or set(rule["verbs"]) != {"get"}:
                extra.append(rule)
            continue
        # The cluster's identity for checkpoints: get on the one namespace kube-system.
        if rule == IDENTITY_RULE:
            continue
        if set(rule["verbs"]) != {"list", "watch"}:
            extra.append(rule)
        for g in rule["apiGroups"]:
            for res in rule["resources"]:
                granted.add((g, res))
    check(f"{label}: ClusterRole grants list+watch on exactly the watched resources and CRDs", granted == needed and not extra,
          f"granted {sorted(granted)}, needed {sorted(needed)}, other rules {extra}")
    # A sink that keeps a checkpoint records the cluster's identity (uid of kube-system) and
    # cannot start without reading it (found against a real API server: the overlays' patches
    # replaced the base's rules and lost this one).
    if any(keeps_checkpoint(s) for s in config.get("sinks", [])):
        check(f"{label}: a sink keeps a checkpoint: the ClusterRole allows get on namespace kube-system",
              IDENTITY_RULE in role["rules"])
    if config.get("leader_election", {}).get("enabled"):
        role = find(objects, "Role", "kube-event-bridge-leader-election")
        leases = role and all(r["apiGroups"] == ["coordination.k8s.io"] and r["resources"] == ["leases"] for r in role[0]["rules"])
        check(f"{label}: a Role allows the Lease (and nothing else) for leader election", bool(leases))
        check(f"{label}: RoleBinding for the Lease Role", bool(find(objects, "RoleBinding", "kube-event-bridge-leader-election")))
    sharded = config.get("sharding", {}).get("shards", 1) > 1
    if sharded:
        role = find(objects, "Role", "kube-event-bridge-leader-election")
        verbs = {v for r in (role[0]["rules"] if role else []) if not r.get("resourceNames") for v in r["verbs"]}
        check(f"{label}: sharded: the Lease Role allows create, get, update, list and delete on Leases (shard and membership Leases)",
              {"create", "get", "update", "list", "delete"} <= verbs, f"verbs without resourceNames: {sorted(verbs)}")

    # Hardening.
    deployment = find(objects, "Deployment", "kube-event-bridge")[0]
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    sc = container.get("securityContext", {})
    if sharded:
        check(f"{label}: sharded: at least three replicas", deployment["spec"]["replicas"] >= 3)
    else:
        check(f"{label}: two replicas", deployment["spec"]["replicas"] == 2)
    check(f"{label}: runs as non-root with seccomp RuntimeDefault",
          pod["securityContext"].get("runAsNonRoot") is True and pod["securityContext"].get("seccompProfile", {}).get("type") == "RuntimeDefault")
    check(f"{label}: read-only root, no privilege escalation, all capabilities dropped",
          sc.get("readOnlyRootFilesystem") is True and sc.get("allowPrivilegeEscalation") is False and sc.get("capabilities", {}).get("drop") == ["ALL"])
    check(f"{label}: liveness /healthz and readiness /readyz",
          container["livenessProbe"]["httpGet"]["path"] == "/healthz" and container["readinessProbe"]["httpGet"]["path"] == "/readyz")
    check(f"{label}: resource requests and memory limit",
          "requests" in container.get("resources", {}) and "memory" in container["resources"].get("limits", {}))
    mounts = {m["name"] for m in container.get("volumeMounts", [])}
    volumes = {v["name"] for v in pod.get("volumes", [])}
    check(f"{label}: every volume mount has its volume", mounts <= volumes, f"{mounts - volumes}")

    # Monitoring objects.
    service = find(objects, "Service", "kube-event-bridge")[0]
    monitor = find(objects, "ServiceMonitor", "kube-event-bridge")[0]
    selects = all(service["metadata"]["labels"].get(k) == v for k, v in monitor["spec"]["selector"]["matchLabels"].items())
    ports = {p["name"] for p in service["spec"]["ports"]}
    check(f"{label}: ServiceMonitor selects the Service and scrapes a named port",
          selects and all(e["port"] in ports for e in monitor["spec"]["endpoints"]))
    rule = find(objects, "PrometheusRule", "kube-event-bridge")[0]
    with open(ROOT / "deploy" / "alerts" / "kube-event-bridge.rules.yml") as f:
        plain = yaml.safe_load(f)
    check(f"{label}: PrometheusRule holds exactly deploy/alerts/kube-event-bridge.rules.yml", rule["spec"] == plain)


# ---------------------------------------------------------------------------------------
# The Helm chart (deploy/helm/kube-event-bridge), with the Helm that scripts/build-helm builds.

CHART = ROOT / "deploy" / "helm" / "kube-event-bridge"
EXAMPLES = ROOT / "deploy" / "helm" / "examples"
# Each example values file and the kustomization it must equal, object by object.
EXAMPLE_OF = {"stdout": "base", "kafka": "overlays/kafka", "nats": "overlays/nats", "sharded": "overlays/sharded"}
MONITORING = ["--api-versions", "monitoring.coreos.com/v1/ServiceMonitor", "--api-versions", "monitoring.coreos.com/v1/PrometheusRule"]
# Labels only Helm sets (chart, release, version): compared without them.
HELM_LABELS = {"helm.sh/chart", "app.kubernetes.io/managed-by", "app.kubernetes.io/instance", "app.kubernetes.io/version"}


def helm_binary():
    target = pathlib.Path(os.environ.get("CARGO_TARGET_DIR") or ROOT / "target")
    exe = (target if target.is_absolute() else ROOT / target) / "helm" / "helm"
    if not exe.exists():
        subprocess.run([str(ROOT / "scripts" / "build-helm")], check=True)
    return exe


def helm(*args):
    """Runs helm; returns (exit code, stdout, stderr)."""
    env = dict(os.environ)
    tmp = pathlib.Path(tempfile.gettempdir()) / "keb-helm-home"
    env.update(HELM_CACHE_HOME=str(tmp / "cache"), HELM_CONFIG_HOME=str(tmp / "config"), HELM_DATA_HOME=str(tmp / "data"))
    run = subprocess.run([str(helm_binary()), *args], capture_output=True, text=True, cwd=ROOT, env=env)
    return run.returncode, run.stdout, run.stderr


def template(*args):
    """`helm template kube-event-bridge CHART -n kube-event-bridge ARGS`: its objects, or the error."""
    code, out, err = helm("template", "kube-event-bridge", str(CHART), "--namespace", "kube-event-bridge", *args)
    if code != 0:
        return None, err.strip()
    return [d for d in yaml.safe_load_all(out) if d], ""


def normalized(o, helm_side):
    """An object as compared across kustomize and Helm: without Helm's own labels and the
    config checksum (kustomize's equivalent is the generated name's hash, which this
    repository's renderer leaves out), RBAC rules sorted, the config parsed."""
    o = copy.deepcopy(o)

    def strip(node):
        if isinstance(node, dict):
            for key in ("labels", "matchLabels", "selector"):  # selector: a Service's
                if isinstance(node.get(key), dict):
                    for label in HELM_LABELS:
                        node[key].pop(label, None)
            for v in node.values():
                strip(v)
        elif isinstance(node, list):
            for v in node:
                strip(v)
    strip(o)
    template = o.get("spec", {}).get("template", {}).get("metadata", {})
    template.get("annotations", {}).pop("checksum/config", None)
    if template.get("annotations") == {}:
        template.pop("annotations")
    if o["kind"] in ("ClusterRole", "Role"):
        o["rules"] = sorted(o["rules"], key=lambda r: yaml.safe_dump(r, sort_keys=True))
    if o["kind"] == "ConfigMap" and "config.yaml" in o.get("data", {}):
        o["data"]["config.yaml"] = yaml.safe_load(o["data"]["config.yaml"])
    if o["kind"] not in CLUSTER_SCOPED:
        o["metadata"].setdefault("namespace", "kube-event-bridge")
    return o


def differences(a, b, path=""):
    """Field paths where a and b differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b), key=str):
            if k not in a or k not in b:
                out.append(f"{path}.{k}: {'only in Helm' if k not in a else 'only in kustomize'}")
            else:
                out += differences(a[k], b[k], f"{path}.{k}")
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: kustomize {a!r}, Helm {b!r}"]


def check_chart():
    code, out, err = helm("lint", "--strict", str(CHART))
    check("helm lint --strict deploy/helm/kube-event-bridge", code == 0, (out + err).strip())
    for name, path in [("files/kube-event-bridge.json", ROOT / "dashboards" / "kube-event-bridge.json"),
                       ("files/kube-event-bridge.rules.yml", ROOT / "deploy" / "alerts" / "kube-event-bridge.rules.yml")]:
        check(f"chart: {name} is a copy of {path.relative_to(ROOT)}", (CHART / name).read_bytes() == path.read_bytes())

    # The chart's defaults (no values file) are deploy/base's objects, as stdout.yaml's are.
    for example in [None, *sorted(EXAMPLES.glob("*.yaml"))]:
        values = ["-f", str(example)] if example else []
        label = f"helm template -f {example.relative_to(ROOT)}" if example else "helm template (the chart's defaults)"
        code, out, err = helm("lint", "--strict", str(CHART), *values)
        check(f"helm lint --strict {' '.join(values)}".strip(), code == 0, (out + err).strip())
        objects, err = template(*values, *MONITORING)
        if not check(f"{label}: renders", objects is not None, err):
            continue
        print(f"     {label}: " + ", ".join(f"{o['kind']} {o['metadata']['name']}" for o in objects))
        check_objects(label, objects, "kube-event-bridge-config")
        dashboard = find(objects, "ConfigMap", "kube-event-bridge-dashboard")
        check(f"{label}: the Grafana dashboard ConfigMap carries dashboards/kube-event-bridge.json, labelled for the sidecar",
              bool(dashboard) and dashboard[0]["metadata"]["labels"].get("grafana_dashboard") == "1"
              and json.loads(dashboard[0]["data"]["kube-event-bridge.json"]) == json.loads((ROOT / "dashboards" / "kube-event-bridge.json").read_text()))
        # One source of truth: the same objects as the kustomization, field by field (Helm
        # adds the dashboard; kustomize the Namespace, which `helm install --create-namespace`
        # creates).
        kustomization = EXAMPLE_OF[example.stem] if example else "base"
        kustomized = render(ROOT / "deploy" / kustomization)
        ours = {(o["kind"], o["metadata"]["name"]): normalized(o, False) for o in kustomized if o["kind"] != "Namespace"}
        theirs = {(o["kind"], o["metadata"]["name"]): normalized(o, True) for o in objects if o["metadata"]["name"] != "kube-event-bridge-dashboard"}
        found = [f"{k}: only in kustomize" for k in ours.keys() - theirs.keys()] + [f"{k}: only in Helm" for k in theirs.keys() - ours.keys()]
        for key in sorted(ours.keys() & theirs.keys()):
            found += [f"{key[0]} {key[1]}{d}" for d in differences(ours[key], theirs[key])]
        check(f"{label}: the same objects as deploy/{kustomization}, field by field", not found, "\n      " + "\n      ".join(found))

    # Without the Prometheus Operator's CRDs, no ServiceMonitor or PrometheusRule.
    objects, err = template()
    check("helm template without monitoring.coreos.com/v1: no ServiceMonitor or PrometheusRule",
          objects is not None and not [o for o in objects if o["apiVersion"].startswith("monitoring.coreos.com/")], err)

    # RBAC from config.resources: a custom kind named in rbac.plurals, a kind the chart does
    # not know (refused, named), and a wildcard selection (the wide role).
    resources = ["--set", "config.resources[0].api_version=apps/v1", "--set", "config.resources[0].kind=Deployment",
                 "--set", "config.resources[1].api_version=example.com/v1", "--set", "config.resources[1].kind=Widget",
                 "--set", "config.routes[0].resource=deployment.apps", "--set", "config.routes[0].sinks[0]=stdout",
                 "--set", "config.routes[1].resource=widget.example.com", "--set", "config.routes[1].sinks[0]=stdout"]
    objects, err = template(*resources)
    check("helm template: a custom kind without rbac.plurals is refused, naming it",
          objects is None and "config.resources[1]" in err and "Widget" in err and "rbac.plurals" in err, err)
    objects, err = template(*resources, "--set", "rbac.plurals.example\\.com/Widget=widgets")
    if check("helm template: rbac.plurals names a custom kind's plural", objects is not None, err):
        rules = find(objects, "ClusterRole")[0]["rules"]
        print("     narrow selection (Deployments, Widgets): " + json.dumps([r for r in rules if r.get("verbs") == ["list", "watch"]]))
        check("helm template: list and watch on exactly apps/deployments and example.com/widgets",
              {"apiGroups": ["apps"], "resources": ["deployments"], "verbs": ["list", "watch"]} in rules
              and {"apiGroups": ["example.com"], "resources": ["widgets"], "verbs": ["list", "watch"]} in rules)
    objects, err = template("--set", "config.resources[0].api_version=*", "--set", "config.resources[0].kind=*",
                            "--set", "config.resources[0].name=everything",
                            "--set", "config.routes[0].resource=everything", "--set", "config.routes[0].sinks[0]=stdout")
    if check("helm template: a wildcard selection renders", objects is not None, err):
        rules = find(objects, "ClusterRole")[0]["rules"]
        print("     wildcard selection (api_version: \"*\", kind: \"*\"): " + json.dumps([r for r in rules if r.get("verbs") == ["list", "watch"]]))
        check("helm template: a wildcard selection gets list and watch on every resource, never other verbs",
              {"apiGroups": ["*"], "resources": ["*"], "verbs": ["list", "watch"]} in rules
              and all(set(r["verbs"]) <= {"list", "watch", "get"} for r in rules))

    # values.schema.json: misspelt or mistyped values are refused with the schema's error.
    for args, wanted in [(["--set", "replicaCont=3"], "additional properties 'replicaCont' not allowed"),
                         (["--set", "config.sinks[0].name=k", "--set", "config.sinks[0].type=kafka", "--set", "config.sinks[0].kafka.brokerz=x"],
                          "additional properties 'brokerz' not allowed"),
                         (["--set", "config.log.format=yaml"], "/config/log/format"),
                         (["--set", "config.shutdown.grace_period=25"], "/config/shutdown/grace_period")]:
        objects, err = template(*args)
        check(f"helm template {' '.join(args)}: refused by values.schema.json ({wanted})", objects is None and wanted in err, err)
    # What spans fields or cannot work in a Deployment: refused at install, named.
    for args, wanted in [
        (["--set", "config.sinks[0].name=kafka", "--set", "config.sinks[0].type=kafka", "--set", "config.sinks[0].kafka.brokers[0]=kafka:9092"],
         "config.routes[0].sinks: no sink named \"stdout\""),
        (["--set", "config.resources[0].api_version=apps/v1", "--set", "config.resources[0].kind=Deployment"],
         "config.routes[0].resource: no resource named \"configmap\""),
        (["--set", "config.sinks[0].name=stdout", "--set", "config.sinks[0].type=nats", "--set", "config.sinks[0].nats.servers[0]=nats://u:pw@nats:4222"],
         "config.sinks[0].nats.servers[0]: credentials in the URL"),
        (["--set", "config.leader_election.enabled=false"], "every replica would publish everything"),
        (["--set", "config.leader_election.identity=pod-a"], "config.leader_election.identity"),
        (["--set", "config.admin.address=127.0.0.1:8080"], "loopback only"),
        (["--set", "config.admin.address=0.0.0.0:0"], "port 0"),
    ]:
        objects, err = template(*args)
        check(f"helm template {' '.join(args)}: refused ({wanted})", objects is None and wanted in err, err)
    # A second release's Lease is its own; with a nameOverride the alerts follow the job label.
    objects, err = template("--set", "fullnameOverride=other")
    if check("helm template with fullnameOverride=other renders", objects is not None, err):
        config = yaml.safe_load(find(objects, "ConfigMap", "other-config")[0]["data"]["config.yaml"])
        names = [n for r in find(objects, "Role")[0]["rules"] for n in r.get("resourceNames", [])]
        check("fullnameOverride=other: the config's Lease and the Role's are `other`",
              config["leader_election"].get("lease_name") == "other" and names == ["other"], f"{config['leader_election']}, {names}")
    objects, err = template("--set", "nameOverride=keb", *MONITORING)
    if check("helm template with nameOverride=keb renders", objects is not None, err):
        rules = yaml.safe_dump(find(objects, "PrometheusRule")[0]["spec"])
        check("nameOverride=keb: the alerts select job=\"keb\", the ServiceMonitor's job label",
              'job="keb"' in rules and 'job="kube-event-bridge"' not in rules)
    objects, err = template("--set", "replicaCount=1")
    check("helm template with one replica: no PodDisruptionBudget (it would block drains)",
          objects is not None and not find(objects, "PodDisruptionBudget"), err)


def main():
    for directory in [ROOT / "deploy" / "base", *sorted((ROOT / "deploy" / "overlays").iterdir())]:
        check_kustomization(directory)
    check_chart()
    for rules in sorted((ROOT / "deploy" / "alerts").glob("*.rules.yml")):
        run = subprocess.run(["promtool", "check", "rules", str(rules)], capture_output=True, text=True)
        check(f"promtool check rules {rules.relative_to(ROOT)}", run.returncode == 0, (run.stdout + run.stderr).strip())
    run = subprocess.run(["hadolint", str(ROOT / "Dockerfile")], capture_output=True, text=True)
    check("hadolint Dockerfile", run.returncode == 0, (run.stdout + run.stderr).strip())
    passed = sum(1 for _, ok in results if ok)
    failed = len(results) - passed
    print(f"check-deploy: {passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
