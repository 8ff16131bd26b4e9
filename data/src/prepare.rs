//! Turning a text into a prepared data directory (`tokenizer.json`, `train.bin`, `val.bin`),
//! reopening one with consistency checks, and a content-addressed cache of such directories
//! that concurrent processes can share. It deliberately does not coordinate ranks (no
//! barrier, no lock): racing callers each build a private copy and the first rename wins.

use std::fs;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::atomic::{sync_dir, unique_temp_path, write_bytes_atomic};
use crate::error::DataError;
use crate::tokenizer::{Tokenizer, hex, sha256_hex};
use crate::tokens::{Split, TokenFile, TokenHeaderInfo, write_tokens};

/// Fraction of tokens held out for validation by [`prepare_cached`] (nanoGPT's 90/10 split).
pub const DEFAULT_VAL_FRACTION: f64 = 0.1;
/// File name of the tokenizer inside a prepared directory.
pub const TOKENIZER_FILE: &str = "tokenizer.json";
/// Each split needs at least one input token and its target.
const MIN_SPLIT_TOKENS: usize = 2;
/// Bumped when the prepared layout or split rule changes, so old cache entries are not reused.
const CACHE_KEY_VERSION: &[u8] = b"ember-prepare-v1\n";

/// A prepared data directory, opened and checked: the tokenizer and both memory-mapped splits.
#[derive(Debug)]
pub struct PreparedData {
    /// The directory holding `tokenizer.json`, `train.bin` and `val.bin`.
    pub dir: PathBuf,
    /// The tokenizer that produced both splits.
    pub tokenizer: Tokenizer,
    /// The first `1 - val_fraction` of the tokens.
    pub train: TokenFile,
    /// The last `val_fraction` of the tokens.
    pub val: TokenFile,
}

/// Which tokenizer [`prepare_cached`] should use.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TokenizerSpec {
    /// Train a byte-level BPE of this size on the text itself (only on a cache miss).
    Train {
        /// Requested vocabulary size (at least 257).
        vocab_size: usize,
    },
    /// Load a Hugging Face `tokenizer.json`, e.g. GPT-2's.
    File(PathBuf),
}

/// Tokenizes `text` and writes `out_dir/{tokenizer.json,train.bin,val.bin}`, then reopens the
/// directory. The split is by tokens: the first `floor(n * (1 - val_fraction))` are train, the
/// rest val, so the two files concatenated are exactly `tokenizer.encode(text)`.
/// `source_name` only labels error messages. Refuses an empty text, a `val_fraction` outside
/// (0, 1), and a text too short to give both splits at least 2 tokens.
pub fn prepare(
    text: &str,
    tokenizer: &Tokenizer,
    out_dir: &Path,
    val_fraction: f64,
    source_name: &str,
) -> Result<PreparedData, DataError> {
    write_prepared(text, tokenizer, out_dir, val_fraction, source_name)?;
    PreparedData::open(out_dir)
}

/// The writing half of [`prepare`], so [`prepare_cached`] can write into a temporary
/// directory and open the data only at its final path.
fn write_prepared(
    text: &str,
    tokenizer: &Tokenizer,
    out_dir: &Path,
    val_fraction: f64,
    source_name: &str,
) -> Result<(), DataError> {
    if !(val_fraction > 0.0 && val_fraction < 1.0) {
        return Err(DataError::Invalid(format!(
            "val_fraction {val_fraction} must be strictly between 0 and 1 (e.g. 0.1 for a 90/10 \
             split)"
        )));
    }
    if text.is_empty() {
        return Err(DataError::Invalid(format!(
            "source '{source_name}' is empty: there is nothing to tokenize; check the input file"
        )));
    }
    let tokens = tokenizer.encode(text)?;
    let n = tokens.len();
    let n_train = ((n as f64 * (1.0 - val_fraction)).floor() as usize).min(n);
    let n_val = n - n_train;
    if n_train < MIN_SPLIT_TOKENS || n_val < MIN_SPLIT_TOKENS {
        return Err(DataError::Invalid(format!(
            "source '{source_name}' tokenizes to only {n} tokens: a val_fraction of \
             {val_fraction} leaves {n_train} train and {n_val} val tokens, and each split needs \
             at least {MIN_SPLIT_TOKENS}; provide more text or adjust val_fraction"
        )));
    }

    fs::create_dir_all(out_dir).map_err(|e| DataError::io("create directory", out_dir, e))?;
    write_bytes_atomic(
        &out_dir.join(TOKENIZER_FILE),
        tokenizer.to_json().as_bytes(),
    )?;
    for (split, part) in [
        (Split::Train, &tokens[..n_train]),
        (Split::Val, &tokens[n_train..]),
    ] {
        let info = TokenHeaderInfo {
            vocab_size: tokenizer.vocab_size(),
            tokenizer_sha256: tokenizer.sha256(),
            split,
        };
        write_tokens(out_dir.join(split.file_name()), part, info)?;
    }
    Ok(())
}

