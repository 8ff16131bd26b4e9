//! GPT-2-architecture language model in Burn: configuration and presets, deterministic
//! initialisation keyed by parameter path, keyed dropout, and the model.
//!
//! This crate deliberately knows nothing about distribution, optimisers, data or files:
//! sharding and training are applied to the built model from outside (torchtitan's rule).

pub mod config;
pub mod dropout;
pub mod gpt;
pub mod init;
pub mod kernels;
pub mod layers;
pub mod layout;

pub use config::{GptConfig, PRESETS};
pub use dropout::DropoutKey;
pub use gpt::{Gpt, ModelError, Tokens, cross_entropy};
