//! Host quantization kernels beside memcpy, single thread, block 2048 (and 256, the sharding
//! default): `cargo bench -p ember-comm --bench quant`. Plain `Instant`, no harness and no MPI.
//! It deliberately measures only `HostKernels` writing into caller buffers (no allocation).
//!
//! # What the numbers mean
//!
//! As in `bench.rs`: GB/s = f32 bytes of the buffer (`4 * n`, the quantize input or the
//! dequantize output; for the sum of 2 parts still `4 * n`) / time, and `ratio` = memcpy time /
//! kernel time, memcpy being `copy_from_slice` of the same `4 * n` bytes. Each sample runs a
//! kernel enough times to move ~16 MiB; samples of every kernel alternate, so drift in the
//! machine hits all of them; the median of 15 samples (after a warm-up) is reported. The load
//! average is printed before and after: the machine is shared, so say how busy it was.

use std::hint::black_box;
use std::time::Instant;

use ember_comm::quant::host::HostKernels;
use ember_comm::quant::{BlockSize, QuantFormat, QuantKernels, Quantized};

const SIZES: [usize; 6] = [64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20];
const SAMPLES: usize = 15;
/// Bytes per sample: small buffers repeat the kernel so one sample is well above timer noise.
const SAMPLE_BYTES: usize = 16 << 20;

/// Column names: quantize, dequantize, dequantize-and-sum of 2 parts.
const KERNELS: [&str; 6] = [
    "q int8",
    "q int4",
    "dq int8",
    "dq int4",
    "dqs2 int8",
    "dqs2 int4",
];

/// The same input as `bench.rs`: values in [-0.5, 0.5) on a 1e-3 grid.
fn input(n: usize, salt: usize) -> Vec<f32> {
    (0..n)
        .map(|i| (((i + salt) * 7919) % 1000) as f32 * 1e-3 - 0.5)
        .collect()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Sizes from the command line (`-- 64K 1M`), else [`SIZES`]; cargo's own `--bench` is skipped.
fn sizes() -> Vec<usize> {
    let picked: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| {
            let (n, shift) = match a.strip_suffix('K') {
                Some(n) => (n, 10),
                None => (a.strip_suffix('M')?, 20),
            };
            Some(n.parse::<usize>().ok()? << shift)
        })
        .collect();
    if picked.is_empty() {
        SIZES.to_vec()
    } else {
        picked
    }
}

fn main() {
    if let Ok(load) = std::fs::read_to_string("/proc/loadavg") {
        println!("load average before: {}", load.trim());
    }
    for block in [2048, 256] {
        let block = BlockSize::new(block).unwrap();
        println!("\nblock {}: GB/s (ratio to memcpy)\n", block.get());
        print!("| f32 bytes | memcpy |");
        for k in KERNELS {
            print!(" {k} |");
        }
        println!("\n|---:|---:|---:|---:|---:|---:|---:|---:|");
        for &size in &sizes() {
            bench_size(size, block);
        }
    }
    if let Ok(load) = std::fs::read_to_string("/proc/loadavg") {
        println!("\nload average after: {}", load.trim());
    }
}

fn bench_size(size: usize, block: BlockSize) {
    let n = size / 4;
    let reps = (SAMPLE_BYTES / size).max(1);
    let x = input(n, 0);
    let mut copy = vec![0.0f32; n];
    let mut d8 = vec![0u8; QuantFormat::Int8.data_bytes(n)];
    let mut d4 = vec![0u8; QuantFormat::Int4.data_bytes(n)];
    let mut scales = vec![0.0f32; n.div_ceil(block.get())];
    let mut out = vec![0.0f32; n];
    let parts = |format| -> [Quantized; 2] {
        [
            HostKernels.quantize(&x, format, block),
            HostKernels.quantize(&input(n, 17), format, block),
        ]
    };
    let p8 = parts(QuantFormat::Int8);
    let p4 = parts(QuantFormat::Int4);

    let mut times = vec![Vec::new(); 7];
    for s in 0..=SAMPLES {
        let mut sample = |k: usize, f: &mut dyn FnMut()| {
            let t0 = Instant::now();
            for _ in 0..reps {
                f();
            }
            // Sample 0 is the warm-up.
            if s > 0 {
                times[k].push(t0.elapsed().as_secs_f64() / reps as f64);
            }
        };
        sample(6, &mut || {
            copy.copy_from_slice(black_box(&x));
            black_box(&mut copy);
        });
        let mut q = |format, data: &mut [u8]| {
            HostKernels.quantize_into(black_box(&x), format, block, data, &mut scales);
            black_box(data);
        };
        sample(0, &mut || q(QuantFormat::Int8, &mut d8));
        sample(1, &mut || q(QuantFormat::Int4, &mut d4));
        let mut dq = |parts: &[Quantized]| {
            match parts {
                [one] => HostKernels.dequantize_into(black_box(one), &mut out),
                _ => HostKernels.dequantize_sum_into(black_box(parts), &mut out),
            }
            black_box(&mut out);
        };
        sample(2, &mut || dq(&p8[..1]));
        sample(3, &mut || dq(&p4[..1]));
        sample(4, &mut || dq(&p8));
        sample(5, &mut || dq(&p4));
    }
    let t: Vec<f64> = times.into_iter().map(median).collect();
    let gbps = |t: f64| size as f64 / t / 1e9;
    print!("| {} | {:.2} |", human(size), gbps(t[6]));
    for &tk in &t[..6] {
        print!(" {:.2} ({:.2}) |", gbps(tk), t[6] / tk);
    }
    println!();
}

fn human(bytes: usize) -> String {
    if bytes >= 1 << 20 {
        format!("{} MiB", bytes >> 20)
    } else {
        format!("{} KiB", bytes >> 10)
    }
}
