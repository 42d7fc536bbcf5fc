//! From an MCP server's tools to Warden's catalog, and from an MCP tool result to a Warden
//! outcome.
//!
//! - Names: `mcp.<server>.<tool>`; a tool whose name Warden cannot carry (characters outside
//!   `[A-Za-z0-9_.-]`, or too long) is left out, with a warning.
//! - Input schemas are carried over as they are. One that is not JSON Schema keeps its tool in
//!   the catalog, so a plan naming it is accepted and each call fails — recorded, with the
//!   reason — instead of the tool silently vanishing.
//! - Effect class: the operator's `effects` entry, else the server's annotations — untrusted
//!   hints, so they are only defaults: `readOnlyHint: true` → read-only; otherwise
//!   `destructiveHint: false` → write; otherwise (MCP's default) consequential.

use serde_json::{Map, Value, json};
use warden_core::ids::{MAX_ID_LEN, check_tool_name};
use warden_proto::v1 as pb;

use crate::config::{Effect, McpServerConfig};

/// Extra time a tool declares beyond the host's own wait for the server, so the host answers
/// (a failure naming the hang, recorded) before the executor's timeout would leave the call's
/// outcome unknown.
pub const ANSWER_GRACE_SECS: u32 = 2;

/// One MCP tool as the host serves it.
#[derive(Debug, Clone)]
pub struct McpTool {
    /// The server's name for it.
    pub name: String,
    pub spec: pb::ToolSpec,
    /// Why its input schema is not JSON Schema, if it is not: every call then fails so.
    pub schema_problem: Option<String>,
    /// The SHA-256 of its declaration (`warden_grpc::catalog::declaration_sha256`), which an
    /// authorization naming one must name.
    pub declaration_sha256: String,
}

/// The Warden name of `tool` on `server`.
pub fn warden_name(server: &str, tool: &str) -> String {
    format!("mcp.{server}.{tool}")
}

/// Splits `mcp.<server>.<tool>`.
pub fn split_name(name: &str) -> Option<(&str, &str)> {
    name.strip_prefix("mcp.")?.split_once('.')
}

/// The effect class of `tool`: the operator's word, else the server's hints.
pub fn effect(server: &McpServerConfig, tool: &rmcp::model::Tool) -> Effect {
    if let Some(e) = server.effects.get(tool.name.as_ref()) {
        return *e;
    }
    let hints = tool.annotations.as_ref();
    if hints.and_then(|a| a.read_only_hint) == Some(true) {
        Effect::ReadOnly
    } else if hints.and_then(|a| a.destructive_hint) == Some(false) {
        Effect::Write
    } else {
        Effect::Consequential
    }
}

/// The host's view of one listed tool; `None` (with a warning) when Warden cannot name it.
pub fn from_mcp(server: &McpServerConfig, tool: &rmcp::model::Tool) -> Option<McpTool> {
    let name = warden_name(&server.name, &tool.name);
    if name.len() > MAX_ID_LEN || check_tool_name(&name).is_err() {
        tracing::warn!(server = %server.name, tool = %tool.name, "tool left out: its name is not a Warden tool name ([A-Za-z0-9_.-], at most 128 with the prefix)");
        return None;
    }
    let schema = Value::Object((*tool.input_schema).clone());
    let schema_problem = input_schema_problem(&schema).map(|p| format!("its input schema is not JSON Schema: {p}"));
    if let Some(p) = &schema_problem {
        tracing::warn!(server = %server.name, tool = %tool.name, problem = %p, "tool listed, but every call of it will fail");
    }
    let effect = effect(server, tool);
    let description = tool.description.as_deref().or(tool.title.as_deref()).unwrap_or_default();
    let spec = pb::ToolSpec {
        name,
        description: format!("{description} (MCP server '{}')", server.name).trim_start().to_string(),
        input_schema_json: warden_core::canonical_json(&schema),
        timeout_sec: server.call_timeout_secs + ANSWER_GRACE_SECS,
        // Idempotent means "asking again after a lost answer changes nothing": the executor
        // then re-invokes instead of stopping for an operator. The host cannot see what an MCP
        // server does, so it vouches only for reads — a read asked twice has no effect to
        // repeat. That rests on the read-only class, which is the operator's `effects` entry
        // or else the server's readOnlyHint: an untrusted hint, so an operator who does not
        // trust a server's read-only claims sets `effects` for its tools. MCP's own
        // idempotentHint is not used: it is the server's word about effects it has.
        idempotent: effect == Effect::ReadOnly,
        consequential: effect == Effect::Consequential,
        read_only: effect == Effect::ReadOnly,
        version: "mcp".into(),
        retry_policy: pb::RetryPolicy::None as i32,
        // This bridge keeps no durable mark of calls started, so a call whose answer was
        // lost goes to an operator unless the tool is a read.
        detects_in_doubt: false,
        output_schema_json: output_schema(tool).map(|s| warden_core::canonical_json(&s)).unwrap_or_default(),
        effect: match effect {
            Effect::ReadOnly => pb::Effect::ReadOnly,
            Effect::Write => pb::Effect::Mutating,
            Effect::Consequential => pb::Effect::Consequential,
        } as i32,
        risk_level: pb::RiskLevel::Unspecified as i32,
    };
    let declaration_sha256 = warden_grpc::catalog::declaration_sha256(&spec);
    Some(McpTool { name: tool.name.to_string(), spec, schema_problem, declaration_sha256 })
}

