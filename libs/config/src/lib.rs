//! Layered configuration for every Warden binary: built-in defaults → TOML file →
//! `WARDEN_*` environment variables (`__` nests: `WARDEN_LEDGER__DATABASE_URL`) → the
//! caller's overrides (CLI flags), then one [`WardenConfig::validate`] that names the bad key.
//!
//! One file configures the whole mesh; each binary reads its own section.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;

use figment::Figment;
use figment::providers::{Env, Format, Serialized, Toml};
use serde::{Deserialize, Serialize};

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("configuration could not be read: {0}")]
    Load(#[from] Box<figment::Error>),
    #[error("invalid configuration key '{key}': {reason}")]
    Invalid { key: String, reason: String },
}

fn invalid(key: &str, reason: impl Into<String>) -> ConfigError {
    ConfigError::Invalid { key: key.to_string(), reason: reason.into() }
}

/// Longest Unix domain socket path Linux accepts (`sun_path` holds 108 bytes, NUL included).
const MAX_SOCKET_PATH: usize = 107;

/// A Unix domain socket path a service may listen on or connect to: absolute (a relative one
/// would depend on each process's working directory) and short enough for the kernel.
fn unix_socket_path(path: &str) -> Result<(), String> {
    if !path.starts_with('/') {
        return Err(format!("'{path}' must be an absolute path"));
    }
    if path.len() > MAX_SOCKET_PATH {
        return Err(format!("'{path}' is longer than {MAX_SOCKET_PATH} bytes, the most a socket path may be"));
    }
    Ok(())
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct WardenConfig {
    pub ledger: LedgerConfig,
    pub policy: PolicyConfig,
    pub planner: PlannerConfig,
    pub executor: ExecutorConfig,
    pub tools: ToolsConfig,
    pub auth: AuthConfig,
    pub telemetry: TelemetryConfig,
}

/// Traces and metrics (see `warden_telemetry`). The standard `OTEL_*` environment variables
/// (`OTEL_EXPORTER_OTLP_ENDPOINT`, `OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`,
/// `OTEL_TRACES_SAMPLER`, `OTEL_BSP_*`) are honoured; a key set here takes precedence over
/// the variable it stands for.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TelemetryConfig {
    /// OTLP collector base URL (`http://otel-collector:4318`, or `:4317` with `grpc`). Empty:
    /// `OTEL_EXPORTER_OTLP_ENDPOINT`; with neither set, no trace is exported.
    pub otlp_endpoint: String,
    /// `grpc` or `http/protobuf`. Empty: `OTEL_EXPORTER_OTLP_PROTOCOL`, else `http/protobuf`.
    pub otlp_protocol: String,
    /// Where this process serves Prometheus metrics (`/metrics`). Empty: the binary's own
    /// default (executor and `warden dev` 127.0.0.1:9100, ledger :9101, policy :9102, planner
    /// :9103, demo tools :9105, MCP host :9106); `off`: none. Per process, `--metrics-listen`
    /// or `WARDEN_METRICS_LISTEN` override it.
    pub metrics_listen: String,
}

/// Caller authentication (see `warden_grpc::auth`). No tokens: not authenticated.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AuthConfig {
    /// Accepted bearer tokens: token → tenant name, `tenant/agent` (that agent only),
    /// `tenant@person` (a person, who approves as themself), or `*` for operators and services.
    pub tokens: BTreeMap<String, String>,
    /// The token this process presents to other services (a `*` token in a mesh).
    pub token: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LedgerConfig {
    pub listen: String,
    /// Also serve on this Unix domain socket (an absolute path; empty: none), for co-located
    /// clients, which name it as the endpoint `unix:<path>`: no TCP/IP stack between them.
    pub listen_unix: String,
    /// `sqlite://path` (embedded default) or `postgres://…`.
    pub database_url: String,
    pub max_connections: u32,
    /// Largest accepted event payload or plan, in bytes.
    pub max_payload_bytes: usize,
    /// Largest tool output stored by reference (`Ledger.PutOutput`), in bytes of canonical
    /// JSON; below the 8 MiB gRPC message limit.
    pub max_output_bytes: usize,
    /// Ed25519 seed (hex) the ledger signs chain heads with; created 0600 when missing.
    pub key_file: String,
    /// Group-commit writers (PostgreSQL; SQLite always uses one). A run always uses the same one.
    pub write_lanes: usize,
    /// Most events committed together by one writer.
    pub max_batch: usize,
    /// The policy service, whose published keys verify every `policy_decision` before it is
    /// recorded (decisions travel with the executor's appends; none can be forged).
    pub policy_endpoint: String,
    /// Most child frames one run tree opens, all depths together (seed 001's frames are
    /// bounded in depth by the plan; this bounds their number, so a plan — a model's
    /// included — cannot fan out exponentially). Past it `CreateRun` of a frame is
    /// FAILED_PRECONDITION and the step fails `frame_refused`.
    pub max_frames_per_root: u64,
    /// Most run submissions waiting to be recorded at once. Submissions wait in a queue and
    /// are written together, many in one commit. Past this bound a submission is refused at
    /// once with RESOURCE_EXHAUSTED and a retry hint, and nothing is written.
    pub max_pending_runs: usize,
    /// Most bytes of run submissions (their requests' encoded size) waiting at once. Past it,
    /// a submission is refused as past `max_pending_runs`. At least 8 MiB, one request's most.
    pub max_pending_run_bytes: usize,
}

