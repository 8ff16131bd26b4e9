//! Where a rank's ranges of the parameters come from when a sharded model is built: the
//! caller's initialiser (a counter-based draw keyed by path, so any range can be drawn alone),
//! a checkpoint, or a pretrained directory. The partitioner asks a source only for the ranges
//! this rank owns, so no rank ever holds a parameter range it does not own. It deliberately
//! knows no file format: a checkpoint reader or a Hugging Face reader implements the trait.

use std::ops::Range;

use crate::error::ShardError;

/// The values of parameters by path and element range.
pub trait ParamSource {
    /// Elements `range` of parameter `name` (flattened row-major; `shape` is its whole shape),
    /// as f32. An error names the parameter and the range that could not be read.
    fn read(
        &mut self,
        name: &str,
        shape: &[usize],
        range: Range<usize>,
    ) -> Result<Vec<f32>, ShardError>;

    /// A fingerprint every rank's source must share (a seed, a file's checksum): ranks whose
    /// sources differ would build different models, so construction refuses them.
    fn fingerprint(&self) -> u64;
}

/// A source from a closure `(name, shape, range) -> values`, with the fingerprint given.
///
/// ```
/// use ember_sharding::{FnSource, ParamSource};
/// let mut zeros = FnSource::new(0, |_name: &str, _shape: &[usize], r: std::ops::Range<usize>| {
///     Ok(vec![0.0; r.len()])
/// });
/// assert_eq!(zeros.read("w", &[2, 2], 1..3).unwrap(), vec![0.0, 0.0]);
/// ```
pub struct FnSource<F> {
    fingerprint: u64,
    read: F,
}

impl<F> FnSource<F>
where
    F: FnMut(&str, &[usize], Range<usize>) -> Result<Vec<f32>, ShardError>,
{
    /// Wraps `read`; every rank must pass the same `fingerprint` (for example the seed).
    pub fn new(fingerprint: u64, read: F) -> Self {
        Self { fingerprint, read }
    }
}

impl<F> std::fmt::Debug for FnSource<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FnSource")
            .field("fingerprint", &self.fingerprint)
            .finish_non_exhaustive()
    }
}

impl<F> ParamSource for FnSource<F>
where
    F: FnMut(&str, &[usize], Range<usize>) -> Result<Vec<f32>, ShardError>,
{
    fn read(
        &mut self,
        name: &str,
        shape: &[usize],
        range: Range<usize>,
    ) -> Result<Vec<f32>, ShardError> {
        let n = range.len();
        let got = (self.read)(name, shape, range.clone())?;
        if got.len() != n {
            return Err(ShardError::Source(format!(
                "{name}: the source returned {} values for elements [{}, {})",
                got.len(),
                range.start,
                range.end
            )));
        }
        Ok(got)
    }

    fn fingerprint(&self) -> u64 {
        self.fingerprint
    }
}
