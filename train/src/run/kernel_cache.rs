//! Where CubeCL keeps what it learns about a device between runs: autotune's choice of kernel
//! for every shape it has timed, and (on CUDA and ROCm) the compiled kernels. A run on a GPU
//! otherwise spends its first steps compiling and timing candidates again; with the cache, a
//! later run of the same shapes on the same device starts from them.
//!
//! `--kernel-cache DIR` (or `EMBER_KERNEL_CACHE`) names the folder, `off` keeps
//! the autotune results and compiled kernels in memory (CubeCL's own probes of the device keep
//! the place CubeCL's configuration gives them). By default the folder is `kernels` in ember's
//! cache folder (where prepared corpora go: `$EMBER_CACHE_DIR`, else `$XDG_CACHE_HOME/ember`,
//! else `~/.cache/ember`). Every other CubeCL setting (`cubecl.toml`, `CUBECL_*`) is honoured
//! as CubeCL reads it. Ranks of a job share the folder: CubeCL writes it as one database that
//! several processes may open.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use serde::Serialize;

use crate::error::{CliResult, usage};

/// Where the kernel cache lives, as chosen on the command line or in the environment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KernelCache {
    /// Autotune results and compiled kernels stay in memory: every run tunes and compiles every
    /// kernel.
    Off,
    /// The folder that holds it.
    Dir(PathBuf),
}

/// The environment variable read when `--kernel-cache` is not given.
pub const ENV: &str = "EMBER_KERNEL_CACHE";

static CHOSEN: OnceLock<KernelCache> = OnceLock::new();

impl KernelCache {
    /// `--kernel-cache`'s value (`flag`), else [`ENV`]'s, else the user's cache folder.
    pub fn resolve(flag: Option<&str>) -> CliResult<Self> {
        Self::resolve_from(flag, std::env::var(ENV).ok())
    }

    /// [`KernelCache::resolve`] with [`ENV`]'s value given.
    fn resolve_from(flag: Option<&str>, env: Option<String>) -> CliResult<Self> {
        let (what, value) = match flag {
            Some(v) => ("--kernel-cache", Some(v.to_string())),
            None => (ENV, env.filter(|v| !v.is_empty())),
        };
        match value.as_deref() {
            Some("off") => Ok(Self::Off),
            Some(dir) => {
                let dir = PathBuf::from(dir);
                if dir.exists() && !dir.is_dir() {
                    return Err(usage(format!(
                        "{what} {}: not a folder; name a folder for the kernel cache, or off",
                        dir.display()
                    )));
                }
                Ok(Self::Dir(dir))
            }
            None => Ok(Self::Dir(default_dir())),
        }
    }

    /// Makes `self` the process's choice (the binary makes it at start from
    /// `--kernel-cache`); the first call wins.
    pub fn choose(self) {
        let _ = CHOSEN.set(self);
    }

    /// The process's choice: what [`KernelCache::choose`] was given, else [`ENV`]'s or the
    /// default, read when a CubeCL device first needs it (so a command that starts none
    /// never reads it).
    pub fn chosen() -> CliResult<&'static Self> {
        if let Some(c) = CHOSEN.get() {
            return Ok(c);
        }
        let c = Self::resolve(None)?;
        Ok(CHOSEN.get_or_init(|| c))
    }
}

/// `ENV=VALUE` for the ranks a launcher starts, which may run on other hosts: the choice of
/// `--kernel-cache` (a folder made absolute) or of [`ENV`], where one was made.
pub fn for_ranks() -> Option<String> {
    for_ranks_of(CHOSEN.get(), std::env::var(ENV).ok())
}

/// [`for_ranks`] of the choice made (`chosen`) and [`ENV`]'s value (`env`).
fn for_ranks_of(chosen: Option<&KernelCache>, env: Option<String>) -> Option<String> {
    let value = match chosen {
        Some(KernelCache::Off) => "off".to_string(),
        Some(KernelCache::Dir(dir)) => std::path::absolute(dir)
            .unwrap_or_else(|_| dir.clone())
            .display()
            .to_string(),
        None => env.filter(|v| !v.is_empty())?,
    };
    Some(format!("{ENV}={value}"))
}

