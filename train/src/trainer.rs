//! The single-process training loop: gradient accumulation over micro-batches, global-norm
//! clipping, AdamW on f32 master weights, periodic evaluation, metrics and checkpoints, and
//! exact resume (batches and dropout are pure functions of the step, so a resumed run draws
//! exactly what the uninterrupted run would have).

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result, anyhow, ensure};
use burn::module::Module;
use burn::tensor::{DType, Device, Int, Tensor, TensorData};
use ember_data::{BatchPlan, PreparedData, STREAM_TRAIN, STREAM_VAL, Sampler, TokenFile};
use ember_model::init::splitmix64;
use ember_model::{Gpt, named_grads, named_tensors, replace_named};

use crate::checkpoint::{self, RunRecord, TensorMeta};
use crate::config::{Dtype, TrainConfig};
use crate::device::peak_flops;
use crate::log0;
use crate::metrics::{MetricsWriter, StepMetrics, progress_bar};
use crate::optim::{AdamW, AdamWConfig, LrSchedule, clip_by_global_norm, squared_norm};

/// The derivation of random state recorded in checkpoints.
pub const RNG_SCHEME: &str = "weights: splitmix64/Box-Muller keyed by (seed, parameter path); batches: \
     ember_data::window_start(seed, stream, step, sample); dropout: the device RNG is seeded \
     with splitmix64(seed ^ splitmix64(step)) before each step";

/// Builds a `[b, t]` token tensor on `device`.
pub fn tokens(values: Vec<i64>, b: usize, t: usize, device: &Device) -> Tensor<2, Int> {
    Tensor::from_data(TensorData::new(values, [b, t]), device)
}

/// Reads a one-element tensor as f64.
pub fn scalar(t: Tensor<1>) -> f64 {
    t.into_data()
        .convert::<f64>()
        .try_to_vec::<f64>()
        .expect("a float tensor")[0]
}

/// The dtype the model computes in.
pub fn burn_dtype(dtype: Dtype) -> DType {
    match dtype {
        Dtype::F32 => DType::F32,
        Dtype::Bf16 => DType::BF16,
    }
}

/// Mean loss of `model` over `iters` batches of `batch` sequences drawn from `split`'s val
/// stream (the same batches at every evaluation, so evaluations are comparable).
pub fn evaluate(
    model: &Gpt,
    split: &TokenFile,
    seed: u64,
    block: usize,
    batch: usize,
    iters: u64,
    device: &Device,
) -> Result<f64> {
    let sampler = Sampler::new(split, block, seed, STREAM_VAL)?;
    let mut total = 0.0;
    for i in 0..iters {
        let b = sampler.batch(i, 0..batch as u64);
        let (_, loss) = model.forward_loss(
            tokens(b.inputs, b.batch, b.block, device),
            tokens(b.targets, b.batch, b.block, device),
        );
        total += scalar(loss);
    }
    Ok(total / iters as f64)
}

/// A training run in progress.
#[derive(Debug)]
pub struct Trainer {
    config: TrainConfig,
    device: Device,
    ad: Device,
    model: Gpt,
    opt: AdamW,
    data: PreparedData,
    step: u64,
    tokens_seen: u64,
}

impl Trainer {
    /// A fresh run (weights from `config.seed`) or, with `resume`, the state of a loaded
    /// checkpoint. `config.model.vocab_size` must already be the tokenizer's.
    pub fn new(
        config: TrainConfig,
        device: Device,
        data: PreparedData,
        resume: Option<checkpoint::Loaded>,
    ) -> Result<Self> {
        let ad = device.clone().autodiff();
        let dtype = burn_dtype(config.dtype);
        let model = config.model.init_with_seed(config.seed, &ad);
        let masters = named_tensors(&model)
            .into_iter()
            .map(|n| (n.name, n.shape, n.value.without_autodiff()))
            .collect();
        let opt = AdamW::new(
            AdamWConfig {
                beta1: config.beta1,
                beta2: config.beta2,
                eps: 1e-8,
                weight_decay: config.weight_decay,
            },
            masters,
        );
        let mut trainer = Trainer {
            model,
            opt,
            device,
            ad,
            data,
            step: 0,
            tokens_seen: 0,
            config,
        };
        if let Some(loaded) = resume {
            trainer.restore(loaded)?;
        }
        if dtype != DType::F32 || trainer.step > 0 {
            trainer.sync_model_from_masters()?;
        }
        Ok(trainer)
    }

