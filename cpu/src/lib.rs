//! What this CPU's vector units run, probed once for the whole process. Every ember kernel
//! compiled for more than one instruction set picks its version here: the quantization
//! kernels (`ember-comm`), the host passes over flex tensors (`ember-sharding`), the model's
//! fused kernels and bf16 products (`ember-model`), and the peak-FLOP estimate behind MFU.
//!
//! A kernel compiled for [`Vector::Avx512`] may use AVX-512 F, BW, DQ and VL together with
//! AVX2, FMA and BMI2; one compiled for [`Vector::Avx2`] may use AVX2, FMA and BMI2. Each
//! level is granted only where the CPU reports every feature it names.
//!
//! AMX (Intel's tile registers and their bf16 products, `tdpbf16ps`) takes more than the
//! CPU's word: Linux hands a process the tiles' 8 KiB of state only when asked
//! (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`). [`amx`] asks once and answers
//! whether a kernel may use them.

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
    /// AMX-TILE and AMX-BF16 (tile registers, `tdpbf16ps`), as the CPU reports them. Whether
    /// this process may use them is [`amx`]'s answer.
    pub amx_bf16: bool,
    /// Bytes of a core's L2 cache, as the CPU reports them in the cache leaves Linux lists
    /// its caches from (CPUID 4 on Intel, 0x8000_001D on AMD; else leaf 0x8000_0006);
    /// `None` where it says nothing.
    pub l2_bytes: Option<usize>,
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
        // CPUID leaf 7: EDX bit 22 is AMX-BF16, bit 24 AMX-TILE (the standard library's
        // detection of them is not stable yet).
        let leaf7 = std::arch::x86_64::__cpuid_count(7, 0);
        let amx = leaf7.edx >> 22 & 1 == 1 && leaf7.edx >> 24 & 1 == 1;
        Cpu {
            vector,
            avx512_bf16: avx512 && has!("avx512bf16"),
            // Every CPU with AMX has AVX-512, which the kernels around the tiles use.
            amx_bf16: avx512 && amx,
            l2_bytes: l2_bytes(),
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        Cpu {
            vector: Vector::Baseline,
            avx512_bf16: false,
            amx_bf16: false,
            l2_bytes: None,
        }
    }
}

/// A core's L2 in bytes from CPUID: the unified level-2 entry of the deterministic cache
/// leaf (4 on Intel, 0x8000_001D on AMD, the leaves Linux's cache list reads), else leaf
/// 0x8000_0006's size in KiB (ECX bits 31-16), which hypervisors may fill in apart from the
/// cache leaves.
#[cfg(target_arch = "x86_64")]
fn l2_bytes() -> Option<usize> {
    use std::arch::x86_64::__cpuid_count;
    let (max, max_ext) = (__cpuid_count(0, 0).eax, __cpuid_count(0x8000_0000, 0).eax);
    for leaf in [4, 0x8000_001D] {
        if (leaf < 0x8000_0000 && max < leaf) || (leaf >= 0x8000_0000 && max_ext < leaf) {
            continue;
        }
        // Sub-leaves until a null entry (type 0): EAX bits 4-0 type (3 unified), 7-5 level;
        // size = ways x partitions x line bytes x sets (each field stored less one).
        for sub in 0..16 {
            let r = __cpuid_count(leaf, sub);
            let kind = r.eax & 0x1f;
            if kind == 0 {
                break;
            }
            if kind == 3 && (r.eax >> 5) & 7 == 2 {
                let field =
                    |v: u32, shift: u32, bits: u32| ((v >> shift) & ((1 << bits) - 1)) as usize + 1;
                let ways = field(r.ebx, 22, 10);
                let partitions = field(r.ebx, 12, 10);
                let line = field(r.ebx, 0, 12);
                let sets = r.ecx as usize + 1;
                return Some(ways * partitions * line * sets);
            }
        }
    }
    let kib = if max_ext >= 0x8000_0006 {
        __cpuid_count(0x8000_0006, 0).ecx >> 16
    } else {
        0
    };
    (kib > 0).then_some(kib as usize * 1024)
}

