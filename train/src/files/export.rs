//! `ember export`: a checkpoint (sharded or not) to the Hugging Face GPT-2 layout, offline,
//! from the shard files alone: `model.safetensors` (or `model-0000k-of-0000N.safetensors`
//! with `model.safetensors.index.json` past `--max-shard-size`), `config.json` with
//! `GPT2Config`'s fields, and `tokenizer.json`. And the way back: reading such a directory
//! (ours, or GPT-2's own) for `ember train --init-from`.
//!
//! Names are ember's paths with the `transformer.` prefix (`transformer.h.0.attn.c_attn.weight`);
//! linear weights are already in Conv1D's `[in, out]` layout; `lm_head.weight` is not
//! written because GPT-2 ties it to `transformer.wte.weight`.

use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, anyhow, ensure};
use ember_model::GptConfig;
use ember_sharding::Checkpoint;
use ember_sharding::plumbing::checkpoint::{FileDtype, ShardWriter};
use safetensors::tensor::{Dtype as StDtype, SafeTensors};
use serde_json::json;

use crate::files::checkpoint;
use crate::run::config::Dtype;

/// Prefix of every GPT-2 parameter name in Hugging Face files.
pub const HF_PREFIX: &str = "transformer.";

/// The `config.json` of a GPT-2 of `model`.
pub fn hf_config(model: &GptConfig, dtype: Dtype) -> serde_json::Value {
    json!({
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": model.vocab_size,
        "n_positions": model.block_size,
        "n_ctx": model.block_size,
        "n_embd": model.n_embd,
        "n_layer": model.n_layer,
        "n_head": model.n_head,
        "n_inner": null,
        "activation_function": "gelu_new",
        "resid_pdrop": model.dropout,
        "embd_pdrop": model.dropout,
        "attn_pdrop": model.dropout,
        "layer_norm_epsilon": 1e-5,
        "initializer_range": model.init_std,
        "scale_attn_weights": true,
        "use_cache": true,
        "tie_word_embeddings": true,
        "bos_token_id": null,
        "eos_token_id": null,
        "torch_dtype": match dtype { Dtype::F32 => "float32", Dtype::Bf16 => "bfloat16" },
    })
}

/// Writes the Hugging Face layout of checkpoint `dir` into `out`; returns the files written.
/// Offline and streamed: each tensor is read from the checkpoint's rank files and written out
/// one at a time, so the export needs memory for one tensor, not the model.
pub fn export(dir: &Path, out: &Path, dtype: Dtype, max_shard_bytes: u64) -> Result<Vec<PathBuf>> {
    let checkpoint = Checkpoint::open_local(dir)?;
    let index = checkpoint.index();
    let run = checkpoint::RunRecord::of(&index.manifest, &index.dir)?;
    let model = &run.train.model;
    fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let file_dtype = match dtype {
        Dtype::F32 => FileDtype::F32,
        Dtype::Bf16 => FileDtype::Bf16,
    };
    let width = match dtype {
        Dtype::F32 => 4u64,
        Dtype::Bf16 => 2,
    };
    // Tensors in model order, split greedily into files of at most the limit (a tensor larger
    // than the limit gets a file of its own, as transformers does).
    let tensors = &index.manifest.tensors;
    let mut groups: Vec<Vec<usize>> = vec![Vec::new()];
    let mut size = 0u64;
    for (i, t) in tensors.iter().enumerate() {
        let n = width * t.shape.iter().product::<usize>() as u64;
        if size + n > max_shard_bytes && !groups.last().expect("one group").is_empty() {
            groups.push(Vec::new());
            size = 0;
        }
        groups.last_mut().expect("one group").push(i);
        size += n;
    }
    let count = groups.len();
    let mut written = Vec::new();
    let mut weight_map = BTreeMap::new();
    let mut total = 0u64;
    let meta = BTreeMap::from([("format".to_string(), "pt".to_string())]);
    for (k, group) in groups.iter().enumerate() {
        let name = if count == 1 {
            "model.safetensors".to_string()
        } else {
            format!("model-{:05}-of-{count:05}.safetensors", k + 1)
        };
        let path = out.join(&name);
        let names: Vec<(String, Vec<usize>)> = group
            .iter()
            .map(|&i| {
                (
                    format!("{HF_PREFIX}{}", tensors[i].name),
                    tensors[i].shape.clone(),
                )
            })
            .collect();
        let mut w = ShardWriter::create(&path, &meta, &names, file_dtype)?;
        for &i in group {
            let t = &tensors[i];
            let n: usize = t.shape.iter().product();
            w.write(&index.read("param", &t.name, 0..n)?)?;
            weight_map.insert(format!("{HF_PREFIX}{}", t.name), name.clone());
            total += width * n as u64;
        }
        w.finish()?;
        written.push(path);
    }
    if count > 1 {
        let path = out.join("model.safetensors.index.json");
        let index = json!({"metadata": {"total_size": total}, "weight_map": weight_map});
        fs::write(&path, serde_json::to_string_pretty(&index)?)?;
        written.push(path);
    }
    let config = out.join("config.json");
    fs::write(
        &config,
        serde_json::to_string_pretty(&hf_config(model, dtype))?,
    )?;
    written.push(config);
    let tok = out.join("tokenizer.json");
    fs::copy(index.dir.join("tokenizer.json"), &tok)
        .with_context(|| format!("copying {}", index.dir.join("tokenizer.json").display()))?;
    written.push(tok);
    Ok(written)
}

