-- Capability handles (SPEC-KERN-01 §2.2). Only the SHA-256 of a handle is stored: the handle
-- itself is shown once, at issue, and cannot be recovered from the database.
CREATE TABLE capabilities (
    capability_id     TEXT PRIMARY KEY,
    handle_sha256     TEXT NOT NULL UNIQUE,
    tenant            TEXT NOT NULL,
    tool_patterns     TEXT NOT NULL,
    action_patterns   TEXT NOT NULL,
    resource_patterns TEXT NOT NULL,
    issued_at_ms      BIGINT NOT NULL,
    expires_at_ms     BIGINT NOT NULL,
    revoked           BIGINT NOT NULL DEFAULT 0,
    revoke_reason     TEXT NOT NULL DEFAULT ''
);
CREATE INDEX capabilities_tenant ON capabilities (tenant, capability_id);