impl PreparedData {
    /// Opens a directory written by [`prepare`]. Checks that both `.bin` headers carry the
    /// SHA-256 of the `tokenizer.json` bytes on disk, its vocabulary size, and the right
    /// split; a mismatch (files from different runs mixed together) is refused.
    pub fn open(dir: impl AsRef<Path>) -> Result<PreparedData, DataError> {
        let dir = dir.as_ref().to_path_buf();
        let tok_path = dir.join(TOKENIZER_FILE);
        let tokenizer = Tokenizer::from_file(&tok_path)?;
        // Hash the bytes on disk rather than re-serialising: that is what `prepare` hashed.
        let bytes = fs::read(&tok_path).map_err(|e| DataError::io("read", &tok_path, e))?;
        let tok_sha = sha256_hex(&bytes);

        let open_split = |split: Split| -> Result<TokenFile, DataError> {
            let file = TokenFile::open(dir.join(split.file_name()))?;
            let h = file.header();
            let problem = if h.split != split {
                Some(format!(
                    "{} says it holds the {:?} split",
                    split.file_name(),
                    h.split
                ))
            } else if h.tokenizer_sha256 != tok_sha {
                Some(format!(
                    "{} was written with tokenizer {} but {TOKENIZER_FILE} has hash {tok_sha}",
                    split.file_name(),
                    h.tokenizer_sha256
                ))
            } else if h.vocab_size != tokenizer.vocab_size() {
                Some(format!(
                    "{} has vocab_size {} but {TOKENIZER_FILE} has {}",
                    split.file_name(),
                    h.vocab_size,
                    tokenizer.vocab_size()
                ))
            } else {
                None
            };
            match problem {
                Some(p) => Err(DataError::Prepared {
                    dir: dir.clone(),
                    problem: format!(
                        "{p}; the files come from different runs: delete the directory and \
                         prepare the data again"
                    ),
                }),
                None => Ok(file),
            }
        };
        let train = open_split(Split::Train)?;
        let val = open_split(Split::Val)?;
        Ok(PreparedData {
            dir,
            tokenizer,
            train,
            val,
        })
    }
}

