//! The tool catalog: which configured tool host serves which tool, with its declaration.
//! Fetched from every host's `ListTools` and cached briefly, so a restarted host is seen.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::Mutex;
use tonic::Status;
use warden_proto::v1 as pb;
use warden_proto::v1::tool_host_client::ToolHostClient;

const TTL: Duration = Duration::from_secs(5);

/// A tool as the catalog knows it: its declaration and the index of its host.
#[derive(Debug, Clone)]
pub struct CatalogEntry {
    pub spec: pb::ToolSpec,
    pub host: usize,
    /// [`declaration_sha256`] of `spec`, computed once per listing.
    pub declaration_sha256: String,
}

pub type Tools = Arc<HashMap<String, CatalogEntry>>;

#[derive(Clone)]
pub struct ToolCatalog {
    hosts: Vec<ToolHostClient<crate::auth::Ch>>,
    cached: Arc<Mutex<Option<(Instant, Tools)>>>,
}

impl ToolCatalog {
    pub fn new(endpoints: &[String]) -> Result<ToolCatalog, Status> {
        let hosts = endpoints
            .iter()
            .map(|e| Ok(ToolHostClient::new(crate::channel(e)?).max_decoding_message_size(crate::MAX_MESSAGE_BYTES)))
            .collect::<Result<_, Status>>()?;
        Ok(ToolCatalog { hosts, cached: Default::default() })
    }

    /// The current catalog; the first host to declare a name serves it. A host that does
    /// not answer keeps the tools it declared last time, so one host down does not take
    /// every other host's tools with it; with no answer and nothing cached, UNAVAILABLE.
    pub async fn tools(&self) -> Result<Tools, Status> {
        let previous = {
            let cached = self.cached.lock().await;
            match cached.as_ref() {
                Some((at, tools)) if at.elapsed() < TTL => return Ok(tools.clone()),
                Some((_, tools)) => Some(tools.clone()),
                None => None,
            }
        };
        let mut tools = HashMap::new();
        let mut failures = Vec::new();
        for (i, host) in self.hosts.iter().enumerate() {
            match host.clone().list_tools(pb::ListToolsRequest::default()).await {
                Ok(listed) => {
                    for spec in listed.into_inner().tools {
                        tools.entry(spec.name.clone()).or_insert_with(|| CatalogEntry {
                            declaration_sha256: declaration_sha256(&spec),
                            spec,
                            host: i,
                        });
                    }
                }
                Err(s) => {
                    tracing::warn!(host = i, error = %s, "tool host did not list its tools");
                    if let Some(prev) = &previous {
                        for (name, e) in prev.iter().filter(|(_, e)| e.host == i) {
                            tools.entry(name.clone()).or_insert_with(|| e.clone());
                        }
                    }
                    failures.push(s.message().to_string());
                }
            }
        }
        if failures.len() == self.hosts.len() && tools.is_empty() {
            return Err(Status::unavailable(format!("tool catalog unavailable: {}", failures.join("; "))));
        }
        let tools = Arc::new(tools);
        *self.cached.lock().await = Some((Instant::now(), tools.clone()));
        Ok(tools)
    }

    /// A client for host `i`.
    pub fn host(&self, i: usize) -> ToolHostClient<crate::auth::Ch> {
        self.hosts[i].clone()
    }
}

/// A tool's effect class by name: the declared one, else what the older flags say
/// (consequential, else read-only, else mutating).
pub fn effect_name(spec: &pb::ToolSpec) -> &'static str {
    match pb::Effect::try_from(spec.effect).unwrap_or(pb::Effect::Unspecified) {
        pb::Effect::ReadOnly => "read_only",
        pb::Effect::Mutating => "mutating",
        pb::Effect::External => "external",
        pb::Effect::Consequential => "consequential",
        pb::Effect::Unspecified if spec.consequential => "consequential",
        pb::Effect::Unspecified if spec.read_only => "read_only",
        pb::Effect::Unspecified => "mutating",
    }
}

/// The effect class `name` names (see [`effect_name`]).
pub fn effect_from_name(name: &str) -> pb::Effect {
    match name {
        "read_only" => pb::Effect::ReadOnly,
        "mutating" => pb::Effect::Mutating,
        "external" => pb::Effect::External,
        "consequential" => pb::Effect::Consequential,
        _ => pb::Effect::Unspecified,
    }
}

/// The SHA-256 of a tool's declaration as authorizations bind it: RFC 8785 JSON of
/// `{"name", "version", "effect", "risk_level", "idempotent", "input_schema", "output_schema"}`
/// (schemas parsed, `null` when none or not JSON; `effect` as [`effect_name`] gives it;
/// `risk_level` "low", "medium", "high" or "unspecified"). Any host can compute it: the Python
/// framework does the same.
pub fn declaration_sha256(spec: &pb::ToolSpec) -> String {
    let schema = |text: &str| serde_json::from_str::<serde_json::Value>(text).unwrap_or(serde_json::Value::Null);
    let risk = match pb::RiskLevel::try_from(spec.risk_level).unwrap_or(pb::RiskLevel::Unspecified) {
        pb::RiskLevel::Low => "low",
        pb::RiskLevel::Medium => "medium",
        pb::RiskLevel::High => "high",
        pb::RiskLevel::Unspecified => "unspecified",
    };
    let declaration = serde_json::json!({
        "name": spec.name,
        "version": spec.version,
        "effect": effect_name(spec),
        "risk_level": risk,
        "idempotent": spec.idempotent,
        "input_schema": schema(&spec.input_schema_json),
        "output_schema": schema(&spec.output_schema_json),
    });
    warden_core::sha256_hex(warden_core::canonical_json(&declaration))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_declaration_digest_changes_with_the_class_the_version_or_a_schema() {
        let spec = pb::ToolSpec {
            name: "email.send".into(),
            version: "1".into(),
            consequential: true,
            input_schema_json: r#"{"type": "object"}"#.into(),
            ..Default::default()
        };
        assert_eq!(effect_name(&spec), "consequential", "from the older flag");
        let base = declaration_sha256(&spec);
        // Formatting of the schema text does not matter; its content does.
        let spaced = pb::ToolSpec { input_schema_json: "{ \"type\" : \"object\" }".into(), ..spec.clone() };
        assert_eq!(declaration_sha256(&spaced), base);
        let downgraded = pb::ToolSpec { consequential: false, read_only: true, ..spec.clone() };
        let bumped = pb::ToolSpec { version: "2".into(), ..spec.clone() };
        let reshaped =
            pb::ToolSpec { input_schema_json: r#"{"type": "object", "required": ["to"]}"#.into(), ..spec.clone() };
        for other in [downgraded, bumped, reshaped] {
            assert_ne!(declaration_sha256(&other), base);
        }
        let explicit = pb::ToolSpec { effect: pb::Effect::Consequential as i32, ..spec.clone() };
        assert_eq!(declaration_sha256(&explicit), base, "the same class, declared or derived");
        // The Python framework computes the same digest (sdk/python tests assert this value).
        assert_eq!(base, "3b851c447c6f3f4718ab4a76878086db2caebf412ce5a235f7286352ac730acd");
    }
}