    fn restore(&mut self, loaded: checkpoint::Loaded) -> Result<()> {
        let m = &loaded.run;
        ensure!(
            m.tokenizer_sha256 == self.data.tokenizer.sha256(),
            "{} was trained with another tokenizer than this data's (SHA-256 {} vs {}); \
             resume with the same --data and --tokenizer",
            loaded.dir.display(),
            m.tokenizer_sha256,
            self.data.tokenizer.sha256()
        );
        ensure!(
            loaded.tensors.len() == self.opt.params.len(),
            "{} holds {} tensors, the model has {}",
            loaded.dir.display(),
            loaded.tensors.len(),
            self.opt.params.len()
        );
        for (p, t) in self.opt.params.iter_mut().zip(loaded.tensors) {
            ensure!(
                p.name == t.meta.name && p.shape == t.meta.shape,
                "{}: tensor {} {:?} does not match the model's {} {:?}",
                loaded.dir.display(),
                t.meta.name,
                t.meta.shape,
                p.name,
                p.shape
            );
            let [w, m1, m2] = t.values;
            let flat = |v: Vec<f32>| {
                let n = v.len();
                Tensor::<1>::from_data(TensorData::new(v, [n]), &self.device)
            };
            p.master = flat(w);
            p.exp_avg = flat(m1);
            p.exp_avg_sq = flat(m2);
        }
        self.opt.step = loaded.adam_step;
        self.step = loaded.manifest.step;
        self.tokens_seen = m.data.tokens_seen;
        Ok(())
    }

    /// Starts from the weights of a Hugging Face directory (`ember train --init-from`) instead
    /// of the seed's: every parameter must be present with its shape.
    pub fn load_weights(&mut self, hf: &crate::export::HfDir) -> Result<()> {
        for p in self.opt.params.iter_mut() {
            let n = p.shape.iter().product();
            let v = hf.read(&p.name, &p.shape, 0..n)?;
            p.master = Tensor::<1>::from_data(TensorData::new(v, [n]), &self.device);
        }
        self.sync_model_from_masters()
    }

    /// Copies the f32 masters into the model, cast to the compute dtype.
    fn sync_model_from_masters(&mut self) -> Result<()> {
        let dtype = burn_dtype(self.config.dtype);
        let values: HashMap<String, Tensor<1>> = self
            .opt
            .params
            .iter()
            .map(|p| {
                let v = p.master.clone();
                let v = if dtype == DType::F32 {
                    v
                } else {
                    v.cast(dtype)
                };
                (p.name.clone(), v.autodiff())
            })
            .collect();
        let model = self.model.clone();
        self.model = replace_named(model, values).map_err(|e| anyhow!(e.join("; ")))?;
        Ok(())
    }

    /// Optimizer steps completed.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// The model, for evaluation or sampling (a snapshot without autodiff).
    pub fn model(&self) -> Gpt {
        self.model.valid()
    }

    /// Runs one optimizer step; returns (mean loss, grad norm before clipping, lr).
    pub fn train_step(&mut self) -> Result<(f64, f64, f64)> {
        let c = self.config.clone();
        let schedule = LrSchedule {
            lr: c.lr,
            min_lr: c.min_lr,
            warmup_iters: c.warmup_iters,
            lr_decay_iters: c.lr_decay_iters,
        };
        let lr = schedule.at(self.step);
        if c.model.dropout > 0.0 {
            self.ad.seed(splitmix64(c.seed ^ splitmix64(self.step)));
        }
        let plan = BatchPlan::new(c.batch_size, c.grad_accum, 1, 0)?;
        let sampler = Sampler::new(&self.data.train, c.block_size, c.seed, STREAM_TRAIN)?;
        let mut acc: Option<Vec<Tensor<1>>> = None;
        let mut loss_sum: Option<Tensor<1>> = None;
        for micro in 0..c.grad_accum {
            let b = sampler.batch(self.step, plan.samples(micro));
            let (_, loss) = self.model.forward_loss(
                tokens(b.inputs, b.batch, b.block, &self.ad),
                tokens(b.targets, b.batch, b.block, &self.ad),
            );
            let grads = loss.backward();
            let named = named_grads(&self.model, &grads);
            let grads: Vec<Tensor<1>> = named
                .into_iter()
                .map(|(name, g)| {
                    g.map(|g| g.cast(DType::F32))
                        .with_context(|| format!("no gradient reached {name}"))
                })
                .collect::<Result<_>>()?;
            let loss = loss.without_autodiff();
            loss_sum = Some(match loss_sum {
                Some(s) => s + loss,
                None => loss,
            });
            acc = Some(match acc {
                Some(a) => a.into_iter().zip(grads).map(|(a, g)| a + g).collect(),
                None => grads,
            });
        }
        let mut grads = acc.expect("grad_accum >= 1");
        if c.grad_accum > 1 {
            // Each micro-batch loss is a mean over its tokens; the step's loss is the mean of
            // those means (all micro-batches have the same size).
            let inv = 1.0 / c.grad_accum as f64;
            grads = grads.into_iter().map(|g| g * inv).collect();
        }
        let loss = scalar(loss_sum.expect("grad_accum >= 1")) / c.grad_accum as f64;
        let norm = scalar(squared_norm(&grads)).sqrt();
        ensure!(
            loss.is_finite() && norm.is_finite(),
            "training diverged at step {}: loss {loss}, gradient norm {norm}; lower --lr or \
             raise --warmup-iters",
            self.step + 1
        );
        clip_by_global_norm(&mut grads, norm, c.grad_clip);
        self.opt.update(lr, grads);
        self.sync_model_from_masters()?;
        self.step += 1;
        self.tokens_seen += c.tokens_per_step() as u64;
        Ok((loss, norm, lr))
    }

