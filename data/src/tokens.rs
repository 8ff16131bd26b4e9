//! The token file format (`train.bin`, `val.bin`) and its memory-mapped reader.
//!
//! Layout: 8-byte magic `EMBTOK01`, a little-endian u64 header length, a JSON header padded
//! with spaces so that the payload starts at a multiple of 64 bytes, then `count`
//! little-endian tokens (u16 when the vocabulary fits, else u32). The JSON header makes files
//! self-describing (`head -c 300 train.bin` shows it) and ties them to the tokenizer by hash.
//! This module deliberately knows nothing about tokenizers or batching.

use std::fmt;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use serde::{Deserialize, Serialize};

use crate::atomic::write_atomic;
use crate::error::DataError;

/// First eight bytes of every token file; the trailing `01` is the layout version.
pub const MAGIC: &[u8; 8] = b"EMBTOK01";
/// Value of the header's `format` field.
pub const FORMAT: &str = "ember-tokens";
/// Value of the header's `version` field understood by this reader.
pub const VERSION: u32 = 1;
/// The payload starts at a multiple of this, so a u16/u32 view of it is always aligned and
/// starts on a cache line.
const PAYLOAD_ALIGN: usize = 64;
/// Magic plus the u64 header length.
const PREAMBLE: usize = 16;
/// Headers are ~200 bytes; refusing anything over 1 MiB stops a corrupt length from making
/// us parse (or allocate for) gigabytes.
const MAX_HEADER: u64 = 1 << 20;

/// How each token is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    /// Two little-endian bytes; used whenever the vocabulary has at most 65536 ids (GPT-2's
    /// 50257 included), halving the file size.
    U16,
    /// Four little-endian bytes; for larger vocabularies.
    U32,
}

impl Dtype {
    /// The narrowest dtype that holds every id below `vocab_size`.
    pub fn for_vocab(vocab_size: usize) -> Dtype {
        if vocab_size <= 1 << 16 {
            Dtype::U16
        } else {
            Dtype::U32
        }
    }

    /// Bytes per token.
    pub fn width(self) -> usize {
        match self {
            Dtype::U16 => 2,
            Dtype::U32 => 4,
        }
    }
}

/// Which part of the corpus a token file holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Split {
    /// The training tokens (the first part of the corpus).
    Train,
    /// The validation tokens (the last part of the corpus).
    Val,
}

impl Split {
    /// The file name used for this split in a prepared directory.
    pub fn file_name(self) -> &'static str {
        match self {
            Split::Train => "train.bin",
            Split::Val => "val.bin",
        }
    }
}

/// The JSON header of a token file. Field order is the on-disk order.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenHeader {
    /// Always [`FORMAT`].
    pub format: String,
    /// Always [`VERSION`] for files this crate reads.
    pub version: u32,
    /// Number of ids of the tokenizer; every token is below it.
    pub vocab_size: usize,
    /// Storage width, always `Dtype::for_vocab(vocab_size)`.
    pub dtype: Dtype,
    /// Number of tokens in the payload.
    pub count: u64,
    /// Hex SHA-256 of the tokenizer JSON that produced the tokens.
    pub tokenizer_sha256: String,
    /// Which split this file holds.
    pub split: Split,
}

/// What the caller of [`write_tokens`] supplies; the rest of the header is derived.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenHeaderInfo {
    /// Number of ids of the tokenizer.
    pub vocab_size: usize,
    /// Hex SHA-256 of the tokenizer JSON.
    pub tokenizer_sha256: String,
    /// Which split the tokens are.
    pub split: Split,
}

