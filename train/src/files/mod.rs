//! What a run reads and writes: checkpoints (`checkpoint`), the Hugging Face layout
//! (`export`), the log, `metrics.jsonl` and the progress bar (`metrics`), and `loss.png`
//! (`plot`).

pub mod checkpoint;
pub mod export;
pub mod metrics;
pub mod plot;
