//! GPT-2-architecture language model in Burn: configuration and presets, deterministic
//! initialisation, the model, and helpers to walk any module's parameters by name.
//!
//! This crate deliberately knows nothing about distribution, optimisers, data or files:
//! sharding and training are applied to the built model from outside (torchtitan's rule).

pub mod config;
pub mod gpt;
pub mod init;
pub mod layers;
pub mod named;

pub use config::{GptConfig, PRESETS};
pub use gpt::{Gpt, cross_entropy};
pub use named::{NamedTensor, named_grads, named_tensors, replace_named};