/// A file made and removed in `dir`: whether CubeCL can write its database there.
#[cfg_attr(
    not(any(feature = "wgpu", feature = "cuda", feature = "rocm")),
    allow(dead_code)
)]
fn writable(dir: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let probe = dir.join(format!(".ember-probe-{}", std::process::id()));
    std::fs::write(&probe, b"")?;
    std::fs::remove_file(&probe)
}

/// `kernels` in ember's cache folder ([`crate::run::data::cache_root`]).
fn default_dir() -> PathBuf {
    crate::run::data::cache_root().join("kernels")
}

/// What the cache held when this process first used a CubeCL device: entries written by
/// earlier runs.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Warmth {
    /// The cache's folder; `None` when it is off.
    pub dir: Option<PathBuf>,
    /// Autotune results (one per operation and shape class tuned on this device).
    pub tuned: u64,
    /// Compiled kernels (CUDA and ROCm keep them; wgpu compiles WGSL in its driver each run).
    pub compiled: u64,
    /// Why the cache could not be used, where it could not.
    pub error: Option<String>,
}

impl Warmth {
    /// One line for the run's log.
    pub fn line(&self) -> String {
        match (&self.dir, &self.error) {
            (None, _) => "kernel cache off: this run tunes and compiles every kernel".to_string(),
            (Some(dir), Some(e)) => format!(
                "kernel cache {} unusable ({e}): this run tunes and compiles every kernel and \
                 keeps the results in memory only",
                dir.display()
            ),
            (Some(dir), None) if self.tuned + self.compiled == 0 => format!(
                "kernel cache {} is empty: this run tunes and compiles every kernel it uses, \
                 and keeps the results there for the next",
                dir.display()
            ),
            (Some(dir), None) => format!(
                "kernel cache {}: {} autotune result{} and {} compiled kernel{} from earlier runs",
                dir.display(),
                self.tuned,
                if self.tuned == 1 { "" } else { "s" },
                self.compiled,
                if self.compiled == 1 { "" } else { "s" },
            ),
        }
    }
}