impl Default for LedgerConfig {
    fn default() -> Self {
        LedgerConfig {
            listen: "127.0.0.1:7101".into(),
            listen_unix: String::new(),
            database_url: "sqlite://.warden/ledger.db".into(),
            max_connections: 16,
            max_payload_bytes: 1 << 20,
            max_output_bytes: 6 << 20,
            key_file: ".warden/ledger.key".into(),
            write_lanes: 4,
            max_batch: 128,
            policy_endpoint: "http://127.0.0.1:7102".into(),
            max_frames_per_root: 100,
            max_pending_runs: 10_000,
            max_pending_run_bytes: 256 << 20,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PolicyMode {
    /// Decisions are computed and recorded, but a deny is logged, not enforced.
    Permissive,
    /// Default deny: anything not explicitly allowed is refused.
    #[default]
    Enforced,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TenantPolicy {
    /// Tools this tenant may call (exact names, or a trailing `*` prefix pattern).
    pub allow_tools: Vec<String>,
    /// Tools whose calls wait for a human approval of the exact arguments (same patterns).
    pub require_approval: Vec<String>,
    /// Who may approve this tenant's calls; empty: any approver the caller names.
    pub approvers: Vec<String>,
    /// Who reviews the calls `require_approval` gates: `human` (the default: a person
    /// approves or denies through `Approvals`) or `critic` (a model critic, asked through the
    /// planner while the call is decided; its verdict is recorded in the run and replayed,
    /// and a call it denies is `critic_denied`, never retried).
    pub approval_mode: String,
    /// Budgets (0 = unlimited). Monotonic: once spent, never refunded; a breach denies.
    pub max_calls_per_run: u64,
    pub max_cost_per_run: f64,
    pub max_cost_per_tenant: f64,
    /// Wall time a run may take, in ms from its submission (0 = unlimited): past it every
    /// further call — a model call included — is denied `run_time_limit`. A child frame has
    /// what is left of its root run's (seed 001). A retry of a call allowed in time is that
    /// same call (like the call limit, it is not counted again). Measured by the ledger's
    /// clock at the start and the policy's at the call: keep the mesh's clocks in sync (NTP).
    pub max_run_ms: u64,
    /// Calls per minute across the tenant's runs (0 = unlimited), counted in Redis so every
    /// policy replica shares the window.
    pub rate_limit_per_minute: u64,
    /// Largest `amount_usd` one call may carry (0 = unlimited).
    pub max_cost_per_call: f64,
    /// Tools this tenant may itself delegate: its own token may issue capabilities only for
    /// tool patterns within these (same pattern syntax). Empty (the default): only operators
    /// (`*` tokens) issue this tenant's capabilities — a capability never carries more
    /// authority than its issuer holds.
    pub delegable_tools: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PolicyConfig {
    pub listen: String,
    /// Also serve on this Unix domain socket (an absolute path; empty: none), for co-located
    /// clients, which name it as the endpoint `unix:<path>`: no TCP/IP stack between them.
    pub listen_unix: String,
    pub ledger_endpoint: String,
    /// Ed25519 signing key seed (hex); created with mode 0600 when missing.
    pub key_file: String,
    /// Policy state (capabilities): `sqlite://path` or `postgres://…` (its own database).
    pub database_url: String,
    /// Longest capability lifetime Issue grants, in seconds.
    pub max_capability_ttl_secs: u64,
    /// Directory of Cedar policies (`schema.cedarschema` + `*.cedar`); empty: the tenant
    /// allowlists decide. Changes are picked up without a restart.
    pub policy_dir: String,
    /// How often the policy directory is checked for changes.
    pub reload_interval_ms: u64,
    /// How long a pending approval waits before it expires.
    pub approval_ttl_secs: u64,
    /// Keys rotated out: still published (not current) so authorizations they signed verify
    /// until they expire. Rotate by moving `key_file` here and pointing it at a new file.
    pub previous_key_files: Vec<String>,
    /// Consequential tools (Maple): a call needs an explicit commitment — a capability handle
    /// — or it is denied with `missing_commitment`. Exact names or a trailing `*`.
    pub consequential_tools: Vec<String>,
    /// The planner, which asks the model critic for tenants whose `approval_mode` is `critic`.
    pub planner_endpoint: String,
    /// Built-in deterministic invariants, checked after every other rule allowed a call.
    pub invariants: Vec<InvariantConfig>,
    /// `redis://…` for rate windows shared by policy replicas; empty: in-process windows.
    pub redis_url: String,
    /// Semantic idempotency (Artana): calls of `tool` whose `template` (with `{field}`
    /// placeholders filled from the arguments) matches an earlier success are
    /// `semantic_duplicate`; one whose earlier call has no known outcome is
    /// `semantic_requires_reconciliation`.
    pub semantic_keys: Vec<SemanticKeyConfig>,
    /// Tools whose calls need a recorded intent plan (a `policy::intent_plan` run summary)
    /// no older than `intent_max_age_secs` (0 = any age): `missing_intent_plan` otherwise.
    pub intent_required_tools: Vec<String>,
    pub intent_max_age_secs: u64,
    pub mode: PolicyMode,
    pub authorization_ttl_ms: u64,
    pub tenants: BTreeMap<String, TenantPolicy>,
}

impl Default for PolicyConfig {
    fn default() -> Self {
        PolicyConfig {
            listen: "127.0.0.1:7102".into(),
            listen_unix: String::new(),
            ledger_endpoint: "http://127.0.0.1:7101".into(),
            key_file: ".warden/policy.key".into(),
            database_url: "sqlite://.warden/policy.db".into(),
            max_capability_ttl_secs: 30 * 24 * 3600,
            policy_dir: String::new(),
            reload_interval_ms: 1_000,
            approval_ttl_secs: 3 * 24 * 3600,
            previous_key_files: Vec::new(),
            consequential_tools: Vec::new(),
            planner_endpoint: "http://127.0.0.1:7103".into(),
            invariants: Vec::new(),
            redis_url: String::new(),
            semantic_keys: Vec::new(),
            intent_required_tools: Vec::new(),
            intent_max_age_secs: 0,
            mode: PolicyMode::Enforced,
            authorization_ttl_ms: 60_000,
            tenants: BTreeMap::new(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SemanticKeyConfig {
    /// Tool name or trailing-`*` pattern.
    pub tool: String,
    /// E.g. `"pay:{to}:{amount}"`.
    pub template: String,
}

/// One built-in invariant (seed 002) on the calls of the tools matching `tool`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum InvariantConfig {
    /// `args[field]` must be `true`.
    RequiredArgTrue { tool: String, field: String },
    /// `args[field]` must be an RFC 5322 address whose domain is exactly one of `domains`
    /// (ASCII case-insensitive; subdomains do not count). One address only unless
    /// `allow_multiple`, and then every address of the list (groups included) is checked.
    EmailDomainAllowlist {
        tool: String,
        field: String,
        domains: Vec<String>,
        /// Accept an address list (several addresses, or a group) instead of refusing it.
        #[serde(default)]
        allow_multiple: bool,
    },
    /// `args[field]` must be one of the `verified` recipients.
    RecipientMustBeVerified { tool: String, field: String, verified: Vec<String> },
    /// `args[field] <op> value`, op one of eq, ne, lt, lte, gt, gte, in.
    CustomJsonRule { tool: String, field: String, op: String, value: serde_json::Value },
    /// `args[field]` must be Python 3 source that parses (CPython's `ast` grammar).
    AstValidationPassed { tool: String, field: String },
    /// `args[field]` must parse and pass the deterministic lint rules in `select` (codes such
    /// as `E722`, `S307`; empty = every rule), lines at most `max_line_length` characters.
    LinterPassed {
        tool: String,
        field: String,
        #[serde(default)]
        select: Vec<String>,
        #[serde(default = "default_max_line_length")]
        max_line_length: usize,
    },
}

fn default_max_line_length() -> usize {
    120
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PlannerConfig {
    pub listen: String,
    /// Also serve on this Unix domain socket (an absolute path; empty: none), for co-located
    /// clients, which name it as the endpoint `unix:<path>`: no TCP/IP stack between them.
    pub listen_unix: String,
    pub tool_hosts: Vec<String>,
    pub max_steps: usize,
    /// Model calls are authorized here (`model.call`) and their cost recorded.
    pub policy_endpoint: String,
    /// Model calls are recorded in the run's chain here.
    pub ledger_endpoint: String,
    /// Longest goal accepted, in bytes (`SubmitRun.goal`).
    pub max_goal_bytes: usize,
    /// Redaction before a goal leaves Warden or is recorded: pattern name → regular
    /// expression; each match becomes `[redacted:<name>]`. Defaults cover common secrets and
    /// personal data; set a name to "" to turn its default off.
    pub redact: BTreeMap<String, String>,
    /// The model planning asks (no provider: goal runs are refused with how to configure one).
    pub model: ModelConfig,
    /// Per-tenant model (replaces `model` whole for that tenant's runs).
    pub tenants: BTreeMap<String, PlannerTenantConfig>,
    /// Prices per model name, per million tokens: usage × price is the call's recorded cost.
    pub prices: BTreeMap<String, ModelPrice>,
}

/// A tenant's own planning model.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PlannerTenantConfig {
    pub model: ModelConfig,
}

/// Price of a model, per million tokens.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ModelPrice {
    pub input_per_mtok: f64,
    pub output_per_mtok: f64,
}

/// A model provider: `openai` is any OpenAI-compatible Chat Completions endpoint (OpenAI,
/// vLLM, llama.cpp's `llama-server`, Ollama, …); `anthropic` the Anthropic Messages API.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ModelConfig {
    /// "" (none), "openai" or "anthropic".
    pub provider: String,
    /// e.g. `https://api.openai.com/v1`, `http://127.0.0.1:8080/v1`, `https://api.anthropic.com`.
    pub base_url: String,
    pub model: String,
    /// Environment variable holding the API key (none: no key is sent).
    pub api_key_env: String,
    /// Or a file holding it (read at start; trailing whitespace trimmed).
    pub api_key_file: String,
    /// Per HTTP attempt.
    pub timeout_secs: u64,
    /// Times an invalid plan is shown its error and asked again before the fallback.
    pub repair_attempts: u32,
    /// Retries of one call on 429, 5xx, timeouts and refused connections (with backoff,
    /// honouring `Retry-After`) before planning fails `planner_unavailable`.
    pub max_retries: u32,
    pub max_tokens: u32,
    pub temperature: f64,
    /// OpenAI structured output dialect: "json_schema" (OpenAI, llama-server, vLLM) or
    /// "json_object" (`llama-cpp-python`'s server: `{"type":"json_object","schema":…}`).
    pub response_format: String,
}

impl Default for ModelConfig {
    fn default() -> Self {
        ModelConfig {
            provider: String::new(),
            base_url: String::new(),
            model: String::new(),
            api_key_env: String::new(),
            api_key_file: String::new(),
            timeout_secs: 60,
            repair_attempts: 2,
            max_retries: 3,
            max_tokens: 1024,
            temperature: 0.0,
            response_format: "json_schema".into(),
        }
    }
}

impl ModelConfig {
    pub fn is_configured(&self) -> bool {
        !self.provider.is_empty()
    }

    fn validate(&self, key: &str) -> Result<(), ConfigError> {
        if !self.is_configured() {
            return Ok(());
        }
        let k = |f: &str| format!("{key}.{f}");
        if !matches!(self.provider.as_str(), "openai" | "anthropic") {
            return Err(invalid(&k("provider"), format!("'{}' is not \"openai\" or \"anthropic\"", self.provider)));
        }
        match url::Url::parse(&self.base_url) {
            Ok(u) if matches!(u.scheme(), "http" | "https") && u.host().is_some() => {}
            Ok(_) => return Err(invalid(&k("base_url"), format!("'{}' is not an http(s) URL", self.base_url))),
            Err(e) => return Err(invalid(&k("base_url"), format!("'{}' is not a URL ({e})", self.base_url))),
        }
        if self.model.is_empty() || self.model.len() > 200 || self.model.chars().any(|c| c.is_control()) {
            return Err(invalid(&k("model"), "a model name of 1 to 200 printable characters"));
        }
        if self.timeout_secs == 0 || self.timeout_secs > 3600 {
            return Err(invalid(&k("timeout_secs"), "from 1 to 3600"));
        }
        if self.repair_attempts > 5 {
            return Err(invalid(&k("repair_attempts"), "at most 5"));
        }
        if self.max_retries > 10 {
            return Err(invalid(&k("max_retries"), "at most 10"));
        }
        if self.max_tokens == 0 || self.max_tokens > 200_000 {
            return Err(invalid(&k("max_tokens"), "from 1 to 200000"));
        }
        if !(0.0..=2.0).contains(&self.temperature) {
            return Err(invalid(&k("temperature"), "from 0 to 2"));
        }
        if !matches!(self.response_format.as_str(), "json_schema" | "json_object") {
            return Err(invalid(&k("response_format"), "\"json_schema\" or \"json_object\""));
        }
        Ok(())
    }
}

/// Default redaction patterns (see [`PlannerConfig::redact`]).
pub fn default_redactions() -> BTreeMap<String, String> {
    [
        ("openai_key", r"sk-[A-Za-z0-9_-]{16,}"),
        ("aws_access_key", r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b"),
        ("bearer_token", r"(?i)\bbearer\s+[A-Za-z0-9._~+/=-]{16,}"),
        ("private_key", r"-----BEGIN [A-Z ]*PRIVATE KEY-----[\s\S]*?(?:-----END [A-Z ]*PRIVATE KEY-----|$)"),
        ("email", r"\b[A-Za-z0-9._%+-]+@[A-Za-z0-9.-]+\.[A-Za-z]{2,}\b"),
        ("card_number", r"\b(?:\d[ -]?){13,19}\b"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect()
}

impl Default for PlannerConfig {
    fn default() -> Self {
        PlannerConfig {
            listen: "127.0.0.1:7103".into(),
            listen_unix: String::new(),
            tool_hosts: vec!["http://127.0.0.1:7105".into()],
            max_steps: 10,
            policy_endpoint: "http://127.0.0.1:7102".into(),
            ledger_endpoint: "http://127.0.0.1:7101".into(),
            max_goal_bytes: 8192,
            redact: default_redactions(),
            model: ModelConfig::default(),
            tenants: BTreeMap::new(),
            prices: BTreeMap::new(),
        }
    }
}

impl PlannerConfig {
    /// The model a tenant's runs plan with (its own, else the default), if any.
    pub fn model_for(&self, tenant: &str) -> Option<&ModelConfig> {
        let m = self.tenants.get(tenant).map(|t| &t.model).filter(|m| m.is_configured()).unwrap_or(&self.model);
        m.is_configured().then_some(m)
    }

    fn validate(&self) -> Result<(), ConfigError> {
        self.model.validate("planner.model")?;
        for (tenant, t) in &self.tenants {
            t.model.validate(&format!("planner.tenants.{tenant}.model"))?;
        }
        for (name, pattern) in &self.redact {
            if !pattern.is_empty() {
                regex::Regex::new(pattern).map_err(|e| {
                    invalid(&format!("planner.redact.{name}"), format!("not a regular expression: {e}"))
                })?;
            }
        }
        for (model, p) in &self.prices {
            for (field, v) in [("input_per_mtok", p.input_per_mtok), ("output_per_mtok", p.output_per_mtok)] {
                if !v.is_finite() || v < 0.0 {
                    return Err(invalid(&format!("planner.prices.{model}.{field}"), "a price is a number ≥ 0"));
                }
            }
        }
        if self.max_goal_bytes == 0 || self.max_goal_bytes > 1 << 20 {
            return Err(invalid("planner.max_goal_bytes", "from 1 to 1048576"));
        }
        Ok(())
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ExecutorConfig {
    pub listen: String,
    /// Also serve on this Unix domain socket (an absolute path; empty: none), for co-located
    /// clients, which name it as the endpoint `unix:<path>`: no TCP/IP stack between them.
    pub listen_unix: String,
    pub ledger_endpoint: String,
    pub policy_endpoint: String,
    pub planner_endpoint: String,
    pub tool_hosts: Vec<String>,
    /// `redis://…` for leases shared by replicas; empty means an in-process lease store
    /// (a single executor only — the `warden dev` shape).
    pub redis_url: String,
    pub lease_ttl_ms: u64,
    pub max_concurrency: usize,
    /// How often the sweeper looks for runs without a live lease.
    pub sweep_interval_ms: u64,
    pub max_plan_bytes: usize,
    /// Identity of this replica in leases and events; generated when empty.
    pub executor_id: String,
    /// Retry backoff: attempt n waits `retry_backoff_base_ms × 2^(n-1)` after attempt n-1 failed
    /// (seed 000's `2^attempt` seconds at the default 1000; smaller in tests).
    pub retry_backoff_base_ms: u64,
    /// How long a blip may last before it fails a step: while the policy service, the ledger
    /// or a tool host cannot be reached (a restart, a datastore outage), idempotent calls are
    /// retried with jittered backoff for up to this long. Only then does a step fail
    /// (`policy_unavailable`, `tool_host_unavailable`). Nothing runs meanwhile (fail closed).
    pub outage_grace_ms: u64,
    /// How long an executor's liveness key outlives its last heartbeat (three a TTL): a
    /// replica that dies is taken over by another within about this plus `sweep_interval_ms`,
    /// well inside the lease TTL.
    pub liveness_ttl_ms: u64,
    /// The step pipeline's output rules (seed 000 §10): name → regular expression. A tool
    /// output whose JSON text matches one is recorded as `"[Output sanitized]"` with the rule's
    /// name (the step keeps its status), so what a tool leaks never reaches the ledger, the
    /// next step or the planner. Defaults: credentials (API keys, AWS access keys, bearer
    /// tokens, private keys); an empty pattern turns a default off.
    pub output_rules: BTreeMap<String, String>,
    /// Largest tool output recorded inline in its `tool_completed`, in bytes of canonical
    /// JSON. A larger one is stored by reference (`Ledger.PutOutput`): the event cites its
    /// SHA-256 and size, so the chain commits to it while the log stays small.
    pub inline_output_max_bytes: usize,
    /// How often a goal run whose plan ended with failed steps is planned again (seed 000
    /// §12): the planner is told the failures and the completed steps, which are kept. 0 turns
    /// replanning off.
    pub max_replan_rounds: u32,
    /// Ask for a submitted run's first decisions while the ledger creates the run, instead of
    /// after (docs/write-path.md): the policy decides against the plan being recorded, and the
    /// ledger records such a decision only in a run whose plan has the digest it names. Runs
    /// submitted with capability handles or a goal always wait for their creation. The policy
    /// and the ledger must be upgraded to know it first (an older policy denies such calls).
    pub decide_while_creating: bool,
    /// With `decide_while_creating`: how long the ledger's creation of a run waits for its
    /// first step's decision and request, to record them in the same transaction (one commit
    /// for the run and its first request). The run's driver lets the creation go at once
    /// whenever the first step takes another way (a deny, a call decided only once the run is
    /// recorded); a step allowed later is appended after. 0 never waits.
    pub first_step_wait_ms: u64,
}

/// Default output rules (see [`ExecutorConfig::output_rules`]): the credential patterns of
/// [`default_redactions`], not its personal-data ones (an e-mail address in a tool's output is
/// usually its point).
pub fn default_output_rules() -> BTreeMap<String, String> {
    let credentials = ["openai_key", "aws_access_key", "bearer_token", "private_key"];
    default_redactions().into_iter().filter(|(k, _)| credentials.contains(&k.as_str())).collect()
}

impl Default for ExecutorConfig {
    fn default() -> Self {
        ExecutorConfig {
            listen: "127.0.0.1:7100".into(),
            listen_unix: String::new(),
            ledger_endpoint: "http://127.0.0.1:7101".into(),
            policy_endpoint: "http://127.0.0.1:7102".into(),
            planner_endpoint: "http://127.0.0.1:7103".into(),
            tool_hosts: vec!["http://127.0.0.1:7105".into()],
            redis_url: String::new(),
            lease_ttl_ms: 10_000,
            max_concurrency: 5,
            sweep_interval_ms: 1_000,
            max_plan_bytes: 256 * 1024,
            executor_id: String::new(),
            retry_backoff_base_ms: 1_000,
            outage_grace_ms: 30_000,
            liveness_ttl_ms: 1_000,
            output_rules: default_output_rules(),
            inline_output_max_bytes: 64 * 1024,
            max_replan_rounds: 2,
            decide_while_creating: true,
            first_step_wait_ms: 50,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ToolsConfig {
    pub listen: String,
    /// Also serve on this Unix domain socket (an absolute path; empty: none), for co-located
    /// clients, which name it as the endpoint `unix:<path>`: no TCP/IP stack between them.
    pub listen_unix: String,
    pub policy_endpoint: String,
    /// The ledger, whose published key verifies the acknowledgement every call must carry
    /// that its request is durably recorded.
    pub ledger_endpoint: String,
    /// Where `email.send` appends its messages, one JSON object per line.
    pub outbox_path: String,
    /// SQLite file holding the host's durable state: the first outcome of every
    /// (tenant, idempotency key), replayed after a restart instead of acting twice, and the
    /// `kv` store. Empty (the default): `tools.db` in the directory of `outbox_path`, so the
    /// outcomes live beside the side effects they describe.
    pub state_path: String,
    /// The `timeout_sec` the host declares for a tool, by name (default 10 for every demo tool;
    /// 0 declares none, so executors fall back to 60 s).
    pub timeout_secs: BTreeMap<String, u32>,
    /// An output JSON Schema the host declares for a tool, by name, in place of the tool's own
    /// (the demo tools declare one where their output has a fixed shape). Executors check
    /// every output against it (see `ToolSpec.output_schema_json`).
    pub output_schemas: BTreeMap<String, String>,
    /// The effect class the host declares for a tool, by name, in place of the tool's own:
    /// `read_only`, `mutating`, `external` or `consequential` (which needs a commitment).
    pub effects: BTreeMap<String, String>,
}

impl Default for ToolsConfig {
    fn default() -> Self {
        ToolsConfig {
            listen: "127.0.0.1:7105".into(),
            listen_unix: String::new(),
            policy_endpoint: "http://127.0.0.1:7102".into(),
            ledger_endpoint: "http://127.0.0.1:7101".into(),
            outbox_path: ".warden/outbox.jsonl".into(),
            state_path: String::new(),
            timeout_secs: BTreeMap::new(),
            output_schemas: BTreeMap::new(),
            effects: BTreeMap::new(),
        }
    }
}

impl ToolsConfig {
    /// The state file in use: `state_path`, or `tools.db` beside the outbox when it is empty.
    pub fn state_file(&self) -> std::path::PathBuf {
        if !self.state_path.is_empty() {
            return self.state_path.clone().into();
        }
        Path::new(&self.outbox_path).parent().unwrap_or(Path::new("")).join("tools.db")
    }
}

impl WardenConfig {
    /// Defaults, then `file` (when given), then `WARDEN_*` variables.
    pub fn figment(file: Option<&Path>) -> Figment {
        let mut f = Figment::from(Serialized::defaults(WardenConfig::default()));
        if let Some(path) = file {
            f = f.merge(Toml::file_exact(path));
        }
        // Only nested keys (`WARDEN_SECTION__KEY`) are configuration; flat ones such as
        // WARDEN_ENDPOINT or WARDEN_CONFIG belong to the CLI.
        f.merge(Env::prefixed("WARDEN_").filter(|k| k.as_str().contains("__")).split("__"))
    }

    /// Loads and validates the configuration.
    pub fn load(file: Option<&Path>) -> Result<WardenConfig, ConfigError> {
        Self::from_figment(Self::figment(file))
    }

    /// Extracts and validates from any figment (tests inject values this way).
    pub fn from_figment(f: Figment) -> Result<WardenConfig, ConfigError> {
        let c: WardenConfig = f.extract().map_err(Box::new)?;
        c.validate()?;
        Ok(c)
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        for (section, addr, unix) in [
            ("ledger", &self.ledger.listen, &self.ledger.listen_unix),
            ("policy", &self.policy.listen, &self.policy.listen_unix),
            ("planner", &self.planner.listen, &self.planner.listen_unix),
            ("executor", &self.executor.listen, &self.executor.listen_unix),
            ("tools", &self.tools.listen, &self.tools.listen_unix),
        ] {
            addr.parse::<SocketAddr>()
                .map_err(|e| invalid(&format!("{section}.listen"), format!("'{addr}' is not host:port ({e})")))?;
            if !unix.is_empty() {
                unix_socket_path(unix).map_err(|reason| invalid(&format!("{section}.listen_unix"), reason))?;
            }
        }
        let mut endpoints = vec![
            ("policy.ledger_endpoint", &self.policy.ledger_endpoint),
            ("policy.planner_endpoint", &self.policy.planner_endpoint),
            ("executor.ledger_endpoint", &self.executor.ledger_endpoint),
            ("executor.policy_endpoint", &self.executor.policy_endpoint),
            ("executor.planner_endpoint", &self.executor.planner_endpoint),
            ("tools.policy_endpoint", &self.tools.policy_endpoint),
            ("tools.ledger_endpoint", &self.tools.ledger_endpoint),
            ("ledger.policy_endpoint", &self.ledger.policy_endpoint),
            ("planner.policy_endpoint", &self.planner.policy_endpoint),
            ("planner.ledger_endpoint", &self.planner.ledger_endpoint),
        ];
        endpoints.extend(self.planner.tool_hosts.iter().map(|e| ("planner.tool_hosts", e)));
        endpoints.extend(self.executor.tool_hosts.iter().map(|e| ("executor.tool_hosts", e)));
        for (key, e) in endpoints {
            // As the gRPC client reads it: `unix://` then `unix:` stripped, the rest the path.
            if let Some(path) = e.strip_prefix("unix://").or_else(|| e.strip_prefix("unix:")) {
                unix_socket_path(path).map_err(|reason| invalid(key, format!("'{e}': {reason}")))?;
            } else if !(e.starts_with("http://") || e.starts_with("https://")) {
                return Err(invalid(key, format!("'{e}' must be an http:// or https:// URL, or unix:/path")));
            }
        }
        self.planner.validate()?;
        for (name, pattern) in &self.executor.output_rules {
            if !pattern.is_empty() {
                regex::Regex::new(pattern).map_err(|e| {
                    invalid(&format!("executor.output_rules.{name}"), format!("not a regular expression: {e}"))
                })?;
            }
        }
        for (tenant, t) in &self.policy.tenants {
            if !matches!(t.approval_mode.as_str(), "" | "human" | "critic") {
                return Err(invalid(&format!("policy.tenants.{tenant}.approval_mode"), "human or critic"));
            }
        }
        for (tool, effect) in &self.tools.effects {
            if !matches!(effect.as_str(), "read_only" | "mutating" | "external" | "consequential") {
                return Err(invalid(
                    &format!("tools.effects.{tool}"),
                    "read_only, mutating, external or consequential",
                ));
            }
        }
        for (tool, schema) in &self.tools.output_schemas {
            let key = format!("tools.output_schemas.{tool}");
            let schema: serde_json::Value =
                serde_json::from_str(schema).map_err(|e| invalid(&key, format!("not JSON: {e}")))?;
            jsonschema::validator_for(&schema).map_err(|e| invalid(&key, format!("not JSON Schema: {e}")))?;
        }
        if !matches!(self.telemetry.otlp_protocol.as_str(), "" | "grpc" | "http/protobuf") {
            return Err(invalid("telemetry.otlp_protocol", "must be grpc or http/protobuf"));
        }
        let otlp = &self.telemetry.otlp_endpoint;
        if !(otlp.is_empty() || otlp.starts_with("http://") || otlp.starts_with("https://")) {
            return Err(invalid("telemetry.otlp_endpoint", format!("'{otlp}' must be an http:// or https:// URL")));
        }
        let metrics = &self.telemetry.metrics_listen;
        if !(metrics.is_empty() || metrics == "off") {
            metrics.parse::<SocketAddr>().map_err(|e| {
                invalid("telemetry.metrics_listen", format!("'{metrics}' is not host:port or off ({e})"))
            })?;
        }
        let pdb = &self.policy.database_url;
        if !(pdb.starts_with("sqlite:") || pdb.starts_with("postgres://") || pdb.starts_with("postgresql://")) {
            return Err(invalid("policy.database_url", "must start with sqlite:, postgres:// or postgresql://"));
        }
        let db = &self.ledger.database_url;
        if !(db.starts_with("sqlite:") || db.starts_with("postgres://") || db.starts_with("postgresql://")) {
            return Err(invalid("ledger.database_url", "must start with sqlite:, postgres:// or postgresql://"));
        }
        if !self.executor.redis_url.is_empty() && !self.executor.redis_url.starts_with("redis://") {
            return Err(invalid("executor.redis_url", "must be empty (in-process leases) or a redis:// URL"));
        }
        let positive = [
            ("ledger.max_connections", self.ledger.max_connections as u64),
            ("ledger.max_payload_bytes", self.ledger.max_payload_bytes as u64),
            ("ledger.max_output_bytes", self.ledger.max_output_bytes as u64),
            ("executor.inline_output_max_bytes", self.executor.inline_output_max_bytes as u64),
            ("ledger.write_lanes", self.ledger.write_lanes as u64),
            ("ledger.max_batch", self.ledger.max_batch as u64),
            ("ledger.max_frames_per_root", self.ledger.max_frames_per_root),
            ("ledger.max_pending_runs", self.ledger.max_pending_runs as u64),
            ("planner.max_steps", self.planner.max_steps as u64),
            ("executor.max_concurrency", self.executor.max_concurrency as u64),
            ("executor.max_plan_bytes", self.executor.max_plan_bytes as u64),
            ("executor.sweep_interval_ms", self.executor.sweep_interval_ms),
            ("executor.liveness_ttl_ms", self.executor.liveness_ttl_ms),
            ("policy.authorization_ttl_ms", self.policy.authorization_ttl_ms),
        ];
        if let Some((key, _)) = positive.iter().find(|(_, v)| *v == 0) {
            return Err(invalid(key, "must be greater than zero"));
        }
        if self.ledger.max_pending_run_bytes < 8 << 20 {
            return Err(invalid("ledger.max_pending_run_bytes", "at least 8388608 (one request's largest size)"));
        }
        if self.ledger.max_output_bytes > 7 << 20 {
            return Err(invalid("ledger.max_output_bytes", "at most 7340032 (an output travels in one gRPC message)"));
        }
        if self.executor.inline_output_max_bytes > self.ledger.max_payload_bytes {
            return Err(invalid("executor.inline_output_max_bytes", "at most ledger.max_payload_bytes"));
        }
        // It adds to `SubmitRun`'s answer when a driver is slow to reach its first step.
        if self.executor.first_step_wait_ms > 30_000 {
            return Err(invalid("executor.first_step_wait_ms", "from 0 to 30000"));
        }
        if self.executor.max_replan_rounds > 16 {
            return Err(invalid("executor.max_replan_rounds", "from 0 to 16"));
        }
        if self.executor.lease_ttl_ms < 300 {
            return Err(invalid("executor.lease_ttl_ms", "must be at least 300 ms"));
        }
        if self.executor.liveness_ttl_ms < 300 || self.executor.liveness_ttl_ms > self.executor.lease_ttl_ms {
            return Err(invalid("executor.liveness_ttl_ms", "must be from 300 ms to executor.lease_ttl_ms"));
        }
        for (token, scope) in &self.auth.tokens {
            if token.len() < 16 || !token.chars().all(|c| c.is_ascii_graphic()) {
                return Err(invalid("auth.tokens", "tokens are at least 16 printable ASCII characters"));
            }
            let id = |s: &str| {
                !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | ':' | '.'))
            };
            let ok = match (scope.split_once('/'), scope.split_once('@')) {
                _ if scope == "*" => true,
                (Some((tenant, agent)), None) => id(tenant) && id(agent),
                (None, Some((tenant, person))) => id(tenant) && id(person),
                (None, None) => id(scope),
                _ => false,
            };
            if !ok {
                return Err(invalid(
                    "auth.tokens",
                    format!("scope '{scope}' is not '*', a tenant id, tenant/agent or tenant@person"),
                ));
            }
        }
        for (tenant, t) in &self.policy.tenants {
            for (key, patterns) in [("allow_tools", &t.allow_tools), ("delegable_tools", &t.delegable_tools)] {
                if patterns.iter().any(|p| p.is_empty() || p[..p.len() - 1].contains('*')) {
                    return Err(invalid(
                        &format!("policy.tenants.{tenant}.{key}"),
                        "patterns are tool names with at most one trailing '*'",
                    ));
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use figment::providers::Serialized;

    #[test]
    fn defaults_validate() {
        WardenConfig::default().validate().unwrap();
    }

    #[test]
    fn bad_values_name_their_key() {
        let f = Figment::from(Serialized::defaults(WardenConfig::default()))
            .merge(Serialized::default("executor.max_concurrency", 0));
        let e = WardenConfig::from_figment(f).unwrap_err();
        assert!(e.to_string().contains("executor.max_concurrency"), "{e}");
        let f = Figment::from(Serialized::defaults(WardenConfig::default()))
            .merge(Serialized::default("ledger.database_url", "mysql://x"));
        assert!(WardenConfig::from_figment(f).unwrap_err().to_string().contains("ledger.database_url"));
    }

    #[test]
    fn bad_model_settings_name_their_key() {
        let cases = [
            (
                "[planner.model]\nprovider = \"gemini\"\nbase_url = \"http://x\"\nmodel = \"m\"\n",
                "planner.model.provider",
            ),
            (
                "[planner.model]\nprovider = \"openai\"\nbase_url = \"not a url\"\nmodel = \"m\"\n",
                "planner.model.base_url",
            ),
            (
                "[planner.model]\nprovider = \"openai\"\nbase_url = \"ftp://x\"\nmodel = \"m\"\n",
                "planner.model.base_url",
            ),
            ("[planner.model]\nprovider = \"openai\"\nbase_url = \"http://x\"\nmodel = \"\"\n", "planner.model.model"),
            ("[planner.prices.gpt]\ninput_per_mtok = -1.0\n", "planner.prices.gpt.input_per_mtok"),
            ("[planner.redact]\nbroken = \"(\"\n", "planner.redact.broken"),
            ("[executor.output_rules]\nbroken = \"(\"\n", "executor.output_rules.broken"),
            ("[tools.output_schemas]\necho = \"{\"\n", "tools.output_schemas.echo"),
            ("[tools.output_schemas]\necho = '{\"type\": 12}'\n", "tools.output_schemas.echo"),
            (
                "[planner.tenants.acme.model]\nprovider = \"anthropic\"\nbase_url = \"https://a\"\nmodel = \"m\"\nrepair_attempts = 9\n",
                "planner.tenants.acme.model.repair_attempts",
            ),
        ];
        for (toml, key) in cases {
            let f = Figment::from(Serialized::defaults(WardenConfig::default())).merge(Toml::string(toml));
            let e = WardenConfig::from_figment(f).unwrap_err().to_string();
            assert!(e.contains(key), "{toml}: {e}");
        }
        let f = Figment::from(Serialized::defaults(WardenConfig::default())).merge(Toml::string(
            "[planner.model]\nprovider = \"openai\"\nbase_url = \"http://127.0.0.1:8080/v1\"\nmodel = \"smollm2\"\n\
             [planner.tenants.acme.model]\nprovider = \"anthropic\"\nbase_url = \"https://api.anthropic.com\"\nmodel = \"claude\"\n",
        ));
        let c = WardenConfig::from_figment(f).unwrap();
        assert_eq!(c.planner.model_for("acme").unwrap().provider, "anthropic");
        assert_eq!(c.planner.model_for("globex").unwrap().model, "smollm2");
    }

    #[test]
    fn unix_sockets_are_absolute_short_paths() {
        let ok = "[ledger]\nlisten_unix = \"/run/warden/ledger.sock\"\n\
                  [executor]\nledger_endpoint = \"unix:/run/warden/ledger.sock\"\n\
                  tool_hosts = [\"unix:///run/warden/tools.sock\"]\n";
        let f = Figment::from(Serialized::defaults(WardenConfig::default())).merge(Toml::string(ok));
        let c = WardenConfig::from_figment(f).unwrap();
        assert_eq!(c.ledger.listen_unix, "/run/warden/ledger.sock");
        let long = format!("/{}", "s".repeat(MAX_SOCKET_PATH));
        let cases = [
            ("[policy]\nlisten_unix = \"warden/policy.sock\"\n".to_string(), "policy.listen_unix"),
            (format!("[tools]\nlisten_unix = \"{long}\"\n"), "tools.listen_unix"),
            ("[executor]\npolicy_endpoint = \"unix:policy.sock\"\n".to_string(), "executor.policy_endpoint"),
            ("[tools]\nledger_endpoint = \"unix://run/ledger.sock\"\n".to_string(), "tools.ledger_endpoint"),
            ("[planner]\ntool_hosts = [\"ftp://host\"]\n".to_string(), "planner.tool_hosts"),
        ];
        for (toml, key) in cases {
            let f = Figment::from(Serialized::defaults(WardenConfig::default())).merge(Toml::string(&toml));
            let e = WardenConfig::from_figment(f).unwrap_err().to_string();
            assert!(e.contains(key), "{toml}: {e}");
        }
    }

    #[test]
    fn toml_and_unknown_keys() {
        let f = Figment::from(Serialized::defaults(WardenConfig::default()))
            .merge(Toml::string("[policy.tenants.acme]\nallow_tools = [\"echo\", \"kv.*\"]\n"));
        let c = WardenConfig::from_figment(f).unwrap();
        assert_eq!(c.policy.tenants["acme"].allow_tools, vec!["echo", "kv.*"]);
        let f = Figment::from(Serialized::defaults(WardenConfig::default()))
            .merge(Toml::string("[ledger]\nlisten_addr = 1\n"));
        assert!(WardenConfig::from_figment(f).unwrap_err().to_string().contains("listen_addr"));
    }
}

#[cfg(test)]
mod readme {
    use super::*;

    /// The configuration examples in the README stay valid configuration.
    #[test]
    fn readme_examples_parse_and_validate() {
        let readme = include_str!("../../../README.md");
        let blocks: Vec<&str> = readme.split("```toml").skip(1).filter_map(|b| b.split("```").next()).collect();
        assert!(blocks.len() >= 2, "the README shows its configuration");
        for block in blocks {
            let f = figment::Figment::from(figment::providers::Serialized::defaults(WardenConfig::default()))
                .merge(figment::providers::Toml::string(block));
            let c: WardenConfig = f.extract().unwrap_or_else(|e| panic!("README example does not parse: {e}\n{block}"));
            // Placeholder tokens in the README are shorter than real ones; check the rest.
            if c.auth.tokens.is_empty() {
                c.validate().unwrap_or_else(|e| panic!("README example does not validate: {e}\n{block}"));
            }
        }
    }
}
