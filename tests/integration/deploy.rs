//! The Kubernetes manifests and the image stay in step with the code: the mounted
//! configuration validates, every `WARDEN_SECTION__KEY` a container sets names a real key,
//! every command is a binary the image ships, and container ports, probes and Services agree
//! with the configured listen addresses; every pod is annotated for Prometheus scraping on its
//! metrics port and exports traces to the in-cluster collector.

use std::collections::BTreeSet;

use figment::Figment;
use figment::providers::{Format, Serialized, Toml};
use serde_json::Value;
use warden_config::WardenConfig;

const MANIFESTS: &str = include_str!("../../deploy/k8s/warden.yaml");
const DOCKERFILE: &str = include_str!("../../deploy/Dockerfile");

fn documents() -> Vec<Value> {
    serde_yaml::Deserializer::from_str(MANIFESTS)
        .map(|d| {
            let v: serde_yaml::Value = serde::Deserialize::deserialize(d).expect("a YAML document");
            serde_json::to_value(v).expect("JSON-compatible")
        })
        .filter(|d| !d.is_null())
        .collect()
}

fn config_toml(docs: &[Value]) -> String {
    docs.iter()
        .find(|d| d["kind"] == "ConfigMap" && d["metadata"]["name"] == "warden-config")
        .and_then(|d| d["data"]["warden.toml"].as_str())
        .expect("the warden-config ConfigMap carries warden.toml")
        .to_string()
}

/// A value of the same kind as the default at `section.key`, as TOML.
fn placeholder(defaults: &Value, section: &str, key: &str) -> String {
    match &defaults[section][key] {
        Value::String(_) => "\"postgres://placeholder\"".into(),
        Value::Number(_) => "1000".into(),
        Value::Bool(_) => "true".into(),
        Value::Array(_) => "[]".into(),
        Value::Object(_) => "{}".into(),
        Value::Null => panic!("{section}.{key} is not a configuration key"),
    }
}

#[test]
fn the_manifests_match_the_configuration_and_the_image() {
    let docs = documents();
    let toml = config_toml(&docs);
    let base = Figment::from(Serialized::defaults(WardenConfig::default())).merge(Toml::string(&toml));
    let config = WardenConfig::from_figment(base.clone()).expect("the mounted warden.toml validates");
    let defaults = serde_json::to_value(WardenConfig::default()).expect("defaults");
    let shipped: BTreeSet<&str> =
        DOCKERFILE.split_whitespace().filter_map(|w| w.strip_prefix("target/release/")).collect();
    let listen = |binary: &str| -> u16 {
        let addr = match binary {
            "warden-ledger" => &config.ledger.listen,
            "warden-policy" => &config.policy.listen,
            "warden-planner" => &config.planner.listen,
            "warden-executor" => &config.executor.listen,
            "warden-tools" => &config.tools.listen,
            other => panic!("{other} is not a Warden service"),
        };
        addr.parse::<std::net::SocketAddr>().expect("listen address").port()
    };

    let deployments: Vec<&Value> = docs.iter().filter(|d| d["kind"] == "Deployment").collect();
    assert_eq!(deployments.len(), 5, "ledger, policy, planner, executor, tools");
    for d in deployments {
        let name = d["metadata"]["name"].as_str().expect("name");
        for c in d["spec"]["template"]["spec"]["containers"].as_array().expect("containers") {
            let binary = c["command"][0].as_str().expect("a command");
            assert!(shipped.contains(binary), "{name}: the image does not ship {binary}");
            assert_eq!(c["command"], serde_json::json!([binary, "--config", "/etc/warden/warden.toml"]));
            let port = listen(binary);
            assert_eq!(c["ports"][0]["containerPort"], port, "{name}: container port");
            assert_eq!(c["readinessProbe"]["grpc"]["port"], port, "{name}: readiness probe");
            assert_eq!(c["livenessProbe"]["grpc"]["port"], port, "{name}: liveness probe");
            observable(name, d, c, &config);
            // Every variable names a real key: apply a value of the right kind and extract.
            for env in c["env"].as_array().into_iter().flatten() {
                let var = env["name"].as_str().expect("env name");
                // OpenTelemetry's own variables (checked above), and the pod name they cite.
                if var.starts_with("OTEL_") || var == "POD_NAME" {
                    continue;
                }
                let (section, key) = var
                    .strip_prefix("WARDEN_")
                    .and_then(|k| k.split_once("__"))
                    .map(|(s, k)| (s.to_lowercase(), k.to_lowercase()))
                    .unwrap_or_else(|| panic!("{name}: {var} is not WARDEN_SECTION__KEY"));
                let value = placeholder(&defaults, &section, &key);
                let with = base.clone().merge(Toml::string(&format!("[{section}]\n{key} = {value}\n")));
                with.extract::<WardenConfig>().unwrap_or_else(|e| panic!("{name}: {var}: {e}"));
            }
        }
        let service = docs
            .iter()
            .find(|s| s["kind"] == "Service" && s["metadata"]["name"] == name)
            .unwrap_or_else(|| panic!("no Service for {name}"));
        let port = listen(d["spec"]["template"]["spec"]["containers"][0]["command"][0].as_str().unwrap_or(""));
        assert_eq!(service["spec"]["ports"][0]["targetPort"], port, "{name}: Service targetPort");
        assert_eq!(service["spec"]["selector"], d["spec"]["selector"]["matchLabels"], "{name}: selector");
    }
    // The endpoints the services call each other on are the Services' names and ports.
    for endpoint in [&config.policy.ledger_endpoint, &config.executor.ledger_endpoint, &config.executor.policy_endpoint]
    {
        let host_port = endpoint.trim_start_matches("http://");
        let (host, port) = host_port.split_once(':').expect("host:port");
        let service = docs
            .iter()
            .find(|s| s["kind"] == "Service" && s["metadata"]["name"] == host)
            .unwrap_or_else(|| panic!("{endpoint}: no Service {host}"));
        assert_eq!(service["spec"]["ports"][0]["port"].to_string(), port, "{endpoint}");
    }
}