/// A Hugging Face GPT-2 directory opened for reading by range: its model shape, where every
/// parameter lies in which file (memory-mapped; nothing is read until asked), and its
/// tokenizer. A sharded run's ranks each read only the ranges they own.
#[derive(Debug)]
pub struct HfDir {
    /// The directory.
    pub dir: PathBuf,
    /// Shape from `config.json`.
    pub config: GptConfig,
    /// `tokenizer.json`, when the directory has one.
    pub tokenizer: Option<PathBuf>,
    files: Vec<(PathBuf, fs::File)>,
    /// Every file's path and size.
    sizes: Vec<(PathBuf, usize)>,
    /// Ember path -> (file, shape, dtype, byte offset of its data in the file).
    tensors: HashMap<String, (usize, Vec<usize>, StDtype, usize)>,
}

impl HfDir {
    /// Opens a Hugging Face GPT-2 directory (`config.json` plus `model.safetensors` or the
    /// sharded files of `model.safetensors.index.json`), as written by [`export`] or by
    /// `transformers`' `save_pretrained`. Names with or without the `transformer.` prefix are
    /// accepted; `lm_head.weight` and attention-mask buffers are skipped.
    pub fn open(dir: &Path) -> Result<Self> {
        let config_path = dir.join("config.json");
        let text = fs::read_to_string(&config_path).with_context(|| {
            format!(
                "{} has no config.json: --init-from takes a Hugging Face GPT-2 directory",
                dir.display()
            )
        })?;
        let c: serde_json::Value = serde_json::from_str(&text)
            .with_context(|| format!("{} is not JSON", config_path.display()))?;
        let field = |k: &str| {
            c.get(k)
                .and_then(serde_json::Value::as_u64)
                .map(|v| v as usize)
                .with_context(|| format!("{}: no integer `{k}`", config_path.display()))
        };
        if let Some(a) = c.get("activation_function").and_then(|v| v.as_str()) {
            ensure!(
                a == "gelu_new" || a == "gelu_pytorch_tanh",
                "{}: activation {a} is not GPT-2's tanh GELU",
                config_path.display()
            );
        }
        let config = GptConfig::new(
            field("n_layer")?,
            field("n_head")?,
            field("n_embd")?,
            field("n_positions")?,
            field("vocab_size")?,
        );
        config
            .validate()
            .map_err(|e| anyhow!("{}: {e}", config_path.display()))?;
        let files: Vec<PathBuf> = if dir.join("model.safetensors").is_file() {
            vec![dir.join("model.safetensors")]
        } else {
            let index_path = dir.join("model.safetensors.index.json");
            let index: serde_json::Value =
                serde_json::from_str(&fs::read_to_string(&index_path).with_context(|| {
                    format!(
                        "{} has neither model.safetensors nor model.safetensors.index.json",
                        dir.display()
                    )
                })?)
                .with_context(|| format!("{} is not JSON", index_path.display()))?;
            let mut names: Vec<String> = index["weight_map"]
                .as_object()
                .with_context(|| format!("{}: no weight_map", index_path.display()))?
                .values()
                .filter_map(|v| v.as_str().map(String::from))
                .collect();
            names.sort();
            names.dedup();
            names.into_iter().map(|n| dir.join(n)).collect()
        };
        let mut maps = Vec::new();
        let mut tensors = HashMap::new();
        let mut opened = Vec::new();
        for path in files {
            let file =
                fs::File::open(&path).with_context(|| format!("opening {}", path.display()))?;
            // SAFETY: opened read-only; a directory being read is not written concurrently
            // (export writes a new directory).
            let map = unsafe { memmap2::Mmap::map(&file) }
                .with_context(|| format!("mapping {}", path.display()))?;
            // Bounds-checks the header and every tensor's offsets against the file.
            let (header_len, meta) = SafeTensors::read_metadata(&map)
                .map_err(|e| anyhow!("{}: bad safetensors file: {e}", path.display()))?;
            for (name, info) in meta.tensors() {
                if name == "lm_head.weight"
                    || name.ends_with(".attn.bias")
                    || name.ends_with(".attn.masked_bias")
                {
                    continue;
                }
                ensure!(
                    matches!(info.dtype, StDtype::F32 | StDtype::BF16 | StDtype::F16),
                    "{}: {name} is {:?}; expected F32, BF16 or F16",
                    path.display(),
                    info.dtype
                );
                let key = name.strip_prefix(HF_PREFIX).unwrap_or(&name).to_string();
                tensors.insert(
                    key,
                    (
                        opened.len(),
                        info.shape.clone(),
                        info.dtype,
                        8 + header_len + info.data_offsets.0,
                    ),
                );
            }
            // The map served the header; values are read with `pread`, so what a rank reads
            // is page cache, not its resident memory.
            maps.push((path.clone(), map.len()));
            opened.push((path, file));
        }
        let tokenizer = dir.join("tokenizer.json");
        Ok(Self {
            dir: dir.to_path_buf(),
            config,
            tokenizer: tokenizer.is_file().then_some(tokenizer),
            sizes: maps,
            files: opened,
            tensors,
        })
    }