/// Like [`prepare`] with [`DEFAULT_VAL_FRACTION`], but cached under
/// `cache_root/<source_name>-<16 hex>` where the hex starts the SHA-256 of the text bytes and
/// the tokenizer spec (the vocab size, or the loaded tokenizer's hash). A cache hit is reused
/// (a BPE is only trained on a miss). A miss is prepared in a private temporary directory in
/// `cache_root` and renamed into place; if another process won the race the rename fails
/// because the directory exists, and that one is used. Stale temporaries from crashed runs
/// (`.<name>.tmp-*`) are left for the user to delete.
pub fn prepare_cached(
    text: &str,
    source_name: &str,
    tokenizer: TokenizerSpec,
    cache_root: &Path,
) -> Result<PreparedData, DataError> {
    let name_ok = !source_name.is_empty()
        && !source_name.starts_with('.')
        && source_name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c));
    if !name_ok {
        return Err(DataError::Invalid(format!(
            "source name {source_name:?} cannot name a cache directory: use ASCII letters, \
             digits, '-', '_' or '.', not starting with '.'"
        )));
    }
    let (loaded, spec_key) = match &tokenizer {
        TokenizerSpec::Train { vocab_size } => (None, format!("train-byte-level-bpe:{vocab_size}")),
        TokenizerSpec::File(path) => {
            let tok = Tokenizer::from_file(path)?;
            let key = format!("file:{}", tok.sha256());
            (Some(tok), key)
        }
    };
    let mut hasher = Sha256::new();
    hasher.update(CACHE_KEY_VERSION);
    // Length-prefix the text so (text, spec) pairs cannot collide by moving bytes across the
    // boundary between them.
    hasher.update((text.len() as u64).to_le_bytes());
    hasher.update(text.as_bytes());
    hasher.update(spec_key.as_bytes());
    hasher.update(DEFAULT_VAL_FRACTION.to_le_bytes());
    let key = hex(&hasher.finalize());
    let dir_name = format!("{source_name}-{}", &key[..16]);
    let final_dir = cache_root.join(&dir_name);

    // Only complete directories ever appear under the final name (they arrive by rename),
    // so existence means "complete"; `open` still verifies every file.
    if final_dir.exists() {
        return open_cached(&final_dir);
    }

    fs::create_dir_all(cache_root)
        .map_err(|e| DataError::io("create cache directory", cache_root, e))?;
    let tok = match (loaded, tokenizer) {
        (Some(tok), _) => tok,
        (None, TokenizerSpec::Train { vocab_size }) => {
            Tokenizer::train_byte_level_bpe(text, vocab_size)?
        }
        (None, TokenizerSpec::File(_)) => unreachable!("file tokenizers are loaded above"),
    };
    let tmp = unique_temp_path(cache_root, &dir_name);
    if let Err(e) = write_prepared(text, &tok, &tmp, DEFAULT_VAL_FRACTION, source_name) {
        let _ = fs::remove_dir_all(&tmp);
        return Err(e);
    }
    match fs::rename(&tmp, &final_dir) {
        Ok(()) => sync_dir(cache_root),
        // Another caller finished first: its directory has identical content (same key,
        // deterministic preparation), so discard ours and use it.
        Err(_) if final_dir.exists() => {
            let _ = fs::remove_dir_all(&tmp);
        }
        Err(e) => {
            let _ = fs::remove_dir_all(&tmp);
            return Err(DataError::io("rename into place", &final_dir, e));
        }
    }
    open_cached(&final_dir)
}

