use ember_comm::quant::host::HostKernels;
use ember_comm::quant::{BlockSize, QuantFormat, QuantKernels, reference};

fn next(s: &mut u64) -> u64 { *s ^= *s << 13; *s ^= *s >> 7; *s ^= *s << 17; *s }

#[test]
fn stress() {
    let mut s = 0x9e3779b97f4a7c15u64;
    let mut total = 0usize;
    for round in 0..2000 {
        let n = 1 << 17;
        let kind = round % 5;
        let x: Vec<f32> = (0..n).map(|i| {
            let r = next(&mut s);
            match kind {
                // continuous, random exponent per 256-block
                0 => { let e = ((i / 256) as u64 * 2654435761 % 250) as i32 - 125; ((r >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 2f32.powi(e) }
                // bf16-rounded
                1 => { let v = ((r >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 2f32.powi((r % 20) as i32 - 10); f32::from_bits(v.to_bits() & 0xffff_0000) }
                // small integers and halves
                2 => ((r % 511) as f32 - 255.0) * 0.5,
                // raw random bits (finite only)
                3 => { let v = f32::from_bits(r as u32); if v.is_finite() { v } else { 1.0 } }
                // bench-like grid
                _ => ((i * 7919 + round) % 1000) as f32 * 1e-3 - 0.5,
            }
        }).collect();
        for block in [8usize, 16, 64, 256, 2048] {
            let block = BlockSize::new(block).unwrap();
            for format in [QuantFormat::Int8, QuantFormat::Int4] {
                let want = reference::quantize(&x, format, block);
                let got = HostKernels.quantize(&x, format, block);
                assert!(got.bit_eq(&want), "round {round} kind {kind} {format:?} {block:?}");
                total += n;
            }
        }
        if round % 100 == 0 { eprintln!("round {round}"); }
    }
    eprintln!("{total} element-quantizations identical");
}