/// The output schema of a listed tool as Warden checks it: a step's output is the MCP result
/// (`text`, `content`, `structuredContent`), and an MCP `outputSchema` describes its
/// `structuredContent`, which a tool declaring one must return (MCP 2025-06-18, "Output
/// Schema"). A declared schema that is not JSON Schema is left out (the executor would not
/// check it either).
pub fn output_schema(tool: &rmcp::model::Tool) -> Option<Value> {
    let declared = Value::Object((*tool.output_schema.clone()?).clone());
    if subschema_problem(&declared, "#", 0).is_some() {
        return None;
    }
    Some(serde_json::json!({
        "type": "object",
        "required": ["structuredContent"],
        "properties": {"structuredContent": declared},
    }))
}

const TYPES: [&str; 7] = ["null", "boolean", "object", "array", "number", "string", "integer"];
/// Deeper than any real schema; bounds the recursion on a hostile one.
const MAX_DEPTH: usize = 64;

/// Why `schema` is not a JSON Schema for a tool's input (an object schema), if it is not. The
/// keywords JSON Schema defines must have the shapes the meta-schema gives them; unknown
/// keywords are allowed, as JSON Schema allows them.
pub fn input_schema_problem(schema: &Value) -> Option<String> {
    subschema_problem(schema, "#", 0).or_else(|| {
        let t = schema.get("type").filter(|t| *t != "object")?;
        Some(format!("#/type: a tool's input is an object, its schema's type must be \"object\", not {t}"))
    })
}