    /// Validation loss with the run's eval settings.
    pub fn val_loss(&self) -> Result<f64> {
        let c = &self.config;
        evaluate(
            &self.model(),
            &self.data.val,
            c.seed,
            c.block_size,
            c.micro_batch(),
            c.eval_iters,
            &self.device,
        )
    }

    /// Writes a checkpoint of the current state under the out dir, one parameter at a time.
    pub fn save(&self) -> Result<PathBuf> {
        let tensors: Vec<TensorMeta> = self
            .opt
            .params
            .iter()
            .map(|p| TensorMeta {
                name: p.name.clone(),
                shape: p.shape.clone(),
            })
            .collect();
        let run = RunRecord::new(
            &self.config,
            self.step,
            self.tokens_seen,
            RNG_SCHEME,
            self.data.tokenizer.sha256(),
        );
        let v = |t: &Tensor<1>| t.to_data().convert::<f32>().try_to_vec::<f32>().unwrap();
        checkpoint::save_whole(
            &self.config.out_dir,
            self.step,
            &run,
            self.opt.step,
            &tensors,
            &mut |i| {
                let p = &self.opt.params[i];
                [v(&p.master), v(&p.exp_avg), v(&p.exp_avg_sq)]
            },
            &self.data.dir.join("tokenizer.json"),
        )
    }

    /// Trains to `max_iters`, logging, evaluating and saving as configured. Returns the
    /// metrics of this invocation.
    pub fn run(&mut self) -> Result<Vec<StepMetrics>> {
        let c = self.config.clone();
        let mut writer = MetricsWriter::open(&c.out_dir, (self.step > 0).then_some(self.step))?;
        let peak = peak_flops(c.device, c.peak_tflops);
        let flops_per_token = c.model.train_flops_per_token(c.block_size);
        let bar = progress_bar(c.max_iters, self.step, 0);
        let start = Instant::now();
        // (seconds spent in training steps, tokens) since the last logged step: evaluation
        // and checkpointing are kept out of the throughput figure.
        let mut window = (0.0f64, 0u64);
        let mut logged = Vec::new();
        while self.step < c.max_iters {
            let t0 = Instant::now();
            let (loss, grad_norm, lr) = self.train_step()?;
            window.0 += t0.elapsed().as_secs_f64();
            window.1 += c.tokens_per_step() as u64;
            let step = self.step;
            let last = step == c.max_iters;
            let eval_now = c.eval_interval > 0 && (step.is_multiple_of(c.eval_interval) || last);
            let val_loss = if eval_now {
                Some(self.val_loss()?)
            } else {
                None
            };
            bar.set_position(step);
            bar.set_message(format!("loss {loss:.4}"));
            if step.is_multiple_of(c.log_interval) || eval_now || last {
                let tokens_per_s = window.1 as f64 / window.0.max(1e-9);
                let m = StepMetrics {
                    step,
                    loss,
                    lr,
                    grad_norm,
                    tokens_per_s,
                    mfu: peak.map(|p| tokens_per_s * flops_per_token / p),
                    elapsed_s: start.elapsed().as_secs_f64(),
                    val_loss,
                    comm_bytes: None,
                    comm_wait_frac: None,
                    rss_peak_bytes: Some(vec![ember_sharding::memory::resident().peak]),
                    device_bytes: ember_sharding::memory::device_bytes_in_use(&self.device)
                        .map(|b| vec![b]),
                    plan_bytes: None,
                };
                writer.write(&m)?;
                let val = val_loss.map_or(String::new(), |v| format!(" val {v:.4}"));
                let mfu = m
                    .mfu
                    .map_or(String::new(), |u| format!(" mfu {:.1}%", 100.0 * u));
                bar.suspend(|| {
                    log0!(
                        0,
                        "step {step:>6} loss {loss:.4}{val} lr {lr:.2e} norm {grad_norm:.3} \
                         {tokens_per_s:.0} tok/s{mfu}"
                    )
                });
                logged.push(m);
                window = (0.0, 0);
            }
            if (c.save_interval > 0 && step.is_multiple_of(c.save_interval)) || last {
                let dir = self.save()?;
                if c.keep_last > 0 {
                    checkpoint::prune(&c.out_dir, c.keep_last as usize)?;
                }
                bar.suspend(|| log0!(0, "saved {}", dir.display()));
            }
        }
        bar.finish_and_clear();
        Ok(logged)
    }
}
