//! The MCP host's configuration: where it listens, the mesh services whose keys it trusts, its
//! durable state, and the MCP servers it fronts (each a command spoken to over stdio or a
//! streamable HTTP URL, scoped to tenants).
//!
//! Layers, as for every Warden binary: built-in defaults → the file (`--config`, or
//! `WARDEN_CONFIG`) → `WARDEN_MCP__KEY` variables (and `WARDEN_AUTH__TOKEN`) → validation that
//! names the bad key. The host reads the file's `[mcp]` section and `[auth] token` and ignores
//! every other section, so one file may describe the host and its neighbours.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;

use figment::Figment;
use figment::providers::{Env, Format, Serialized, Toml};
use serde::{Deserialize, Serialize};
use warden_core::ids::check_id;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("configuration could not be read: {0}")]
    Load(#[from] Box<figment::Error>),
    #[error("invalid configuration key '{key}': {reason}")]
    Invalid { key: String, reason: String },
}

fn invalid(key: impl Into<String>, reason: impl Into<String>) -> ConfigError {
    ConfigError::Invalid { key: key.into(), reason: reason.into() }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct McpConfig {
    pub listen: String,
    /// The policy service, whose published keys verify every call's authorization.
    pub policy_endpoint: String,
    /// The ledger, whose published keys verify every call's acknowledgement that its request
    /// is recorded.
    pub ledger_endpoint: String,
    /// SQLite file with the first outcome of every (tenant, idempotency key), written before a
    /// call is answered and replayed for a repeated key, across restarts too.
    pub state_path: String,
    /// How long a server's tool list is reused before it is asked again (in the background:
    /// `ListTools` never waits on a slow server once its tools are known).
    pub list_ttl_ms: u64,
    /// How long starting a server (spawning it or reaching its URL, the MCP handshake and its
    /// first tool listing) may take.
    pub connect_timeout_ms: u64,
    pub servers: Vec<McpServerConfig>,
}

impl Default for McpConfig {
    fn default() -> Self {
        McpConfig {
            listen: "127.0.0.1:7106".into(),
            policy_endpoint: "http://127.0.0.1:7102".into(),
            ledger_endpoint: "http://127.0.0.1:7101".into(),
            state_path: ".warden/mcp.db".into(),
            list_ttl_ms: 5_000,
            connect_timeout_ms: 20_000,
            servers: Vec::new(),
        }
    }
}

/// What a tool does to the world, as the host declares it to Warden.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Effect {
    /// Reads only: declared `read_only` (and `idempotent`, see `tools::spec`).
    ReadOnly,
    /// Changes something, additively (MCP `destructiveHint: false`).
    Write,
    /// Changes something and may destroy or overwrite (MCP's default for a tool that is not
    /// read-only): declared `consequential`.
    Consequential,
}

/// One MCP server: exactly one of `command` (stdio) and `url` (streamable HTTP).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct McpServerConfig {
    /// `[a-z0-9][a-z0-9_-]*`: its tools are `mcp.<name>.<tool>`.
    pub name: String,
    /// Program and arguments of a stdio server, e.g. `["node", "dist/index.js", "/srv/docs"]`.
    pub command: Vec<String>,
    /// Extra environment for the command (the host's own environment is inherited).
    pub env: BTreeMap<String, String>,
    /// Working directory for the command (empty: the host's).
    pub cwd: String,
    /// A streamable HTTP server's endpoint, e.g. `http://127.0.0.1:8000/mcp`.
    pub url: String,
    /// Sent as `Authorization: Bearer …` to the HTTP server (empty: nothing).
    pub bearer_token: String,
    /// Tenants whose runs may call this server's tools (`"*"`: every tenant). Policy decides
    /// who may call what; this is the host's own fence around a server holding one tenant's
    /// data or credentials, and it is required: a server serves nobody until it is named.
    pub tenants: Vec<String>,
    /// How long the host waits for one call's answer. The tools declare 2 s more as their
    /// `timeout_sec`, so the host's answer — a recorded failure naming the hang — reaches the
    /// executor before the executor gives up on the call.
    pub call_timeout_secs: u32,
    /// The operator's effect class per tool (the MCP tool name), overriding the server's
    /// annotations, which are untrusted hints used only as defaults.
    pub effects: BTreeMap<String, Effect>,
}

