//! `ember eval`: mean cross-entropy per token of a checkpoint over the validation split or a
//! text file, on consecutive non-overlapping windows that cover every token once (the same
//! tokens `transformers`' GPT2LMHeadModel would score for the same windows).

use burn::tensor::Device;
use ember_model::Gpt;

/// Sum of the per-token losses and the number of predicted tokens over `ids`, scored in
/// windows of at most `block` predictions, `batch` windows at a time. Ids the model cannot
/// take (outside its vocabulary) are an error.
pub fn score(
    model: &Gpt,
    ids: &[u32],
    block: usize,
    batch: usize,
    device: &Device,
) -> Result<(f64, u64), ember_model::ModelError> {
    let windows: Vec<(usize, usize)> = (0..ids.len().saturating_sub(1))
        .step_by(block)
        .map(|s| (s, block.min(ids.len() - 1 - s)))
        .collect();
    let mut total = 0.0;
    let mut count = 0u64;
    // Windows of equal length are batched; only the last one can be shorter.
    for group in windows.chunk_by(|a, b| a.1 == b.1) {
        for chunk in group.chunks(batch) {
            let t = chunk[0].1;
            let mut x = Vec::with_capacity(chunk.len() * t);
            let mut y = Vec::with_capacity(chunk.len() * t);
            for &(s, len) in chunk {
                x.extend(ids[s..s + len].iter().map(|&v| v as i64));
                y.extend(ids[s + 1..s + len + 1].iter().map(|&v| v as i64));
            }
            let n = (chunk.len() * t) as u64;
            let (x, y) = (
                model.tokens(x, chunk.len(), device)?,
                model.tokens(y, chunk.len(), device)?,
            );
            let (_, loss) = model.forward_loss(&x, &y, None);
            let loss: f32 = loss.into_scalar();
            total += loss as f64 * n as f64;
            count += n;
        }
    }
    Ok((total, count))
}
