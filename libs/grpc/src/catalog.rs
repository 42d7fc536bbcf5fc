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
                        tools.entry(spec.name.clone()).or_insert(CatalogEntry { spec, host: i });
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
