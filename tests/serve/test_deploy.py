"""The deployment files in deploy/: the Kubernetes manifests validate against the Kubernetes
schemas (kubernetes-validate) and agree with the server's configuration; the Prometheus rules pass
`promtool check rules` and their `promtool test rules` file; the Grafana dashboard is well formed
and its queries parse; and a live server's /metrics has every metric the rules, the dashboard and
the autoscaler use."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
import yaml

from leapfrog.serve.config import build_config
from test_server_common import ServerThread

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
PROM = DEPLOY / "prometheus"
RULES = PROM / "rules.yaml"
DASHBOARD = DEPLOY / "grafana" / "leapfrog-dashboard.json"
DOCKERFILES = [DEPLOY / "docker" / "Dockerfile.cpu", DEPLOY / "docker" / "Dockerfile.cuda"]
KUBERNETES_VERSION = "1.30.0"       # one of the versions kubernetes-validate bundles schemas for
MANIFESTS = ["deployment.yaml", "service.yaml", "hpa.yaml"]

# Metric names as PromQL and the dashboard write them. Names from kube-state-metrics and `up` are
# not the server's and are left out.
METRIC_NAME = re.compile(r"leapfrog:[A-Za-z0-9_:]+|process_[a-z_]+")

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool not on PATH (Debian: apt-get install prometheus; scripts/install.sh tries)")


def docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def one(name: str, kind: str) -> dict:
    found = [d for d in docs(K8S / name) if d["kind"] == kind]
    assert len(found) == 1, f"{name}: expected one {kind}"
    return found[0]


def commented_block(path: Path, title: str) -> dict:
    """The YAML between `# BEGIN <title>` and `# END <title>`, uncommented."""
    text = path.read_text()
    m = re.search(rf"^# BEGIN {re.escape(title)}\n(.*?)^# END {re.escape(title)}$", text, re.M | re.S)
    assert m, f"{path.name}: no block {title!r}"
    return yaml.safe_load("\n".join(re.sub(r"^# ?", "", line) for line in m.group(1).splitlines()))


def dashboard_targets() -> list[tuple[str, dict]]:
    d = json.loads(DASHBOARD.read_text())
    return [(p["title"], t) for p in d["panels"] if p["type"] != "row" for t in p["targets"]]


def run(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=120)


# --- Kubernetes ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name", MANIFESTS + ["multinode/statefulset.yaml"])
def test_manifest_validates(name):
    import kubernetes_validate
    for doc in docs(K8S / name):
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)   # raises on any error


def test_multinode_replica_launches_what_the_server_accepts():
    """The multi-node StatefulSet's torchrun command: as many nodes as pods, a group of
    tensor_parallel_size x pipeline_parallel_size processes (what `leapfrog serve` checks under
    torchrun), flags `leapfrog serve` knows, the rendezvous on pod 0 through the headless Service."""
    import shlex
    from leapfrog.serve.main import build_parser
    sts = one("multinode/statefulset.yaml", "StatefulSet")
    cmd = shlex.split(sts["spec"]["template"]["spec"]["containers"][0]["args"][0].replace('"${HOSTNAME##*-}"', "0"))
    assert cmd[:2] == ["exec", "torchrun"]
    opt = lambda name: cmd[cmd.index(name) + 1]  # noqa: E731
    assert int(opt("--nnodes")) == sts["spec"]["replicas"]
    serve = cmd[cmd.index("-m") + 2:]
    args = build_parser().parse_args(serve[1:])
    assert serve[0] == "serve"
    assert args.tensor_parallel_size * args.pipeline_parallel_size == int(opt("--nnodes")) * int(opt("--nproc-per-node"))
    gpus = sts["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
    assert int(gpus) == int(opt("--nproc-per-node"))
    assert opt("--master-addr") == f"{sts['metadata']['name']}-0.{sts['spec']['serviceName']}"


def test_hpa_custom_metric_variant():
    """The commented variant validates once uncommented, and the adapter rule in the comment turns
    the server's gauge into the metric name that variant asks for."""
    import kubernetes_validate
    hpa = commented_block(K8S / "hpa.yaml", "custom-metric HorizontalPodAutoscaler")
    kubernetes_validate.validate(hpa, KUBERNETES_VERSION, strict=True)
    assert hpa["metadata"]["name"] == one("hpa.yaml", "HorizontalPodAutoscaler")["metadata"]["name"]
    pods_metric = next(m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"] if m["type"] == "Pods")

    rule = commented_block(K8S / "hpa.yaml", "prometheus-adapter rule")["rules"][0]
    series = re.match(r"[^{]+", rule["seriesQuery"].strip("'\"")).group(0)
    assert series == "leapfrog:num_requests_waiting"
    renamed = re.sub(rule["name"]["matches"], rule["name"]["as"].replace("${1}", r"\1"), series)
    assert renamed == pods_metric == "leapfrog_num_requests_waiting"


def test_kustomization_lists_the_manifests():
    k = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert k["kind"] == "Kustomization"
    assert sorted(k["resources"]) == sorted(MANIFESTS)
    assert sorted(p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml") == sorted(MANIFESTS)
    if shutil.which("kubectl") is None:
        return
    r = run("kubectl", "kustomize", str(K8S))        # offline: renders, talks to no cluster
    assert r.returncode == 0, r.stderr
    kinds = sorted(d["kind"] for d in yaml.safe_load_all(r.stdout) if d)
    assert kinds == ["Deployment", "HorizontalPodAutoscaler", "Service"]


def test_manifests_agree_with_the_server():
    """Ports, probe paths, the drain time and the LEAPFROG_* examples match what `leapfrog serve`
    does; the Service and the HPA point at the Deployment."""
    dep, svc, hpa = one("deployment.yaml", "Deployment"), one("service.yaml", "Service"), one("hpa.yaml", "HorizontalPodAutoscaler")
    pod = dep["spec"]["template"]
    (c,) = pod["spec"]["containers"]
    env = {e["name"]: e.get("value", "2") for e in c["env"]}   # valueFrom: the CPU limit, 2 cores
    cfg = build_config({}, environ=env)                       # unknown or malformed keys raise
    assert {k for k in env if k.startswith("LEAPFROG_")} >= {"LEAPFROG_SHUTDOWN_TIMEOUT", "LEAPFROG_MAX_BATCH_SIZE"}

    (port,) = c["ports"]
    assert port["containerPort"] == cfg.port == 8080 and port["name"] == "http"
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert c["startupProbe"]["httpGet"]["path"] == "/ready"
    pre_stop = int(c["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert pod["spec"]["terminationGracePeriodSeconds"] > pre_stop + cfg.shutdown_timeout
    assert c["resources"]["requests"]["cpu"] and c["resources"]["limits"]["cpu"]
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(cfg.port)

    labels = pod["metadata"]["labels"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert svc["spec"]["selector"].items() <= labels.items()
    assert svc["spec"]["type"] == "ClusterIP"
    assert svc["spec"]["ports"] == [{"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}]
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": dep["metadata"]["name"]}
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (1, 8)

    uid = pod["spec"]["securityContext"]["runAsUser"]
    for dockerfile in DOCKERFILES:
        assert f"--uid {uid} " in dockerfile.read_text(), f"{dockerfile.name}: user {uid} not created"


def test_dockerfiles():
    """Both images: non-root, port 8080, a HEALTHCHECK on /healthz, `leapfrog serve`, torch pinned
    as scripts/install.sh pins it, and everything they COPY exists and is not .dockerignored."""
    torch_pin = re.search(r'"torch==([0-9.]+)"', (ROOT / "scripts" / "install.sh").read_text()).group(1)
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    assert {".git", ".venv", "bench_results"} <= ignored
    for dockerfile in DOCKERFILES:
        text = dockerfile.read_text()
        assert re.search(r"^USER (?!root|0\b)\S+", text, re.M), dockerfile.name
        assert re.search(r"^EXPOSE 8080$", text, re.M), dockerfile.name
        assert re.search(r"^HEALTHCHECK .*\n(.*\\\n)*.*/healthz", text, re.M), dockerfile.name
        assert 'CMD ["leapfrog", "serve"]' in text, dockerfile.name
        assert f"ARG TORCH_VERSION={torch_pin}" in text, dockerfile.name
        for line in re.findall(r"^COPY (.+)$", text, re.M):
            for src in line.split()[:-1]:
                assert (ROOT / src).exists(), f"{dockerfile.name}: COPY {src}: no such path"
                assert src not in ignored, f"{dockerfile.name}: COPY {src} but .dockerignore drops it"
    assert "download.pytorch.org/whl/cpu" in DOCKERFILES[0].read_text()
    assert "FROM python:3.11-slim" in DOCKERFILES[0].read_text()
    assert re.search(r"^ARG CUDA_IMAGE=nvidia/cuda:\S+-runtime-", DOCKERFILES[1].read_text(), re.M)


# --- Prometheus ---------------------------------------------------------------------------------
def test_rules_are_complete():
    """Every alert waits (`for:`), has a severity and says what is wrong."""
    groups = yaml.safe_load(RULES.read_text())["groups"]
    assert [g["name"] for g in groups] == ["leapfrog"]
    alerts = groups[0]["rules"]
    assert len(alerts) >= 5
    for a in alerts:
        assert "alert" in a and a.get("for"), a
        assert a["labels"]["severity"] in ("warning", "critical"), a["alert"]
        assert a["annotations"]["summary"] and a["annotations"]["description"], a["alert"]
    exprs = " ".join(a["expr"] for a in alerts)
    for needed in ("leapfrog:e2e_request_latency_seconds_bucket", "leapfrog:request_success_total",
                   "leapfrog:http_requests_rejected_total", "leapfrog:kv_cache_usage_perc",
                   "leapfrog:num_requests_waiting", 'up{job="leapfrog"}',
                   "kube_deployment_status_replicas_unavailable"):
        assert needed in exprs, needed
    # every alert is exercised by the promtool test file
    tested = set(re.findall(r"alertname: (\w+)", (PROM / "rules_test.yaml").read_text()))
    assert tested == {a["alert"] for a in alerts}


@needs_promtool
def test_promtool_check_rules():
    r = run(PROMTOOL, "check", "rules", str(RULES))
    assert r.returncode == 0, r.stdout + r.stderr


@needs_promtool
def test_promtool_test_rules():
    r = run(PROMTOOL, "test", "rules", "rules_test.yaml", cwd=PROM)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout


@needs_promtool
def test_promtool_check_scrape_config(tmp_path):
    """scrape.yaml as it is; Debian's promtool is built without Kubernetes service discovery, and
    there the rest of the file is checked with static targets in its place."""
    r = run(PROMTOOL, "check", "config", str(PROM / "scrape.yaml"))
    if "kubernetes_sd_configs not found" in r.stdout + r.stderr:
        config = yaml.safe_load((PROM / "scrape.yaml").read_text())
        for job in config["scrape_configs"]:
            if job.pop("kubernetes_sd_configs", None) is not None:
                job["static_configs"] = [{"targets": ["127.0.0.1:8080"]}]
        config["rule_files"] = [str(PROM / f) for f in config["rule_files"]]
        (tmp_path / "scrape.yaml").write_text(yaml.safe_dump(config))
        r = run(PROMTOOL, "check", "config", str(tmp_path / "scrape.yaml"))
    assert r.returncode == 0, r.stdout + r.stderr
    jobs = {j["job_name"] for j in yaml.safe_load((PROM / "scrape.yaml").read_text())["scrape_configs"]}
    assert "leapfrog" in jobs           # the rules select job="leapfrog"


@needs_promtool
def test_dashboard_queries_parse(tmp_path):
    """Each dashboard query, with Grafana's variables filled in, is valid PromQL (checked by
    promtool as the expression of a recording rule)."""
    rules = []
    for i, (title, t) in enumerate(dashboard_targets()):
        expr = t["expr"].replace("$__rate_interval", "5m").replace("$model_name", ".*")
        assert "$" not in expr, f"{title}: unknown variable in {expr}"
        rules.append({"record": f"dashboard:query_{i}", "expr": expr})
    path = tmp_path / "dashboard_rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    r = run(PROMTOOL, "check", "rules", str(path))
    assert r.returncode == 0, r.stdout + r.stderr


# --- Grafana ------------------------------------------------------------------------------------
def test_dashboard_structure():
    d = json.loads(DASHBOARD.read_text())
    assert d["uid"] and d["title"] and 36 <= d["schemaVersion"] <= 41
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert variables["model_name"]["type"] == "query" and "model_name" in variables["model_name"]["definition"]

    panels = [p for p in d["panels"] if p["type"] != "row"]      # rows only lay the panels out
    assert len(panels) >= 10
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    for p in panels:
        assert p["targets"], f"panel {p['title']!r} has no targets"
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        assert {"h", "w", "x", "y"} <= p["gridPos"].keys() and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
        for t in p["targets"]:
            assert t["expr"].strip() and t["refId"], p["title"]
            if "leapfrog:" in t["expr"]:
                assert 'model_name=~"$model_name"' in t["expr"], f"{p['title']}: ignores the model_name variable"
    exprs = " ".join(t["expr"] for _, t in dashboard_targets())
    for needed in ("leapfrog:request_success_total", "leapfrog:time_to_first_token_seconds_bucket",
                   "leapfrog:time_per_output_token_seconds_bucket", "leapfrog:e2e_request_latency_seconds_bucket",
                   "leapfrog:request_tokens_per_forward", "leapfrog:num_requests_running",
                   "leapfrog:num_requests_waiting", "leapfrog:kv_cache_usage_perc",
                   "leapfrog:prefix_cache_hits_total", "leapfrog:prefix_cache_queries_total",
                   "leapfrog:generation_tokens_total", "leapfrog:http_requests_rejected_total",
                   "process_resident_memory_bytes"):
        assert needed in exprs, needed


# --- against a live server ----------------------------------------------------------------------
KEY = "deploy-test-key"


@pytest.fixture(scope="module")
def server(llama_dir):
    # With an API key, a request without it is rejected: the labelled rejection counter then has a
    # sample (a family nobody has incremented yet is written without any).
    s = ServerThread(llama_dir, api_key=[KEY]).start()
    yield s
    s.stop()


def referenced_metrics() -> dict[str, set[str]]:
    """Metric name -> the files that use it."""
    out: dict[str, set[str]] = {}
    for path in (RULES, DASHBOARD, K8S / "hpa.yaml"):
        for name in METRIC_NAME.findall(path.read_text()):
            out.setdefault(name, set()).add(path.name)
    return out


def test_live_metrics_have_every_referenced_name(server):
    auth = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(server.url + "/v1/completions", headers=auth, timeout=60,
                   json={"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    assert httpx.get(server.url + "/v1/models").status_code == 401

    text = httpx.get(server.url + "/metrics", headers=auth).text
    samples: dict[str, list[str]] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name = re.match(r"[^{\s]+", line).group(0)
            samples.setdefault(name, []).append(line)
    # the request left samples in the histograms and the labelled counters
    e2e_count = samples["leapfrog:e2e_request_latency_seconds_count"][0]
    assert float(e2e_count.rsplit(" ", 1)[1]) >= 1
    assert any('finished_reason="length"' in s for s in samples["leapfrog:request_success_total"])
    # turned away before naming a model: counted under no model's name, not the first one's
    assert any('model_name="",reason="unauthorized"' in s for s in samples["leapfrog:http_requests_rejected_total"])

    used = referenced_metrics()
    assert len(used) >= 10 and "process_resident_memory_bytes" in used
    # exact names: PromQL selects the series as exposed (counters with _total, histograms by
    # _bucket / _sum / _count)
    missing = {name: sorted(files) for name, files in used.items() if name not in samples}
    assert not missing, f"not in /metrics: {missing}"
    # and the labels the rules and the dashboard group by
    for label in ("model_name", "finished_reason", "reason", "le"):
        assert f'{label}="' in text, label
