//! The flat collectives on one group, blocking forms: all-gather, reduce-scatter, all-reduce,
//! broadcast, all-to-all over f32 / bf16 / u8 / i8 host buffers. Each one charges the counters
//! and is watched by the timeout. Non-blocking forms live in `pending`; compositions over
//! several hops in `hier` (and `quantized`).
//!
//! The `_into` forms are thin wrappers over the MPI call on the caller's buffers (no copy, no
//! allocation), so they run at MPI's speed; the plain forms allocate the output and apply the
//! padding rule of `padding` to lengths that don't divide by the group size.

use std::ffi::c_void;

use mpi::ffi;

use crate::comm::Group;
use crate::counters::{Op, Role, formula};
use crate::element::Element;
use crate::error::CommError;
use crate::padding::{ShardLayout, pad_zeros};
use crate::topology::Scope;

/// How a reduction combines the ranks' buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Reduce {
    /// Element-wise sum.
    Sum,
    /// Element-wise sum divided by the group size (floating-point elements only).
    Mean,
}

/// MPI counts are `int`: refuse larger buffers with advice instead of truncating.
pub(crate) fn mpi_count(n: usize) -> Result<i32, CommError> {
    i32::try_from(n).map_err(|_| {
        CommError::Shape(format!(
            "{n} elements exceed MPI's int count limit of {}: split the buffer into chunks",
            i32::MAX
        ))
    })
}

fn bytes_of<T>(n: usize) -> u64 {
    (n * std::mem::size_of::<T>()) as u64
}

impl<'c> Group<'c> {
    /// The scope of this group in canonical form (`Topology::canonical`): the key its
    /// collectives are charged to.
    pub fn scope(&self) -> Scope {
        self.scope
    }

    /// Number of ranks in the group.
    pub fn size(&self) -> usize {
        self.size
    }

    /// This rank's index in the group (see `topology` for the order).
    pub fn index(&self) -> usize {
        self.index
    }

    /// Charges this rank for `op` on `bytes` per the formula in `counters`.
    pub(crate) fn charge(&self, op: Op, bytes: u64, role: Role) {
        self.comm
            .charge(self.scope, op, formula(op, bytes, self.size, role));
    }

    pub(crate) fn check_len(
        &self,
        what: &str,
        got: usize,
        want: usize,
        hint: &str,
    ) -> Result<(), CommError> {
        if got == want {
            Ok(())
        } else {
            Err(CommError::Shape(format!(
                "{what} on {} (group of {}): got {got} elements, need {want}; {hint}",
                self.comm.topology().scope_name(self.scope),
                self.size
            )))
        }
    }

    /// All-gather: `recv[i*s..(i+1)*s]` = rank `i`'s `send` (`s = send.len()`).
    pub fn all_gather_into<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<(), CommError> {
        let s = send.len();
        self.check_len(
            "all_gather",
            recv.len(),
            s * self.size,
            "recv must be group size x send",
        )?;
        let count = mpi_count(s)?;
        self.charge(Op::AllGather, bytes_of::<T>(recv.len()), Role::Member);
        let _armed = self.comm.arm(Op::AllGather, self.scope);
        // SAFETY: both buffers are valid for the counts given, of the datatype given; the
        // call completes before the borrows end.
        unsafe {
            ffi::MPI_Allgather(
                send.as_ptr() as *const c_void,
                count,
                T::mpi_datatype(),
                recv.as_mut_ptr() as *mut c_void,
                count,
                T::mpi_datatype(),
                self.raw,
            );
        }
        Ok(())
    }

    /// All-gather returning the padded buffer of `size * send.len()` elements.
    pub fn all_gather<T: Element>(&self, send: &[T]) -> Result<Vec<T>, CommError> {
        let mut recv = vec![T::default(); send.len() * self.size];
        self.all_gather_into(send, &mut recv)?;
        Ok(recv)
    }

    /// Reduce-scatter: `recv` = reduction over ranks of their `send[i*s..(i+1)*s]`, for this
    /// rank's index `i` and `s = recv.len()`; `send.len()` must be `size * s`.
    pub fn reduce_scatter_into<T: Element>(
        &self,
        send: &[T],
        recv: &mut [T],
        reduce: Reduce,
    ) -> Result<(), CommError> {
        let s = recv.len();
        self.check_len(
            "reduce_scatter",
            send.len(),
            s * self.size,
            "send must be group size x recv (use `reduce_scatter` to pad)",
        )?;
        let count = mpi_count(s)?;
        if reduce == Reduce::Mean {
            // Refuse before moving anything, so an error leaves the ranks in step.
            T::divide(&mut [], 1)?;
        }
        self.charge(Op::ReduceScatter, bytes_of::<T>(send.len()), Role::Member);
        let _armed = self.comm.arm(Op::ReduceScatter, self.scope);
        // SAFETY: as in `all_gather_into`.
        unsafe {
            ffi::MPI_Reduce_scatter_block(
                send.as_ptr() as *const c_void,
                recv.as_mut_ptr() as *mut c_void,
                count,
                T::mpi_datatype(),
                self.comm.sum_op::<T>(),
                self.raw,
            );
        }
        if reduce == Reduce::Mean {
            T::divide(recv, self.size)?;
        }
        Ok(())
    }

