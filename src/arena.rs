//! Bump arenas (in progress).
