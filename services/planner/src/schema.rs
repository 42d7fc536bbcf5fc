//! What the model is shown and held to: the tools a run may call (with their signatures,
//! seed 002), the JSON Schema of an `ExecutionPlan` built from them (OpenAI's strict subset:
//! every field required, `additionalProperties: false`, tool names as an enum per step kind),
//! and the strict parse and validation of an answer against that catalog.

use std::collections::{BTreeMap, HashMap};

use serde_json::{Map, Value, json};
use warden_core::canonical::args_digest;
use warden_core::plan::{Plan, PlanLimits};
use warden_proto::v1 as pb;

/// A tool the model may plan with.
#[derive(Debug, Clone)]
pub struct AllowedTool {
    pub name: String,
    pub description: String,
    pub version: String,
    /// The declared input schema (an object schema; `{}` declares none).
    pub schema: Value,
}

impl AllowedTool {
    pub fn from_spec(spec: &pb::ToolSpec) -> AllowedTool {
        let schema = serde_json::from_str::<Value>(&spec.input_schema_json)
            .ok()
            .filter(Value::is_object)
            .unwrap_or_else(|| json!({"type": "object"}));
        AllowedTool {
            name: spec.name.clone(),
            description: spec.description.clone(),
            version: if spec.version.is_empty() { "0".into() } else { spec.version.clone() },
            schema,
        }
    }

    /// Seed 002's tool signature: name, version, schema version and hash.
    pub fn signature(&self) -> Value {
        json!({
            "name": self.name,
            "tool_version": self.version,
            "schema_version": "json-schema",
            "schema_hash": args_digest(&self.schema),
        })
    }
}

/// The catalog a planning round offers, sorted by name.
#[derive(Debug, Clone)]
pub struct Offer {
    pub tools: Vec<AllowedTool>,
}

impl Offer {
    pub fn new(mut tools: Vec<AllowedTool>) -> Offer {
        tools.sort_by(|a, b| a.name.cmp(&b.name));
        Offer { tools }
    }

    pub fn names(&self) -> Vec<String> {
        self.tools.iter().map(|t| t.name.clone()).collect()
    }

    pub fn signatures(&self) -> Vec<Value> {
        self.tools.iter().map(AllowedTool::signature).collect()
    }

    /// Hash of the tool signatures (not just the names): any schema change is drift.
    pub fn signatures_hash(&self) -> String {
        args_digest(&Value::Array(self.signatures()))
    }

    /// The answer's JSON Schema. A step is one of one object schema per tool, whose `tool` is
    /// that tool's name, whose `params` is its input schema made strict, and whose
    /// `alternatives` are other calls of the offer serving the same purpose, tried in order
    /// when the call fails for good (seed 001's branches); or a decomposition — a step with a
    /// `subgoal` instead of a tool, which opens a child frame planned for that sub-goal.
    ///
    /// Each call shape is defined once (`$defs`, under `warden_` names no tool's own reference
    /// means) and referred to, so the schema grows with the offer, not with its square.
    pub fn response_schema(&self, max_steps: usize) -> Value {
        let mut defs = Map::new();
        for (i, t) in self.tools.iter().enumerate() {
            let call = json!({
                "type": "object",
                "additionalProperties": false,
                "required": ["tool", "params"],
                "properties": {
                    "tool": {"type": "string", "enum": [t.name]},
                    "params": {"$ref": format!("#/$defs/warden_params_{i}")},
                },
            });
            embed(&t.schema, i, &mut defs);
            defs.insert(format!("warden_call_{i}"), call);
        }
        let calls: Vec<Value> =
            (0..self.tools.len()).map(|i| json!({"$ref": format!("#/$defs/warden_call_{i}")})).collect();
        defs.insert(
            "warden_alternatives".into(),
            json!({"type": "array", "maxItems": warden_core::plan::MAX_ALTERNATIVES, "items": {"anyOf": calls}}),
        );
        let mut step_kinds: Vec<Value> = self
            .tools
            .iter()
            .enumerate()
            .map(|(i, t)| {
                json!({
                    "type": "object",
                    "additionalProperties": false,
                    "required": ["id", "tool", "params", "depends_on", "alternatives"],
                    "properties": {
                        "id": {"type": "string"},
                        "tool": {"type": "string", "enum": [t.name]},
                        "params": {"$ref": format!("#/$defs/warden_params_{i}")},
                        "depends_on": {"type": "array", "items": {"type": "string"}},
                        "alternatives": {"$ref": "#/$defs/warden_alternatives"},
                    },
                })
            })
            .collect();
        // A decomposition; its sub-goal's size is checked when the answer is read (in bytes).
        if !step_kinds.is_empty() {
            step_kinds.push(json!({
                "type": "object",
                "additionalProperties": false,
                "required": ["id", "subgoal", "depends_on"],
                "properties": {
                    "id": {"type": "string"},
                    "subgoal": {"type": "string"},
                    "depends_on": {"type": "array", "items": {"type": "string"}},
                },
            }));
        }
        let steps = if step_kinds.is_empty() {
            json!({"type": "array", "maxItems": 0, "items": {"type": "object", "additionalProperties": false, "properties": {}, "required": []}})
        } else {
            json!({"type": "array", "maxItems": max_steps, "items": {"anyOf": step_kinds}})
        };
        let mut schema = json!({
            "type": "object",
            "additionalProperties": false,
            "required": ["reasoning", "steps", "direct_response"],
            "properties": {
                "reasoning": {"type": "string"},
                "steps": steps,
                "direct_response": {"type": ["string", "null"]},
            },
        });
        if !self.tools.is_empty() {
            schema["$defs"] = Value::Object(defs);
        }
        schema
    }
}

