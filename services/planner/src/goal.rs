//! Security before planning (seed 000 §10): a goal is bounded and redacted before it is
//! recorded or leaves Warden for a model provider.

use regex::Regex;
use tonic::Status;
use warden_config::PlannerConfig;
use warden_grpc::invalid_field;

/// The configured redaction patterns, compiled once.
#[derive(Debug, Clone)]
pub struct Redactor {
    patterns: Vec<(String, Regex)>,
    max_goal_bytes: usize,
}

/// A goal as it will be recorded and sent, and the names of the patterns that matched.
#[derive(Debug, Clone, PartialEq)]
pub struct CheckedGoal {
    pub text: String,
    pub redacted: Vec<String>,
}

impl Redactor {
    pub fn new(config: &PlannerConfig) -> anyhow::Result<Redactor> {
        let mut patterns = Vec::new();
        for (name, pattern) in config.redact.iter().filter(|(_, p)| !p.is_empty()) {
            // Bounded compiled size: a pattern is configuration, but never an unbounded one.
            let re = regex::RegexBuilder::new(pattern)
                .size_limit(1 << 20)
                .build()
                .map_err(|e| anyhow::anyhow!("planner.redact.{name}: {e}"))?;
            patterns.push((name.clone(), re));
        }
        Ok(Redactor { patterns, max_goal_bytes: config.max_goal_bytes })
    }

    /// Refuses an empty goal or one over the limit (INVALID_ARGUMENT naming `goal`), then
    /// replaces every match of every pattern with `[redacted:<name>]`.
    pub fn check(&self, goal: &str) -> Result<CheckedGoal, Status> {
        if goal.trim().is_empty() {
            return Err(invalid_field("goal", "must not be empty"));
        }
        if goal.len() > self.max_goal_bytes {
            return Err(invalid_field(
                "goal",
                format!("{} bytes is over the maximum of {} (planner.max_goal_bytes)", goal.len(), self.max_goal_bytes),
            ));
        }
        let mut text = goal.to_string();
        let mut redacted = Vec::new();
        for (name, re) in &self.patterns {
            if re.is_match(&text) {
                text = re.replace_all(&text, format!("[redacted:{name}]").as_str()).into_owned();
                redacted.push(name.clone());
            }
        }
        Ok(CheckedGoal { text, redacted })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn redactor() -> Redactor {
        Redactor::new(&PlannerConfig::default()).unwrap()
    }

    #[test]
    fn secrets_and_personal_data_are_redacted() {
        let g = redactor()
            .check("mail alice@example.com the key sk-abcdefghijklmnopqrstuv and card 4111 1111 1111 1111")
            .unwrap();
        assert_eq!(g.text, "mail [redacted:email] the key [redacted:openai_key] and card [redacted:card_number]");
        assert_eq!(g.redacted, vec!["card_number", "email", "openai_key"]);
        let plain = redactor().check("upper-case the word hello").unwrap();
        assert_eq!(plain.text, "upper-case the word hello");
        assert!(plain.redacted.is_empty());
    }

    #[test]
    fn empty_and_oversized_goals_name_the_field() {
        for bad in ["", "   ", &"x".repeat(8193)] {
            let e = redactor().check(bad).unwrap_err();
            assert_eq!(e.code(), tonic::Code::InvalidArgument);
            assert_eq!(warden_grpc::field_violations(&e)[0].0, "goal");
        }
    }
}
