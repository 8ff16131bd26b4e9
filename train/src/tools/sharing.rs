//! How much of the machine's CPU time went elsewhere while a benchmark ran: to other
//! processes, and to the hypervisor (steal, a vCPU descheduled by the host). A benchmark's
//! figure is only as good as the machine was quiet; on a VM the host may take a vCPU away
//! at any moment, and a fork-join step waits for the thread whose vCPU is gone.
//!
//! Read from Linux's `/proc/stat` (each CPU's time by kind, in clock ticks; those this
//! process may run on, its affinity) and this process's own CPU time (`getrusage`, its
//! threads and its children once reaped) at both ends of the interval: what those CPUs spent
//! busy beyond this process's own time went to others. Ticks are sampled at 100 Hz, so an
//! interval of a second on 2 CPUs reads to about 1% of the machine.

use serde::Serialize;

/// Shares of the time of the CPUs this process may run on over an interval, each from 0 to 1.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Sharing {
    /// Busy in other processes (and the kernel's work for them).
    pub others: f64,
    /// Stolen: the hypervisor ran something else on this VM's vCPUs.
    pub steal: f64,
}

impl Sharing {
    /// Of the two, the larger.
    pub fn elsewhere(self) -> f64 {
        self.others.max(self.steal)
    }
}

/// Above this share of the machine going elsewhere (either kind), a benchmark warns that its
/// figures are suspect.
pub const QUIET_BELOW: f64 = 0.05;

/// The CPUs' time and this process's at one moment.
#[derive(Debug, Clone, Copy)]
pub struct Sample {
    /// `/proc/stat`'s counters summed over the CPUs this process may run on: user, nice,
    /// system, idle, iowait, irq, softirq, steal.
    ticks: Ticks,
    /// This process's CPU time and that of its reaped children, seconds.
    own_s: f64,
}

/// The eight counters of a `/proc/stat` CPU line that partition its time (guest time is
/// already inside user time).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Ticks([u64; 8]);

impl Ticks {
    fn total(&self) -> u64 {
        self.0.iter().sum()
    }
    /// user, nice, system, irq, softirq: not idle, not waiting for I/O, not stolen.
    fn busy(&self) -> u64 {
        let [user, nice, system, _, _, irq, softirq, _] = self.0;
        user + nice + system + irq + softirq
    }
    fn steal(&self) -> u64 {
        self.0[7]
    }
}

/// The sum of the `cpuN` lines of a `/proc/stat` for the CPUs `allowed` holds (all of them
/// where it is `None`), or `None` where `stat` holds none of them or a line is cut short.
fn parse(stat: &str, allowed: Option<&[usize]>) -> Option<Ticks> {
    let mut sum = [0u64; 8];
    let mut found = false;
    for line in stat.lines() {
        let mut fields = line.split_whitespace();
        let Some(n) = fields
            .next()
            .and_then(|name| name.strip_prefix("cpu"))
            .and_then(|n| n.parse::<usize>().ok())
        else {
            continue;
        };
        if allowed.is_some_and(|a| !a.contains(&n)) {
            continue;
        }
        for t in &mut sum {
            *t += fields.next()?.parse::<u64>().ok()?;
        }
        found = true;
    }
    found.then_some(Ticks(sum))
}

/// The CPUs this process may run on (its affinity), or `None` where it cannot tell.
#[cfg(target_os = "linux")]
fn allowed_cpus() -> Option<Vec<usize>> {
    // SAFETY: sched_getaffinity writes one cpu_set_t into the zeroed value it is handed, and
    // CPU_ISSET reads it for numbers below its size.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return None;
        }
        let cpus: Vec<usize> = (0..libc::CPU_SETSIZE as usize)
            .filter(|&c| libc::CPU_ISSET(c, &set))
            .collect();
        (!cpus.is_empty()).then_some(cpus)
    }
}

/// Seconds of CPU this process and its reaped children have used.
#[cfg(target_os = "linux")]
fn own_seconds() -> Option<f64> {
    let seconds = |who| {
        // SAFETY: getrusage writes one rusage into the zeroed value it is handed.
        let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
        (unsafe { libc::getrusage(who, &mut usage) } == 0).then(|| {
            let s = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
            s(usage.ru_utime) + s(usage.ru_stime)
        })
    };
    Some(seconds(libc::RUSAGE_SELF)? + seconds(libc::RUSAGE_CHILDREN)?)
}

/// Clock ticks per second of `/proc/stat` (Linux's usual 100 where it cannot tell).
fn ticks_per_second() -> f64 {
    #[cfg(target_os = "linux")]
    // SAFETY: sysconf only reads a configuration value.
    if let hz @ 1.. = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } {
        return hz as f64;
    }
    100.0
}

/// The CPUs' time and this process's now; `None` off Linux or where `/proc/stat` cannot be
/// read.
pub fn sample() -> Option<Sample> {
    #[cfg(target_os = "linux")]
    {
        let stat = std::fs::read_to_string("/proc/stat").ok()?;
        let ticks = parse(&stat, allowed_cpus().as_deref())?;
        Some(Sample {
            ticks,
            own_s: own_seconds()?,
        })
    }
    #[cfg(not(target_os = "linux"))]
    {
        None
    }
}

