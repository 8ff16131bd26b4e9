//! The flat collectives on one group, blocking forms: all-gather, reduce-scatter, all-reduce,
//! broadcast, all-to-all over f32 / bf16 / u8 / i8 host buffers. Each one charges the counters
//! with the bytes it hands to MPI and is watched by the timeout. Compositions over several hops
//! live in `hier` (and qgZ's exchange in `quantized`).
//!
//! # Algorithms
//!
//! The bandwidth-bound collectives are ours, built on MPI point-to-point, so that which bytes
//! cross which link is a documented property of ember rather than of the MPI build (its tuned
//! and non-blocking components pick per size and group, some sending every block to every
//! rank). For a group of `g` ranks in group-index order (innermost level varying fastest, so
//! ring neighbours share the fastest link wherever they can):
//!
//! | op | algorithm | elements over each edge used |
//! |---|---|---|
//! | all-gather of blocks of `s` | ring, `g - 1` steps | `(g - 1) s` on each edge `i -> i + 1` |
//! | reduce-scatter into blocks of `s` | ring, `g - 1` steps | `(g - 1) s` on each edge `i -> i + 1` |
//! | all-to-all of blocks of `c` | pairwise (`i -> i + k` for every `k`), posted at once | `c` on each ordered pair |
//! | all-reduce, >= 64 KiB | ring reduce-scatter + ring all-gather | `2 (g - 1) / g` of the buffer |
//! | all-reduce < 64 KiB | recursive doubling (ring all-gather off powers of two) | latency-bound |
//! | broadcast | MPI's blocking call (never inside a training step) | - |
//!
//! Every wait polls MPI without holding a core (see `complete`): it yields the core between
//! polls for the first 2 ms, then sleeps between them; on a machine whose cores the ranks
//! share, a busy-polling wait takes the compute's time.
//!
//! The `_into` forms work on the caller's buffers; the plain forms allocate the output and
//! apply the padding rule of `padding` to lengths that don't divide by the group size.

use std::ffi::c_void;
use std::time::{Duration, Instant};

use mpi::ffi;