fn subschema_problem(schema: &Value, at: &str, depth: usize) -> Option<String> {
    if depth > MAX_DEPTH {
        return Some(format!("{at}: nested deeper than {MAX_DEPTH}"));
    }
    let obj = match schema {
        Value::Bool(_) => return None,
        Value::Object(o) => o,
        other => return Some(format!("{at}: a schema is an object or a boolean, not {other}")),
    };
    let sub = |v: &Value, key: &str| subschema_problem(v, &format!("{at}/{key}"), depth + 1);
    let schema_map = |key: &str, v: &Value| match v {
        Value::Object(m) => m.iter().find_map(|(k, s)| sub(s, &format!("{key}/{k}"))),
        other => Some(format!("{at}/{key}: must be an object of schemas, not {other}")),
    };
    let schema_list = |key: &str, v: &Value| match v {
        Value::Array(a) if !a.is_empty() => a.iter().enumerate().find_map(|(i, s)| sub(s, &format!("{key}/{i}"))),
        other => Some(format!("{at}/{key}: must be a non-empty array of schemas, not {other}")),
    };
    let count =
        |key: &str, v: &Value| (!v.is_u64()).then(|| format!("{at}/{key}: must be a non-negative integer, not {v}"));
    for (key, v) in obj {
        let problem = match key.as_str() {
            "type" => match v {
                Value::String(t) if TYPES.contains(&t.as_str()) => None,
                Value::Array(ts)
                    if !ts.is_empty() && ts.iter().all(|t| t.as_str().is_some_and(|t| TYPES.contains(&t))) =>
                {
                    None
                }
                other => Some(format!("{at}/type: {other} is not a JSON Schema type")),
            },
            "properties" | "patternProperties" | "$defs" | "definitions" | "dependentSchemas" => schema_map(key, v),
            "allOf" | "anyOf" | "oneOf" | "prefixItems" => schema_list(key, v),
            "items" => match v {
                // Draft 4–2019 tuples: an array of schemas.
                Value::Array(_) => schema_list(key, v),
                _ => sub(v, key),
            },
            "not"
            | "additionalProperties"
            | "additionalItems"
            | "contains"
            | "propertyNames"
            | "if"
            | "then"
            | "else"
            | "unevaluatedProperties"
            | "unevaluatedItems" => sub(v, key),
            "required" => match v {
                Value::Array(a) if a.iter().all(Value::is_string) => None,
                other => Some(format!("{at}/required: must be an array of property names, not {other}")),
            },
            "enum" => (!v.is_array()).then(|| format!("{at}/enum: must be an array, not {v}")),
            "minimum" | "maximum" | "exclusiveMinimum" | "exclusiveMaximum" | "multipleOf" => {
                // Draft 4 spelled the exclusive bounds as booleans.
                let draft4 = v.is_boolean() && key.starts_with("exclusive");
                (!(v.is_number() || draft4)).then(|| format!("{at}/{key}: must be a number, not {v}"))
            }
            "minLength" | "maxLength" | "minItems" | "maxItems" | "minProperties" | "maxProperties" | "minContains"
            | "maxContains" => count(key, v),
            "pattern" | "format" | "$ref" | "$id" | "$schema" | "title" | "description" => {
                (!v.is_string()).then(|| format!("{at}/{key}: must be a string, not {v}"))
            }
            _ => None,
        };
        if problem.is_some() {
            return problem;
        }
    }
    None
}

/// A completed MCP call as Warden output: the result's `content` blocks, its
/// `structuredContent` when it has one, and `text` — the text blocks joined — so a later step
/// can reference `{{step.output.text}}`.
pub fn output_of(result: &rmcp::model::CallToolResult) -> Value {
    let content = serde_json::to_value(&result.content).unwrap_or(Value::Array(vec![]));
    let mut out = Map::new();
    out.insert("text".into(), Value::String(text_of(result)));
    out.insert("content".into(), content);
    if let Some(structured) = &result.structured_content {
        out.insert("structuredContent".into(), structured.clone());
    }
    Value::Object(out)
}

/// The text blocks of a result, joined by newlines.
pub fn text_of(result: &rmcp::model::CallToolResult) -> String {
    result.content.iter().filter_map(|c| c.as_text().map(|t| t.text.as_str())).collect::<Vec<_>>().join("\n")
}

