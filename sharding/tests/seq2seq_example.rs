//! The encoder-decoder example (`examples/seq2seq.rs`: two stacks of blocks, the encoder's
//! output handed to every decoder block as a side tensor, a tied embedding and head, padding,
//! auxiliary losses, and Burn's own `Dropout` in residual branches and inside
//! `MultiHeadAttention`) trains exactly as one process does:
//!
//! - one process, under `zero3` (each unit recomputed by backward), `ddp` (one graph per
//!   micro-batch) and `zero3` keeping every unit's graph, matches plain Burn drawing the same
//!   masks (its device seeded with `draw_seed` before each unit's part of the forward), at
//!   dropout 0.01, 0.03 and 0.1;
//! - at dropout 0.1 and 0.03, every unquantized preset on 4 ranks and `zero3` on 2 matches one
//!   process within 2e-5 at every step of 30, the quantized presets within 2%;
//! - a save on 4 ranks resumes on 2 within 2e-5 of the run that went on.
//!
//! Every run is a process of its own (this test binary run again, under `mpirun` or alone):
//! the device's generator is the process's.

mod common;

#[path = "../examples/seq2seq.rs"]
#[allow(dead_code)]
mod seq2seq;

use burn::module::Module;
use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::{Device, Tensor};
use ember_sharding::{Preset, Recompute, Rows, Shard, StepLoss, draw_seed};
use seq2seq::{BATCH, LR, Pairs, Run, SEED, SIZE, Seq2Seq, Seq2SeqConfig};

const CHILD: &str = "EMBER_SEQ2SEQ_CHILD";
const TEST: &str = "the_seq2seq_example_trains_as_one_process_and_as_plain_burn";
const STEPS: u64 = 30;

/// Pairs per micro-batch where runs are compared with dropout (the same micro-batches draw
/// the same masks).
const MICRO: usize = 4;

/// How a run trains: `mode` is a preset's name, `keep` (zero3 keeping every unit's graph) or
/// `plain` (plain Burn), at dropout `p`, gradient clipping `clip` and `micro` pairs per
/// micro-batch.
#[derive(Debug, Clone, Copy)]
struct How<'a> {
    mode: &'a str,
    p: f64,
    clip: f64,
    micro: usize,
}

/// Rank 0's loss at every step of a run on `np` ranks over `topology` (`np == 0`: one process,
/// no `mpirun`), trained as `how` says.
fn losses(
    np: usize,
    topology: &str,
    how: How<'_>,
    steps: u64,
    resume: Option<std::path::PathBuf>,
    save: Option<std::path::PathBuf>,
) -> Vec<(u64, f64)> {
    let How {
        mode,
        p,
        clip,
        micro,
    } = how;
    let mode = format!("{mode}/{p}/{clip}/{micro}");
    let spec = common::spec(topology, &mode, steps, &resume, &save);
    let stdout = common::run_ranks(TEST, CHILD, &spec, np);
    serde_json::from_str(common::line(&stdout, "LOSSES ")).unwrap()
}

/// The loss of micro-batch `micro` of step `step` by the model's own forward in plain Burn,
/// its device's generator seeded before each unit's part as the partitioner seeds it: unit 0
/// embeds, then one unit per encoder block, then one per decoder block (the first also runs
/// the step from encoder to decoder, the last also the loss).
fn plain_loss(m: &Seq2Seq, pairs: &Pairs, step: u64, micro: u64, device: &Device) -> Tensor<1> {
    let seed = |unit: usize| device.seed(draw_seed(SEED, step, micro, unit));
    seed(0);
    let mut x = m.embed(pairs.sources(device));
    for (i, block) in m.enc.iter().enumerate() {
        seed(1 + i);
        x = block.forward(x, pairs);
    }
    let first = 1 + m.enc.len();
    seed(first);
    let memory = m.memory(x);
    let mut y = m.embed(pairs.shifted(device));
    let mut aux = Tensor::zeros([1], device);
    for (i, block) in m.dec.iter().enumerate() {
        if i > 0 {
            seed(first + i);
        }
        let (out, penalty) = block.forward(y, memory.clone(), pairs);
        (y, aux) = (out, aux + penalty);
    }
    aux + m.loss(y, pairs, device)
}