/// Hands the chosen cache to CubeCL before its first device (of kind `device`) starts, once
/// per process, and returns what the cache held then (later calls return the first call's
/// answer). Compiled kernels are kept only for CUDA and ROCm, whose compiler's output CubeCL
/// can store (on wgpu the driver compiles WGSL itself, and keeping CubeCL's records of it
/// doubled the first step on lavapipe for nothing). A folder that cannot be written is said,
/// and the run keeps everything in memory. Fails where [`ENV`] names a file.
#[cfg(any(feature = "wgpu", feature = "cuda", feature = "rocm"))]
pub fn configure(device: crate::run::config::DeviceKind) -> CliResult<&'static Warmth> {
    use cubecl::config::{CubeClRuntimeConfig, RuntimeConfig};
    static WARMTH: OnceLock<Warmth> = OnceLock::new();
    if let Some(w) = WARMTH.get() {
        return Ok(w);
    }
    let chosen = KernelCache::chosen()?;
    let mut config = CubeClRuntimeConfig::from_current_dir().override_from_env();
    let mut warmth = Warmth::default();
    if let KernelCache::Dir(dir) = chosen {
        warmth.dir = Some(dir.clone());
        match writable(dir) {
            Ok(()) => {
                config.environment.path =
                    cubecl::config::cache::CacheConfig::Directory(dir.clone());
                config.compilation.cache = !matches!(device, crate::run::config::DeviceKind::Wgpu);
            }
            Err(e) => warmth.error = Some(e.to_string()),
        }
    }
    if warmth.dir.is_none() || warmth.error.is_some() {
        config.autotune.disable_cache = true;
        config.compilation.cache = false;
    }
    // Fails only where a CubeCL client already read its configuration: the binary calls this
    // before any device starts, so the settings above are the ones in force.
    let _ = CubeClRuntimeConfig::try_set(config);
    if warmth.dir.is_some() && warmth.error.is_none() {
        // Namespaces are `<store>/<cubecl version>/<what>`: autotune's results, the
        // compilers' stores (`cuda`, `hip`, ...), and CubeCL's own records and throughput
        // probes, which are neither. Entries of another CubeCL version are never read.
        let current = cubecl_environment::persistence::Namespace::scoped("autotune", "");
        let version = current
            .as_str()
            .split('/')
            .nth(1)
            .unwrap_or_default()
            .to_string();
        for ns in cubecl::environment::namespaces() {
            let mut parts = ns.namespace.split('/');
            let (store, v) = (parts.next(), parts.next());
            if v != Some(version.as_str()) {
                continue;
            }
            match store {
                Some("autotune") => warmth.tuned += ns.entries,
                Some("records" | "throughput") => {}
                _ => warmth.compiled += ns.entries,
            }
        }
    }
    Ok(WARMTH.get_or_init(|| warmth))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_flag_wins_and_off_turns_it_off() {
        let env = || Some("/from/env".to_string());
        assert_eq!(
            KernelCache::resolve_from(None, env()).unwrap(),
            KernelCache::Dir(PathBuf::from("/from/env"))
        );
        assert_eq!(
            KernelCache::resolve_from(Some("/from/flag"), env()).unwrap(),
            KernelCache::Dir(PathBuf::from("/from/flag"))
        );
        assert_eq!(
            KernelCache::resolve_from(None, None).unwrap(),
            KernelCache::Dir(default_dir())
        );
        assert_eq!(
            KernelCache::resolve_from(Some("off"), env()).unwrap(),
            KernelCache::Off
        );
        assert_eq!(
            KernelCache::resolve(Some("/x/y")).unwrap(),
            KernelCache::Dir(PathBuf::from("/x/y"))
        );
        let file = tempfile::NamedTempFile::new().unwrap();
        let err = KernelCache::resolve(Some(file.path().to_str().unwrap()))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("--kernel-cache") && err.contains("not a folder"),
            "{err}"
        );
        let err = KernelCache::resolve_from(None, Some(file.path().to_str().unwrap().into()))
            .unwrap_err()
            .to_string();
        assert!(err.contains(ENV) && err.contains("not a folder"), "{err}");
    }

    #[test]
    fn ranks_get_the_choice_with_its_folder_made_absolute() {
        let here = std::env::current_dir().unwrap();
        let dir = KernelCache::Dir(PathBuf::from("cache"));
        assert_eq!(
            for_ranks_of(Some(&dir), None),
            Some(format!("{ENV}={}", here.join("cache").display()))
        );
        assert_eq!(
            for_ranks_of(Some(&KernelCache::Off), Some("/x".into())),
            Some(format!("{ENV}=off"))
        );
        assert_eq!(
            for_ranks_of(None, Some("/x".into())),
            Some(format!("{ENV}=/x"))
        );
        assert_eq!(for_ranks_of(None, Some(String::new())), None);
        assert_eq!(for_ranks_of(None, None), None);
    }

    #[test]
    fn lines_say_what_the_run_will_pay() {
        let cold = Warmth {
            dir: Some(PathBuf::from("/c")),
            ..Default::default()
        };
        assert!(cold.line().contains("is empty"), "{}", cold.line());
        let warm = Warmth {
            tuned: 3,
            compiled: 1,
            ..cold.clone()
        };
        assert_eq!(
            warm.line(),
            "kernel cache /c: 3 autotune results and 1 compiled kernel from earlier runs"
        );
        assert!(Warmth::default().line().starts_with("kernel cache off"));
    }
}
