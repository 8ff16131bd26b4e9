//! Loading a trained model back from a checkpoint, and sampling text from it (temperature,
//! top-k). No KV cache: each new token re-runs the cropped context, fine at these sizes.

use std::collections::HashMap;
use std::path::Path;

use anyhow::{Result, anyhow};
use burn::tensor::{Device, Tensor, TensorData};
use ember_data::Tokenizer;
use ember_model::Gpt;
use ember_model::init::splitmix64;
use ember_sharding::params::{load, param_shapes};

use crate::files::checkpoint::{self, Loaded};

/// A model and its tokenizer, restored from a checkpoint.
#[derive(Debug)]
pub struct Restored {
    /// The model on the inference device.
    pub model: Gpt,
    /// The tokenizer saved beside the weights.
    pub tokenizer: Tokenizer,
    /// The checkpoint it came from.
    pub loaded: Loaded,
}

/// Loads `path` (a checkpoint directory or an out dir) onto `device`.
pub fn restore(path: &Path, device: &Device) -> Result<Restored> {
    let dir = checkpoint::locate(path)?;
    let loaded = checkpoint::load(&dir)?;
    let tokenizer = Tokenizer::from_file(dir.join("tokenizer.json"))?;
    let model_config = &loaded.run.train.model;
    let model = model_config.init_with_seed(0, device)?;
    let values: HashMap<String, Tensor<1>> = loaded
        .tensors
        .iter()
        .map(|t| {
            let v = t.values[0].clone();
            let n = v.len();
            (
                t.meta.name.clone(),
                Tensor::from_data(TensorData::new(v, [n]), device),
            )
        })
        .collect();
    let shapes: HashMap<String, Vec<usize>> = param_shapes(&model).into_iter().collect();
    let mut values = values;
    for (name, shape) in &shapes {
        let n: usize = shape.iter().product();
        match values.get(name) {
            Some(v) if v.dims()[0] == n => {}
            Some(v) => {
                return Err(anyhow!(
                    "{}: {name} holds {} values, the model's shape {shape:?} has {n}",
                    dir.display(),
                    v.dims()[0]
                ));
            }
            None => return Err(anyhow!("{} has no tensor {name}", dir.display())),
        }
    }
    let model = load(model, &mut values, &shapes, device, false);
    Ok(Restored {
        model,
        tokenizer,
        loaded,
    })
}

/// Samples `max_new` tokens after `prompt`. `temperature` 0 means greedy; `top_k` 0 means
/// the whole vocabulary. Deterministic for a given `seed`.
pub fn generate(
    model: &Gpt,
    prompt: &[u32],
    max_new: usize,
    temperature: f64,
    top_k: usize,
    seed: u64,
    device: &Device,
) -> Result<Vec<u32>> {
    let block = model.block_size();
    let mut ids: Vec<u32> = prompt.to_vec();
    for i in 0..max_new {
        let ctx = &ids[ids.len().saturating_sub(block)..];
        let t = ctx.len();
        let idx = model.tokens(ctx.iter().map(|&x| x as i64).collect(), 1, device)?;
        let logits = model.forward(&idx, None);
        let last: Vec<f32> = logits
            .slice([0..1, t - 1..t])
            .into_data()
            .convert::<f32>()
            .try_to_vec::<f32>()
            .expect("float logits");
        let u = (splitmix64(seed ^ splitmix64(i as u64)) >> 11) as f64 / (1u64 << 53) as f64;
        ids.push(sample(&last, temperature, top_k, u));
    }
    Ok(ids[prompt.len()..].to_vec())
}

/// Draws a token from `logits` with uniform number `u` in [0, 1).
pub fn sample(logits: &[f32], temperature: f64, top_k: usize, u: f64) -> u32 {
    let argmax = || {
        logits
            .iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .map_or(0, |(i, _)| i as u32)
    };
    if temperature <= 0.0 {
        return argmax();
    }
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
    if top_k > 0 {
        order.truncate(top_k);
    }
    let max = logits[order[0]] as f64;
    let weights: Vec<f64> = order
        .iter()
        .map(|&i| ((logits[i] as f64 - max) / temperature).exp())
        .collect();
    let total: f64 = weights.iter().sum();
    let mut acc = 0.0;
    for (&i, w) in order.iter().zip(&weights) {
        acc += w / total;
        if u < acc {
            return i as u32;
        }
    }
    *order.last().expect("non-empty vocabulary") as u32
}

/// Encodes a prompt, refusing one the tokenizer turns into nothing.
pub fn encode_prompt(tokenizer: &Tokenizer, prompt: &str) -> Result<Vec<u32>> {
    let ids = tokenizer.encode(prompt)?;
    if ids.is_empty() {
        return Err(anyhow!("--prompt encodes to no tokens; give some text"));
    }
    Ok(ids)
}

#[cfg(test)]
mod tests {
    use super::sample;

    #[test]
    fn greedy_and_top_k() {
        let logits = [0.0, 3.0, 1.0, 2.0];
        assert_eq!(sample(&logits, 0.0, 0, 0.9), 1);
        // top-1 is greedy whatever the draw.
        assert_eq!(sample(&logits, 1.0, 1, 0.999), 1);
        // top-2 never returns a token outside {1, 3}.
        for u in [0.0, 0.3, 0.6, 0.99] {
            assert!([1, 3].contains(&sample(&logits, 1.0, 2, u)));
        }
    }
}
