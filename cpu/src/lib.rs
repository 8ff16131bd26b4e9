//! What this CPU's vector units run, probed once for the whole process. Every ember kernel
//! compiled for more than one instruction set picks its version here: the quantization
//! kernels (`ember-comm`), the host passes over flex tensors (`ember-sharding`), the model's
//! fused kernels and bf16 products (`ember-model`), and the peak-FLOP estimate behind MFU.
//!
//! A kernel compiled for [`Vector::Avx512`] may use AVX-512 F, BW, DQ and VL together with
//! AVX2, FMA and BMI2; one compiled for [`Vector::Avx2`] may use AVX2, FMA and BMI2. Each
//! level is granted only where the CPU reports every feature it names.

use std::sync::OnceLock;

/// The instruction sets ember compiles kernels for, narrowest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Vector {
    /// Baseline x86-64 (SSE2), or a CPU of another architecture.
    Baseline,
    /// AVX2 with FMA and BMI2 (x86-64-v3's vector part).
    Avx2,
    /// AVX-512 F, BW, DQ and VL besides AVX2, FMA and BMI2 (x86-64-v4: every AVX-512 server
    /// CPU since Skylake-SP).
    Avx512,
}

impl Vector {
    /// Lanes of f32 in one register of this set.
    pub fn f32_lanes(self) -> usize {
        match self {
            Vector::Baseline => 4,
            Vector::Avx2 => 8,
            Vector::Avx512 => 16,
        }
    }
}

impl std::fmt::Display for Vector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Vector::Baseline => "baseline",
            Vector::Avx2 => "AVX2",
            Vector::Avx512 => "AVX-512",
        })
    }
}

/// What this CPU runs, as asked once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cpu {
    /// The widest vector set every feature of which the CPU reports.
    pub vector: Vector,
    /// AVX512_BF16: bf16 pairs multiplied and summed into f32 lanes (`vdpbf16ps`), on top of
    /// [`Vector::Avx512`].
    pub avx512_bf16: bool,
}

/// This CPU's answer, probed on the first call.
pub fn cpu() -> Cpu {
    static CPU: OnceLock<Cpu> = OnceLock::new();
    *CPU.get_or_init(probe)
}

/// The widest vector set of this CPU ([`cpu`]'s `vector`).
pub fn vector() -> Vector {
    cpu().vector
}

fn probe() -> Cpu {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::is_x86_feature_detected as has;
        let avx2 = has!("avx2") && has!("fma") && has!("bmi2");
        let avx512 =
            avx2 && has!("avx512f") && has!("avx512bw") && has!("avx512dq") && has!("avx512vl");
        let vector = if avx512 {
            Vector::Avx512
        } else if avx2 {
            Vector::Avx2
        } else {
            Vector::Baseline
        };
        Cpu {
            vector,
            avx512_bf16: avx512 && has!("avx512bf16"),
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        Cpu {
            vector: Vector::Baseline,
            avx512_bf16: false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_probe_agrees_with_the_cpus_own_flags() {
        let c = cpu();
        assert_eq!(c, cpu(), "a second call answers the same");
        // /proc/cpuinfo is the kernel's own list of the CPU's flags: the probe must grant no
        // set whose features the kernel does not list, and every set whose features it does.
        let Ok(info) = std::fs::read_to_string("/proc/cpuinfo") else {
            return;
        };
        let Some(flags) = info.lines().find(|l| l.starts_with("flags")) else {
            return;
        };
        let flags: Vec<&str> = flags.split_whitespace().collect();
        let all = |names: &[&str]| names.iter().all(|n| flags.contains(n));
        let avx2 = all(&["avx2", "fma", "bmi2"]);
        let avx512 = avx2 && all(&["avx512f", "avx512bw", "avx512dq", "avx512vl"]);
        let expected = if avx512 {
            Vector::Avx512
        } else if avx2 {
            Vector::Avx2
        } else {
            Vector::Baseline
        };
        assert_eq!(c.vector, expected, "flags: {flags:?}");
        assert_eq!(c.avx512_bf16, avx512 && all(&["avx512_bf16"]));
        assert!(c.vector.f32_lanes() >= 4);
    }
}
