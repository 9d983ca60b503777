"""The deployment files, checked offline: prints `deploy: N passed, M failed` and exits 1 on a failure.

- every kustomization under deploy/kubernetes renders with `kubectl kustomize`, and every rendered object
  of a built-in kind validates against the Kubernetes schemas (kubernetes-validate, strict: an unknown or
  misspelled field fails); ServiceMonitor and PrometheusRule are checked against what they must say;
- the base's rules and the PrometheusRule are the same as examples/config and deploy/monitoring/alerts.yaml;
  the base and the overlays hold no Prometheus Operator kind (deploy/kubernetes/monitoring has them);
- deploy/envoy/token-budget.yaml is an Envoy Bootstrap that checks each budget of examples/config/ai.yaml
  before the request (hits_addend 0) and reports the tokens from dynamic metadata after it
  (apply_on_stream_done), on rules that count over their limit;
- the Deployment matches the drain, probe and security expectations of deploy/README.md;
- deploy/envoy/envoy.yaml parses into Envoy's own Bootstrap message and deploy/istio's patches into the
  filter and virtual host messages (PyPI xds-protos), so a misspelled field fails;
- deploy/envoy/rlqs.yaml parses into a Bootstrap with the rate limit quota filter and its bucket matchers,
  points at the ratelimitd cluster over HTTP/2, and every bucket it builds names a key the edge rules have at
  their top level (so ratelimitd matches it to a rule), with a behaviour before and after an assignment;
- deploy/envoy-gateway: the built-in objects validate, Envoy Gateway's configuration (in the ConfigMap and in
  the Helm values) names an image and the Redis that redis.yaml serves, and the BackendTrafficPolicy is a
  global limit Envoy Gateway accepts;
- the Dockerfile copies only files that exist and the .dockerignore lets through, runs as non-root,
  exposes the default ports and has the binary where Envoy Gateway starts it.
"""

import fnmatch
import os
import subprocess
import sys

import kubernetes_validate
import yaml
from google.protobuf import json_format

# Message types that `@type` fields of the Envoy files name, registered by importing them.
from envoy.config.bootstrap.v3 import bootstrap_pb2
from envoy.config.route.v3 import route_components_pb2
from envoy.extensions.filters.http.lua.v3 import lua_pb2
from envoy.extensions.filters.http.ratelimit.v3 import rate_limit_pb2 as http_ratelimit_pb2
from envoy.extensions.filters.http.rate_limit_quota.v3 import rate_limit_quota_pb2
from envoy.extensions.filters.http.router.v3 import router_pb2  # noqa: F401
from envoy.extensions.filters.network.http_connection_manager.v3 import (  # noqa: F401
    http_connection_manager_pb2,
)
from envoy.extensions.upstreams.http.v3 import http_protocol_options_pb2
from envoy.type.matcher.v3 import http_inputs_pb2  # noqa: F401

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from tally import Tally  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KUBERNETES_VERSION = "1.30"
KUSTOMIZATIONS = [
    "deploy/kubernetes/base",
    "deploy/kubernetes/overlays/redis-standalone",
    "deploy/kubernetes/overlays/redis-sentinel",
    "deploy/kubernetes/overlays/redis-sentinel/example-redis",
    "deploy/kubernetes/overlays/redis-cluster",
    "deploy/kubernetes/overlays/redis-cluster/example-redis",
    "deploy/kubernetes/monitoring",
]

check = Tally("deploy")


def path(*parts):
    return os.path.join(ROOT, *parts)


def render(kustomization):
    out = subprocess.run(
        ["kubectl", "kustomize", path(kustomization)], capture_output=True, text=True
    )
    if out.returncode != 0:
        check(f"{kustomization} renders", False, out.stderr.strip())
        return []
    check(f"{kustomization} renders", True)
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def container(objects, deployment="ratelimitd"):
    for o in objects:
        if o["kind"] == "Deployment" and o["metadata"]["name"] == deployment:
            return o, o["spec"]["template"]["spec"]["containers"][0]
    return None, None


def env_of(c):
    return {e["name"]: e for e in c.get("env", [])}