/// Writes `tokens` as a token file at `path`, atomically (temp file, fsync, rename).
/// Refuses an empty vocabulary and any token `>= vocab_size`. Returns the header written.
pub fn write_tokens(
    path: impl AsRef<Path>,
    tokens: &[u32],
    info: TokenHeaderInfo,
) -> Result<TokenHeader, DataError> {
    let path = path.as_ref();
    if info.vocab_size == 0 || info.vocab_size > 1 << 32 {
        return Err(DataError::Invalid(format!(
            "cannot write {}: vocab_size {} is outside 1..=2^32",
            path.display(),
            info.vocab_size
        )));
    }
    if let Some(index) = tokens.iter().position(|&t| t as usize >= info.vocab_size) {
        return Err(DataError::TokenOutOfRange {
            token: tokens[index],
            index,
            vocab_size: info.vocab_size,
        });
    }
    let header = TokenHeader {
        format: FORMAT.to_owned(),
        version: VERSION,
        vocab_size: info.vocab_size,
        dtype: Dtype::for_vocab(info.vocab_size),
        count: tokens.len() as u64,
        tokenizer_sha256: info.tokenizer_sha256,
        split: info.split,
    };
    let mut json = serde_json::to_string(&header)
        .map_err(|e| DataError::Invalid(format!("cannot serialise token header: {e}")))?;
    let padded = (PREAMBLE + json.len()).next_multiple_of(PAYLOAD_ALIGN) - PREAMBLE;
    json.extend(std::iter::repeat_n(' ', padded - json.len()));

    write_atomic(path, |w| {
        w.write_all(MAGIC)?;
        w.write_all(&(json.len() as u64).to_le_bytes())?;
        w.write_all(json.as_bytes())?;
        match header.dtype {
            // Range checked above, so the narrowing cast is lossless.
            Dtype::U16 => tokens
                .iter()
                .try_for_each(|&t| w.write_all(&(t as u16).to_le_bytes())),
            Dtype::U32 => tokens
                .iter()
                .try_for_each(|&t| w.write_all(&t.to_le_bytes())),
        }
    })?;
    Ok(header)
}

/// A validated, memory-mapped token file. Reading is zero-copy: the OS pages tokens in on
/// demand, so a multi-gigabyte corpus costs no resident memory up front.
pub struct TokenFile {
    path: PathBuf,
    header: TokenHeader,
    mmap: Mmap,
    /// Byte offset of the first token (a multiple of 64).
    offset: usize,
    /// Number of tokens, `header.count` as a usize.
    len: usize,
}

impl fmt::Debug for TokenFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TokenFile")
            .field("path", &self.path)
            .field("header", &self.header)
            .finish()
    }
}

