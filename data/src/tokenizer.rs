//! A thin wrapper over Hugging Face `tokenizers`: train a GPT-2 style byte-level BPE from a
//! text, or load any `tokenizer.json`; encode, decode, save atomically and fingerprint.
//! It deliberately exposes no padding, truncation, special-token or batch-encoding options:
//! a GPT trainer only needs a flat stream of ids.

use std::fmt;
use std::path::Path;

use sha2::{Digest, Sha256};
use tokenizers::models::TrainerWrapper;
use tokenizers::models::bpe::{BPE, BpeTrainer};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;

use crate::atomic::write_bytes_atomic;
use crate::error::DataError;

/// Byte-level BPE needs one token per byte value before it can merge anything.
const BYTE_ALPHABET: usize = 256;

/// A tokenizer with its canonical JSON and that JSON's SHA-256 computed once, so the
/// fingerprint written into token files is exactly the hash of the bytes `save` writes.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// Compact serialisation; immutable because `inner` is never mutated after construction.
    json: String,
    /// Lower-case hex SHA-256 of `json`.
    sha256: String,
}

impl fmt::Debug for Tokenizer {
    // The vocabulary can be 50k entries; print its size and fingerprint instead.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size())
            .field("sha256", &self.sha256)
            .finish()
    }
}

impl Tokenizer {
    /// Trains a GPT-2 style byte-level BPE on `text`.
    ///
    /// The result has exactly `vocab_size` tokens (the 256 byte tokens, then merges in order
    /// of frequency) unless the text runs out of distinct pairs to merge first, in which case
    /// it has fewer: never more. Always read the size back with [`Tokenizer::vocab_size`].
    /// `vocab_size < 257` is refused: there would be no room for a single merge.
    ///
    /// Deterministic: the same `text` and `vocab_size` always give byte-identical JSON (the
    /// `tokenizers` trainer breaks count ties by pair id and sorts its alphabet).
    pub fn train_byte_level_bpe(text: &str, vocab_size: usize) -> Result<Tokenizer, DataError> {
        if vocab_size <= BYTE_ALPHABET {
            return Err(DataError::VocabTooSmall { vocab_size });
        }
        // Same pre-tokenizer settings as GPT-2: the regex split, and no prefix space so that
        // decode(encode(text)) == text exactly.
        let byte_level = ByteLevel::default().add_prefix_space(false);
        let mut inner = tokenizers::Tokenizer::new(BPE::default());
        inner.with_pre_tokenizer(Some(byte_level));
        inner.with_decoder(Some(ByteLevel::default()));

        let mut trainer: TrainerWrapper = BpeTrainer::builder()
            .vocab_size(vocab_size)
            // 1 rather than the usual 2: on small corpora we would rather reach the
            // requested size than stop early; rare merges are harmless for training.
            .min_frequency(1)
            .show_progress(false)
            // All 256 byte symbols up front, so any input (bytes never seen in training
            // included) stays encodable: no unknown token is ever needed.
            .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
            .build()
            .into();
        // One sequence, the whole text: training sees the same pre-tokenisation that
        // `encode(text)` will, including runs of newlines across line ends.
        inner
            .train(&mut trainer, std::iter::once(text))
            .map_err(|e| DataError::tokenizer("train a byte-level BPE", e))?;
        Self::from_inner(inner)
    }