def kubernetes():
    rendered = {k: render(k) for k in KUSTOMIZATIONS}
    for k, objects in rendered.items():
        check(f"{k} has objects", len(objects) > 0, "nothing rendered")
        for o in objects:
            name = f"{k}: {o.get('kind')}/{o.get('metadata', {}).get('name')}"
            if o["kind"] == "ServiceMonitor":
                ep = o["spec"]["endpoints"][0]
                check(name, ep["port"] == "http" and ep["path"] == "/metrics", str(ep))
                continue
            if o["kind"] == "PrometheusRule":
                alerts = yaml.safe_load(open(path("deploy/monitoring/alerts.yaml")))
                check(f"{name} equals deploy/monitoring/alerts.yaml", o["spec"] == alerts)
                continue
            try:
                kubernetes_validate.validate(o, KUBERNETES_VERSION, strict=True)
                check(name, True)
            except kubernetes_validate.ValidationError as err:
                check(name, False, f"{'.'.join(str(p) for p in err.path)}: {err.message}")
            except Exception as err:  # an unknown kind or version: no schema
                check(name, False, repr(err))
            # Secrets come from Secrets: no credential in a ConfigMap or a plain env value.
            for c in o.get("spec", {}).get("template", {}).get("spec", {}).get("containers", []):
                for e in c.get("env", []):
                    if e["name"] in ("REDIS_AUTH", "RATELIMITD_HASH_SECRET"):
                        check(f"{name} {e['name']} from a Secret", "secretKeyRef" in e.get("valueFrom", {}), str(e))

    base = rendered["deploy/kubernetes/base"]
    deployment, c = container(base)
    spec = deployment["spec"]["template"]["spec"]
    env = env_of(c)
    check("3 replicas", deployment["spec"]["replicas"] == 3)
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        p = c.get(probe, {}).get("grpc", {})
        check(f"{probe} on the ratelimit gRPC health service", p == {"port": 8081, "service": "ratelimit"}, str(p))
    check("reload-friendly rules mount", env["RUNTIME_WATCH_ROOT"]["value"] == "false"
          and env["RUNTIME_IGNOREDOTFILES"]["value"] == "true")
    mount = c["volumeMounts"][0]["mountPath"]
    expected = "/".join(env[v]["value"] for v in ("RUNTIME_ROOT", "RUNTIME_SUBDIRECTORY", "RUNTIME_APPDIRECTORY"))
    check("rules mounted where RUNTIME_* points", mount == expected, f"{mount} != {expected}")
    drain = int(env["RATELIMITD_SHUTDOWN__DRAIN_DELAY"]["value"].rstrip("s"))
    grace = int(env["RATELIMITD_SHUTDOWN__GRACE_PERIOD"]["value"].rstrip("s"))
    pre_stop = c["lifecycle"]["preStop"]["sleep"]["seconds"]
    check("termination grace covers preStop + drain + grace",
          spec["terminationGracePeriodSeconds"] > pre_stop + drain + grace,
          f"{spec['terminationGracePeriodSeconds']} <= {pre_stop} + {drain} + {grace}")
    check("drain outlasts a readiness period", drain >= c["readinessProbe"]["periodSeconds"])
    sc = c["securityContext"]
    check("read-only root, no privilege escalation", sc["readOnlyRootFilesystem"] and not sc["allowPrivilegeEscalation"])
    check("non-root pod", spec["securityContext"]["runAsNonRoot"] is True)
    check("spread across nodes", any(t["topologyKey"] == "kubernetes.io/hostname" for t in spec["topologySpreadConstraints"]))
    services = {o["metadata"]["name"]: o for o in base if o["kind"] == "Service"}
    service = services["ratelimitd"]
    ports = {p["name"]: p for p in service["spec"]["ports"]}
    check("Service grpc 8081 appProtocol grpc", ports["grpc"]["port"] == 8081 and ports["grpc"]["appProtocol"] == "grpc")
    check("Service http 8080", ports["http"]["port"] == 8080)
    # Envoy's STRICT_DNS clusters need every replica's address: a headless Service over the same pods,
    # which deploy/envoy's files name.
    headless = services.get("ratelimitd-headless", {}).get("spec", {})
    check("headless Service over the Deployment's pods", headless.get("clusterIP") == "None"
          and headless.get("selector") == deployment["spec"]["selector"]["matchLabels"]
          and any(p["port"] == 8081 for p in headless.get("ports", [])), str(headless))
    for name in ("envoy.yaml", "rlqs.yaml"):
        text = open(path("deploy/envoy", name)).read()
        check(f"deploy/envoy/{name} names the headless Service", "ratelimitd-headless.<namespace>.svc.cluster.local" in text)
    kinds = {o["kind"] for o in base}
    for kind in ("HorizontalPodAutoscaler", "PodDisruptionBudget", "NetworkPolicy", "ConfigMap"):
        check(f"base has a {kind}", kind in kinds)
    # The base and the overlays hold built-in kinds only (each validated above against the Kubernetes
    # schemas): they apply on a cluster without the Prometheus Operator, whose kinds are apart.
    for k, objects in rendered.items():
        operator_kinds = {o["kind"] for o in objects} & {"ServiceMonitor", "PrometheusRule"}
        if k != "deploy/kubernetes/monitoring":
            check(f"{k} needs no Prometheus Operator", not operator_kinds, str(operator_kinds))
    monitoring = {o["kind"] for o in rendered["deploy/kubernetes/monitoring"]}
    check("monitoring has the ServiceMonitor and the PrometheusRule", monitoring == {"ServiceMonitor", "PrometheusRule"}, str(monitoring))
    rules = next(o for o in base if o["kind"] == "ConfigMap")
    for name in sorted(os.listdir(path("examples/config"))):
        check(f"ConfigMap {name} equals examples/config/{name}", rules["data"].get(name) == open(path("examples/config", name)).read())

    for overlay, topology in (("redis-standalone", None), ("redis-sentinel", "sentinel"), ("redis-cluster", "cluster")):
        _, c = container(rendered[f"deploy/kubernetes/overlays/{overlay}"])
        env = env_of(c)
        check(f"{overlay} sets REDIS_URL", "REDIS_URL" in env)
        check(f"{overlay} REDIS_TYPE", env.get("REDIS_TYPE", {}).get("value") == topology, str(env.get("REDIS_TYPE")))
        check(f"{overlay} keeps the base's settings", "RUNTIME_ROOT" in env)


