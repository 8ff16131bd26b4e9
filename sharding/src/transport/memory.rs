//! Memory as the operating system reports it: this process's resident set (now and its peak)
//! and the memory available to new processes. These are measurements, read from the kernel;
//! nothing here adds up what the plan says should be held.

/// This process's resident memory, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub struct Resident {
    /// Resident set size now (`VmRSS`).
    pub current: u64,
    /// Largest resident set size since the process started (`VmHWM`, what `/usr/bin/time`
    /// reports as maximum resident set size).
    pub peak: u64,
}

/// Reads `/proc/self/status`; falls back to `getrusage` (peak only) where there is no procfs.
pub fn resident() -> Resident {
    if let Ok(status) = std::fs::read_to_string("/proc/self/status") {
        let field = |key: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(key))
                .and_then(kib)
        };
        if let (Some(current), Some(peak)) = (field("VmRSS:"), field("VmHWM:")) {
            return Resident { current, peak };
        }
    }
    let peak = max_rss_getrusage();
    Resident {
        current: peak,
        peak,
    }
}

/// Resets this process's peak (`VmHWM`) to its current resident set, so a later [`resident`]
/// reports the peak of what came after (Linux's `/proc/self/clear_refs`). Returns whether the
/// kernel accepted it; where it does not, the peak keeps covering the whole process.
pub fn reset_peak() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

/// Memory the kernel says new allocations can get without swapping (`MemAvailable` of
/// `/proc/meminfo`), or `None` where it does not say.
pub fn available() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    info.lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))
        .and_then(kib)
}

/// Bytes in use on `device`'s own memory, where its backend reports them (CubeCL devices, with
/// the `cubecl` feature); `None` on host backends, whose memory is the resident set above.
pub fn device_bytes_in_use(device: &burn::tensor::Device) -> Option<u64> {
    #[cfg(feature = "cubecl")]
    if let Some(b) = crate::transport::cube::device_bytes_in_use(device) {
        return Some(b);
    }
    let _ = device;
    None
}

/// Bytes `device`'s memory pools hold from the driver, in use or kept for reuse, where its
/// backend reports them (CubeCL devices, with the `cubecl` feature); `None` elsewhere.
pub fn device_bytes_reserved(device: &burn::tensor::Device) -> Option<u64> {
    #[cfg(feature = "cubecl")]
    if let Some(b) = crate::transport::cube::device_bytes_reserved(device) {
        return Some(b);
    }
    let _ = device;
    None
}

/// Parses `"   12345 kB"` into bytes.
fn kib(rest: &str) -> Option<u64> {
    let mut parts = rest.split_whitespace();
    let n: u64 = parts.next()?.parse().ok()?;
    match parts.next() {
        Some("kB") | None => Some(n * 1024),
        Some(_) => None,
    }
}

fn max_rss_getrusage() -> u64 {
    // SAFETY: `getrusage` writes one `rusage` into the zeroed struct we own.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    let rc = unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) };
    if rc != 0 {
        return 0;
    }
    // Linux reports kilobytes, macOS bytes.
    let scale = if cfg!(target_os = "macos") { 1 } else { 1024 };
    usage.ru_maxrss.max(0) as u64 * scale
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn touching_memory_raises_the_measured_peak() {
        let before = resident();
        assert!(before.peak >= before.current && before.current > 0);
        // 64 MiB written page by page must show up in the resident set.
        let mut block = vec![0u8; 64 << 20];
        for i in (0..block.len()).step_by(4096) {
            block[i] = 1;
        }
        let after = resident();
        std::hint::black_box(&block);
        assert!(
            after.peak >= before.current + (60 << 20),
            "peak {} after touching 64 MiB, resident before {}",
            after.peak,
            before.current
        );
        assert!(available().is_some_and(|a| a > 0));
    }
}
