//! GPU tests (in progress).
