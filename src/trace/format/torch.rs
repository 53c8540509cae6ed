//! PyTorch.