/// Opens a cache entry, adding the remedy (delete it) to any error.
fn open_cached(dir: &Path) -> Result<PreparedData, DataError> {
    PreparedData::open(dir).map_err(|e| DataError::Prepared {
        dir: dir.to_path_buf(),
        problem: format!("cache entry is unusable ({e}); delete this directory to rebuild it"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::corpus::TINY_SHAKESPEARE;
    use crate::tokenizer::test_tokenizer;
    use crate::tokens::Dtype;

    #[test]
    fn whole_corpus_round_trips_through_the_splits() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("shakespeare");
        let tok = test_tokenizer();
        let data = prepare(TINY_SHAKESPEARE, tok, &out, 0.1, "shakespeare").unwrap();

        let mut all = data.train.to_vec();
        all.extend(data.val.to_vec());
        assert_eq!(tok.decode(&all).unwrap(), TINY_SHAKESPEARE);
        assert_eq!(all, tok.encode(TINY_SHAKESPEARE).unwrap());

        for (file, split) in [(&data.train, Split::Train), (&data.val, Split::Val)] {
            let h = file.header();
            assert_eq!(h.count as usize, file.len());
            assert_eq!(h.dtype, Dtype::U16);
            assert_eq!(h.split, split);
            assert_eq!(h.vocab_size, 512);
            assert_eq!(h.tokenizer_sha256, tok.sha256());
        }
        let n = all.len();
        assert_eq!(data.train.len(), (n as f64 * 0.9).floor() as usize);
        assert_eq!(data.train.len() + data.val.len(), n);

        let again = PreparedData::open(&out).unwrap();
        assert_eq!(again.tokenizer.sha256(), tok.sha256());
        assert_eq!(again.val.to_vec(), data.val.to_vec());
    }

    #[test]
    fn truncated_split_is_refused_naming_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let text = &TINY_SHAKESPEARE[..20_000];
        prepare(text, test_tokenizer(), dir.path(), 0.1, "tiny").unwrap();
        let val = dir.path().join("val.bin");
        let len = fs::metadata(&val).unwrap().len();
        fs::OpenOptions::new()
            .write(true)
            .open(&val)
            .unwrap()
            .set_len(len - 10)
            .unwrap();
        let msg = PreparedData::open(dir.path()).unwrap_err().to_string();
        assert!(
            msg.contains("val.bin") && msg.contains(&len.to_string()),
            "{msg}"
        );
    }

    #[test]
    fn mixed_runs_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let text = &TINY_SHAKESPEARE[..20_000];
        prepare(text, test_tokenizer(), dir.path(), 0.1, "tiny").unwrap();
        // Replace the tokenizer with a different one: the .bin files no longer match it.
        let other = Tokenizer::train_byte_level_bpe(text, 300).unwrap();
        other.save(dir.path().join(TOKENIZER_FILE)).unwrap();
        let msg = PreparedData::open(dir.path()).unwrap_err().to_string();
        assert!(
            msg.contains("train.bin") && msg.contains("prepare the data again"),
            "{msg}"
        );
    }

    #[test]
    fn empty_or_too_short_text_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let tok = test_tokenizer();
        let msg = prepare("", tok, dir.path(), 0.1, "blank")
            .unwrap_err()
            .to_string();
        assert!(msg.contains("blank") && msg.contains("empty"), "{msg}");
        let msg = prepare("Hi there", tok, dir.path(), 0.1, "short")
            .unwrap_err()
            .to_string();
        assert!(msg.contains("short") && msg.contains("at least 2"), "{msg}");
        let msg = prepare(&TINY_SHAKESPEARE[..1000], tok, dir.path(), 1.0, "x")
            .unwrap_err()
            .to_string();
        assert!(msg.contains("val_fraction"), "{msg}");
        // Nothing was written by the refused calls.
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 0);
    }

    #[test]
    fn cache_is_reused_and_keyed_by_tokenizer() {
        let root = tempfile::tempdir().unwrap();
        let text = &TINY_SHAKESPEARE[..20_000];
        let spec = TokenizerSpec::Train { vocab_size: 300 };
        let a = prepare_cached(text, "tiny", spec.clone(), root.path()).unwrap();
        assert!(a.dir.starts_with(root.path()));
        let name = a.dir.file_name().unwrap().to_str().unwrap().to_owned();
        assert!(
            name.starts_with("tiny-") && name.len() == "tiny-".len() + 16,
            "{name}"
        );
        let modified = fs::metadata(a.dir.join("train.bin"))
            .unwrap()
            .modified()
            .unwrap();

        let b = prepare_cached(text, "tiny", spec, root.path()).unwrap();
        assert_eq!(a.dir, b.dir);
        let modified_again = fs::metadata(b.dir.join("train.bin"))
            .unwrap()
            .modified()
            .unwrap();
        assert_eq!(modified, modified_again, "cache hit must not rewrite files");
        assert_eq!(fs::read_dir(root.path()).unwrap().count(), 1);

        // A tokenizer file gives a different key, and its hash is what the data carries.
        let tok_path = root.path().join("external.json");
        test_tokenizer().save(&tok_path).unwrap();
        let c = prepare_cached(text, "tiny", TokenizerSpec::File(tok_path), root.path()).unwrap();
        assert_ne!(c.dir, a.dir);
        assert_eq!(c.train.header().tokenizer_sha256, test_tokenizer().sha256());
    }

    #[test]
    fn concurrent_callers_share_one_directory() {
        let root = tempfile::tempdir().unwrap();
        let text = &TINY_SHAKESPEARE[20_000..35_000];
        let spec = TokenizerSpec::Train { vocab_size: 280 };
        let results: Vec<_> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..4)
                .map(|_| s.spawn(|| prepare_cached(text, "race", spec.clone(), root.path())))
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap().unwrap())
                .collect()
        });
        for r in &results {
            assert_eq!(r.dir, results[0].dir);
            assert_eq!(r.train.to_vec(), results[0].train.to_vec());
        }
        // Exactly one entry: the losers removed their temporary directories.
        let entries: Vec<_> = fs::read_dir(root.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(entries.len(), 1, "{entries:?}");
    }

    #[test]
    fn cache_refuses_path_like_source_names() {
        let root = tempfile::tempdir().unwrap();
        let spec = TokenizerSpec::Train { vocab_size: 300 };
        for bad in ["", "../x", "a/b", ".hidden"] {
            assert!(
                prepare_cached("text", bad, spec.clone(), root.path()).is_err(),
                "{bad}"
            );
        }
    }
}
