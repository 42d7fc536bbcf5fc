//! The `warden.v1` gRPC contract, generated from `proto/warden/v1`.
//!
//! Client and server stubs sit behind the `client` and `server` features so a service can
//! depend on another's client without pulling in its server.

#![allow(clippy::all, missing_docs)]

pub mod v1 {
    tonic::include_proto!("warden.v1");
}

/// The encoded `FileDescriptorSet` of every served service, for gRPC reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("warden_descriptor");
