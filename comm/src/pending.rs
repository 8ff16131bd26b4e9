//! Non-blocking collectives: `start_*` hands MPI owned buffers and returns a [`Pending`]
//! handle, so compute can run while data moves; `wait` returns the result. It deliberately
//! owns its buffers (moved in) instead of borrowing: a handle can then outlive the caller's
//! stack frame, and nobody can touch memory MPI is still writing.

use std::ffi::c_void;

use mpi::ffi;

use crate::collective::{Reduce, mpi_count};
use crate::comm::Group;
use crate::counters::{Op, Role};
use crate::element::Element;
use crate::error::CommError;
use crate::padding::{ShardLayout, pad_zeros};

/// What `wait` does to the received buffer after MPI completes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Finish {
    /// Return it as is.
    AsIs,
    /// Divide by the group size (`Reduce::Mean`).
    Mean,
}

/// A collective in flight. `wait` it to get the output; dropping it without waiting blocks
/// until MPI is done with the buffers (they cannot be freed earlier).
pub struct Pending<'c, T: Element> {
    group: Group<'c>,
    op: Op,
    request: ffi::MPI_Request,
    // Kept alive (and unmoved on the heap) until the request completes.
    _send: Vec<T>,
    recv: Vec<T>,
    finish: Finish,
    done: bool,
}

impl<T: Element> std::fmt::Debug for Pending<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pending")
            .field("op", &self.op)
            .field("group", &self.group)
            .field("done", &self.done)
            .finish_non_exhaustive()
    }
}

impl<'c, T: Element> Pending<'c, T> {
    /// True once the collective has completed (then `wait` returns at once).
    pub fn is_complete(&mut self) -> bool {
        if !self.done {
            let mut flag = 0;
            // SAFETY: `request` is a live request created by this handle.
            unsafe {
                ffi::MPI_Test(&mut self.request, &mut flag, ffi::RSMPI_STATUS_IGNORE);
            }
            self.done = flag != 0;
        }
        self.done
    }

    /// Blocks until the collective completes (watched by the timeout) and returns its output.
    pub fn wait(mut self) -> Result<Vec<T>, CommError> {
        self.block();
        let mut out = std::mem::take(&mut self.recv);
        if self.finish == Finish::Mean {
            T::divide(&mut out, self.group.size)?;
        }
        Ok(out)
    }

    fn block(&mut self) {
        if !self.done {
            let _armed = self.group.comm.arm(self.op, self.group.scope);
            // SAFETY: as in `is_complete`.
            unsafe {
                ffi::MPI_Wait(&mut self.request, ffi::RSMPI_STATUS_IGNORE);
            }
            self.done = true;
        }
    }
}

impl<T: Element> Drop for Pending<'_, T> {
    fn drop(&mut self) {
        self.block();
    }
}

