//! Resolves `--data` / `--tokenizer` into prepared token files: the embedded corpus or a text
//! file (tokenized once and cached), or a directory made by `ember prepare`.

use std::path::{Path, PathBuf};

use anyhow::Context;
use ember_data::{PreparedData, TINY_SHAKESPEARE, TokenizerSpec, prepare_cached};

use crate::error::{CliError, CliResult, usage};
use crate::run::config::TrainConfig;

/// Where prepared corpora are cached: `$EMBER_CACHE_DIR`, else `$XDG_CACHE_HOME/ember`,
/// else `~/.cache/ember`, else `./.ember-cache`.
pub fn cache_root() -> PathBuf {
    if let Some(dir) = std::env::var_os("EMBER_CACHE_DIR") {
        return dir.into();
    }
    if let Some(dir) = std::env::var_os("XDG_CACHE_HOME") {
        return Path::new(&dir).join("ember");
    }
    match std::env::var_os("HOME") {
        Some(home) => Path::new(&home).join(".cache").join("ember"),
        None => PathBuf::from(".ember-cache"),
    }
}

/// The tokenizer to use: the `--tokenizer` file, or a BPE of `vocab_size` trained on the data.
pub fn tokenizer_spec(tokenizer: Option<&Path>, vocab_size: usize) -> CliResult<TokenizerSpec> {
    match tokenizer {
        Some(p) if !p.is_file() => Err(usage(format!(
            "--tokenizer {}: no such file; pass a Hugging Face tokenizer.json",
            p.display()
        ))),
        Some(p) => Ok(TokenizerSpec::File(p.to_path_buf())),
        None => Ok(TokenizerSpec::Train { vocab_size }),
    }
}

/// Reads a user's text file, refusing a missing (usage) or empty (runtime) one.
pub fn read_text(flag: &str, path: &Path) -> CliResult<String> {
    if !path.exists() {
        return Err(usage(format!(
            "{flag} {}: no such file or directory",
            path.display()
        )));
    }
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("{flag} {}: cannot read it as UTF-8 text", path.display()))?;
    if text.trim().is_empty() {
        return Err(CliError::Runtime(anyhow::anyhow!(
            "{flag} {}: the file is empty; give a text file with some content",
            path.display()
        )));
    }
    Ok(text)
}

/// Loads (preparing on first use) the data a run trains on.
pub fn load(config: &TrainConfig) -> CliResult<PreparedData> {
    let spec = tokenizer_spec(config.tokenizer.as_deref(), config.vocab_size)?;
    let cache = cache_root();
    let prepared = match &config.data {
        None => prepare_cached(TINY_SHAKESPEARE, "tinyshakespeare", spec, &cache),
        Some(dir) if dir.is_dir() => {
            if config.tokenizer.is_some() {
                return Err(usage(format!(
                    "--data {} is a prepared directory with its own tokenizer; drop --tokenizer \
                     or pass the text file instead",
                    dir.display()
                )));
            }
            PreparedData::open(dir)
        }
        Some(file) => {
            let text = read_text("--data", file)?;
            let stem = file
                .file_stem()
                .map_or("data".into(), |s| s.to_string_lossy().into_owned());
            prepare_cached(&text, &stem, spec, &cache)
        }
    };
    prepared.map_err(|e| CliError::Runtime(anyhow::Error::new(e)))
}