/// Whether this process may run AMX bf16 products: the CPU has AMX-TILE and AMX-BF16
/// ([`Cpu::amx_bf16`]) and the kernel granted the tiles' state to the process, asked for on
/// the first call (permission is the whole process's, its threads' now and later). `Err`
/// says why not, for a run's first lines.
pub fn amx() -> Result<(), &'static str> {
    static GRANTED: OnceLock<Result<(), &'static str>> = OnceLock::new();
    *GRANTED.get_or_init(|| {
        if !cpu().amx_bf16 {
            return Err("this CPU has no AMX-BF16 tiles");
        }
        request_tiles()
    })
}

#[cfg(all(target_os = "linux", target_arch = "x86_64"))]
fn request_tiles() -> Result<(), &'static str> {
    // From the kernel's arch/x86/include/uapi/asm/prctl.h and fpu/types.h.
    const ARCH_GET_XCOMP_PERM: libc::c_long = 0x1022;
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: arch_prctl with these codes reads and writes nothing of this process's memory
    // but `granted`, a valid u64.
    unsafe {
        if libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        ) != 0
        {
            return Err("the kernel refused the AMX tiles' state (arch_prctl ARCH_REQ_XCOMP_PERM)");
        }
        let mut granted: u64 = 0;
        if libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_GET_XCOMP_PERM,
            &mut granted as *mut u64,
        ) != 0
            || granted >> XFEATURE_XTILEDATA & 1 == 0
        {
            return Err("the kernel did not grant the AMX tiles' state");
        }
    }
    Ok(())
}

#[cfg(not(all(target_os = "linux", target_arch = "x86_64")))]
fn request_tiles() -> Result<(), &'static str> {
    Err("ember asks for the AMX tiles' state only on Linux")
}

/// How many times the multiply-adds per second of f32 FMA (`vfmadd231ps`) this CPU's bf16
/// dot products (`vdpbf16ps`, two bf16 products summed into each f32 lane) reach, measured
/// once in this process on 512-bit registers: `None` without AVX512_BF16.
///
/// The instructions alone say nothing of their speed: Zen 4 runs `vdpbf16ps` at the rate of
/// its 512-bit FMA, twice the multiply-adds (2.00x measured); where they give no more
/// multiply-adds than FMA (a Sapphire Rapids machine), bf16 arithmetic only adds its
/// conversions. Each instruction runs in 12 independent chains (more than any core's latency
/// times its throughput), best of 9 timings of 4,096 rounds each: about a millisecond.
pub fn bf16_dot_speedup() -> Option<f64> {
    static SPEEDUP: OnceLock<Option<f64>> = OnceLock::new();
    *SPEEDUP.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        if cpu().avx512_bf16 {
            // SAFETY: the CPU has AVX-512 F and AVX512_BF16.
            return Some(unsafe { rate::speedup() });
        }
        None
    })
}

#[cfg(target_arch = "x86_64")]
mod rate {
    use std::arch::x86_64::*;
    use std::hint::black_box;
    use std::time::Instant;

    const CHAINS: usize = 12;
    const ROUNDS: usize = 4096;

    /// Seconds of the best of 9 runs of `f`.
    fn best(mut f: impl FnMut()) -> f64 {
        (0..9)
            .map(|_| {
                let start = Instant::now();
                f();
                start.elapsed().as_secs_f64()
            })
            .fold(f64::INFINITY, f64::min)
    }

    /// `ROUNDS` rounds of `CHAINS` f32 FMAs (16 multiply-adds each).
    #[target_feature(enable = "avx512f")]
    fn fma() {
        let x = _mm512_set1_ps(black_box(1.0 + 1e-7));
        let y = _mm512_set1_ps(black_box(1.0 - 1e-7));
        let mut acc = [_mm512_setzero_ps(); CHAINS];
        for _ in 0..ROUNDS {
            for a in &mut acc {
                *a = _mm512_fmadd_ps(x, y, *a);
            }
        }
        black_box(acc);
    }