/// Puts tool `i`'s input schema into the response schema's `defs`: made strict, at
/// `warden_params_{i}`, and its own definitions (`$defs`, `definitions`) beside it, made strict
/// too, under names of the tool's own (`warden_{i}_{name}`, `warden_{i}_d_{name}`) — llama.cpp
/// names a grammar rule after a reference's last segment, so two tools' `Address` must not
/// share a name. Its local references are rewritten to where things now are; left as they
/// were, they would be resolved against the response schema's root and find nothing.
/// Definitions nested deeper (below a property's own object schema, or a definition's) stay
/// where they are ([`strict`] keeps them), renamed apart too ([`rename_nested_defs`]), and
/// pointers into them are rebased like any other. (Not kept: definitions inside members an
/// object schema loses to [`strict`] — `allOf`, `items`, `additionalProperties`, … of an
/// object — and references spelled percent-encoded are not rewritten.)
fn embed(schema: &Value, i: usize, defs: &mut Map<String, Value>) {
    let mut renamed = schema.clone();
    rename_nested_defs(&mut renamed, i);
    let schema = &renamed;
    let mut params = strict(schema);
    // The top level's own definitions are hoisted below, not kept twice.
    if let Some(p) = params.as_object_mut() {
        p.remove("$defs");
        p.remove("definitions");
    }
    rebase_refs(&mut params, i);
    if let Some(declared) = schema.as_object() {
        for (key, tag) in [("$defs", ""), ("definitions", "d_")] {
            let Some(Value::Object(own)) = declared.get(key) else { continue };
            for (name, def) in own {
                // `true`/`false` are schemas too, kept as they are.
                let mut def = if def.is_object() { strict(def) } else { def.clone() };
                rebase_refs(&mut def, i);
                defs.insert(format!("warden_{i}_{tag}{name}"), def);
            }
        }
    }
    defs.insert(format!("warden_params_{i}"), params);
}

/// Gives every definition below tool `i`'s top level a name of the tool's own, unique within
/// it (`warden_{i}_n{k}_{name}`), and points the tool's references to it there: grammar rules
/// are named after a reference's last segment, and two nested `address` definitions of
/// different shapes must not become one rule. (The top level's own are renamed when hoisted,
/// see [`embed`].)
fn rename_nested_defs(schema: &mut Value, i: usize) {
    let mut renames: Vec<(String, String)> = Vec::new();
    each_schema(schema, "", &mut |members, pointer| {
        // The top level's own are hoisted instead.
        if pointer.is_empty() {
            return;
        }
        for key in ["$defs", "definitions"] {
            let Some(Value::Object(own)) = members.get_mut(key) else { continue };
            let names: Vec<String> = own.keys().cloned().collect();
            for name in names {
                let new = format!("warden_{i}_n{}_{name}", renames.len());
                renames.push((
                    format!("{pointer}/{key}/{}", pointer_escape(&name)),
                    format!("{pointer}/{key}/{}", pointer_escape(&new)),
                ));
                if let Some(d) = own.remove(&name) {
                    own.insert(new, d);
                }
            }
        }
    });
    if renames.is_empty() {
        return;
    }
    each_ref(schema, &mut |r| {
        let Some(target) = r.strip_prefix('#') else { return };
        // Outer definitions were renamed first: a pointer into a nested one takes each
        // rename on its way down, in order.
        let mut to = target.to_string();
        for (old, new) in &renames {
            if let Some(rest) = to.strip_prefix(old.as_str())
                && (rest.is_empty() || rest.starts_with('/'))
            {
                to = format!("{new}{rest}");
            }
        }
        if to != target {
            *r = format!("#{to}");
        }
    });
}