impl Default for McpServerConfig {
    fn default() -> Self {
        McpServerConfig {
            name: String::new(),
            command: Vec::new(),
            env: BTreeMap::new(),
            cwd: String::new(),
            url: String::new(),
            bearer_token: String::new(),
            tenants: Vec::new(),
            call_timeout_secs: 30,
            effects: BTreeMap::new(),
        }
    }
}

impl McpServerConfig {
    /// Whether `tenant`'s calls may reach this server (an empty tenant — the mesh's catalog
    /// listing every host's tools — sees every server).
    pub fn admits(&self, tenant: &str) -> bool {
        tenant.is_empty() || self.tenants.iter().any(|t| t == "*" || t == tenant)
    }
}

/// The parts of the file the host reads. Other sections are someone else's.
#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(default)]
struct HostFile {
    mcp: McpConfig,
    auth: AuthSection,
}

#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(default)]
struct AuthSection {
    /// The token this host presents to the policy and the ledger (a `*` token in a mesh).
    token: String,
}

/// The loaded configuration: the host's section and the token it presents.
#[derive(Debug, Clone, Default)]
pub struct Loaded {
    pub mcp: McpConfig,
    pub token: String,
}

impl Loaded {
    /// Defaults, then `file` (when given), then `WARDEN_MCP__*` and `WARDEN_AUTH__TOKEN`.
    pub fn load(file: Option<&Path>) -> Result<Loaded, ConfigError> {
        let mut f = Figment::from(Serialized::defaults(HostFile::default()));
        if let Some(path) = file {
            f = f.merge(Toml::file_exact(path));
        }
        let ours = |k: &str| {
            let k = k.to_ascii_lowercase();
            k.starts_with("mcp__") || k == "auth__token"
        };
        f = f.merge(Env::prefixed("WARDEN_").filter(move |k| ours(k.as_str())).split("__"));
        Self::from_figment(f)
    }

    /// Extracts and validates from any figment (tests inject values this way).
    fn from_figment(f: Figment) -> Result<Loaded, ConfigError> {
        let file: HostFile = f.extract().map_err(Box::new)?;
        file.mcp.validate()?;
        Ok(Loaded { mcp: file.mcp, token: file.auth.token })
    }

    /// From TOML text (tests and examples).
    pub fn from_toml(text: &str) -> Result<Loaded, ConfigError> {
        Self::from_figment(Figment::from(Serialized::defaults(HostFile::default())).merge(Toml::string(text)))
    }
}

/// `[a-z0-9][a-z0-9_-]*`, at most 32 characters: no dots, so `mcp.<server>.<tool>` splits
/// one way only.
fn valid_server_name(name: &str) -> bool {
    let mut chars = name.chars();
    name.len() <= 32
        && chars.next().is_some_and(|c| c.is_ascii_lowercase() || c.is_ascii_digit())
        && chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_' || c == '-')
}