impl Sample {
    /// Where the CPUs' time went between `earlier` and this sample; `None` where no tick
    /// passed. A child that ends inside the interval counts as this process's own once it is
    /// reaped, so sample after reaping the children whose time is the benchmark's.
    pub fn since(&self, earlier: &Sample) -> Option<Sharing> {
        share(
            earlier.ticks,
            self.ticks,
            (self.own_s - earlier.own_s) * ticks_per_second(),
        )
    }
}

/// Where the CPUs' time went from `before` (a [`sample`]) to now; `None` where either end
/// could not be read or no tick passed.
pub fn since(before: Option<Sample>) -> Option<Sharing> {
    sample()?.since(&before?)
}

/// [`Sample::since`] from the counters at both ends and this process's own ticks between.
fn share(before: Ticks, after: Ticks, own_ticks: f64) -> Option<Sharing> {
    let delta = |f: fn(&Ticks) -> u64| f(&after).saturating_sub(f(&before)) as f64;
    let total = delta(Ticks::total);
    if total <= 0.0 {
        return None;
    }
    Some(Sharing {
        others: ((delta(Ticks::busy) - own_ticks) / total).clamp(0.0, 1.0),
        steal: (delta(Ticks::steal) / total).clamp(0.0, 1.0),
    })
}

/// Of `shares`, the one with the most going elsewhere (either kind), and that share.
pub fn worst(shares: &[Sharing]) -> Option<Sharing> {
    shares
        .iter()
        .copied()
        .max_by(|a, b| a.elsewhere().total_cmp(&b.elsewhere()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    const STAT: &str = "cpu  3700 8 1510 880100 300 0 95 2205 0 0\n\
                        cpu0 3600 6 750 440000 150 0 47 1105 0 0\n\
                        cpu1 100 2 760 440100 150 0 48 1100 0 0\n\
                        intr 1 2 3\n";

    #[test]
    fn the_lines_of_the_allowed_cpus_are_summed_in_their_order() {
        assert_eq!(
            parse(STAT, None),
            Some(Ticks([3700, 8, 1510, 880100, 300, 0, 95, 2205]))
        );
        assert_eq!(
            parse(STAT, Some(&[1])),
            Some(Ticks([100, 2, 760, 440100, 150, 0, 48, 1100]))
        );
        assert_eq!(parse(STAT, Some(&[7])), None, "no line of an allowed CPU");
        assert_eq!(
            parse("cpu  1 2 3 4 5 6 7 8\n", None),
            None,
            "no CPU's own line"
        );
        assert_eq!(parse("cpu0 1 2 3\n", None), None, "a line cut short");
    }

    #[test]
    fn busy_ticks_beyond_our_own_are_others_and_steal_is_apart() {
        let before = Ticks([100, 0, 20, 1000, 0, 0, 0, 10]);
        // 200 ticks pass: 120 busy (80 user, 30 system, 10 softirq), 60 idle, 20 stolen.
        let after = Ticks([180, 0, 50, 1060, 0, 0, 10, 30]);
        let s = share(before, after, 90.0).unwrap();
        assert!((s.others - 30.0 / 200.0).abs() < 1e-12, "{s:?}");
        assert!((s.steal - 20.0 / 200.0).abs() < 1e-12, "{s:?}");
        assert_eq!(s.elsewhere(), s.others);
        // More of our own time than the ticks show (their sampling): no one else, not below 0.
        assert_eq!(share(before, after, 500.0).unwrap().others, 0.0);
        assert_eq!(share(before, before, 0.0), None, "no tick passed");
    }

    #[test]
    fn the_worst_share_is_the_one_with_the_most_elsewhere() {
        let a = Sharing {
            others: 0.02,
            steal: 0.10,
        };
        let b = Sharing {
            others: 0.08,
            steal: 0.0,
        };
        assert_eq!(worst(&[b, a]), Some(a));
        assert_eq!(worst(&[]), None);
    }

    /// A process spinning beside us for half a second is seen as others' time, at least half
    /// a core's worth of it.
    #[cfg(target_os = "linux")]
    #[test]
    fn a_spinning_process_beside_us_counts_as_others() {
        let cpus = allowed_cpus().map_or(1, |c| c.len()) as f64;
        let mut spinner = std::process::Command::new("sh")
            .args(["-c", "while :; do :; done"])
            .spawn()
            .expect("starting sh");
        std::thread::sleep(Duration::from_millis(100));
        let before = sample().unwrap();
        std::thread::sleep(Duration::from_millis(500));
        // Sampled before the spinner is reaped: its time is not ours.
        let after = sample().unwrap();
        spinner.kill().unwrap();
        spinner.wait().unwrap();
        let s = after.since(&before).unwrap();
        assert!(s.others * cpus >= 0.5, "{s:?} of {cpus} CPUs");
    }
}
