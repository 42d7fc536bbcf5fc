//! Cedar policies: who (a tenant) may call what (an action per tool) on which resource, with
//! the call's canonical arguments as the context.
//!
//! A policy directory holds `schema.cedarschema` and any number of `*.cedar` files. Every
//! policy is validated against the schema at load; a policy's rule id is its `@id("…")`
//! annotation, or `<file>:<n>`. Requests are built as
//! `principal = Tenant::"<tenant>"`, `action = Action::"<tool>"`, `resource = Tool::"<tool>"`,
//! `context = <arguments>` (typed by the schema's declaration of that action), so a tool the
//! schema does not declare, or arguments that do not fit it, are denied.
//!
//! Agents: when the run acts for an agent and the schema declares `entity Agent in [Tenant]`,
//! the principal is `Agent::"<tenant>/<agent>"`, a member of `Tenant::"<tenant>"`. A policy
//! written `principal in Tenant::"acme"` then covers the tenant and all its agents, and
//! `principal == Agent::"acme/billing-bot"` one agent; an action must list `Agent` among its
//! principals to be callable by agents. A schema without `Agent` keeps the tenant as the
//! principal. Action groups (`action in Action::"payments"`) resolve from the schema.
//!
//! Resources: when the schema declares `entity Resource in [Tool]` and an action lists
//! `Resource` among its resources, a call whose arguments carry a string `resource` (the
//! same argument capabilities scope) has the resource `Resource::"<resource>"`, a member of
//! `Tool::"<tool>"`; `resource in Tool::"kv.put"` still holds for it. Otherwise the resource
//! is `Tool::"<tool>"`.

use std::collections::HashMap;
use std::path::Path;
use std::str::FromStr;

use cedar_policy::{
    Authorizer, Context, Decision, Entities, Entity, EntityId, EntityTypeName, EntityUid, PolicyId, PolicySet, Request,
    Schema, ValidationMode, Validator,
};
use miette::Diagnostic;
use serde_json::Value;

use crate::rules::{RuleDecision, Verdict};

/// Name of the schema file in a policy directory.
pub const SCHEMA_FILE: &str = "schema.cedarschema";

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{file}:{line}: {reason}")]
pub struct LoadError {
    pub file: String,
    pub line: usize,
    pub reason: String,
}

/// A validated policy set with its schema.
pub struct CedarPolicies {
    set: PolicySet,
    schema: Schema,
    /// Entity type names parsed once: Tenant, Action, Tool.
    types: [EntityTypeName; 3],
    /// `Agent`, when the schema declares it.
    agent_type: Option<EntityTypeName>,
    /// `Resource`, when the schema declares it, and the actions that take one.
    resource_type: Option<EntityTypeName>,
    resource_actions: std::collections::HashSet<String>,
    /// Per action: the action entity and the groups it is in (from the schema).
    action_entities: HashMap<String, Entities>,
    /// Per action: only the policies that can apply to it (`action == …` for another action
    /// cannot), so a decision evaluates a handful of policies, not the whole set.
    per_action: HashMap<String, PolicySet>,
    authorizer: Authorizer,
    /// Digest of the files it was loaded from (to notice changes).
    pub digest: String,
    pub count: usize,
}

fn line_of(text: &str, offset: usize) -> usize {
    text[..offset.min(text.len())].bytes().filter(|b| *b == b'\n').count() + 1
}

/// The first labelled line of a diagnostic in `text` (1 when it has none).
fn diagnostic_line(d: &dyn Diagnostic, text: &str) -> usize {
    d.labels().and_then(|mut l| l.next()).map(|l| line_of(text, l.offset())).unwrap_or(1)
}

/// A digest of the directory's policy files (names and contents).
pub fn dir_digest(dir: &Path) -> std::io::Result<String> {
    let mut names: Vec<_> = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "cedar" || x == "cedarschema"))
        .collect();
    names.sort();
    let mut material = String::new();
    for p in names {
        material.push_str(&p.display().to_string());
        material.push('\0');
        material.push_str(&std::fs::read_to_string(&p)?);
        material.push('\0');
    }
    Ok(warden_core::sha256_hex(material))
}

