//! The one error type of `ember-data`: every message names the file or value at fault and
//! says what to do about it. It deliberately does not wrap Burn or training errors.

use std::path::PathBuf;

/// A boxed error from a dependency (the `tokenizers` crate reports errors this way).
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Everything that can go wrong while building tokenizers, writing or reading token files,
/// and planning batches.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    /// A filesystem operation failed; `action` says which (e.g. "create", "rename").
    #[error("could not {action} {}: {source}", path.display())]
    Io {
        /// What we were doing, as a verb phrase ("read", "create directory", ...).
        action: &'static str,
        /// The file or directory involved.
        path: PathBuf,
        /// The underlying OS error.
        #[source]
        source: std::io::Error,
    },

    /// A setting that cannot work with the data: the field, its value, and why.
    #[error("{field} = {value}: {reason}")]
    Setting {
        /// The field (`block_size`, `global_batch`, `grad_accum`).
        field: &'static str,
        /// Its value.
        value: usize,
        /// What is wrong with it and what would work.
        reason: String,
    },

    /// A tokenizer file could not be read or parsed.
    #[error(
        "could not load tokenizer {}: {source}. Expected a Hugging Face tokenizer.json \
         (e.g. GPT-2's from https://huggingface.co/openai-community/gpt2/resolve/main/tokenizer.json); \
         re-download it, or train a byte-level BPE instead",
        path.display()
    )]
    TokenizerFile {
        /// The file we tried to load.
        path: PathBuf,
        /// Why it failed (I/O or JSON).
        #[source]
        source: BoxError,
    },

    /// Training, encoding, decoding or serialising with a tokenizer failed.
    #[error("tokenizer failed to {what}: {source}")]
    Tokenizer {
        /// The operation, as a verb phrase ("train", "encode text", ...).
        what: String,
        /// The error reported by the `tokenizers` crate.
        #[source]
        source: BoxError,
    },

    /// A requested vocabulary is too small for byte-level BPE.
    #[error(
        "vocab_size {vocab_size} is too small for a byte-level BPE: it needs the 256 byte \
         tokens plus at least one merge; use a vocab_size of at least 257 (e.g. 512)"
    )]
    VocabTooSmall {
        /// The size that was asked for.
        vocab_size: usize,
    },

    /// A token id does not fit the vocabulary it is written with.
    #[error(
        "token {token} at position {index} is outside the vocabulary of size {vocab_size}; \
         the tokens and the tokenizer do not belong together"
    )]
    TokenOutOfRange {
        /// The offending id.
        token: u32,
        /// Where it is in the token sequence.
        index: usize,
        /// The declared vocabulary size.
        vocab_size: usize,
    },

    /// A token file is malformed (bad magic, header, dtype or length).
    #[error("token file {} is invalid: {problem}", path.display())]
    TokenFile {
        /// The file at fault.
        path: PathBuf,
        /// What is wrong with it and what to do.
        problem: String,
    },

    /// A prepared data directory is inconsistent (its files do not belong together).
    #[error("prepared data in {} is inconsistent: {problem}", dir.display())]
    Prepared {
        /// The directory at fault.
        dir: PathBuf,
        /// What is wrong with it and what to do.
        problem: String,
    },

    /// An argument or combination of arguments is refused; the message says which and why.
    #[error("{0}")]
    Invalid(String),
}

impl DataError {
    /// Wraps an I/O error with the action and path, so the message says what failed where.
    pub(crate) fn io(
        action: &'static str,
        path: impl Into<PathBuf>,
        source: std::io::Error,
    ) -> Self {
        DataError::Io {
            action,
            path: path.into(),
            source,
        }
    }

    /// Wraps a `tokenizers` error with the operation that failed.
    pub(crate) fn tokenizer(what: impl Into<String>, source: BoxError) -> Self {
        DataError::Tokenizer {
            what: what.into(),
            source,
        }
    }
}