/// What a tool error says, as far as it says anything.
pub fn error_text(result: &rmcp::model::CallToolResult) -> String {
    let text = text_of(result);
    if !text.is_empty() {
        return text;
    }
    match &result.structured_content {
        Some(v) => v.to_string(),
        None => json!(result.content).to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tool(name: &str, schema: Value, annotations: Value) -> rmcp::model::Tool {
        serde_json::from_value(json!({"name": name, "inputSchema": schema, "annotations": annotations})).expect("tool")
    }

    fn server() -> McpServerConfig {
        McpServerConfig {
            name: "fs".into(),
            command: vec!["x".into()],
            tenants: vec!["acme".into()],
            ..McpServerConfig::default()
        }
    }

    #[test]
    fn hints_are_defaults_the_operator_overrides() {
        let s = server();
        let read = tool("read_file", json!({"type": "object"}), json!({"readOnlyHint": true}));
        let add = tool("create_directory", json!({"type": "object"}), json!({"destructiveHint": false}));
        let write = tool("write_file", json!({"type": "object"}), json!({}));
        let spec = |t: &rmcp::model::Tool, s: &McpServerConfig| from_mcp(s, t).expect("named").spec;
        let r = spec(&read, &s);
        assert_eq!(
            (r.name.as_str(), r.read_only, r.idempotent, r.consequential),
            ("mcp.fs.read_file", true, true, false)
        );
        let a = spec(&add, &s);
        assert_eq!((a.read_only, a.idempotent, a.consequential), (false, false, false));
        let w = spec(&write, &s);
        assert_eq!((w.read_only, w.idempotent, w.consequential), (false, false, true), "MCP's default: destructive");
        assert_eq!(w.timeout_sec, 32, "the host's 30 s wait plus the grace");

        // A server claiming a write tool only reads: the operator's word wins.
        let liar = tool("write_file", json!({"type": "object"}), json!({"readOnlyHint": true}));
        let mut s2 = server();
        s2.effects.insert("write_file".into(), Effect::Consequential);
        let w = spec(&liar, &s2);
        assert!(!w.idempotent && !w.read_only && w.consequential);
        // idempotentHint alone vouches for nothing.
        let hinted = tool("bump", json!({"type": "object"}), json!({"idempotentHint": true, "destructiveHint": false}));
        assert!(!spec(&hinted, &s).idempotent);
    }

    #[test]
    fn names_warden_cannot_carry_are_left_out() {
        assert!(from_mcp(&server(), &tool("has space", json!({}), json!({}))).is_none());
        assert!(from_mcp(&server(), &tool(&"x".repeat(130), json!({}), json!({}))).is_none());
        assert_eq!(split_name("mcp.fs.read.file"), Some(("fs", "read.file")));
        assert_eq!(split_name("echo"), None);
    }

    #[test]
    fn schemas_that_are_not_json_schema_are_named_with_the_reason() {
        let ok = [
            json!({"type": "object"}),
            json!({}),
            json!({"type": "object", "properties": {"path": {"type": "string", "minLength": 1}, "n": {"type": ["integer", "null"]}},
                   "required": ["path"], "additionalProperties": false, "$defs": {"x": true}}),
            json!({"type": "object", "properties": {"xs": {"type": "array", "items": {"anyOf": [{"type": "string"}, {"type": "number"}]}}}}),
        ];
        for s in ok {
            assert_eq!(input_schema_problem(&s), None, "{s}");
        }
        let bad = [
            (json!({"type": "banana"}), "#/type"),
            (json!({"type": "string"}), "must be \"object\""),
            (json!({"type": "object", "properties": {"x": 5}}), "#/properties/x"),
            (json!({"type": "object", "properties": [1, 2]}), "#/properties"),
            (json!({"type": "object", "required": "x"}), "#/required"),
            (
                json!({"type": "object", "properties": {"x": {"type": "array", "items": {"type": "bogus"}}}}),
                "#/properties/x/items/type",
            ),
            (json!({"type": "object", "properties": {"x": {"minLength": -1}}}), "minLength"),
            (json!({"anyOf": []}), "#/anyOf"),
        ];
        for (s, at) in bad {
            let p = input_schema_problem(&s).unwrap_or_else(|| panic!("{s} passed"));
            assert!(p.contains(at), "{p} should point at {at}");
        }
        let mut deep = json!({"type": "string"});
        for _ in 0..100 {
            deep = json!({"items": deep});
        }
        let deep = json!({"type": "object", "properties": {"x": deep}});
        assert!(input_schema_problem(&deep).expect("too deep").contains("deeper"));

        let t = tool("odd", json!({"type": "object", "properties": {"x": 5}}), json!({}));
        let listed = from_mcp(&server(), &t).expect("still listed");
        assert!(listed.schema_problem.expect("problem").contains("not JSON Schema"));
        let schema: Value = serde_json::from_str(&listed.spec.input_schema_json).expect("json");
        assert_eq!(schema, json!({"type": "object", "properties": {"x": 5}}), "carried over as given");
    }

    #[test]
    fn results_become_outputs_with_their_text() {
        let r: rmcp::model::CallToolResult = serde_json::from_value(json!({
            "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            "structuredContent": {"n": 1}
        }))
        .expect("result");
        let out = output_of(&r);
        assert_eq!(out["text"], "a\nb");
        assert_eq!(out["structuredContent"], json!({"n": 1}));
        assert_eq!(out["content"][1]["text"], "b");
    }
}