impl TokenFile {
    /// Opens and validates `path`: magic, header JSON, format/version, dtype consistent with
    /// the vocabulary, payload alignment, and that the file length is exactly payload offset +
    /// count * width (so a truncated file is refused with the sizes), and that every token is
    /// below the vocabulary size (a damaged or foreign file is refused with the offset of the
    /// first one that is not).
    pub fn open(path: impl AsRef<Path>) -> Result<TokenFile, DataError> {
        let path = path.as_ref().to_path_buf();
        let bad = |problem: String| DataError::TokenFile {
            path: path.clone(),
            problem,
        };
        let file = File::open(&path).map_err(|e| DataError::io("open", &path, e))?;
        let file_len = file
            .metadata()
            .map_err(|e| DataError::io("stat", &path, e))?
            .len();
        if file_len < PREAMBLE as u64 {
            return Err(bad(format!(
                "it is {file_len} bytes, shorter than the {PREAMBLE}-byte preamble; it is not an \
                 ember token file or was cut short: delete it and prepare the data again"
            )));
        }
        // SAFETY: the map is read-only, and our writers never modify a token file in place:
        // they write a new file and rename it over the old one, which leaves this mapping on
        // the old inode. Only a process truncating the file behind our back could fault us,
        // the standard caveat of every memory-mapped reader.
        let mmap =
            unsafe { Mmap::map(&file) }.map_err(|e| DataError::io("memory-map", &path, e))?;
        let bytes: &[u8] = &mmap;

        if &bytes[..8] != MAGIC {
            return Err(bad(format!(
                "it starts with {:?}, not the magic {:?}; it is not an ember token file (or was \
                 written by an incompatible version): prepare the data again",
                String::from_utf8_lossy(&bytes[..8]),
                String::from_utf8_lossy(MAGIC)
            )));
        }
        let header_len = u64::from_le_bytes(bytes[8..16].try_into().expect("8 bytes"));
        if header_len > MAX_HEADER || PREAMBLE as u64 + header_len > file_len {
            return Err(bad(format!(
                "its header length {header_len} is corrupt (file is {file_len} bytes, headers are \
                 at most {MAX_HEADER}); prepare the data again"
            )));
        }
        let offset = PREAMBLE + header_len as usize;
        if !offset.is_multiple_of(PAYLOAD_ALIGN) {
            return Err(bad(format!(
                "its payload starts at byte {offset}, not a multiple of {PAYLOAD_ALIGN}; \
                 prepare the data again"
            )));
        }
        let header: TokenHeader =
            serde_json::from_slice(&bytes[PREAMBLE..offset]).map_err(|e| {
                bad(format!(
                    "its JSON header does not parse ({e}); prepare the data again"
                ))
            })?;
        if header.format != FORMAT || header.version != VERSION {
            return Err(bad(format!(
                "its header says format {:?} version {}, but this reader understands {FORMAT:?} \
                 version {VERSION}; prepare the data again with this version",
                header.format, header.version
            )));
        }
        if header.vocab_size == 0 || header.dtype != Dtype::for_vocab(header.vocab_size) {
            return Err(bad(format!(
                "its header pairs dtype {:?} with vocab_size {}, which this format never writes; \
                 prepare the data again",
                header.dtype, header.vocab_size
            )));
        }
        let width = header.dtype.width() as u64;
        let expected = header
            .count
            .checked_mul(width)
            .and_then(|n| n.checked_add(offset as u64));
        if expected != Some(file_len) {
            return Err(bad(format!(
                "its header promises {} tokens of {width} bytes after a {offset}-byte header, i.e. \
                 {} bytes, but the file is {file_len} bytes (truncated or corrupt, e.g. an \
                 interrupted copy): delete it and prepare the data again",
                header.count,
                expected.map_or_else(|| "an impossible number of".to_owned(), |e| e.to_string())
            )));
        }
        let len = usize::try_from(header.count).map_err(|_| {
            bad(format!(
                "{} tokens do not fit this platform's usize",
                header.count
            ))
        })?;
        let file = TokenFile {
            path,
            header,
            mmap,
            offset,
            len,
        };
        // Every id must index the embedding: one that does not would fail inside the model
        // (a panic in Burn's gather) at whatever step first draws it.
        if let Some((index, token)) = file.first_out_of_range() {
            return Err(DataError::TokenFile {
                path: file.path.clone(),
                problem: format!(
                    "token {token} at offset {index} is not below its vocabulary size {}; the file \
                 is corrupt or was written for another tokenizer: prepare the data again",
                    file.header.vocab_size
                ),
            });
        }
        Ok(file)
    }

    /// The first token `>= vocab_size`, with its offset (one pass over the payload).
    fn first_out_of_range(&self) -> Option<(usize, u32)> {
        let vocab = self.header.vocab_size as u64;
        let p = self.payload();
        let at = match self.header.dtype {
            Dtype::U16 => {
                let (chunks, _) = p.as_chunks::<2>();
                chunks
                    .iter()
                    .position(|c| u16::from_le_bytes(*c) as u64 >= vocab)
            }
            Dtype::U32 => {
                let (chunks, _) = p.as_chunks::<4>();
                chunks
                    .iter()
                    .position(|c| u32::from_le_bytes(*c) as u64 >= vocab)
            }
        }?;
        Some((at, self.get(at)))
    }

    /// Number of tokens.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when the file holds no tokens.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The parsed JSON header.
    pub fn header(&self) -> &TokenHeader {
        &self.header
    }

    /// The path this file was opened from (for error messages).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The token payload as raw little-endian bytes.
    fn payload(&self) -> &[u8] {
        &self.mmap[self.offset..]
    }

    /// Token `i`.
    ///
    /// # Panics
    /// If `i >= self.len()`, like slice indexing.
    pub fn get(&self, i: usize) -> u32 {
        assert!(
            i < self.len,
            "token index {i} out of range for {} ({} tokens)",
            self.path.display(),
            self.len
        );
        let p = self.payload();
        match self.header.dtype {
            Dtype::U16 => u16::from_le_bytes([p[2 * i], p[2 * i + 1]]) as u32,
            Dtype::U32 => u32::from_le_bytes(p[4 * i..4 * i + 4].try_into().expect("4 bytes")),
        }
    }