/// A pod is seen from outside: Prometheus scrapes the metrics port the configuration serves
/// (annotations and a named container port agree with `telemetry.metrics_listen`), and traces
/// go to the collector with the deployment's service name.
fn observable(name: &str, deployment: &Value, container: &Value, config: &WardenConfig) {
    let metrics: std::net::SocketAddr = config.telemetry.metrics_listen.parse().expect("telemetry.metrics_listen");
    assert!(metrics.ip().is_unspecified(), "{name}: metrics must be reachable from the pod network");
    let annotations = &deployment["spec"]["template"]["metadata"]["annotations"];
    assert_eq!(annotations["prometheus.io/scrape"], "true", "{name}: scrape annotation");
    assert_eq!(annotations["prometheus.io/port"], metrics.port().to_string(), "{name}: scrape port");
    assert_eq!(annotations["prometheus.io/path"], "/metrics", "{name}: scrape path");
    let ports = container["ports"].as_array().expect("ports");
    assert!(
        ports.iter().any(|p| p["name"] == "metrics" && p["containerPort"] == metrics.port()),
        "{name}: a container port named metrics on {}",
        metrics.port()
    );
    let env = |var: &str| {
        container["env"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|e| e["name"] == var)
            .and_then(|e| e["value"].as_str())
            .unwrap_or_else(|| panic!("{name}: {var} is not set"))
            .to_string()
    };
    let endpoint = env("OTEL_EXPORTER_OTLP_ENDPOINT");
    assert!(endpoint.starts_with("http://") || endpoint.starts_with("https://"), "{name}: {endpoint}");
    assert!(matches!(env("OTEL_EXPORTER_OTLP_PROTOCOL").as_str(), "grpc" | "http/protobuf"), "{name}: protocol");
    assert_eq!(env("OTEL_SERVICE_NAME"), name, "{name}: service name");
    let attributes = env("OTEL_RESOURCE_ATTRIBUTES");
    assert!(
        attributes.split(',').all(|kv| kv.split_once('=').is_some_and(|(k, v)| !k.is_empty() && !v.is_empty())),
        "{name}: OTEL_RESOURCE_ATTRIBUTES is key=value pairs: {attributes}"
    );
    if attributes.contains("$(POD_NAME)") {
        assert!(
            container["env"].as_array().into_iter().flatten().any(|e| e["name"] == "POD_NAME"),
            "{name}: POD_NAME is cited but not defined"
        );
    }
}

#[test]
fn the_shipped_cedar_policies_validate() {
    let docs = documents();
    let policies = docs
        .iter()
        .find(|d| d["kind"] == "ConfigMap" && d["metadata"]["name"] == "warden-policies")
        .expect("the warden-policies ConfigMap");
    let dir = tempfile::tempdir().expect("dir");
    for (file, text) in policies["data"].as_object().expect("files") {
        std::fs::write(dir.path().join(file), text.as_str().expect("text")).expect("write");
    }
    let warden = warden_testkit::mesh::bin_dir().expect("binaries").join("warden");
    let out = std::process::Command::new(warden).args(["policy", "validate"]).arg(dir.path()).output().expect("run");
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && said.starts_with("valid"), "{said}{}", String::from_utf8_lossy(&out.stderr));
}