    /// Loads a Hugging Face `tokenizer.json` (e.g. GPT-2's). A missing or malformed file
    /// gives an error naming the file and where to get a good one.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Tokenizer, DataError> {
        let path = path.as_ref();
        let file_err = |source| DataError::TokenizerFile {
            path: path.to_path_buf(),
            source,
        };
        let bytes = std::fs::read(path).map_err(|e| file_err(e.into()))?;
        let inner = tokenizers::Tokenizer::from_bytes(&bytes).map_err(file_err)?;
        Self::from_inner(inner)
    }

    fn from_inner(inner: tokenizers::Tokenizer) -> Result<Tokenizer, DataError> {
        let json = inner
            .to_string(false)
            .map_err(|e| DataError::tokenizer("serialise to JSON", e))?;
        let sha256 = sha256_hex(json.as_bytes());
        Ok(Tokenizer {
            inner,
            json,
            sha256,
        })
    }

    /// Writes the tokenizer as compact JSON to `path`, atomically (temp file in the same
    /// directory, fsync, rename), so concurrent readers never see a partial file.
    pub fn save(&self, path: impl AsRef<Path>) -> Result<(), DataError> {
        write_bytes_atomic(path.as_ref(), self.json.as_bytes())
    }

    /// The exact JSON that [`Tokenizer::save`] writes and [`Tokenizer::sha256`] hashes.
    pub fn to_json(&self) -> &str {
        &self.json
    }

    /// Encodes `text` into token ids, without adding any special tokens.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, DataError> {
        // `encode_fast` skips computing character offsets, which we never use.
        let encoding = self
            .inner
            .encode_fast(text, false)
            .map_err(|e| DataError::tokenizer("encode text", e))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Decodes ids back to text. For byte-level BPE this inverts [`Tokenizer::encode`]
    /// exactly; a slice that cuts a multi-byte character in half decodes that character
    /// lossily (U+FFFD).
    pub fn decode(&self, ids: &[u32]) -> Result<String, DataError> {
        self.inner
            .decode(ids, false)
            .map_err(|e| DataError::tokenizer("decode ids", e))
    }

    /// Number of token ids, added (special) tokens included: the embedding table size.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Lower-case hex SHA-256 of the serialised JSON: identifies the tokenizer in token
    /// file headers and cache keys.
    pub fn sha256(&self) -> String {
        self.sha256.clone()
    }
}

/// Lower-case hex SHA-256 of `bytes`.
pub(crate) fn sha256_hex(bytes: &[u8]) -> String {
    hex(&Sha256::digest(bytes))
}

/// Lower-case hex of `bytes` (a digest).
pub(crate) fn hex(bytes: &[u8]) -> String {
    use fmt::Write;
    bytes
        .iter()
        .fold(String::with_capacity(bytes.len() * 2), |mut s, b| {
            let _ = write!(s, "{b:02x}");
            s
        })
}

/// A byte-level BPE with 512 tokens trained on the first ~100 KB of Tiny Shakespeare,
/// trained once and shared by the tests of every module to keep them fast.
#[cfg(test)]
pub(crate) fn test_tokenizer() -> &'static Tokenizer {
    static TOK: std::sync::OnceLock<Tokenizer> = std::sync::OnceLock::new();
    TOK.get_or_init(|| Tokenizer::train_byte_level_bpe(test_training_text(), 512).unwrap())
}