/// Loads and validates a policy directory; every problem is reported with file and line.
pub fn load_dir(dir: &Path) -> Result<CedarPolicies, Vec<LoadError>> {
    let io = |file: &str, e: std::io::Error| vec![LoadError { file: file.to_string(), line: 0, reason: e.to_string() }];
    let digest = dir_digest(dir).map_err(|e| io(&dir.display().to_string(), e))?;
    let schema_path = dir.join(SCHEMA_FILE);
    let schema_text = std::fs::read_to_string(&schema_path).map_err(|e| io(&schema_path.display().to_string(), e))?;
    let schema = match Schema::from_cedarschema_str(&schema_text) {
        Ok((s, _warnings)) => s,
        Err(e) => {
            return Err(vec![LoadError {
                file: schema_path.display().to_string(),
                line: diagnostic_line(&e, &schema_text),
                reason: e.to_string(),
            }]);
        }
    };
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .map_err(|e| io(&dir.display().to_string(), e))?
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "cedar"))
        .collect();
    files.sort();
    let mut set = PolicySet::new();
    let mut origin: HashMap<PolicyId, (String, String)> = HashMap::new();
    let mut errors = Vec::new();
    for path in &files {
        let file = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|e| io(&file, e))?;
        let parsed = match PolicySet::from_str(&text) {
            Ok(p) => p,
            Err(e) => {
                errors.push(LoadError { file: file.clone(), line: diagnostic_line(&e, &text), reason: e.to_string() });
                continue;
            }
        };
        let stem = path.file_stem().map(|s| s.to_string_lossy().to_string()).unwrap_or_default();
        for (n, p) in parsed.policies().enumerate() {
            let id = p.annotation("id").map(str::to_string).unwrap_or_else(|| format!("{stem}:{n}"));
            let renamed = p.new_id(PolicyId::new(&id));
            if let Err(e) = set.add(renamed) {
                errors.push(LoadError { file: file.clone(), line: 1, reason: format!("policy '{id}': {e}") });
            }
            origin.insert(PolicyId::new(&id), (file.clone(), text.clone()));
        }
    }
    if !errors.is_empty() {
        return Err(errors);
    }
    let result = Validator::new(schema.clone()).validate(&set, ValidationMode::Strict);
    let invalid: Vec<LoadError> = result
        .validation_errors()
        .map(|e| {
            let (file, text) = origin.get(e.policy_id()).cloned().unwrap_or_default();
            LoadError { line: diagnostic_line(e, &text), file, reason: format!("policy '{}': {e}", e.policy_id()) }
        })
        .collect();
    if !invalid.is_empty() {
        return Err(invalid);
    }
    let count = set.policies().count();
    let parse = |t: &str| {
        EntityTypeName::from_str(t).map_err(|e| vec![LoadError { file: String::new(), line: 0, reason: e.to_string() }])
    };
    let types = [parse("Tenant")?, parse("Action")?, parse("Tool")?];
    let agent = parse("Agent")?;
    let agent_type = schema.entity_types().any(|t| *t == agent).then_some(agent);
    let resource = parse("Resource")?;
    let resource_actions = schema
        .actions()
        .filter(|a| schema.resources_for_action(a).is_some_and(|mut r| r.any(|t| *t == resource)))
        .map(|a| a.id().unescaped().to_string())
        .collect();
    let resource_type = schema.entity_types().any(|t| *t == resource).then_some(resource);
    let all_actions = schema
        .action_entities()
        .map_err(|e| vec![LoadError { file: schema_path.display().to_string(), line: 0, reason: e.to_string() }])?;
    let mut action_entities = HashMap::new();
    let mut per_action: HashMap<String, PolicySet> = HashMap::new();
    for action in schema.actions() {
        let mut subset = PolicySet::new();
        for p in set.policies() {
            let applies = match p.action_constraint() {
                cedar_policy::ActionConstraint::Eq(a) => &a == action,
                // `in` may name action groups: keep the policy (correct, just not pruned).
                cedar_policy::ActionConstraint::Any | cedar_policy::ActionConstraint::In(_) => true,
            };
            if applies {
                let _ = subset.add(p.clone());
            }
        }
        let name = action.id().unescaped().to_string();
        per_action.insert(name.clone(), subset);
        // The action and its groups (transitively), so `action in Action::"group"` holds.
        let mut mine = Vec::new();
        let mut todo = vec![action.clone()];
        while let Some(uid) = todo.pop() {
            if let Some(e) = all_actions.get(&uid).filter(|_| !mine.iter().any(|m: &Entity| m.uid() == uid)) {
                todo.extend(all_actions.ancestors(&uid).into_iter().flatten().cloned());
                mine.push(e.clone());
            }
        }
        let entities = Entities::from_entities(mine, None)
            .map_err(|e| vec![LoadError { file: schema_path.display().to_string(), line: 0, reason: e.to_string() }])?;
        action_entities.insert(name, entities);
    }
    Ok(CedarPolicies {
        set,
        schema,
        types,
        agent_type,
        resource_type,
        resource_actions,
        action_entities,
        per_action,
        authorizer: Authorizer::new(),
        digest,
        count,
    })
}