use crate::comm::Group;
use crate::counters::{Op, Role, Traffic, formula};
use crate::element::Element;
use crate::error::CommError;
use crate::fault::Armed;
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
    /// A group of one moves nothing and is charged nothing.
    pub(crate) fn charge(&self, op: Op, bytes: u64, role: Role) {
        if self.size > 1 {
            self.comm
                .charge(self.scope, op, formula(op, bytes, self.size, role));
        }
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
    ///
    /// A ring in group-index order: in step `k` every member sends the block it received in
    /// step `k - 1` (its own at first) to the next index and receives one from the previous,
    /// so every edge of the ring carries `(g - 1) s` elements (see the module doc).
    pub fn all_gather_into<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<(), CommError> {
        let s = send.len();
        self.check_len(
            "all_gather",
            recv.len(),
            s * self.size,
            "recv must be group size x send",
        )?;
        mpi_count(s)?;
        self.ring_all_gather(Op::AllGather, send, recv)
    }

    /// The ring of [`Group::all_gather_into`] (lengths checked), charged and watched as `op`.
    fn ring_all_gather<T: Element>(
        &self,
        op: Op,
        send: &[T],
        recv: &mut [T],
    ) -> Result<(), CommError> {
        let s = send.len();
        let i = self.index;
        recv[i * s..(i + 1) * s].copy_from_slice(send);
        self.ring_all_gather_in_place(op, recv, s)
    }

    /// The ring of [`Group::ring_all_gather`] on `recv` that already holds this rank's block
    /// of `s` elements in its place.
    fn ring_all_gather_in_place<T: Element>(
        &self,
        op: Op,
        recv: &mut [T],
        s: usize,
    ) -> Result<(), CommError> {
        let (g, i) = (self.size, self.index);
        if g == 1 || s == 0 {
            return Ok(());
        }
        let armed = self.comm.arm(op, self.scope);
        let (right, left) = ((i + 1) % g, (i + g - 1) % g);
        for k in 0..g - 1 {
            let out = (i + g - k) % g;
            let into = (i + 2 * g - k - 1) % g;
            let (send_block, recv_block) = two_blocks(recv, s, out, into);
            self.send_recv(&armed, op, send_block, right, recv_block, left)?;
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
    ///
    /// A ring in group-index order: block `c` starts at index `c + 1`, travels the ring
    /// collecting every member's block `c`, and ends summed at index `c`; every edge carries
    /// `(g - 1) s` elements. The sum order is fixed by the group (`x[c+1] + x[c+2] + ... +
    /// x[c]`), so a run is reproducible bit for bit at the same layout.
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
        mpi_count(s)?;
        if reduce == Reduce::Mean {
            // Refuse before moving anything, so an error leaves the ranks in step.
            T::divide(&mut [], 1)?;
        }
        self.ring_reduce_scatter(Op::ReduceScatter, send, recv)?;
        if reduce == Reduce::Mean {
            T::divide(recv, self.size)?;
        }
        Ok(())
    }

    /// The ring of [`Group::reduce_scatter_into`] (lengths checked, a sum), charged and
    /// watched as `op`.
    fn ring_reduce_scatter<T: Element>(
        &self,
        op: Op,
        send: &[T],
        recv: &mut [T],
    ) -> Result<(), CommError> {
        let s = recv.len();
        let (g, i) = (self.size, self.index);
        let block = |c: usize| &send[c * s..(c + 1) * s];
        if g == 1 || s == 0 {
            recv.copy_from_slice(block(i));
            return Ok(());
        }
        let armed = self.comm.arm(op, self.scope);
        let (right, left) = ((i + 1) % g, (i + g - 1) % g);
        // Step k receives block (i - k - 2)'s sum over the k + 1 members before this one and
        // adds this rank's own block to it (received + own, the order every rank uses). The
        // first step sends straight from `send`, the last receives straight into `recv`: with
        // two members nothing else is touched, and more need two buffers of one block.
        let mut spare: [Vec<T>; 2] = Default::default();
        if g > 2 {
            spare = [vec![T::default(); s], vec![T::default(); s]];
        }
        let [mut partial, mut incoming] = spare;
        for k in 0..g - 1 {
            let c = (i + 2 * g - k - 2) % g;
            let outgoing: &[T] = if k == 0 {
                block((i + g - 1) % g)
            } else {
                &partial
            };
            if k == g - 2 {
                self.send_recv(&armed, op, outgoing, right, recv, left)?;
                T::add_into(recv, block(c));
            } else {
                self.send_recv(&armed, op, outgoing, right, &mut incoming, left)?;
                T::add_into(&mut incoming, block(c));
                std::mem::swap(&mut partial, &mut incoming);
            }
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
    ///
    /// Buffers of at least [`RING_ALL_REDUCE_BYTES`] run as a ring reduce-scatter then a ring
    /// all-gather (`2 (g - 1) / g` of the buffer over every edge); smaller ones, where
    /// latency dominates, by recursive doubling.
    pub fn all_reduce_into<T: Element>(
        &self,
        send: &[T],
        recv: &mut [T],
        reduce: Reduce,
    ) -> Result<(), CommError> {
        self.check_len("all_reduce", recv.len(), send.len(), "recv must match send")?;
        mpi_count(send.len())?;
        if reduce == Reduce::Mean {
            T::divide(&mut [], 1)?;
        }
        let g = self.size;
        if g == 1 {
            recv.copy_from_slice(send);
        } else if bytes_of::<T>(send.len()) >= RING_ALL_REDUCE_BYTES {
            let layout = ShardLayout::new(send.len(), g, 1);
            if layout.padded() == send.len() {
                // This rank's block of the sum lands in its place in `recv`, and the gather
                // fills in the others around it: no buffer besides `recv`.
                let s = layout.shard;
                let i = self.index;
                self.ring_reduce_scatter(Op::AllReduce, send, &mut recv[i * s..(i + 1) * s])?;
                self.ring_all_gather_in_place(Op::AllReduce, recv, s)?;
            } else {
                let mut shard = vec![T::default(); layout.shard];
                let padded = pad_zeros(send, layout.padded());
                self.ring_reduce_scatter(Op::AllReduce, &padded, &mut shard)?;
                drop(padded);
                let mut out = vec![T::default(); layout.padded()];
                self.ring_all_gather(Op::AllReduce, &shard, &mut out)?;
                recv.copy_from_slice(&out[..send.len()]);
            }
        } else {
            // Latency-bound: charged by the formula, as the plan counts it.
            self.charge(Op::AllReduce, bytes_of::<T>(send.len()), Role::Member);
            self.small_all_reduce(send, recv)?;
        }
        if reduce == Reduce::Mean {
            T::divide(recv, self.size)?;
        }
        Ok(())
    }

    /// A sum of small buffers in as few steps as the group allows: recursive doubling
    /// (partners at distance 1, 2, 4, ... exchange their partial sums, `log2 g` steps) when the
    /// group size is a power of two, else a ring all-gather of every buffer and a sum in index
    /// order. Each pair adds the lower index's partial sum first, so every member ends with the
    /// same bits. Charges nothing itself.
    fn small_all_reduce<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<(), CommError> {
        let (g, i, n) = (self.size, self.index, send.len());
        let armed = self.comm.arm(Op::AllReduce, self.scope);
        if g.is_power_of_two() {
            recv.copy_from_slice(send);
            let mut mine = vec![T::default(); n];
            let mut theirs = vec![T::default(); n];
            let mut d = 1;
            while d < g {
                let partner = i ^ d;
                mine.copy_from_slice(recv);
                self.exchange(&armed, &mine, partner, &mut theirs, partner)?;
                let (first, second) = if i < partner {
                    (&mine, &theirs)
                } else {
                    (&theirs, &mine)
                };
                recv.copy_from_slice(first);
                T::add_into(recv, second);
                d *= 2;
            }
        } else {
            let mut all = vec![T::default(); n * g];
            all[i * n..(i + 1) * n].copy_from_slice(send);
            let (right, left) = ((i + 1) % g, (i + g - 1) % g);
            for k in 0..g - 1 {
                let out = (i + g - k) % g;
                let into = (i + 2 * g - k - 1) % g;
                let (send_block, recv_block) = two_blocks(&mut all, n, out, into);
                self.exchange(&armed, send_block, right, recv_block, left)?;
            }
            recv.copy_from_slice(&all[..n]);
            for c in 1..g {
                T::add_into(recv, &all[c * n..(c + 1) * n]);
            }
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
        // MPI's blocking call, whose waits are MPI's own: a broadcast happens outside the
        // training step (set-up, a checkpoint's start), where no compute wants the core, and
        // the watchdog thread still ends a wait past the timeout.
        // SAFETY: `buf` is valid for `count` elements of the datatype given.
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
    ///
    /// Pairwise exchange: in step `k` (1 to `g - 1`) every member sends to index `i + k` and
    /// receives from `i - k`, so each ordered pair carries exactly one block.
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
        let c = send.len() / self.size;
        mpi_count(c)?;
        let (g, i) = (self.size, self.index);
        recv[i * c..(i + 1) * c].copy_from_slice(&send[i * c..(i + 1) * c]);
        if g == 1 || c == 0 {
            return Ok(());
        }
        let armed = self.comm.arm(Op::AllToAll, self.scope);
        let bytes = bytes_of::<T>(c);
        let topology = self.comm.topology();
        let world = |index| topology.member(self.scope, self.comm.rank(), index);
        let peers: Vec<usize> = (0..g).filter(|&k| k != i).map(world).collect();
        armed.waiting_on(&peers);
        self.comm.charge(
            self.scope,
            Op::AllToAll,
            Traffic {
                sent: bytes * (g as u64 - 1),
                received: bytes * (g as u64 - 1),
            },
        );
        let gpu = |r: usize| r / topology.stride(1.min(topology.depth()));
        let mine = gpu(self.comm.rank());
        let off_gpu: u64 = peers.iter().filter(|&&r| gpu(r) != mine).count() as u64 * 2 * bytes;
        let start = Instant::now();
        // Every pair's exchange is posted at once, in the pairwise order (step k: to i + k,
        // from i - k), and completed together: each ordered pair still carries one block.
        let mut requests = vec![null_request(); 2 * (g - 1)];
        let count = c as i32;
        for k in 1..g {
            let (to, from) = ((i + k) % g, (i + g - k) % g);
            // SAFETY: the blocks `from` of `recv` (distinct for distinct k, none of them block
            // `i`) and `to` of `send` are valid for `c` elements of the datatype given, and
            // both buffers outlive the requests, which complete before this function returns.
            unsafe {
                ffi::MPI_Irecv(
                    recv.as_mut_ptr().add(from * c) as *mut c_void,
                    count,
                    T::mpi_datatype(),
                    from as i32,
                    STEP_TAG,
                    self.raw,
                    &mut requests[2 * (k - 1)],
                );
                ffi::MPI_Isend(
                    send.as_ptr().add(to * c) as *const c_void,
                    count,
                    T::mpi_datatype(),
                    to as i32,
                    STEP_TAG,
                    self.raw,
                    &mut requests[2 * (k - 1) + 1],
                );
            }
        }
        complete(&mut requests);
        if off_gpu > 0 {
            self.comm
                .record_off_gpu(off_gpu, start.elapsed().as_nanos() as u64);
        }
        Ok(())
    }

    /// One step of a collective: sends `send` to group index `to` and receives `recv` from
    /// `from` at once, charging `op` the bytes handed to MPI; `armed` names the two for the
    /// timeout.
    fn send_recv<T: Element>(
        &self,
        armed: &Armed<'_>,
        op: Op,
        send: &[T],
        to: usize,
        recv: &mut [T],
        from: usize,
    ) -> Result<(), CommError> {
        self.comm.charge(
            self.scope,
            op,
            Traffic {
                sent: bytes_of::<T>(send.len()),
                received: bytes_of::<T>(recv.len()),
            },
        );
        self.exchange(armed, send, to, recv, from)
    }

    /// Sends `send` to group index `to` and receives `recv` from `from` at once, charging
    /// nothing; `armed` names the two for the timeout.
    fn exchange<T: Element>(
        &self,
        armed: &Armed<'_>,
        send: &[T],
        to: usize,
        recv: &mut [T],
        from: usize,
    ) -> Result<(), CommError> {
        let (n_send, n_recv) = (mpi_count(send.len())?, mpi_count(recv.len())?);
        let topology = self.comm.topology();
        let world = |index| topology.member(self.scope, self.comm.rank(), index);
        let (to_rank, from_rank) = (world(to), world(from));
        if to == from {
            armed.waiting_on(&[to_rank]);
        } else {
            armed.waiting_on(&[to_rank, from_rank]);
        }
        // Bytes this exchange moves over links that leave this rank's GPU.
        let gpu = |r: usize| r / topology.stride(1.min(topology.depth()));
        let mine = gpu(self.comm.rank());
        let off_gpu = if gpu(to_rank) != mine {
            bytes_of::<T>(send.len())
        } else {
            0
        } + if gpu(from_rank) != mine {
            bytes_of::<T>(recv.len())
        } else {
            0
        };
        let start = Instant::now();
        let mut requests = [null_request(); 2];
        // SAFETY: both buffers are valid for their counts of the datatype given, do not
        // overlap, and outlive the requests, which complete before this function returns.
        unsafe {
            ffi::MPI_Irecv(
                recv.as_mut_ptr() as *mut c_void,
                n_recv,
                T::mpi_datatype(),
                from as i32,
                STEP_TAG,
                self.raw,
                &mut requests[0],
            );
            ffi::MPI_Isend(
                send.as_ptr() as *const c_void,
                n_send,
                T::mpi_datatype(),
                to as i32,
                STEP_TAG,
                self.raw,
                &mut requests[1],
            );
        }
        complete(&mut requests);
        if off_gpu > 0 {
            self.comm
                .record_off_gpu(off_gpu, start.elapsed().as_nanos() as u64);
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

/// The tag of every point-to-point step of our collectives. Steps on one communicator never
/// interleave (one thread issues a group's collectives, in the same order on every rank) and
/// MPI keeps messages between two ranks in order, so one tag matches them all.
const STEP_TAG: i32 = 0x656d;

/// All-reduces of at least this many bytes run as a ring; smaller ones by recursive doubling.
pub const RING_ALL_REDUCE_BYTES: u64 = 64 * 1024;

/// `MPI_REQUEST_NULL`, for a request slot MPI fills in.
fn null_request() -> ffi::MPI_Request {
    // SAFETY: reading a constant that mpi-sys initialises at link time.
    unsafe { ffi::RSMPI_REQUEST_NULL }
}

/// Blocks `a` and `b` (distinct) of `s` elements of `buf`: `a` to read, `b` to write.
fn two_blocks<T>(buf: &mut [T], s: usize, a: usize, b: usize) -> (&[T], &mut [T]) {
    debug_assert_ne!(a, b);
    if a < b {
        let (lo, hi) = buf.split_at_mut(b * s);
        (&lo[a * s..(a + 1) * s], &mut hi[..s])
    } else {
        let (lo, hi) = buf.split_at_mut(a * s);
        (&hi[..s], &mut lo[b * s..(b + 1) * s])
    }
}

/// Waits until every request completes, without holding a core: it polls MPI (which is what
/// moves the data) for a few microseconds, then yields its core between polls for
/// [`YIELDING`] (whatever else wants the core runs first), then sleeps between polls, growing
/// the nap to [`MAX_NAP`]. A blocking `MPI_Wait` busy-polls instead, and the ranks sharing a
/// machine's cores then take their compute's time: measured on 8 ranks over 2 cores, a system
/// CPU share of 68% and step times 1.5x longer than with this wait. Yielding for 2 ms cost
/// training nothing measurable there and brings messages of 1-4 MiB to the speed of MPI's own
/// calls (sleeping at once left them at 0.3-0.9 of it); yielding for 50 ms made hier3 steps
/// 1.15x longer.
fn complete(requests: &mut [ffi::MPI_Request]) {
    precise_sleeps();
    let start = Instant::now();
    let mut nap = MIN_NAP;
    loop {
        let mut flag = 0;
        // SAFETY: every request is a live request (or MPI_REQUEST_NULL) of this process.
        unsafe {
            ffi::MPI_Testall(
                requests.len() as i32,
                requests.as_mut_ptr(),
                &mut flag,
                ffi::RSMPI_STATUSES_IGNORE,
            );
        }
        if flag != 0 {
            return;
        }
        let waited = start.elapsed();
        if waited < SPIN {
            std::hint::spin_loop();
            continue;
        }
        if waited < YIELDING {
            // Other threads and ranks sharing this core run first; the poll comes back as
            // soon as none wants the core.
            std::thread::yield_now();
            continue;
        }
        std::thread::sleep(nap);
        // A nap never overshoots the wait by more than an eighth of it so far: transfers
        // over shared memory progress only while a rank polls.
        nap = (nap * 2)
            .min(MAX_NAP)
            .min((start.elapsed() / 8).max(MIN_NAP));
    }
}

/// Lets this thread's sleeps end when they are due: Linux lets a sleep run 50 us late by
/// default (the thread's timer slack), more than a nap of [`complete`] itself.
fn precise_sleeps() {
    thread_local! {
        static SET: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    }
    SET.with(|set| {
        if !set.get() {
            #[cfg(target_os = "linux")]
            // SAFETY: PR_SET_TIMERSLACK takes a number of nanoseconds and affects this thread
            // only; a refusal leaves the slack as it was.
            unsafe {
                libc::prctl(libc::PR_SET_TIMERSLACK, 1_000 as libc::c_ulong);
            }
            set.set(true);
        }
    });
}

/// How long [`complete`] polls without sleeping: long enough for a small message on shared
/// memory.
const SPIN: Duration = Duration::from_micros(50);
/// How long [`complete`] polls between yields of its core before it sleeps between polls:
/// a message of a few MiB on shared memory.
const YIELDING: Duration = Duration::from_millis(2);
/// The first and the longest sleep between polls.
const MIN_NAP: Duration = Duration::from_micros(20);
const MAX_NAP: Duration = Duration::from_millis(1);