    /// Reduce-scatter of any length: pads with zeros per the rule in `padding` and returns
    /// this rank's shard of `ShardLayout::new(send.len(), size, 1).shard` elements.
    pub fn reduce_scatter<T: Element>(
        &self,
        send: &[T],
        reduce: Reduce,
    ) -> Result<Vec<T>, CommError> {
        let layout = ShardLayout::new(send.len(), self.size, 1);
        let mut recv = vec![T::default(); layout.shard];
        if layout.padded() == send.len() {
            self.reduce_scatter_into(send, &mut recv, reduce)?;
        } else {
            self.reduce_scatter_into(&pad_zeros(send, layout.padded()), &mut recv, reduce)?;
        }
        Ok(recv)
    }

    /// All-reduce: `recv` = reduction over ranks of their `send` (same length).
    pub fn all_reduce_into<T: Element>(
        &self,
        send: &[T],
        recv: &mut [T],
        reduce: Reduce,
    ) -> Result<(), CommError> {
        self.check_len("all_reduce", recv.len(), send.len(), "recv must match send")?;
        let count = mpi_count(send.len())?;
        if reduce == Reduce::Mean {
            T::divide(&mut [], 1)?;
        }
        self.charge(Op::AllReduce, bytes_of::<T>(send.len()), Role::Member);
        let _armed = self.comm.arm(Op::AllReduce, self.scope);
        // SAFETY: as in `all_gather_into`.
        unsafe {
            ffi::MPI_Allreduce(
                send.as_ptr() as *const c_void,
                recv.as_mut_ptr() as *mut c_void,
                count,
                T::mpi_datatype(),
                self.comm.sum_op::<T>(),
                self.raw,
            );
        }
        if reduce == Reduce::Mean {
            T::divide(recv, self.size)?;
        }
        Ok(())
    }

    /// All-reduce returning a new buffer.
    pub fn all_reduce<T: Element>(&self, send: &[T], reduce: Reduce) -> Result<Vec<T>, CommError> {
        let mut recv = vec![T::default(); send.len()];
        self.all_reduce_into(send, &mut recv, reduce)?;
        Ok(recv)
    }

    /// Broadcast: every rank's `buf` becomes the buffer of group index `root` (same length on
    /// every rank).
    pub fn broadcast<T: Element>(&self, buf: &mut [T], root: usize) -> Result<(), CommError> {
        self.check_root(root)?;
        let count = mpi_count(buf.len())?;
        let role = if self.index == root {
            Role::Root
        } else {
            Role::Member
        };
        self.charge(Op::Broadcast, bytes_of::<T>(buf.len()), role);
        let _armed = self.comm.arm(Op::Broadcast, self.scope);
        // SAFETY: as in `all_gather_into`.
        unsafe {
            ffi::MPI_Bcast(
                buf.as_mut_ptr() as *mut c_void,
                count,
                T::mpi_datatype(),
                root as i32,
                self.raw,
            );
        }
        Ok(())
    }

    pub(crate) fn check_root(&self, root: usize) -> Result<(), CommError> {
        if root < self.size {
            Ok(())
        } else {
            Err(CommError::Shape(format!(
                "broadcast root {root} is outside the group of {}: use an index below it",
                self.size
            )))
        }
    }

    /// All-to-all: block `j` of `send` (`c = send.len() / size` elements) goes to group index
    /// `j`, which stores it as its block `i` (this rank's index).
    pub fn all_to_all_into<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<(), CommError> {
        self.check_len("all_to_all", recv.len(), send.len(), "recv must match send")?;
        if !send.len().is_multiple_of(self.size) {
            return Err(CommError::Shape(format!(
                "all_to_all of {} elements over {} ranks: pad to a multiple of the group size \
                 (use `all_to_all`, which applies the padding rule)",
                send.len(),
                self.size
            )));
        }
        let count = mpi_count(send.len() / self.size)?;
        self.charge(Op::AllToAll, bytes_of::<T>(send.len()), Role::Member);
        let _armed = self.comm.arm(Op::AllToAll, self.scope);
        // SAFETY: as in `all_gather_into`.
        unsafe {
            ffi::MPI_Alltoall(
                send.as_ptr() as *const c_void,
                count,
                T::mpi_datatype(),
                recv.as_mut_ptr() as *mut c_void,
                count,
                T::mpi_datatype(),
                self.raw,
            );
        }
        Ok(())
    }

    /// All-to-all of any length: pads with zeros per the rule in `padding`; blocks are the
    /// padded shards.
    pub fn all_to_all<T: Element>(&self, send: &[T]) -> Result<Vec<T>, CommError> {
        let padded = ShardLayout::new(send.len(), self.size, 1).padded();
        let send = pad_zeros(send, padded);
        let mut recv = vec![T::default(); padded];
        self.all_to_all_into(&send, &mut recv)?;
        Ok(recv)
    }
}
