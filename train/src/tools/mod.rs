//! The commands around a run: `ember bench` (`bench`, with `torch_gpt.py`, the PyTorch
//! reference it runs beside, `products`, a step's matrix products one by one, and `sharing`,
//! how much of the CPUs went elsewhere meanwhile), `ember eval`, `ember generate` and `ember
//! plan` (`planning`), and `ember selftest --ptx`, ember's kernels compiled for CUDA without
//! a GPU (`ptx`).

pub mod bench;
pub mod eval;
pub mod generate;
pub mod planning;
pub mod products;
#[cfg(feature = "cuda")]
pub mod ptx;
pub mod sharing;