    /// Elements `range` of parameter `name` (an ember path) of shape `shape`, as f32; only
    /// those bytes are read.
    pub fn read(
        &self,
        name: &str,
        shape: &[usize],
        range: std::ops::Range<usize>,
    ) -> Result<Vec<f32>> {
        let (file, found, dtype, start) = self.tensors.get(name).with_context(|| {
            format!(
                "{} has no tensor {HF_PREFIX}{name}: it is not a GPT-2 of this shape",
                self.dir.display()
            )
        })?;
        ensure!(
            found.as_slice() == shape,
            "{}: {HF_PREFIX}{name} has shape {found:?}, the model's is {shape:?}",
            self.dir.display()
        );
        let n: usize = shape.iter().product();
        ensure!(
            range.end <= n,
            "{}: {name} has {n} elements, [{}, {}) asked",
            self.dir.display(),
            range.start,
            range.end
        );
        let width = if *dtype == StDtype::F32 { 4 } else { 2 };
        let (path, f) = &self.files[*file];
        let mut bytes = vec![0u8; width * range.len()];
        f.read_exact_at(&mut bytes, (start + width * range.start) as u64)
            .with_context(|| format!("reading {}", path.display()))?;
        Ok(match dtype {
            StDtype::F32 => bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            StDtype::BF16 => bytes
                .chunks_exact(2)
                .map(|c| ember_comm::Bf16(u16::from_le_bytes([c[0], c[1]])).to_f32())
                .collect(),
            _ => bytes
                .chunks_exact(2)
                .map(|c| f16_to_f32(u16::from_le_bytes([c[0], c[1]])))
                .collect(),
        })
    }
}

impl ember_sharding::ParamSource for HfDir {
    fn read(
        &mut self,
        name: &str,
        shape: &[usize],
        range: std::ops::Range<usize>,
    ) -> Result<Vec<f32>, ember_sharding::ShardError> {
        HfDir::read(self, name, shape, range)
            .map_err(|e| ember_sharding::ShardError::Source(format!("--init-from: {e:#}")))
    }

    fn fingerprint(&self) -> u64 {
        // The same directory on every rank: its files' sizes and names.
        self.sizes
            .iter()
            .fold(0xcbf2_9ce4_8422_2325u64, |h, (p, len)| {
                p.to_string_lossy()
                    .bytes()
                    .chain(len.to_le_bytes())
                    .fold(h, |h, b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3))
            })
    }
}

/// IEEE half to f32 (exact).
fn f16_to_f32(h: u16) -> f32 {
    let sign = ((h >> 15) as u32) << 31;
    let exp = ((h >> 10) & 0x1f) as u32;
    let frac = (h & 0x3ff) as u32;
    let bits = match (exp, frac) {
        (0, 0) => sign,
        (0, f) => {
            // Subnormal: normalise.
            let shift = f.leading_zeros() - 21;
            let f = (f << shift) & 0x3ff;
            sign | ((113 - shift) << 23) | (f << 13)
        }
        (0x1f, f) => sign | 0x7f80_0000 | (f << 13),
        (e, f) => sign | ((e + 112) << 23) | (f << 13),
    };
    f32::from_bits(bits)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn half_precision_decodes_exactly() {
        assert_eq!(f16_to_f32(0x3c00), 1.0);
        assert_eq!(f16_to_f32(0xc000), -2.0);
        assert_eq!(f16_to_f32(0x0001), 2f32.powi(-24));
        assert_eq!(f16_to_f32(0x7bff), 65504.0);
        assert!(f16_to_f32(0x7e00).is_nan());
    }
}
