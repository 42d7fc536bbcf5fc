//! Warden's domain, with no gRPC, no database and no async: plans and their validation,
//! `{{step.output}}` templates, RFC 8785 canonical JSON and the ledger's hash chain,
//! signed authorizations, and the fold of a run's events into its state.
//!
//! Everything here is deterministic and cheap to test; the services map it onto the wire.

pub mod ack;
pub mod auth;
pub mod canonical;
pub mod chain;
pub mod dag;
pub mod decision;
pub mod events;
pub mod export;
pub mod head;
pub mod ids;
pub mod plan;
pub mod receipt;
pub mod replan;
pub mod run;
pub mod signature;
pub mod template;
pub mod trace;

pub use canonical::{canonical_json, sha256_hex};