def parse(message, value, name):
    try:
        json_format.ParseDict(value, message)
        check(name, True)
    except json_format.ParseError as err:
        check(name, False, str(err))
        return None
    return message


def token_budget():
    name = "deploy/envoy/token-budget.yaml"
    config = yaml.safe_load(open(path(name)))
    bootstrap = parse(bootstrap_pb2.Bootstrap(), config, f"{name} is an Envoy Bootstrap")
    if bootstrap is None:
        return
    hcm = http_connection_manager_pb2.HttpConnectionManager()
    bootstrap.static_resources.listeners[0].filter_chains[0].filters[0].typed_config.Unpack(hcm)
    filters = [f.name for f in hcm.http_filters]
    check("token budget: Lua writes the usage before the rate limit filter reads it",
          filters == ["envoy.filters.http.lua", "envoy.filters.http.ratelimit", "envoy.filters.http.router"], str(filters))
    lua = lua_pb2.Lua()
    hcm.http_filters[0].typed_config.Unpack(lua)
    ratelimit = http_ratelimit_pb2.RateLimit()
    hcm.http_filters[1].typed_config.Unpack(ratelimit)
    check("token budget: domain ai", ratelimit.domain == "ai")

    def shape(limit):
        return [a.request_headers.descriptor_key for a in limit.actions]

    limits = hcm.route_config.virtual_hosts[0].routes[0].route.rate_limits
    checks = [shape(l) for l in limits
              if not l.apply_on_stream_done and l.hits_addend.HasField("number") and l.hits_addend.number.value == 0]
    reports = [(shape(l), l.hits_addend.format) for l in limits if l.apply_on_stream_done]
    check("token budget: a check before the request for every report after it",
          len(reports) > 0 and sorted(checks) == sorted(s for s, _ in reports), f"{checks} / {reports}")
    for s, fmt in reports:
        check(f"token budget: the report of {s} counts the tokens from dynamic metadata",
              fmt == "%DYNAMIC_METADATA(ratelimitd.usage:total_tokens)%", fmt)
    check("token budget: the Lua filter writes what the reports read",
          'dynamicMetadata():set("ratelimitd.usage", "total_tokens"' in lua.default_source_code.inline_string)

    rules = yaml.safe_load(open(path("examples/config/ai.yaml")))
    check("token budget: the rules are domain ai", rules["domain"] == "ai")

    def rule(nodes, keys):
        node = next((n for n in nodes if n["key"] == keys[0]), None)
        if node is None or len(keys) == 1:
            return node
        return rule(node.get("descriptors", []), keys[1:])

    for s, _ in reports:
        node = rule(rules["descriptors"], s)
        written = ([node["rate_limit"]] if node and "rate_limit" in node else []) + (node or {}).get("rate_limits", [])
        check(f"token budget: every limit of {s} counts over its limit",
              len(written) > 0 and all(l.get("count_over_limit") is True for l in written), str(written))