/// The first ~100 KB of Tiny Shakespeare (cut on a character boundary).
#[cfg(test)]
pub(crate) fn test_training_text() -> &'static str {
    let text = crate::corpus::TINY_SHAKESPEARE;
    &text[..text.floor_char_boundary(100_000)]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_varied_text() {
        let tok = test_tokenizer();
        let samples = [
            "First Citizen:\nBefore we proceed any further, hear me speak.",
            "  leading spaces and trailing  ",
            "\n\n\nnewlines\r\nand\ttabs\n",
            "unicode: héllo wörld, Ελληνικά, 日本語, emoji 🦀🔥, combining e\u{301}",
            "",
            " ",
            "'s 't 're contractions, numbers 12345 and punctuation?!...",
        ];
        for text in samples {
            let ids = tok.encode(text).unwrap();
            assert!(ids.iter().all(|&i| (i as usize) < tok.vocab_size()));
            assert_eq!(tok.decode(&ids).unwrap(), text, "ids {ids:?}");
        }
    }

    #[test]
    fn trained_vocab_has_requested_size_and_compresses() {
        let tok = test_tokenizer();
        assert_eq!(tok.vocab_size(), 512);
        let text = test_training_text();
        let ids = tok.encode(text).unwrap();
        // Merges must actually be used: 512 tokens on English give well under a token per byte.
        assert!(
            (ids.len() as f64) < 0.6 * text.len() as f64,
            "{} tokens for {} bytes",
            ids.len(),
            text.len()
        );
    }

    #[test]
    fn training_is_deterministic() {
        let text = &test_training_text()[..30_000];
        let a = Tokenizer::train_byte_level_bpe(text, 400).unwrap();
        let b = Tokenizer::train_byte_level_bpe(text, 400).unwrap();
        assert_eq!(a.to_json(), b.to_json());
        assert_eq!(a.sha256(), b.sha256());
        // Golden value: also catches nondeterminism across processes (hash seeds differ per
        // process) and silent behaviour changes in the pinned `tokenizers` version.
        assert_eq!(
            a.sha256(),
            "03e78cc58b241c5d1eddd1923f4afcdfd2e91b0ec3ba5db6d327dfdfef3c1f36"
        );
        let c = Tokenizer::train_byte_level_bpe(text, 401).unwrap();
        assert_ne!(a.sha256(), c.sha256());
    }

    #[test]
    fn refuses_vocab_without_room_for_merges() {
        let err = Tokenizer::train_byte_level_bpe("abc", 256).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("256") && msg.contains("257"), "{msg}");
        assert!(Tokenizer::train_byte_level_bpe("abcabc", 257).is_ok());
    }

    #[test]
    fn tiny_text_gives_at_most_the_requested_vocab() {
        let tok = Tokenizer::train_byte_level_bpe("ab ab ab", 1000).unwrap();
        assert!(
            tok.vocab_size() > 256 && tok.vocab_size() < 1000,
            "{}",
            tok.vocab_size()
        );
        assert_eq!(tok.decode(&tok.encode("ab ba").unwrap()).unwrap(), "ab ba");
    }

    #[test]
    fn save_and_load_preserve_encoding_and_fingerprint() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokenizer.json");
        let tok = test_tokenizer();
        tok.save(&path).unwrap();
        let loaded = Tokenizer::from_file(&path).unwrap();
        assert_eq!(loaded.sha256(), tok.sha256());
        assert_eq!(sha256_hex(&std::fs::read(&path).unwrap()), tok.sha256());
        let text = "O Romeo, Romeo! wherefore art thou Romeo?";
        assert_eq!(loaded.encode(text).unwrap(), tok.encode(text).unwrap());
    }

    #[test]
    fn malformed_or_missing_file_error_names_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let bad = dir.path().join("broken-tokenizer.json");
        std::fs::write(&bad, b"{\"model\": 42").unwrap();
        let msg = Tokenizer::from_file(&bad).unwrap_err().to_string();
        assert!(msg.contains("broken-tokenizer.json"), "{msg}");
        assert!(msg.contains("tokenizer.json"), "{msg}");

        let missing = dir.path().join("nope.json");
        let msg = Tokenizer::from_file(&missing).unwrap_err().to_string();
        assert!(msg.contains("nope.json"), "{msg}");
    }

    /// GPT-2's byte-to-symbol table (`bytes_to_unicode` in openai/gpt-2 `encoder.py`):
    /// printable bytes map to themselves, the rest to U+0100 upwards in byte order.
    fn gpt2_byte_symbol(b: u8) -> char {
        let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        if printable(b) {
            b as char
        } else {
            let n = (0..b).filter(|&x| !printable(x)).count() as u32;
            char::from_u32(256 + n).unwrap()
        }
    }

    #[test]
    fn loads_a_gpt2_format_tokenizer_json() {
        // A miniature of GPT-2's tokenizer.json, field for field: 256 byte tokens in GPT-2
        // order, two merges, and <|endoftext|> both in the vocab and as an added token.
        let mut vocab = serde_json::Map::new();
        for b in 0..=255u8 {
            vocab.insert(gpt2_byte_symbol(b).to_string(), b.into());
        }
        vocab.insert("\u{120}t".into(), 256.into());
        vocab.insert("he".into(), 257.into());
        vocab.insert("<|endoftext|>".into(), 258.into());
        let json = serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null,
            "added_tokens": [{"id": 258, "special": true, "content": "<|endoftext|>",
                "single_word": false, "lstrip": false, "rstrip": false, "normalized": true}],
            "normalizer": null,
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true},
            "post_processor": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false},
            "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true},
            "model": {"dropout": null, "unk_token": null, "continuing_subword_prefix": "",
                "end_of_word_suffix": "", "fuse_unk": false, "vocab": vocab,
                "merges": ["\u{120} t", "h e"]}
        });
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("gpt2-mini.json");
        std::fs::write(&path, serde_json::to_vec(&json).unwrap()).unwrap();

        let tok = Tokenizer::from_file(&path).unwrap();
        assert_eq!(
            tok.vocab_size(),
            259,
            "the overlapping added token counts once"
        );
        let text = "he the<|endoftext|>\n é";
        let ids = tok.encode(text).unwrap();
        assert_eq!(&ids[..4], &[257, 256, 257, 258], "{ids:?}");
        assert_eq!(tok.decode(&ids).unwrap(), text);
    }

    #[test]
    fn sha256_matches_known_vector() {
        assert_eq!(
            sha256_hex(b"abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }
}