/// Where a local reference of tool `i`'s schema points once embedded ([`embed`]); `None`
/// for one that is not a JSON pointer into the tool's own document (an anchor, `#name`,
/// resolves anywhere in the response schema; a URI is left alone).
fn rebased(reference: &str, i: usize) -> Option<String> {
    if reference == "#" {
        return Some(format!("#/$defs/warden_params_{i}"));
    }
    let pointer = reference.strip_prefix("#/")?;
    // A definition's name in a pointer is escaped (`~0`, `~1`); the prefix needs none.
    if let Some(rest) = pointer.strip_prefix("$defs/") {
        return Some(format!("#/$defs/warden_{i}_{rest}"));
    }
    if let Some(rest) = pointer.strip_prefix("definitions/") {
        return Some(format!("#/$defs/warden_{i}_d_{rest}"));
    }
    Some(format!("#/$defs/warden_params_{i}/{pointer}"))
}

/// Rewrites every local `$ref` of tool `i`'s schema ([`rebased`]).
fn rebase_refs(schema: &mut Value, i: usize) {
    each_ref(schema, &mut |r| {
        if let Some(to) = rebased(r, i) {
            *r = to;
        }
    });
}

/// Calls `f` on every `$ref` of a schema ([`each_schema`]).
fn each_ref(schema: &mut Value, f: &mut impl FnMut(&mut String)) {
    each_schema(schema, "", &mut |members, _| {
        if let Some(Value::String(r)) = members.get_mut("$ref") {
            f(r);
        }
    });
}

/// Calls `f` on every object of a schema that is a schema, with its JSON pointer from the
/// root (`""` for the root), before going below it (so `f` may rename what it finds there).
/// Members that map names to schemas (`properties`, `$defs`, …) are schemas whatever their
/// names (a property may be called `default` or `$ref`); `enum`, `const`, `default` and
/// `examples` hold data, left alone.
fn each_schema(schema: &mut Value, pointer: &str, f: &mut impl FnMut(&mut Map<String, Value>, &str)) {
    match schema {
        Value::Object(members) => {
            f(members, pointer);
            for (key, v) in members.iter_mut() {
                let here = format!("{pointer}/{}", pointer_escape(key));
                match key.as_str() {
                    "enum" | "const" | "default" | "examples" => {}
                    "properties" | "patternProperties" | "$defs" | "definitions" | "dependentSchemas" => {
                        if let Value::Object(named) = v {
                            for (name, s) in named.iter_mut() {
                                each_schema(s, &format!("{here}/{}", pointer_escape(name)), f);
                            }
                        }
                    }
                    _ => each_schema(v, &here, f),
                }
            }
        }
        Value::Array(items) => {
            for (n, item) in items.iter_mut().enumerate() {
                each_schema(item, &format!("{pointer}/{n}"), f);
            }
        }
        _ => {}
    }
}

/// A name as a JSON pointer segment (RFC 6901: `~` and `/` escaped).
fn pointer_escape(name: &str) -> String {
    name.replace('~', "~0").replace('/', "~1")
}