    /// `ROUNDS` rounds of `CHAINS` bf16 dot products (32 multiply-adds each).
    #[target_feature(enable = "avx512f,avx512bf16")]
    fn dot() {
        let x = _mm512_cvtne2ps_pbh(_mm512_set1_ps(black_box(1.0)), _mm512_set1_ps(0.5));
        let y = _mm512_cvtne2ps_pbh(_mm512_set1_ps(black_box(0.25)), _mm512_set1_ps(2.0));
        let mut acc = [_mm512_setzero_ps(); CHAINS];
        for _ in 0..ROUNDS {
            for a in &mut acc {
                *a = _mm512_dpbf16_ps(*a, x, y);
            }
        }
        black_box(acc);
    }

    /// Multiply-adds per second of `vdpbf16ps` over those of `vfmadd231ps`.
    ///
    /// # Safety
    /// The CPU has AVX-512 F and AVX512_BF16.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub(super) unsafe fn speedup() -> f64 {
        // Each warms the unit (and the clock) before its own timings.
        let (fma_s, dot_s) = (best(|| fma()), best(|| dot()));
        (32.0 / dot_s) / (16.0 / fma_s)
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
        assert_eq!(c.amx_bf16, avx512 && all(&["amx_bf16", "amx_tile"]));
        assert!(c.vector.f32_lanes() >= 4);
    }

    #[test]
    fn the_l2_size_is_the_kernels_own() {
        // Linux lists every core's caches from the same CPUID cache leaves: the probe (on
        // whichever core this test runs; hybrid CPUs differ between kinds of core) must
        // report one of the unified L2 sizes it lists.
        let read = |p: std::path::PathBuf| std::fs::read_to_string(p).unwrap_or_default();
        let mut sizes = vec![];
        let cpus = std::fs::read_dir("/sys/devices/system/cpu")
            .into_iter()
            .flatten();
        for c in cpus.flatten() {
            let caches = std::fs::read_dir(c.path().join("cache"))
                .into_iter()
                .flatten();
            for e in caches.flatten() {
                let (level, kind) = (read(e.path().join("level")), read(e.path().join("type")));
                if level.trim() == "2" && kind.trim() == "Unified" {
                    let size = read(e.path().join("size"));
                    let kib: usize = size
                        .trim()
                        .trim_end_matches('K')
                        .parse()
                        .expect("a size in KiB");
                    sizes.push(kib * 1024);
                }
            }
        }
        if sizes.is_empty() {
            eprintln!("skipped: the kernel lists no unified L2");
            return;
        }
        let l2 = cpu().l2_bytes.expect("an L2 where the kernel lists one");
        assert!(
            sizes.contains(&l2),
            "probe {l2} bytes, the kernel lists {sizes:?}"
        );
    }

    #[test]
    fn amx_is_granted_where_the_cpu_has_it() {
        match (cpu().amx_bf16, amx()) {
            (true, Ok(())) => eprintln!("AMX tiles granted to this process"),
            // A Linux kernel from before 5.16 has no permission to ask for.
            (true, Err(why)) => eprintln!("AMX on the CPU, not granted: {why}"),
            (false, granted) => assert!(granted.is_err(), "granted without the CPU's AMX"),
        }
        assert_eq!(amx(), amx(), "asked once");
    }

    #[test]
    fn the_bf16_dot_rate_is_measured_where_the_instructions_are() {
        let speedup = bf16_dot_speedup();
        assert_eq!(speedup.is_some(), cpu().avx512_bf16);
        if let Some(s) = speedup {
            // At most two bf16 products per f32 lane per instruction: twice FMA's rate is the
            // most a core can reach, and no core runs it at under a quarter of FMA's.
            assert!((0.25..=2.2).contains(&s), "measured {s}");
            eprintln!("vdpbf16ps: {s:.2}x the multiply-adds of vfmadd231ps");
        }
    }
}