/// Plain Burn from the example's starting weights: the same batches cut into the same
/// micro-batches, their losses summed into one backward, Burn's AdamW with the example's
/// settings, no clipping.
fn plain(comm: &ember_comm::Comm, p: f64, steps: u64) -> Vec<(u64, f64)> {
    let start = seq2seq::train(
        comm,
        &Run {
            preset: "zero3".into(),
            steps: 0,
            dropout: p,
            clip: 0.0,
            micro: MICRO,
            resume: None,
            save: None,
        },
    )
    .unwrap()
    .model
    .unwrap();
    let device = Device::flex().autodiff();
    let mut model = start.fork(&device).train().set_require_grad(true);
    let mut optim = AdamWConfig::new()
        .with_beta_1(0.9)
        .with_beta_2(0.95)
        .with_epsilon(1e-8)
        .with_weight_decay(0.01)
        .init();
    let ((rows, len), micro_rows) = (BATCH, MICRO);
    let mut out = Vec::new();
    for step in 0..steps {
        let batch = Pairs::draw(step, rows, len, SIZE.vocab);
        let mut total: Option<Tensor<1>> = None;
        for j in 0..rows / micro_rows {
            let micro = batch.select(j * micro_rows..(j + 1) * micro_rows);
            let loss = plain_loss(&model, &micro, step, j as u64, &device);
            total = Some(match total {
                Some(t) => t + loss,
                None => loss,
            });
        }
        let total = total.unwrap();
        let value = total.clone().inner().into_data().convert::<f64>();
        out.push((step, value.try_to_vec::<f64>().unwrap()[0]));
        let grads = GradientsParams::from_grads(total.backward(), &model);
        model = optim.step(LR, model, grads);
    }
    out
}

/// The example's model at one process, zero3 keeping every unit's graph (no recompute).
fn keep(comm: &ember_comm::Comm, p: f64, steps: u64) -> Vec<(u64, f64)> {
    let size = Seq2SeqConfig { dropout: p, ..SIZE };
    let mut config = Preset::Zero3.config(comm.topology().depth());
    config.recompute = Recompute::None;
    let mut model = Shard::embed(|m: &Seq2Seq, b: &Pairs, _, d| m.embed(b.sources(d)))
        .stack("enc", |m, i, x, b, _| m.enc[i].forward(x, b))
        .then(|m, x, b, _, d| (m.embed(b.shifted(d)), m.memory(x)))
        .stack("dec", |m, i, y, b, s| m.dec[i].forward(y, s.get("enc"), b))
        .loss(|m, y, b, _, d| m.loss(y, b, d))
        .config(config)
        .seed(SEED)
        .step_loss(StepLoss::Sum)
        .build(comm, |d| size.init(d), Device::flex())
        .unwrap();
    let adamw = ember_sharding::AdamW {
        beta2: 0.95,
        ..ember_sharding::AdamW::default()
    };
    (0..steps)
        .map(|step| {
            let batch = Pairs::draw(step, BATCH.0, BATCH.1, SIZE.vocab);
            let micro = model.micro_batches(&batch, MICRO).unwrap();
            let grads = model.backward(&micro).unwrap();
            (step, model.apply(grads, &adamw, LR).unwrap().loss)
        })
        .collect()
}

/// A step of the example's model whose encoder blocks read the encoder's final norm (a root
/// parameter, which only the pieces around the stacks read).
fn forgetful(comm: &ember_comm::Comm) -> Result<(), ember_sharding::ShardError> {
    let mut model = Shard::embed(|m: &Seq2Seq, b: &Pairs, _, d| m.embed(b.sources(d)))
        .stack("enc", |m, i, x, b, _| m.enc[i].forward(m.memory(x), b))
        .then(|m, x, b, _, d| (m.embed(b.shifted(d)), m.memory(x)))
        .stack("dec", |m, i, y, b, s| m.dec[i].forward(y, s.get("enc"), b))
        .loss(|m, y, b, _, d| m.loss(y, b, d))
        .step_loss(StepLoss::Sum)
        .build(comm, |d| SIZE.init(d), Device::flex())?;
    let batch = Pairs::draw(0, BATCH.0, BATCH.1, SIZE.vocab);
    model.backward(&model.micro_batches(&batch, MICRO)?)?;
    Ok(())
}