def envoy():
    config = yaml.safe_load(open(path("deploy/envoy/envoy.yaml")))
    bootstrap = parse(bootstrap_pb2.Bootstrap(), config, "deploy/envoy/envoy.yaml is an Envoy Bootstrap")
    if bootstrap is None:
        return
    listener = bootstrap.static_resources.listeners[0]
    hcm = http_connection_manager_pb2.HttpConnectionManager()
    listener.filter_chains[0].filters[0].typed_config.Unpack(hcm)
    ratelimit = http_ratelimit_pb2.RateLimit()
    hcm.http_filters[0].typed_config.Unpack(ratelimit)
    check("envoy: ratelimit filter before the router", hcm.http_filters[-1].name == "envoy.filters.http.router")
    check("envoy: domain edge", ratelimit.domain == "edge")
    check("envoy: fails open", ratelimit.failure_mode_deny is False)
    check("envoy: X-RateLimit headers", ratelimit.enable_x_ratelimit_headers == http_ratelimit_pb2.RateLimit.DRAFT_VERSION_03)
    check("envoy: a timeout", ratelimit.timeout.ToMilliseconds() > 0)
    cluster = ratelimit.rate_limit_service.grpc_service.envoy_grpc.cluster_name
    check("envoy: the gRPC cluster exists", cluster in [c.name for c in bootstrap.static_resources.clusters])
    keys = set()
    for limit in hcm.route_config.virtual_hosts[0].rate_limits:
        for action in limit.actions:
            kind = action.WhichOneof("action_specifier")
            keys.add(action.request_headers.descriptor_key if kind == "request_headers" else kind)
    check("envoy: actions for every key of the edge rules",
          keys >= {"generic_key", "remote_address", "api_key", "path", "method"}, str(keys))

    for doc in yaml.safe_load_all(open(path("deploy/istio/ratelimit-envoyfilter.yaml"))):
        name = f"istio {doc['metadata']['name']}"
        check(f"{name} is an EnvoyFilter", doc["apiVersion"] == "networking.istio.io/v1alpha3" and doc["kind"] == "EnvoyFilter")
        for patch in doc["spec"]["configPatches"]:
            value = patch["patch"]["value"]
            if patch["applyTo"] == "HTTP_FILTER":
                typed = dict(value["typed_config"])
                typed.pop("@type")
                parse(http_ratelimit_pb2.RateLimit(), typed, f"{name}: filter config is a RateLimit")
            elif patch["applyTo"] == "VIRTUAL_HOST":
                parse(route_components_pb2.VirtualHost(), value, f"{name}: patch is a VirtualHost")
            else:
                check(name, False, f"unexpected applyTo {patch['applyTo']}")