impl<'c> Group<'c> {
    fn pending<T: Element>(
        &self,
        op: Op,
        send: Vec<T>,
        recv: Vec<T>,
        finish: Finish,
        start: impl FnOnce(*const c_void, *mut c_void, *mut ffi::MPI_Request),
    ) -> Pending<'c, T> {
        let mut p = Pending {
            group: *self,
            op,
            // SAFETY: reading a constant mpi-sys initialises at link time.
            request: unsafe { ffi::RSMPI_REQUEST_NULL },
            _send: send,
            recv,
            finish,
            done: false,
        };
        let send_ptr = p._send.as_ptr() as *const c_void;
        let recv_ptr = p.recv.as_mut_ptr() as *mut c_void;
        start(send_ptr, recv_ptr, &mut p.request);
        p
    }

    /// Starts an all-gather of `send` (see `all_gather_into`).
    pub fn start_all_gather<T: Element>(&self, send: Vec<T>) -> Result<Pending<'c, T>, CommError> {
        let count = mpi_count(send.len())?;
        let recv = vec![T::default(); send.len() * self.size];
        self.charge(
            Op::AllGather,
            (recv.len() * size_of::<T>()) as u64,
            Role::Member,
        );
        let raw = self.raw;
        Ok(
            self.pending(Op::AllGather, send, recv, Finish::AsIs, |s, r, req| {
                // SAFETY: `s` and `r` point into heap buffers the handle owns until completion.
                unsafe {
                    ffi::MPI_Iallgather(
                        s,
                        count,
                        T::mpi_datatype(),
                        r,
                        count,
                        T::mpi_datatype(),
                        raw,
                        req,
                    );
                }
            }),
        )
    }

    /// Starts a reduce-scatter of any length (padded per `padding`; see `reduce_scatter`).
    pub fn start_reduce_scatter<T: Element>(
        &self,
        send: Vec<T>,
        reduce: Reduce,
    ) -> Result<Pending<'c, T>, CommError> {
        let layout = ShardLayout::new(send.len(), self.size, 1);
        let send = if layout.padded() == send.len() {
            send
        } else {
            pad_zeros(&send, layout.padded())
        };
        let count = mpi_count(layout.shard)?;
        let finish = self.finish_for::<T>(reduce)?;
        self.charge(
            Op::ReduceScatter,
            (send.len() * size_of::<T>()) as u64,
            Role::Member,
        );
        let recv = vec![T::default(); layout.shard];
        let (raw, sum) = (self.raw, self.comm.sum_op::<T>());
        Ok(
            self.pending(Op::ReduceScatter, send, recv, finish, |s, r, req| {
                // SAFETY: as in `start_all_gather`.
                unsafe {
                    ffi::MPI_Ireduce_scatter_block(s, r, count, T::mpi_datatype(), sum, raw, req);
                }
            }),
        )
    }

    /// Starts an all-reduce of `send`.
    pub fn start_all_reduce<T: Element>(
        &self,
        send: Vec<T>,
        reduce: Reduce,
    ) -> Result<Pending<'c, T>, CommError> {
        let count = mpi_count(send.len())?;
        let finish = self.finish_for::<T>(reduce)?;
        self.charge(
            Op::AllReduce,
            (send.len() * size_of::<T>()) as u64,
            Role::Member,
        );
        let recv = vec![T::default(); send.len()];
        let (raw, sum) = (self.raw, self.comm.sum_op::<T>());
        Ok(
            self.pending(Op::AllReduce, send, recv, finish, |s, r, req| {
                // SAFETY: as in `start_all_gather`.
                unsafe {
                    ffi::MPI_Iallreduce(s, r, count, T::mpi_datatype(), sum, raw, req);
                }
            }),
        )
    }

    /// Starts a broadcast from group index `root`; `buf` is the data at the root and only
    /// gives the length elsewhere.
    pub fn start_broadcast<T: Element>(
        &self,
        buf: Vec<T>,
        root: usize,
    ) -> Result<Pending<'c, T>, CommError> {
        self.check_root(root)?;
        let count = mpi_count(buf.len())?;
        let role = if self.index == root {
            Role::Root
        } else {
            Role::Member
        };
        self.charge(Op::Broadcast, (buf.len() * size_of::<T>()) as u64, role);
        let raw = self.raw;
        Ok(
            self.pending(Op::Broadcast, Vec::new(), buf, Finish::AsIs, |_, r, req| {
                // SAFETY: as in `start_all_gather`.
                unsafe {
                    ffi::MPI_Ibcast(r, count, T::mpi_datatype(), root as i32, raw, req);
                }
            }),
        )
    }

    /// Starts an all-to-all of any length (padded per `padding`; see `all_to_all`).
    pub fn start_all_to_all<T: Element>(&self, send: Vec<T>) -> Result<Pending<'c, T>, CommError> {
        let padded = ShardLayout::new(send.len(), self.size, 1).padded();
        let send = if padded == send.len() {
            send
        } else {
            pad_zeros(&send, padded)
        };
        let count = mpi_count(padded / self.size)?;
        self.charge(
            Op::AllToAll,
            (send.len() * size_of::<T>()) as u64,
            Role::Member,
        );
        let recv = vec![T::default(); padded];
        let raw = self.raw;
        Ok(
            self.pending(Op::AllToAll, send, recv, Finish::AsIs, |s, r, req| {
                // SAFETY: as in `start_all_gather`.
                unsafe {
                    ffi::MPI_Ialltoall(
                        s,
                        count,
                        T::mpi_datatype(),
                        r,
                        count,
                        T::mpi_datatype(),
                        raw,
                        req,
                    );
                }
            }),
        )
    }

    fn finish_for<T: Element>(&self, reduce: Reduce) -> Result<Finish, CommError> {
        Ok(match reduce {
            Reduce::Sum => Finish::AsIs,
            Reduce::Mean => {
                // Refuse integer means before anything moves.
                T::divide(&mut [], 1)?;
                Finish::Mean
            }
        })
    }
}