    /// Appends tokens `start .. start + n`, widened to i64 (Burn's integer element), to
    /// `out`. One range check up front; the copy itself walks fixed-size byte chunks, which
    /// the compiler turns into a bounds-check-free loop.
    ///
    /// # Panics
    /// If `start + n > self.len()`.
    pub fn read_into(&self, start: usize, n: usize, out: &mut Vec<i64>) {
        let end = start.checked_add(n).filter(|&e| e <= self.len);
        let Some(end) = end else {
            panic!(
                "read of tokens {start}..{start}+{n} is past the end of {} ({} tokens)",
                self.path.display(),
                self.len
            );
        };
        let w = self.header.dtype.width();
        let bytes = &self.payload()[start * w..end * w];
        out.reserve(n);
        match self.header.dtype {
            Dtype::U16 => {
                let (chunks, _) = bytes.as_chunks::<2>();
                out.extend(chunks.iter().map(|c| u16::from_le_bytes(*c) as i64));
            }
            Dtype::U32 => {
                let (chunks, _) = bytes.as_chunks::<4>();
                out.extend(chunks.iter().map(|c| u32::from_le_bytes(*c) as i64));
            }
        }
    }

    /// All tokens in order (one `get` per element: for tests and statistics, not hot loops).
    pub fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        (0..self.len).map(move |i| self.get(i))
    }

    /// All tokens copied into a vector.
    pub fn to_vec(&self) -> Vec<u32> {
        self.iter().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(vocab_size: usize, split: Split) -> TokenHeaderInfo {
        TokenHeaderInfo {
            vocab_size,
            tokenizer_sha256: "ab".repeat(32),
            split,
        }
    }

    #[test]
    fn u16_round_trip_with_aligned_payload() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("train.bin");
        let tokens: Vec<u32> = (0..1000).map(|i| (i * 37) % 50257).collect();
        let written = write_tokens(&path, &tokens, info(50257, Split::Train)).unwrap();
        assert_eq!(written.dtype, Dtype::U16);

        let f = TokenFile::open(&path).unwrap();
        assert_eq!(f.header(), &written);
        assert_eq!(f.len(), 1000);
        assert!(!f.is_empty());
        assert_eq!(f.to_vec(), tokens);
        assert_eq!(f.get(999), tokens[999]);
        assert_eq!(f.offset % 64, 0);
        let file_len = std::fs::metadata(&path).unwrap().len() as usize;
        assert_eq!(file_len, f.offset + 2 * 1000);

        let mut out = vec![-1i64];
        f.read_into(10, 5, &mut out);
        let want: Vec<i64> = std::iter::once(-1)
            .chain(tokens[10..15].iter().map(|&t| t as i64))
            .collect();
        assert_eq!(out, want);
    }

    #[test]
    fn header_is_readable_json_with_spec_fields() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("val.bin");
        write_tokens(&path, &[1, 2, 3], info(512, Split::Val)).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(&bytes[..8], b"EMBTOK01");
        let hlen = u64::from_le_bytes(bytes[8..16].try_into().unwrap()) as usize;
        let json = std::str::from_utf8(&bytes[16..16 + hlen])
            .unwrap()
            .trim_end();
        assert_eq!(
            json,
            format!(
                r#"{{"format":"ember-tokens","version":1,"vocab_size":512,"dtype":"u16","count":3,"tokenizer_sha256":"{}","split":"val"}}"#,
                "ab".repeat(32)
            )
        );
    }

    #[test]
    fn large_vocab_uses_u32() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.bin");
        let tokens = vec![0, 65536, 100_000, 7];
        write_tokens(&path, &tokens, info(100_001, Split::Train)).unwrap();
        let f = TokenFile::open(&path).unwrap();
        assert_eq!(f.header().dtype, Dtype::U32);
        assert_eq!(f.to_vec(), tokens);
        let mut out = Vec::new();
        f.read_into(1, 3, &mut out);
        assert_eq!(out, vec![65536, 100_000, 7]);
        assert_eq!(Dtype::for_vocab(65536), Dtype::U16);
        assert_eq!(Dtype::for_vocab(65537), Dtype::U32);
    }

    #[test]
    fn refuses_out_of_range_token() {
        let dir = tempfile::tempdir().unwrap();
        let err = write_tokens(dir.path().join("t.bin"), &[1, 512], info(512, Split::Train))
            .unwrap_err()
            .to_string();
        assert!(err.contains("512") && err.contains("position 1"), "{err}");
    }

    #[test]
    fn reading_refuses_an_id_past_the_vocabulary_naming_file_offset_and_size() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("train.bin");
        write_tokens(&path, &[3, 1, 4, 1, 5], info(512, Split::Train)).unwrap();
        // Damage the payload in place: token 3 becomes 600 (0x0258, little-endian).
        let mut bytes = std::fs::read(&path).unwrap();
        let payload = bytes.len() - 2 * 5;
        bytes[payload + 6..payload + 8].copy_from_slice(&600u16.to_le_bytes());
        std::fs::write(&path, &bytes).unwrap();
        let msg = TokenFile::open(&path).unwrap_err().to_string();
        assert!(
            msg.contains("train.bin")
                && msg.contains("token 600 at offset 3")
                && msg.contains("vocabulary size 512"),
            "{msg}"
        );
    }

    #[test]
    fn refuses_truncated_file_naming_it_and_sizes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("train.bin");
        write_tokens(&path, &[5; 100], info(512, Split::Train)).unwrap();
        let full = std::fs::metadata(&path).unwrap().len();
        let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        f.set_len(full - 3).unwrap();
        let msg = TokenFile::open(&path).unwrap_err().to_string();
        assert!(msg.contains("train.bin"), "{msg}");
        assert!(
            msg.contains(&full.to_string()) && msg.contains(&(full - 3).to_string()),
            "{msg}"
        );
    }

    #[test]
    fn refuses_bad_magic_and_garbage_header() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.bin");
        std::fs::write(&path, b"NOTATOKENFILE...................").unwrap();
        let msg = TokenFile::open(&path).unwrap_err().to_string();
        assert!(msg.contains("x.bin") && msg.contains("magic"), "{msg}");

        let mut bytes = b"EMBTOK01".to_vec();
        bytes.extend(48u64.to_le_bytes());
        bytes.extend([b'{'; 48]);
        std::fs::write(&path, &bytes).unwrap();
        let msg = TokenFile::open(&path).unwrap_err().to_string();
        assert!(msg.contains("JSON header"), "{msg}");

        std::fs::write(&path, b"EMB").unwrap();
        assert!(TokenFile::open(&path).is_err());
    }

    #[test]
    fn refuses_dtype_inconsistent_with_vocab() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.bin");
        write_tokens(&path, &[1, 2], info(512, Split::Train)).unwrap();
        let mut bytes = std::fs::read(&path).unwrap();
        let at = bytes.windows(5).position(|w| w == b"\"u16\"").unwrap();
        bytes[at..at + 5].copy_from_slice(b"\"u32\"");
        std::fs::write(&path, &bytes).unwrap();
        let msg = TokenFile::open(&path).unwrap_err().to_string();
        assert!(msg.contains("dtype"), "{msg}");
    }

    #[test]
    #[should_panic(expected = "past the end")]
    fn read_past_end_panics_with_message() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.bin");
        write_tokens(&path, &[1, 2, 3], info(512, Split::Train)).unwrap();
        TokenFile::open(&path)
            .unwrap()
            .read_into(2, 2, &mut Vec::new());
    }

    #[test]
    fn empty_file_is_valid_and_empty() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.bin");
        write_tokens(&path, &[], info(512, Split::Val)).unwrap();
        let f = TokenFile::open(&path).unwrap();
        assert!(f.is_empty());
        assert_eq!(f.to_vec(), Vec::<u32>::new());
    }
}
