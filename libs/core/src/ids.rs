//! Identifier rules shared by every service, so a bad id is refused the same way everywhere.

/// Longest id Warden accepts (run ids, step ids, tenants, idempotency keys).
pub const MAX_ID_LEN: usize = 128;

/// Longest step id: short enough that `{run_id}:{step_id}:{attempt}` stays a valid id.
pub const MAX_STEP_ID_LEN: usize = 64;

/// Why an identifier was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdError {
    #[error("must not be empty")]
    Empty,
    #[error("must be at most {MAX_ID_LEN} characters")]
    TooLong,
    #[error("must be at most {MAX_STEP_ID_LEN} characters")]
    StepTooLong,
    #[error("must start with a letter or digit and contain only letters, digits, '-', '_', ':' or '.'")]
    BadCharacters,
}

/// Tenants, run ids and idempotency keys: `[A-Za-z0-9][A-Za-z0-9_.:-]*`, at most 128 chars.
pub fn check_id(id: &str) -> Result<(), IdError> {
    check_with(id, |c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | ':' | '.'))
}

/// Step ids may not contain '.' or ':' because templates address outputs as `{{id.output.x}}`.
pub fn check_step_id(id: &str) -> Result<(), IdError> {
    if id.len() > MAX_STEP_ID_LEN {
        return Err(IdError::StepTooLong);
    }
    check_with(id, |c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_'))
}

/// Tool names: `[A-Za-z0-9][A-Za-z0-9_.-]*` (`text.upper`, `kv.put`).
pub fn check_tool_name(name: &str) -> Result<(), IdError> {
    check_with(name, |c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

fn check_with(id: &str, allowed: impl Fn(char) -> bool) -> Result<(), IdError> {
    let first = id.chars().next().ok_or(IdError::Empty)?;
    if id.len() > MAX_ID_LEN {
        return Err(IdError::TooLong);
    }
    if !first.is_ascii_alphanumeric() || !id.chars().all(allowed) {
        return Err(IdError::BadCharacters);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids() {
        assert!(check_id("tenant-a").is_ok());
        assert!(check_id("0193a1b2-7c4d-7e8f-9a0b-1c2d3e4f5a6b").is_ok());
        assert_eq!(check_id(""), Err(IdError::Empty));
        assert_eq!(check_id("-x"), Err(IdError::BadCharacters));
        assert_eq!(check_id("a b"), Err(IdError::BadCharacters));
        assert_eq!(check_id(&"a".repeat(129)), Err(IdError::TooLong));
        assert!(check_step_id("step_1").is_ok());
        assert_eq!(check_step_id("a.b"), Err(IdError::BadCharacters));
    }
}
