//! Interop with other CUDA crates, each behind its cargo feature: the only place outside
//! [`cuda`](crate::cuda) that names their types.

#[cfg(feature = "cudarc")]
pub mod cudarc;