impl McpConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.listen
            .parse::<SocketAddr>()
            .map_err(|e| invalid("mcp.listen", format!("'{}' is not host:port ({e})", self.listen)))?;
        for (key, e) in [("mcp.policy_endpoint", &self.policy_endpoint), ("mcp.ledger_endpoint", &self.ledger_endpoint)]
        {
            if !(e.starts_with("http://") || e.starts_with("https://")) {
                return Err(invalid(key, format!("'{e}' must be an http:// or https:// URL")));
            }
        }
        if self.state_path.is_empty() {
            return Err(invalid("mcp.state_path", "must name a file"));
        }
        for (key, v) in [("mcp.list_ttl_ms", self.list_ttl_ms), ("mcp.connect_timeout_ms", self.connect_timeout_ms)] {
            if v == 0 {
                return Err(invalid(key, "must be greater than zero"));
            }
        }
        let mut names = std::collections::BTreeSet::new();
        for (i, s) in self.servers.iter().enumerate() {
            let key = |k: &str| format!("mcp.servers[{i}].{k}");
            if !valid_server_name(&s.name) {
                return Err(invalid(key("name"), format!("'{}' is not [a-z0-9][a-z0-9_-]* (at most 32)", s.name)));
            }
            if !names.insert(s.name.as_str()) {
                return Err(invalid(key("name"), format!("'{}' names two servers", s.name)));
            }
            match (s.command.is_empty(), s.url.is_empty()) {
                (false, false) => return Err(invalid(key("url"), "a server has a command or a url, not both")),
                (true, true) => return Err(invalid(key("command"), "a server needs a command (stdio) or a url")),
                (true, false) if !(s.url.starts_with("http://") || s.url.starts_with("https://")) => {
                    return Err(invalid(key("url"), format!("'{}' must be an http:// or https:// URL", s.url)));
                }
                (false, true) if s.command[0].is_empty() => {
                    return Err(invalid(key("command"), "the program name is empty"));
                }
                _ => {}
            }
            if s.tenants.is_empty() {
                return Err(invalid(key("tenants"), "name the tenants this server serves (\"*\" for every tenant)"));
            }
            if let Some(t) = s.tenants.iter().find(|t| t.as_str() != "*" && check_id(t).is_err()) {
                return Err(invalid(key("tenants"), format!("'{t}' is not a tenant id")));
            }
            if !(1..=3600).contains(&s.call_timeout_secs) {
                return Err(invalid(key("call_timeout_secs"), "must be from 1 to 3600"));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The README's MCP example (`cat > mcp.toml <<TOML … TOML`) stays a valid configuration.
    #[test]
    fn the_readme_example_is_a_valid_configuration() {
        let readme = include_str!("../../../README.md");
        let opening = "cat > mcp.toml <<TOML\n";
        let start = readme.find(opening).expect("the README shows an mcp.toml") + opening.len();
        let end = start + readme[start..].find("\nTOML\n").expect("the heredoc ends");
        let text = readme[start..end].replace("$HOME", "/home/someone");
        let loaded = Loaded::from_toml(&text).unwrap_or_else(|e| panic!("README example: {e}\n{text}"));
        let fs = &loaded.mcp.servers[0];
        assert_eq!((fs.name.as_str(), fs.command[0].as_str()), ("fs", "node"));
        assert_eq!(fs.effects["write_file"], Effect::Write);
    }

    #[test]
    fn a_server_file_loads_and_bad_keys_are_named() {
        let ok = Loaded::from_toml(
            r#"
            [ledger]
            listen = "127.0.0.1:1"          # another binary's section: ignored here
            [auth]
            token = "service-token-0123456789"
            [auth.tokens]
            "x" = "*"
            [mcp]
            listen = "127.0.0.1:0"
            [[mcp.servers]]
            name = "fs"
            command = ["node", "index.js", "/srv"]
            tenants = ["acme"]
            effects = { write_file = "consequential", read_text_file = "read_only" }
            [[mcp.servers]]
            name = "search"
            url = "http://127.0.0.1:8000/mcp"
            tenants = ["*"]
            "#,
        )
        .expect("valid");
        assert_eq!(ok.token, "service-token-0123456789");
        assert_eq!(ok.mcp.servers[0].effects["write_file"], Effect::Consequential);
        assert!(ok.mcp.servers[0].admits("acme") && !ok.mcp.servers[0].admits("globex"));
        assert!(ok.mcp.servers[1].admits("globex"), "'*' serves every tenant");

        let bad = |toml: &str, key: &str| {
            let e = Loaded::from_toml(toml).expect_err(toml).to_string();
            assert!(e.contains(key), "{e} should name {key}");
        };
        bad("[[mcp.servers]]\nname = \"a.b\"\ncommand = [\"x\"]\ntenants = [\"t\"]\n", "mcp.servers[0].name");
        bad("[[mcp.servers]]\nname = \"a\"\ntenants = [\"t\"]\n", "mcp.servers[0].command");
        bad("[[mcp.servers]]\nname = \"a\"\ncommand = [\"x\"]\n", "mcp.servers[0].tenants");
        bad("[[mcp.servers]]\nname = \"a\"\ncommand = [\"x\"]\nurl = \"http://h/\"\ntenants = [\"t\"]\n", "url");
        bad("[[mcp.servers]]\nname = \"a\"\nurl = \"ftp://h/\"\ntenants = [\"t\"]\n", "mcp.servers[0].url");
        bad(
            "[[mcp.servers]]\nname = \"a\"\ncommand = [\"x\"]\ntenants = [\"t\"]\n[[mcp.servers]]\nname = \"a\"\ncommand = [\"y\"]\ntenants = [\"t\"]\n",
            "mcp.servers[1].name",
        );
        bad("[mcp]\nlisten_addr = 1\n", "listen_addr");
        bad(
            "[[mcp.servers]]\nname = \"a\"\ncommand = [\"x\"]\ntenants = [\"t\"]\neffects = { w = \"sometimes\" }\n",
            "sometimes",
        );
    }
}