/// The names a schema's `required` lists.
fn required_names(schema: &Value) -> Vec<&str> {
    schema
        .get("required")
        .and_then(Value::as_array)
        .map(|r| r.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default()
}

/// A tool's input schema in OpenAI's strict subset: objects list every property as required
/// and allow no others; a property the tool does not require may be `null` (dropped again
/// when the answer is read, see [`drop_null_optionals`]). An object's own definitions
/// (`$defs`, `definitions`) are kept, made strict too, so references into them still resolve.
fn strict(schema: &Value) -> Value {
    let Some(obj) = schema.as_object() else {
        return json!({"type": "object", "additionalProperties": false, "properties": {}, "required": []});
    };
    let is_object = obj.get("type").and_then(Value::as_str) == Some("object") || obj.contains_key("properties");
    if !is_object {
        return schema.clone();
    }
    let required = required_names(schema);
    let mut props = Map::new();
    if let Some(p) = obj.get("properties").and_then(Value::as_object) {
        for (name, s) in p {
            let mut s = strict(s);
            if !required.contains(&name.as_str())
                && let Some(t) = s.get("type").cloned()
            {
                s["type"] = match t {
                    Value::String(t) => json!([t, "null"]),
                    Value::Array(mut ts) if !ts.contains(&json!("null")) => {
                        ts.push(json!("null"));
                        Value::Array(ts)
                    }
                    other => other,
                };
            }
            props.insert(name.clone(), s);
        }
    }
    let names: Vec<Value> = props.keys().map(|k| Value::String(k.clone())).collect();
    let mut out = Map::new();
    out.insert("type".into(), json!("object"));
    out.insert("additionalProperties".into(), json!(false));
    out.insert("properties".into(), Value::Object(props));
    out.insert("required".into(), Value::Array(names));
    if let Some(d) = obj.get("description") {
        out.insert("description".into(), d.clone());
    }
    for key in ["$defs", "definitions"] {
        if let Some(Value::Object(own)) = obj.get(key) {
            // `true`/`false` are schemas too, kept as they are.
            let own = own.iter().map(|(name, d)| (name.clone(), if d.is_object() { strict(d) } else { d.clone() }));
            out.insert(key.into(), Value::Object(own.collect()));
        }
    }
    Value::Object(out)
}

/// Removes `null` values the strict schema allowed for properties the tool does not require.
fn drop_null_optionals(params: &mut Value, schema: &Value) {
    let required = required_names(schema);
    if let Some(map) = params.as_object_mut() {
        map.retain(|k, v| !v.is_null() || required.contains(&k.as_str()));
    }
    drop_nested_nulls(params, schema, schema, 0);
}

/// How deep [`drop_nested_nulls`] follows a value (answers are bounded by the model's output;
/// this bounds the walk of a pathological one).
const MAX_NULL_DEPTH: usize = 32;

/// [`drop_null_optionals`] below the top level: inside a property's own object schema, the
/// items of an array, and a local definition a `$ref` names — wherever [`strict`] made a
/// property the tool does not require nullable. Only declared, optional properties lose a
/// `null`; the tool's own schema still judges what is left.
fn drop_nested_nulls(value: &mut Value, schema: &Value, root: &Value, depth: usize) {
    if depth >= MAX_NULL_DEPTH {
        return;
    }
    let Some(schema) = local_target(schema, root) else { return };
    match value {
        Value::Object(map) => {
            let Some(props) = schema.get("properties").and_then(Value::as_object) else { return };
            if depth > 0 {
                let required = required_names(schema);
                map.retain(|k, v| !(v.is_null() && props.contains_key(k) && !required.contains(&k.as_str())));
            }
            for (k, v) in map.iter_mut() {
                if let Some(s) = props.get(k) {
                    drop_nested_nulls(v, s, root, depth + 1);
                }
            }
        }
        Value::Array(items) => {
            if let Some(s) = schema.get("items") {
                items.iter_mut().for_each(|v| drop_nested_nulls(v, s, root, depth + 1));
            }
        }
        _ => {}
    }
}

/// `schema`, or the local definition its `$ref` (a JSON pointer into the tool's own schema,
/// `root`) names, following a few references in a row; `None` for one that leads nowhere.
fn local_target<'a>(mut schema: &'a Value, root: &'a Value) -> Option<&'a Value> {
    for _ in 0..8 {
        let Some(r) = schema.get("$ref").and_then(Value::as_str) else { return Some(schema) };
        schema = root.pointer(r.strip_prefix('#')?)?;
    }
    None
}

/// Drops the `null`s the strict schema allowed in one call's (a step's or an alternative's)
/// `params`, by its tool's declared schema.
fn drop_call_nulls(call: &mut Value, validators: &Validators) {
    let tool = call.get("tool").and_then(Value::as_str).unwrap_or_default().to_string();
    if let (Some(params), Some((schema, _))) = (call.get_mut("params"), validators.by_tool.get(&tool)) {
        drop_null_optionals(params, schema);
    }
}

/// Compiled input-schema validators of the offered tools.
pub struct Validators {
    by_tool: HashMap<String, (Value, Option<jsonschema::Validator>)>,
}

impl Validators {
    /// A tool whose declared schema does not compile is offered nothing to check against:
    /// its params are then refused (a tool host declaring a broken schema is a tool host bug
    /// the model cannot fix).
    pub fn new(offer: &Offer) -> Validators {
        let by_tool = offer
            .tools
            .iter()
            .map(|t| (t.name.clone(), (t.schema.clone(), jsonschema::validator_for(&t.schema).ok())))
            .collect();
        Validators { by_tool }
    }
}

/// Parses the model's answer strictly (a JSON object with exactly the plan's fields), then
/// validates it like an explicit plan (ids, tools of the offer, dependencies, cycles,
/// templates, size) and each step's params against its tool's input schema. The error is what
/// the model is shown on a repair pass.
pub fn parse_and_validate(
    text: &str,
    offer: &Offer,
    validators: &Validators,
    max_steps: usize,
    round: Option<(u32, &warden_core::replan::ReplanContext)>,
) -> Result<Plan, String> {
    let mut value: Value =
        serde_json::from_str(text.trim()).map_err(|e| format!("the answer is not valid JSON: {e}"))?;
    if let Some(obj) = value.as_object_mut() {
        // The schema makes `direct_response` required and nullable; a plan omits it.
        if obj.get("direct_response").is_some_and(Value::is_null) {
            obj.remove("direct_response");
        }
        if obj.get("direct_response").and_then(Value::as_str).is_some_and(|s| s.trim().is_empty()) {
            obj.remove("direct_response");
        }
        if let Some(steps) = obj.get_mut("steps").and_then(Value::as_array_mut) {
            for step in steps {
                drop_call_nulls(step, validators);
                // No alternatives is an empty list the strict schema asks for.
                if step.get("alternatives").and_then(Value::as_array).is_some_and(Vec::is_empty)
                    && let Some(o) = step.as_object_mut()
                {
                    o.remove("alternatives");
                }
                for alt in step.get_mut("alternatives").and_then(Value::as_array_mut).into_iter().flatten() {
                    drop_call_nulls(alt, validators);
                }
            }
        }
    }
    let plan = Plan::parse(&value.to_string()).map_err(|e| format!("{}: {e}", e.field()))?;
    if plan.direct_response.is_some() && !plan.steps.is_empty() {
        return Err("direct_response: answer directly (no steps) or plan steps (direct_response null), not both".into());
    }
    let known: BTreeMap<&str, ()> = offer.tools.iter().map(|t| (t.name.as_str(), ())).collect();
    let is_known = |t: &str| known.contains_key(t);
    let limits = PlanLimits { max_steps, known_tool: &is_known };
    // A replanning round's steps are checked as they will run: renamed where an id is taken,
    // after the kept steps they may build on.
    let plan = match round {
        Some((n, context)) if plan.direct_response.is_none() => {
            let revised = warden_core::plan::revise(&context.kept, &context.taken(), &plan, n, &limits)
                .map_err(|e| format!("{}: {e}", e.field()))?;
            Plan { steps: revised.steps, reasoning: plan.reasoning, direct_response: None, max_depth: None }
        }
        _ => {
            plan.validate(&limits).map_err(|e| format!("{}: {e}", e.field()))?;
            plan
        }
    };
    for (i, step) in plan.steps.iter().enumerate() {
        // A decomposition calls nothing itself: its frame is planned for its sub-goal.
        if step.subgoal.is_some() {
            continue;
        }
        let calls = std::iter::once((format!("steps[{i}]"), &step.tool, &step.params)).chain(
            step.alternatives
                .iter()
                .enumerate()
                .map(|(j, a)| (format!("steps[{i}].alternatives[{j}]"), &a.tool, &a.params)),
        );
        for (at, tool, params) in calls {
            // A templated value is resolved at run time; its type is checked then, by the host.
            if params.to_string().contains("{{") {
                continue;
            }
            match validators.by_tool.get(tool) {
                Some((_, Some(v))) => {
                    if let Some(err) = v.iter_errors(params).next() {
                        let path = err.instance_path.to_string();
                        return Err(format!("{at}.params{path}: {err} (tool '{tool}')"));
                    }
                }
                Some((_, None)) => {
                    return Err(format!("{at}: tool '{tool}' declares an input schema that does not compile"));
                }
                None => return Err(format!("{at}.tool: '{tool}' is not offered")),
            }
        }
    }
    Ok(plan)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn offer() -> Offer {
        Offer::new(vec![
            AllowedTool {
                name: "echo".into(),
                description: "echoes".into(),
                version: "1".into(),
                schema: json!({"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}),
            },
            AllowedTool {
                name: "kv.put".into(),
                description: "stores".into(),
                version: "1".into(),
                schema: json!({"type": "object", "properties": {"key": {"type": "string"}, "ttl": {"type": "integer"}}, "required": ["key"]}),
            },
        ])
    }

    /// A tool of the offer with `schema` as its input schema.
    fn tool(name: &str, schema: Value) -> AllowedTool {
        AllowedTool { name: name.into(), description: "d".into(), version: "1".into(), schema }
    }

    /// Follows a local `$ref` of the schema.
    fn resolve<'a>(schema: &'a Value, v: &'a Value) -> &'a Value {
        match v["$ref"].as_str() {
            Some(r) => schema.pointer(r.trim_start_matches('#')).expect("the reference resolves"),
            None => v,
        }
    }

    /// Tools whose input schemas refer to their own definitions (`$defs`, `definitions`, a
    /// pointer into themselves, an anchor): the references still find them inside the response
    /// schema, and two tools' definitions of the same name stay apart.
    #[test]
    fn a_tools_own_definitions_are_found_in_the_response_schema() {
        let mail = tool(
            "mail",
            json!({
                "type": "object",
                "properties": {
                    "to": {"$ref": "#/$defs/address"},
                    "cc": {"type": "array", "items": {"$ref": "#/definitions/address"}},
                    "reply": {"$ref": "#/properties/to"},
                    "kind": {"enum": [{"$ref": "#/not/a/reference"}]},
                    "default": {"$ref": "#/$defs/address"},
                    "priority": {"$ref": "#level"},
                },
                "required": ["to", "kind", "default", "priority"],
                "$defs": {
                    "address": {"type": "string", "maxLength": 8},
                    "level": {"$anchor": "level", "type": "integer"},
                },
                "definitions": {"address": {"type": "string", "maxLength": 8}},
            }),
        );
        // Another tool's `address` is a number.
        let call = tool(
            "call",
            json!({"type": "object", "properties": {"to": {"$ref": "#/$defs/address"}}, "required": ["to"],
                   "$defs": {"address": {"type": "integer"}}}),
        );
        let s = Offer::new(vec![mail, call]).response_schema(10);
        let validator = jsonschema::validator_for(&s).expect("every reference resolves");
        let answer = |to: Value, other: Value| {
            json!({"reasoning": "r", "direct_response": null, "steps": [
                {"id": "a", "tool": "mail", "depends_on": [], "alternatives": [],
                 "params": {"to": to, "cc": ["b@c"], "reply": "d@e", "kind": {"$ref": "#/not/a/reference"},
                            "default": "f@g", "priority": 1}},
                {"id": "b", "tool": "call", "depends_on": [], "alternatives": [], "params": {"to": other}}]})
        };
        assert!(validator.is_valid(&answer(json!("a@b"), json!(5))));
        assert!(!validator.is_valid(&answer(json!("far.too.long@example.org"), json!(5))), "the definition applies");
        assert!(!validator.is_valid(&answer(json!(5), json!(5))));
        assert!(!validator.is_valid(&answer(json!("a@b"), json!("a@b"))), "each tool has its own `address`");
        // Values of the schema that are data, not schemas (the enum), are left as they are.
        // (Tools are offered by name: `call` is 0, `mail` 1.)
        let kind = &s["$defs"]["warden_params_1"]["properties"]["kind"];
        assert_eq!(kind, &json!({"enum": [{"$ref": "#/not/a/reference"}]}));
        assert_eq!(s["$defs"]["warden_params_1"]["properties"]["priority"]["$ref"], json!("#level"));
        assert_eq!(s["$defs"]["warden_0_address"], json!({"type": "integer"}));
    }

    /// A property's own object schema may carry definitions of its own, referred to from
    /// inside it: they are kept (strict like the rest) and the references find them.
    #[test]
    fn definitions_nested_below_a_property_are_kept() {
        let ship = tool(
            "ship",
            json!({
                "type": "object",
                "properties": {
                    "parcel": {
                        "type": "object",
                        "properties": {
                            "to": {"$ref": "#/properties/parcel/$defs/address"},
                            "from": {"$ref": "#/properties/parcel/definitions/address"},
                        },
                        "required": ["to", "from"],
                        "$defs": {"address": {
                            "type": "object",
                            "properties": {"street": {"$ref": "#/properties/parcel/$defs/address/$defs/street"}},
                            "required": ["street"],
                            "$defs": {"street": {"type": "string", "maxLength": 20}},
                        }},
                        "definitions": {"address": {"type": "string", "maxLength": 8}},
                    },
                },
                "required": ["parcel"],
            }),
        );
        let s = Offer::new(vec![ship]).response_schema(10);
        let validator = jsonschema::validator_for(&s).expect("every reference resolves");
        let answer = |to: Value, from: Value| {
            json!({"reasoning": "r", "direct_response": null, "steps": [
                {"id": "a", "tool": "ship", "depends_on": [], "alternatives": [],
                 "params": {"parcel": {"to": to, "from": from}}}]})
        };
        assert!(validator.is_valid(&answer(json!({"street": "Main St"}), json!("home"))));
        assert!(!validator.is_valid(&answer(json!({"street": 5}), json!("home"))), "the $defs definition applies");
        assert!(!validator.is_valid(&answer(json!({"street": "x", "zip": "1"}), json!("home"))), "made strict");
        let long = json!({"street": "a street far longer than twenty"});
        assert!(!validator.is_valid(&answer(long, json!("home"))), "a definition inside a definition applies");
        assert!(!validator.is_valid(&answer(json!({"street": "x"}), json!("far too long"))), "definitions apply");
        let params = &s["$defs"]["warden_params_0"];
        assert!(params.get("$defs").is_none(), "the top level's own definitions are hoisted, not kept twice");
        // The two nested `address` definitions (an object, a string) have names apart, each
        // referred to where it is.
        let parcel = &params["properties"]["parcel"];
        let to = parcel["properties"]["to"]["$ref"].as_str().expect("a reference");
        let from = parcel["properties"]["from"]["$ref"].as_str().expect("a reference");
        let last = |r: &str| r.rsplit('/').next().unwrap_or_default().to_string();
        assert_ne!(last(to), last(from), "{to} / {from}");
        assert_eq!(resolve(&s, &parcel["properties"]["to"])["type"], json!("object"));
        assert_eq!(resolve(&s, &parcel["properties"]["from"])["type"], json!("string"));
    }

    #[test]
    fn schema_is_strict_and_names_tools_as_enums() {
        let s = offer().response_schema(10);
        assert_eq!(s["additionalProperties"], json!(false));
        assert_eq!(s["required"], json!(["reasoning", "steps", "direct_response"]));
        let kinds = s["properties"]["steps"]["items"]["anyOf"].as_array().unwrap();
        assert_eq!(kinds[0]["properties"]["tool"]["enum"], json!(["echo"]));
        let kv = resolve(&s, &kinds[1]["properties"]["params"]);
        assert_eq!(kv["required"], json!(["key", "ttl"]));
        assert_eq!(kv["properties"]["ttl"]["type"], json!(["integer", "null"]));
        assert_eq!(kv["additionalProperties"], json!(false));
    }

    #[test]
    fn the_schema_offers_alternatives_and_decompositions() {
        let s = offer().response_schema(10);
        let kinds = s["properties"]["steps"]["items"]["anyOf"].as_array().unwrap();
        assert_eq!(kinds.len(), 3, "one kind per tool and a decomposition");
        let alts = resolve(&s, &kinds[0]["properties"]["alternatives"]);
        assert_eq!(alts["maxItems"], json!(warden_core::plan::MAX_ALTERNATIVES));
        let kv = resolve(&s, &alts["items"]["anyOf"][1]);
        assert_eq!(kv["properties"]["tool"]["enum"], json!(["kv.put"]));
        assert_eq!(resolve(&s, &kv["properties"]["params"])["required"], json!(["key", "ttl"]));
        assert_eq!(kinds[2]["required"], json!(["id", "subgoal", "depends_on"]));
        assert!(Offer::new(vec![]).response_schema(10)["properties"]["steps"]["maxItems"] == json!(0));
        // Every reference resolves, and the schema is a JSON Schema an answer validates against.
        let answer = json!({"reasoning": "r", "direct_response": null, "steps": [
            {"id": "a", "tool": "echo", "params": {"text": "x"}, "depends_on": [],
             "alternatives": [{"tool": "kv.put", "params": {"key": "k", "ttl": null}}]},
            {"id": "b", "subgoal": "more", "depends_on": ["a"]},
        ]});
        let validator = jsonschema::validator_for(&s).expect("a JSON Schema");
        assert!(validator.is_valid(&answer));
        let wrong = json!({"reasoning": "r", "direct_response": null, "steps": [
            {"id": "a", "tool": "echo", "params": {"text": "x"}, "depends_on": [],
             "alternatives": [{"tool": "kv.put", "params": {"text": "x"}}]}]});
        assert!(!validator.is_valid(&wrong), "an alternative is held to its own tool's params");
    }

    #[test]
    fn alternatives_and_subgoals_are_read_and_checked_like_steps() {
        let o = offer();
        let v = Validators::new(&o);
        let answer = json!({"reasoning": "r", "direct_response": null, "steps": [
            {"id": "a", "tool": "echo", "params": {"text": "x"}, "depends_on": [],
             "alternatives": [{"tool": "kv.put", "params": {"key": "k", "ttl": null}}]},
            {"id": "b", "subgoal": "Find what a missed", "depends_on": ["a"]},
            {"id": "c", "tool": "echo", "params": {"text": "{{b.output}}"}, "depends_on": ["b"], "alternatives": []},
        ]});
        let plan = parse_and_validate(&answer.to_string(), &o, &v, 10, None).unwrap();
        assert_eq!(plan.steps[0].alternatives[0].params, json!({"key": "k"}), "optional nulls dropped");
        assert_eq!(plan.steps[1].subgoal.as_deref(), Some("Find what a missed"));
        assert!(plan.steps[2].alternatives.is_empty());
        let bad_alt = json!({"steps": [{"id": "a", "tool": "echo", "params": {"text": "x"}, "depends_on": [],
                                        "alternatives": [{"tool": "kv.put", "params": {"ttl": 3}}]}]});
        let e = parse_and_validate(&bad_alt.to_string(), &o, &v, 10, None).unwrap_err();
        assert!(e.contains("steps[0].alternatives[0].params"), "{e}");
        let unoffered = json!({"steps": [{"id": "a", "tool": "echo", "params": {"text": "x"}, "depends_on": [],
                                          "alternatives": [{"tool": "shell", "params": {}}]}]});
        assert!(parse_and_validate(&unoffered.to_string(), &o, &v, 10, None).unwrap_err().contains("shell"));
    }

    #[test]
    fn answers_are_parsed_strictly_and_validated() {
        let o = offer();
        let v = Validators::new(&o);
        let good = r#"{"reasoning":"r","direct_response":null,"steps":[{"id":"a","tool":"kv.put","params":{"key":"k","ttl":null},"depends_on":[]}]}"#;
        let plan = parse_and_validate(good, &o, &v, 10, None).unwrap();
        assert_eq!(plan.steps[0].params, json!({"key": "k"}));
        let cases = [
            ("not json", "not valid JSON"),
            (r#"{"steps":[],"extra":1}"#, "extra"),
            (r#"{"steps":[{"id":"a","tool":"shell","params":{},"depends_on":[]}]}"#, "shell"),
            (r#"{"steps":[{"id":"a","tool":"echo","params":{"text":"x"},"depends_on":["zz"]}]}"#, "zz"),
            (r#"{"steps":[{"id":"a","tool":"echo","params":{"text":5},"depends_on":[]}]}"#, "params"),
            (r#"{"steps":[{"id":"a","tool":"echo","params":{},"depends_on":[]}]}"#, "text"),
        ];
        for (text, needle) in cases {
            let e = parse_and_validate(text, &o, &v, 10, None).unwrap_err();
            assert!(e.contains(needle), "{text}: {e}");
        }
    }

    /// The strict schema lets the model fill an optional property with `null` at any depth
    /// (a property's object, an array's items, a definition): those are dropped before the
    /// tool's own schema judges the params, which would refuse them; a required property's
    /// `null`, and a value the tool declares nothing about, are left to it.
    #[test]
    fn nulls_for_optional_properties_are_dropped_at_every_depth() {
        let ship = tool(
            "ship",
            json!({
                "type": "object",
                "properties": {
                    "parcel": {"type": "object", "properties": {"to": {"type": "string"}, "note": {"type": "string"}},
                               "required": ["to"]},
                    "cc": {"type": "array", "items": {"$ref": "#/$defs/copy"}},
                },
                "required": ["parcel"],
                "$defs": {"copy": {"type": "object", "properties": {"to": {"type": "string"}, "memo": {"type": "string"}},
                                   "required": ["to"]}},
            }),
        );
        let o = Offer::new(vec![ship]);
        let v = Validators::new(&o);
        let answer = |params: Value| {
            json!({"reasoning": "r", "direct_response": null,
                   "steps": [{"id": "a", "tool": "ship", "params": params, "depends_on": [], "alternatives": []}]})
            .to_string()
        };
        let nulls =
            json!({"parcel": {"to": "x", "note": null}, "cc": [{"to": "y", "memo": null}, {"to": "z", "memo": "m"}]});
        let plan = parse_and_validate(&answer(nulls), &o, &v, 10, None).expect("the nulls are dropped");
        assert_eq!(plan.steps[0].params, json!({"parcel": {"to": "x"}, "cc": [{"to": "y"}, {"to": "z", "memo": "m"}]}));
        let required = json!({"parcel": {"to": null}});
        let e = parse_and_validate(&answer(required), &o, &v, 10, None).expect_err("a required property's null stays");
        assert!(e.contains("params"), "{e}");
    }
}