def envoy_rlqs():
    name = "deploy/envoy/rlqs.yaml"
    bootstrap = parse(bootstrap_pb2.Bootstrap(), yaml.safe_load(open(path(name))), f"{name} is an Envoy Bootstrap")
    if bootstrap is None:
        return
    hcm = http_connection_manager_pb2.HttpConnectionManager()
    bootstrap.static_resources.listeners[0].filter_chains[0].filters[0].typed_config.Unpack(hcm)
    quota = rate_limit_quota_pb2.RateLimitQuotaFilterConfig()
    check("rlqs: the first filter is the rate limit quota filter",
          hcm.http_filters[0].typed_config.Unpack(quota), hcm.http_filters[0].typed_config.type_url)
    check("rlqs: router last", hcm.http_filters[-1].name == "envoy.filters.http.router")
    check("rlqs: domain edge", quota.domain == "edge")
    clusters = {c.name: c for c in bootstrap.static_resources.clusters}
    cluster = quota.rlqs_server.envoy_grpc.cluster_name
    check("rlqs: the quota server's cluster exists", cluster in clusters, cluster)
    if cluster in clusters:
        options = http_protocol_options_pb2.HttpProtocolOptions()
        typed = clusters[cluster].typed_extension_protocol_options["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
        check("rlqs: HTTP/2 to ratelimitd", typed.Unpack(options) and options.explicit_http_config.HasField("http2_protocol_options"))
        port = clusters[cluster].load_assignment.endpoints[0].lb_endpoints[0].endpoint.address.socket_address.port_value
        check("rlqs: ratelimitd's gRPC port", port == 8081, str(port))

    matchers = quota.bucket_matchers
    actions = [m.on_match.action for m in matchers.matcher_list.matchers] + [matchers.on_no_match.action]
    edge = yaml.safe_load(open(path("examples/config/edge.yaml")))
    top = {d["key"] for d in edge["descriptors"]}
    built = set()
    for action in actions:
        settings = rate_limit_quota_pb2.RateLimitQuotaBucketSettings()
        unpacked = action.typed_config.Unpack(settings)
        check(f"rlqs: bucket {action.name} has bucket settings", unpacked, action.typed_config.type_url)
        if not unpacked:
            continue
        keys = set(settings.bucket_id_builder.bucket_id_builder)
        built |= keys
        check(f"rlqs: bucket {action.name} has keys of the edge rules", keys and keys <= top, f"{keys} not in {top}")
        check(f"rlqs: bucket {action.name} behaves before its first assignment",
              settings.no_assignment_behavior.HasField("fallback_rate_limit"))
        # A newcomer may wait a report period or two for a share while the pool is handed out: its
        # fallback must limit it, not admit everything.
        fallback = settings.no_assignment_behavior.fallback_rate_limit
        check(f"rlqs: bucket {action.name} falls back to a token bucket, not ALLOW_ALL",
              fallback.HasField("token_bucket") and fallback.token_bucket.HasField("tokens_per_fill")
              and fallback.token_bucket.fill_interval.ToSeconds() >= 1, str(fallback))
        check(f"rlqs: bucket {action.name} behaves when its assignment expires",
              settings.HasField("expired_assignment_behavior"))
        check(f"rlqs: bucket {action.name} reports every 5 s (the period Envoy uses)",
              settings.reporting_interval.ToSeconds() == 5, str(settings.reporting_interval))
    check("rlqs: buckets for the global, search and API key rules", built >= {"generic_key", "path", "api_key"}, str(built))


def validate(o, name):
    try:
        kubernetes_validate.validate(o, KUBERNETES_VERSION, strict=True)
        check(name, True)
    except kubernetes_validate.ValidationError as err:
        check(name, False, f"{'.'.join(str(p) for p in err.path)}: {err.message}")


def envoy_gateway():
    base = "deploy/envoy-gateway"
    redis = [d for d in yaml.safe_load_all(open(path(base, "redis.yaml"))) if d]
    for o in redis:
        validate(o, f"{base}/redis.yaml: {o['kind']}/{o['metadata']['name']}")
    service = next(o for o in redis if o["kind"] == "Service")
    redis_url = f"{service['metadata']['name']}.{service['metadata']['namespace']}.svc.cluster.local:{service['spec']['ports'][0]['port']}"

    def gateway_config(config, name):
        check(f"{name}: an EnvoyGateway", config.get("apiVersion") == "gateway.envoyproxy.io/v1alpha1"
              and config.get("kind") == "EnvoyGateway", str(config.get("kind")))
        backend = config.get("rateLimit", {}).get("backend", {})
        check(f"{name}: counts in the Redis of redis.yaml", backend.get("type") == "Redis"
              and backend.get("redis", {}).get("url") == redis_url, str(backend))
        return config

    (configmap,) = [d for d in yaml.safe_load_all(open(path(base, "envoy-gateway-config.yaml"))) if d]
    validate(configmap, f"{base}/envoy-gateway-config.yaml: ConfigMap")
    check("envoy-gateway-config in Envoy Gateway's namespace",
          configmap["metadata"] == {"name": "envoy-gateway-config", "namespace": "envoy-gateway-system"})
    config = gateway_config(yaml.safe_load(configmap["data"]["envoy-gateway.yaml"]), "envoy-gateway-config.yaml")
    image = config.get("provider", {}).get("kubernetes", {}).get("rateLimitDeployment", {}).get("container", {}).get("image", "")
    check("envoy-gateway-config.yaml: a ratelimitd image", "ratelimitd" in image, image)

    values = yaml.safe_load(open(path(base, "values.yaml")))
    image = values.get("ratelimit", {}).get("image", {})
    check("values.yaml: the ratelimitd image", set(image) == {"registry", "repository", "tag"}
          and "ratelimitd" in image["repository"], str(image))
    backend = values.get("config", {}).get("envoyGateway", {}).get("rateLimit", {}).get("backend", {})
    check("values.yaml: counts in the Redis of redis.yaml", backend.get("redis", {}).get("url") == redis_url, str(backend))

    (policy,) = [d for d in yaml.safe_load_all(open(path(base, "backend-traffic-policy.yaml"))) if d]
    check("backend-traffic-policy.yaml: a BackendTrafficPolicy", policy["apiVersion"] == "gateway.envoyproxy.io/v1alpha1"
          and policy["kind"] == "BackendTrafficPolicy")
    limit = policy["spec"]["rateLimit"]
    check("backend-traffic-policy.yaml: a global limit", limit["type"] == "Global" and set(limit) == {"type", "global"})
    for rule in limit["global"]["rules"]:
        check("backend-traffic-policy.yaml: each rule a limit per unit",
              isinstance(rule["limit"]["requests"], int)
              and rule["limit"]["unit"] in ("Second", "Minute", "Hour", "Day", "Month", "Year"), str(rule))


def dockerfile():
    lines = open(path("Dockerfile")).read().splitlines()
    ignore = [l.strip() for l in open(path(".dockerignore")) if l.strip() and not l.startswith("#")]

    def shipped(p):
        # The .dockerignore here excludes everything, then lets listed paths through.
        allowed = [pat[1:].rstrip("/") for pat in ignore if pat.startswith("!")]
        return any(p == a or p.startswith(a + "/") or fnmatch.fnmatch(p, a) for a in allowed)

    stage = 0
    for line in lines:
        words = line.split()
        if not words or words[0].startswith("#"):
            continue
        if words[0] == "FROM":
            stage += 1
        if words[0] == "COPY" and not any(w.startswith("--from") for w in words):
            for src in words[1:-1]:
                check(f"Dockerfile COPY {src} exists", os.path.exists(path(src)))
                check(f"Dockerfile COPY {src} passes .dockerignore", shipped(src.rstrip("/")))
    text = "\n".join(lines)
    check("Dockerfile: multi-stage", stage >= 2)
    check("Dockerfile: non-root user", "USER 65532" in text)
    check("Dockerfile: ports", "EXPOSE 8081 8080" in text)
    check("Dockerfile: the binary at /bin/ratelimit, where Envoy Gateway starts it",
          "COPY --from=build /src/target/release/ratelimitd /bin/ratelimit" in text)
    # The image's default: cwd /srv/ratelimitd with the example rules in ./config, no settings at all.
    check("Dockerfile: example rules in ./config of the working directory",
          "COPY examples/config /srv/ratelimitd/config" in text and "WORKDIR /srv/ratelimitd" in text)


kubernetes()
token_budget()
envoy()
envoy_rlqs()
envoy_gateway()
dockerfile()
sys.exit(check.finish())
