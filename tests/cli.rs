//! End-to-end tests of the `ember` binary: training quality on the embedded corpus, exact
//! resume, generate / eval / prepare, and the message and exit code of every bad input.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use ember_data::{TINY_SHAKESPEARE, TokenizerSpec, prepare_cached, unigram_entropy};
use ember_train::files::metrics::{StepMetrics, read_metrics};

/// Prepared corpora are shared by every test of this binary (preparation is idempotent and
/// safe under concurrency).
fn cache_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("ember-cache")
}

/// Runs `ember args...`, killing it after `limit`.
fn ember(args: &[&str], limit: Duration) -> Output {
    ember_with(args, &[], limit)
}

/// [`ember`] with the environment variables `vars` set.
fn ember_with(args: &[&str], vars: &[(&str, &str)], limit: Duration) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_ember"))
        .args(args)
        .envs(vars.iter().copied())
        .env("EMBER_CACHE_DIR", cache_dir())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawning ember");
    let start = Instant::now();
    while child.try_wait().expect("waiting").is_none() {
        if start.elapsed() > limit {
            child.kill().ok();
            panic!("ember {args:?} ran longer than {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    child.wait_with_output().expect("collecting output")
}

fn ok(args: &[&str]) -> Output {
    let out = ember(args, Duration::from_secs(600));
    assert!(
        out.status.success(),
        "ember {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// The devices this build runs: flex, and wgpu in a wgpu build.
fn devices() -> Vec<&'static str> {
    let mut devices = vec!["flex"];
    if cfg!(feature = "wgpu") {
        devices.push("wgpu");
    }
    devices
}

/// Each line of `out`'s standard output, parsed as JSON.
fn json_lines(out: &Output) -> Vec<serde_json::Value> {
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn path(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn losses(metrics: &[StepMetrics]) -> Vec<(u64, f64)> {
    metrics.iter().map(|m| (m.step, m.loss)).collect()
}

#[test]
fn tiny_learns_below_unigram_entropy_and_then_generates_and_evals() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    ok(&[
        "train",
        "--preset",
        "tiny",
        "--max-iters",
        "300",
        "--batch-size",
        "16",
        "--lr",
        "3e-3",
        "--warmup-iters",
        "30",
        "--eval-interval",
        "150",
        "--eval-iters",
        "10",
        "--log-interval",
        "25",
        "--out-dir",
        path(&out),
    ]);
    let metrics = read_metrics(&out.join("metrics.jsonl")).unwrap();
    let last = metrics.last().unwrap();
    assert_eq!(last.step, 300);
    let val = last.val_loss.expect("the last step is evaluated");

    // The bar: a model that ignores context can do no better than the unigram entropy of
    // the tokens it predicts.
    let data = prepare_cached(
        TINY_SHAKESPEARE,
        "tinyshakespeare",
        TokenizerSpec::Train { vocab_size: 512 },
        &cache_dir(),
    )
    .unwrap();
    let h = unigram_entropy((0..data.val.len()).map(|i| data.val.get(i)));
    assert!(
        val < h - 0.5,
        "val loss {val:.3} is not well below the unigram entropy {h:.3}"
    );
    assert!(
        metrics
            .iter()
            .all(|m| m.tokens_per_s > 0.0 && m.mfu.unwrap() > 0.0)
    );

    let png = std::fs::read(out.join("loss.png")).unwrap();
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
    assert!(out.join("step-000300").join("manifest.json").is_file());

    let sample = ok(&[
        "generate",
        "--checkpoint",
        path(&out),
        "--prompt",
        "ROMEO:",
        "--max-new-tokens",
        "40",
    ]);
    let text = String::from_utf8(sample.stdout).unwrap();
    assert!(
        text.starts_with("ROMEO:") && text.len() > "ROMEO:".len() + 20,
        "{text}"
    );

    let eval = ok(&["eval", "--checkpoint", path(&out)]);
    let v: serde_json::Value = serde_json::from_slice(&eval.stdout).unwrap();
    let eval_loss = v["loss"].as_f64().unwrap();
    assert_eq!(v["tokens"].as_u64().unwrap(), data.val.len() as u64 - 1);
    // Whole split vs 10 sampled batches: the same model, so close but not equal.
    assert!(
        (eval_loss - val).abs() < 0.25,
        "eval {eval_loss} vs training val {val}"
    );
}

#[test]
fn resume_continues_bit_for_bit() {
    let tmp = tempfile::tempdir().unwrap();
    let common = [
        "train",
        "--preset",
        "tiny",
        "--batch-size",
        "8",
        "--grad-accum",
        "2",
        "--dropout",
        "0.1",
        "--warmup-iters",
        "5",
        "--log-interval",
        "1",
        "--eval-interval",
        "5",
        "--eval-iters",
        "2",
        "--save-interval",
        "10",
    ];
    let full = tmp.path().join("full");
    let split = tmp.path().join("split");
    let run = |dir: &Path, extra: &[&str]| {
        let mut args: Vec<&str> = common.to_vec();
        args.extend_from_slice(&["--out-dir", path(dir)]);
        args.extend_from_slice(extra);
        ok(&args);
    };
    run(&full, &["--max-iters", "20", "--lr-decay-iters", "20"]);
    // An interrupted run: it got to step 14 but only the checkpoint of step 10 counts (as if
    // killed before its final save), so steps 11-14 are replayed after the resume.
    run(&split, &["--max-iters", "14", "--lr-decay-iters", "20"]);
    let at_10 = split.join("step-000010");
    // A resume that a later check refuses (here the memory pre-flight, after the settings and
    // the data are read) leaves the out dir's later checkpoint where it was.
    refused(
        &[
            "train",
            "--resume",
            path(&at_10),
            "--max-iters",
            "20",
            "--batch-size",
            "4000000",
        ],
        2,
        "GB per rank",
    );
    assert!(split.join("step-000014").join("manifest.json").is_file());
    assert!(!split.join("superseded-step-000014").exists());
    // A new name already taken is refused before anything is read or renamed.
    let taken = split.join("superseded-step-000014");
    std::fs::create_dir(&taken).unwrap();
    refused(
        &["train", "--resume", path(&at_10), "--max-iters", "20"],
        2,
        "is taken",
    );
    assert!(split.join("step-000014").join("manifest.json").is_file());
    std::fs::remove_dir(&taken).unwrap();
    ok(&["train", "--resume", path(&at_10), "--max-iters", "20"]);
    // The abandoned history's later checkpoint is kept under another name, out of the way of
    // `--resume split` and of pruning.
    assert!(
        split
            .join("superseded-step-000014")
            .join("manifest.json")
            .is_file()
    );
    assert!(!split.join("step-000014").exists());
    let a = read_metrics(&full.join("metrics.jsonl")).unwrap();
    let b = read_metrics(&split.join("metrics.jsonl")).unwrap();
    assert_eq!(losses(&a).len(), 20);
    assert_eq!(losses(&a), losses(&b), "resumed losses differ");
    let val = |m: &[StepMetrics]| m.iter().map(|m| m.val_loss).collect::<Vec<_>>();
    assert_eq!(val(&a), val(&b));
}

#[test]
fn prepare_writes_tokens_a_run_can_train_on() {
    let tmp = tempfile::tempdir().unwrap();
    let text = tmp.path().join("poem.txt");
    std::fs::write(&text, TINY_SHAKESPEARE[..60_000].repeat(2)).unwrap();
    let data = tmp.path().join("prepared");
    let out = ok(&[
        "prepare",
        "--input",
        path(&text),
        "--vocab-size",
        "300",
        "--out",
        path(&data),
    ]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["vocab_size"].as_u64().unwrap(), 300);

    // The same data with one id past the vocabulary: refused when opened, with the file, the
    // offset and the vocabulary size, instead of a panic inside the model at some later step.
    let damaged = tmp.path().join("damaged");
    std::fs::create_dir(&damaged).unwrap();
    for f in ["tokenizer.json", "train.bin", "val.bin"] {
        std::fs::copy(data.join(f), damaged.join(f)).unwrap();
    }
    let bin = damaged.join("train.bin");
    let mut bytes = std::fs::read(&bin).unwrap();
    let n = bytes.len();
    bytes[n - 2..].copy_from_slice(&300u16.to_le_bytes());
    std::fs::write(&bin, &bytes).unwrap();
    let count = v["train_tokens"].as_u64().unwrap();
    refused(
        &[
            "train",
            "--preset",
            "tiny",
            "--data",
            path(&damaged),
            "--max-iters",
            "3",
        ],
        1,
        &format!(
            "token 300 at offset {} is not below its vocabulary size 300",
            count - 1
        ),
    );
    ok(&[
        "train",
        "--preset",
        "tiny",
        "--data",
        path(&data),
        "--max-iters",
        "3",
        "--eval-interval",
        "0",
        "--out-dir",
        path(&tmp.path().join("run")),
    ]);
}

/// Runs a bad command and checks its one-line message and exit code.
fn refused(args: &[&str], code: i32, needle: &str) {
    let out = ember(args, Duration::from_secs(300));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(code), "ember {args:?}: {stderr}");
    assert!(
        stderr.contains(needle),
        "ember {args:?}: expected {needle:?} in {stderr}"
    );
    assert!(
        !stderr.contains("panicked") && !stderr.contains("backtrace"),
        "ember {args:?} panicked: {stderr}"
    );
}

#[test]
fn bad_input_gets_a_clear_message_and_exit_code() {
    let tmp = tempfile::tempdir().unwrap();
    let t = |name: &str| tmp.path().join(name);
    std::fs::write(t("empty.txt"), "  \n").unwrap();
    std::fs::write(t("bad-tokenizer.json"), "{\"model\": 12").unwrap();
    std::fs::create_dir(t("not-a-checkpoint")).unwrap();
    std::fs::write(t("config.toml"), "n_layers = 3\n").unwrap();

    refused(&["train", "--bogus-flag"], 2, "--bogus-flag");
    refused(
        &["train", "--n-embd", "100", "--n-head", "3"],
        2,
        "--n-embd 100 is not divisible by --n-head 3",
    );
    refused(
        &[
            "train",
            "--n-embd",
            "1000000",
            "--n-head",
            "1",
            "--max-iters",
            "1",
        ],
        2,
        "GB are available",
    );
    refused(
        &["train", "--preset", "gpt5"],
        2,
        "--preset gpt5 is not a preset",
    );
    refused(
        &["train", "--grad-clip", "inf"],
        2,
        "--grad-clip must be a finite number",
    );
    refused(
        &["train", "--lr", "-1"],
        2,
        "--lr must be a positive finite number",
    );
    refused(
        &["train", "--n-head", "0"],
        2,
        "--n-head must be at least 1",
    );
    refused(
        &["train", "--dropout", "1.5"],
        2,
        "--dropout 1.5 must be in [0, 1)",
    );
    std::fs::write(t("a-file"), "").unwrap();
    refused(
        &["train", "--out-dir", path(&t("a-file"))],
        2,
        "is a file, not a directory",
    );
    refused(
        &["bench", "train", "--presets", "tiny,gpt5"],
        2,
        "--presets: `gpt5` is not a preset",
    );
    refused(
        &["bench", "train", "--preset", "tiny"],
        2,
        "use --presets tiny instead of --preset tiny",
    );
    refused(
        &["train", "--batch-size", "10", "--grad-accum", "3"],
        2,
        "--batch-size 10 is not divisible by --grad-accum 3",
    );
    refused(
        &["train", "--data", path(&t("missing.txt"))],
        2,
        "missing.txt: no such file",
    );
    refused(
        &["train", "--data", path(&t("empty.txt"))],
        1,
        "empty.txt: the file is empty",
    );
    refused(
        &["train", "--tokenizer", path(&t("bad-tokenizer.json"))],
        1,
        "bad-tokenizer.json",
    );
    refused(
        &["train", "--config", path(&t("config.toml"))],
        2,
        "n_layers",
    );
    // A value from the config file, refused under its flag's name, says where it was set;
    // one the command line gave does not.
    std::fs::write(t("batch.toml"), "batch_size = 7\ngrad_accum = 2\n").unwrap();
    refused(
        &[
            "train",
            "--config",
            path(&t("batch.toml")),
            "--preset",
            "tiny",
        ],
        2,
        "(--batch-size and --grad-accum are set in ",
    );
    refused(
        &[
            "train",
            "--config",
            path(&t("batch.toml")),
            "--batch-size",
            "9",
        ],
        2,
        "sequences (--grad-accum is set in ",
    );
    refused(
        &["generate", "--checkpoint", path(&t("not-a-checkpoint"))],
        1,
        "is not a checkpoint",
    );
    refused(
        &["eval", "--checkpoint", path(&t("nowhere"))],
        2,
        "no such directory",
    );
    refused(
        &["train", "--resume", path(&t("nowhere"))],
        2,
        "no such file or directory",
    );
    refused(
        &["train", "--resume", path(&t("not-a-checkpoint"))],
        1,
        "is not a checkpoint",
    );

    // A checkpoint of a 64-position tiny model refuses a longer context and another shape.
    let run = t("run");
    ok(&[
        "train",
        "--preset",
        "tiny",
        "--max-iters",
        "2",
        "--eval-interval",
        "0",
        "--out-dir",
        path(&run),
    ]);
    refused(
        &["train", "--resume", path(&run), "--block-size", "128"],
        2,
        "exceeds the model's 64 positions",
    );
    refused(
        &["train", "--resume", path(&run), "--n-layer", "3"],
        2,
        "--n-layer differs from the checkpoint",
    );
    refused(
        &["train", "--resume", path(&run), "--max-iters", "2"],
        2,
        "is not past the checkpoint's step 2",
    );
    refused(
        &[
            "train",
            "--preset",
            "tiny",
            "--max-iters",
            "2",
            "--out-dir",
            path(&run),
        ],
        2,
        "already holds checkpoints",
    );
    refused(
        &[
            "generate",
            "--checkpoint",
            path(&run),
            "--temperature",
            "NaN",
        ],
        2,
        "--temperature NaN",
    );
    // Compiling the kernels for CUDA needs a build with CUDA.
    if !cfg!(feature = "cuda") {
        refused(&["selftest", "--ptx", "90"], 2, "built without CUDA");
    }
    refused(&["selftest", "--ptx", "70"], 2, "70");
    refused(
        &["selftest", "--ptx", "90", "--device", "flex"],
        2,
        "cannot be used with",
    );
    refused(
        &["selftest", "--ptx", "90", "--ptx-compiler", "nvcc"],
        2,
        "--ptx-compiler",
    );
    // How attention runs on a CubeCL device: `products` or `flash`, nothing else.
    if cfg!(feature = "wgpu") {
        let args = [
            "train",
            "--device",
            "wgpu",
            "--max-iters",
            "1",
            "--eval-interval",
            "0",
        ];
        let out = ember_with(
            &[&args[..], &["--out-dir", path(&t("attention"))]].concat(),
            &[("EMBER_ATTENTION", "fast")],
            Duration::from_secs(300),
        );
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{stderr}");
        assert!(
            stderr.contains("EMBER_ATTENTION is \"fast\"") && stderr.contains("`flash`"),
            "{stderr}"
        );
        assert!(!stderr.contains("panicked"), "{stderr}");
        assert!(!t("attention").join("metrics.jsonl").exists());
    }
}

#[test]
fn bf16_compute_tracks_f32_training() {
    let tmp = tempfile::tempdir().unwrap();
    // `EMBER_BF16_DOT=0` takes the path of a CPU without bf16 dot-product instructions.
    let run = |dtype: &str, vars: &[(&str, &str)]| {
        let out = tmp.path().join(format!("{dtype}{}", vars.len()));
        let args = [
            "train",
            "--preset",
            "tiny",
            "--dtype",
            dtype,
            "--max-iters",
            "40",
            "--log-interval",
            "10",
            "--eval-interval",
            "0",
            "--out-dir",
            path(&out),
        ];
        let output = ember_with(&args, vars, Duration::from_secs(600));
        let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
        assert!(output.status.success(), "ember {args:?} failed: {stderr}");
        (read_metrics(&out.join("metrics.jsonl")).unwrap(), stderr)
    };
    let (f32_run, _) = run("f32", &[]);
    let (bf16_run, bf16_said) = run("bf16", &[]);
    let (widened_run, said) = run("bf16", &[("EMBER_BF16_DOT", "0")]);
    // Without bf16 instructions one rank trains in f32: bf16 parameters would only add a copy
    // and casts. It says so, and its losses are f32's, bit for bit.
    let in_f32 = "the run trains in f32, as with --dtype f32";
    assert!(
        said.contains(in_f32),
        "a run without bf16 instructions says how it computes: {said}"
    );
    assert_eq!(losses(&f32_run), losses(&widened_run));
    // `ember plan` plans what `ember train` runs: all in f32 at one rank, bf16 parameters
    // computing in f32 at two.
    let plan = |topology: &str| -> serde_json::Value {
        let args = [
            "plan",
            "--preset",
            "tiny",
            "--shard",
            "zero3",
            "--dtype",
            "bf16",
            "--topology",
            topology,
            "--json",
        ];
        let output = ember_with(&args, &[("EMBER_BF16_DOT", "0")], Duration::from_secs(60));
        assert!(output.status.success(), "ember {args:?} failed");
        serde_json::from_slice(&output.stdout).unwrap()
    };
    let one = plan("1x1x1");
    assert_eq!(
        (&one["shard"]["compute"], &one["asked_dtype"]),
        (&"f32".into(), &"bf16".into())
    );
    let two = plan("1x2x1");
    assert_eq!(
        (&two["shard"]["compute"], &two["module_dtype"]),
        (&"bf16".into(), &"f32".into())
    );
    assert!(two.get("asked_dtype").is_none());
    // With them (where this CPU has them), bf16 computes in bf16.
    if !bf16_said.contains(in_f32) {
        for (a, b) in f32_run.iter().zip(&bf16_run) {
            // bf16 keeps 8 bits of mantissa: activations differ by ~0.4%, and over 40 steps
            // the losses stay within a few hundredths of a nat of the f32 run.
            assert!(
                (a.loss - b.loss).abs() < 0.05,
                "step {}: f32 {} vs bf16 {}",
                a.step,
                a.loss,
                b.loss
            );
        }
        assert_ne!(
            losses(&f32_run),
            losses(&bf16_run),
            "bf16 must actually change the arithmetic"
        );
    }
}

#[test]
fn a_kill_during_training_never_damages_saved_checkpoints() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    // Saving every step, so the kill lands in or near a save.
    let mut child = Command::new(env!("CARGO_BIN_EXE_ember"))
        .args([
            "train",
            "--preset",
            "tiny",
            "--max-iters",
            "100000",
            "--save-interval",
            "1",
            "--eval-interval",
            "0",
            "--out-dir",
            path(&out),
        ])
        .env("EMBER_CACHE_DIR", cache_dir())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let start = Instant::now();
    while !out.join("step-000008").exists() {
        assert!(
            start.elapsed() < Duration::from_secs(300),
            "no checkpoints appeared"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    child.kill().unwrap(); // SIGKILL: no destructor, no flush
    child.wait().unwrap();
    let steps: Vec<_> = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("step-"))
        .collect();
    assert!(steps.len() >= 8, "{steps:?}");
    let text = tmp.path().join("text.txt");
    std::fs::write(&text, &TINY_SHAKESPEARE[..2000]).unwrap();
    for name in steps {
        let dir = out.join(&name);
        let res = ember(
            &["eval", "--checkpoint", path(&dir), "--data", path(&text)],
            Duration::from_secs(120),
        );
        assert!(
            res.status.success(),
            "{name} does not load: {}",
            String::from_utf8_lossy(&res.stderr)
        );
    }
    // And the out dir resolves to its latest complete checkpoint.
    ok(&["eval", "--checkpoint", path(&out), "--data", path(&text)]);
}

/// `ember selftest` checks the quantization kernels of each runtime it can reach against the
/// reference, bit for bit: the host kernels on flex, and (in wgpu builds) the CubeCL kernels
/// on the runtime's client and on the device's Burn tensors, the path a training step takes.
#[test]
fn selftest_checks_every_kernel_path_of_the_device() {
    for device in devices() {
        let out = ok(&["selftest", "--device", device, "--json"]);
        let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(report["passed"], true, "{device}: {report}");
        let checks = report["checks"].as_array().unwrap();
        assert_eq!(checks.len(), 2, "{device}: {report}");
        for c in checks {
            assert!(c["checks"].as_u64().unwrap() > 100, "{device}: {c}");
            assert!(
                c["failures"].as_array().unwrap().is_empty(),
                "{device}: {c}"
            );
        }
        let path = checks[1]["runtime"].as_str().unwrap();
        assert!(path.starts_with("training path on"), "{path}");
        if device == "wgpu" {
            // The tensors really were on the Vulkan device, not handed to the host kernels.
            assert_ne!(report["device_name"], "host", "{report}");
        }
    }
}

/// `--against-torch` runs PyTorch's step on the device ember ran on: the CPU for flex (the
/// GPU check runs it on a CUDA card), with torch.compile beside eager on request; wgpu has no
/// PyTorch device and is refused.
#[test]
fn bench_against_torch_pairs_on_the_same_device() {
    refused(
        &[
            "bench",
            "train",
            "--presets",
            "tiny",
            "--device",
            "wgpu",
            "--against-torch",
            "python3",
        ],
        2,
        "PyTorch has no wgpu device",
    );
    refused(
        &["bench", "train", "--presets", "tiny", "--torch-compile"],
        2,
        "--against-torch",
    );
    let has_torch = Command::new("python3")
        .args(["-c", "import torch"])
        .status()
        .is_ok_and(|s| s.success());
    if !has_torch {
        eprintln!(
            "python3 cannot import torch: the pairing itself is not run (.ci/run installs it)"
        );
        return;
    }
    let out = ok(&[
        "bench",
        "train",
        "--presets",
        "tiny",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--rounds",
        "1",
        "--vocab-size",
        "50304",
        "--against-torch",
        "python3",
        "--json",
    ]);
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(r["device"], "cpu", "{r}");
    // The same model on both sides, the vocabulary included (a benchmark keeps the asked-for
    // one even where the data's tokenizer learned fewer tokens).
    assert_eq!(r["params"][0], r["params"][1], "{r}");
    assert!(r["params"][0].as_u64().unwrap() > 50304 * 64, "{r}");
    assert!(r["ratio"].as_f64().unwrap() > 0.0, "{r}");
    assert!(r["torch_compile_median_ms"].is_null(), "{r}");
    // How much of the CPUs went elsewhere during each side's rounds, read from /proc/stat.
    for side in ["ember_elsewhere", "torch_elsewhere"] {
        for kind in ["others", "steal"] {
            let share = r[side][kind].as_f64();
            assert!(
                share.is_some_and(|s| (0.0..=1.0).contains(&s)),
                "{side}.{kind}: {r}"
            );
        }
    }
}

/// `ember launch` refuses what is not a training job before starting anything, and does not
/// restart a job whose configuration its ranks refused (a restart would not change it).
#[test]
fn launch_refuses_what_a_restart_would_not_fix() {
    let tmp = tempfile::tempdir().unwrap();
    refused(
        &["launch", "--np", "1", "--", "eval"],
        2,
        "ember launch runs ember train",
    );
    refused(
        &["launch", "--np", "1", "--", "train", "--bogus-flag"],
        2,
        "--bogus-flag",
    );
    let out = tmp.path().join("refused");
    let root = [
        ("OMPI_ALLOW_RUN_AS_ROOT", "1"),
        ("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1"),
    ];
    let run = ember_with(
        &[
            "launch",
            "--np",
            "1",
            "--max-restarts",
            "3",
            "--",
            "train",
            "--preset",
            "tiny",
            "--n-embd",
            "100",
            "--n-head",
            "3",
            "--out-dir",
            path(&out),
        ],
        &root,
        Duration::from_secs(120),
    );
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert_eq!(run.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("refused the job's configuration")
            && stderr.contains("--n-embd 100 is not divisible by --n-head 3"),
        "{stderr}"
    );
    assert!(!stderr.contains("restart 1"), "{stderr}");
    let events = ember_train::files::metrics::read_events(&out.join("metrics.jsonl")).unwrap();
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(events[0]["event"], "gave_up");
}

/// A GPU run keeps autotune's choices in the kernel cache (`--kernel-cache DIR`), and the next
/// run of the same shapes starts from them and says so; `off` keeps nothing; a file where the
/// folder should be is refused before anything runs.
#[test]
fn the_kernel_cache_carries_autotune_from_one_run_to_the_next() {
    let file = tempfile::NamedTempFile::new().unwrap();
    refused(
        &["--kernel-cache", path(file.path()), "bench", "train"],
        2,
        "not a folder",
    );
    if !cfg!(feature = "wgpu") {
        eprintln!("the kernel cache is CubeCL's: this build has no CubeCL device to run it on");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("kernels");
    let bench = |cache: &str| {
        let out = ok(&[
            "--kernel-cache",
            cache,
            "bench",
            "train",
            "--device",
            "wgpu",
            "--presets",
            "tiny",
            "--batch-size",
            "2",
            "--block-size",
            "32",
            "--vocab-size",
            "512",
            "--steps",
            "1",
            "--warmup",
            "1",
            "--json",
        ]);
        let stderr = String::from_utf8_lossy(&out.stderr).to_string();
        let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        (stderr, json["kernel_cache"].clone())
    };
    let (log, first) = bench(path(&cache));
    assert!(log.contains("is empty: this run tunes"), "{log}");
    assert_eq!(first["tuned"], 0, "{first}");
    assert!(cache.is_dir(), "{}", cache.display());
    let (log, second) = bench(path(&cache));
    let tuned = second["tuned"].as_u64().unwrap();
    assert!(
        tuned > 0,
        "the second run found nothing the first kept: {second}"
    );
    assert!(log.contains(&format!("{tuned} autotune results")), "{log}");
    let (log, off) = bench("off");
    assert!(log.contains("kernel cache off"), "{log}");
    assert_eq!(off["dir"], serde_json::Value::Null, "{off}");
}

/// A step that does not fit the device's memory ends with the device's own reason and what to
/// do, exit 1, no panic. On lavapipe the logits of 8 x 1024 tokens over gpt2's vocabulary
/// (1.6 GB in one buffer) are past what one buffer may hold.
#[test]
fn a_step_the_device_cannot_hold_is_a_clear_error() {
    if !cfg!(feature = "wgpu") {
        eprintln!("needs a device with memory of its own: this build has only flex");
        return;
    }
    let args = [
        "--kernel-cache",
        "off",
        "bench",
        "train",
        "--device",
        "wgpu",
        "--presets",
        "tiny",
        "--batch-size",
        "8",
        "--block-size",
        "1024",
        "--vocab-size",
        "50304",
        "--steps",
        "1",
        "--warmup",
        "0",
    ];
    let out = ember(&args, Duration::from_secs(300));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    for needle in [
        "the device failed: can't allocate",
        "--grad-accum for smaller micro-batches",
    ] {
        assert!(stderr.contains(needle), "expected {needle:?} in {stderr}");
    }
    assert!(!stderr.contains("panicked"), "{stderr}");
}

/// `ember bench matmul` times every product of a step (three per linear layer, the head's
/// once, the blocks' once per layer) on each device this build has, and refuses a preset it
/// does not know.
#[test]
fn bench_matmul_times_every_product_of_a_step() {
    refused(
        &["bench", "matmul", "--preset", "gpt5"],
        2,
        "--preset gpt5: no such preset",
    );
    for device in devices() {
        let out = ok(&[
            "bench",
            "matmul",
            "--device",
            device,
            "--preset",
            "tiny",
            "--batch-size",
            "2",
            "--block-size",
            "32",
            "--vocab-size",
            "300",
            "--rounds",
            "2",
            "--per-round",
            "2",
            "--json",
        ]);
        let rows = json_lines(&out);
        assert_eq!(rows.len(), 15, "{device}: {rows:?}");
        let layers = ember_model::GptConfig::preset("tiny").unwrap().n_layer as u64;
        for r in &rows {
            let name = r["name"].as_str().unwrap();
            let per_step = if name.starts_with("lm_head") {
                1
            } else {
                layers
            };
            assert_eq!(r["per_step"], per_step, "{device}: {r}");
            let dims = ["m", "k", "n"].map(|k| r[k].as_f64().unwrap());
            let (ms, tflops) = (r["ms"].as_f64().unwrap(), r["tflops"].as_f64().unwrap());
            assert!(ms > 0.0 && ms.is_finite(), "{device}: {r}");
            let want = 2.0 * dims.iter().product::<f64>() / (ms * 1e-3) / 1e12;
            assert!((tflops - want).abs() <= 1e-9 * want, "{device}: {r}");
            assert!(dims.contains(&64.0), "tiny's width is 64: {r}");
        }
    }
}

/// `ember bench staging` measures each kind of crossing at each size on each device this build
/// has, and refuses a size it cannot read.
#[test]
fn bench_staging_measures_every_crossing() {
    refused(&["bench", "staging", "--sizes", "12Q"], 2, "--sizes 12Q");
    for device in devices() {
        let out = ok(&[
            "bench", "staging", "--device", device, "--sizes", "4K,1M", "--rounds", "2", "--json",
        ]);
        let rows = json_lines(&out);
        assert_eq!(rows.len(), 2, "{device}: {rows:?}");
        assert_eq!(rows[0]["bytes"], 4096, "{device}");
        assert_eq!(rows[1]["bytes"], 1 << 20, "{device}");
        for r in &rows {
            for k in [
                "to_host_f32",
                "to_device_f32",
                "to_host_bf16",
                "to_device_bf16",
            ] {
                let rate = r[k].as_f64().unwrap();
                assert!(rate > 0.0 && rate.is_finite(), "{device} {k}: {r}");
            }
        }
    }
}

#[test]
fn a_one_process_cpu_run_advises_its_heap_for_huge_pages() {
    if !cfg!(all(target_os = "linux", target_env = "gnu"))
        || !Path::new("/sys/kernel/mm/transparent_hugepage").exists()
    {
        eprintln!("skipped: no glibc heap or no transparent huge pages here");
        return;
    }
    let mut child = Command::new(env!("CARGO_BIN_EXE_ember"))
        .args([
            "bench",
            "train",
            "--presets",
            "tiny",
            "--steps",
            "60",
            "--warmup",
            "1",
        ])
        .env("EMBER_CACHE_DIR", cache_dir())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let smaps = format!("/proc/{}/smaps", child.id());
    // Whether a mapping of the heap carries the huge-page advice (`hg`) in this reading.
    let advised = |text: &str| {
        let mut heap = false;
        text.lines().any(|line| {
            if let Some(flags) = line.strip_prefix("VmFlags:") {
                let hit = heap && flags.split_whitespace().any(|f| f == "hg");
                heap = false;
                hit
            } else {
                if line.contains('-') && line.ends_with("[heap]") {
                    heap = true;
                }
                false
            }
        })
    };
    let start = Instant::now();
    let mut seen = false;
    while child.try_wait().unwrap().is_none() {
        assert!(
            start.elapsed() < Duration::from_secs(300),
            "the run did not end"
        );
        seen |= std::fs::read_to_string(&smaps).is_ok_and(|t| advised(&t));
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(child.wait().unwrap().success());
    assert!(
        seen,
        "no stretch of the heap was advised for huge pages while it trained"
    );
}
