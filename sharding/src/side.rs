//! Side tensors: what a unit hands on beside its activation, by name, for any later unit of the
//! same micro-batch to read (an encoder's output, read by every decoder block's
//! cross-attention). A unit reads them as they are and its gradient flows back to the unit that
//! put them: the engine keeps each side tensor from its producer's forward visit to its
//! producer's backward visit, gives it to every later unit (as an autodiff leaf when that unit
//! recomputes), adds up the gradients the readers give it, and backpropagates the sum through
//! the producer.

use std::fmt;

use burn::tensor::Tensor;

/// One side tensor: flat, with its shape (any rank).
#[derive(Debug, Clone)]
pub(crate) struct Entry {
    /// Its name.
    pub name: String,
    /// Its values, flat.
    pub value: Tensor<1>,
    /// Its shape.
    pub shape: Vec<usize>,
}

impl Entry {
    /// The same entry with its value mapped.
    pub(crate) fn map(self, f: impl FnOnce(Tensor<1>) -> Tensor<1>) -> Self {
        Self {
            value: f(self.value),
            ..self
        }
    }
}

/// The side tensors a piece of a unit's forward can read (those earlier units put) and put
/// (for later units), by name. Every piece of a model's forward gets one; a model that hands
/// nothing on beside its activation never touches it.
///
/// ```
/// # use burn::tensor::{Device, Tensor};
/// # use ember_sharding::Side;
/// let mut side = Side::default();
/// let memory = Tensor::<3>::ones([2, 5, 8], &Device::flex());
/// side.put("memory", memory); // an encoder's output, put where the decoder starts
/// let read: Tensor<3> = side.get("memory"); // in every decoder block
/// assert_eq!(read.dims(), [2, 5, 8]);
/// ```
#[derive(Default)]
pub struct Side {
    entries: Vec<Entry>,
    /// Entries before this index were given to the unit; the rest it put.
    given: usize,
    /// The unit running, for messages.
    unit: String,
    /// What the unit did that a unit may not (put a name twice).
    misuse: Vec<String>,
}

impl fmt::Debug for Side {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map()
            .entries(self.entries.iter().map(|e| (&e.name, &e.shape)))
            .finish()
    }
}

impl Side {
    /// The side tensors `entries` given to unit `unit`.
    pub(crate) fn given(unit: &str, entries: Vec<Entry>) -> Self {
        Self {
            given: entries.len(),
            entries,
            unit: unit.to_string(),
            misuse: Vec::new(),
        }
    }

    /// Puts `tensor` under `name`, for the pieces and units after this one. A name is put once
    /// per micro-batch: putting it again is an error of the step
    /// ([`ShardError::Model`](crate::ShardError::Model)), and the first value stays.
    pub fn put<const R: usize>(&mut self, name: impl Into<String>, tensor: Tensor<R>) {
        let name = name.into();
        if self.entries.iter().any(|e| e.name == name) {
            self.misuse.push(format!(
                "unit `{}` put side tensor `{name}`, which is there already: a side tensor is \
                 put once per micro-batch; give the new one another name",
                self.unit
            ));
            return;
        }
        let shape = tensor.dims().to_vec();
        let numel: usize = shape.iter().product();
        self.entries.push(Entry {
            name,
            value: tensor.reshape([numel]),
            shape,
        });
    }

    /// The side tensor `name`, as it was put (same shape, so `R` is the rank it was put with).
    ///
    /// # Panics
    ///
    /// When no earlier piece put `name`, or put it with another rank: a model that reads what
    /// it never wrote. The message names the unit, the tensor and the names there are. Use
    /// [`try_get`](Self::try_get) to ask whether it is there.
    pub fn get<const R: usize>(&self, name: &str) -> Tensor<R> {
        self.try_get(name).unwrap_or_else(|| {
            let names: Vec<&str> = self.entries.iter().map(|e| e.name.as_str()).collect();
            panic!(
                "unit `{}` read side tensor `{name}`, which no earlier piece of this \
                 micro-batch put (there are: {}): put it with Side::put in an earlier piece",
                self.unit,
                if names.is_empty() {
                    "none".to_string()
                } else {
                    names.join(", ")
                }
            )
        })
    }

    /// The side tensor `name`, or `None` when no earlier piece put it.
    ///
    /// # Panics
    ///
    /// When it was put with a rank other than `R`.
    pub fn try_get<const R: usize>(&self, name: &str) -> Option<Tensor<R>> {
        let entry = self.entries.iter().find(|e| e.name == name)?;
        let shape: [usize; R] = entry.shape.as_slice().try_into().unwrap_or_else(|_| {
            panic!(
                "unit `{}` read side tensor `{name}` as rank {R}; it was put with shape {:?}",
                self.unit, entry.shape
            )
        });
        Some(entry.value.clone().reshape(shape))
    }

    /// Whether a side tensor `name` is there.
    pub fn contains(&self, name: &str) -> bool {
        self.entries.iter().any(|e| e.name == name)
    }

    /// The names there are, in the order they were put.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.entries.iter().map(|e| e.name.as_str())
    }

    /// The same side tensors, now read and put by unit `unit` (a forward that runs every unit
    /// through one `Side`).
    pub(crate) fn enter(&mut self, unit: &str) {
        self.unit = unit.to_string();
    }

    /// What the unit did wrong so far, taken.
    pub(crate) fn take_misuse(&mut self) -> Vec<String> {
        std::mem::take(&mut self.misuse)
    }

    /// The entries the unit was given, and those it put.
    pub(crate) fn into_parts(mut self) -> (Vec<Entry>, Vec<Entry>) {
        let put = self.entries.split_off(self.given);
        (self.entries, put)
    }
}