impl CedarPolicies {
    /// The decision for `agent` (empty: the tenant itself) of `tenant` calling `tool` with `args`
    /// (forbid wins; no permit denies).
    pub fn decide(&self, tenant: &str, agent: &str, tool: &str, args: &Value) -> RuleDecision {
        let deny = |rule: &str, reason: String| RuleDecision { verdict: Verdict::Deny, rule_id: rule.into(), reason };
        let uid = |i: usize, id: &str| EntityUid::from_type_name_and_id(self.types[i].clone(), EntityId::new(id));
        let (tenant_uid, action, tool_uid) = (uid(0, tenant), uid(1, tool), uid(2, tool));
        let no_entities = Entities::empty();
        let actions = self.action_entities.get(tool).unwrap_or(&no_entities);
        let mut members = Vec::new();
        let principal = match &self.agent_type {
            Some(t) if !agent.is_empty() => {
                // Agent ids are unique within a tenant only: the entity id carries both.
                let member = EntityUid::from_type_name_and_id(t.clone(), EntityId::new(format!("{tenant}/{agent}")));
                members.push(Entity::new_no_attrs(member.clone(), [tenant_uid].into_iter().collect()));
                member
            }
            _ => tenant_uid,
        };
        let named = args.get("resource").and_then(Value::as_str);
        let resource = match (&self.resource_type, named) {
            (Some(t), Some(name)) if self.resource_actions.contains(tool) => {
                let item = EntityUid::from_type_name_and_id(t.clone(), EntityId::new(name));
                members.push(Entity::new_no_attrs(item.clone(), [tool_uid].into_iter().collect()));
                item
            }
            _ => tool_uid,
        };
        let entities = if members.is_empty() {
            std::borrow::Cow::Borrowed(actions)
        } else {
            match actions.clone().add_entities(members, None) {
                Ok(e) => std::borrow::Cow::Owned(e),
                Err(e) => return deny("cedar_entities", format!("principal or resource of '{tool}': {e}")),
            }
        };
        let who = principal.to_string();
        let context = match Context::from_json_value(args.clone(), Some((&self.schema, &action))) {
            Ok(c) => c,
            Err(e) => return deny("cedar_context", format!("arguments do not fit the schema of '{tool}': {e}")),
        };
        let request = match Request::new(principal, action, resource, context, Some(&self.schema)) {
            Ok(r) => r,
            Err(e) => {
                return deny("cedar_request", format!("the schema does not let {who} call '{tool}': {e}"));
            }
        };
        let policies = self.per_action.get(tool).unwrap_or(&self.set);
        let response = self.authorizer.is_authorized(&request, policies, &entities);
        let by: Vec<String> = response.diagnostics().reason().map(|id| id.to_string()).collect();
        let errors: Vec<String> = response.diagnostics().errors().map(|e| e.to_string()).collect();
        match response.decision() {
            Decision::Allow => RuleDecision {
                verdict: Verdict::Allow,
                rule_id: format!("cedar:{}", by.join(",")),
                reason: format!("permitted by {}", by.join(", ")),
            },
            Decision::Deny if !by.is_empty() => {
                deny(&format!("cedar:{}", by.join(",")), format!("forbidden by {}", by.join(", ")))
            }
            Decision::Deny if !errors.is_empty() => {
                deny("cedar_error", format!("policy evaluation failed: {}", errors.join("; ")))
            }
            Decision::Deny => deny("cedar_default_deny", format!("no Cedar policy permits {who} to call '{tool}'")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const SCHEMA: &str = r#"
entity Tenant;
entity Tool;
action "echo" appliesTo { principal: [Tenant], resource: [Tool], context: {} };
action "email.send" appliesTo {
  principal: [Tenant], resource: [Tool],
  context: { to: String, subject: String, body: String }
};
"#;

    fn dir(files: &[(&str, &str)]) -> tempfile::TempDir {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join(SCHEMA_FILE), SCHEMA).unwrap();
        for (name, text) in files {
            std::fs::write(d.path().join(name), text).unwrap();
        }
        d
    }

    #[test]
    fn permits_forbids_and_denies_by_default() {
        let d = dir(&[(
            "mail.cedar",
            r#"@id("acme-may-echo")
permit(principal == Tenant::"acme", action == Action::"echo", resource);
@id("acme-mail")
permit(principal == Tenant::"acme", action == Action::"email.send", resource);
@id("internal-mail-only")
forbid(principal, action == Action::"email.send", resource) unless { context.to like "*@example.com" };
"#,
        )]);
        let p = load_dir(d.path()).unwrap();
        assert_eq!(p.count, 3);
        let ok = p.decide("acme", "", "echo", &json!({}));
        assert_eq!((ok.verdict, ok.rule_id.as_str()), (Verdict::Allow, "cedar:acme-may-echo"));
        let mail = json!({"to": "ops@example.com", "subject": "s", "body": "b"});
        assert_eq!(p.decide("acme", "", "email.send", &mail).verdict, Verdict::Allow);
        let out = p.decide("acme", "", "email.send", &json!({"to": "x@evil.test", "subject": "s", "body": "b"}));
        assert_eq!((out.verdict, out.rule_id.as_str()), (Verdict::Deny, "cedar:internal-mail-only"));
        assert_eq!(p.decide("globex", "", "echo", &json!({})).rule_id, "cedar_default_deny");
        assert_eq!(p.decide("acme", "", "shell.exec", &json!({})).verdict, Verdict::Deny);
        assert_eq!(p.decide("acme", "", "email.send", &json!({"to": 5})).rule_id, "cedar_context");
    }

    #[test]
    fn agents_are_principals_inside_their_tenant_and_action_groups_resolve() {
        let d = tempfile::tempdir().unwrap();
        let schema = r#"
entity Tenant;
entity Agent in [Tenant];
entity Tool;
action "payments";
action "pay" in ["payments"] appliesTo { principal: [Tenant, Agent], resource: [Tool], context: { amount: Long } };
action "echo" appliesTo { principal: [Tenant], resource: [Tool], context: {} };
"#;
        std::fs::write(d.path().join(SCHEMA_FILE), schema).unwrap();
        let policies = r#"
@id("bot-pays") permit(principal == Agent::"acme/billing-bot", action in Action::"payments", resource) when { context.amount < 100 };
@id("members-pay-little") permit(principal in Tenant::"acme", action == Action::"pay", resource) when { context.amount < 10 };
@id("acme-echo") permit(principal in Tenant::"acme", action == Action::"echo", resource);
"#;
        std::fs::write(d.path().join("p.cedar"), policies).unwrap();
        let p = load_dir(d.path()).unwrap();
        let pay = |tenant: &str, agent: &str, amount: i64| p.decide(tenant, agent, "pay", &json!({"amount": amount}));
        assert_eq!(pay("acme", "billing-bot", 50).rule_id, "cedar:bot-pays", "agent principal, action group");
        assert_eq!(pay("acme", "intern", 50).rule_id, "cedar_default_deny");
        let reason = pay("acme", "intern", 50).reason;
        assert!(reason.contains(r#"Agent::"acme/intern""#), "{reason}");
        assert_eq!(pay("acme", "intern", 5).rule_id, "cedar:members-pay-little", "an agent is in its tenant");
        assert_eq!(pay("acme", "", 5).rule_id, "cedar:members-pay-little", "the tenant itself");
        assert_eq!(pay("globex", "intern", 5).rule_id, "cedar_default_deny", "another tenant's agent");
        assert_eq!(pay("globex", "billing-bot", 50).rule_id, "cedar_default_deny", "agent ids are per tenant");
        assert_eq!(p.decide("acme", "", "echo", &json!({})).verdict, Verdict::Allow);
        assert_eq!(
            p.decide("acme", "billing-bot", "echo", &json!({})).rule_id,
            "cedar_request",
            "echo is not for agents"
        );
    }

    #[test]
    fn a_resource_named_in_the_arguments_is_the_cedar_resource() {
        let d = tempfile::tempdir().unwrap();
        let schema = r#"
entity Tenant;
entity Tool;
entity Resource in [Tool];
action "kv.put" appliesTo { principal: [Tenant], resource: [Tool, Resource], context: { resource?: String, value?: String } };
action "echo" appliesTo { principal: [Tenant], resource: [Tool], context: { resource?: String } };
"#;
        std::fs::write(d.path().join(SCHEMA_FILE), schema).unwrap();
        let policies = r#"
@id("puts") permit(principal, action == Action::"kv.put", resource in Tool::"kv.put");
@id("no-prod") forbid(principal, action == Action::"kv.put", resource == Resource::"prod/config");
@id("echo") permit(principal, action == Action::"echo", resource == Tool::"echo");
"#;
        std::fs::write(d.path().join("p.cedar"), policies).unwrap();
        let p = load_dir(d.path()).unwrap();
        let put = |r: Value| p.decide("acme", "", "kv.put", &r).rule_id;
        assert_eq!(put(json!({"resource": "dev/config", "value": "x"})), "cedar:puts");
        assert_eq!(put(json!({"resource": "prod/config", "value": "x"})), "cedar:no-prod");
        assert_eq!(put(json!({"value": "x"})), "cedar:puts", "no resource named: the tool is the resource");
        assert_eq!(p.decide("acme", "", "echo", &json!({"resource": "prod/config"})).rule_id, "cedar:echo");
    }

    #[test]
    fn a_bad_policy_is_refused_with_file_and_line() {
        let d = dir(&[
            ("ok.cedar", "permit(principal, action, resource);\n"),
            ("bad.cedar", "\n\npermit(principal, action, resource) when { 1 + };\n"),
        ]);
        let errs = load_dir(d.path()).err().unwrap();
        assert!(errs[0].file.ends_with("bad.cedar") && errs[0].line == 3, "{errs:?}");
        let d = dir(&[("typo.cedar", "\npermit(principal, action == Action::\"ecco\", resource);\n")]);
        let errs = load_dir(d.path()).err().unwrap();
        assert!(errs[0].file.ends_with("typo.cedar") && errs[0].reason.contains("ecco"), "{errs:?}");
        assert_eq!(errs[0].line, 2, "{errs:?}");
    }
}