#[test]
fn the_seq2seq_example_trains_as_one_process_and_as_plain_burn() {
    if let Some(child) = common::child(CHILD) {
        let mut parts = child.preset.split('/');
        let mode = parts.next().unwrap();
        let p: f64 = parts.next().unwrap().parse().unwrap();
        let clip: f64 = parts.next().unwrap().parse().unwrap();
        let micro: usize = parts.next().unwrap().parse().unwrap();
        let losses = match mode {
            "plain" => plain(&child.comm, p, child.steps),
            "keep" => keep(&child.comm, p, child.steps),
            "forgetful" => {
                // Every rank reports the error its step returns, then ends.
                let e = forgetful(&child.comm).expect_err("a read of an undeclared parameter");
                println!("ERROR rank {}: {e}", child.comm.rank());
                std::process::exit(1);
            }
            preset => {
                let run = Run {
                    preset: preset.into(),
                    steps: child.steps,
                    dropout: p,
                    clip,
                    micro,
                    resume: child.resume,
                    save: child.save,
                };
                seq2seq::train(&child.comm, &run).unwrap().losses
            }
        };
        if child.comm.rank() == 0 {
            println!("LOSSES {}", serde_json::to_string(&losses).unwrap());
        }
        return;
    }
    let how = |mode, p, clip| How {
        mode,
        p,
        clip,
        micro: MICRO,
    };
    // One process against plain Burn with the same masks, under each way a step runs.
    for p in [0.01, 0.03, 0.1] {
        let reference = losses(0, "1x1x1", how("plain", p, 0.0), STEPS, None, None);
        let (first, last) = (reference[0].1, reference[STEPS as usize - 1].1);
        assert!(
            last < 0.8 * first,
            "plain Burn at {p}: loss {first} -> {last}"
        );
        for mode in ["zero3", "ddp", "keep"] {
            let ours = losses(0, "1x1x1", how(mode, p, 0.0), STEPS, None, None);
            let worst = common::largest_relative_difference(&reference, &ours);
            eprintln!("dropout {p}: one process ({mode}) against plain Burn: {worst:e}");
            assert!(
                worst <= 2e-5,
                "dropout {p}, {mode}: {worst:e} off plain Burn"
            );
        }
    }
    // Sharded against one process, at the same micro-batches.
    for p in [0.1, 0.03] {
        let single = losses(0, "1x1x1", how("zero3", p, 1.0), STEPS, None, None);
        let mut runs = vec![(2, "1x2x1", Preset::Zero3)];
        runs.extend(Preset::ALL.into_iter().map(|preset| {
            let quantized = matches!(preset, Preset::Zeropp | Preset::Hier3);
            (4, if quantized { "1x2x2" } else { "2x2x1" }, preset)
        }));
        for (np, topology, preset) in runs {
            let run = how(preset.name(), p, 1.0);
            let sharded = losses(np, topology, run, STEPS, None, None);
            let worst = common::largest_relative_difference(&single, &sharded);
            eprintln!(
                "dropout {p}: {preset} on {np} ranks ({topology}) against one process: {worst:e}"
            );
            let bound = if matches!(preset, Preset::Zeropp | Preset::Hier3) {
                0.02
            } else {
                2e-5
            };
            assert!(
                worst <= bound,
                "dropout {p}: {preset} on {np} ranks vs one process: {worst:e} (bound {bound:e})"
            );
        }
    }
    // Without dropout the micro-batches need not be the same: the loss is the mean over the
    // global batch's target tokens (`StepLoss::Sum`), whatever their count per micro-batch.
    // One process in one micro-batch of 16 pairs, 2 ranks in one of 8 each, 4 ranks in two of
    // 2 each.
    let no_dropout = |micro| How {
        micro,
        ..how("zero3", 0.0, 1.0)
    };
    let single = losses(0, "1x1x1", no_dropout(16), STEPS, None, None);
    for (np, topology, micro) in [(2, "1x2x1", 8), (4, "2x2x1", 2)] {
        let sharded = losses(np, topology, no_dropout(micro), STEPS, None, None);
        let worst = common::largest_relative_difference(&single, &sharded);
        eprintln!(
            "no dropout: {np} ranks in micro-batches of {micro} against one process in one: \
             {worst:e}"
        );
        assert!(
            worst <= 2e-5,
            "{np} ranks, micro-batches of {micro}: {worst:e}"
        );
    }
    // A block that reads a parameter its unit does not declare: on every rank of the job, an
    // error naming the unit, the parameter and `using`, and the job ends (not at the 300 s
    // limit, which `run_job` would report as exit status `TIMED_OUT`).
    let spec = common::spec("1x2x1", "forgetful/0/0/4", 1, &None, &None);
    let out = common::run_job(TEST, CHILD, &spec, 2);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success(), "{stdout}");
    assert_ne!(
        out.status.code(),
        Some(common::jobs::TIMED_OUT),
        "the job hung: {stdout}"
    );
    for rank in 0..2 {
        // After the test harness's own `test ... ` where a rank's first line follows it.
        let key = format!("ERROR rank {rank}: ");
        let line = stdout
            .lines()
            .find_map(|l| l.split_once(&key).map(|(_, rest)| rest))
            .unwrap_or_else(|| panic!("no {key} in\n{stdout}"));
        assert!(
            line.starts_with("unit `enc.0` read parameter `enc_norm.gamma`"),
            "{line}"
        );
        assert!(line.contains(".using(&[0])"), "{line}");
    }
    // Saved on 4 ranks at step 15, resumed on 2: the run that went on, within 2e-5.
    let tmp = tempfile::tempdir().unwrap();
    let run = how("zero3", 0.1, 1.0);
    let whole = losses(4, "2x2x1", run, STEPS, None, None);
    let saved = Some(tmp.path().to_path_buf());
    let first = losses(4, "2x2x1", run, 15, None, saved);
    let step15 = Some(tmp.path().join("step-000015"));
    let resumed = losses(2, "1x2x1", run, STEPS, step15, None);
    let joined: Vec<(u64, f64)> = first.into_iter().chain(resumed).collect();
    let worst = common::largest_relative_difference(&whole, &joined);
    eprintln!("saved on 4 ranks, resumed on 2, against 4 ranks throughout: {worst:e}");
    assert!(worst <= 2e-5, "resumed on 2 ranks: {worst:e}");
}
