//! `ember-data`: everything between a text file and a batch of token ids. Tokenizers
//! (byte-level BPE training, Hugging Face `tokenizer.json` loading), a memory-mapped token file
//! format, prepared train/val directories with a shared cache, and a stateless rank-aware
//! batch sampler. It deliberately knows nothing about Burn tensors, models or communication:
//! batches leave as plain `Vec<i64>` so the `train` crate decides where they live.

mod atomic;
pub mod corpus;
pub mod error;
pub mod prepare;
pub mod sampler;
pub mod tokenizer;
pub mod tokens;

pub use corpus::{TINY_SHAKESPEARE, unigram_entropy};
pub use error::DataError;
pub use prepare::{PreparedData, TokenizerSpec, prepare, prepare_cached};
pub use sampler::{Batch, BatchPlan, STREAM_TRAIN, STREAM_VAL, Sampler, window_start};
pub use tokenizer::Tokenizer;
pub use tokens::{Dtype, Split, TokenFile, TokenHeader, TokenHeaderInfo, write_tokens};
